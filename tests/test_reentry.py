"""On-device token re-entry (EngineConfig.async_scheduling, issue 38 deliverable 3), on CPU.

A stage's sampled ids stay on the device, where the next prelude (or CB's fused iteration) embeds them
(BatchState.tok); the host reads them after the next launch that is not a prelude. What these tests
pin down: the prelude after a coda is launched before the host has read that coda's ids (no read, and
placeholders in its upload); a stop found late (stop token, stop string) or an abort leaves every
output equal to the host path's and the reference decoder's, and frees every block; host-only rows
(seeded draws, teacher forcing, top log-probs) fall back to the host path; nothing a caller reads
shows a placeholder. The engine-vs-reference grids of test_engine.py, test_gpu_discipline.py (graph
replay) and the rest run with re-entry on (helpers.engine_settings)."""
import random

import pytest

from infer import LLM, EngineConfig, LLMEngine, SamplingParams
from infer.engine.host_syncs import HostSyncs
from infer.engine.sequence import Stage
from looplm import ParamError

from helpers import ARCHS, assert_same, engine_settings, model, random_requests, reference, run_staggered, stable_seed, triples


def _engine(arch, mode, layout="last_exited", lookahead=False, reentry=True, **kw):
    return LLMEngine(model(arch), EngineConfig(**{"max_batch_size": 4, "max_num_batched_tokens": 16,
                                                  "kv_cache_tokens": 512,
                                                  **engine_settings(mode, layout, lookahead, async_scheduling=reentry),
                                                  **kw}))


def _stops(arch, seed):
    """Stop ids that the reference's outputs hit often: some requests stop early, one launch late."""
    outs = reference(arch, "last_exited", False, False, seed)
    seen = {}
    for r in outs:
        for t in r.token_ids[1:]:
            seen[t] = seen.get(t, 0) + 1
    return sorted(seen, key=lambda t: -seen[t])[:2]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("mode", ["cb", "norefill", "refill_k1", "refill_k4"])
def test_a_stop_found_late_changes_nothing(arch, mode):
    """Stop tokens met in the middle of generation: with re-entry the stopping sequence has already
    joined the next prelude (CB: fused iteration) and core step when its id is read; that work is
    discarded. Tokens, exit depths and finish reasons equal the host path's, log-probs to 1e-9 (float64
    rounding of other batch sizes), blocks all come back, and some requests did stop early."""
    seed = stable_seed("late-stop", arch, mode)
    print("seed", seed)
    reqs = random_requests(seed % 4, n=6, max_new=(4, 12))
    stops = _stops(arch, seed % 4)
    runs = {}
    for reentry in (False, True):
        eng = _engine(arch, mode, reentry=reentry)
        seqs = run_staggered(eng, reqs, seed, ignore_eos=False, stop_token_ids=stops)
        assert eng.blocks.all_free and not eng.has_unfinished()
        runs[reentry] = (triples(seqs), [s.finish_reason for s in seqs])
    assert_same(runs[False][0], runs[True][0])  # (log-probs to 1e-9: the batches differ by the late ones)
    assert runs[True][1] == runs[False][1]
    assert "stop" in runs[True][1], "no request stopped on a stop token: the test checks nothing late"


@pytest.mark.parametrize("arch", ARCHS)
def test_the_next_prelude_is_launched_before_the_ids_are_read(arch):
    """Under CDB refill the prelude right after a coda embeds that coda's ids from the device: its
    upload carries placeholders (-1) for them, and no device -> host read happens in the coda's step or
    the prelude's; the ids are read in the next step (one read). Without re-entry the coda's step reads
    them (the test's control)."""
    for reentry in (False, True):
        eng = _engine(arch, "refill_k1", reentry=reentry, exit_criterion="none", full_depth=True)
        uploads = []
        real = eng.runner.batch_state.upload

        def upload(seqs, tokens=False, context=True, riders=None):
            if tokens:
                uploads.append([s.output_ids[-1] for s in seqs])
            return real(seqs, tokens, context, riders)
        eng.runner.batch_state.upload = upload
        for p, n in random_requests(5, n=3, max_new=(6, 8)):
            eng.add_request(p, SamplingParams(max_tokens=n, ignore_eos=True))
        reads, stages = [], []  # per step: host reads, the stage it launched
        while eng.has_unfinished():
            with HostSyncs() as h:
                eng.step()
            stages.append(eng.scheduler.last_stage)
            reads.append(len(h.events))
        codas = [i for i, st in enumerate(stages) if st is Stage.CODA and i + 1 < len(stages)]
        assert codas
        for i in codas:
            if stages[i + 1] is Stage.PRELUDE:
                if reentry:
                    assert reads[i] == 0 and reads[i + 1] == 0, (i, reads[i:i + 3])
                else:
                    assert reads[i] >= 1
        placeholders = sum(t == -1 for u in uploads for t in u)
        assert (placeholders > 0) == reentry, placeholders


@pytest.mark.parametrize("arch", ARCHS)
def test_aborts_while_an_id_is_on_the_device(arch):
    """A request aborted while its last id is on the device (Sequence.unread_ids) ends with finish
    reason 'abort' and tokens that are a prefix of the reference's; every other request equals the
    reference, and every block comes back."""
    seed = stable_seed("abort", arch)
    refs = reference(arch, "last_exited", False, False, seed % 4)
    eng = _engine(arch, "refill_k1")
    seqs = [eng.add_request(p, SamplingParams(max_tokens=n, ignore_eos=True, logprobs=True))
            for p, n in random_requests(seed % 4)]
    victim = None
    for _ in range(10000):
        if not eng.has_unfinished():
            break
        eng.step()
        if victim is None:
            victim = next((s for s in seqs if s.unread_ids and len(s.output_ids) >= 2 and not s.finished), None)
            if victim is not None:
                eng.abort(victim.request_id)
    assert victim is not None and victim.finish_reason == "abort" and victim.unread_ids == 0
    assert eng.blocks.all_free
    for s, r in zip(seqs, refs):
        if s is victim:
            assert s.output_ids == r.token_ids[:len(s.output_ids)]
        else:
            assert (s.output_ids, s.exit_depths) == (r.token_ids, r.exit_depths)


@pytest.mark.parametrize("arch", ARCHS)
def test_host_rows_and_sampling_under_reentry(arch):
    """Unseeded sampling is drawn on the device (the same generator calls as the host path: equal
    tokens); a seeded request, a teacher-forced one and one asking for top log-probs make the stages
    they are in take the host path. Every output equals the run without re-entry."""
    seed = stable_seed("host-rows", arch)
    reqs = random_requests(seed, n=6, max_new=(3, 9))
    params = [dict(temperature=0.8, top_k=20), dict(temperature=0.7, seed=11), dict(logprobs=True, top_logprobs=2),
              {}, dict(temperature=1.0, top_p=0.9), dict(logprobs=True)]
    runs = {}
    for reentry in (False, True):
        eng = _engine(arch, "refill_k1", reentry=reentry, seed=7)
        seqs = [eng.add_request(p, SamplingParams(max_tokens=n, ignore_eos=True, **kw)) for (p, n), kw in zip(reqs, params)]
        forced = eng.add_request([3, 4, 5], forced_output=[7, 8, 9, 10])
        while eng.has_unfinished():
            eng.step()
        runs[reentry] = [(s.output_ids, s.exit_depths, s.logprobs, s.top_logprobs) for s in seqs + [forced]]
    assert runs[True] == runs[False]


def test_swapped_out_while_an_id_is_unread():
    """A pool too small for the batch: sequences are preempted (swapped out) right after a coda, with
    their next token still on the device, and come back in other slots; the token travels with the
    slot's state. Outputs equal the reference decoder's."""
    arch, seed = "huginn-tiny", 5
    refs = reference(arch, "last_exited", False, False, seed, n=5, prompt_len=(2, 8), max_new=(6, 12))
    eng = LLMEngine(model(arch), EngineConfig(max_batch_size=8, block_size=4, kv_cache_tokens=28, watermark=0.0,
                                              **engine_settings("refill_k1", "last_exited", False)))
    seqs = run_staggered(eng, random_requests(seed, n=5, prompt_len=(2, 8), max_new=(6, 12)), seed)
    assert eng.memory_metrics()["preemptions"] > 0
    for s, r in zip(seqs, refs):
        assert (s.output_ids, s.exit_depths) == (r.token_ids, r.exit_depths)
        assert max(abs(a - b) for a, b in zip(s.logprobs, r.logprobs)) < 1e-10


def test_outputs_never_show_a_placeholder_and_stop_strings_hold():
    """Through LLM with a tokenizer: stop strings (found one launch late) cut the text as on the host
    path; RequestOutputs after each step show only ids the host has read."""
    prompts = ["The history of", "Once upon a time", "In 1900", "A list of"]
    outs = {}
    for reentry in (False, True):
        llm = LLM("checkpoints/ouro-demo", async_scheduling=reentry, max_batch_size=4)
        sp = SamplingParams(max_tokens=24, stop=[" the", "."], temperature=0.0)
        outs[reentry] = [(o.token_ids, o.exit_depths, o.text, o.finish_reason) for o in llm.generate(prompts, sp)]
        eng = llm.engine
        seqs = [eng.add_request(p, SamplingParams(max_tokens=8)) for p in prompts]
        while eng.has_unfinished():
            for s in eng.step():
                assert -1 not in eng.output(s).token_ids
        assert all(-1 not in s.output_ids for s in seqs)
    assert outs[True] == outs[False]
    assert any(r == "stop" for *_, r in outs[True])


def test_reentry_with_speculation_is_refused():
    with pytest.raises(ParamError, match="async_scheduling"):
        EngineConfig(async_scheduling=True, speculative_tokens=2)
    assert EngineConfig(speculative_tokens=2).resolve(model("ouro-tiny").cfg, "cpu").async_scheduling is False

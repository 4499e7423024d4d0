"""Prefill riding on the decode stages (infer/engine/chunks.py, mixed.py): mixed launches and chunked
prompts give the whole-prefill numbers (tokens, exit depths, log-probs) in float64, against the
reference decoder and the separate-prefill engine, for every policy x layout (chunking only where
exact) x lookahead x batch size, with staggered arrivals and prompts longer than the token budget;
plus the admission rule (budget, FIFO), the shared-layout refusal, prompt log-probs and aborts."""
import random

import pytest

from infer import EngineConfig, LLMEngine, SamplingParams
from looplm import ParamError

from helpers import ARCHS, MODES, THRESHOLD, engine_settings, grid, model, random_requests, reference, \
    run_staggered, stable_seed

BUDGET = 12  # tokens per launch: most prompts below are longer, so they are chunked
SHAPE = dict(prompt_len=(1, 40), max_new=(1, 8))  # prompts of 1..40 tokens (most longer than BUDGET)
CASES = grid(MODES, archs=ARCHS)


def outputs(eng, reqs, seed):
    """Staggered arrivals (join 0.3, bursts of 1..3), log-probs on; RequestOutputs in input order."""
    return [eng.output(s) for s in run_staggered(eng, reqs, seed, join=0.3)]


@pytest.mark.parametrize("arch,mode,layout,lookahead", CASES)
@pytest.mark.parametrize("max_batch", [2, 8])
def test_mixed_prefill_equals_reference(arch, mode, layout, lookahead, max_batch):
    seed = stable_seed("prefill", arch, mode, layout, lookahead, max_batch)
    print(f"arrival seed {seed}, workload seed {seed % 3}")
    full = mode == "cb" or layout == "full_depth"
    refs = reference(arch, layout, lookahead, full, seed % 3, **SHAPE)
    pipeline = lookahead and mode != "cb" and max_batch == 8
    cfg = EngineConfig(max_batch_size=max_batch, max_num_batched_tokens=BUDGET, kv_cache_tokens=1024, trace=True,
                       **engine_settings(mode, layout, lookahead, pipeline=pipeline))
    eng = LLMEngine(model(arch), cfg)
    outs = outputs(eng, random_requests(seed % 3, **SHAPE), seed)
    for i, (o, r) in enumerate(zip(outs, refs)):
        assert o.token_ids == r.token_ids, f"request {i}"
        assert o.exit_depths == r.exit_depths, f"request {i}"
        assert o.logprobs == pytest.approx(r.logprobs, abs=1e-9, rel=0), f"request {i}"
    assert eng.blocks.all_free
    assert "prefill" not in eng.stats["stage_calls"]  # no separate prefill launch
    chunked = [row for row in eng.trace if row["prompt_tokens"]]
    assert chunked, "no prompt rode in a decode launch"
    if layout != "shared":  # prompts longer than the budget were split; shared keeps them whole
        assert cfg.chunked_prefill is None and eng.config.chunked_prefill
        longest = max(len(p) for p, _ in random_requests(seed % 3, **SHAPE))
        assert max(row["prompt_tokens"] for row in chunked) < longest


@pytest.mark.parametrize("arch", ARCHS)
def test_mixed_equals_separate_with_logprobs(arch):
    """The same requests, mixed + chunked vs separate whole-prompt prefill: identical tokens and
    depths, log-probs and prompt log-probs (echo) within float64 rounding."""
    print("seed 7")
    reqs = random_requests(7, n=5, prompt_len=(20, 60), max_new=(2, 6))
    outs = {}
    for prefill in ("mixed", "separate"):
        eng = LLMEngine(model(arch), EngineConfig(prefill=prefill, max_num_batched_tokens=16, max_batch_size=4,
                                                  exit_threshold=THRESHOLD, kv_cache_tokens=1024))
        seqs = [eng.add_request(p, SamplingParams(max_tokens=n, ignore_eos=True, logprobs=True, prompt_logprobs=2))
                for p, n in reqs]
        while eng.has_unfinished():
            eng.step()
        outs[prefill] = seqs
    for a, b in zip(outs["mixed"], outs["separate"]):
        assert a.output_ids == b.output_ids and a.exit_depths == b.exit_depths
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-9, rel=0)
        assert a.prompt_logprobs[0] is None and len(a.prompt_logprobs) == len(a.prompt_ids)
        assert a.prompt_logprobs[1:] == pytest.approx(b.prompt_logprobs[1:], abs=1e-9, rel=0)


def test_budget_and_fifo():
    """Every launch that mixes decode items and prompt tokens holds at most the budget; prompts are
    admitted in arrival order (a short prompt may still get its first token before a long one)."""
    m = model("ouro-tiny")
    rng = random.Random(11)
    print("seed 11")
    eng = LLMEngine(m, EngineConfig(max_num_batched_tokens=24, max_batch_size=6, exit_threshold=THRESHOLD,
                                    kv_cache_tokens=2048, trace=True))
    seqs = [eng.add_request([rng.randrange(1, 256) for _ in range(rng.randint(1, 70))],
                            SamplingParams(max_tokens=rng.randint(1, 10), ignore_eos=True)) for _ in range(12)]
    admitted = []  # (step of admission, seq_id)
    step = 0
    while eng.has_unfinished():
        eng.step()
        step += 1
        admitted += [(step, s.seq_id) for s in seqs if s.started and s.seq_id not in {i for _, i in admitted}]
    assert all(s.finished for s in seqs)
    assert [i for _, i in sorted(admitted)] == sorted(s.seq_id for s in seqs)
    over = [r for r in eng.trace if r["batch"] + r["prompt_tokens"] > 24 and r["batch"] and r["prompt_tokens"]]
    assert not over, over[:3]


def test_the_old_budget_name_is_refused_with_the_new_one():
    """The budget counts a launch's decode items too, so it is vLLM's max_num_batched_tokens; its old
    name fails with the new one, before anything loads."""
    with pytest.raises(ParamError, match="max_prefill_tokens is now max_num_batched_tokens"):
        EngineConfig.from_kwargs({"max_prefill_tokens": 64})
    assert EngineConfig.from_kwargs({"max_num_batched_tokens": 64}).max_num_batched_tokens == 64


def test_shared_refuses_explicit_chunking():
    with pytest.raises(ParamError, match="not exact with kv_layout='shared'") as e:
        EngineConfig(kv_layout="shared", chunked_prefill=True)
    assert e.value.param == "chunked_prefill"
    # a checkpoint that names the shared layout: refused when resolved
    cfg = EngineConfig(chunked_prefill=True)
    m = model("ouro-tiny")
    with pytest.raises(ParamError, match="chunked_prefill"):
        LLMEngine(m, EngineConfig(chunked_prefill=True, kv_layout="shared"))
    assert cfg.resolve(m.cfg).chunked_prefill
    assert not EngineConfig(kv_layout="shared").resolve(m.cfg).chunked_prefill
    with pytest.raises(ParamError, match="prefill"):
        EngineConfig(prefill="chunky")
    with pytest.raises(ParamError, match="needs prefill='mixed'"):
        EngineConfig(prefill="separate", chunked_prefill=True)


def test_abort_mid_prompt_frees_memory():
    m = model("huginn-tiny")
    eng = LLMEngine(m, EngineConfig(max_num_batched_tokens=8, max_batch_size=4, exit_threshold=THRESHOLD,
                                    kv_cache_tokens=512))
    a = eng.add_request(list(range(1, 60)), SamplingParams(max_tokens=4, ignore_eos=True))
    b = eng.add_request(list(range(1, 9)), SamplingParams(max_tokens=4, ignore_eos=True))
    for _ in range(3):
        eng.step()
    assert a.chunk is not None or a.prefilled > 0  # in the middle of its prompt
    eng.abort(a.request_id)
    while eng.has_unfinished():
        eng.step()
    assert a.finish_reason == "abort" and b.finish_reason == "length"
    assert eng.blocks.all_free


@pytest.mark.parametrize("mode", ["cb", "norefill", "refill_k1"])
def test_preemption_with_chunks_is_exact(mode):
    """A pool of 12 blocks x 4 tokens, prompts longer than the budget: decode items are swapped out
    and back while other prompts are mid-chunk; outputs equal an ample pool's (float64)."""
    arch = "ouro-tiny" if mode == "norefill" else "huginn-tiny"
    print("seed 5", arch)
    reqs = random_requests(5, n=6, prompt_len=(6, 20), max_new=(6, 12))
    base = dict(max_batch_size=8, exit_threshold=THRESHOLD, block_size=4, max_num_batched_tokens=12, **MODES[mode])
    outs = []
    for pool in (1024, 48):
        eng = LLMEngine(model(arch), EngineConfig(kv_cache_tokens=pool, watermark=0.0, **base))
        outs.append((outputs(eng, reqs, 5), eng.metrics()))
        assert eng.blocks.all_free
    (want, m0), (got, m) = outs
    assert m0["preemptions"] == 0 and m["preemptions"] >= 1, m
    for a, b in zip(want, got):
        assert a.token_ids == b.token_ids and a.exit_depths == b.exit_depths
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-9, rel=0)

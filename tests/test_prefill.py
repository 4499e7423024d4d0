"""Prefill riding on the decode stages (infer/engine/chunks.py, mixed.py): mixed launches and chunked
prompts give the whole-prefill numbers (tokens, exit depths, log-probs) in float64, against the
reference decoder and the separate-prefill engine, for every policy x layout (chunking only where
exact) x lookahead x batch size, with staggered arrivals and prompts longer than the token budget;
plus the admission rule (budget, FIFO), the shared-layout refusal, prompt log-probs and aborts."""
import functools
import itertools
import random
import zlib

import pytest
import torch

from infer import EngineConfig, LLMEngine, SamplingParams
from infer.engine.reference import reference_generate
from looplm import ExitPolicy, ParamError, tiny_model

ARCHS = ["ouro-tiny", "huginn-tiny"]
MODES = {"cb": dict(policy="cb"), "norefill": dict(policy="cdb", refill=False),
         "refill_k1": dict(policy="cdb", refill=True, min_coda_batch=1),
         "refill_k4": dict(policy="cdb", refill=True, min_coda_batch=4)}
LAYOUTS = ["last_exited", "shared", "full_depth"]
THRESHOLD = 0.55
BUDGET = 12  # tokens per launch: most prompts below are longer, so they are chunked


@functools.lru_cache(maxsize=None)
def model(arch):
    return tiny_model(arch, dtype=torch.float64, std=0.15, seed=3)


def workload(seed, n=6):
    """Prompts of 1..40 tokens (most longer than BUDGET), 1..8 new tokens."""
    rng = random.Random(seed)
    return [([rng.randrange(1, 256) for _ in range(rng.randint(1, 40))], rng.randint(1, 8)) for _ in range(n)]


@functools.lru_cache(maxsize=None)
def reference(arch, layout, lookahead, full, seed):
    m = model(arch)
    pol = ExitPolicy.from_config(m.cfg, threshold=THRESHOLD, lookahead=lookahead, full_depth=full)
    return [reference_generate(m, p, n, pol, kv_layout=layout) for p, n in workload(seed)]


def run_staggered(engine, reqs, seed):
    rng = random.Random(seed)
    pending, seqs, steps = list(enumerate(reqs)), {}, 0
    while pending or engine.has_unfinished():
        if pending and (not engine.has_unfinished() or rng.random() < 0.3):
            for _ in range(rng.randint(1, 3)):
                if pending:
                    i, (p, n) = pending.pop(0)
                    seqs[i] = engine.add_request(p, SamplingParams(max_tokens=n, ignore_eos=True, logprobs=True))
        engine.step()
        steps += 1
        assert steps < 10000, "engine made no progress"
    return [engine.output(seqs[i]) for i in range(len(reqs))]


CASES = [(a, m, lay, la) for a, m, lay, la in itertools.product(ARCHS, MODES, LAYOUTS, [False, True])
         if not (m == "cb" and (la or lay == "full_depth")) and not (lay == "full_depth" and la)]


@pytest.mark.parametrize("arch,mode,layout,lookahead", CASES)
@pytest.mark.parametrize("max_batch", [2, 8])
def test_mixed_prefill_equals_reference(arch, mode, layout, lookahead, max_batch):
    seed = zlib.crc32(f"prefill/{arch}/{mode}/{layout}/{lookahead}/{max_batch}".encode()) % 1000
    print(f"arrival seed {seed}, workload seed {seed % 3}")
    full = mode == "cb" or layout == "full_depth"
    refs = reference(arch, layout, lookahead, full, seed % 3)
    pipeline = lookahead and mode != "cb" and max_batch == 8
    cfg = EngineConfig(kv_layout=layout, max_batch_size=max_batch, exit_threshold=THRESHOLD, lookahead=lookahead,
                       max_prefill_tokens=BUDGET, kv_cache_tokens=1024, pipeline=pipeline, trace=True,
                       **MODES[mode])
    eng = LLMEngine(model(arch), cfg)
    outs = run_staggered(eng, workload(seed % 3), seed)
    for i, (o, r) in enumerate(zip(outs, refs)):
        assert o.token_ids == r.token_ids, f"request {i}"
        assert o.exit_depths == r.exit_depths, f"request {i}"
        assert o.logprobs == pytest.approx(r.logprobs, abs=1e-9, rel=0), f"request {i}"
    assert eng.blocks.all_free
    assert "prefill" not in eng.stats["stage_calls"]  # no separate prefill launch
    chunked = [row for row in eng.trace if row["prompt_tokens"]]
    assert chunked, "no prompt rode in a decode launch"
    if layout != "shared":  # prompts longer than the budget were split; shared keeps them whole
        assert cfg.chunked_prefill is None and eng.config.chunked_prefill_enabled
        longest = max(len(p) for p, _ in workload(seed % 3))
        assert max(row["prompt_tokens"] for row in chunked) < longest


@pytest.mark.parametrize("arch", ARCHS)
def test_mixed_equals_separate_with_logprobs(arch):
    """The same requests, mixed + chunked vs separate whole-prompt prefill: identical tokens and
    depths, log-probs and prompt log-probs (echo) within float64 rounding."""
    rng = random.Random(7)
    print("seed 7")
    reqs = [([rng.randrange(1, 256) for _ in range(rng.randint(20, 60))], rng.randint(2, 6)) for _ in range(5)]
    outs = {}
    for prefill in ("mixed", "separate"):
        eng = LLMEngine(model(arch), EngineConfig(prefill=prefill, max_prefill_tokens=16, max_batch_size=4,
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
    eng = LLMEngine(m, EngineConfig(max_prefill_tokens=24, max_batch_size=6, exit_threshold=THRESHOLD,
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


def test_shared_refuses_explicit_chunking():
    with pytest.raises(ParamError, match="not exact with kv_layout='shared'") as e:
        EngineConfig(kv_layout="shared", chunked_prefill=True)
    assert e.value.param == "chunked_prefill"
    # a checkpoint that names the shared layout: refused when resolved
    cfg = EngineConfig(chunked_prefill=True)
    m = model("ouro-tiny")
    with pytest.raises(ParamError, match="chunked_prefill"):
        LLMEngine(m, EngineConfig(chunked_prefill=True, kv_layout="shared"))
    assert cfg.chunked_prefill_enabled
    assert not EngineConfig(kv_layout="shared").chunked_prefill_enabled
    with pytest.raises(ParamError, match="prefill"):
        EngineConfig(prefill="chunky")
    with pytest.raises(ParamError, match="needs prefill='mixed'"):
        EngineConfig(prefill="separate", chunked_prefill=True)


def test_abort_mid_prompt_frees_memory():
    m = model("huginn-tiny")
    eng = LLMEngine(m, EngineConfig(max_prefill_tokens=8, max_batch_size=4, exit_threshold=THRESHOLD,
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
    rng = random.Random(5)
    print("seed 5", arch)
    reqs = [([rng.randrange(1, 256) for _ in range(rng.randint(6, 20))], rng.randint(6, 12)) for _ in range(6)]
    base = dict(max_batch_size=8, exit_threshold=THRESHOLD, block_size=4, max_prefill_tokens=12, **MODES[mode])
    outs = []
    for pool in (1024, 48):
        eng = LLMEngine(model(arch), EngineConfig(kv_cache_tokens=pool, watermark=0.0, **base))
        outs.append((run_staggered(eng, reqs, 5), eng.metrics()))
        assert eng.blocks.all_free
    (want, m0), (got, m) = outs
    assert m0["preemptions"] == 0 and m["preemptions"] >= 1, m
    for a, b in zip(want, got):
        assert a.token_ids == b.token_ids and a.exit_depths == b.exit_depths
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-9, rel=0)

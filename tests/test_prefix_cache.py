"""Prefix caching (block_manager.py, chunks.py): requests whose prompts share leading full blocks
reuse their K/V and prefill only the suffix. Exact for the depth-indexed layouts: tokens, exit
depths and log-probs (float64, |diff| < 1e-9) equal the engine without caching (and the reference
decoder) for every policy x layout x lookahead with staggered arrivals, with preemption and with
eviction; the scheduler's bookkeeping (reference counts, the cache map, FIFO, no leak, no
deadlock) holds under thousands of random steps; the shared layout and separate prefill refuse."""
import itertools
import random

import pytest
import torch

from infer import EngineConfig, LLMEngine, SamplingParams
from infer.engine.block_manager import BlockManager
from infer.engine.reference import reference_generate
from infer.engine.scheduler import Scheduler
from infer.serving.async_engine import AsyncEngine
from infer.serving.metrics import render_metrics
from looplm import ExitPolicy, ParamError, tiny_model

from helpers import MODES, THRESHOLD, ContentRunner, arrive_or_abort, assert_same, check_blocks, engine_settings, \
    exits_vary, fake_postprocess, \
    grid, model, policy, run_staggered, stable_seed, triples

BASE = dict(block_size=4, max_num_batched_tokens=12, max_batch_size=8, exit_threshold=THRESHOLD)


def shared_prefix_workload(seed, n=10, max_new=(3, 7)):
    """Prompts that share long prefixes (2-4 blocks of 4): a few system prompts, each request one
    of them + 0..5 tokens; some prompts repeat exactly, one is a prefix of another."""
    rng = random.Random(seed)
    heads = [[rng.randrange(1, 256) for _ in range(rng.randint(9, 16))] for _ in range(3)]
    reqs = []
    for i in range(n):
        if i >= 2 and rng.random() < 0.25:
            p = list(reqs[rng.randrange(len(reqs))][0])  # the same prompt again
        else:
            p = rng.choice(heads) + [rng.randrange(1, 256) for _ in range(rng.randint(0, 5))]
        reqs.append((p, rng.randint(*max_new)))
    reqs.append((reqs[0][0] + [7, 8, 9, 10, 11], 4))  # an earlier prompt is a prefix of this one
    return reqs


def run(eng, reqs, seed, **params):
    """Staggered arrivals (seeded); returns (tokens, depths, logprobs) per request, input order."""
    return triples(run_staggered(eng, reqs, seed, join=0.25, burst=2, **params))


CASES = grid(MODES, ["last_exited", "full_depth"])


@pytest.mark.parametrize("mode,layout,lookahead", CASES)
def test_prefix_caching_on_equals_off(mode, layout, lookahead):
    seed = stable_seed("prefix", mode, layout, lookahead)
    arch = "huginn-tiny" if seed % 2 else "ouro-tiny"
    print("seed", seed, arch)
    reqs = shared_prefix_workload(seed)
    base = dict(BASE, kv_cache_tokens=1024, **engine_settings(mode, layout, lookahead))
    off = LLMEngine(model(arch), EngineConfig(enable_prefix_caching=False, **base))
    on = LLMEngine(model(arch), EngineConfig(**base))  # on by default here
    want, got = run(off, reqs, seed), run(on, reqs, seed)
    m = on.metrics()
    assert off.metrics()["prefix_cache_hits"] == 0 and m["prefix_cache_hits"] >= 8, m  # not vacuous
    assert_same(want, got)
    assert on.blocks.all_free and off.blocks.all_free
    if mode in ("cb", "refill_k1"):  # and both equal the sequential reference decoder
        full = mode == "cb" or layout == "full_depth"
        pol = policy(arch, lookahead, full)
        for (p, n), (t, d, lp) in zip(reqs, got):
            r = reference_generate(model(arch), p, n, pol, kv_layout=layout)
            assert t == r.token_ids and d == r.exit_depths
            assert lp == pytest.approx(r.logprobs, abs=1e-9, rel=0)
    if layout != "full_depth" and mode != "cb":
        assert exits_vary(want, 2)  # exits really vary


def test_hit_is_capped_and_only_the_suffix_is_prefilled():
    """An identical 12-token prompt hits 2 of its 3 blocks (one position must be computed for the
    first token); a 13-token prompt with the same head hits all 3; each prefills only the rest."""
    eng = LLMEngine(model("ouro-tiny"), EngineConfig(**BASE, kv_cache_tokens=256, trace=True))
    p = list(range(20, 32))
    for prompt, hits in ((p, 0), (p, 8), (p + [5], 12)):
        before, rows = eng.metrics()["prefix_cache_hits"], len(eng.trace)
        s = eng.add_request(prompt, SamplingParams(max_tokens=2, ignore_eos=True))
        while eng.has_unfinished():
            eng.step()
        assert eng.metrics()["prefix_cache_hits"] - before == hits
        assert sum(r["prompt_tokens"] for r in eng.trace[rows:] if r["stage"] == "prelude") == len(prompt) - hits
        assert len(s.output_ids) == 2
    m = eng.metrics()
    assert m["prefix_cache_queries"] == 12 + 12 + 13
    assert m["prefix_cache_hit_rate"] == pytest.approx(20 / 37)
    assert m["prefix_cache_blocks"] == 3 and eng.blocks.all_free  # cached blocks count as free
    eng.reset_prefix_cache()  # forgotten: the same prompt again finds nothing
    eng.add_request(p + [5], SamplingParams(max_tokens=2))
    while eng.has_unfinished():
        eng.step()
    assert eng.metrics()["prefix_cache_hits"] == m["prefix_cache_hits"] and eng.blocks.all_free


@pytest.mark.parametrize("mode,lookahead", [("cb", False), ("norefill", False), ("refill_k1", False),
                                            ("refill_k4", True)])
def test_prefix_caching_with_preemption_is_exact(mode, lookahead):
    """A pool of 11 blocks x 4 tokens: requests are swapped out and back (shared blocks stay with
    their other holders) while others hit the cache; outputs equal an ample pool without caching."""
    seed = stable_seed("prefix-swap", mode)
    arch = "ouro-tiny" if mode == "norefill" else "huginn-tiny"
    print("seed", seed, arch)
    reqs = shared_prefix_workload(seed, n=8, max_new=(6, 12))
    base = dict(BASE, lookahead=lookahead, pipeline=lookahead, watermark=0.0, **MODES[mode])
    want = run(LLMEngine(model(arch), EngineConfig(kv_cache_tokens=1024, enable_prefix_caching=False, **base)),
               reqs, seed)
    eng = LLMEngine(model(arch), EngineConfig(kv_cache_tokens=44, **base))
    got = run(eng, reqs, seed)
    m = eng.metrics()
    assert m["preemptions"] >= 1 and m["prefix_cache_hits"] > 0, m
    assert m["swapped_in_blocks"] == m["swapped_out_blocks"]
    assert_same(want, got)
    assert eng.blocks.all_free and not eng.runner.host_swap


def test_paged_decode_attention_reads_shared_blocks():
    """Paged decode attention (block tables + an inverse page table, eager FlexAttention on CPU):
    a shared block sits at the same logical index in every table that holds it (its hash encodes
    its position), so the page table stays valid; outputs equal the gather path without caching."""
    seed = 17
    print("seed", seed)
    reqs = shared_prefix_workload(seed, n=6)
    base = dict(BASE, policy="cdb", min_coda_batch=2, kv_cache_tokens=256)
    want = run(LLMEngine(model("ouro-tiny"), EngineConfig(enable_prefix_caching=False, **base)), reqs, seed)
    eng = LLMEngine(model("ouro-tiny"), EngineConfig(**base))
    eng.runner.enable_paged(compile=False)
    got = run(eng, reqs, seed)
    assert eng.metrics()["prefix_cache_hits"] > 0
    assert_same(want, got)


def test_eviction_is_exact():
    """Five system prompts of 3 blocks cycle through a 14-block pool: cached blocks are evicted
    (least recently used first) and later prompts recompute them; still exact."""
    rng = random.Random(21)
    print("seed 21")
    heads = [[rng.randrange(1, 256) for _ in range(12)] for _ in range(5)]
    reqs = [(heads[i % 5 if i < 10 else rng.randrange(5)] + [rng.randrange(1, 256)], 3) for i in range(16)]
    base = dict(BASE, policy="cdb", refill=True, max_batch_size=2)
    want = run(LLMEngine(model("huginn-tiny"), EngineConfig(kv_cache_tokens=1024, enable_prefix_caching=False,
                                                            **base)), reqs, 21)
    eng = LLMEngine(model("huginn-tiny"), EngineConfig(kv_cache_tokens=56, **base))
    got = run(eng, reqs, 21)
    m = eng.metrics()
    assert m["prefix_cache_evictions"] > 0 and m["prefix_cache_hits"] > 0, m
    assert_same(want, got)
    assert eng.blocks.all_free


def test_reserve_kv_with_prefix_caching_is_exact():
    """Up-front reservation takes prompt + max_tokens minus the hit blocks."""
    reqs = shared_prefix_workload(5, n=8)
    base = dict(BASE, reserve_kv=True, kv_cache_tokens=200)
    want = run(LLMEngine(model("ouro-tiny"), EngineConfig(enable_prefix_caching=False, **base)), reqs, 5)
    eng = LLMEngine(model("ouro-tiny"), EngineConfig(**base))
    got = run(eng, reqs, 5)
    assert eng.metrics()["prefix_cache_hits"] > 0 and eng.metrics()["preemptions"] == 0
    assert_same(want, got)
    assert eng.blocks.all_free


def test_echo_requests_get_no_hits_and_correct_prompt_logprobs():
    """A request that asks for prompt log-probs needs every position's logits: it never reads the
    cache (it may fill it); its prompt log-probs equal the separate whole-prompt prefill's."""
    m = model("ouro-tiny")
    p = list(range(40, 58))
    outs = {}
    for name, kw in (("separate", dict(prefill="separate")), ("mixed", {})):
        eng = LLMEngine(m, EngineConfig(**BASE, kv_cache_tokens=512, **kw))
        seqs = []
        for _ in range(3):  # one after another: the second and third could hit the first's blocks
            seqs.append(eng.add_request(p, SamplingParams(max_tokens=3, ignore_eos=True, logprobs=True,
                                                          prompt_logprobs=1)))
            while eng.has_unfinished():
                eng.step()
        outs[name] = (seqs, eng.metrics())
    (ref, _), (got, mm) = outs["separate"], outs["mixed"]
    assert mm["prefix_cache_hits"] == 0 and mm["prefix_cache_blocks"] == 4  # registered, never read
    for a, b in zip(ref, got):
        assert a.output_ids == b.output_ids and a.exit_depths == b.exit_depths
        assert b.prompt_logprobs[0] is None and len(b.prompt_logprobs) == len(p)
        assert b.prompt_logprobs[1:] == pytest.approx(a.prompt_logprobs[1:], abs=1e-9, rel=0)
    # a plain request after them does hit what they registered
    eng = LLMEngine(m, EngineConfig(**BASE, kv_cache_tokens=512))
    for params in (SamplingParams(max_tokens=2, prompt_logprobs=0), SamplingParams(max_tokens=2)):
        eng.add_request(p, params)
        while eng.has_unfinished():
            eng.step()
    assert eng.metrics()["prefix_cache_hits"] == 16


def test_shared_layout_would_not_be_exact(monkeypatch):
    """Why `shared` refuses: forced on (the check bypassed), the cached blocks hold each prefix
    position's final loop step, while the suffix's depth-major prefill without caching reads the
    prefix at the current step: the numbers differ."""
    import infer.engine.config as config
    monkeypatch.setattr(config, "check_prefix_caching", lambda *a: None)
    reqs = shared_prefix_workload(11)
    base = dict(BASE, kv_layout="shared", kv_cache_tokens=1024)
    want = run(LLMEngine(model("ouro-tiny"), EngineConfig(enable_prefix_caching=False, **base)), reqs, 11)
    eng = LLMEngine(model("ouro-tiny"), EngineConfig(enable_prefix_caching=True, **base))
    got = run(eng, reqs, 11)
    assert eng.metrics()["prefix_cache_hits"] > 0
    assert max(abs(a - b) for (_, _, l1), (_, _, l2) in zip(want, got) for a, b in zip(l1, l2)) > 1e-3


def test_settings_defaults_refusals_and_metrics():
    tiny = model("ouro-tiny").cfg
    assert EngineConfig().resolve(tiny).enable_prefix_caching  # last_exited, mixed prefill
    assert EngineConfig(kv_layout="full_depth").resolve(tiny).enable_prefix_caching
    assert not EngineConfig(kv_layout="shared").resolve(tiny).enable_prefix_caching
    assert not EngineConfig(prefill="separate").resolve(tiny).enable_prefix_caching
    assert not EngineConfig(enable_prefix_caching=False).resolve(tiny).enable_prefix_caching
    with pytest.raises(ParamError, match="not exact with kv_layout='shared'.*final loop step") as e:
        EngineConfig(kv_layout="shared", enable_prefix_caching=True)
    assert e.value.param == "enable_prefix_caching"
    with pytest.raises(ParamError, match="needs prefill='mixed'"):
        EngineConfig(prefill="separate", enable_prefix_caching=True)
    m = model("ouro-tiny")
    m_shared = tiny_model("ouro-tiny", dtype=torch.float64, kv_layout="shared")  # a checkpoint naming shared
    with pytest.raises(ParamError, match="enable_prefix_caching"):
        LLMEngine(m_shared, EngineConfig(enable_prefix_caching=True))
    assert not LLMEngine(m_shared, EngineConfig()).config.enable_prefix_caching
    eng = LLMEngine(m, EngineConfig(**BASE, kv_cache_tokens=256))
    assert eng.config.describe()["enable_prefix_caching"] is True
    for _ in range(2):
        eng.add_request(list(range(30, 39)), SamplingParams(max_tokens=2))
        while eng.has_unfinished():
            eng.step()
    aeng = AsyncEngine(eng)
    text = render_metrics(aeng, "tiny", {})
    assert "# TYPE cdb_prefix_cache_hits_total counter" in text
    assert 'cdb_prefix_cache_hits_total{model_name="tiny"} 8\n' in text
    assert 'cdb_prefix_cache_queries_total{model_name="tiny"} 18\n' in text
    assert 'cdb_prefix_cache_hit_rate{model_name="tiny"} 0.444444444\n' in text


# ------------------------------------------------------------------ scheduler alone (pure Python)
# (policy, refill, pipelined lookahead, max batch, reserve_kv) per seed
SCHED = [("cb", False, False, 8, False), ("cdb", False, True, 8, False), ("cdb", True, True, 8, False),
         ("cdb", True, False, 6, False), ("cb", False, False, 3, False), ("cdb", True, False, 8, True)]


@pytest.mark.parametrize("seed", range(len(SCHED)))
def test_scheduler_invariants_with_sharing(seed):
    """Thousands of scheduler steps (mixed prefill, prefix caching, a small pool, preemption,
    aborts, arrivals; prompts drawn from a few shared prefixes), checked after every step."""
    rng = random.Random(seed)
    policy, refill, pipelined, batch, reserve = SCHED[seed]
    print("seed", seed, SCHED[seed])
    tiny = tiny_model("ouro-tiny").cfg
    cfg = EngineConfig(policy=policy, refill=refill, min_coda_batch=rng.choice([1, 3]), max_batch_size=batch,
                       block_size=4, watermark=0.05, max_num_batched_tokens=rng.choice([6, 16]),
                       reserve_kv=reserve).resolve(tiny)
    bm = BlockManager(20, 4, cfg.max_batch_size)
    sch = Scheduler(cfg, bm, 64, pipeline=pipelined, swap_blocks=rng.choice([6, 64]), r_full=tiny.r_max)
    runner = ContentRunner(bm)
    pol = ExitPolicy.from_config(tiny, threshold=0.5, lookahead=pipelined)
    heads = [[rng.randrange(3, 256) for _ in range(rng.randint(4, 14))] for _ in range(3)]
    seqs, admitted, ids, steps, hashes_seen = [], [], itertools.count(), 0, set()
    prompt = lambda r: r.choice(heads)[:r.randint(1, 14)] + [r.randrange(3, 256) for _ in range(r.randint(0, 6))]  # noqa: E731
    while len(seqs) < 300 or sch.has_work():
        arrive_or_abort(sch, seqs, rng, 300, prompt, (1, 25), pol, ids)
        work = sch.schedule()
        runner.swap(sch.take_swaps())
        admitted += [s.seq_id for s in seqs if s.slot >= 0 and s.seq_id not in admitted]
        check_blocks(sch, bm)
        hashes_seen |= set(bm.by_hash)
        steps += 1
        assert steps < 100000, "deadlock"
        if work is None:
            continue
        runner.run(work)
        fake_postprocess(sch, work, rng, token=lambda r: r.randrange(3, 256))
        check_blocks(sch, bm)
    assert all(s.finished for s in seqs) and bm.all_free and not runner.host and not sch.swapped
    assert admitted == sorted(admitted)  # FIFO admission
    c = sch.counters
    print(steps, "steps", c, "evictions", bm.evictions)
    assert steps > 1000 and c["prefix_cache_hits"] > 0 and bm.evictions > 0 and len(hashes_seen) > len(bm.by_hash)
    assert c["preemptions"] > 0 or cfg.reserve_kv

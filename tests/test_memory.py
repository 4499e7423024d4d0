"""KV memory at real scale: the pool sized from a budget, blocks on demand, exact preemption by
swapping (outputs equal an ample pool's in float64 for every policy x layout x lookahead), the
scheduler's invariants under random load with aborts, and bad input."""
import functools
import itertools
import logging
import random

import pytest
import torch

from infer import EngineConfig, LLMEngine, SamplingParams
from infer.engine.block_manager import BlockManager
from infer.engine.memory import CPU_KV_MEMORY
from infer.engine.scheduler import Scheduler
from infer.engine.sequence import Sequence, Stage
from looplm import ExitPolicy, tiny_model
from looplm.model import LoopedLM

from staggered import run_staggered  # tests/staggered.py

MODES = {"cb": dict(policy="cb"), "norefill": dict(policy="cdb", refill=False),
         "refill_k1": dict(policy="cdb", refill=True, min_coda_batch=1),
         "refill_k4": dict(policy="cdb", refill=True, min_coda_batch=4)}
LAYOUTS = ["last_exited", "shared", "full_depth"]


@functools.lru_cache(maxsize=None)
def model(arch):
    return tiny_model(arch, dtype=torch.float64, std=0.15, seed=3)


def run(eng, reqs, seed):
    """Staggered arrivals (seeded); returns (tokens, depths, logprobs) per request in input order."""
    return run_staggered(eng, reqs, seed, join=0.4, burst=3)


CASES = [(m, lay, la) for m, lay, la in itertools.product(MODES, LAYOUTS, [False, True])
         if not (m == "cb" and (la or lay == "full_depth")) and not (lay == "full_depth" and la)]


@pytest.mark.parametrize("mode,layout,lookahead", CASES)
def test_preemption_is_exact(mode, layout, lookahead):
    """A pool of 5 blocks x 4 tokens: most requests are swapped out at least once (in every queue,
    mid-loop included); tokens, exit depths and log-probs equal an ample pool's."""
    arch = "huginn-tiny" if hash((mode, layout)) % 2 else "ouro-tiny"
    seed = sum(map(ord, mode + layout)) + lookahead
    print("seed", seed, arch)
    rng = random.Random(seed)
    reqs = [([rng.randrange(1, 256) for _ in range(rng.randint(2, 8))], rng.randint(5, 10)) for _ in range(5)]
    # separate prefill: whole prompts admitted in bursts make most requests swap (mixed prefill with
    # preemption: tests/test_prefill.py::test_preemption_with_chunks_is_exact)
    base = dict(kv_layout=layout, max_batch_size=8, exit_threshold=0.55, lookahead=lookahead, block_size=4,
                pipeline=lookahead and mode != "cb", prefill="separate", **MODES[mode])
    ample = LLMEngine(model(arch), EngineConfig(kv_cache_tokens=1024, **base))
    small = LLMEngine(model(arch), EngineConfig(kv_cache_tokens=20, watermark=0.0, **base))
    want, got = run(ample, reqs, seed), run(small, reqs, seed)
    m = small.metrics()
    assert ample.metrics()["preemptions"] == 0 and m["preemptions"] >= len(reqs) // 2, m
    assert m["swap_bytes"] > 0 and m["swapped_in_blocks"] == m["swapped_out_blocks"]
    for (t1, d1, l1), (t2, d2, l2) in zip(want, got):
        assert t1 == t2 and d1 == d2
        assert max(abs(a - b) for a, b in zip(l1, l2)) < 1e-9
    assert small.blocks.all_free and not small.runner.__dict__.get("_host_swap")
    if layout != "full_depth" and mode != "cb":
        assert len({d for _, ds, _ in want for d in ds[1:]}) >= 2  # exits really vary


def test_swap_space_full_waits_never_drops():
    """Host swap space of one block: sequences that need a block wait for others instead."""
    m = model("ouro-tiny")
    cfg = dict(max_batch_size=8, exit_threshold=0.55, block_size=4, kv_cache_tokens=24, watermark=0.0)
    rng = random.Random(7)
    reqs = [([rng.randrange(1, 256) for _ in range(rng.randint(2, 8))], rng.randint(6, 12)) for _ in range(6)]
    want = run(LLMEngine(m, EngineConfig(**{**cfg, "kv_cache_tokens": 1024})), reqs, 7)
    eng = LLMEngine(m, EngineConfig(**cfg, swap_space=1))
    got = run(eng, reqs, 7)
    m = eng.metrics()
    assert m["stalls"] + m["swap_overcommits"] > 0 and m["swapped_out_blocks"] <= m["swap_overcommits"] * 6
    assert [g[:2] for g in got] == [w[:2] for w in want]
    assert eng.blocks.all_free


@pytest.mark.parametrize("mode,prefill,paged", [("refill_k1", "separate", False), ("refill_k1", "mixed", True),
                                                 ("norefill", "mixed", False), ("cb", "separate", True)])
def test_device_block_tables_follow_the_scheduler(mode, prefill, paged):
    """The runner sends a block table once and then only what changes (`Work.changed`: admitted,
    swapped in, resumed; `Work.grown`: the new entries of a table that crossed into a block). Under
    preemption and growth, every item of every decode launch finds its whole table, its inverse page
    entries and its position on the device."""
    seed = sum(map(ord, mode + prefill)) + paged
    print("seed", seed)
    rng = random.Random(seed)
    reqs = [([rng.randrange(1, 256) for _ in range(rng.randint(2, 9))], rng.randint(6, 14)) for _ in range(7)]
    eng = LLMEngine(model("ouro-tiny"), EngineConfig(kv_cache_tokens=24, watermark=0.0, max_batch_size=8, block_size=4,
                                                     exit_threshold=0.55, prefill=prefill, **MODES[mode]))
    r = eng.runner
    if paged:
        r.enable_paged(compile=False)
    run_ = r.run
    checked = {"items": 0, "grown": 0}

    def checked_run(work):
        out = run_(work)
        checked["grown"] += len(work.grown)
        if work.stage is not Stage.PREFILL:
            for s in work.seqs:
                sl, n = s.slot, len(s.blocks)
                assert r._own[sl] is s and r._nblk[sl] == n and r.bt[sl, :n].tolist() == s.blocks, (work.stage, s)
                assert int(r.pos[sl]) == s.num_tokens - 1, (work.stage, s)
                if paged:
                    assert r.page_index[s.blocks].tolist() == list(range(n))
                checked["items"] += 1
        return out
    r.run = checked_run
    run(eng, reqs, seed)
    m = eng.metrics()
    assert checked["items"] > 50 and checked["grown"] > 5 and m["preemptions"] > 0, (checked, m)
    assert eng.blocks.all_free


def ouro_real_layers(max_position=65536) -> LoopedLM:
    """Ouro-1.4B's real layer / head counts (24 core layers, 16 KV heads, r_max 4, context 65536)
    with tiny hidden sizes."""
    return tiny_model("ouro-tiny", n_core=24, num_heads=16, num_kv_heads=16, head_dim=8, hidden_size=128,
                      intermediate_size=64, r_max=4, max_position=max_position)


def test_real_shapes_construct_with_defaults_within_budget(caplog):
    m = ouro_real_layers()
    with caplog.at_level(logging.WARNING, logger="infer.engine"):
        eng = LLMEngine(m, EngineConfig())
    nbytes = eng.runner.layout.nbytes()
    assert nbytes <= CPU_KV_MEMORY, nbytes
    assert eng.max_model_len < 65536 and eng.max_model_len == eng.blocks.num_blocks * eng.blocks.block_size
    warn = [r.getMessage() for r in caplog.records if "max_model_len" in r.getMessage()]
    assert len(warn) == 1 and "65536" in warn[0] and "kv_cache_memory" in warn[0]
    with pytest.raises(ValueError, match="does not fit the model's context"):
        eng.add_request([1] * eng.max_model_len)
    s = eng.add_request([1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True))
    while eng.has_unfinished():
        eng.step()
    assert len(s.output_ids) == 3 and eng.blocks.all_free
    small = LLMEngine(m, EngineConfig(kv_cache_memory=8 * 2**20))
    assert small.runner.layout.nbytes() <= 8 * 2**20


def test_budget_smaller_than_one_block_fails_naming_numbers():
    m = ouro_real_layers()
    with pytest.raises(ValueError, match=r"less than one block of 16 tokens x \d+ bytes") as e:
        LLMEngine(m, EngineConfig(kv_cache_memory=2**20))
    assert e.value.param == "kv_cache_memory"
    with pytest.raises(ValueError, match="kv_cache_tokens"):
        LLMEngine(m, EngineConfig(kv_cache_tokens=8))


def test_max_model_len_setting():
    m = model("ouro-tiny")
    eng = LLMEngine(m, EngineConfig(max_model_len=20, exit_threshold=0.55))
    with pytest.raises(ValueError, match="context of 20 tokens"):
        eng.add_request([1] * 20)
    s = eng.add_request([1] * 15, SamplingParams(max_tokens=30, ignore_eos=True))
    while eng.has_unfinished():
        eng.step()
    assert s.num_tokens == 20 and s.finish_reason == "length"
    with pytest.raises(ValueError, match="exceeds the checkpoint's context"):
        LLMEngine(m, EngineConfig(max_model_len=10**6))


# ------------------------------------------------------------------ scheduler alone (pure Python)
class FakeScores:
    def __init__(self, xs):
        self.xs = xs

    def get(self):
        return self.xs


@pytest.mark.parametrize("seed", range(4))
def test_scheduler_invariants_random_steps_with_aborts(seed):
    """Thousands of scheduler steps with a fake runner that checks ownership: no block or slot
    owned twice, swap ops consistent, FIFO admission, every request finishes, nothing leaks."""
    rng = random.Random(seed)
    print("seed", seed)
    cfg = EngineConfig(policy="cdb", refill=bool(seed % 2), min_coda_batch=rng.choice([1, 3]),
                       max_batch_size=rng.choice([3, 8]), block_size=4, watermark=0.05,
                       prefill="separate")  # this fake runner drives PREFILL work by hand (mixed: test_prefill.py)
    cfg = cfg.resolve(tiny_model("ouro-tiny").cfg)
    bm = BlockManager(16, 4, cfg.max_batch_size)
    sch = Scheduler(cfg, bm, 64, pipeline=bool(seed // 2), swap_blocks=rng.choice([4, 64]))
    pol = ExitPolicy.from_config(tiny_model("ouro-tiny").cfg, threshold=0.5, lookahead=bool(seed // 2))
    seqs, admitted, host, ids, steps = [], [], set(), itertools.count(), 0
    while len(seqs) < 120 or sch.has_work():
        if len(seqs) < 120 and rng.random() < 0.2:
            s = Sequence(next(ids), str(len(seqs)), [1] * rng.randint(1, 20),
                         SamplingParams(max_tokens=rng.randint(1, 40)), pol)
            seqs.append(s)
            sch.add(s)
        if seqs and rng.random() < 0.01:
            v = rng.choice(seqs)
            if not v.finished:
                sch.finish(v, "abort")
        work = sch.schedule()
        for op in sch.take_swaps():
            if op.kind == "out":
                assert op.seq.seq_id not in host
                host.add(op.seq.seq_id)
            else:
                assert op.seq.seq_id in host
                host.discard(op.seq.seq_id)
        holders = sch._holders() + (work.seqs if work is not None and work.stage is Stage.PREFILL else [])
        owned = [b for s in holders for b in s.blocks]
        assert len(owned) == len(set(owned)) and not set(owned) & set(bm.free_blocks)
        assert len(owned) + len(bm.free_blocks) == bm.num_blocks
        assert sorted(s.slot for s in holders) == sorted(set(s.slot for s in holders))
        for s in holders:
            assert len(s.blocks) * 4 >= s.position + 1 - (s.stage is Stage.PRELUDE and s in sch.stalled)
            assert s.room == len(s.blocks) * 4 - len(s.prompt_ids)  # Sequence.room follows every table change
        steps += 1
        assert steps < 100000, "deadlock"
        if work is None:
            continue
        if work.stage is Stage.PREFILL:
            admitted += [s.seq_id for s in work.seqs]
        if work.stage is Stage.CORE:
            sch.postprocess(work, scores=FakeScores([rng.choice([0.0, 1.0]) for _ in work.seqs]))
        elif work.stage.emits:
            fin = {}
            for s in work.seqs:
                s.output_ids.append(1)
                if len(s.output_ids) >= s.params.max_tokens or s.num_tokens >= 64:
                    fin[s.seq_id] = "length"
            sch.postprocess(work, finished=fin)
        else:
            sch.postprocess(work)
    assert all(s.finished for s in seqs) and bm.all_free and not host and not sch.swapped
    assert admitted == sorted(admitted)  # FIFO admission
    assert sch.counters["preemptions"] > 0

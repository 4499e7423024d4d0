"""KV memory at real scale: the pool sized from a budget, blocks on demand, exact preemption by
swapping (outputs equal an ample pool's in float64 for every policy x layout x lookahead), the
scheduler's invariants under random load with aborts, and bad input."""
import itertools
import logging
import random

import pytest

from infer import EngineConfig, LLMEngine, SamplingParams
from infer.engine.block_manager import BlockManager
from infer.engine.config import CPU_KV_MEMORY
from infer.engine.scheduler import Scheduler
from infer.engine.sequence import Sequence, Stage, Status
from looplm import ExitPolicy, tiny_model
from looplm.model import LoopedLM

from helpers import ARCHS, MODES, arrive_or_abort, assert_same, engine_settings, exits_vary, fake_postprocess, grid, \
    model, random_requests, run_staggered, triples


def run(eng, reqs, seed):
    """Staggered arrivals (seeded); returns (tokens, depths, logprobs) per request in input order."""
    return triples(run_staggered(eng, reqs, seed, join=0.4, burst=3))


# each grid point on one model, alternating by position in the grid: both models, every layout and
# lookahead setting on each
CASES = [(*case, ARCHS[i % 2]) for i, case in enumerate(grid(MODES))]


@pytest.mark.parametrize("mode,layout,lookahead,arch", CASES)
def test_preemption_is_exact(mode, layout, lookahead, arch):
    """A pool of 5 blocks x 4 tokens: most requests are swapped out at least once (in every queue,
    mid-loop included); tokens, exit depths and log-probs equal an ample pool's."""
    seed = sum(map(ord, mode + layout)) + lookahead
    print("seed", seed, arch)
    reqs = random_requests(seed, n=5, prompt_len=(2, 8), max_new=(5, 10))
    # separate prefill: whole prompts admitted in bursts make most requests swap (mixed prefill with
    # preemption: tests/test_prefill.py::test_preemption_with_chunks_is_exact)
    base = dict(max_batch_size=8, block_size=4, prefill="separate", **engine_settings(mode, layout, lookahead))
    ample = LLMEngine(model(arch), EngineConfig(kv_cache_tokens=1024, **base))
    small = LLMEngine(model(arch), EngineConfig(kv_cache_tokens=20, watermark=0.0, **base))
    want, got = run(ample, reqs, seed), run(small, reqs, seed)
    m = small.metrics()
    assert ample.metrics()["preemptions"] == 0 and m["preemptions"] >= len(reqs) // 2, m
    assert m["swap_bytes"] > 0 and m["swapped_in_blocks"] == m["swapped_out_blocks"]
    assert_same(want, got, tol=1e-9)
    assert small.blocks.all_free and not small.runner.host_swap
    if layout != "full_depth" and mode != "cb":
        assert exits_vary(want, 2)  # exits really vary


def test_swap_space_full_waits_never_drops():
    """Host swap space of one block: sequences that need a block wait for others instead."""
    m = model("ouro-tiny")
    cfg = dict(max_batch_size=8, exit_threshold=0.55, block_size=4, kv_cache_tokens=24, watermark=0.0)
    reqs = random_requests(7, n=6, prompt_len=(2, 8), max_new=(6, 12))
    want = run(LLMEngine(m, EngineConfig(**{**cfg, "kv_cache_tokens": 1024})), reqs, 7)
    eng = LLMEngine(m, EngineConfig(**cfg, swap_space=1))
    got = run(eng, reqs, 7)
    m = eng.metrics()
    assert m["stalls"] + m["swap_overcommits"] > 0 and m["swapped_out_blocks"] <= m["swap_overcommits"] * 6
    assert [g[:2] for g in got] == [w[:2] for w in want]
    assert eng.blocks.all_free


@pytest.mark.parametrize("mode,prefill,paged", [("refill_k1", "separate", False), ("refill_k1", "mixed", True),
                                                 ("norefill", "mixed", False),
                                                 pytest.param("cb", "separate", True, marks=pytest.mark.slow)])  # ~11 s
def test_device_block_tables_follow_the_scheduler(mode, prefill, paged):
    """The runner sends a block table once and then only what changes (`Work.changed`: admitted,
    swapped in, resumed; `Work.grown`: the new entries of a table that crossed into a block). Under
    preemption and growth, every item of every decode launch finds its whole table, its inverse page
    entries and its position on the device."""
    seed = sum(map(ord, mode + prefill)) + paged
    print("seed", seed)
    reqs = random_requests(seed, n=7, prompt_len=(2, 9), max_new=(6, 14))
    eng = LLMEngine(model("ouro-tiny"), EngineConfig(kv_cache_tokens=24, watermark=0.0, max_batch_size=8, block_size=4,
                                                     exit_threshold=0.55, prefill=prefill, **MODES[mode]))
    r = eng.runner
    if paged:
        r.enable_paged(compile=False)
    checked = {"items": 0, "grown": 0}

    def checked_run(work, seconds):
        if seconds is None:  # (before the launch)
            return
        checked["grown"] += len(work.grown)
        if work.stage is not Stage.PREFILL:
            r.batch_state.check(work.seqs)  # the oracle: every table, inverse page entry and position rebuilt
            checked["items"] += len(work.seqs)
    eng.on_launch.append(checked_run)
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
    with pytest.raises(ValueError, match="maximum context length is"):
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
    with pytest.raises(ValueError, match="maximum context length is 20 tokens"):
        eng.add_request([1] * 20)
    s = eng.add_request([1] * 15, SamplingParams(max_tokens=30, ignore_eos=True))
    while eng.has_unfinished():
        eng.step()
    assert s.num_tokens == 20 and s.finish_reason == "length"
    with pytest.raises(ValueError, match="exceeds the checkpoint's context"):
        LLMEngine(m, EngineConfig(max_model_len=10**6))


# ------------------------------------------------------------------ scheduler alone (pure Python)
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
        arrive_or_abort(sch, seqs, rng, 120, lambda r: [1] * r.randint(1, 20), (1, 40), pol, ids)
        work = sch.schedule()
        for op in sch.take_swaps():
            if op.kind == "out":
                assert op.seq.seq_id not in host
                host.add(op.seq.seq_id)
            else:
                assert op.seq.seq_id in host
                host.discard(op.seq.seq_id)
        holders = sch.preemption.holders() + (work.items if work is not None and work.stage is Stage.PREFILL else [])
        owned = [b for s in holders for b in s.blocks]
        assert len(owned) == len(set(owned)) and not set(owned) & set(bm.free_blocks)
        assert len(owned) + len(bm.free_blocks) == bm.num_blocks
        assert sorted(s.slot for s in holders) == sorted(set(s.slot for s in holders))
        for s in holders:
            assert len(s.blocks) * 4 >= s.position + 1 - (s.status is Status.STALLED)
            assert s.room == len(s.blocks) * 4 - len(s.prompt_ids)  # Sequence.room follows every table change (the BlockManager keeps it)
        steps += 1
        assert steps < 100000, "deadlock"
        if work is None:
            continue
        if work.stage is Stage.PREFILL:
            admitted += [s.seq_id for s in work.items]
        fake_postprocess(sch, work, rng, token=lambda r: 1)
    assert all(s.finished for s in seqs) and bm.all_free and not host and not sch.swapped
    assert admitted == sorted(admitted)  # FIFO admission
    assert sch.counters["preemptions"] > 0


def test_block_manager_owns_a_sequences_table():
    """allocate_seq / grow_seq / shrink_seq / free_seq change a Sequence's blocks and slot and keep
    its room (output rows its table holds) right; the block-level rules stay: shared hits first,
    a failed grow changes nothing, the freed table's last block is freed first (reused last)."""
    bm = BlockManager(6, 4, 2)
    pol = ExitPolicy.from_config(tiny_model("ouro-tiny").cfg)
    a, b = (Sequence(i, str(i), [1] * 5, SamplingParams(max_tokens=20), pol) for i in range(2))
    bm.allocate_seq(a, 5)
    assert (a.blocks, a.slot, a.room) == ([0, 1], 0, 3)
    assert bm.grow_seq(a, 9) and (a.blocks, a.room) == ([0, 1, 2], 7)
    assert bm.grow_seq(a, 9) and a.blocks == [0, 1, 2]  # already holds them
    bm.allocate_seq(b, 5, hits=[0])  # b shares a's first block
    assert (b.blocks, b.slot, b.room, bm.ref[0]) == ([0, 3], 1, 3, 2)
    assert not bm.grow_seq(b, 17) and (b.blocks, b.room) == ([0, 3], 3)  # 3 more wanted, 2 free
    bm.shrink_seq(a, 6)
    assert (a.blocks, a.room, list(bm.free_blocks)) == ([0, 1], 3, [4, 5, 2])
    table = a.blocks
    bm.free_seq(a)
    assert (a.blocks, a.slot, a.room) == ([], -1, -5) and table == [0, 1]  # a new table: a SwapOp keeps the old
    assert list(bm.free_blocks) == [4, 5, 2, 1] and bm.ref[0] == 1  # b still holds block 0
    bm.free_seq(b)
    assert list(bm.free_blocks) == [4, 5, 2, 1, 3, 0] and bm.all_free


def test_batch_state_oracle_catches_a_stale_table():
    """The oracle above can fail: a block-table entry or a position changed behind the batch
    state's back (as a missed `Work.grown` or `invalidate` would leave it) is reported."""
    eng = LLMEngine(model("ouro-tiny"), EngineConfig(kv_cache_tokens=64, block_size=4, exit_threshold=0.55))
    seqs = [eng.add_request([3, 4, 5, 6, 7], SamplingParams(max_tokens=6, ignore_eos=True)) for _ in range(2)]
    bs = eng.runner.batch_state
    for _ in range(100):  # run on until a prelude has uploaded positions and tables: items wait for a core step
        eng.step()
        if any(s.output_ids and s.status is Status.RUNNING and s.stage is Stage.CORE for s in seqs):
            break
    live = [s for s in seqs if s.status is Status.RUNNING and s.stage is Stage.CORE]
    bs.check(live)  # consistent
    s = live[0]
    bs.bt[s.slot, 0] += 1
    with pytest.raises(AssertionError, match="device block table"):
        bs.check(live)
    bs.bt[s.slot, 0] -= 1
    bs.pos[s.slot] += 1
    with pytest.raises(AssertionError, match="device position"):
        bs.check(live)

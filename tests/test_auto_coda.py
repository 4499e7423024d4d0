"""min_coda_batch="auto" (infer/engine/auto_coda.py, issue 39): the stage-cost table, the decision
rule on made-up costs, what it reports (bench JSON, metrics, /metrics), the setting's validation,
and in the simulator the paper models' contrast (Ouro: the coda at once; Huginn: exits gather).
Exactness under auto is in the engine's equality suite (tests/test_engine.py, helpers.MODES_AUTO)."""
import random
from types import SimpleNamespace

import pytest

from infer.engine.auto_coda import EMA, REPLAN, AutoCoda, StageCosts, at
from infer.engine.config import EngineConfig
from infer.engine.llm_engine import LLMEngine
from infer.engine.sampling_params import SamplingParams
from infer.engine.sequence import Stage
from looplm.errors import ParamError

from helpers import model


def pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def test_stage_costs_interpolate_and_drop_chunk_rows_once_clean():
    c = StageCosts()
    assert c.predict(Stage.CORE, 4) is None
    c.observe(Stage.CORE, 8, 9.0, chunks=True)  # a launch with prompt chunks: used until a clean one comes
    assert c.predict(Stage.CORE, 8) == 9.0
    c.observe(Stage.CORE, 2, 1.0)
    c.observe(Stage.CORE, 8, 4.0)
    assert c.predict(Stage.CORE, 8) == 4.0  # the chunk row is gone
    c.observe(Stage.CORE, 8, 99.0, chunks=True)  # ... and chunk launches no longer count
    assert c.predict(Stage.CORE, 8) == 4.0
    assert c.predict(Stage.CORE, 4) == pytest.approx(2.0) and c.predict(Stage.CORE, 1) == 1.0
    assert c.predict(Stage.CORE, 64) == 4.0
    c.observe(Stage.CORE, 8, 14.0)
    assert c.predict(Stage.CORE, 8) == pytest.approx(4.0 + 0.2 * 10.0)  # moving average
    assert c.sizes[Stage.CORE] == [2, 8]  # (the row's sizes, sorted once: the chunk row's 8 went with it)


def test_fixed_cost_is_the_batch_independent_part():
    c = StageCosts()
    assert c.fixed(Stage.CODA) is None
    c.observe(Stage.CODA, 16, 3.0)
    assert c.fixed(Stage.CODA) == 3.0  # one size seen: all of it
    c.observe(Stage.CODA, 8, 2.0)
    c.observe(Stage.CODA, 64, 50.0)  # (only the two smallest sizes define the line)
    assert c.fixed(Stage.CODA) == pytest.approx(1.0)  # 2.0 - (3.0 - 2.0) / 8 * 8
    c.observe(Stage.PRELUDE, 1, 1.0)
    c.observe(Stage.PRELUDE, 2, 5.0)
    assert c.fixed(Stage.PRELUDE) == 0.0  # never below 0


def _auto(core: float, coda: float, prelude: float) -> AutoCoda:
    a = AutoCoda(pow2)
    for stage, t in ((Stage.CORE, core), (Stage.CODA, coda), (Stage.PRELUDE, prelude)):
        for b in (1, 64):
            a.observe(stage, b, t, idle=0, slots=64)
    return a


def test_cold_start_runs_the_coda_at_once():
    assert AutoCoda(pow2).coda_now(1, 10, 1, 11)


def test_a_cheap_coda_runs_at_once_an_expensive_one_waits_until_waiting_costs_its_share():
    cheap = _auto(core=1.0, coda=0.02, prelude=0.02)  # Ouro-like: the head alone next to the core
    assert cheap.coda_now(4, 60, 4, 64)  # (as many exits as the dear coda below waits with)
    dear = _auto(core=1.0, coda=0.8, prelude=0.6)  # Huginn-like: 2 + 2 layers and the head
    waits = 0
    while not dear.coda_now(4, 60, 4, 64):  # 4 exits of 64: each core step costs them 4/64 of it
        dear.observe(Stage.CORE, 60, 1.0, idle=4, slots=64)
        waits += 1
    # it launches once the held cost plus one more step reaches coda + prelude
    assert (waits + 1) * 4 / 64 >= 1.4 > waits * 4 / 64
    d = dear.describe()["last_decision"]
    assert d["coda_now"] and d["hold_s"] >= d["launch_s"] and d["waiting"] == 4
    dear.observe(Stage.CODA, 4, 0.8, idle=4, slots=64)
    assert dear.held == 0.0 and dear.describe()["k_hist"] == {1: 1, 4: 1, 64: 1}  # (_auto's two codas, then this one)


def _rows(fixed: float) -> AutoCoda:
    """A core step whose every padded row costs 1 s (long contexts: attention, not weights) beside a
    fixed `fixed` s per launch; cheap codas and preludes."""
    a = AutoCoda(pow2)
    for b in (1, 2, 4, 8, 16, 32, 64, 128):
        a.observe(Stage.CORE, b, fixed + b, idle=0, slots=64)
    for stage in (Stage.CODA, Stage.PRELUDE):
        a.observe(stage, 1, 0.01, idle=0, slots=64)
    return a


def test_a_core_step_splits_where_padded_rows_cost_more_than_a_launch():
    a = _rows(fixed=1.0)
    # 80 items: 64 + 16 rows (65 + 17 s), not 128 (129 s); 64 fill their padded size: one launch
    assert a.core_plan(80) == (pytest.approx(82.0), 64) and a.core_plan(64) == (65.0, 64)
    assert a.core_plan(100) == (pytest.approx(65 + 33 + 5), 64)  # 64 + (32 + 4) rows: 103 s < 129 s
    assert a.core_batch(80) == 64 and a.core_batch(64) == 64 and a.describe()["split_core_steps"] == 1
    # where the launch's fixed cost is most of it (weights), one launch: 80 items at 128 rows
    assert _rows(fixed=100.0).core_plan(80) == (228.0, 80)
    # a smaller size not measured yet is predicted flat at the table's end: no split on a guess
    b = AutoCoda(pow2)
    b.observe(Stage.CORE, 128, 129.0, idle=0, slots=64)
    assert b.core_plan(80) == (129.0, 80)
    assert AutoCoda(pow2).core_plan(80) == (None, 80)


def test_core_splits_follow_the_row_every_replan_launches_and_at_once_on_a_new_size():
    a = _rows(fixed=1.0)
    assert a.core_batch(80) == 64
    for i in range(REPLAN):  # the 128-row launch turns cheap (1 s): the moving average follows it
        assert a.core_batch(80) == 64, i  # (the split planned before, until REPLAN core launches are learned)
        a.observe(Stage.CORE, 128, 1.0, idle=0, slots=64)
        # the coda decision's plans follow every launch
        whole = 1 + 128 * (1 - EMA) ** (i + 1)
        assert a.core_plan(80) == ((pytest.approx(82.0), 64) if whole > 82 else (pytest.approx(whole), 80))
    assert a.core_batch(80) == 80  # one launch now
    b = AutoCoda(pow2)
    b.observe(Stage.CORE, 128, 129.0, idle=0, slots=64)
    assert b.core_batch(80) == 80
    for size in (64, 16):  # sizes seen for the first time: planned again at once
        b.observe(Stage.CORE, size, 1.0 + size, idle=0, slots=64)
    assert b.core_batch(80) == 64


def test_queued_launches_are_learned_in_order_when_a_decision_reads_them():
    """The engine queues its launches (AutoCoda.unlearned) rather than learning each at once: a coda
    decision, a due core plan (an item count not planned yet, or REPLAN launches queued) and
    describe() learn them first, in launch order, and then see what learning each at its launch
    would have made them see. A planned core split waits for the queue to reach REPLAN."""
    rng = random.Random(39)
    launches = [(stage, b, rng.uniform(0.5, 2.0) * b, rng.choice([0, 3]), 64, rng.random() < 0.2)
                for _ in range(40) for stage, b in ((Stage.PRELUDE, 4), (Stage.CORE, rng.choice([16, 60])),
                                                    (Stage.CODA, rng.choice([1, 4])))]
    eager, queued = AutoCoda(pow2), AutoCoda(pow2)
    for launch in launches:
        eager.observe(*launch)
    queued.unlearned.extend(launches)
    assert queued.coda_now(4, 60, 3, 64) == eager.coda_now(4, 60, 3, 64)
    assert queued.last == eager.last and queued.held == eager.held and queued.unlearned == []
    assert queued.costs.table == eager.costs.table and queued.describe() == eager.describe()

    a = _rows(fixed=1.0)  # a planned split (80 items: 64 + 16) ...
    assert a.core_batch(80) == 64
    for i in range(REPLAN - 1):  # ... kept while fewer than REPLAN launches wait, however cheap they are
        a.unlearned.append((Stage.CORE, 128, 1.0, 0, 64, False))
        assert a.core_batch(80) == 64 and len(a.unlearned) == i + 1
    a.unlearned.append((Stage.CORE, 128, 1.0, 0, 64, False))
    assert a.core_batch(80) == 80 and a.unlearned == []  # learned: the 128-row launch is cheap now


def _plan_recursive(a: AutoCoda, row: dict[int, float], n: int, least: float) -> tuple[float, int]:
    """core_plan as first written (recursive): the unrolled AutoCoda._plan must equal it."""
    p = a.padded(n)
    whole, h = at(row, p), a.padded(p // 2)
    if not 0 < h < n or at(row, h) + least >= whole:
        return whole, n
    split = at(row, h) + _plan_recursive(a, row, n - h, least)[0]
    return (split, h) if split < whole else (whole, n)


def test_the_unrolled_plan_equals_the_recursion_and_fixed_follows_its_sizes():
    seed = 39
    print("seed", seed)
    rng = random.Random(seed)
    for _ in range(200):
        a = AutoCoda(pow2)
        fixed, per = rng.uniform(0, 5), rng.uniform(0.01, 2)
        for b in rng.sample([1, 2, 4, 8, 16, 32, 64, 128, 256], rng.randint(1, 9)):
            a.observe(Stage.CORE, b, (fixed + per * b) * rng.uniform(0.7, 1.3), idle=0, slots=64)
        row = a.costs.table[Stage.CORE]
        least = min(row.values())
        for n in range(1, 300):
            assert a.core_plan(n) == _plan_recursive(a, row, n, least), (row, n)
    # fixed(): the line through the two smallest sizes, redrawn only when one of them (or a new size) moves
    c = StageCosts()
    for b, t in ((4, 3.0), (8, 5.0), (64, 40.0)):
        c.observe(Stage.CODA, b, t)
    assert c.fixed(Stage.CODA) == 1.0
    c.observe(Stage.CODA, 64, 80.0)  # (not one of them: the same line)
    assert c.fixed(Stage.CODA) == 1.0
    c.observe(Stage.CODA, 8, 10.0)  # 5 -> 6: the line through (4, 3) and (8, 6) meets 0 at 0
    assert c.fixed(Stage.CODA) == pytest.approx(0.0)
    c.observe(Stage.CODA, 2, 2.5)  # a new smallest size: (2, 2.5) and (4, 3) -> 2.0
    assert c.fixed(Stage.CODA) == pytest.approx(2.0)


def test_the_scheduler_steps_the_rest_of_a_split_core_queue_next():
    from infer.engine.scheduler import Scheduler
    from infer.engine.sequence import Sequence
    sch = Scheduler.__new__(Scheduler)  # only the core step's choice: a queue and auto's table
    sch.core_q, sch.auto = [Sequence.__new__(Sequence) for _ in range(80)], _rows(1.0)
    sch.chunker = SimpleNamespace(flying=0)  # no prompt chunk in flight
    for s in sch.core_q:
        s.chunk = None  # decode items
    sch.queues = {Stage.CORE: sch.core_q}
    q0 = list(sch.core_q)
    first = sch._core()
    assert first.seqs == q0[:64] and sch.core_q == q0[64:] + q0[:64]
    assert sch._core().seqs == q0[64:] + q0[:48]  # the 16 not stepped come first


def test_exits_wait_rather_than_push_the_core_step_past_a_padded_size():
    a = _rows(fixed=40.0)  # (a launch costs too much to split: 72 + 41 s > 104 s for 33 items)
    assert a.core_plan(33) == (104.0, 33)
    assert a.padding(28, 3, 72.0) == 0.0  # 31 items still fit the 32 rows paid for
    assert a.coda_now(3, 28, 3, 31)
    # 33 items would run at 64 rows: 104 - 72 * 33 / 30 s above the step's cost per item now
    assert a.padding(30, 3, 72.0) == pytest.approx(104 - 72 * 33 / 30)
    assert not a.coda_now(3, 30, 3, 33)
    d = a.describe()["last_decision"]
    assert d["launch_s"] == pytest.approx(0.02 + d["padding_s"]) and d["padding_s"] == pytest.approx(104 - 72 * 33 / 30)
    # where the weights dominate (a flat cost), more items cost nothing: no padding term
    flat = _auto(core=1.0, coda=0.8, prelude=0.6)
    assert flat.padding(30, 3, 1.0) == 0.0


def test_a_launch_with_prompt_chunks_charges_the_waiting_exits_its_decode_part_only():
    a = _auto(core=1.0, coda=0.8, prelude=0.6)
    a.observe(Stage.CORE, 60, 10.0, idle=4, slots=64, chunks=True)  # a 2k-token chunk rode along: 10 s
    assert a.held == pytest.approx(4 * 1.0 / 64)  # the chunk-free core step's share, not 10 s's
    assert a.costs.predict(Stage.CORE, 64) == 1.0  # (nor does the table learn from it: its row is clean)
    a.observe(Stage.CORE, 60, 2.0, idle=4, slots=64)
    assert a.held == pytest.approx(4 * (1.0 + 2.0) / 64)


def test_setting_validation_and_flag():
    assert EngineConfig(min_coda_batch="auto").min_coda_batch == "auto"
    for bad in ("sometimes", 1, None):
        with pytest.raises(ParamError, match="refill must be True or False"):
            EngineConfig(refill=bad)
    with pytest.raises(ParamError, match="refill='auto' is refill=True"):  # (the old default, removed)
        EngineConfig(refill="auto")
    for bad in ("often", 0, 2.5):
        with pytest.raises(ParamError, match="min_coda_batch must be an integer >= 1 or 'auto'"):
            EngineConfig(min_coda_batch=bad)
    import argparse

    from infer.engine.config import add_engine_args, engine_kwargs_from_args
    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert engine_kwargs_from_args(p.parse_args(["--min-coda-batch", "auto"]))["min_coda_batch"] == "auto"
    assert engine_kwargs_from_args(p.parse_args(["--min-coda-batch", "4"]))["min_coda_batch"] == 4
    with pytest.raises(SystemExit):
        p.parse_args(["--min-coda-batch", "often"])
    assert engine_kwargs_from_args(p.parse_args(["--no-refill"]))["refill"] is False
    assert "refill" not in engine_kwargs_from_args(p.parse_args([]))  # (unset: EngineConfig's True)
    # lm-eval model_args come as strings: "auto" stays "auto" where a setting takes it
    from eval.lm import engine_settings
    assert engine_settings({"refill": "true", "min_coda_batch": "auto"}) == {"refill": True, "min_coda_batch": "auto"}
    assert engine_settings({"refill": "false", "min_coda_batch": "4"}) == {"refill": False, "min_coda_batch": 4}
    with pytest.raises(ParamError, match="model_args min_coda_batch='often': expected .* or auto"):
        engine_settings({"min_coda_batch": "often"})
    with pytest.raises(ParamError, match="model_args refill='maybe'"):
        engine_settings({"refill": "maybe"})


def test_engine_reports_what_auto_decided():
    """On a CPU the launches' wall-clock seconds are the costs: the engine's metrics (and so the
    server's /metrics) carry the codas, their batch histogram and the last decision."""
    from infer.serving.metrics import render_metrics
    eng = LLMEngine(model("huginn-tiny"), EngineConfig(min_coda_batch="auto", exit_threshold=0.55, max_batch_size=8))
    for i in range(6):
        eng.add_request([3 + i, 4, 5], SamplingParams(max_tokens=8, ignore_eos=True))
    while eng.has_unfinished():
        eng.step()
    d = eng.auto_coda_metrics()
    assert d["codas"] == eng.metrics()["stage_calls"]["coda"] and sum(d["k_hist"].values()) == d["codas"]
    m = eng.metrics()
    assert m["auto_coda_codas"] == d["codas"] and m["auto_coda_k_hist"] == d["k_hist"]
    assert m["auto_coda_split_core_steps"] == d["split_core_steps"] <= m["stage_calls"]["core"]
    assert d["last_decision"] is not None and d["last_decision"]["launch_s"] > 0
    assert LLMEngine(model("huginn-tiny"), EngineConfig(min_coda_batch=1)).auto_coda_metrics() is None

    class Snap:
        alive = True
        rate_window_s = 10.0
        snapshot = {**m, "waiting": 0, "tokens_per_s": 0.0, "engine_keys": list(m),
                    "counters": {"prompt_tokens": 0, "generation_tokens": 0, "requests_failed": 0,
                                 "requests_rejected": 0, "requests_aborted": 0, "step_errors": 0,
                                 "requests_finished": {}}}
    text = render_metrics(Snap(), "m", {})
    k, n = next(iter(d["k_hist"].items()))
    assert f'cdb_auto_coda_batch_total{{model_name="m",k="{k}"}} {n}' in text and "cdb_auto_coda_hold_s" in text \
        and "cdb_auto_coda_padding_s" in text
    assert f'cdb_auto_coda_split_core_steps{{model_name="m"}} {d["split_core_steps"]}' in text


def test_simulator_auto_follows_the_models_coda_cost():
    """Ouro-1.4B (coda = the head): auto runs the coda about as K = 1 does; Huginn-3.5B (coda = 2
    layers and the head): exits gather (codas 1.5x K = 1's batch or more) and auto beats K = 1."""
    from infer.sim.cost import HOST_JSON, HostCost, RooflineCost, h100_kv_tokens
    from infer.sim.runner import binomial_depths, depths_from_distribution
    from infer.sim.simulate import simulate
    from infer.sim.workloads import make_requests
    from looplm.presets import paper_config
    out = {}
    for name, mean in (("ouro-1.4b", 2.5), ("huginn-3.5b", 9.0)):
        cfg = paper_config(name)
        reqs = make_requests("alpaca", 48, seed=0, scale=1.0, max_model_len=2048, vocab_size=cfg.vocab_size)
        cost = RooflineCost(cfg, host=HostCost.from_json(HOST_JSON), attention="sdpa")
        modes = [{"name": "cb", "policy": "cb"}, {"name": "k1", "policy": "cdb", "min_coda_batch": 1},
                 {"name": "auto", "policy": "cdb", "min_coda_batch": "auto"}]
        blk = simulate(cfg, reqs, cost, depths_from_distribution(binomial_depths(cfg.r_max, mean), reqs, 0), modes,
                       max_batch_size=16, kv_cache_tokens=h100_kv_tokens(cfg, "last_exited"))
        out[name] = {r["mode"]: r for r in blk["results"]}
    ouro, huginn = out["ouro-1.4b"], out["huginn-3.5b"]
    assert ouro["auto"]["output_tokens_per_s"] >= 0.99 * ouro["k1"]["output_tokens_per_s"]
    coda = {n: {m: r["stages"]["coda"]["mean_batch"] for m, r in out[n].items() if m != "cb"} for n in out}
    assert coda["ouro-1.4b"]["auto"] < 1.2 * coda["ouro-1.4b"]["k1"]  # as K = 1: the exits of one core step
    assert coda["huginn-3.5b"]["auto"] > 1.5 * coda["huginn-3.5b"]["k1"]
    assert huginn["auto"]["auto_coda"]["mean_k"] == pytest.approx(coda["huginn-3.5b"]["auto"])
    assert huginn["auto"]["output_tokens_per_s"] > 1.05 * huginn["k1"]["output_tokens_per_s"]
    assert ouro["k1"]["auto_coda"] is None


def _codas_mid_loop(refill, coda_s: float) -> tuple[int, int]:
    """Simulated engine, 12 requests decoding at spread exit depths, every launch priced flat
    (1 ms; the coda `coda_s`): (codas launched while items were still in the loop, all codas)."""
    from functools import partial

    from infer.sim.cost import FittedCost
    from infer.sim.latency import StageFit
    from infer.sim.runner import SIM_EXITS, SimModel, SimRunner, binomial_depths, depths_from_distribution
    from infer.sim.workloads import Request
    from looplm.presets import paper_config
    cfg = paper_config("huginn-3.5b")
    reqs = [Request([5 + i, 6, 7, 8], 24, 4, 24) for i in range(12)]
    cost = FittedCost({s: StageFit(s, coda_s if s == "coda" else 1e-3, 0.0, 0.0, 1.0, 1)
                       for s in ("prefill", "prelude", "core", "coda")})
    runner = partial(SimRunner, cost=cost, depths=depths_from_distribution(binomial_depths(cfg.r_max, 9.0), reqs, 0))
    eng = LLMEngine(SimModel(cfg), EngineConfig(refill=refill, max_batch_size=16, kv_cache_tokens=2048,
                                                max_model_len=2048, r_min=1, **SIM_EXITS), runner_cls=runner)
    for r in reqs:
        eng.add_request(r.prompt_ids, SamplingParams(max_tokens=r.output_len, ignore_eos=True))
    mid = codas = 0
    while eng.has_unfinished():
        loop = len(eng.scheduler.core_q)
        eng.step()
        if eng.scheduler.last_stage is Stage.CODA:
            codas += 1
            mid += loop > 0
    return mid, codas


def test_auto_coda_lets_the_loop_drain_where_a_coda_costs_more_than_waiting():
    """refill=True with min_coda_batch="auto" (both defaults): where a coda and its prelude cost
    little next to holding exits back (1 ms, as a core step), exits re-enter the loop at most codas
    (refill); where they cost 50 core steps, every coda after the first few (auto's cold start,
    K = 1 until each stage's cost is seen) waits for the loop to drain, as a no-refill cohort's."""
    assert EngineConfig().refill is True and EngineConfig().min_coda_batch == "auto"
    mid, codas = _codas_mid_loop(True, 1e-3)
    assert mid > 0.8 * codas > 20
    mid, codas = _codas_mid_loop(True, 5e-2)
    assert mid <= 2 and codas > 10
    assert _codas_mid_loop(False, 1e-3)[0] == 0  # (the cohorts themselves)


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA")
def test_cuda_launches_are_timed_by_events_read_without_waiting():
    """CUDA: the costs come from events read once done (LaunchTimer), so the table fills while
    the engine runs, and the outputs equal a fixed-K engine's."""
    import torch
    m = model("huginn-tiny").to("cuda")
    outs = {}
    for k in (1, "auto"):
        eng = LLMEngine(m, EngineConfig(min_coda_batch=k, exit_threshold=0.55, max_batch_size=8))
        seqs = [eng.add_request([3 + i, 4, 5], SamplingParams(max_tokens=12, ignore_eos=True)) for i in range(6)]
        while eng.has_unfinished():
            eng.step()
        outs[k] = [(s.output_ids, s.exit_depths) for s in seqs]
    torch.cuda.synchronize()
    assert outs[1] == outs["auto"]
    assert eng._launch_timer is not None and eng.scheduler.auto.costs.table

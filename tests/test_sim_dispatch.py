"""The simulator's dispatch charge (issue 62; infer/sim/dispatch.py, SimRunner): op counts per launch
kind come from the engine (equal to a direct count of the ModelRunner running that launch, at
another width), an eager chunk-carrying core step is charged more than a graphed one, zero costs
give the clock without the charge back, the JSON carries dispatch_s / eager_ops per mode, bad
values are one-line errors naming the flag, and the emulated device's graphs follow cuda_graphs.
No timing assertions: every figure here is virtual."""
import json
from functools import partial

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from infer.engine.config import EngineConfig
from infer.engine.llm_engine import LLMEngine
from infer.engine.sampling_params import SamplingParams
from infer.engine.sequence import Stage
from infer.sim import dispatch as D
from infer.sim import emulated as E
from infer.sim.__main__ import main
from infer.sim.cost import RooflineCost
from infer.sim.runner import SIM_EXITS, SimModel, SimRunner, binomial_depths, depths_from_distribution
from infer.sim.simulate import simulate_mode
from infer.sim.workloads import Request, make_requests
from looplm.cli import run
from looplm.errors import ParamError
from looplm.presets import dummy_model, preset_config

CFG = preset_config("ouro-tiny")  # 0-2-0, r_max 4, GQA, the ouro_gate criterion
LAYOUT = "last_exited"


class _Direct(TorchDispatchMode):
    """The test's own count: every aten op while `on`."""

    def __init__(self):
        super().__init__()
        self.n, self.on = 0, False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += self.on
        return func(*args, **(kwargs or {}))


def _direct_counts(cfg) -> list[tuple]:
    """Run a real engine at the preset's own width (not count_config's) and count each launch's ops
    directly: a decode-only launch its `body`, a launch with chunks all of `run` but the upload.
    Returns (stage, decode items, chunks, ops)."""
    model = dummy_model(cfg, torch.float32, "cpu")
    eng = LLMEngine(model, EngineConfig(max_batch_size=4, max_num_batched_tokens=32, kv_cache_tokens=4096,
                                        policy="cdb", refill=True, min_coda_batch=1))
    r, m = eng.runner, _Direct()
    out = []
    body, upload = r.body, r.batch_state.upload

    def counted_body(*a, **k):
        m.on = True
        try:
            return body(*a, **k)
        finally:
            m.on = False

    def quiet_upload(*a, **k):
        was, m.on = m.on, False
        try:
            return upload(*a, **k)
        finally:
            m.on = was
    r.body, r.batch_state.upload = counted_body, quiet_upload

    def launch(work, dt):
        if dt is None:
            m.n, m.on = 0, bool(work.chunks)
        else:
            m.on = False
            out.append((work.stage, len(work.seqs), len(work.chunks), m.n))
    eng.on_launch.append(launch)
    g = torch.Generator().manual_seed(0)
    for i, (p, o) in enumerate(((40, 3), (20, 2), (50, 3), (8, 2))):
        eng.add_request(torch.randint(3, 250, (p,), generator=g).tolist(),
                        SamplingParams(max_tokens=o, ignore_eos=True, temperature=0.0))
    with torch.inference_mode(), m:
        while eng.has_unfinished():
            eng.step()
    return out


def test_op_counts_come_from_the_engine():
    counts = D.count_ops(CFG, "cdb", LAYOUT, "ouro_gate")
    assert counts.how["counted_on"] == "cpu" and counts.how["criterion"] == "ouro_gate"
    rows = _direct_counts(CFG)
    decode = {(st, ops) for st, n, ch, ops in rows if not ch}
    seen = {st for st, _ in decode}
    assert seen == {Stage.PRELUDE, Stage.CORE, Stage.CODA}
    for st in seen:  # a decode-only launch's body: the count, exactly (an upload's extra ops aside: prelude)
        assert counts.decode[st] in {ops for s, ops in decode if s is st}, st
    assert {ops for s, ops in decode if s is Stage.CORE} == {counts.decode[Stage.CORE]}
    mixed = [(st, n, ch, ops) for st, n, ch, ops in rows if ch]
    assert {ch for _, _, ch, _ in mixed} >= {1, 2} and any(n == 0 for _, n, _, _ in mixed)
    for st, n, ch, ops in mixed:  # base + per chunk + decode items: within a few ops of each launch
        assert abs(counts.mixed[st](ch, n > 0) - ops) <= max(2.0, 0.01 * ops), (st, n, ch, ops)
    # ops grow with the chunks, and a chunk-carrying core step dispatches more than a decode-only one
    core = counts.mixed[Stage.CORE]
    assert core.per > 0 and core(1, True) > counts.decode[Stage.CORE]


def test_counts_follow_the_structure_not_the_width():
    wide = preset_config("ouro-tiny", hidden_size=128, intermediate_size=256, head_dim=32)
    assert D.structure_key(wide) == D.structure_key(CFG)
    deeper = preset_config("ouro-tiny", n_core=3)
    assert D.structure_key(deeper) != D.structure_key(CFG)
    assert D.count_ops(deeper, "cdb", LAYOUT, "ouro_gate").decode[Stage.CORE] > \
        D.count_ops(CFG, "cdb", LAYOUT, "ouro_gate").decode[Stage.CORE]


def _engine(cost, requests, graphs=True, **kw):
    depths = depths_from_distribution(binomial_depths(CFG.r_max, 2.5), requests, 0)
    # (K=1, not auto: the same launches whatever they cost)
    ecfg = EngineConfig(**{"max_batch_size": 8, "max_num_batched_tokens": 32, "kv_cache_tokens": 8192, **SIM_EXITS,
                           "r_min": 1, "refill": True, "min_coda_batch": 1, **kw})
    return LLMEngine(SimModel(CFG), ecfg, runner_cls=partial(SimRunner, cost=cost, depths=depths, overlap=True,
                                                             graphs=graphs))


def test_an_eager_chunk_core_step_is_charged_more_than_a_graphed_one():
    """On the SDPA path a launch with prompt chunks runs eagerly (mixed.py): charged its counted ops,
    a decode-only one a replay; on the paged path both replay graphs."""
    reqs = [Request(list(range(3, 3 + p)), o, p, o) for p, o in ((60, 6), (20, 8), (45, 5), (10, 9))]
    paged = _engine(RooflineCost(CFG, kv_layout=LAYOUT, attention="paged", dispatch=D.Dispatch()), reqs)
    for i, r in enumerate(reqs):
        paged.add_request(r.prompt_ids, SamplingParams(max_tokens=r.output_len, ignore_eos=True), request_id=str(i))
    while paged.has_unfinished():
        paged.step()
    d = paged.runner.dispatch_stats()
    assert d["eager_launches"] == 0 and d["graphed_launches"] > 0 and d["eager_ops"] == 0
    eng = _engine(RooflineCost(CFG, kv_layout=LAYOUT, attention="sdpa", dispatch=D.Dispatch()), reqs)
    charged = []

    def launch(work, dt):
        if dt is None:
            launch.before = eng.runner.dispatched["dispatch_s"]
        else:
            charged.append((work.stage, bool(work.chunks), eng.runner.dispatched["dispatch_s"] - launch.before,
                            eng.runner.trace[-1]["seconds"]))
    eng.on_launch.append(launch)
    for i, r in enumerate(reqs):
        eng.add_request(r.prompt_ids, SamplingParams(max_tokens=r.output_len, ignore_eos=True), request_id=str(i))
    while eng.has_unfinished():
        eng.step()
    eager = [c for st, ch, c, _ in charged if st is Stage.CORE and ch]
    graphed = [c for st, ch, c, _ in charged if st is Stage.CORE and not ch]
    assert eager and graphed
    assert graphed == pytest.approx([D.REPLAY_US * 1e-6] * len(graphed))  # one replay each
    assert min(eager) > max(graphed)
    ops = D.count_ops(CFG, "cdb", LAYOUT, "ouro_gate")
    assert min(eager) >= D.OP_US * 1e-6 * (ops.mixed[Stage.CORE](1, False) - ops.mixed[Stage.CORE].max_residual) - 1e-9
    d = eng.runner.dispatch_stats()
    assert d["eager_launches"] == sum(ch for _, ch, _, _ in charged) and d["graphed_launches"] == len(graphed) + sum(
        1 for st, ch, _, _ in charged if st is not Stage.CORE and not ch)
    assert d["eager_ops"] > 0 and d["dispatch_s"] == pytest.approx(sum(c for _, _, c, _ in charged))
    # without graphs every launch is eager: a decode-only core step costs its counted ops
    eng2 = _engine(RooflineCost(CFG, kv_layout=LAYOUT, attention="sdpa", dispatch=D.Dispatch()), reqs, graphs=False)
    for i, r in enumerate(reqs):
        eng2.add_request(r.prompt_ids, SamplingParams(max_tokens=r.output_len, ignore_eos=True), request_id=str(i))
    while eng2.has_unfinished():
        eng2.step()
    d2 = eng2.runner.dispatch_stats()
    assert d2["graphed_launches"] == 0 and d2["eager_launches"] == d["eager_launches"] + d["graphed_launches"]
    assert d2["dispatch_s"] > d["dispatch_s"]


def _mode(cost, reqs, name="cdb_refill_k1", **mode):
    depths = depths_from_distribution(binomial_depths(CFG.r_max, 2.5), reqs, 0)
    return simulate_mode(CFG, reqs, {"name": name, "policy": "cdb", "refill": True, "min_coda_batch": 1, **mode},
                         cost, depths, max_batch_size=8, kv_cache_tokens=8192, max_num_batched_tokens=64)


@pytest.mark.parametrize("mode", [{}, {"policy": "cb"}])
def test_zero_costs_reproduce_the_clock_without_the_charge(mode):
    reqs = make_requests("alpaca", 12, seed=0, max_model_len=512, vocab_size=CFG.vocab_size)
    cost = partial(RooflineCost, CFG, kv_layout=LAYOUT, attention="sdpa")  # (chunk launches eager: ops counted)
    off, zero, on = (_mode(cost(dispatch=d), reqs, **mode) for d in (None, D.Dispatch(0, 0), D.Dispatch()))
    assert off["dispatch"] is None
    assert zero["seconds"] == off["seconds"]
    assert [r["seconds"] for r in zero["trace"]] == [r["seconds"] for r in off["trace"]]
    assert zero["dispatch"]["dispatch_s"] == 0 and zero["dispatch"]["eager_ops"] > 0  # (counted, not charged)
    assert zero["exit_depths"] == on["exit_depths"]
    assert on["seconds"] > off["seconds"] and on["dispatch"]["dispatch_s"] > 0
    assert on["dispatch"]["eager_ops"] == zero["dispatch"]["eager_ops"] or mode  # (auto / K=1: the same launches)


def test_cli_json_reports_dispatch_per_mode(tmp_path, capsys):
    main(["--model", "ouro-tiny", "--workloads", "alpaca", "--num-requests", "6", "--ks", "1", "auto",
          "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert "dispatch s" in out and "eager ops" in out and "5 us per eager aten op" in out
    doc = json.loads(next(tmp_path.glob("sim_*.json")).read_text())
    assert doc["attention"] == "paged" and doc["cuda_graphs"] is True
    assert doc["dispatch"] == {"op_us": D.OP_US, "replay_us": D.REPLAY_US, "source": "defaults"}
    results = doc["workloads"][0]["results"]
    assert {r["mode"] for r in results} >= {"cb", "cdb_refill_k1", "cdb_refill_kauto"}
    assert any(r["mode"].endswith("_separate") for r in results)
    for r in results:  # (paged, the default: every launch replays a graph, prompt chunks or not, separate
        # prefill launches too)
        assert r["dispatch_s"] > 0 and r["eager_ops"] == 0, r["mode"]
        assert r["dispatch"]["eager_launches"] == 0 and r["dispatch"]["graphed_launches"] >= 1


def test_dispatch_json_and_flags(tmp_path, capsys):
    f = tmp_path / "gpu_check.json"
    f.write_text(json.dumps({"dispatch": {"op_us": 2.5, "replay_us": 7.0}, "other": 1}))
    assert D.Dispatch.from_json(f).describe() == {"op_us": 2.5, "replay_us": 7.0, "source": str(f)}
    assert D.Dispatch.from_json(f, op_us=1.0).op_us == 1.0  # a flag given explicitly wins
    main(["--model", "ouro-tiny", "--workloads", "alpaca", "--num-requests", "3", "--ks", "1", "--dispatch-json",
          str(f), "--replay-us", "3", "--out", str(tmp_path / "o")])
    doc = json.loads(next((tmp_path / "o").glob("sim_*.json")).read_text())
    assert doc["dispatch"] == {"op_us": 2.5, "replay_us": 3.0, "source": str(f)}
    half = tmp_path / "half.json"  # (gpu_check's block before its dispatch section ran: nulls)
    half.write_text(json.dumps({"dispatch": {"op_us": 4.0, "replay_us": None}}))
    d = D.Dispatch.from_json(half)
    assert (d.op_us, d.replay_us) == (4.0, D.REPLAY_US) and "replay_us null there" in d.source
    for doc in ({"op_us": 1}, {"dispatch": {"op_us": "fast", "replay_us": 1}}):
        bad = tmp_path / "bad.json"
        bad.write_text(json.dumps(doc))
        with pytest.raises(ParamError, match="--dispatch-json"):
            D.Dispatch.from_json(bad)
    bad.write_text(json.dumps({"dispatch": {"op_us": -2, "replay_us": 1}}))
    with pytest.raises(ParamError, match="--op-us must be >= 0"):
        D.Dispatch.from_json(bad)


@pytest.mark.parametrize("flag", ["--op-us", "--replay-us"])
def test_negative_costs_are_one_line_errors_naming_the_flag(flag, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        run(main, ["--model", "ouro-tiny", flag, "-1", "--out", str(tmp_path)])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error:") and flag in err


def test_emulated_device_replays_graphs_unless_told_not_to():
    reqs = [Request([5 + i] * 20, 4, 20, 4) for i in range(3)]

    def stats(**engine):
        eng = E.emulated_engine("ouro-tiny", "emulated:h100",
                                {"max_batch_size": 4, "refill": True, "min_coda_batch": 1, **engine}, by_index=True)
        for i, r in enumerate(reqs):
            eng.add_request(r.prompt_ids, SamplingParams(max_tokens=r.output_len, ignore_eos=True), request_id=str(i))
        while eng.has_unfinished():
            eng.step()
        assert eng.config.cuda_graphs is False  # (the engine itself runs the CPU path)
        return eng.runner.describe()["dispatched"]
    on, off = stats(), stats(cuda_graphs=False)
    # (the H100 it stands for runs paged attention: launches with prompt chunks replay graphs too)
    assert on["cuda_graphs"] and on["graphed_launches"] > 0 and on["eager_launches"] == 0
    assert not off["cuda_graphs"] and off["graphed_launches"] == 0
    assert off["eager_launches"] == on["eager_launches"] + on["graphed_launches"]
    assert stats(cuda_graphs=True)["graphed_launches"] == on["graphed_launches"]  # (not refused on the CPU engine)

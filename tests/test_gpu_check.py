"""scripts/gpu_check.py, the one command of the first GPU run (issues 38, 62): its CPU dry run end to
end (so the script cannot rot before a GPU runs it), its guards, atomic saves and SIGTERM, the
autograd check, the dispatch costs, and its CUDA-only arithmetic (launch events, allocator peaks,
graph pool, graph replay) on stand-ins for torch.cuda, since no CUDA device runs here."""
import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from infer import EngineConfig, LLMEngine
from infer.engine.scheduler import Work
from infer.engine.sequence import Stage
from looplm import tiny_model
from scripts import gpu_check as G

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "WANDB_MODE": "offline"}
NEW_MODES = {"cdb_refill_k1", "cdb_refill_auto", "cdb_refill_k1_no_pipeline", "cb_sdpa", "cdb_refill_k1_sdpa"}


def finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


@pytest.fixture
def quiet_threads():
    """One torch thread while main runs in this process (as the dry run sets it; two threads on a
    shared 2-core machine run the tiny launches ~10x slower), the process's count back after."""
    old = torch.get_num_threads()
    yield
    torch.set_num_threads(old)


@pytest.mark.slow
def test_cpu_dry_run_writes_the_whole_json(tmp_path):
    """`--device cpu --small`: every section runs, every engine built inside the graph stand-in
    (captured at start-up as on CUDA) and free of autograd state; float64 parity holds for every
    CPU variant, paged FlexAttention matches SDPA within the stated tolerances; the dispatch costs
    are written where the simulator reads them; each mode (the lookahead pipeline on and off,
    min_coda_batch="auto", SDPA beside the default attention) has its speedup over CB with an
    interval, exact work counts and the memory reserve; the CUDA-only numbers are null with their
    reason; the JSON was replaced atomically (no temporary file left). Ouro runs 6 requests (--small's
    default is 12): a batch of 4 and 2 refills, each mode's passes half as long."""
    p = subprocess.run([sys.executable, "-m", "scripts.gpu_check", "--device", "cpu", "--small", "--num-requests",
                        "6", "--out", str(tmp_path)], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "parity_float64 done" in p.stdout and "wrote" in p.stdout  # progress and the summary are printed
    assert [f.name for f in tmp_path.iterdir()] == ["gpu_check.json"]
    doc = json.loads((tmp_path / "gpu_check.json").read_text())
    assert doc["complete"] and doc["exit_code"] == 0 and doc["device_type"] == "cpu" and doc["skipped"] == []
    assert doc["sections_done"] == list(G.SECTIONS) and doc["terminated"] is None and doc["in_flight"] is None
    assert doc["ouro_1p4b"]["workload"]["num_requests"] == 6 > G.SMALL_BASE["max_batch_size"]  # refills happen
    assert {r["what"] for r in doc["ran"]} >= set(G.SECTIONS) | {f"ouro_1p4b/{m['name']}" for m in G.MODES}
    assert set(doc["nulls"]) >= {"idle", "dispatch.replay_us"} and "graph_capture" not in doc["nulls"]

    # the dispatch block the simulator reads (infer/sim/dispatch.py: Dispatch.from_json)
    d = doc["dispatch"]
    assert finite(d["op_us"]) and 0 < d["op_us"] < 1000 and d["replay_us"] is None
    assert d["op_us_source"].startswith("ouro_1p4b/")  # the paper shape's engine, measured eagerly (SDPA)
    assert finite(d["micro"]["op_us"]) and {e["where"] for e in d["engines"]} >= {"ouro-tiny float32 engine"}
    assert all(e["ops"] > 50 and e["attention_backend"] == "sdpa" for e in d["engines"])

    ag = doc["autograd_check"]
    assert ag["ok"] and ag["failures"] == [] and ag["checks"] >= 2 * (len(G.MODES) + len(G.HUGINN_MODES))

    par = doc["parity_float64"]
    assert par["ok"] and par["failed"] == [] and par["all_cases_ran"]
    for arch in ("ouro-tiny", "huginn-tiny"):
        for layout in ("last_exited", "shared"):
            for variant in ("eager", "paged"):
                assert par["cases"][f"{arch}/{layout}/{variant}"] is True
            assert par["cases"][f"{arch}/{layout}/eager_async"] is True or \
                par["cases"][f"{arch}/{layout}/eager_async"].startswith("refused")
    for variant in ("graphs", "graphs_no_async", "cb_graphs"):  # through the stand-in
        assert par["cases"][f"ouro-tiny/last_exited/{variant}"] is True

    pp = doc["parity_paged"]
    assert pp["ok"] and pp["failed"] == [] and set(pp["tolerance"]) == {"float32", "bfloat16"}
    assert set(pp["cases"]) == {"/".join(c) for c in G.PAGED_CASES[:G.PAGED_CASES_CPU]}
    for key, c in pp["cases"].items():
        tol = G.TOLERANCE[c["dtype"]]
        assert c["ok"] and c["depths_equal"] and c["as_accurate_as_sdpa"] and c["tokens"] > 0
        assert 0 <= c["logprob_max_abs_diff"] <= tol["logprob_abs"]
        assert all(d["sdpa_top2_margin"] <= tol["token_margin"] for d in c["divergences"])
        assert c["graph_capture"]["paged"]["captured"] > 0  # paged attention inside the stand-in's graphs

    for key, r_max, modes in (("ouro_1p4b", 4, G.MODES), ("huginn_3p5b", 16, G.HUGINN_MODES)):
        b = doc[key]
        assert b["errors"] == {} and b["modes_skipped"] == []
        assert b["modes_run"] == [m["name"] for m in modes]
        assert b["model"]["r_max"] == r_max and b["workload"]["num_requests"] > 0
        res = b["results"]
        for name, r in res.items():
            assert len(r["seconds_all"]) == (5 if key == "ouro_1p4b" else 3)
            assert r["work"]["flops"] > 0 and r["work"]["weight_bytes"] > 0 and sum(r["work"]["launches"].values())
            assert finite(r["compute_ratio"]) and finite(r["weight_traffic_ratio"])
            assert r["idle"] is None
            gcap = r["graph_capture"]  # the stand-in captured every key at start-up, as CUDA would
            assert gcap["stand_in"] is True and gcap["captured"] > 0
            mem = r["memory"]
            assert mem["measured"] is None and mem["checks"] is None and mem["kv_pool_bytes"] > 0
            assert "largest key first" in mem["graph_pool_expectation"]
            assert all(mem["reserve_bytes"][k] > 0 for k in ("prefill", "logprobs", "decode", "activation_reserve"))
            assert sum(v["launches"] for v in r["launches"].values()) > 0
            if name == "cb":
                continue
            iv = r["speedup_interval"]
            assert all(finite(iv[k]) for k in ("median", "lo", "hi")) and iv["lo"] <= iv["median"] <= iv["hi"]
            assert b["speedup_vs_cb"][name] == iv
        # exits replayed / drawn: CDB's tokens leave early, CB and full depth run r_max
        assert res["cb"]["mean_exit_depth"] == res["cdb_full_depth"]["mean_exit_depth"] == r_max
        assert 1 <= res["cdb_norefill"]["mean_exit_depth"] < r_max
        # the lookahead pipeline as served, min_coda_batch="auto" (its decisions recorded)
        for name in ("cdb_refill_k1", "cdb_refill_auto", "cdb_norefill"):
            assert res[name]["engine_config"]["pipeline"] is True and res[name]["pipeline"] is True
        assert res["cdb_refill_auto"]["engine_config"]["min_coda_batch"] == "auto"
        assert res["cdb_refill_auto"]["auto_coda"]["codas"] > 0
        assert res["cdb_refill_k1"]["engine_config"]["async_scheduling"] is True
    res = doc["ouro_1p4b"]["results"]
    assert res["cdb_refill_k1_no_pipeline"]["engine_config"]["pipeline"] is False
    assert res["cdb_refill_k1_no_async"]["engine_config"]["async_scheduling"] is False
    assert res["cb_sdpa"]["attention_backend"] == res["cdb_refill_k1_sdpa"]["attention_backend"] == "sdpa"
    # every adaptive Ouro mode replays the same depths (DEPTH_RULE): the pipeline's ratio compares like with like
    assert len({res[n]["exit_depths_crc32"] for n in NEW_MODES - {"cb_sdpa"}}) == 1
    ratios = doc["ouro_1p4b"]["ratios"]
    assert set(ratios) == set(G.RATIOS) and all(finite(v["median"]) for v in ratios.values())
    assert ratios["pipeline_speedup"]["time_of"] == "cdb_refill_k1_no_pipeline"
    assert doc["ouro_1p4b"]["exits"]["source"] == "docs/figures/ouro-demo-alpaca8.exits.json"


@pytest.mark.slow
def test_sigterm_saves_what_ran_and_what_was_in_flight(tmp_path):
    """SIGTERM half way (the second mode has started): the run exits 128 + 15 with its JSON whole,
    naming the signal, the mode in flight (inside its section) and what had finished; the first
    mode's results are in it. Fails on the old code, which died with the mode in flight unsaved."""
    proc = subprocess.Popen([sys.executable, "-m", "scripts.gpu_check", "--device", "cpu", "--small", "--sections",
                             "ouro_1p4b", "--num-requests", "4", "--out", str(tmp_path)], cwd=ROOT, env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seen = []
    try:
        for line in proc.stdout:
            seen.append(line)
            if "ouro_1p4b/cdb_refill_k1: start" in line:
                proc.send_signal(signal.SIGTERM)
                break
        rest, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, "".join(seen)[-3000:] + (rest or "")[-3000:]
    assert [f.name for f in tmp_path.iterdir()] == ["gpu_check.json"]
    doc = json.loads((tmp_path / "gpu_check.json").read_text())
    t = doc["terminated"]
    assert t["signal"] == "SIGTERM" and not doc["complete"] and doc["exit_code"] == 143
    assert t["in_flight"]["what"] == "ouro_1p4b/cdb_refill_k1" and t["in_flight"]["within"] == ["ouro_1p4b"]
    assert t["in_flight"]["phase"]  # what the mode was doing
    assert {"what": "ouro_1p4b/cb", "status": "ok"}.items() <= doc["ran"][0].items()
    assert doc["ouro_1p4b"]["modes_run"] == ["cb"] and "cb" in doc["ouro_1p4b"]["results"]


def test_a_tiny_budget_skips_every_section_with_its_estimate(tmp_path, quiet_threads):
    """Every section is guarded: with 0.5 s of budget none starts (each estimate is seconds), each
    is named in `skipped` with its estimate and why, and the run still ends with its JSON. Fails on
    the old code, which ran parity and every Ouro mode whatever the budget."""
    doc = G.main(["--device", "cpu", "--small", "--budget-s", "0.5", "--out", str(tmp_path)])
    assert doc["complete"] and doc["exit_code"] == 0 and doc["sections_done"] == [] and doc["ran"] == []
    skipped = {s["what"]: s for s in doc["skipped"]}
    assert list(skipped) == list(G.SECTIONS)
    for name in G.SECTIONS[:-1]:
        assert skipped[name]["estimated_s"] > 0.5 and "--budget-s" in skipped[name]["why"]
        assert doc[name]["skipped"] == skipped[name]
    assert "no ouro_1p4b mode ran" in skipped["huginn_3p5b"]["why"]
    assert doc["dispatch"]["op_us"] is None and "dispatch.op_us" in doc["nulls"]
    assert json.loads((tmp_path / "gpu_check.json").read_text())["skipped"] == doc["skipped"]


def test_each_mode_is_guarded_its_error_saved_as_it_ends_and_huginn_skipped(tmp_path, monkeypatch, quiet_threads):
    """Every Ouro mode fails (each "taking" 40 s of a 100 s budget): each error is in the JSON on disk
    before the next mode starts; the third mode is skipped (the estimate, 1.2 x the longest so far,
    no longer fits), with its estimate; Huginn is skipped because no Ouro mode ran. Fails on the old
    code (errors saved when the section ended, modes unguarded, Huginn started on a 0 s estimate)."""
    on_disk, clock = [], {"extra": 0.0}

    def failing_mode(run, key, model, mode, *a, **k):
        on_disk.append(json.loads(run.path.read_text()))
        clock["extra"] += 40.0  # the mode "takes" 40 s
        raise RuntimeError(f"{mode['name']} broke")

    monkeypatch.setattr(G, "run_mode", failing_mode)
    # the script's clock is this fake one alone (a busy machine's real seconds must not move the estimates)
    monkeypatch.setattr(G, "time", SimpleNamespace(perf_counter=lambda: clock["extra"]))
    monkeypatch.setitem(G.PRIORS["small"], "ouro_1p4b", 10.0)
    doc = G.main(["--device", "cpu", "--small", "--budget-s", "100", "--sections", "ouro_1p4b,huginn_3p5b",
                  "--out", str(tmp_path)])
    b = doc["ouro_1p4b"]
    first, second = G.MODES[0]["name"], G.MODES[1]["name"]
    assert set(b["errors"]) == {first, second} and b["modes_run"] == []
    assert b["errors"][second]["error"] == f"RuntimeError: {second} broke"
    assert on_disk[1]["ouro_1p4b"]["errors"][first]["error"] == f"RuntimeError: {first} broke"  # saved at once
    assert on_disk[1]["in_flight"]["what"] == f"ouro_1p4b/{second}"
    assert b["modes_skipped"] == [m["name"] for m in G.MODES[2:]]
    third = next(s for s in doc["skipped"] if s["what"] == f"ouro_1p4b/{G.MODES[2]['name']}")
    assert third["estimated_s"] == pytest.approx(48.0, abs=1.0) and "--budget-s" in third["why"]
    assert doc["huginn_3p5b"]["skipped"]["why"].startswith("every ouro_1p4b mode failed")
    assert "huginn_3p5b" not in doc["sections_done"]
    assert [r["status"] for r in doc["ran"]] == ["error", "error", "ok"]  # two modes, then the section


def test_past_the_budget_a_mode_keeps_min_repeats_and_the_rest_is_skipped(tmp_path, quiet_threads, monkeypatch):
    """A mode that starts runs MIN_REPEATS timed passes whatever the budget; past it, its extra
    passes and the modes after it are skipped, each named with why; Huginn, estimated from Ouro's
    mode, does not fit either. The script's clock is a fake one that moves 1 s per pass of the engine
    (and not otherwise): how fast this machine runs cannot move a guard's decision."""
    monkeypatch.setitem(G.PRIORS["small"], "ouro_1p4b", 0.0)  # (the first mode starts on a 2 s budget)
    monkeypatch.setattr(G, "MODES", [m for m in G.MODES if m["name"] in ("cdb_refill_k1", "cb")][::-1])
    clock, real_run_engine = {"s": 0.0}, G.run_engine

    def run_engine_1s(*a, **k):  # traced, instrumented, then timed passes: past the budget at the third
        clock["s"] += 1.0
        return real_run_engine(*a, **k)

    monkeypatch.setattr(G, "run_engine", run_engine_1s)
    monkeypatch.setattr(G, "time", SimpleNamespace(perf_counter=lambda: clock["s"]))
    doc = G.main(["--device", "cpu", "--small", "--budget-s", "2", "--num-requests", "4", "--sections",
                  "ouro_1p4b,huginn_3p5b", "--out", str(tmp_path)])
    b = doc["ouro_1p4b"]
    assert doc["complete"] and b["modes_run"] == ["cdb_refill_k1"] and b["modes_skipped"] == ["cb"]
    assert len(b["results"]["cdb_refill_k1"]["seconds_all"]) == G.MIN_REPEATS
    skipped = [s["what"] for s in doc["skipped"]]
    assert skipped == ["ouro_1p4b/cdb_refill_k1 timed passes 4-5", "ouro_1p4b/cb", "huginn_3p5b"]
    assert doc["estimate"]["huginn_3p5b"] > 0 and doc["autograd_check"]["ok"]
    assert json.loads((tmp_path / "gpu_check.json").read_text())["skipped"] == doc["skipped"]


def _engine(model, **kw):
    return LLMEngine(model, EngineConfig(max_batch_size=2, kv_cache_tokens=64, max_num_batched_tokens=16, **kw))


def test_autograd_problems_names_trainable_weights_and_graph_state():
    """The check finds a parameter that requires grad, a runner buffer with a grad_fn (what a
    capture with autograd on leaves: issue 62) and one nested in a container; a frozen engine is
    clean."""
    m = tiny_model("ouro-tiny", max_position=64)
    eng = _engine(m.requires_grad_(False))
    assert G.autograd_problems(eng) == []
    next(m.parameters()).requires_grad_(True)
    r = eng.runner
    r.state = r.state + torch.zeros(1, requires_grad=True)  # a grad_fn, as index_copy_ under autograd leaves
    r.layout.extra_ = {"rows": [torch.zeros(2, requires_grad=True)]}
    problems = G.autograd_problems(eng)
    assert any(p.startswith("parameter ") and p.endswith("requires grad") for p in problems)
    assert "runner.state: grad_fn AddBackward0" in problems
    assert "runner.layout.extra_['rows'][0]: requires_grad" in problems


def test_a_model_that_requires_grad_fails_the_run(tmp_path, monkeypatch, quiet_threads):
    """The autograd check runs on every engine of the run: weights handed in trainable are reported
    with the engine and when, and the run exits 1 (it still completes its sections)."""
    real = G.shape_model
    monkeypatch.setattr(G, "shape_model", lambda *a: real(*a).requires_grad_(True))
    monkeypatch.setattr(G, "MODES", [m for m in G.MODES if m["name"] == "cdb_refill_k1"])
    doc = G.main(["--device", "cpu", "--small", "--sections", "ouro_1p4b", "--num-requests", "2", "--repeats", "1",
                  "--out", str(tmp_path)])
    ag = doc["autograd_check"]
    assert doc["complete"] and doc["exit_code"] == 1 and not ag["ok"]
    assert [(f["engine"], f["when"]) for f in ag["failures"]] == [("ouro_1p4b/cdb_refill_k1", "start-up"),
                                                                  ("ouro_1p4b/cdb_refill_k1", "its passes")]
    for f in ag["failures"]:  # the weights; nothing autograd recorded on them (captures and passes: inference mode)
        assert f["problems"][0].startswith("parameter ") and not any("runner" in p for p in f["problems"])


class FakeGraph:
    """A CUDAGraph stand-in: replay counts, and remembers the static input it replayed."""

    def __init__(self, static):
        self.static, self.replayed = static, []

    def replay(self):
        self.replayed.append(self.static.clone())


def test_engine_dispatch_counts_ops_and_times_a_replay_on_the_scratch_slot(monkeypatch, tmp_path):
    """The CUDA path of the dispatch costs on a fake engine: the eager body's aten ops are counted
    and its host time divided by them; a graph replay is timed only after the graph's static input
    is set to the scratch slot (a replay of the last real slots would write a live sequence's state
    and KV); the top-level dispatch block takes the best-ranked measurement, and replay_us leaves
    `nulls`."""
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda dev: None)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    key = (Stage.CORE, 1, 1, 0)
    static = torch.tensor([5])  # the last launch's real slot
    graph = FakeGraph(static)
    calls = []

    def body(stage, slots, nb, r_max):
        calls.append(slots)
        return torch.abs(torch.neg(slots)).sum()  # 3 aten ops

    runner = SimpleNamespace(scratch_slot=7, device=torch.device("cpu"), body=body,
                             graph_keys=lambda fused, r: [(Stage.PRELUDE, 1, 1, 0), (Stage.CORE, 2, 1, 0), key],
                             graphs=SimpleNamespace(graphs={key: (graph, static, None)}))
    eng = SimpleNamespace(runner=runner, model=SimpleNamespace(device=cuda, cfg=SimpleNamespace(r_max=4)),
                          config=SimpleNamespace(policy="cdb", attention_backend="sdpa"))
    m = G.engine_dispatch(eng, eager=True, reps=3, replays=4)
    assert m["ops"] == 3 and m["stage"] == "core" and m["padded_batch"] == 1
    assert calls and all(c.tolist() == [7] for c in calls)  # the body ran on the scratch slot only
    assert len(graph.replayed) == 5 and all(s.tolist() == [7] for s in graph.replayed)
    assert finite(m["replay_us"]) and finite(m["op_us"]) and m["op_us"] == pytest.approx(m["launch_host_us"] / 3)

    run = G.Run(tmp_path, 100.0, {"skipped": [], "dispatch": {"op_us": None, "replay_us": None, "engines": []},
                                  "nulls": {"dispatch.replay_us": "not yet", "dispatch.op_us": "not yet"}}, {})
    G.record_dispatch(run, "tiny", {**m, "op_us": 9.0, "replay_us": 11.0}, rank=1)
    G.record_dispatch(run, "ouro_1p4b/cb_sdpa", m, rank=2)
    G.record_dispatch(run, "later tiny", {**m, "op_us": 1.0, "replay_us": 1.0}, rank=1)  # ranked lower: kept out
    d = run.doc["dispatch"]
    assert d["op_us"] == m["op_us"] and d["replay_us"] == m["replay_us"] and run.doc["nulls"] == {}
    assert d["op_us_source"].startswith("ouro_1p4b/cb_sdpa") and len(d["engines"]) == 3


def test_saves_are_atomic_and_a_signal_during_a_save_waits_for_it(tmp_path, monkeypatch):
    """Run.save writes a temporary file and os.replace-s it; a signal arriving mid-save is handled
    once the file is whole (then the JSON names it and Terminated is raised)."""
    run = G.Run(tmp_path, 100.0, {"skipped": [], "complete": False}, {})
    run.begin("ouro_1p4b")
    run.begin("ouro_1p4b/cb")
    run.phase(phase="timed pass 2 of 5")
    real_dumps, fired = json.dumps, []

    def dumps_with_a_signal(obj, **kw):
        if not fired:  # SIGTERM lands while the first dump runs: the handler (on_signal) is called there
            fired.append("signal")
            run.on_signal(signal.SIGTERM)
            fired.append("deferred")  # (it returned: the file being written is finished first)
        return real_dumps(obj, **kw)

    monkeypatch.setattr(G.json, "dumps", dumps_with_a_signal)
    with pytest.raises(G.Terminated):
        run.save()
    assert fired == ["signal", "deferred"] and [f.name for f in tmp_path.iterdir()] == ["gpu_check.json"]
    doc = json.loads((tmp_path / "gpu_check.json").read_text())
    assert doc["terminated"]["signal"] == "SIGTERM" and doc["exit_code"] == 143 and not doc["complete"]
    fl = doc["terminated"]["in_flight"]
    assert fl["what"] == "ouro_1p4b/cb" and fl["phase"] == "timed pass 2 of 5" and fl["within"] == ["ouro_1p4b"]


class FakeEvent:
    """A CUDA event stand-in: `record` stamps the fake device clock, which advances 1 ms per record
    plus whatever `FakeEvent.gap` says the device idled before it."""
    now, gap = 0.0, 0.0

    def __init__(self, enable_timing=False):
        self.t = None

    def record(self, stream):
        FakeEvent.now += 1.0 + FakeEvent.gap
        self.t = FakeEvent.now

    def elapsed_time(self, other):
        return other.t - self.t


def fake_cuda(monkeypatch, allocated):
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda dev: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda dev: None)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda dev: allocated.update(peak=allocated["now"]))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda dev: allocated["now"])
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda dev: allocated["peak"])


def test_launch_probe_measures_gaps_and_peaks_per_kind(monkeypatch):
    """The instrument's CUDA path: a launch's window is its two events, the idle time the windows'
    gaps (by pair of kinds), and each kind's peak the allocator's maximum over its launches less
    what was allocated when it began."""
    FakeEvent.now = 0.0
    alloc = {"now": 100, "peak": 100}
    fake_cuda(monkeypatch, alloc)
    probe = G.LaunchProbe(torch.device("cuda", 0))
    chunk = SimpleNamespace(seq_id=0, chunk=(0, 8), prompt_ids=[1] * 8)  # a prompt chunk in flight
    launches = [(Work(Stage.PRELUDE, [chunk]), 0.0, 900), (Work(Stage.CORE, []), 2.0, 150),
                (Work(Stage.CORE, []), 0.0, 160), (Work(Stage.CODA, []), 1.0, 120)]
    for work, gap, peak in launches:
        FakeEvent.gap = gap  # the device idles `gap` ms before this launch begins
        probe(work, None)
        FakeEvent.gap = 0.0
        alloc["peak"] = peak  # what the launch allocated at its height
        probe(work, 0.001)
    idle = probe.idle()
    # four 1 ms windows; between them 1 ms (the clock's tick per record) plus the idle before each
    assert idle["launches"] == 4 and idle["span_ms"] == 10.0
    assert idle["between_launches_ms"] == 6.0 and idle["idle_fraction"] == pytest.approx(0.6)
    assert idle["by_pair"]["mixed>core"] == {"count": 1, "total_ms": 3.0, "mean_ms": 3.0}
    assert idle["by_pair"]["core>core"]["total_ms"] == 1.0 and idle["gap_ms"]["max"] == 3.0
    assert idle["device_ms_by_kind"]["core"] == {"launches": 2, "total_ms": 2.0, "mean_ms": 1.0}
    assert probe.mem["mixed"] == {"launches": 1, "peak_over_base_bytes": 800, "peak_allocated_bytes": 900}
    assert probe.mem["core"]["launches"] == 2 and probe.mem["core"]["peak_over_base_bytes"] == 60
    assert probe.host_summary()["core"]["launches"] == 2

    # the memory report: the eager launch against the prefill reserve, the graph pool against decode's
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda dev: (10, 80))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda dev: 70)
    monkeypatch.setattr(torch.cuda, "memory_snapshot", lambda mempool_id=None, include_traces=True: [
        {"device": 0, "total_size": 300, "segment_pool_id": (1, 2)},
        {"device": 0, "total_size": 50, "segment_pool_id": (0, 0)}])
    eng = SimpleNamespace(config=SimpleNamespace(kv_cache_tokens=32), kv_bytes_per_token=4,
                          model=SimpleNamespace(device=torch.device("cuda", 0)),
                          runner=SimpleNamespace(graphs=SimpleNamespace(pool=(1, 2))))
    rep = G.memory_report(eng, probe, {"prefill": 1000, "logprobs": 400, "decode": 150, "graph_outputs": 50,
                                       "activation_reserve": 1250})
    assert rep["graph_pool_bytes"] == 300 and rep["kv_pool_bytes"] == 128
    assert rep["decode_reserve_bytes"] == 200  # the pool holds the largest body and the graphs' static outputs
    assert rep["checks"] == {"eager_within_reserve": True, "eager_over_reserve": 0.8,
                             "decode_within_reserve": False, "decode_over_reserve": 1.5}
    assert rep["measured"]["device_total_bytes"] == 80 and rep["measured"]["pass_peak_allocated_bytes"] == 900

"""scripts/gpu_check.py, the one command of the first GPU run (issue 38): its CPU dry run end to end
(so the script cannot rot before a GPU runs it), its budget, and its CUDA-only arithmetic (launch
events, allocator peaks, graph pool) on stand-ins for torch.cuda, since no CUDA device runs here."""
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from infer.engine.scheduler import Work
from infer.engine.sequence import Stage
from scripts import gpu_check as G

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "WANDB_MODE": "offline"}


def finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


@pytest.mark.slow
def test_cpu_dry_run_writes_the_whole_json(tmp_path):
    """`--device cpu --small`: every section runs; parity holds for every CPU variant; each mode has
    its speedup over CB with an interval, exact work counts and the memory reserve; the CUDA-only
    numbers are null with their reason."""
    p = subprocess.run([sys.executable, "-m", "scripts.gpu_check", "--device", "cpu", "--small", "--out",
                        str(tmp_path)], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "parity_float64 done" in p.stdout and "wrote" in p.stdout  # progress and the summary are printed
    doc = json.loads((tmp_path / "gpu_check.json").read_text())
    assert doc["complete"] and doc["device_type"] == "cpu" and doc["skipped"] == []
    assert doc["sections_done"] == ["parity_float64", "ouro_1p4b", "huginn_3p5b"]
    assert set(doc["nulls"]) >= {"idle", "graph_capture"}

    par = doc["parity_float64"]
    assert par["ok"] and par["failed"] == []
    for arch in ("ouro-tiny", "huginn-tiny"):
        for layout in ("last_exited", "shared"):
            for variant in ("eager", "paged", "cb"):
                assert par["cases"][f"{arch}/{layout}/{variant}"] is True
            assert par["cases"][f"{arch}/{layout}/eager_async"] is True or \
                par["cases"][f"{arch}/{layout}/eager_async"].startswith("refused")

    for key, r_max in (("ouro_1p4b", 4), ("huginn_3p5b", 16)):
        b = doc[key]
        assert b["errors"] == {} or all(e["refused"] for e in b["errors"].values()), b["errors"]
        assert {"cb", "cdb_refill_k1_no_async", "cdb_norefill", "cdb_full_depth"} <= set(b["modes_run"])
        assert b["model"]["r_max"] == r_max and b["workload"]["num_requests"] > 0
        res = b["results"]
        for name, r in res.items():
            assert len(r["seconds_all"]) == (5 if key == "ouro_1p4b" else 3)
            assert r["work"]["flops"] > 0 and r["work"]["weight_bytes"] > 0 and sum(r["work"]["launches"].values())
            assert finite(r["compute_ratio"]) and finite(r["weight_traffic_ratio"])
            assert r["idle"] is None and r["graph_capture"] is None
            mem = r["memory"]
            assert mem["measured"] is None and mem["checks"] is None and mem["kv_pool_bytes"] > 0
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
        assert res["cdb_refill_k1_no_async"]["engine_config"]["async_scheduling"] is False
        if "cdb_refill_k1" in res:
            assert res["cdb_refill_k1"]["engine_config"]["async_scheduling"] is True
            assert finite(b["async_speedup"]["median"])
    assert doc["ouro_1p4b"]["exits"]["source"] == "docs/figures/ouro-demo-alpaca8.exits.json"


@pytest.mark.slow
def test_budget_skips_the_optional_parts(tmp_path, monkeypatch, capsys):
    """Past --budget-s a mode runs MIN_REPEATS timed passes, not more, and the Huginn shape is
    skipped; the JSON names each skipped part."""
    monkeypatch.setattr(G, "parity_float64", lambda run, dev: {"ok": True, "cases": {}, "failed": []})
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)  # (leave this process's threads alone)
    doc = G.main(["--device", "cpu", "--small", "--budget-s", "0", "--num-requests", "4", "--out", str(tmp_path)])
    assert doc["complete"] and doc["huginn_3p5b"]["skipped"]["what"] == "huginn_3p5b"
    res = doc["ouro_1p4b"]["results"]
    assert all(len(r["seconds_all"]) == G.MIN_REPEATS for r in res.values())
    skipped = [s["what"] for s in doc["skipped"]]
    assert skipped == [f"{m['name']} timed passes 4-5" for m in G.MODES if m["name"] in res] + ["huginn_3p5b"]
    assert json.loads((tmp_path / "gpu_check.json").read_text())["skipped"] == doc["skipped"]


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
    chunk = SimpleNamespace(seq_id=0)
    launches = [(Work(Stage.PRELUDE, [], chunks=[chunk]), 0.0, 900), (Work(Stage.CORE, []), 2.0, 150),
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
    rep = G.memory_report(eng, probe, {"prefill": 1000, "logprobs": 400, "decode": 200, "activation_reserve": 1200})
    assert rep["graph_pool_bytes"] == 300 and rep["kv_pool_bytes"] == 128
    assert rep["checks"] == {"eager_within_reserve": True, "eager_over_reserve": 0.8,
                             "decode_within_reserve": False, "decode_over_reserve": 1.5}
    assert rep["measured"]["device_total_bytes"] == 80 and rep["measured"]["pass_peak_allocated_bytes"] == 900

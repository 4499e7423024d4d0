"""The simulator's two clocks (SimRunner, issue 38): the host's work runs beside the device's and
waits only where the engine reads a launch's results; on-device token re-entry takes the host's
coda -> prelude work off the critical path. Hand-computed timelines on a constant cost model."""
from __future__ import annotations

import pytest

from infer.engine.sequence import Stage
from infer.sim.cost import Call, HostCost
from infer.sim.runner import binomial_depths, depths_from_distribution
from infer.sim.simulate import simulate_mode
from infer.sim.workloads import Request
from looplm.presets import paper_config

CFG = paper_config("ouro-1.4b")


class ConstCost:
    """Every launch: `device` seconds on the device plus `host` seconds of host work (the share
    `host_seconds` names, as RooflineCost's); re-entry's read of the ids costs `resolve`."""

    def __init__(self, device: float, host: float, resolve: float, reentry_host: float | None = None,
                 pre: float | None = None):
        self.device, self.host, self.resolve = device, host, resolve
        self.reentry_host = host if reentry_host is None else reentry_host
        self.pre = pre  # the host's work before each launch (None: all of it)

    def __call__(self, c: Call) -> float:
        return self.device + self.host

    def host_seconds(self, stage: Stage, padded: int, reentry: bool = False) -> float:
        return self.reentry_host if reentry else self.host

    def resolve_seconds(self, stage: Stage, padded: int) -> float:
        return self.resolve

    def host_pre_seconds(self, stage: Stage, padded: int, reentry: bool = False) -> float:
        return self.host_seconds(stage, padded, reentry) if self.pre is None else self.pre


class DeviceOnly:
    """A cost model without a host share (as FittedCost): all of it is device time."""

    def __call__(self, c: Call) -> float:
        return 1e-3 * (1 + c.batch)


def run(cost, mode: dict, reqs: list[Request], overlap: bool, reentry: bool, **kw) -> dict:
    depths = depths_from_distribution(binomial_depths(CFG.r_max, 2.5), reqs, seed=0)
    return simulate_mode(CFG, reqs, {"name": "m", **mode}, cost, depths, overlap=overlap,
                         async_scheduling=reentry, kv_cache_tokens=1 << 16, **kw)


def test_cb_timeline_by_hand():
    """One request, CB (one fused launch per token), n launches, device time d > host h + read r.
    In series: n (h + d). Overlapped, the ids read at once: the same (each launch waits for the
    host to read the last one's rows, then for its own host work). With re-entry the host prepares
    launch k+1 while launch k runs: h + n d + r (the first launch's host work, the last one's read)."""
    d, h, r = 1e-3, 2e-4, 1e-4
    req = [Request([5] * 8, 6, 8, 6)]
    serial = run(ConstCost(d, h, r), {"policy": "cb"}, req, overlap=False, reentry=False, max_batch_size=1)
    n = len(serial["trace"])
    assert n == 6 and serial["seconds"] == pytest.approx(n * (h + d), rel=1e-12)
    synced = run(ConstCost(d, h, r), {"policy": "cb"}, req, overlap=True, reentry=False, max_batch_size=1)
    assert synced["seconds"] == pytest.approx(n * (h + d), rel=1e-12)
    over = run(ConstCost(d, h, r), {"policy": "cb"}, req, overlap=True, reentry=True, max_batch_size=1)
    assert over["seconds"] == pytest.approx(h + n * d + r, rel=1e-12)
    # host-bound (host h2 = 2d per launch): the host sets the pace, launch k starts at k h2 + (k - 2) r
    # (k >= 2; each step reads the previous launch's ids), the last ends d later and is read then
    h2 = 2 * d
    slow = run(ConstCost(d, h2, r), {"policy": "cb"}, req, overlap=True, reentry=True, max_batch_size=1)
    assert slow["seconds"] == pytest.approx(n * h2 + (n - 2) * r + d + r, rel=1e-12)
    assert over["exit_depths"] == serial["exit_depths"] == slow["exit_depths"]
    # the host's work split at the launch (pre before it, the rest after): where the host reads the
    # rows at once the rest waits for them, so nothing changes; with re-entry the rest runs beside
    # the launch, and only the first launch's pre precedes the device's work
    for p in (h / 4, h / 2):
        split = run(ConstCost(d, h, r, pre=p), {"policy": "cb"}, req, overlap=True, reentry=False, max_batch_size=1)
        assert split["seconds"] == pytest.approx(n * (h + d), rel=1e-12)
        split = run(ConstCost(d, h, r, pre=p), {"policy": "cb"}, req, overlap=True, reentry=True, max_batch_size=1)
        assert split["seconds"] == pytest.approx(p + n * d + r, rel=1e-12)


@pytest.mark.parametrize("lookahead", [False, True])
def test_cdb_overlap_orders_and_keeps_the_schedule(lookahead):
    """CDB refill on a batch: every variant runs the same launches with the same exits (the engine
    decides, not the clock); the device's work bounds the time from below; each overlap takes host
    time off the critical path: re-entry (coda -> prelude) and, with lookahead, the pipeline (core
    step t+1 launched before step t's scores are read)."""
    reqs = [Request([3 + i] * (4 + i), 5 + i % 4, 4 + i, 5 + i % 4) for i in range(8)]
    d, h, r = 1e-4, 6e-5, 2e-5
    mode = {"policy": "cdb", "refill": True, "min_coda_batch": 1}
    kw = dict(max_batch_size=8, lookahead=lookahead)
    serial = run(ConstCost(d, h, r), mode, reqs, overlap=False, reentry=False, **kw)
    synced = run(ConstCost(d, h, r), mode, reqs, overlap=True, reentry=False, **kw)
    over = run(ConstCost(d, h, r), mode, reqs, overlap=True, reentry=True, **kw)
    launches = len(serial["trace"])
    assert serial["seconds"] == pytest.approx(launches * (h + d), rel=1e-12)
    for x in (synced, over):
        assert x["exit_depths"] == serial["exit_depths"]
        assert [(t["stage"], t["batch"]) for t in x["trace"]] == [(t["stage"], t["batch"]) for t in serial["trace"]]
    assert launches * d < over["seconds"] < synced["seconds"] < serial["seconds"]


def test_no_host_share_means_no_overlap():
    """A cost model that names no host share (FittedCost: the host's time is inside its fit) is
    charged in series either way: the two clocks change nothing."""
    reqs = [Request([3 + i] * 6, 7, 6, 7) for i in range(4)]
    mode = {"policy": "cdb", "refill": True}
    a = run(DeviceOnly(), mode, reqs, overlap=False, reentry=False, max_batch_size=4)
    b = run(DeviceOnly(), mode, reqs, overlap=True, reentry=True, max_batch_size=4)
    assert b["seconds"] == pytest.approx(a["seconds"], rel=1e-12)
    assert a["seconds"] == pytest.approx(sum(t["seconds"] for t in a["trace"]), rel=1e-12)


def test_host_table_with_reentry():
    """HostCost: the re-entry table where measured (its stage entries and the ids' read,
    resolve_<stage>), interpolated in the batch as the synchronous one; without it, re-entry is
    charged the synchronous table and no read."""
    sync = {"16": {"coda": {"median": 10.0}}, "64": {"coda": {"median": 40.0}}}
    asyn = {"16": {"coda": {"median": 20.0}, "resolve_coda": {"median": 4.0}},
            "64": {"coda": {"median": 50.0}, "resolve_coda": {"median": 16.0}}}
    both = HostCost(sync, asyn)
    assert both(Stage.CODA, 40) == pytest.approx(25e-6)
    assert both(Stage.CODA, 40, reentry=True) == pytest.approx(35e-6)
    assert both.resolve(Stage.CODA, 40) == pytest.approx(10e-6) and both.resolve(Stage.FUSED, 40) == 0.0
    only = HostCost(sync)
    assert only(Stage.CODA, 64, reentry=True) == pytest.approx(40e-6) and only.resolve(Stage.CODA, 64) == 0.0


def test_a_model_without_a_gate_head_simulates_with_its_own_criterion():
    """A gateless model (Huginn-3.5B's release, a gate-stripped folder; issue 59) runs in the
    simulator: the engine's stand-in criterion gets its gate head there, the runner still charges
    the model's own criterion (kl) and the exits are the recorded ones."""
    from looplm.config import replace
    from infer.sim.runner import SimModel
    cfg = replace(paper_config("huginn-3.5b"), exit_gate=False, exit_criterion="kl", exit_threshold=1e-3)
    assert SimModel(cfg).cfg.exit_gate and SimModel(cfg).cfg.exit_criterion == "kl"
    reqs = [Request([3 + i] * (4 + i), 5 + i % 4, 4 + i, 5 + i % 4) for i in range(4)]
    depths = depths_from_distribution(binomial_depths(cfg.r_max, 9.0), reqs, seed=0)
    out = simulate_mode(cfg, reqs, {"name": "m", "policy": "cdb", "refill": True, "min_coda_batch": 1},
                        ConstCost(1e-4, 6e-5, 2e-5), depths, overlap=True, kv_cache_tokens=1 << 16, max_batch_size=4)
    assert out["exit_depths"] and out["seconds"] > 0

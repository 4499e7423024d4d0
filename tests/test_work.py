"""Exact work counts (infer/sim/work.py): the same bench command gives the same counts, and the
counts are what the exit depths and the requests say they must be."""
from infer.bench import offline
from infer.sim import stats
from looplm import tiny_model

from helpers import model


MODES = [m for m in offline.modes_for([1], norefill=False, full_depth=True) if m["name"] != "cb_separate"]


def _bench(m, seed=0):
    return offline.bench_workload(m, None, "alpaca", num_requests=4, scale=0.03, seed=seed, modes=MODES, repeats=1,
                                  base={"max_batch_size": 4, "exit_threshold": 0.55}, warmup=False)


def test_work_counts_are_exact_and_reproducible():
    m = model("ouro-tiny")
    a, b = _bench(m), _bench(m)
    assert [r["work"] for r in a["results"]] == [r["work"] for r in b["results"]]
    cfg, by = m.cfg, {r["mode"]: r for r in a["results"]}
    prompt = a["workload"]["prompt_tokens"]
    for r in a["results"]:
        w, hist = r["work"], r["exit_depth_hist"]
        assert w["layer_token_passes"]["lm_head_rows"] == r["output_tokens"]  # one head row per token
        decode = sum(hist.values())
        depth_sum = sum(d * c for d, c in hist.items())
        if r["engine_config"]["full_depth"]:
            depth_sum = decode * cfg.r_max
        # every prompt position runs r_max core steps, every decode token its exit depth
        assert w["layer_token_passes"]["core"] == (depth_sum + prompt * cfg.r_max) * cfg.n_core, r["mode"]
    assert by["cdb_refill_k1"]["compute_ratio"] < 1 and by["cb"]["compute_ratio"] == 1
    assert by["cdb_full_depth"]["compute_ratio"] >= 1  # full depth does all of CB's work, in more launches
    assert by["cdb_refill_k1"]["work"]["launches"]["core"] > 0 and by["cb"]["work"]["launches"]["core"] == 0


def test_huginn_counts_its_prelude_and_coda_layers():
    m = tiny_model("huginn-tiny")
    blk = _bench(m)
    r = next(r for r in blk["results"] if r["mode"] == "cb")
    p = r["work"]["layer_token_passes"]
    rows = r["output_tokens"] - 4 + blk["workload"]["prompt_tokens"]  # decode items + prompt positions
    assert p["prelude"] == rows * m.cfg.n_prelude and p["coda"] == rows * m.cfg.n_coda
    assert r["work"]["weight_bytes"] > 0 and r["work"]["kv_rows_read"] > 0


def test_speedup_interval_says_what_it_knows():
    iv = stats.ratio_interval([2.0, 2.1, 1.9, 2.0, 2.2], [1.0, 1.1, 0.9, 1.0, 1.05])
    assert iv["verdict"] == "faster" and iv["lo"] > 1.5 and iv["lo"] <= iv["median"] <= iv["hi"]
    assert stats.ratio_interval([1.0, 1.2, 0.9, 1.1], [1.1, 1.0, 1.0, 1.0])["verdict"] == "within noise"
    assert stats.ratio_interval([1.0, 1.0, 1.0], [2.0, 2.1, 1.9])["verdict"] == "slower"
    # the same inputs give the same interval (a fixed bootstrap seed)
    assert stats.ratio_interval([1, 2, 3], [2, 2, 2]) == stats.ratio_interval([1, 2, 3], [2, 2, 2])

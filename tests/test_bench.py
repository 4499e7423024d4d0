"""Measurement: bounds on hand-computed cases, the latency fit on synthetic timings, workloads,
the bench JSON, the simulator against a measured CPU run, and `make demo` in its tiny setting."""
import json

import numpy as np
import pytest

from infer.sim import bounds, latency, workloads
from infer.sim.cost import Call, FittedCost, RooflineCost, h100_kv_tokens
from infer.sim.runner import SimModel, SimRunner, binomial_depths, depths_from_distribution
from infer.sim.simulate import replay_fitted, simulate, simulate_mode
from infer.engine.sequence import Stage
from looplm.presets import paper_config
from infer.bench import offline as bench
from looplm.config import LoopConfig


def tiny_cfg(arch="ouro", **kw):
    # d=4, one head of 4, ffn 8, vocab 10: small enough to count by hand
    base = dict(arch=arch, vocab_size=10, hidden_size=4, intermediate_size=8, num_heads=1, num_kv_heads=1, head_dim=4,
                n_prelude=0, n_core=1, n_coda=0, r_max=4)
    return LoopConfig(**{**base, **kw})


# ---------------------------------------------------------------------------------- bounds
def test_bounds_hand_computed_ouro():
    cfg = tiny_cfg()
    # layer weights: qkv 4*3*4 = 48, o 16, mlp 3*4*8 = 96 -> 160; FLOPs 2*160 + attention 4*1*4*c
    assert bounds.layer_params(cfg) == 160
    assert bounds.layer_flops(cfg, 5) == 320 + 80
    f0, fr = bounds.f0_fr(cfg, 5)
    assert fr == 400 + 2 * 4  # + Ouro's exit gate (d -> 1)
    assert f0 == 2 * 4 * 10  # the LM head; the embedding is a lookup
    assert bounds.s_dec(f0, fr, 4, 2) == pytest.approx((80 + 4 * 408) / (80 + 2 * 408))
    b = bounds.bound(cfg, 2.0, 0.25, 5)
    assert b["s_dec"] == pytest.approx(1712 / 896)
    assert b["s_e2e"] == pytest.approx(1 / (0.25 + 0.75 * 896 / 1712))


def test_bounds_hand_computed_huginn():
    cfg = tiny_cfg("huginn", n_prelude=1, n_coda=2, r_max=8, qk_bias=False, exit_gate=False)
    f0, fr = bounds.f0_fr(cfg, 0)
    assert fr == 320 + 2 * 8 * 4  # one core layer + the adapter (2d -> d)
    assert f0 == 3 * 320 + 2 * 4 * 10  # prelude + 2 coda layers + head
    assert bounds.s_dec(f0, fr, 8, 8) == 1.0


def test_bound_limits():
    assert bounds.s_dec(0, 1, 4, 2) == 2.0  # F0 = 0: r_max / d
    assert bounds.s_dec(10, 1, 4, 2) < 2.0
    assert bounds.s_e2e(0.0, 1.7) == pytest.approx(1.7)
    assert bounds.s_e2e(1.0, 1.7) == 1.0
    assert bounds.s_e2e(0.5, 2.0) == pytest.approx(1 / (0.5 + 0.25))
    with pytest.raises(ValueError):
        bounds.s_e2e(1.5, 2.0)


# ---------------------------------------------------------------------------------- latency model
def test_latency_fit_recovers_known_coefficients():
    rng = np.random.default_rng(0)
    delta, gamma, alpha = 2e-3, 3e-5, 4e-8
    nb = rng.integers(1, 65, 300)
    nc = nb * rng.integers(16, 2048, 300)
    t = (delta + gamma * nb + alpha * nc) * (1 + 0.01 * rng.standard_normal(300))
    trace = [{"stage": "core", "batch": int(b), "padded": int(b), "context": int(c), "seconds": float(s)}
             for b, c, s in zip(nb, nc, t)]
    f = latency.fit_trace(trace)["core"]
    assert f.delta == pytest.approx(delta, rel=0.05)
    assert f.gamma == pytest.approx(gamma, rel=0.1)
    assert f.alpha == pytest.approx(alpha, rel=0.05)
    assert f.r2 > 0.98
    assert f.saturation_batch(512) == pytest.approx(f.delta / (f.gamma + 512 * f.alpha))


def test_latency_fit_is_non_negative():
    # a flat stage with noise: no negative slope, the fit keeps the mean
    rng = np.random.default_rng(1)
    nb = rng.integers(1, 33, 50)
    t = 1e-3 + 1e-5 * rng.standard_normal(50)
    d, g, a, r2 = latency.fit_linear(nb, nb * 10, t)
    assert g >= 0 and a >= 0 and d == pytest.approx(1e-3, rel=0.02)


def test_latency_sweep_runs():
    from looplm import tiny_model
    rows = latency.sweep(tiny_model("ouro-tiny"), [1, 4], [8, 32], repeats=1)
    assert len(rows) == 4 and all(r["seconds"] > 0 for r in rows)
    assert {r["context"] for r in rows} == {8, 32, 4 * 8, 4 * 32}


# ---------------------------------------------------------------------------------- workloads
def test_workloads_deterministic_scaled_clamped():
    a = workloads.make_requests("sharegpt", 20, seed=3, scale=0.1, max_model_len=64, vocab_size=50)
    b = workloads.make_requests("sharegpt", 20, seed=3, scale=0.1, max_model_len=64, vocab_size=50)
    c = workloads.make_requests("sharegpt", 20, seed=4, scale=0.1, max_model_len=64, vocab_size=50)
    assert a == b and a != c
    for r in a:
        assert 1 <= r.prompt_len and 1 <= r.output_len and r.prompt_len + r.output_len <= 64
        assert all(workloads.FIRST_ID <= t < 50 for t in r.prompt_ids)
        if (r.trace_prompt_len * 0.1 + r.trace_output_len * 0.1) <= 60:
            assert r.prompt_len == max(1, round(r.trace_prompt_len * 0.1))
    assert workloads.scaled_lengths(4000, 100, 1.0, 512) == (499, 12, True)
    assert 0 < workloads.fit_scale("arxiv", 512) < 0.2 and workloads.fit_scale("alpaca", 4096) == 1.0
    with pytest.raises(ValueError):
        workloads.make_requests("nope", 2)


def test_workload_traces_match_published_means():
    for name, (p, o) in {"alpaca": (17.96, 58.55), "sharegpt": (161.31, 337.99), "arxiv": (2588.08, 291.43)}.items():
        rows = workloads.load_trace(name)
        assert np.mean([r[0] for r in rows]) == pytest.approx(p, rel=0.03)
        assert np.mean([r[1] for r in rows]) == pytest.approx(o, rel=0.03)


class ByteTokenizer:
    def encode(self, text):
        return list(text.encode("utf-8"))


def test_workload_prompts_are_real_text_with_a_tokenizer():
    reqs = workloads.make_requests("alpaca", 8, seed=0, max_model_len=256, tokenizer=ByteTokenizer())
    for r in reqs:
        clamped = workloads.scaled_lengths(r.trace_prompt_len, r.trace_output_len, 1.0, 256)[2]
        assert r.prompt_len >= 1 and (clamped or r.prompt_len == r.trace_prompt_len)
        text = bytes(r.prompt_ids).decode("utf-8", errors="replace")
        assert sum(ch.isalpha() or ch.isspace() for ch in text) > 0.7 * len(text)


def test_mean_decode_context():
    r = workloads.Request([1] * 10, 4, 10, 4)  # decode tokens 2..4 attend 11, 12, 13 positions
    assert workloads.mean_decode_context([r]) == pytest.approx(12)


# ---------------------------------------------------------------------------------- bench
@pytest.fixture(scope="module")
def bench_json(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    bench.main(["--model", "ouro-tiny", "--workloads", "alpaca", "--num-requests", "3", "--scale", "0.2",
                "--ks", "2", "--repeats", "1", "--out", str(out), "--save-trace"])
    return out, json.loads((out / "bench_ouro-tiny.json").read_text())


@pytest.mark.slow  # its fixture runs the whole offline bench (~10 s)
def test_bench_json_has_every_field(bench_json):
    out, data = bench_json
    assert (out / "bench_ouro-tiny.png").stat().st_size > 1000
    blk = data["workloads"][0]
    modes = [r["mode"] for r in blk["results"]]
    assert modes == ["cb", "cb_separate", "cdb_norefill", "cdb_refill_k2", "cdb_full_depth"]
    for r in blk["results"]:
        for k in bench.RESULT_FIELDS + ("seconds", "num_requests", "output_tokens"):
            assert k in r and r[k] is not None, k
        assert r["output_tokens"] == blk["workload"]["output_tokens"]  # same lengths for every policy
        # the timed pass's own prefix-cache lookups (the warm-up's are not counted, its cache is reset)
        on = r["engine_config"]["enable_prefix_caching"]
        assert r["prefix_cache"]["queries"] == (blk["workload"]["prompt_tokens"] if on else 0)
    cb = blk["results"][0]
    assert cb["speedup_vs_cb"] == 1.0 and cb["s_e2e"] == 1.0 and cb["mean_exit_depth"] == 4
    assert 0 <= cb["alpha"] < 1
    cdb = blk["results"][2]
    assert cdb["s_e2e"] == pytest.approx(bounds.s_e2e(cdb["alpha"], cdb["s_dec"]))
    assert cdb["fraction_of_bound"] == pytest.approx(cdb["speedup_vs_cb"] / cdb["s_e2e"])
    assert "core" in blk["latency_fit"] and "b_star" in blk["latency_fit"]["core"]
    assert "full_depth_vs_cb" in blk and blk["workload"]["scale"] == 0.2
    # the saved trace feeds the latency CLI and the simulator's replay with the fitted cost model
    latency.main(["fit", str(out / "trace_ouro-tiny.json")])
    blocks = replay_fitted(out / "trace_ouro-tiny.json")
    assert [r["mode"] for r in blocks[0]["results"]] == modes
    assert all(r["measured_tokens_per_s"] > 0 and r["output_tokens"] == cb["output_tokens"] for r in blocks[0]["results"])


def test_throughput_api():
    r = bench.throughput("ouro-tiny", policy="cdb", refill=True, min_coda_batch=1, workload="alpaca", num_requests=2,
                         scale=0.1, max_batch_size=4)
    for k in ("output_tokens_per_s", "requests_per_s", "mean_exit_depth", "seconds", "num_requests", "output_tokens"):
        assert k in r
    assert r["num_requests"] == 2 and r["output_tokens"] > 0 and 1 <= r["mean_exit_depth"] <= 4


# ---------------------------------------------------------------------------------- simulator
def test_sim_with_fitted_cost_reproduces_a_measured_run():
    """The real engine on a cost model fitted to a measured run replays that run's schedule (same
    steps, batches, contexts and exit depths) and charges exactly the cost model for each step."""
    from infer.engine.llm import load_model
    m, _ = load_model("huginn-tiny")
    reqs = workloads.make_requests("alpaca", 6, seed=1, scale=0.3, max_model_len=m.cfg.max_position, vocab_size=256)
    base = dict(max_batch_size=4, exit_threshold=0.5)
    for mode in bench.modes_for([2], full_depth=False)[2:]:  # cdb no-refill and refill (after cb, cb_separate)
        bench.run_mode(m, None, reqs[:2], mode, base, keep_trace=False)
        raw = bench.run_mode(m, None, reqs, mode, base)
        fits = latency.fit_trace(raw["trace"])
        per_step = (raw["seconds"] - raw["traced_seconds"]) / raw["steps"]
        s = simulate_mode(m.cfg, reqs, mode, FittedCost(fits, per_step), raw["exit_depths"], max_batch_size=4,
                              kv_cache_tokens=4 * m.cfg.max_position)
        assert s["steps"] == raw["steps"]
        assert {k: v["calls"] for k, v in s["stages"].items()} == {k: v["calls"] for k, v in raw["stages"].items()}
        assert s["exit_depths"] == raw["exit_depths"]
        key = ("stage", "batch", "padded", "context")
        assert [[r[k] for k in key] for r in s["trace"]] == [[r[k] for k in key] for r in raw["trace"]]
        cost = FittedCost(fits, per_step)
        expected = sum(cost(Call(Stage(r["stage"]), r["batch"], r["padded"], r["tokens"], r["context"]))
                       for r in raw["trace"])
        assert s["seconds"] == pytest.approx(expected, rel=1e-9)


def test_sim_depths_and_lookahead():
    cfg = paper_config("ouro-1.4b")
    probs = binomial_depths(4, 2.5)
    assert sum(probs.values()) == pytest.approx(1) and sum(d * p for d, p in probs.items()) == pytest.approx(2.5)
    reqs = workloads.make_requests("alpaca", 6, seed=0, scale=0.5, max_model_len=cfg.max_position, vocab_size=100)
    depths = depths_from_distribution(probs, reqs, seed=0)
    cost = RooflineCost(cfg)
    mode = {"name": "cdb_refill_k1", "policy": "cdb", "refill": True, "min_coda_batch": 1}
    r = simulate_mode(cfg, reqs, mode, cost, depths, max_batch_size=8, kv_cache_tokens=8 * 4096)
    assert r["exit_depths"] == [[4] + d[1:] for d in depths]  # every token left at its drawn depth
    la = simulate_mode(cfg, reqs, mode, cost, depths, max_batch_size=8, kv_cache_tokens=8 * 4096, lookahead=True)
    assert la["exit_depths"] == [[4] + [max(2, x) for x in d[1:]] for d in depths]


def test_sim_h100_roofline_orders_the_modes():
    cfg = paper_config("ouro-1.4b")
    reqs = workloads.make_requests("alpaca", 24, seed=0, max_model_len=cfg.max_position, vocab_size=100)
    depths = depths_from_distribution(binomial_depths(4, 2.5), reqs)
    blk = simulate(cfg, reqs, RooflineCost(cfg), depths, bench.modes_for([1]), workload="alpaca",
                       max_batch_size=16, kv_cache_tokens=h100_kv_tokens(cfg))
    by = {r["mode"]: r for r in blk["results"]}
    assert by["cdb_refill_k1"]["speedup_vs_cb"] > 1.1
    assert by["cdb_refill_k1"]["fraction_of_bound"] <= 1.02
    assert 0.9 < blk["full_depth_vs_cb"] <= 1.0


# ---------------------------------------------------------------------------------- demo
def test_make_demo_tiny(tmp_path, capsys):
    from scripts import demo
    assert demo.main(["--tiny", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "cdb_refill_k1" in out and "bound S_e2e" in out and "plot:" in out and "random-weight preset" in out
    assert (tmp_path / "bench_ouro-tiny.png").exists()


@pytest.mark.slow
def test_make_demo_real_structure_part(tmp_path, capsys):
    """Part 1 of `make demo` at test size: exits recorded on ouro-demo, replayed on a dummy preset
    (ouro-tiny here; ouro-mini in the demo), verdict lines with intervals, the H100 simulation."""
    import json

    from scripts import demo
    assert demo.main(["--models", "ouro", "--workloads", "alpaca", "--num-requests", "3", "--repeats", "2",
                      "--real-preset", "ouro-tiny", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "Part 1: real structure" in out and "Part 2" in out and "H100 sim (Ouro-1.4B)" in out
    line = next(ln for ln in out.splitlines() if ln.strip().startswith("alpaca") and "x CB [" in ln)
    assert "work/CB" in line and "S_e2e" in line and any(v in line for v in ("faster", "slower", "within noise"))
    doc = json.loads((tmp_path / "ouro-demo.exits.json").read_text())
    assert doc["complete"] and len(doc["workloads"]["alpaca"]["requests"]) == 3
    bench = json.loads((tmp_path / "bench_ouro-tiny.json").read_text())
    res = {r["mode"]: r for r in bench["workloads"][0]["results"]}
    assert bench["workloads"][0]["replayed_exits"]["model"].endswith("ouro-demo")
    assert res["cdb_refill_k1"]["speedup_interval"]["rounds"] == 2


def test_bench_host_runs_and_reports_every_stage(tmp_path, capsys):
    """python -m infer.bench.host on the current engine (it once broke silently when the engine's
    defaults changed): every stage kind has median and p90, attention rows are counted."""
    import json

    from infer.bench import host
    out = tmp_path / "host.json"
    host.main(["--batches", "16", "--steps", "6", "--out", str(out)])
    d = json.loads(out.read_text())
    assert set(d["host_us"]["16"]) == {"prefill", "prelude", "core", "coda", "fused"}
    assert all(v["median"] > 0 and v["p90"] >= v["median"] for v in d["host_us"]["16"].values())
    # with on-device token re-entry: the same stages, and the reads of the ids one launch later
    assert set(d["host_async_us"]["16"]) == {"prefill", "prelude", "core", "coda", "fused", "resolve_coda",
                                             "resolve_fused"}
    assert all(v["median"] > 0 for v in d["host_async_us"]["16"].values())
    att = d["attention"]["16"]
    assert att["rows_paged"] >= att["context"] > 0 and att["rows_read"] >= att["rows_paged"]


def test_bench_host_vs_auto_scales_a_host_table_stage_by_stage(tmp_path):
    """--vs-auto: the CDB stages under K=1 and min_coda_batch=auto side by side, and with --onto a
    committed table whose CDB stages are scaled by what auto measured (the table a simulation of auto
    charges): each entry x its stage's ratio at the nearest measured batch, CB's fused row as it was."""
    from infer.bench import host
    stages = ("prelude", "core", "coda", "fused")
    base = {"host_us": {str(b): {k: {"median": 10.0 * b, "p90": 20.0 * b, "n": 5} for k in stages} for b in (16, 64)},
            "pre_us": {"16": {"core": {"median": 4.0, "p90": 5.0, "n": 5}}}, "command": "the base's"}
    (tmp_path / "base.json").write_text(json.dumps(base))
    out = tmp_path / "auto.json"
    host.main(["--vs-auto", "--batches", "16", "--steps", "6", "--repeats", "2", "--onto", str(tmp_path / "base.json"),
               "--out", str(out)])
    d = json.loads(out.read_text())
    r = d["vs_auto"]["16"]
    assert set(r) == {"prelude", "core", "coda"}
    assert all(v[key]["k1"] > 0 and v[key]["auto"] / v[key]["k1"] == pytest.approx(v[key]["ratio"])
               for v in r.values() for key in ("host_us", "pre_us"))
    for v in r.values():  # each round's two passes paired: the median of their ratios and its interval
        iv = v["host_us"]["paired"]
        assert iv["rounds"] == 2 and iv["lo"] <= iv["median"] <= iv["hi"]
    for b in ("16", "64"):  # (batch 64 takes batch 16's ratios: the only ones measured)
        for k in ("prelude", "core", "coda"):
            assert d["host_us"][b][k]["median"] == pytest.approx(10.0 * int(b) * r[k]["host_us"]["paired"]["median"])
            assert d["host_us"][b][k]["p90"] == pytest.approx(20.0 * int(b) * r[k]["host_us"]["paired"]["median"])
        assert d["host_us"][b]["fused"] == base["host_us"][b]["fused"]
    assert d["pre_us"]["16"]["core"]["median"] == pytest.approx(4.0 * r["core"]["pre_us"]["paired"]["median"])
    assert d["command"] == "the base's" and d["vs_auto_command"].startswith("python -m infer.bench.host --vs-auto")


def test_prefix_bench_runs_and_caching_helps(capsys):
    """python -m infer.bench.prefix on the simulator: same requests with caching off and on; every
    request after the first ones hits the shared 512-token prefix, so fewer prompt tokens are
    prefilled and TTFT falls."""
    from infer.bench import prefix
    d = prefix.main(["--engine", "sim", "--num-requests", "40", "--rate", "200"])
    off, on = d["results"]["off"], d["results"]["on"]
    assert off["prefix_cache_hits"] == 0 and on["prefix_cache_hit_rate"] > 0.8
    assert on["prompt_tokens_prefilled"] == off["prompt_tokens_prefilled"] - on["prefix_cache_hits"]
    assert on["ttft_mean_s"] < off["ttft_mean_s"] and d["ttft_mean_ratio_off_over_on"] > 1
    assert json.loads(capsys.readouterr().out)["results"]["on"] == on


def test_sim_charges_swaps_at_pcie_bandwidth():
    """SimRunner.swap: a preemption costs its KV blocks + state slot each way at the PCIe bandwidth
    (the engine's own swap_bytes count), added to the virtual clock; scheduling does not change."""
    from functools import partial

    from infer import EngineConfig, LLMEngine, SamplingParams

    cfg = paper_config("ouro-1.4b")
    reqs = [workloads.Request([3 + i] * 20, 30, 20, 30) for i in range(8)]
    depths = depths_from_distribution(binomial_depths(4, 2.5), reqs)
    runs = []
    for bw in (1e10, 1e30):
        eng = LLMEngine(SimModel(cfg), EngineConfig(kv_cache_tokens=160, watermark=0.0, max_batch_size=8,
                                                         exit_criterion="learned", exit_threshold=0.5),
                        runner_cls=partial(SimRunner, cost=RooflineCost(cfg), depths=depths, pcie_bandwidth=bw))
        for i, r in enumerate(reqs):
            eng.add_request(r.prompt_ids, SamplingParams(max_tokens=r.output_len, ignore_eos=True),
                            request_id=str(i))
        while eng.has_unfinished():
            eng.step()
        runs.append((eng.runner, eng.metrics()))
    (slow, m), (fast, m2) = runs
    assert m["preemptions"] > 0 and m == m2
    assert slow.swap_seconds == pytest.approx(m["swap_bytes"] / 1e10)
    assert slow.clock - fast.clock == pytest.approx(slow.swap_seconds - fast.swap_seconds)


# ---------------------------------------------------------------------------------- vs the HF reference
def test_reference_bench_engine_side_on_ouro_demo():
    """infer/bench/reference.py's engine side (the reference side needs its scratch venv): the prompts fit the
    context with room for the new tokens; CB runs at full depth with one fused launch per token step; CDB
    with the checkpoint's trained exits exits earlier; the ratio rows read each mode's paired reference."""
    from pathlib import Path

    from infer.bench import reference as ref
    model = str(Path(ref.ROOT) / "checkpoints" / "ouro-demo")
    ps = ref.prompts(model, 4, 8, ref.ALPACA)
    assert len(ps) == 4 and all(0 < len(p) <= 128 - 8 for p in ps)
    job = {"prompts": ps, "batch": 4, "new_tokens": 8, "threads": 1}
    cb = ref.engine_worker(model, {**job, "mode": "cb"})
    cdb = ref.engine_worker(model, {**job, "mode": "cdb"})
    assert [len(o) for o in cb["outputs"]] == [8] * 4 and cb["mean_exit_depth"] == 4.0
    assert set(cb["stage_calls"]) == {"fused"} and cb["stage_calls"]["fused"] == 8  # the prompts ride in the first
    assert cdb["mean_exit_depth"] < 4.0 and set(cdb["stage_calls"]) == {"prelude", "core", "coda"}
    with pytest.raises(SystemExit, match="unknown mode 'xx'"):
        ref.main(["--ref-python", "python", "--ref-code", ".", "--runs", "xx:4"])


def test_a_cpu_engine_keeps_freed_memory_once_per_process():
    """infer/engine/cpu_malloc.py: a CPU engine fixes glibc's mmap and trim thresholds once (a process
    that names an allocator or the thresholds itself is left alone), in a fresh process."""
    import os
    import subprocess
    import sys
    code = ("from infer.engine import cpu_malloc as m; from infer import LLMEngine; from looplm import tiny_model; "
            "LLMEngine(tiny_model('ouro-tiny')); print(m._done)")
    env = {k: v for k, v in os.environ.items() if k not in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_",
                                                            "LD_PRELOAD")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[True]"
    out = subprocess.run([sys.executable, "-c", code], env={**env, "MALLOC_MMAP_THRESHOLD_": "131072"},
                         capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "[False]"

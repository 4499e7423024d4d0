"""`python -m infer.sim`: the simulator's command line (simulate.py) on a GPU roofline (cost.py).

    python -m infer.sim --model ouro-1.4b --workloads alpaca sharegpt arxiv --ks 1 4 16 --out outputs/sim

The output is the offline benchmark's JSON (python -m infer.bench), with virtual seconds. Each launch
is also charged the host's cost of issuing it (infer/sim/dispatch.py: --op-us per eager aten op, the
ops counted from the engine, --replay-us per CUDA graph replay, or --dispatch-json); each mode's
result has `dispatch_s` (host seconds charged for it) and `eager_ops`. Decode attention is priced as
the engine's CUDA default, the paged kernel (--attention).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from infer.engine.config import EngineConfig, coda_batch_arg, add_engine_args, engine_kwargs_from_args
from looplm.cli import run
from looplm.layer_split import split_config, split_of
from looplm.policy import ExitPolicy
from looplm.presets import PAPER_MODELS

from . import replay as RP
from .cost import DEVICES, HOST_JSON, HostCost, RooflineCost, h100_kv_tokens
from .dispatch import OP_US, REPLAY_US, Dispatch
from .emulated import emulated_config
from .report import format_table, plot
from .runner import ASSUMED_MEAN_DEPTH, binomial_depths, depths_from_distribution
from .simulate import SIM_SKIPPED, load_acceptance, replay_fitted, served_context, simulate, speculation_projection
from .stats import modes_for
from .workloads import WORKLOADS, load_trace, make_requests


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m infer.sim", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="ouro-1.4b", help=f"{sorted(PAPER_MODELS)} (roofline), a preset or a checkpoint "
                   "folder (its config.json's shape; no weights read), or with --fitted the benchmarked model "
                   "(default: the one in the trace file)")
    p.add_argument("--fitted", type=Path, default=None, help="replay a bench trace file (infer.bench --save-trace) "
                   "with the latency model fitted on it, and compare with the measured throughput")
    p.add_argument("--layer-split", default=None, metavar="P-C-Q",
                   help="Huginn only: the model with its first P prelude, C core and Q coda layers (e.g. 0-4-0 or "
                        "1-4-1 of huginn-3.5b's 2-4-2; with --fitted default the bench's)")
    p.add_argument("--workloads", nargs="+", default=None,
                   help=f"{', '.join(WORKLOADS)}, or CSV length traces (prompt_tokens, output_tokens columns); "
                        "default: the three (with --replay-exits: the file's workloads, by name)")
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--mean-depth", type=float, default=None, help="mean exit depth (binomial spread); default: assumed")
    p.add_argument("--ks", type=coda_batch_arg, nargs="+", default=[1, 4, 16])
    p.add_argument("--gpu", default="h100", choices=sorted(DEVICES),
                   help="the GPU priced: its bandwidth, peak FLOP/s and memory (the KV pool); SXM parts")
    p.add_argument("--bandwidth", type=float, default=None, help="bytes/s (default: --gpu's; H100 SXM 3.35e12)")
    p.add_argument("--peak-flops", type=float, default=None, help="dense bf16 FLOP/s (default: --gpu's)")
    p.add_argument("--overhead-us", type=float, default=20.0, help="launch/scheduling overhead per stage call "
                   "(used without a host benchmark JSON)")
    p.add_argument("--host-json", type=Path, default=HOST_JSON if HOST_JSON.exists() else None,
                   help="per-stage host time measured by python -m infer.bench.host (default: "
                        f"{HOST_JSON} when it exists); 'none' for the constant --overhead-us")
    p.add_argument("--attention", default="paged", choices=("context", "paged", "sdpa"),
                   help="decode attention's KV reads: a paged kernel over the block tables (default: the engine's "
                        "CUDA default, EngineConfig.attention_backend), the SDPA gather to the longest context (the "
                        "engine's CPU path), or the ideal real context")
    p.add_argument("--op-us", type=float, default=None,
                   help=f"host microseconds per aten op of an eager launch (a launch carrying prompt chunks, a prefill, "
                        f"speculation; every launch with --no-cuda-graphs), ops counted from the engine "
                        f"(infer/sim/dispatch.py); 0 turns the charge off (default: --dispatch-json's, else {OP_US:g})")
    p.add_argument("--replay-us", type=float, default=None,
                   help=f"host microseconds per CUDA graph replay (a decode-only launch) (default: --dispatch-json's, "
                        f"else {REPLAY_US:g}, an assumption until scripts/gpu_check.py measures it)")
    p.add_argument("--dispatch-json", type=Path, default=None, metavar="FILE",
                   help="op_us and replay_us from a JSON's top-level {\"dispatch\": {\"op_us\": ..., \"replay_us\": ...}} "
                        "(scripts/gpu_check.py's); --op-us / --replay-us given explicitly win")
    p.add_argument("--serial-host", action="store_true",
                   help="charge each launch's host time and device time in series (the simulator before on-device "
                        "token re-entry); default: the host works beside the device and waits only where the engine "
                        "reads results (SimRunner)")
    RP.add_args(p, "a recorded-exits file (infer.bench --record-exits): its requests' lengths and the depths its "
                   "scores decide, instead of --mean-depth's binomial and the trace")
    p.add_argument("--replay-threshold", type=float, default=None, help="with --replay-exits: default the recorded")
    p.add_argument("--replay-r-min", type=int, default=None, help="with --replay-exits: default the recorded")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--acceptance", metavar="FILE_OR_RATE", default=None,
                   help="with --speculative-tokens: the draft acceptance rate, or a JSON file that measured it "
                        "(python -m infer.bench.speculative, or a bench JSON with speculation)")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64],
                   help="with --speculative-tokens: the batch sizes of the speculation projection")
    p.add_argument("--out", type=Path, default=Path("outputs/sim"))
    # the engine's own flags (a mode's policy / refill / K / full depth and the simulator's exit
    # criterion are set per mode); kv_cache_tokens: default what an 80 GB H100 holds beside the weights
    add_engine_args(p, skip=SIM_SKIPPED)
    p.set_defaults(max_batch_size=64)
    a = p.parse_args(argv)
    dispatch = (Dispatch.from_json(a.dispatch_json, a.op_us, a.replay_us) if a.dispatch_json is not None else
                Dispatch(OP_US if a.op_us is None else a.op_us, REPLAY_US if a.replay_us is None else a.replay_us,
                         "flags" if a.op_us is not None or a.replay_us is not None else "defaults"))
    a.out.mkdir(parents=True, exist_ok=True)
    if a.fitted is not None:
        blocks = replay_fitted(a.fitted, None if a.model == "ouro-1.4b" else a.model, a.layer_split)
        for b in blocks:
            print(format_table(b))
            print(f"{'mode':16s} {'measured':>10s} {'simulated':>10s} {'error':>7s}   (output tokens/s; fitted cost model)")
            for r in b["results"]:
                print(f"{r['mode']:16s} {r['measured_tokens_per_s']:10.1f} {r['output_tokens_per_s']:10.1f} "
                      f"{100 * r['sim_error']:+6.1f}%")
        path = a.out / f"replay_{a.fitted.stem}.json"
        path.write_text(json.dumps({"trace_file": str(a.fitted), "cost_model": "fitted (infer/sim/latency.py)",
                                    "workloads": [{k: v for k, v in b.items() if k != "traces"} for b in blocks]},
                                   indent=1, default=float))
        print(f"json: {path}")
        return
    replay = RP.from_args(p, a)
    if replay is None:  # a shipped name or a CSV length trace (with --replay-exits: the file's names)
        try:
            for w in a.workloads or ():
                load_trace(w)
        except ValueError as e:
            p.error(f"--workloads: {e}")
    gpu = {**DEVICES[a.gpu], **{k: getattr(a, k) for k in ("bandwidth", "peak_flops") if getattr(a, k) is not None}}
    cfg = emulated_config(a.model, a.layer_split)[0]  # a paper shape, a preset or a checkpoint's config.json
    name = a.model if a.model in PAPER_MODELS else Path(a.model).name
    label = f"{name} split {split_of(cfg)}" if a.layer_split else name  # how outputs name the model
    engine = engine_kwargs_from_args(a)
    # CUDA graphs: which launches replay one (default on, as on CUDA); the engine runs on a CPU SimModel
    graphs = engine.pop("cuda_graphs", None) is not False
    layout = EngineConfig(**engine).resolve(cfg).kv_layout  # the cost model prices the layout the engine runs
    engine.setdefault("kv_cache_tokens", h100_kv_tokens(cfg, layout, memory=gpu["memory"]))
    ctx = served_context(cfg, engine)
    if replay is not None:
        rs = RP.engine_settings(replay, {"exit_threshold": a.replay_threshold, "r_min": a.replay_r_min})
        pol = ExitPolicy(rs["exit_criterion"], rs["exit_threshold"], rs["r_min"], cfg.r_max, bool(a.lookahead))
    workloads = a.workloads or (list(replay["workloads"]) if replay is not None else list(WORKLOADS))
    mean = a.mean_depth or ASSUMED_MEAN_DEPTH.get(a.model, (1 + cfg.r_max) / 2)
    probs = binomial_depths(cfg.r_max, mean)
    host = HostCost.from_json(a.host_json) if a.host_json is not None and str(a.host_json) != "none" else None
    cost = RooflineCost(cfg, bandwidth=gpu["bandwidth"], peak_flops=gpu["peak_flops"], overhead=a.overhead_us * 1e-6,
                        kv_layout=layout, host=host, attention=a.attention, dispatch=dispatch)
    if a.speculative_tokens:
        if a.acceptance is None:
            p.error("--speculative-tokens needs --acceptance FILE_OR_RATE (the drafts' acceptance rate)")
        rate = load_acceptance(a.acceptance)
        out = []
        for w in workloads:
            reqs = make_requests(w, a.num_requests, seed=a.seed, scale=1.0, max_model_len=ctx, vocab_size=cfg.vocab_size)
            rows = speculation_projection(cfg, reqs, cost, depths_from_distribution(probs, reqs, a.seed), a.batches,
                                          rate, {**engine, "cuda_graphs": graphs}, a.seed)
            out.append({"workload": w, "rows": rows})
            for r in rows:
                print(f"{label} {w:9s} batch {r['batch']:3d}: tokens/s {r['off']['output_tokens_per_s']:9.1f} -> "
                      f"{r['on']['output_tokens_per_s']:9.1f} ({r['throughput_ratio']:.2f}x), TPOT "
                      f"{1e3 * r['off']['mean_tpot_s']:.2f} -> {1e3 * r['on']['mean_tpot_s']:.2f} ms "
                      f"({r['tpot_speedup']:.2f}x), acceptance {r['on']['speculative']['acceptance_rate']:.2f}, "
                      f"tokens/verification {r['on']['speculative']['tokens_per_verification']:.2f}")
        path = a.out / f"sim_spec_{name}_k{a.speculative_tokens}_a{rate:.2f}.json"
        path.write_text(json.dumps({"model": a.model, "gpu": a.gpu, "acceptance": rate, "acceptance_arg": a.acceptance,
                                    "engine": engine, "attention": a.attention, "dispatch": dispatch.describe(),
                                    "cuda_graphs": graphs, "mean_exit_depth_assumed": mean, "num_requests": a.num_requests,
                                    "simulated": True, "workloads": out,
                                    "command": "python -m infer.sim " + " ".join(argv if argv is not None else
                                                                                 sys.argv[1:])},
                                   indent=1, default=float))
        print(f"json: {path}")
        return
    blocks = []
    for w in workloads:
        if replay is not None:
            reqs = RP.make_replay_requests(replay, w, cfg.vocab_size, ctx, a.seed)
            depths = RP.replay_depths(replay, w, pol)
        else:
            reqs = make_requests(w, a.num_requests, seed=a.seed, scale=1.0, max_model_len=ctx,
                                 vocab_size=cfg.vocab_size)
            depths = depths_from_distribution(probs, reqs, a.seed)
        blk = simulate(cfg, reqs, cost, depths, modes_for(a.ks), workload=w, overlap=not a.serial_host,
                       cuda_graphs=graphs, **engine)
        if replay is not None:
            blk["replayed_exits"] = {"file": str(a.replay_exits), "model": replay["model"], "policy": {
                "criterion": pol.criterion, "threshold": pol.threshold, "r_min": pol.r_min, "lookahead": pol.lookahead}}
        print(format_table(blk))
        blocks.append(blk)
    meta = {"model": a.model, "config": cfg.name, "gpu": a.gpu, "memory": gpu["memory"], "layer_split": a.layer_split and split_of(cfg),
            "cost_model": "roofline", "bandwidth": cost.bandwidth,
            "peak_flops": cost.peak_flops, "overhead_s": None if host else cost.overhead,
            "host_json": str(a.host_json) if host else None, "attention": a.attention, "engine": engine,
            "dispatch": dispatch.describe(), "cuda_graphs": graphs,
            "host_overlap": not a.serial_host, "num_requests": a.num_requests,
            "exit_depth_distribution": None if replay else probs, "mean_exit_depth_assumed": None if replay else mean,
            "replay_exits": str(a.replay_exits) if replay else None, "pooled": a.pool, "simulated": True,
            "command": "python -m infer.sim " + " ".join(argv if argv is not None else sys.argv[1:])}
    stem = name + (f"_split{split_of(cfg)}" if a.layer_split else "")
    tag = f"{stem}_replay_{a.replay_exits.stem}" if replay else f"{stem}_d{mean:g}"
    path = a.out / f"sim_{tag}.json"
    path.write_text(json.dumps({**meta, "workloads": [{k: v for k, v in b.items() if k != "traces"} for b in blocks]},
                               indent=1, default=float))
    png = plot(blocks, a.out / f"sim_{tag}.png", f"{label}, simulated {a.gpu.upper()} roofline, " +
               (f"exits replayed from {replay['model']}" if replay else f"mean exit depth {mean:g}"))
    print(f"json: {path}\nplot: {png}")


if __name__ == "__main__":
    run(main)

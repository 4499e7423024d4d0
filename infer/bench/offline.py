"""Offline throughput benchmark: the same requests through `cb`, `cdb` no-refill and `cdb` refill
(several minimum coda batches K), EOS ignored so every policy produces the same output lengths,
in one process, repeated in alternating order to reduce noise (the median time is reported).

    python -m infer.bench --model checkpoints/ouro-demo --workloads alpaca sharegpt arxiv \
        --num-requests 32 --scale auto --ks 1 4 --repeats 3 --out outputs/bench

Per policy: output tokens/s, requests/s, mean exit depth, the prefill share of time (alpha, from
CB's step trace), the bounds S_dec / S_e2e (infer/sim/bounds.py), the speedup over CB and its
fraction of S_e2e; also the fitted stage latency model (infer/sim/latency.py) and a PNG plot.
`cdb_full_depth` (exits disabled) measures what the stage split alone costs against CB.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import time
from functools import partial
from pathlib import Path

import torch

from infer.engine.config import EngineConfig, coda_batch_arg, add_engine_args, engine_kwargs_from_args
from infer.engine.llm import add_load_args, load_model
from infer.engine.llm_engine import LLMEngine
from infer.engine.progress import progress
from infer.engine.sampling_params import SamplingParams
from infer.sim import bounds as B
from infer.sim import replay as RP
from infer.sim.emulated import emulated_engine
from infer.sim.latency import fit_trace, fits_to_json
from infer.sim.report import format_table, model_meta, write_outputs
from infer.sim.stats import bounds_block, headline, mode_kwargs, modes_for, prefix_cache, raw_from, summarize
from infer.sim.work import work_counts
from infer.sim.workloads import WORKLOADS, Request, describe, make_requests, mean_decode_context
from looplm.layer_split import split_of

RESULT_FIELDS = ("output_tokens_per_s", "requests_per_s", "mean_exit_depth", "alpha", "s_dec", "s_e2e",
                 "speedup_vs_cb", "fraction_of_bound", "settings")


# ---------------------------------------------------------------------------------- one run
def make_engine(model, tokenizer, mode: dict, base: dict) -> LLMEngine:
    return LLMEngine(model, EngineConfig(**{**base, **mode_kwargs(mode), "trace": True}), tokenizer)


def run_engine(eng, mode: dict, requests: list[Request], progress=None, keep_trace: bool = True,
               trackers=None, seqs: list | None = None, traced: bool = True) -> dict:
    """Run every request through an (idle) engine; the raw measurement. The engine can be reused:
    its CUDA graphs, once captured by a first pass, are not captured again inside a timed run.
    `trackers(i)`: request i's exit tracker (a replay's, infer/sim/replay.py); `seqs`: a list the
    engine's sequences are added to (read them once the run is over). `traced=False`: no trace rows
    (on CUDA each traced stage ends in a synchronize, so a timed pass runs untraced: `untraced_timing`)."""
    if eng.config.trace != traced:
        eng.config = dataclasses.replace(eng.config, trace=traced)
    eng.trace = []
    eng.reset_prefix_cache()  # each pass starts cold: only sharing inside the request list counts
    m0, sp0 = eng.metrics(), eng.speculative_metrics()
    added = [eng.add_request(r.prompt_ids, SamplingParams(max_tokens=r.output_len, ignore_eos=True), request_id=str(i),
                             tracker=trackers(i) if trackers is not None else None)
             for i, r in enumerate(requests)]
    if seqs is not None:
        seqs += added
    done = 0
    t0 = time.perf_counter()
    with torch.inference_mode():
        while eng.has_unfinished():
            eng.step()
            if progress is not None:
                n = sum(s.finished for s in added)
                progress.update(n - done)
                done = n
    if eng.model.device.type == "cuda":
        torch.cuda.synchronize(eng.model.device)
    seconds = time.perf_counter() - t0
    outs = [eng.output(s) for s in added]
    for s in added:
        eng.release(s.request_id)
    bad = [i for i, (o, r) in enumerate(zip(outs, requests)) if len(o.token_ids) != r.output_len]
    if bad:
        raise RuntimeError(f"{mode['name']}: requests {bad[:5]} produced a different number of tokens than asked")
    return raw_from(mode, eng.trace, seconds, outs, eng.config, keep_trace, prefix_cache(eng.metrics(), m0),
                    work_counts(eng.trace, eng.model.cfg, eng.model.dtype.itemsize), eng.speculative_metrics(sp0),
                    eng.auto_coda_metrics())


def run_mode(model, tokenizer, requests: list[Request], mode: dict, base: dict, progress=None,
             keep_trace: bool = True) -> dict:
    """One run on a fresh engine."""
    return run_engine(make_engine(model, tokenizer, mode, base), mode, requests, progress, keep_trace)


def untraced_timing(traced: dict, timed: dict) -> dict:
    """A timed pass run untraced (no per-stage synchronize on CUDA), with the stage statistics, work
    counts and trace of the traced pass of the same requests on the same engine. Their outputs are
    the same run's (the schedule does not depend on timing): a pass whose exit depths differ raises."""
    if timed["exit_depths"] != traced["exit_depths"]:
        raise RuntimeError(f"{traced['name']}: the untraced pass's exit depths differ from the traced pass's")
    return {**traced, "seconds": timed["seconds"], "timed_untraced": True}


# ---------------------------------------------------------------------------------- results
def pick_raw(reps: list[dict], stat: str = "min") -> dict:
    """The repeat that represents a mode: the fastest ("min", robust to other load on a shared
    CPU: contention only ever adds time) or the median one; every repeat's time is kept."""
    ordered = sorted(reps, key=lambda r: r["seconds"])
    if stat not in ("min", "median"):
        raise ValueError(f"stat must be 'min' or 'median', got {stat!r}")
    out = dict(ordered[0] if stat == "min" else ordered[(len(ordered) - 1) // 2])
    if stat == "median":
        out["seconds"] = statistics.median(r["seconds"] for r in reps)
    out["seconds_all"] = [r["seconds"] for r in reps]
    out["stat"] = stat
    return out


def latency_bound(fits: dict, results: list[dict], raws: dict[str, dict], ctx: float) -> None:
    """Add `s_dec_latency` / `s_e2e_latency` to the CDB results: the decode speedup this machine's
    fitted stage latencies allow at CB's mean batch, t_fused / (t_prelude + d t_core + t_coda),
    i.e. the FLOP bound with each stage's fixed cost (delta) counted. Explains a gap to S_dec."""
    need = ("fused", "prelude", "core", "coda")
    cb = raws.get("cb")
    if cb is None or not all(k in fits for k in need) or "fused" not in cb["stages"]:
        return
    nb = cb["stages"]["fused"]["mean_batch"]

    def t(stage: str, n: float) -> float:
        f = fits[stage]
        b = min(2 ** math.ceil(math.log2(max(1.0, n))), 2 ** 30) if f.batch_key == "padded" else n
        return f.predict(b, n * ctx)
    t_cb = t("fused", nb)
    for r in results:
        if r["engine_config"]["full_depth"] or r["alpha"] is None:
            continue
        sd = t_cb / (t("prelude", nb) + r["mean_exit_depth"] * t("core", nb) + t("coda", nb))
        r["s_dec_latency"] = sd
        r["s_e2e_latency"] = B.s_e2e(r["alpha"], sd) if sd > 0 else None


# ---------------------------------------------------------------------------------- a workload
def bench_workload(model, tokenizer, workload: str, *, num_requests: int = 32, scale: float | str = 1.0,
                   seed: int = 0, modes: list[dict] | None = None, repeats: int = 3, base: dict | None = None,
                   progress=None, warmup: bool = True, stat: str = "min", record: bool = False,
                   replay: dict | None = None) -> dict:
    """All modes on one workload: {"workload", "bounds", "results", "latency_fit", "traces"}.
    `record`: first one untimed CDB pass under the engine's policy that records every token's exit
    scores (the block's "recorded_exits", for replay.write). `replay`: a recorded-exits file
    (replay.load): the requests get its lengths and every mode the depths it decides."""
    cfg = model.cfg
    modes = modes or modes_for()
    base = dict(base or {})
    if replay is not None:
        base = RP.engine_settings(replay, base)
    # the requests fit the context the engine really serves (max_model_len: the checkpoint's,
    # capped by the KV pool), which the first mode's engine knows; every mode has the same pool
    first = make_engine(model, tokenizer, modes[0], base)
    ctx_len = first.max_model_len
    if replay is not None:
        reqs = RP.make_replay_requests(replay, workload, cfg.vocab_size, ctx_len, seed)
    else:
        reqs = make_requests(workload, num_requests, seed=seed, scale=scale, max_model_len=ctx_len,
                             vocab_size=cfg.vocab_size, tokenizer=tokenizer)
    recorded = record_exits(model, tokenizer, reqs, base) if record else None
    prep: dict[str, object] = {}  # per mode: the replay's trackers (its depths derived once)
    if replay is not None:
        for m in modes:
            pol = EngineConfig(**{**base, **mode_kwargs(m)}).resolve(cfg, model.device).exit_policy(cfg)
            depths = RP.replay_depths(replay, workload, pol)
            prep[m["name"]] = partial(_forced, pol, depths) if pol.adaptive else None
    reps: dict[str, list[dict]] = {m["name"]: [] for m in modes}
    if model.device.type == "cuda":
        # one engine (KV pool, CUDA graphs captured at its start) at a time; a full untimed pass,
        # traced (a synchronize per stage: its stage times), then the timed passes untraced
        for m in modes:
            eng = first if m is modes[0] else make_engine(model, tokenizer, m, base)
            first = None
            traced = run_engine(eng, m, reqs, trackers=prep.get(m["name"]))
            for _ in range(repeats):
                timed = run_engine(eng, m, reqs, progress, trackers=prep.get(m["name"]), traced=False)
                reps[m["name"]].append(untraced_timing(traced, timed))
            del eng
            torch.cuda.empty_cache()
    else:
        # CPU: every engine alive, warmed up on two requests, repeats in alternating order
        engines = {m["name"]: first if m is modes[0] else make_engine(model, tokenizer, m, base) for m in modes}
        if warmup:
            for m in modes:
                run_engine(engines[m["name"]], m, reqs[:2], keep_trace=False, trackers=prep.get(m["name"]))
        for rep in range(repeats):
            for m in (modes if rep % 2 == 0 else modes[::-1]):
                reps[m["name"]].append(run_engine(engines[m["name"]], m, reqs, progress, trackers=prep.get(m["name"])))
    raws = {m["name"]: pick_raw(reps[m["name"]], stat) for m in modes}
    settings = {**base, "repeats": repeats, "stat": stat, "workload": workload, "seed": seed}
    results = summarize(raws, cfg, reqs, settings)
    trace = [r for raw in raws.values() for r in raw["trace"]]
    ctx = mean_decode_context(reqs)
    fits = fit_trace(trace)
    latency_bound(fits, results, raws, ctx)
    # (replayed requests keep their recorded lengths: scale 1, whatever the workload's name)
    out = {"workload": describe(reqs, workload, 1.0 if replay is not None else scale, ctx_len),
           "bounds": bounds_block(cfg, reqs),
           "results": results, "latency_fit": fits_to_json(fits, ctx),
           "untraced_seconds_per_step": {n: max(0.0, (r["seconds"] - r["traced_seconds"]) / max(1, r["steps"]))
                                         for n, r in raws.items()},
           "traces": {n: r["trace"] for n, r in raws.items()},
           "exit_depths": raws[next((m["name"] for m in modes if m["name"].startswith("cdb_refill")), modes[-1]["name"])]
           ["exit_depths"], **headline(results)}
    if recorded is not None:
        out["recorded_exits"] = recorded
    if replay is not None:
        out["replayed_exits"] = {k: replay[k] for k in ("model", "criterion", "threshold", "r_min", "lookahead",
                                                         "kv_layout", "complete", "replay_r_min")}
    return out


def _forced(policy, depths: list[list[int]], i: int):
    """Replay: request i exits after its recorded depths (depths[i][0] is the prefill's)."""
    return RP.ForcedTracker(policy, depths[i][1:])


def record_exits(model, tokenizer, reqs: list[Request], base: dict) -> dict:
    """One untimed CDB refill (K = 1) pass under the engine's policy with recording exit trackers:
    {"policy": ExitPolicy, "kv_layout", "requests": replay.record_block(...), "exit_depths"}."""
    mode = {"name": "record", "policy": "cdb", "refill": True, "min_coda_batch": 1}
    eng = make_engine(model, tokenizer, mode, base)
    trackers = [RP.RecordingTracker(eng.policy) for _ in reqs]  # (the requests keep the engine's policy)
    raw = run_engine(eng, mode, reqs, keep_trace=False, trackers=trackers.__getitem__)
    rows = [t.rows for t in trackers]
    return {"policy": eng.policy, "kv_layout": eng.config.kv_layout, "requests": RP.record_block(rows, reqs),
            "exit_depths": raw["exit_depths"]}


def record_workload(model, tokenizer, workload: str, *, num_requests: int, scale: float | str = 1.0, seed: int = 0,
                    base: dict | None = None) -> dict:
    """Only the recording pass of `bench_workload(..., record=True)` (no timed modes): the requests
    sized to the engine's context, recorded. Returns a block with "workload" and "recorded_exits"."""
    base = dict(base or {})
    ctx_len = make_engine(model, tokenizer, {"name": "cdb", "policy": "cdb"}, base).max_model_len
    reqs = make_requests(workload, num_requests, seed=seed, scale=scale, max_model_len=ctx_len,
                         vocab_size=model.cfg.vocab_size, tokenizer=tokenizer)
    return {"workload": describe(reqs, workload, scale, ctx_len), "recorded_exits": record_exits(model, tokenizer, reqs, base)}


def write_recorded(path: Path, blocks: list[dict], model, source: str, seed: int) -> None:
    """Write the recorded exits of a run's workload blocks (taken out of them) as one file."""
    rec = [b.pop("recorded_exits") for b in blocks]
    RP.write(path, model=source, policy=rec[0]["policy"], model_r_min=model.cfg.r_min, kv_layout=rec[0]["kv_layout"],
             workloads={b["workload"]["workload"]: {"scale": b["workload"]["scale"], "seed": seed,
                                                    "requests": r["requests"]} for b, r in zip(blocks, rec)})


# ---------------------------------------------------------------------------------- an emulated device
def bench_emulated(a, workloads: list[str], modes: list[dict], base: dict, replay: dict | None
                   ) -> tuple[list[dict], dict]:
    """`python -m infer.bench --device emulated:...`: every mode of every workload on a fresh
    emulated engine, timed on the wall clock (offline.run_engine), beside the cost model's
    prediction of the same run (`predicted_seconds`). Returns (workload blocks, the JSON's meta)."""
    def engine(mode: dict, w: str) -> LLMEngine:
        return emulated_engine(a.model, a.device, {**base, **{k: v for k, v in mode.items() if k != "name"}},
                               mean_depth=a.mean_depth, replay_exits=a.replay_exits if replay else None,
                               replay_workload=w, seed=a.seed, layer_split=a.layer_split, by_index=True, trace=True,
                               attention=a.emulated_attention, slowdown=a.emulated_slowdown)

    scale = a.scale if a.scale == "auto" else float(a.scale)
    blocks = []
    for w in workloads:
        first = engine(modes[0], w)
        cfg, ctx = first.model.cfg, first.max_model_len
        if replay is not None:
            reqs = RP.make_replay_requests(replay, w, cfg.vocab_size, ctx, a.seed)
        else:
            reqs = make_requests(w, a.num_requests, seed=a.seed, scale=scale, max_model_len=ctx,
                                 vocab_size=cfg.vocab_size)
        reps: dict[str, list[dict]] = {m["name"]: [] for m in modes}
        for rep in range(a.repeats):
            for m in (modes if rep % 2 == 0 else modes[::-1]):
                eng = engine(m, w)
                raw = run_engine(eng, m, reqs)
                raw["predicted_seconds"], raw["slept_seconds"] = eng.runner.clock, eng.runner.waited
                reps[m["name"]].append(raw)
        raws = {n: pick_raw(r, a.stat) for n, r in reps.items()}
        info = first.runner.device_info
        settings = {**base, "emulated": info["device"], "repeats": a.repeats, "stat": a.stat, "workload": w,
                    "seed": a.seed}
        results = summarize(raws, cfg, reqs, settings)
        for r in results:
            raw = raws[r["mode"]]
            r["predicted_seconds"] = raw["predicted_seconds"]
            r["predicted_output_tokens_per_s"] = raw["output_tokens"] / raw["predicted_seconds"]
            r["wall_over_predicted"] = raw["seconds"] / (raw["predicted_seconds"] * first.runner.slowdown)
        blocks.append({"workload": describe(reqs, w, 1.0 if replay is not None else scale, ctx),
                       "bounds": bounds_block(cfg, reqs),
                       "results": results, "emulated": info, "traces": {n: r["trace"] for n, r in raws.items()},
                       "exit_depths": next(iter(raws.values()))["exit_depths"],
                       "untraced_seconds_per_step": {n: max(0.0, (r["seconds"] - r["traced_seconds"]) /
                                                            max(1, r["steps"])) for n, r in raws.items()},
                       **headline(results)})
    cfg = first.model.cfg
    name = f"{Path(str(a.model)).name}_{a.device.replace(':', '-')}" + \
        (f"_split{a.layer_split}" if a.layer_split else "")
    meta = {"model": str(a.model), "config": cfg.name, "arch": cfg.arch, "hidden_size": cfg.hidden_size,
            "layers": [cfg.n_prelude, cfg.n_core, cfg.n_coda], "r_max": cfg.r_max, "vocab_size": cfg.vocab_size,
            "params": 0, "weights": "none (emulated device)", "emulated": True, "device": first.runner.device_info,
            "layer_split": a.layer_split, "name": name, "title": f"{name}: speedup over CB vs the bound (emulated)"}
    return blocks, meta


# ---------------------------------------------------------------------------------- the API
def throughput(model, *, policy="cdb", refill=True, min_coda_batch=1, kv_layout=None, exit_threshold=None,
               r_min=None, lookahead=None, exit_criterion=None, workload="alpaca", num_requests=32, scale=1.0, seed=0,
               max_batch_size=32, dtype="float32", device="cpu") -> dict:
    """Offline throughput of one engine configuration on a workload (EOS ignored, one timed run
    after a warm-up on the same engine: 2 requests on CPU, all of them on CUDA). `model`: checkpoint folder, preset name or LoopedLM; `scale`
    shrinks the trace lengths ("auto": fit the model's context). Returns output_tokens_per_s,
    requests_per_s, mean_exit_depth, seconds, num_requests, output_tokens, alpha (prefill share),
    stage statistics and the settings."""
    m, tok = load_model(model, dtype, device)
    base = {k: v for k, v in dict(kv_layout=kv_layout, max_batch_size=max_batch_size, exit_threshold=exit_threshold,
                                  r_min=r_min, lookahead=lookahead, exit_criterion=exit_criterion).items()
            if v is not None}
    mode = {"name": policy if policy == "cb" else f"cdb_{'refill_k%d' % min_coda_batch if refill else 'norefill'}",
            "policy": policy, "refill": refill, "min_coda_batch": min_coda_batch}
    eng = make_engine(m, tok, mode, base)
    reqs = make_requests(workload, num_requests, seed=seed, scale=scale, max_model_len=eng.max_model_len,
                         vocab_size=m.cfg.vocab_size, tokenizer=tok)
    run_engine(eng, mode, reqs if m.device.type == "cuda" else reqs[:2], keep_trace=False)  # warm-up
    raw = run_engine(eng, mode, reqs, keep_trace=False)
    full = raw["engine_config"]["full_depth"]
    return {"output_tokens_per_s": raw["output_tokens"] / raw["seconds"],
            "requests_per_s": raw["num_requests"] / raw["seconds"],
            "mean_exit_depth": float(m.cfg.r_max) if full else raw["mean_exit_depth"],
            "seconds": raw["seconds"], "num_requests": raw["num_requests"], "output_tokens": raw["output_tokens"],
            "alpha": raw["prefill_seconds"] / raw["traced_seconds"] if raw["traced_seconds"] else None,
            "exit_depth_hist": raw["exit_depth_hist"], "stages": raw["stages"],
            "workload": describe(reqs, workload, scale, eng.max_model_len),
            "settings": {**base, **mode_kwargs(mode), "workload": workload, "num_requests": num_requests,
                         "scale": scale, "seed": seed, "dtype": dtype, "device": device},
            "engine_config": raw["engine_config"]}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m infer.bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="ouro-tiny", help="checkpoint folder or preset name (ouro-tiny, huginn-tiny)")
    p.add_argument("--workloads", nargs="+", default=None, choices=WORKLOADS,
                   help="default: all three (with --replay-exits: the file's)")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--scale", default="auto", help="length scale in (0, 1], or 'auto' (fit the model's context)")
    p.add_argument("--ks", type=coda_batch_arg, nargs="+", default=[1, 4], help="minimum coda batch sizes for cdb refill")
    p.add_argument("--no-norefill", action="store_true")
    p.add_argument("--no-full-depth", action="store_true", help="skip the cdb full-depth (no exits) run")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--stat", choices=["min", "median"], default="min",
                   help="which repeat represents a mode (min: robust to other load on a shared CPU)")
    p.add_argument("--seed", type=int, default=0, help="workload sampling seed")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default="cpu", help="a torch device, or emulated:h100 (also h200, a100): no weights, "
                   "every launch waits for the simulator's predicted stage time (infer/sim/emulated.py)")
    p.add_argument("--mean-depth", type=float, default=None, help="emulated device: mean exit depth (binomial "
                   "spread; default: infer.sim's assumption); --replay-exits instead replays a file's depths")
    p.add_argument("--emulated-attention", choices=("sdpa", "paged", "context"), default=None,
                   help="emulated device: what decode attention reads (infer.sim's --attention; default: the "
                        "engine's --attention-backend as on CUDA, paged unless it says sdpa)")
    p.add_argument("--emulated-slowdown", type=float, default=None, metavar="S",
                   help="emulated device: its wall clock runs S times slower than the GPU's (default 1)")
    add_load_args(p)
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (0: torch's default)")
    p.add_argument("--out", type=Path, default=Path("outputs/bench"))
    p.add_argument("--save-trace", action="store_true", help="also write every run's step trace (for python -m infer.sim.latency fit)")
    p.add_argument("--record-exits", type=Path, metavar="FILE",
                   help="first record every token's exit scores under the engine's policy into FILE (infer/bench/"
                        "replay.py; with --r-min R_MAX every step's score, replayable at any policy)")
    RP.add_args(p, "every mode uses the exit depths FILE's scores decide (at --exit-threshold / --r-min, else the "
                   "recorded ones) and its requests' lengths")
    # the modes set policy / refill / min_coda_batch / full_depth; a CPU-sized batch by default
    add_engine_args(p, skip=("policy", "refill", "min_coda_batch", "full_depth", "trace", "seed"))
    p.set_defaults(max_batch_size=32)
    return p


def main(argv: list[str] | None = None) -> None:
    p = parser()
    a = p.parse_args(argv)
    scale = a.scale if a.scale == "auto" else float(a.scale)

    if a.threads:
        torch.set_num_threads(a.threads)
    if a.record_exits and a.replay_exits:
        p.error("--record-exits and --replay-exits: record first, then replay in another run")
    replay = RP.from_args(p, a)
    workloads = a.workloads or (list(replay["workloads"]) if replay else list(WORKLOADS))
    if a.device.startswith("emulated:"):
        if a.record_exits:
            p.error(f"--device {a.device} runs without --record-exits (an emulated device has no exit scores to "
                    "record)")
        blocks, meta = bench_emulated(a, workloads, modes_for(a.ks, not a.no_norefill, not a.no_full_depth),
                                      engine_kwargs_from_args(a), replay)
        meta["command"] = "python -m infer.bench " + " ".join(argv if argv is not None else __import__("sys").argv[1:])
        for b in blocks:
            print(format_table(b))
        paths = write_outputs(blocks, meta, a.out, meta["name"], a.save_trace)
        print(f"json: {paths['json']}\nplot: {paths['png']}")
        return
    for k in ("mean_depth", "emulated_slowdown"):
        if getattr(a, k) is not None:
            p.error(f"--{k.replace('_', '-')} is for an emulated device (--device emulated:h100)")
    model, tok = load_model(a.model, a.dtype, a.device, load_format=a.load_format, layer_split=a.layer_split)
    base = engine_kwargs_from_args(a)
    modes = modes_for(a.ks, not a.no_norefill, not a.no_full_depth)
    n_req = sum(len(RP.requests_of(replay, w)) for w in workloads) if replay else len(workloads) * a.num_requests
    bar = progress(a.repeats * len(modes) * n_req, "bench", "req")
    blocks = [bench_workload(model, tok, w, num_requests=a.num_requests, scale=scale, seed=a.seed, modes=modes,
                             repeats=a.repeats, base=base, progress=bar, stat=a.stat, record=bool(a.record_exits),
                             replay=replay) for w in workloads]
    bar.close()
    if a.record_exits:
        write_recorded(a.record_exits, blocks, model,
                       str(a.model) + (f" (layer split {split_of(model.cfg)})" if a.layer_split else ""), a.seed)
        print(f"recorded exits: {a.record_exits}")
    name = Path(str(a.model)).name + (f"_split{split_of(model.cfg)}" if a.layer_split else "")
    meta = {**model_meta(model, str(a.model), tok), "layer_split": a.layer_split,
            "title": f"{name}: speedup over CB vs the bound",
            "command": "python -m infer.bench " + " ".join(argv if argv is not None else __import__("sys").argv[1:]),
            "threads": torch.get_num_threads()}
    for b in blocks:
        print(format_table(b))
    paths = write_outputs(blocks, meta, a.out, name, a.save_trace)
    print(f"json: {paths['json']}\nplot: {paths['png']}" + (f"\ntrace: {paths['trace']}" if "trace" in paths else ""))


if __name__ == "__main__":
    from looplm.cli import run

    run(main)

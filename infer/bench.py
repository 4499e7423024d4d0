"""Offline throughput benchmark: the same requests through `cb`, `cdb` no-refill and `cdb` refill
(several minimum coda batches K), EOS ignored so every policy produces the same output lengths,
in one process, repeated in alternating order to reduce noise (the median time is reported).

    python -m infer.bench --model checkpoints/ouro-demo --workloads alpaca sharegpt arxiv \
        --num-requests 32 --scale auto --ks 1 4 --repeats 3 --out results/bench

Per policy: output tokens/s, requests/s, mean exit depth, the prefill share of time (alpha, from
CB's step trace), the bounds S_dec / S_e2e (infer/bounds.py), the speedup over CB and its
fraction of S_e2e; also the fitted stage latency model (infer/latency.py) and a PNG plot.
`cdb_full_depth` (exits disabled) measures what the stage split alone costs against CB.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from . import bounds as B
from .latency import fit_trace, fits_to_json
from .workloads import WORKLOADS, Request, describe, make_requests, mean_decode_context

RESULT_FIELDS = ("output_tokens_per_s", "requests_per_s", "mean_exit_depth", "alpha", "s_dec", "s_e2e",
                 "speedup_vs_cb", "fraction_of_bound", "settings")


def modes_for(ks=(1, 4), norefill: bool = True, full_depth: bool = True) -> list[dict]:
    """The policies compared: CB, CDB no-refill, CDB refill per K, and CDB at full depth."""
    modes = [{"name": "cb", "policy": "cb"}]
    if norefill:
        modes.append({"name": "cdb_norefill", "policy": "cdb", "refill": False})
    modes += [{"name": f"cdb_refill_k{k}", "policy": "cdb", "refill": True, "min_coda_batch": int(k)} for k in ks]
    if full_depth:
        modes.append({"name": "cdb_full_depth", "policy": "cdb", "refill": True, "full_depth": True})
    return modes


def _mode_kwargs(mode: dict) -> dict:
    return {k: v for k, v in mode.items() if k != "name"}


# ---------------------------------------------------------------------------------- one run
def run_mode(model, tokenizer, requests: list[Request], mode: dict, base: dict, progress=None,
             keep_trace: bool = True) -> dict:
    """Run every request through one engine configuration; the raw measurement."""
    import torch

    from .engine import EngineConfig, LLMEngine
    from .sampling import SamplingParams

    cfg = EngineConfig(**{**base, **_mode_kwargs(mode), "trace": True})
    eng = LLMEngine(model, cfg, tokenizer)
    seqs = [eng.add_request(r.prompt_ids, SamplingParams(max_tokens=r.output_len, ignore_eos=True), request_id=str(i))
            for i, r in enumerate(requests)]
    done = 0
    t0 = time.perf_counter()
    with torch.inference_mode():
        while eng.has_unfinished():
            eng.step()
            if progress is not None:
                n = sum(s.finished for s in seqs)
                progress.update(n - done)
                done = n
    seconds = time.perf_counter() - t0
    outs = [eng.output(s) for s in seqs]
    bad = [i for i, (o, r) in enumerate(zip(outs, requests)) if len(o.token_ids) != r.output_len]
    if bad:
        raise RuntimeError(f"{mode['name']}: requests {bad[:5]} produced a different number of tokens than asked")
    return raw_from(mode, eng.trace, seconds, outs, eng.stats, keep_trace)


def raw_from(mode: dict, trace: list[dict], seconds: float, outs, stats: dict, keep_trace: bool = True) -> dict:
    """The raw record of one run (shared with the simulator, whose trace and seconds are virtual)."""
    stages: dict[str, dict] = {}
    for r in trace:
        s = stages.setdefault(r["stage"], {"calls": 0, "seconds": 0.0, "items": 0})
        s["calls"] += 1
        s["seconds"] += r["seconds"]
        s["items"] += r["batch"]
    for s in stages.values():
        s["mean_batch"] = s["items"] / s["calls"]
    hist: dict[int, int] = {}
    for o in outs:
        for d in o.exit_depths[1:]:  # the first token comes from the prefill, at full depth
            hist[d] = hist.get(d, 0) + 1
    ntok = sum(hist.values())
    traced = sum(r["seconds"] for r in trace)
    return {"name": mode["name"], "mode": _mode_kwargs(mode), "seconds": seconds,
            "output_tokens": sum(len(o.token_ids) for o in outs), "num_requests": len(outs),
            "mean_exit_depth": sum(d * c for d, c in hist.items()) / ntok if ntok else float("nan"),
            "decode_tokens": ntok, "exit_depth_hist": dict(sorted(hist.items())),
            "prefill_seconds": stages.get("prefill", {}).get("seconds", 0.0), "traced_seconds": traced,
            "steps": len(trace), "stages": stages, "trace": trace if keep_trace else None,
            "exit_depths": [list(o.exit_depths) for o in outs]}


# ---------------------------------------------------------------------------------- results
def summarize(raws: dict[str, dict], cfg, requests: list[Request], settings: dict) -> list[dict]:
    """Per-mode results with the bounds: alpha is CB's measured prefill share, d each mode's mean
    exit depth, F_0 / F_r counted at the requests' mean decode context."""
    ctx = mean_decode_context(requests)
    cb = raws.get("cb")
    alpha_cb = cb["prefill_seconds"] / cb["traced_seconds"] if cb and cb["traced_seconds"] > 0 else None
    out = []
    for name, r in raws.items():
        tps = r["output_tokens"] / r["seconds"]
        full = r["mode"].get("policy") == "cb" or r["mode"].get("full_depth")
        d = cfg.r_max if full or r["mean_exit_depth"] != r["mean_exit_depth"] else r["mean_exit_depth"]
        res = {"mode": name, "output_tokens_per_s": tps, "requests_per_s": r["num_requests"] / r["seconds"],
               "total_tokens_per_s": (r["output_tokens"] + sum(q.prompt_len for q in requests)) / r["seconds"],
               "seconds": r["seconds"], "seconds_all": r.get("seconds_all", [r["seconds"]]),
               "num_requests": r["num_requests"], "output_tokens": r["output_tokens"],
               "mean_exit_depth": d, "exit_depth_hist": r["exit_depth_hist"],
               "alpha": alpha_cb, "alpha_own": r["prefill_seconds"] / r["traced_seconds"] if r["traced_seconds"] else None,
               "steps": r["steps"], "stages": r["stages"],
               "settings": {**settings, **r["mode"]}}
        if alpha_cb is not None:
            b = B.bound(cfg, d, alpha_cb, ctx)
            res.update(s_dec=b["s_dec"], s_e2e=b["s_e2e"])
            cb_tps = cb["output_tokens"] / cb["seconds"]
            res["speedup_vs_cb"] = tps / cb_tps
            res["fraction_of_bound"] = res["speedup_vs_cb"] / b["s_e2e"]
        else:
            res.update(s_dec=None, s_e2e=None, speedup_vs_cb=None, fraction_of_bound=None)
        out.append(res)
    return out


def bounds_block(cfg, requests: list[Request]) -> dict:
    ctx = mean_decode_context(requests)
    f0, fr = B.f0_fr(cfg, ctx)
    return {"f0": f0, "fr": fr, "f0_over_fr": f0 / fr, "r_max": cfg.r_max, "context": ctx,
            "formula": "S_dec = (F0 + r_max Fr)/(F0 + d Fr); S_e2e = 1/(alpha + (1 - alpha)/S_dec)"}


def median_raw(reps: list[dict]) -> dict:
    """The repeat with the median time, carrying every repeat's time."""
    ordered = sorted(reps, key=lambda r: r["seconds"])
    med = dict(ordered[(len(ordered) - 1) // 2])
    med["seconds"] = statistics.median(r["seconds"] for r in reps)
    med["seconds_all"] = [r["seconds"] for r in reps]
    return med


# ---------------------------------------------------------------------------------- a workload
def bench_workload(model, tokenizer, workload: str, *, num_requests: int = 32, scale: float | str = 1.0,
                   seed: int = 0, modes: list[dict] | None = None, repeats: int = 3, base: dict | None = None,
                   progress=None, warmup: bool = True) -> dict:
    """All modes on one workload: {"workload", "bounds", "results", "latency_fit", "traces"}."""
    cfg = model.cfg
    modes = modes or modes_for()
    base = dict(base or {})
    reqs = make_requests(workload, num_requests, seed=seed, scale=scale, max_position=cfg.max_position,
                         vocab_size=cfg.vocab_size, tokenizer=tokenizer)
    if warmup:  # allocator and kernel warm-up, not timed
        run_mode(model, tokenizer, reqs[:2], modes[-1], base, keep_trace=False)
    reps: dict[str, list[dict]] = {m["name"]: [] for m in modes}
    for rep in range(repeats):
        for m in (modes if rep % 2 == 0 else modes[::-1]):
            reps[m["name"]].append(run_mode(model, tokenizer, reqs, m, base, progress))
    raws = {m["name"]: median_raw(reps[m["name"]]) for m in modes}
    settings = {**base, "repeats": repeats, "workload": workload, "seed": seed}
    results = summarize(raws, cfg, reqs, settings)
    trace = [r for raw in raws.values() for r in raw["trace"]]
    ctx = mean_decode_context(reqs)
    out = {"workload": describe(reqs, workload, scale, cfg.max_position), "bounds": bounds_block(cfg, reqs),
           "results": results, "latency_fit": fits_to_json(fit_trace(trace), ctx),
           "untraced_seconds_per_step": {n: max(0.0, (r["seconds"] - r["traced_seconds"]) / max(1, r["steps"]))
                                         for n, r in raws.items()},
           "traces": {n: r["trace"] for n, r in raws.items()},
           "exit_depths": raws[next((m["name"] for m in modes if m["name"].startswith("cdb_refill")), modes[-1]["name"])]
           ["exit_depths"]}
    fd, cbr = next((r for r in results if r["mode"] == "cdb_full_depth"), None), next(
        (r for r in results if r["mode"] == "cb"), None)
    if fd and cbr:
        out["full_depth_vs_cb"] = fd["output_tokens_per_s"] / cbr["output_tokens_per_s"]
    cdb = [r for r in results if r["mode"].startswith("cdb_") and r["mode"] != "cdb_full_depth"]
    if cdb and cbr:
        best = max(cdb, key=lambda r: r["output_tokens_per_s"])
        out["best"] = {"mode": best["mode"], "speedup_vs_cb": best["speedup_vs_cb"],
                       "fraction_of_bound": best["fraction_of_bound"]}
    return out


# ---------------------------------------------------------------------------------- the API
def throughput(model, *, policy="cdb", refill=True, min_coda_batch=1, kv_layout="last_exited", exit_threshold=None,
               r_min=None, lookahead=False, workload="alpaca", num_requests=32, scale=1.0, seed=0,
               max_batch_size=32, dtype="float32", device="cpu") -> dict:
    """Offline throughput of one engine configuration on a workload (EOS ignored, one timed run
    after a 2-request warm-up). `model`: checkpoint folder, preset name or LoopedLM; `scale`
    shrinks the trace lengths ("auto": fit the model's context). Returns output_tokens_per_s,
    requests_per_s, mean_exit_depth, seconds, num_requests, output_tokens, alpha (prefill share),
    stage statistics and the settings."""
    from .llm import load_model

    m, tok = load_model(model, dtype, device)
    base = dict(kv_layout=kv_layout, max_batch_size=max_batch_size, exit_threshold=exit_threshold, r_min=r_min,
                lookahead=lookahead)
    mode = {"name": policy if policy == "cb" else f"cdb_{'refill_k%d' % min_coda_batch if refill else 'norefill'}",
            "policy": policy, "refill": refill, "min_coda_batch": min_coda_batch}
    reqs = make_requests(workload, num_requests, seed=seed, scale=scale, max_position=m.cfg.max_position,
                         vocab_size=m.cfg.vocab_size, tokenizer=tok)
    run_mode(m, tok, reqs[:2], mode, base, keep_trace=False)
    raw = run_mode(m, tok, reqs, mode, base, keep_trace=False)
    full = policy == "cb"
    return {"output_tokens_per_s": raw["output_tokens"] / raw["seconds"],
            "requests_per_s": raw["num_requests"] / raw["seconds"],
            "mean_exit_depth": float(m.cfg.r_max) if full else raw["mean_exit_depth"],
            "seconds": raw["seconds"], "num_requests": raw["num_requests"], "output_tokens": raw["output_tokens"],
            "alpha": raw["prefill_seconds"] / raw["traced_seconds"] if raw["traced_seconds"] else None,
            "exit_depth_hist": raw["exit_depth_hist"], "stages": raw["stages"],
            "workload": describe(reqs, workload, scale, m.cfg.max_position),
            "settings": {**base, **_mode_kwargs(mode), "workload": workload, "num_requests": num_requests,
                         "scale": scale, "seed": seed, "dtype": dtype, "device": device}}


# ---------------------------------------------------------------------------------- output
def format_table(block: dict) -> str:
    w = block["workload"]
    lines = [f"== {w['workload']}: {w['num_requests']} requests, prompt {w['mean_prompt_len']:.1f} / output "
             f"{w['mean_output_len']:.1f} tokens (trace {w['trace_mean_prompt_len']:.0f} / "
             f"{w['trace_mean_output_len']:.0f}; lengths scaled x{w['scale']:.3g}"
             + (f", {w['clamped_to_context']} clamped to the context {w['max_position']}" if w["clamped_to_context"] else "")
             + ")",
             f"{'mode':16s} {'out tok/s':>10s} {'req/s':>7s} {'depth':>6s} {'alpha':>6s} {'S_dec':>6s} "
             f"{'S_e2e':>6s} {'speedup':>8s} {'of bound':>8s}"]
    f = (lambda x, p=3: f"{x:.{p}f}" if isinstance(x, (int, float)) else "-")
    pct = (lambda x: f"{100 * x:.1f}%" if isinstance(x, (int, float)) else "-")
    for r in block["results"]:
        lines.append(f"{r['mode']:16s} {r['output_tokens_per_s']:10.1f} {r['requests_per_s']:7.2f} "
                     f"{r['mean_exit_depth']:6.2f} {f(r['alpha'], 3):>6s} {f(r['s_dec'], 3):>6s} {f(r['s_e2e'], 3):>6s} "
                     f"{f(r['speedup_vs_cb'], 3):>8s} {pct(r['fraction_of_bound']):>8s}")
    b = block["bounds"]
    lines.append(f"bound: F0/Fr = {b['f0_over_fr']:.3f} at context {b['context']:.0f}, r_max {b['r_max']}; "
                 + b["formula"])
    if "full_depth_vs_cb" in block:
        lines.append(f"CDB at full depth / CB throughput: {block['full_depth_vs_cb']:.3f}")
    return "\n".join(lines)


def plot(blocks: list[dict], path: Path, title: str = "") -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(blocks), figsize=(4.8 * len(blocks), 4), squeeze=False)
    for ax, blk in zip(axes[0], blocks):
        rs = blk["results"]
        xs = range(len(rs))
        ax.bar(xs, [r["speedup_vs_cb"] or 0 for r in rs], color=["#888" if r["mode"] == "cb" else "#4878d0" for r in rs],
               label="measured speedup")
        ax.scatter(xs, [r["s_e2e"] or 0 for r in rs], marker="_", s=600, color="k", zorder=3, label="bound S_e2e")
        for x, r in zip(xs, rs):
            if r["fraction_of_bound"]:
                ax.text(x, (r["speedup_vs_cb"] or 0) + 0.02, f"{100 * r['fraction_of_bound']:.0f}%", ha="center",
                        fontsize=7)
        ax.axhline(1.0, color="grey", lw=0.8, ls=":")
        ax.set_xticks(list(xs), [r["mode"].replace("cdb_", "") for r in rs], rotation=30, fontsize=8)
        w = blk["workload"]
        ax.set_title(f"{w['workload']} (x{w['scale']:.3g}), alpha={rs[0]['alpha'] or 0:.2f}", fontsize=9)
        ax.set_ylabel("output tokens/s vs CB")
        ax.legend(fontsize=7, loc="lower right")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_outputs(blocks: list[dict], meta: dict, out: Path, name: str, save_trace: bool = False) -> dict[str, Path]:
    out.mkdir(parents=True, exist_ok=True)
    slim = [{k: v for k, v in b.items() if k not in ("traces", "exit_depths")} for b in blocks]
    paths = {"json": out / f"bench_{name}.json", "png": out / f"bench_{name}.png"}
    paths["json"].write_text(json.dumps({**meta, "workloads": slim}, indent=1, default=float))
    plot(blocks, paths["png"], meta.get("title", name))
    if save_trace:
        paths["trace"] = out / f"trace_{name}.json"
        paths["trace"].write_text(json.dumps({"trace": {f"{b['workload']['workload']}/{m}": t for b in blocks
                                                         for m, t in b["traces"].items()},
                                              "exit_depths": {b["workload"]["workload"]: b["exit_depths"] for b in blocks}}))
    return paths


def model_meta(model, source: str, tokenizer) -> dict:
    cfg = model.cfg
    return {"model": source, "config": cfg.name, "arch": cfg.arch, "hidden_size": cfg.hidden_size,
            "layers": [cfg.n_prelude, cfg.n_core, cfg.n_coda], "r_max": cfg.r_max, "vocab_size": cfg.vocab_size,
            "max_position": cfg.max_position, "exit_criterion": cfg.exit_criterion,
            "exit_threshold": cfg.exit_threshold, "params": sum(p.numel() for p in model.parameters()),
            "prompts": "real text (model tokenizer)" if tokenizer is not None else "random token ids (no tokenizer)"}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m infer.bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="ouro-tiny", help="checkpoint folder or preset name (ouro-tiny, huginn-tiny)")
    p.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--scale", default="auto", help="length scale in (0, 1], or 'auto' (fit the model's context)")
    p.add_argument("--ks", type=int, nargs="+", default=[1, 4], help="minimum coda batch sizes for cdb refill")
    p.add_argument("--no-norefill", action="store_true")
    p.add_argument("--no-full-depth", action="store_true", help="skip the cdb full-depth (no exits) run")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-batch-size", type=int, default=32)
    p.add_argument("--kv-layout", default="last_exited", choices=["last_exited", "shared", "full_depth"])
    p.add_argument("--exit-threshold", type=float, default=None)
    p.add_argument("--exit-criterion", default=None)
    p.add_argument("--r-min", type=int, default=None)
    p.add_argument("--lookahead", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (0: torch's default)")
    p.add_argument("--out", type=Path, default=Path("results/bench"))
    p.add_argument("--save-trace", action="store_true", help="also write every run's step trace (for infer.latency fit)")
    a = p.parse_args(argv)
    scale = a.scale if a.scale == "auto" else float(a.scale)
    import torch
    from tqdm.auto import tqdm

    from .llm import load_model
    if a.threads:
        torch.set_num_threads(a.threads)
    model, tok = load_model(a.model, a.dtype, a.device)
    base = dict(kv_layout=a.kv_layout, max_batch_size=a.max_batch_size, exit_threshold=a.exit_threshold,
                exit_criterion=a.exit_criterion, r_min=a.r_min, lookahead=a.lookahead)
    modes = modes_for(a.ks, not a.no_norefill, not a.no_full_depth)
    bar = tqdm(total=len(a.workloads) * a.repeats * len(modes) * a.num_requests, desc="bench", unit="req")
    blocks = [bench_workload(model, tok, w, num_requests=a.num_requests, scale=scale, seed=a.seed, modes=modes,
                             repeats=a.repeats, base=base, progress=bar) for w in a.workloads]
    bar.close()
    name = Path(str(a.model)).name
    meta = {**model_meta(model, str(a.model), tok), "title": f"{name}: speedup over CB vs the bound",
            "command": "python -m infer.bench " + " ".join(argv if argv is not None else __import__("sys").argv[1:]),
            "threads": torch.get_num_threads()}
    for b in blocks:
        print(format_table(b))
    paths = write_outputs(blocks, meta, a.out, name, a.save_trace)
    print(f"json: {paths['json']}\nplot: {paths['png']}" + (f"\ntrace: {paths['trace']}" if "trace" in paths else ""))


if __name__ == "__main__":
    main()

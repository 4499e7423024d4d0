"""Which gate to serve: a checkpoint's held-out score against mean exit depth for each gate and KV
layout, the score and the exact work at matched mean depths (linear interpolation across
thresholds), and paired bootstrap intervals of the differences, all through the engine.

    python -m eval.gates --config eval/sweeps/gates-lab-hops.yaml
    python -m eval.gates --model checkpoints/lab-hops --seed 7 --n 400 --out outputs/gates/lab-hops.json
    python -m eval.gates --model DIR --text .cache/corpus/heldout.txt --n 64 --out outputs/gates/ouro-demo.json

The score is exact match on the lab task's held-out records (train.tasks.hops, `--seed`, `--n`), or
with `--text` bits per byte (lower is better) of `--n` consecutive windows of that text, each
teacher-forced through the engine after its first token (every other token is decoded at its gate's
depth: `forced_output`, as lm-eval's loglikelihood_rolling through eval.lm).

Gates: `stock` (the checkpoint's criterion), `stock_late` (the same gate read one step late:
lookahead=True), and, where the checkpoint carries them (train/distill_gate.py), `lookahead_head`
(criterion lookahead_gate) and `preloop`. Each runs every threshold of `--thresholds` (r_min 1) on
the same records (policy cdb, batch 128) under each layout of `--kv-layouts`, beside one full-depth
CB run per layout. Per point: the exact work of the run against that CB run (`compute_ratio`,
`weight_traffic_ratio`: infer/sim/work.py, from the engine's trace; they depend only on the
requests and the exit depths) and the measured `speedup_vs_cb` (output tokens per second over CB's;
single runs on this machine, noisy, no interval).

Intervals: every gate and layout decodes the same records, so the differences at a matched depth are
paired; `bootstrap` resamples records (windows), recomputes each point's score and mean depth,
interpolates again, and gives the 95% percentile interval of each difference (resamples where a
gate's sweep does not reach the depth are dropped and counted).
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import time
from pathlib import Path

import numpy as np
import yaml

from eval.lab import run
from infer.sim.work import ratios, work_counts
from train.tasks.hops import generate

GATES = {"stock": {}, "stock_late": {"lookahead": True}, "lookahead_head": {"exit_criterion": "lookahead_gate"},
         "preloop": {"exit_criterion": "preloop"}}
# differences reported with intervals at each matched depth: (gate, against gate), same layout
PAIRS = (("lookahead_head", "stock_late"), ("preloop", "stock"), ("stock_late", "stock"))
BASE_LAYOUT = "last_exited"  # other layouts are compared with it, gate by gate


def at_depth(points: list[dict], depth: float, key: str = "acc") -> float | None:
    """`key` (the score) at a mean exit depth, linearly interpolated between the two nearest points
    of a gate's threshold sweep (None outside the depths it reached)."""
    pts = sorted((p["mean_exit_depth"], p[key]) for p in points if p.get(key) is not None)
    xs, ys = [x for x, _ in pts], [y for _, y in pts]
    if not xs or depth < xs[0] or depth > xs[-1]:
        return None
    return float(np.interp(depth, xs, ys))


def text_run(llm, windows: list[list[int]], window_bytes: list[int], **overrides) -> dict:
    """Teacher-forced bits per byte of `windows` (the first token of each is the prompt), the decoded
    tokens' mean exit depth, and per window its nats, bytes and depth sum / count (`items`)."""
    from infer.engine.sampling_params import SamplingParams
    eng, t0 = llm.engine, time.time()
    seqs = [eng.add_request(w[:1], SamplingParams(**overrides), forced_output=w[1:]) for w in windows]
    while eng.has_unfinished():
        eng.step()
    items = {"nats": [-sum(s.logprobs) for s in seqs], "bytes": list(window_bytes),
             "depth_sum": [float(sum(s.exit_depths[1:])) for s in seqs], "depth_n": [len(s.exit_depths) - 1 for s in seqs]}
    out = {"acc": sum(items["nats"]) / math.log(2) / sum(window_bytes),
           "mean_exit_depth": sum(items["depth_sum"]) / sum(items["depth_n"]), "hard_over_easy": None,
           "output_tokens": sum(len(s.output_ids) for s in seqs), "seconds": time.time() - t0, "items": items}
    for s in seqs:
        eng.release(s.request_id)
    return out


def _scores(items: dict, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Score and mean depth of one point for each resample (rows of `idx`, record indices)."""
    depth = np.asarray(items["depth_sum"])[idx].sum(-1) / np.maximum(1, np.asarray(items["depth_n"])[idx].sum(-1))
    if "correct" in items:
        return np.asarray(items["correct"])[idx].mean(-1), depth
    return np.asarray(items["nats"])[idx].sum(-1) / math.log(2) / np.asarray(items["bytes"])[idx].sum(-1), depth


def bootstrap(runs: dict[str, dict[str, list[dict]]], depths: list[float], iters: int, seed: int) -> list[dict]:
    """Paired bootstrap over records of the score differences at matched depths: PAIRS within each
    layout, and each layout against BASE_LAYOUT gate by gate. `runs[layout][gate]` are the sweep
    points, each with its per-record `items`."""
    n = len(next(iter(next(iter(runs.values())).values()))[0]["items"]["depth_n"])
    idx = np.random.default_rng(seed).integers(0, n, size=(iters, n))
    curves = {}  # (layout, gate) -> ([iters, points] depths, scores), sorted by depth per resample
    for lay, gates in runs.items():
        for g, pts in gates.items():
            sc, dp = zip(*(_scores(p["items"], idx) for p in pts))
            sc, dp = np.stack(sc, 1), np.stack(dp, 1)
            o = np.argsort(dp, 1)
            curves[(lay, g)] = (np.take_along_axis(dp, o, 1), np.take_along_axis(sc, o, 1))

    def interp(key, d):
        dp, sc = curves[key]
        ok = (dp[:, 0] <= d) & (d <= dp[:, -1])
        return np.array([np.interp(d, x, y) if k else np.nan for x, y, k in zip(dp, sc, ok)])

    pairs = [((lay, a), (lay, b)) for lay, gates in runs.items() for a, b in PAIRS if a in gates and b in gates]
    pairs += [((lay, g), (BASE_LAYOUT, g)) for lay in runs if lay != BASE_LAYOUT and BASE_LAYOUT in runs
              for g in runs[lay] if g in runs[BASE_LAYOUT]]
    out = []
    for a, b in pairs:
        for d in depths:
            pa, pb = at_depth(runs[a[0]][a[1]], d), at_depth(runs[b[0]][b[1]], d)
            if pa is None or pb is None:
                continue
            diff = interp(a, d) - interp(b, d)
            diff = diff[~np.isnan(diff)]
            lo, hi = (np.percentile(diff, [2.5, 97.5]) if len(diff) else (None, None))
            out.append({"a": f"{a[0]}/{a[1]}", "b": f"{b[0]}/{b[1]}", "depth": d, "diff": pa - pb,
                        "ci95": [float(lo), float(hi)] if len(diff) else None, "resamples": int(len(diff))})
    return out


def _point(r: dict, q: float | None, work: dict, cb: dict | None) -> dict:
    tps = r["output_tokens"] / r["seconds"]
    return {"threshold": q, "acc": r["acc"], "mean_exit_depth": r["mean_exit_depth"], "hard_over_easy": r["hard_over_easy"],
            "tokens_per_s": tps, **ratios(work, cb["work"] if cb else None),
            "speedup_vs_cb": tps / cb["tokens_per_s"] if cb else None, "work": work, "items": r["items"]}


def compare(model: str, seed: int, n: int, thresholds: list[float], depths: list[float],
            kv_layouts: list[str | None] = (None,), text: Path | None = None, iters: int = 1000) -> dict:
    from infer.engine.llm import LLM
    from looplm.io import read_config
    cfg = read_config(Path(model))
    gates = {k: v for k, v in GATES.items() if k not in ("lookahead_head", "preloop") or
             getattr(cfg, "lookahead_gate" if k == "lookahead_head" else "preloop_gate")}
    records = generate(seed, n, 1, 4, 3) if text is None else None
    window_bytes = None
    out = {"model": model, "heldout": {"seed": seed, "n": n} if text is None else {"text": str(text), "windows": n},
           "score": "exact match" if text is None else "bits per byte", "bootstrap": {"iters": iters, "seed": seed},
           "cb": {}, "runs": {}}

    def llm_for(layout, **kw):
        nonlocal records, window_bytes
        # no prefix caching: every run of the same records recomputes their prompts, so the work counts
        # of the points (and of the CB run they are divided by) are comparable
        llm = LLM(model, max_batch_size=128, dtype="float32", device="cpu", kv_layout=layout, trace=True,
                  enable_prefix_caching=False, **kw)
        if text is not None and records is None:
            L = llm.engine.max_model_len - 1
            ids = llm.tokenizer(Path(text).read_text()[: 400 * L * n])["input_ids"]
            records = [ids[i * L:(i + 1) * L] for i in range(min(n, len(ids) // L))]
            window_bytes = [len(llm.tokenizer.decode(w[1:]).encode()) for w in records]
            out["heldout"].update(tokens=sum(len(w) - 1 for w in records), bytes=sum(window_bytes))
        return llm

    def measured(llm, **overrides) -> tuple[dict, dict]:
        llm.engine.trace.clear()
        r = (run(llm, records, per_record=True, **overrides) if text is None else
             text_run(llm, records, window_bytes, **overrides))
        return r, work_counts(llm.engine.trace, llm.engine.model.cfg, llm.engine.model.dtype.itemsize)

    for layout in kv_layouts:
        llm = None
        gc.collect()
        llm = llm_for(layout, policy="cb")
        lay = llm.config.kv_layout  # the resolved name (None: the checkpoint's)
        r, work = measured(llm)
        cb = out["cb"][lay] = _point(r, None, work, None)
        print(json.dumps({"layout": lay, "gate": "cb", **{k: v for k, v in cb.items() if k not in ("items", "work")}}),
              flush=True)
        out["runs"][lay] = {}
        for name, kw in gates.items():
            del llm
            gc.collect()  # one engine's KV pool alive at a time
            llm = llm_for(layout, policy="cdb", **kw)
            pts = out["runs"][lay][name] = []
            for q in thresholds:
                r, work = measured(llm, exit_threshold=q, r_min=1)
                pts.append(_point(r, q, work, cb))
                print(json.dumps({"layout": lay, "gate": name, **{k: v for k, v in pts[-1].items()
                                                                  if k not in ("items", "work")}}), flush=True)
    keys = ("acc", "compute_ratio", "weight_traffic_ratio", "speedup_vs_cb")
    out["matched"] = {lay: {str(d): {g: {k: at_depth(p, d, k) for k in keys} for g, p in gates_.items()}
                            for d in depths} for lay, gates_ in out["runs"].items()}
    out["differences"] = bootstrap(out["runs"], depths, iters, seed)
    return out


def plot(res: dict, path: Path) -> Path:
    """Score against mean exit depth, one panel per layout, one line per gate; CB's full-depth point
    and the matched depths as vertical guides."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    lays = list(res["runs"])
    fig, axes = plt.subplots(1, len(lays), figsize=(5 * len(lays), 4), sharey=True, squeeze=False)
    for ax, lay in zip(axes[0], lays):
        for g, pts in res["runs"][lay].items():
            pts = sorted(pts, key=lambda p: p["mean_exit_depth"])
            ax.plot([p["mean_exit_depth"] for p in pts], [p["acc"] for p in pts], marker="o", ms=3, label=g)
        cb = res["cb"][lay]
        ax.scatter([cb["mean_exit_depth"]], [cb["acc"]], marker="*", s=80, color="black", label="CB (full depth)")
        for d in res["matched"][lay]:
            ax.axvline(float(d), color="gray", lw=0.5, ls=":")
        ax.set(title=lay, xlabel="mean exit depth", ylabel=res["score"])
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"{Path(res['model']).name}: {res['score']} vs mean exit depth per gate")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", type=Path, default=None, help="a YAML file of these options (eval/sweeps/gates-*.yaml); "
                                                            "flags given on the command line win")
    p.add_argument("--model", default=None)
    p.add_argument("--seed", type=int, default=7, help="held-out records' seed, and the bootstrap's")
    p.add_argument("--n", type=int, default=400)
    p.add_argument("--thresholds", type=float, nargs="+", default=[0.1, 0.3, 0.5, 0.7, 0.8, 0.9, 0.97])
    p.add_argument("--depths", type=float, nargs="+", default=[2.0, 2.25, 2.5, 2.75, 3.0],
                   help="mean exit depths to compare the gates at")
    p.add_argument("--kv-layouts", nargs="+", default=[None], help="layouts to run each gate under (default: the "
                                                                  "checkpoint's)")
    p.add_argument("--text", type=Path, default=None, help="score bits per byte on this text instead of the lab task")
    p.add_argument("--bootstrap", type=int, default=1000, help="resamples of the paired bootstrap")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--plot", type=Path, default=None, help="write the score-vs-depth plot here (PNG)")
    a = p.parse_args(argv)
    if a.config is not None:
        spec = yaml.safe_load(a.config.read_text()) or {}
        unknown = sorted(set(spec) - {x.dest for x in p._actions})
        if unknown:
            p.error(f"{a.config}: unknown option(s) {unknown}")
        p.set_defaults(**{k: (Path(v) if k in ("text", "out", "plot") and v is not None else v) for k, v in spec.items()})
        a = p.parse_args(argv)
    if a.model is None:
        p.error("--model is required (or a --config naming it)")
    res = compare(a.model, a.seed, a.n, a.thresholds, a.depths, a.kv_layouts, a.text, a.bootstrap)
    print(json.dumps({"matched": res["matched"], "differences": res["differences"]}, indent=1))
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(res) + "\n")
    if a.plot:
        plot(res, a.plot)


if __name__ == "__main__":
    main()

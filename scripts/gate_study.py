"""Exit gates added to a model that ships none, against the training-free criteria they learn from,
at matched mean depth (issue 59, deliverable 4).

    python -m scripts.gate_study --out outputs/gate-study            # ~40 min on 2 CPU cores
    python -m scripts.gate_study --out outputs/gate-study --table    # the tables from the finished runs

Steps (each skipped when its output exists, so a re-run continues):
1. checkpoints/huginn-demo with its exit gate removed (tensors and config keys): OUT/stripped.
2. Alpaca's instruction / response pairs (the workloads' 5,000, else the 200 in infer/sim/data) as
   chat `messages`: OUT/alpaca_chat.jsonl.
3. `train/distill_gate.py --add-gate` on OUT/stripped, assistant-only, packed documents, against
   `--teacher kl` and `--teacher latent_diff` (each at a threshold giving mean depth ~3.2 on that
   data): OUT/gate-kl, OUT/gate-latent_diff. The model stays frozen; only the gate trains.
4. Every method's thresholds calibrated (teacher-forced, on the Alpaca windows, not the evaluation's
   documents) to mean depths DEPTHS: kl and latent_diff on OUT/stripped, `learned` on each added
   gate, and the stock gate of checkpoints/huginn-demo (trained in pretraining on its own losses).
5. One eval.sweep per method: lm-eval's looped_ppl (bits per byte) and looped_reasoning (exact match)
   through the engine (last_exited, r_min 1), per-document values kept (`samples`), and each point's
   H100 throughput from its own exits (`--throughput sim:h100`: the recorded exits replayed by the
   simulator on huginn-demo's shape).
6. The tables (printed as JSON, and OUT/table.json; the plot OUT/gate_study.png): every point's depth,
   bits/byte with a 95% bootstrap interval over documents and its paired difference from full depth
   (CB's documents resampled together), exact match and simulated H100 tokens/s; then bits/byte at
   matched mean depths, each method's two nearest points interpolated in depth, and the paired
   bootstrap interval (documents resampled together for every method) of each method's difference
   from kl.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "checkpoints" / "huginn-demo"
ALPACA = [ROOT.parent / "shared" / "data" / "workloads" / "alpaca_prompts.jsonl",
          ROOT / "infer" / "sim" / "data" / "alpaca_text.jsonl"]
DEPTHS = (2.2, 2.6, 3.0, 3.5, 4.2)  # the mean depths each method's thresholds are calibrated to
TEACHERS = {"kl": 0.03, "latent_diff": 0.2}  # teacher thresholds: mean depth ~3.2 on the Alpaca windows
TASKS = "looped_ppl,looped_reasoning"
SEED = 0


def log(msg: str) -> None:
    print(f"[gate_study] {msg}", file=sys.stderr, flush=True)


def strip_gate(src: Path, dst: Path) -> None:
    """src without its exit gate: no exit_gate tensors, exit_gate false, Huginn's own kl criterion."""
    from safetensors.torch import load_file, save_file
    tmp = dst.with_name(dst.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src, tmp)
    tensors = load_file(str(tmp / "model.safetensors"))
    kept = {k: v for k, v in tensors.items() if not k.startswith("exit_gate.")}
    assert len(kept) < len(tensors), "the source has no exit gate to strip"
    save_file(kept, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((tmp / "config.json").read_text())
    cfg.update(exit_gate=False, exit_criterion="kl", exit_threshold=TEACHERS["kl"])
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    for f in ("eval.json", "history.json", "loss_curve.png"):  # the source's own run records
        (tmp / f).unlink(missing_ok=True)
    tmp.replace(dst)


def chat_data(dst: Path) -> str:
    src = next(p for p in ALPACA if p.exists())
    rows = [json.loads(line) for line in src.read_text().splitlines() if line.strip()]
    empty = [r for r in rows if not (r["prompt"].strip() and r["output"].strip())]
    log(f"{src}: {len(rows)} rows, {len(empty)} with an empty prompt or response left out")
    with open(dst.with_suffix(".tmp"), "w") as f:
        for r in rows:
            if r in empty:
                continue
            f.write(json.dumps({"messages": [{"role": "user", "content": r["prompt"]},
                                             {"role": "assistant", "content": r["output"]}]}) + "\n")
    dst.with_suffix(".tmp").replace(dst)
    return str(src)


def run(cmd: list[str]) -> None:
    log(" ".join(cmd))
    subprocess.run(cmd, check=True, cwd=ROOT)


def add_gate(out: Path, teacher: str, steps: int) -> list[str]:
    cmd = [sys.executable, "train/distill_gate.py", "--model", str(out / "stripped"), "--add-gate",
           "--teacher", teacher, "--teacher-threshold", str(TEACHERS[teacher]), "--dataset",
           str(out / "alpaca_chat.jsonl"), "--ctx", "128", "--batch", "8", "--frozen-batch", "8", "--steps", str(steps),
           "--warmup", "50", "--lr", "3e-3", "--eval-windows", "64", "--eval-batch", "8", "--log-every", "50", "--seed", str(SEED), "--no-wandb",
           "--output", str(out / f"gate-{teacher}")]
    if not (out / f"gate-{teacher}" / "config.json").exists():
        run(cmd)
    return cmd[1:]


def calibration_windows(out: Path, n: int = 64):
    """The held-out Alpaca chat windows the trainers pack, as (ids, assistant-token masks, docs)."""
    from train.datasource import from_dataset
    data = from_dataset(str(out / "alpaca_chat.jsonl"), "text", SOURCE, 128, 0.1, cache_root=out / "cache")
    return data.eval(128, n), data.eval_mask(128, n), data.eval_doc(128, n)


def calibrate(folder: Path, criterion: str, windows, depths=DEPTHS) -> list[float]:
    """Thresholds at which `criterion` exits at each of `depths` (mean, teacher-forced, r_min 1) on
    the windows' assistant tokens: bisection on the threshold (in log space for kl / latent_diff)."""
    import torch
    from looplm.io import load_pretrained
    from looplm.policy import ExitPolicy
    from train.common import collect_outputs, summarize_exit
    torch.set_num_threads(1)
    m = load_pretrained(folder, dtype="float32").eval()
    ids, masks, docs = windows
    o = collect_outputs(m, ids, m.cfg.r_max, masks=masks, docs=docs)

    def depth(q: float) -> float:
        return summarize_exit(o, ExitPolicy(criterion, q, 1, m.cfg.r_max))["mean_depth"]
    out = []
    for want in depths:
        # the depth grows as kl / latent_diff thresholds fall, and as a gate's threshold rises
        lo, hi = (math.log(1e-6), math.log(1.0)) if criterion != "learned" else (0.0, 1.0)
        for _ in range(40):
            mid = (lo + hi) / 2
            d = depth(math.exp(mid) if criterion != "learned" else mid)
            if (d > want) == (criterion != "learned"):
                lo = mid
            else:
                hi = mid
        q = math.exp((lo + hi) / 2) if criterion != "learned" else (lo + hi) / 2
        out.append(float(f"{q:.4g}"))
    return out


def sweep(out: Path, name: str, folder: Path, criterion: str, thresholds: list[float], limit: int,
          baselines: bool) -> Path:
    """One eval.sweep over `thresholds` (its own yaml in OUT/sweeps/), results in OUT/sweeps/NAME."""
    import yaml
    d = out / "sweeps" / name
    if (d / "results.json").exists():
        return d
    spec = {"name": f"gate-study-{name}", "program": "eval/sweep.py", "method": "grid",
            "parameters": {"pretrained": {"value": str(folder)}, "tasks": {"value": TASKS},
                           "limit": {"value": limit}, "batch_size": {"value": 32}, "bench_workload": {"value": "alpaca"},
                           "bench_requests": {"value": 8}, "baselines": {"value": baselines},
                           "samples": {"value": True}, "seed": {"value": SEED},
                           "exit_criterion": {"value": criterion}, "exit_threshold": {"values": thresholds},
                           "r_min": {"value": 1}, "kv_layout": {"value": "last_exited"}, "lookahead": {"value": False}}}
    f = out / "sweeps" / f"{name}.yaml"
    f.parent.mkdir(parents=True, exist_ok=True)
    f.write_text(yaml.safe_dump(spec, sort_keys=False))
    run([sys.executable, "-m", "eval.sweep", "run", str(f), "--throughput", "sim:h100", "--out", str(d)])
    return d


# ---------------------------------------------------------------- the tables
def per_doc(row: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A point's documents: looped_ppl (log-likelihood, bytes) and looped_reasoning exact match."""
    s = json.loads(Path(row["samples"]).read_text())
    ppl = sorted(s["looped_ppl"], key=lambda x: int(x["doc_id"]))
    em = sorted(s["looped_reasoning"], key=lambda x: int(x["doc_id"]))
    return (np.array([x["bits_per_byte"][0] for x in ppl]), np.array([x["bits_per_byte"][1] for x in ppl]),
            np.array([x["exact_match"] for x in em], dtype=float))


def bpb(ll: np.ndarray, nbytes: np.ndarray, idx=None) -> np.ndarray | float:
    """Bits per byte of the documents (idx [R, N]: R resamples at once), lm-eval's formula."""
    if idx is None:
        return -ll.sum() / nbytes.sum() / math.log(2)
    return -ll[idx].sum(-1) / nbytes[idx].sum(-1) / math.log(2)


def interp(depths: list[float], values: np.ndarray, at: float):
    """values [..., P] at mean depth `at`, linear between the two points that bracket it (None outside)."""
    order = np.argsort(depths)
    d = np.asarray(depths)[order]
    if not d[0] <= at <= d[-1]:
        return None
    k = min(int(np.searchsorted(d, at, side="right")) - 1, len(d) - 2)
    w = (at - d[k]) / (d[k + 1] - d[k]) if d[k + 1] > d[k] else 0.0
    v = values[..., order]
    return v[..., k] * (1 - w) + v[..., k + 1] * w


def tables(out: Path, methods: dict[str, Path], iters: int = 2000) -> dict:
    rng = np.random.default_rng(SEED)
    pts: dict[str, list[dict]] = {}
    cb = None
    for name, d in methods.items():
        for row in json.loads((d / "results.json").read_text()):
            if row.get("policy") == "cb":
                cb = cb or row
                continue
            pts.setdefault(name, []).append(row)
    first = per_doc(next(iter(pts.values()))[0])
    n_ppl, n_em = len(first[0]), len(first[2])
    idx = rng.integers(0, n_ppl, size=(iters, n_ppl))
    idx_em = rng.integers(0, n_em, size=(iters, n_em))
    points, boot = [], {}
    cb_ll, cb_nb, _ = per_doc(cb)
    cb_boot = bpb(cb_ll, cb_nb, idx)  # full depth on the same resamples: each point's paired difference
    for name, rows in pts.items():
        for row in sorted(rows, key=lambda r: r["mean_exit_depth"]):
            ll, nb, em = per_doc(row)
            b = bpb(ll, nb, idx)
            boot.setdefault(name, []).append(b)
            e = em[idx_em].mean(-1)
            points.append({"method": name, "threshold": row["exit_threshold"], "mean_depth": round(row["mean_exit_depth"], 3),
                           "bits_per_byte": round(float(bpb(ll, nb)), 4),
                           "bpb_ci95": [round(float(x), 4) for x in np.percentile(b, [2.5, 97.5])],
                           "minus_full_depth": round(float(bpb(ll, nb) - bpb(cb_ll, cb_nb)), 4),
                           "minus_full_depth_ci95": [round(float(x), 4) for x in np.percentile(b - cb_boot, [2.5, 97.5])],
                           "exact_match": round(float(em.mean()), 4),
                           "em_ci95": [round(float(x), 4) for x in np.percentile(e, [2.5, 97.5])],
                           "sim_h100_tok_s": round(row["sim/output_tokens_per_s"]),
                           "sim_h100_vs_cb": round(row["sim/speedup_vs_cb"], 3), "sim_command": row["sim/command"]})
    matched = []
    depth_of = {name: sorted(r["mean_exit_depth"] for r in rows) for name, rows in pts.items()}
    for at in DEPTHS[1:-1]:
        rec = {"mean_depth": at}
        vals = {}
        for name in pts:
            v = interp(depth_of[name], np.stack(boot[name], -1), at)  # [iters] bootstrap values at depth `at`
            if v is None:
                continue
            full = [p["bits_per_byte"] for p in points if p["method"] == name]
            tok = [p["sim_h100_tok_s"] for p in points if p["method"] == name]
            vals[name] = v
            rec[name] = {"bits_per_byte": round(float(interp(depth_of[name], np.array(full), at)), 4),
                         "ci95": [round(float(x), 4) for x in np.percentile(v, [2.5, 97.5])],
                         "sim_h100_tok_s": round(float(interp(depth_of[name], np.array(tok, dtype=float), at)))}
        for name, v in vals.items():
            if name != "kl" and "kl" in vals:
                diff = v - vals["kl"]
                rec[name]["minus_kl"] = round(float(rec[name]["bits_per_byte"] - rec["kl"]["bits_per_byte"]), 4)
                rec[name]["minus_kl_ci95"] = [round(float(x), 4) for x in np.percentile(diff, [2.5, 97.5])]
        matched.append(rec)
    cb_row = None if cb is None else {"mean_depth": cb["mean_exit_depth"], "bits_per_byte": round(float(bpb(*per_doc(cb)[:2])), 4),
                                      "exact_match": round(float(per_doc(cb)[2].mean()), 4),
                                      "sim_h100_tok_s": round(cb["sim/output_tokens_per_s"])}
    return {"points": points, "matched_depth": matched, "cb_full_depth": cb_row, "documents": {"looped_ppl": n_ppl,
            "looped_reasoning": n_em}, "bootstrap_iters": iters, "seed": SEED}


def plot(res: dict, path: Path) -> None:
    """bits/byte above full depth's (paired 95% interval) against mean depth and against simulated H100
    tokens/s, per method."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for name in dict.fromkeys(p["method"] for p in res["points"]):
        pts = sorted((p for p in res["points"] if p["method"] == name), key=lambda p: p["mean_depth"])
        y = np.array([p["minus_full_depth"] for p in pts])
        err = np.abs(np.array([p["minus_full_depth_ci95"] for p in pts]).T - y)
        for ax, x in zip(axes, ([p["mean_depth"] for p in pts], [p["sim_h100_tok_s"] for p in pts])):
            ax.errorbar(x, y, yerr=err, marker="o", capsize=3, label=name)
    cb = res.get("cb_full_depth")
    if cb:
        axes[0].axhline(0, color="gray", ls="--", lw=1, label=f"full depth ({cb['bits_per_byte']:.4f})")
        axes[1].scatter([cb["sim_h100_tok_s"]], [0], color="gray", marker="s", label="CB, full depth")
    ylabel = "bits/byte minus full depth's (paired 95% CI)"
    axes[0].set(xlabel="mean exit depth (lm-eval's scored tokens)", ylabel=ylabel)
    axes[1].set(xlabel="simulated H100 output tokens/s (each point's own exits)", ylabel=ylabel)
    axes[0].legend(fontsize=8)
    fig.suptitle("huginn-demo: gates added (distill_gate --add-gate) vs the criteria they learned from", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=ROOT / "outputs" / "gate-study")
    p.add_argument("--steps", type=int, default=200, help="distill_gate steps per gate")
    p.add_argument("--limit", type=int, default=100, help="documents per task (of 200)")
    p.add_argument("--table", action="store_true", help="only the tables, from finished sweeps")
    a = p.parse_args(argv)
    out = a.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("WANDB_MODE", "offline")
    methods = {"kl": out / "sweeps" / "kl", "latent_diff": out / "sweeps" / "latent_diff",
               "gate_from_kl": out / "sweeps" / "gate_from_kl", "gate_from_latent_diff": out / "sweeps" / "gate_from_latent_diff",
               "stock_gate": out / "sweeps" / "stock_gate"}
    record = json.loads((out / "study.json").read_text()) if (out / "study.json").exists() else {}
    if not a.table:
        if not (out / "stripped").exists():
            strip_gate(SOURCE, out / "stripped")
        if not (out / "alpaca_chat.jsonl").exists():
            record["data"] = chat_data(out / "alpaca_chat.jsonl")
        record["train_commands"] = {t: add_gate(out, t, a.steps) for t in TEACHERS}
        if "thresholds" not in record:
            w = calibration_windows(out)
            record["thresholds"] = {
                "kl": calibrate(out / "stripped", "kl", w), "latent_diff": calibrate(out / "stripped", "latent_diff", w),
                "gate_from_kl": calibrate(out / "gate-kl", "learned", w),
                "gate_from_latent_diff": calibrate(out / "gate-latent_diff", "learned", w),
                "stock_gate": calibrate(SOURCE, "learned", w)}
            record["calibrated_depths"] = list(DEPTHS)
            (out / "study.json").write_text(json.dumps(record, indent=2) + "\n")
        folders = {"kl": (out / "stripped", "kl"), "latent_diff": (out / "stripped", "latent_diff"),
                   "gate_from_kl": (out / "gate-kl", "learned"), "gate_from_latent_diff": (out / "gate-latent_diff", "learned"),
                   "stock_gate": (SOURCE, "learned")}
        for i, (name, (folder, crit)) in enumerate(folders.items()):
            sweep(out, name, folder, crit, record["thresholds"][name], a.limit, baselines=i == 0)
    res = tables(out, methods)
    res["thresholds"] = record.get("thresholds")
    res["train_commands"] = record.get("train_commands")
    (out / "table.json").write_text(json.dumps(res, indent=2) + "\n")
    plot(res, out / "gate_study.png")
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()

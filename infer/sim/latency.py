"""The seed's stage latency model `t(N_c, N_b) = delta + gamma N_b + alpha N_c`, fitted by least
squares per stage from the engine's own step trace, and a sweep that measures core-step latency
over batch sizes x context lengths.

    python -m infer.sim.latency sweep --model ouro-tiny --batch-sizes 1 4 16 64 --contexts 64 256 --out outputs/latency
    python -m infer.sim.latency fit outputs/bench/trace_ouro-tiny.json

N_b is the batch (by default the padded one: the runner computes every padded row), N_c the
context tokens the batch reads (prefill: its prompt tokens). delta is the fixed cost (weights
reloaded, launch and host overhead), gamma the per-item cost, alpha the per-context-token cost.
The saturation batch size B* is where the linear terms overtake delta at a typical context c per
item: B* = delta / (gamma + alpha c).
"""
from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from infer.engine.block_manager import BlockManager
from infer.engine.config import EngineConfig, add_engine_args, engine_config_from_args
from infer.engine.llm import load_model
from infer.engine.progress import progress
from infer.engine.runner import ModelRunner
from infer.engine.sampling_params import SamplingParams
from infer.engine.scheduler import Work
from infer.engine.sequence import Sequence, Stage
from infer.engine.trace import TraceRow


@dataclass
class StageFit:
    stage: str
    delta: float  # seconds
    gamma: float  # seconds per batch item
    alpha: float  # seconds per context token read
    r2: float
    n: int  # trace rows fitted
    batch_key: str = "padded"

    def predict(self, batch: float, context: float) -> float:
        return self.delta + self.gamma * batch + self.alpha * context

    def saturation_batch(self, context_per_item: float) -> float:
        """B*: the batch at which gamma N_b + alpha N_c equals delta (inf if they never grow)."""
        slope = self.gamma + self.alpha * context_per_item
        return self.delta / slope if slope > 0 else float("inf")


def fit_linear(nb, nc, t) -> tuple[float, float, float, float]:
    """Least squares of t = delta + gamma nb + alpha nc with non-negative coefficients (the best
    of the fits over subsets of the terms, so that a flat stage gets gamma = 0 rather than a
    negative slope). Returns (delta, gamma, alpha, R^2)."""
    nb, nc, t = (np.asarray(x, dtype=float) for x in (nb, nc, t))
    cols = {"delta": np.ones_like(t), "gamma": nb, "alpha": nc}
    ss_tot = float(((t - t.mean()) ** 2).sum())
    best = None
    for k in range(3, 0, -1):
        for names in itertools.combinations(cols, k):
            X = np.stack([cols[c] for c in names], 1)
            coef, *_ = np.linalg.lstsq(X, t, rcond=None)
            if (coef < 0).any():
                continue
            sse = float(((X @ coef - t) ** 2).sum())
            if best is None or sse < best[0] - 1e-18:
                best = (sse, dict(zip(names, coef.tolist())))
        if best is not None and k == 3:
            break  # the unconstrained fit is already non-negative
    if best is None:
        best = (float((t ** 2).sum()), {"delta": 0.0})
    sse, c = best
    r2 = 1.0 - sse / ss_tot if ss_tot > 0 else 1.0
    return c.get("delta", 0.0), c.get("gamma", 0.0), c.get("alpha", 0.0), r2


def fit_trace(trace: list[TraceRow], batch_key: str = "padded") -> dict[str, StageFit]:
    """One fit per stage of an engine trace (rows: stage, batch, padded, tokens, context, seconds)."""
    out = {}
    for stage in sorted({r["stage"] for r in trace}):
        rows = [r for r in trace if r["stage"] == stage]
        key = "batch" if stage == "prefill" else batch_key
        d, g, a, r2 = fit_linear([r[key] for r in rows], [r["context"] for r in rows], [r["seconds"] for r in rows])
        out[stage] = StageFit(stage, d, g, a, r2, len(rows), key)
    return out


def fits_to_json(fits: dict[str, StageFit], context_per_item: float | None = None) -> dict:
    out = {}
    for s, f in fits.items():
        d = asdict(f)
        if context_per_item is not None and s != "prefill":
            d["b_star"] = f.saturation_batch(context_per_item)
            d["b_star_context"] = context_per_item
        out[s] = d
    return out


def sweep(model, batch_sizes: list[int], contexts: list[int], repeats: int = 5, stages=("core",),
          config: EngineConfig | None = None, progress=None, max_tokens: int | None = None) -> list[dict]:
    """Median latency of one decode stage call over batch sizes x context lengths (tokens each
    item attends), measured on the ModelRunner directly with synthetic sequences, with the KV
    layout, block size, padding, CUDA graphs and exit criterion that `config` resolves to for this
    model (the engine's). Points with batch x context > `max_tokens` are skipped (KV memory)."""
    cfg = model.cfg
    ec = (config or EngineConfig()).resolve(cfg, model.device)
    block_size = ec.block_size
    bad = [c for c in contexts if not 1 <= c <= cfg.max_position]
    if bad:
        raise ValueError(f"contexts {bad} outside [1, max_position={cfg.max_position}]")
    points = [(c, b, s) for c, b, s in itertools.product(contexts, batch_sizes, stages)
              if max_tokens is None or b * c <= max_tokens]
    maxb = max(batch_sizes)
    nblocks = max(b * (-(-(c + repeats + 1) // block_size)) for c, b, _ in points) + 1
    bm = BlockManager(nblocks, block_size, maxb)
    policy = ec.exit_policy(cfg)
    runner = ModelRunner(model, ec.kv_layout, bm, policy.criterion, ec.pad_pow2, maxb, cuda_graphs=ec.cuda_graphs,
                         attention_backend=ec.attention_backend)
    rows = []
    for ctx, b, stage in points:
        seqs = []
        for i in range(b):
            # each prelude call moves the device position on (the runner's persistent state): room
            # for the repeats in the sequence's own blocks
            blocks, slot = bm.allocate(ctx + (repeats + 1 if stage == "prelude" else 0))
            # a sequence made at the point of the stage (no scheduler): its blocks, slot and loop step
            # (a coda item exited at r_max: no last-exited fill)
            seqs.append(Sequence(seq_id=i, request_id=str(i), prompt_ids=[FIRST] * max(1, ctx - 1),
                                 params=SamplingParams(max_tokens=1), policy=policy,
                                 output_ids=[FIRST] if ctx > 1 else [], blocks=blocks, slot=slot,
                                 step=1 if stage == "core" else cfg.r_max, stage=Stage(stage)))
        work = Work(Stage(stage), seqs, changed=seqs)  # new slots and block tables for the runner
        with torch.inference_mode():
            runner.run(work)  # warm-up
            work.changed = []
            ts = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                out = runner.run(work)
                if stage == "core":
                    out.get()
                if model.device.type == "cuda":
                    torch.cuda.synchronize(model.device)
                ts.append(time.perf_counter() - t0)
        for s in seqs:
            bm.free(s.blocks, s.slot)
        rows.append({"stage": stage, "batch": b, "padded": runner.padded(b), "context_per_item": ctx,
                     "context": b * ctx, "tokens": b, "seconds": statistics.median(ts), "seconds_all": ts})
        if progress is not None:
            progress.update(1)
    return rows


FIRST = 3  # a harmless token id for the synthetic sequences


def plot_sweep(rows: list[dict], fits: dict[str, StageFit], path: Path, title: str = "") -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stages = sorted({r["stage"] for r in rows})
    fig, axes = plt.subplots(1, len(stages), figsize=(5.5 * len(stages), 4), squeeze=False)
    for ax, stage in zip(axes[0], stages):
        f = fits.get(stage)
        for ctx in sorted({r["context_per_item"] for r in rows}):
            rs = sorted((r for r in rows if r["stage"] == stage and r["context_per_item"] == ctx), key=lambda r: r["batch"])
            bs = [r["batch"] for r in rs]
            (line,) = ax.plot(bs, [1e3 * r["seconds"] for r in rs], "o-", label=f"context {ctx}")
            if f is not None:
                ax.plot(bs, [1e3 * f.predict(r[f.batch_key], r["context"]) for r in rs], "--", color=line.get_color(),
                        alpha=0.6)
                bstar = f.saturation_batch(ctx)
                if bstar < max(bs) * 4:
                    ax.axvline(bstar, color=line.get_color(), ls=":", alpha=0.5)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch size N_b")
        ax.set_ylabel("latency per call (ms)")
        sub = f"  fit R^2={f.r2:.3f}" if f is not None else ""
        ax.set_title(f"{stage} step {title}{sub}\n(dashed: fit, dotted: B*)", fontsize=9)
        ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def print_fits(fits: dict[str, StageFit], context_per_item: float | None = None) -> None:
    print(f"{'stage':8s} {'delta(ms)':>10s} {'gamma(us/item)':>15s} {'alpha(ns/ctx tok)':>18s} {'R^2':>6s} "
          f"{'n':>5s} {'B*':>8s}")
    for s, f in fits.items():
        b = f"{f.saturation_batch(context_per_item):8.1f}" if context_per_item and s != "prefill" else f"{'-':>8s}"
        print(f"{s:8s} {1e3 * f.delta:10.3f} {1e6 * f.gamma:15.2f} {1e9 * f.alpha:18.2f} {f.r2:6.3f} {f.n:5d} {b}")


# ---------------------------------------------------------------------------------- CLI
def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m infer.sim.latency", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("fit", help="fit the latency model to an engine trace (JSON from infer.bench --save-trace)")
    f.add_argument("trace", type=Path)
    f.add_argument("--batch-key", choices=["padded", "batch"], default="padded")
    f.add_argument("--context-per-item", type=float, default=None, help="typical context for B* (default: the trace's)")
    s = sub.add_parser("sweep", help="measure stage latency over batch sizes x contexts and fit it")
    s.add_argument("--model", default="ouro-tiny", help="checkpoint folder or preset name")
    s.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    s.add_argument("--contexts", type=int, nargs="+", default=[16, 64, 256])
    s.add_argument("--stages", nargs="+", default=["core"], choices=["prelude", "core", "coda"])
    s.add_argument("--repeats", type=int, default=5)
    s.add_argument("--dtype", default="float32")
    s.add_argument("--device", default="cpu")
    s.add_argument("--threads", type=int, default=1, help="torch CPU threads (0: leave torch's default)")
    s.add_argument("--max-tokens", type=int, default=None, help="skip points with batch x context above this")
    s.add_argument("--out", type=Path, default=Path("outputs/latency"))
    # the engine's flags: the sweep runs the layout, block size, padding, CUDA graphs and exit
    # criterion they resolve to for the model (its checkpoint's layout by default)
    add_engine_args(s)
    a = p.parse_args(argv)
    if a.cmd == "fit":
        data = json.loads(a.trace.read_text())
        trace = data["trace"] if isinstance(data, dict) else data
        if isinstance(trace, dict):  # {mode: rows} from the bench
            trace = [r for rows in trace.values() for r in rows]
        fits = fit_trace(trace, a.batch_key)
        dec = [r for r in trace if r["stage"] != "prefill" and r["batch"]]
        c = a.context_per_item or (sum(r["context"] for r in dec) / max(1, sum(r["batch"] for r in dec)))
        print(f"latency fit of {len(trace)} steps from {a.trace} (B* at {c:.0f} context tokens per item)")
        print_fits(fits, c)
        return

    if a.threads:
        torch.set_num_threads(a.threads)
    model, _ = load_model(a.model, a.dtype, a.device)
    npts = sum(a.max_tokens is None or b * c <= a.max_tokens for b in a.batch_sizes for c in a.contexts) * len(a.stages)
    bar = progress(npts, "sweep", "point")
    rows = sweep(model, a.batch_sizes, a.contexts, a.repeats, tuple(a.stages), engine_config_from_args(a), progress=bar,
                 max_tokens=a.max_tokens)
    bar.close()
    fits = fit_trace(rows)
    a.out.mkdir(parents=True, exist_ok=True)
    name = Path(str(a.model)).name
    png = plot_sweep(rows, fits, a.out / f"latency_{name}.png", title=name)
    (a.out / f"latency_{name}.json").write_text(json.dumps(
        {"model": str(a.model), "config": model.cfg.name, "rows": rows,
         "fits": {c: fits_to_json(fits, c) for c in a.contexts}}, indent=1))
    print(f"{'stage':6s} {'ctx':>5s} " + " ".join(f"{b:>7d}" for b in a.batch_sizes) + "   (ms per call)")
    for stage in a.stages:
        for c in a.contexts:
            ms = {r["batch"]: 1e3 * r["seconds"] for r in rows if r["stage"] == stage and r["context_per_item"] == c}
            print(f"{stage:6s} {c:5d} " + " ".join(f"{ms[b]:7.3f}" if b in ms else f"{'-':>7s}" for b in a.batch_sizes))
    for c in a.contexts:
        print(f"-- fit, B* at context {c}")
        print_fits(fits, c)
    print(f"plot: {png}\njson: {a.out / f'latency_{name}.json'}")


if __name__ == "__main__":
    main()

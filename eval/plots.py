"""Sweep plots from a sweep's results.csv: accuracy vs engine throughput with the Pareto front
(pareto.png: the simulated or emulated GPU's throughput when the sweep has one, the CPU bench's
beside it), and accuracy vs exit threshold per r_min / KV layout / lookahead (threshold.png)."""
from __future__ import annotations

import csv
import math
from pathlib import Path

TPS = "bench/output_tokens_per_s"
# the throughput axes a sweep's CSV can have (eval.sweep --throughput): column -> axis label
AXES = {"emulated/output_tokens_per_s": "output tokens/s, emulated {gpu} (real engine, wall clock)",
        "sim/output_tokens_per_s": "output tokens/s, simulated {gpu} ({model})",
        TPS: "output tokens/s (offline bench, this CPU)"}
LAYOUT_MARKERS = {"last_exited": "o", "shared": "s", "full_depth": "D", "first_then_shared": "^"}
BREAK_TOL = 0.01  # accuracy "breaks" once it falls more than this (1 point) below full depth


def lower_is_better(metric: str) -> bool:
    return "perplexity" in metric or "bits_per_byte" in metric


def pareto_front(points: list[tuple[float, float]]) -> list[int]:
    """Indices of the points that no other point beats on both x and y (higher is better), by x."""
    order = sorted(range(len(points)), key=lambda i: (-points[i][0], -points[i][1]))
    front, best = [], -math.inf
    for i in order:
        if points[i][1] > best:
            front.append(i)
            best = points[i][1]
    return sorted(front, key=lambda i: points[i][0])


def knee(points: list[tuple[float, float]]) -> int | None:
    """Index of the knee of a Pareto front given by x (the front's order): the point farthest from
    the chord between its two ends, on axes scaled to [0, 1]. None for fewer than 3 points."""
    if len(points) < 3:
        return None
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    sx, sy = (max(xs) - min(xs)) or 1.0, (max(ys) - min(ys)) or 1.0
    P = [((x - xs[0]) / sx, (y - ys[0]) / sy) for x, y in points]
    ex, ey = P[-1]
    norm = math.hypot(ex, ey) or 1.0
    dist = [abs(ex * py - ey * px) / norm for px, py in P]
    i = max(range(1, len(P) - 1), key=dist.__getitem__)
    return i if dist[i] > 0 else None


def breaks_after(points: list[tuple[float, float]], ref: float, tol: float) -> int | None:
    """Index of the fastest front point (x order) whose y stays within `tol` of `ref` (higher y is
    better; `ref` the full-depth accuracy): past it, accuracy breaks. None if none keeps it."""
    keep = [i for i, (_, y) in enumerate(points) if y >= ref - tol]
    return max(keep, key=lambda i: points[i][0]) if keep else None


def _num(v) -> float:
    try:
        return float(v)
    except (TypeError, ValueError):
        return math.nan


PALETTE = ["tab:blue", "tab:green", "tab:purple", "tab:orange", "tab:brown"]


def _colors(rows: list[dict]) -> dict[str, str]:
    """One color per swept r_min value."""
    r_mins = sorted({r.get("r_min") for r in rows if r.get("policy") != "cb"}, key=_num)
    return {v: PALETTE[i % len(PALETTE)] for i, v in enumerate(r_mins)}


def _style(r: dict, colors: dict[str, str]) -> dict:
    """Color = r_min (black: CB at full depth), marker = KV layout, hollow = lookahead."""
    c = "black" if r.get("policy") == "cb" else colors.get(r.get("r_min"), "gray")
    hollow = r.get("lookahead") == "True"
    return dict(marker=LAYOUT_MARKERS.get(r.get("kv_layout"), "o"), edgecolors=c, facecolors="none" if hollow else c,
                s=50 if r.get("policy") == "cb" else 28)


def _legend(ax, rows: list[dict], colors: dict[str, str]) -> None:
    for v, c in colors.items():
        ax.scatter([], [], c=c, label=f"r_min={v}")
    ax.scatter([], [], c="black", label="CB, full depth")
    if any(r.get("lookahead") == "True" for r in rows):
        ax.scatter([], [], facecolors="none", edgecolors="gray", label="lookahead (hollow)")
    for layout, mk in LAYOUT_MARKERS.items():
        if any(r.get("kv_layout") == layout for r in rows):
            ax.scatter([], [], marker=mk, c="gray", label=layout)
    ax.legend(fontsize=6)


def _pareto_panel(ax, rows: list[dict], metric: str, colors: dict[str, str], x_col: str = TPS) -> None:
    sign = -1.0 if lower_is_better(metric) else 1.0
    xy = [(_num(r.get(x_col)), _num(r.get(metric))) for r in rows]
    for r, (x, y) in zip(rows, xy):
        ax.scatter(x, y, alpha=0.85, **_style(r, colors))
    ok = [i for i, (x, y) in enumerate(xy) if not (math.isnan(x) or math.isnan(y))]
    front = [ok[j] for j in pareto_front([(xy[i][0], sign * xy[i][1]) for i in ok])]
    ax.plot([xy[i][0] for i in front], [xy[i][1] for i in front], "k--", lw=1)
    for i in front:
        ax.annotate(rows[i]["name"], xy[i], fontsize=5, xytext=(3, 3), textcoords="offset points")
    # the full-depth reference, the front's knee, and the fastest point that keeps full-depth accuracy
    full = [i for i in ok if rows[i].get("policy") == "cb"]
    for i in full:
        ax.annotate("full depth", xy[i], fontsize=7, xytext=(-8, -12), textcoords="offset points")
    pts = [(xy[i][0], sign * xy[i][1]) for i in front]
    k = knee(pts)
    if k is not None:
        ax.scatter(*xy[front[k]], s=160, facecolors="none", edgecolors="red", lw=1.2)
        ax.annotate("knee", xy[front[k]], fontsize=7, color="red", xytext=(6, -10), textcoords="offset points")
    if full and sign > 0:
        ref = max(xy[i][1] for i in full)
        b = breaks_after(pts, ref, BREAK_TOL)
        if b is not None and b < len(front) - 1:
            x = (xy[front[b]][0] + xy[front[b + 1]][0]) / 2
            ax.axvline(x, color="red", ls=":", lw=1)
            ax.annotate(f"accuracy breaks (> {BREAK_TOL:g} below full depth)", (x, ax.get_ylim()[0]), fontsize=6,
                        color="red", rotation=90, xytext=(2, 4), textcoords="offset points", va="bottom")
    ax.set_xlabel(AXES.get(x_col, x_col).format(gpu=rows[0].get("sim/gpu", "").upper(),
                                                model=rows[0].get("sim/model", "")), fontsize=8)
    ax.set_ylabel(metric + (" (lower is better)" if sign < 0 else ""))
    ax.set_title("dashed: Pareto front", fontsize=8)


def plot(csv_path: str | Path, metric: str = "score", out: str | Path | None = None) -> list[Path]:
    """Write pareto.png and threshold.png next to the CSV (or into `out`); returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    csv_path = Path(csv_path)
    out = Path(out) if out else csv_path.parent
    with open(csv_path) as f:
        rows = list(csv.DictReader(f))
    cols = list(rows[0])
    name = csv_path.parent.name

    colors = _colors(rows)
    pareto_metrics = [m for m in (metric, "looped_ppl/bits_per_byte") if m in cols]
    xs = [c for c in AXES if c in cols] or [TPS]  # a simulated GPU's axis first, the CPU's as a second panel
    fig, axes = plt.subplots(len(pareto_metrics), len(xs), figsize=(6 * len(xs), 4.5 * len(pareto_metrics)),
                             squeeze=False)
    for i, m in enumerate(pareto_metrics):
        for j, x_col in enumerate(xs):
            _pareto_panel(axes[i][j], rows, m, colors, x_col)
    _legend(axes[0][0], rows, colors)
    fig.suptitle(f"{name}: accuracy vs throughput")
    fig.tight_layout()
    files = [out / "pareto.png"]
    fig.savefig(files[-1], dpi=120)
    plt.close(fig)

    heads = [metric, "mean_exit_depth"] + sorted(
        c for c in cols if c.endswith(("/acc", "/exact_match", "/bits_per_byte")) or "/exact_match/" in c)
    heads = list(dict.fromkeys(h for h in heads if h in cols))
    fig, axes = plt.subplots(1, len(heads), figsize=(3.3 * len(heads), 3.3), squeeze=False)
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        if r.get("policy") != "cb":
            groups.setdefault((r.get("r_min"), r.get("kv_layout"), r.get("lookahead")), []).append(r)
    thresholds = [_num(r["exit_threshold"]) for r in rows if r.get("policy") != "cb"]
    thresholds = [t for t in thresholds if t > 0]
    log_x = bool(thresholds) and max(thresholds) / min(thresholds) > 50
    for ax, h in zip(axes[0], heads):
        for (r_min, layout, la), rs in sorted(groups.items()):
            rs = sorted(rs, key=lambda r: _num(r["exit_threshold"]))
            ls = {(False, False): "-", (True, False): "--", (False, True): ":", (True, True): "-."}[
                (layout == "shared", la == "True")]
            ax.plot([_num(r["exit_threshold"]) for r in rs], [_num(r.get(h)) for r in rs], ls=ls, ms=3,
                    marker=LAYOUT_MARKERS.get(layout, "o"), color=colors.get(r_min, "gray"),
                    label=f"r_min={r_min} {layout}" + (" lookahead" if la == "True" else ""))
        for r in rows:
            if r.get("policy") == "cb":  # full depth, as a horizontal reference
                ax.axhline(_num(r.get(h)), color="black", lw=0.8, ls="--" if r["kv_layout"] == "shared" else "-")
        if log_x:
            ax.set_xscale("log")
        ax.set_xlabel("exit threshold")
        ax.set_title(h, fontsize=8)
    axes[0][0].legend(fontsize=5)
    fig.suptitle(f"{name}: vs exit threshold (black: full depth)")
    fig.tight_layout()
    files.append(out / "threshold.png")
    fig.savefig(files[-1], dpi=120)
    plt.close(fig)
    return files

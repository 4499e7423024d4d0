"""Summaries of a sweep's results.csv, as markdown: the accuracy/throughput table, where each
curve's accuracy starts to drop against full depth, and the cost of lookahead at matched mean depth.

    python -m eval.report outputs/sweeps/ouro-demo/results.csv [--metric looped_ppl/bits_per_byte]
"""
from __future__ import annotations

import argparse
import csv
import math
from pathlib import Path

from eval.plots import TPS, lower_is_better

COLUMNS = [("mean_exit_depth", "depth", 2), ("looped_ppl/bits_per_byte", "ppl bpb", 3),
           ("looped_ppl/word_perplexity", "word ppl", 0), ("looped_cloze/acc", "cloze acc", 3),
           ("looped_lastword/exact_match/first-word", "lastword EM", 3),
           ("looped_reasoning/exact_match/number", "reasoning EM", 3), ("score", "score", 3), (TPS, "tok/s", 0)]


def _num(v) -> float:
    try:
        return float(v)
    except (TypeError, ValueError):
        return math.nan


def read(csv_path: str | Path) -> list[dict]:
    with open(csv_path) as f:
        return list(csv.DictReader(f))


def table(rows: list[dict]) -> str:
    cols = [c for c in COLUMNS if c[0] in rows[0]]
    head = ["policy", "q", "r_min", "layout", "lookahead"] + [c[1] for c in cols]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        if r.get("same_policy_as"):
            continue  # a duplicate of an earlier row (lookahead with r_min 1 and 2)
        cells = [r["policy"], r["exit_threshold"] or "-", r["r_min"] or "-", r["kv_layout"],
                 "yes" if r["lookahead"] == "True" else "no"]
        cells += [f"{_num(r.get(k)):.{d}f}" for k, _, d in cols]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _better(a: float, b: float, metric: str) -> float:
    """How much better a is than b (positive = better)."""
    return (b - a) if lower_is_better(metric) else (a - b)


def drop_points(rows: list[dict], metric: str, tol: float) -> list[str]:
    """Per curve (r_min, layout, lookahead): walking from the highest threshold (deepest) down,
    the first threshold whose metric is worse than the same layout's full depth by more than `tol`
    (relative for perplexity-like metrics, absolute otherwise)."""
    full = {r["kv_layout"]: _num(r.get(metric)) for r in rows if r["policy"] == "cb"}
    curves: dict[tuple, list[dict]] = {}
    for r in rows:
        if r["policy"] != "cb" and not r.get("same_policy_as"):
            curves.setdefault((r["r_min"], r["kv_layout"], r["lookahead"]), []).append(r)
    out = []
    for (r_min, layout, la), rs in sorted(curves.items()):
        ref = full.get(layout, math.nan)
        rs = sorted(rs, key=lambda r: -_num(r["exit_threshold"]))
        limit = ref * tol if lower_is_better(metric) else tol
        drop = next((r for r in rs if -_better(_num(r.get(metric)), ref, metric) > limit), None)
        name = f"r_min={r_min} {layout}" + (" lookahead" if la == "True" else "")
        if drop is None:
            out.append(f"{name}: within tolerance of full depth ({ref:.3f}) at every threshold")
        else:
            out.append(f"{name}: drops at q={drop['exit_threshold']} (depth {_num(drop['mean_exit_depth']):.2f}, "
                       f"{metric} {_num(drop.get(metric)):.3f} vs full depth {ref:.3f})")
    return out


def interpolate(points: list[tuple[float, float]], x: float) -> float:
    """Linear interpolation in x over (x, y) points; nan outside their range."""
    pts = sorted(p for p in points if not (math.isnan(p[0]) or math.isnan(p[1])))
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if x0 <= x <= x1:
            return y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return pts[0][1] if len(pts) == 1 and pts[0][0] == x else math.nan


def lookahead_cost(rows: list[dict], metric: str) -> list[str]:
    """Each lookahead point against the standard curve of the same layout, interpolated at the
    lookahead point's mean exit depth. Lookahead never exits before depth 2, so a lookahead point
    with r_min r is compared with the standard curve at r_min max(r, 2) if that was swept, else r."""
    out = []
    std_r_mins = {r["r_min"] for r in rows if r["policy"] != "cb" and r["lookahead"] != "True"}
    for layout in dict.fromkeys(r["kv_layout"] for r in rows):
        la = [r for r in rows if r["kv_layout"] == layout and r["lookahead"] == "True" and not r.get("same_policy_as")]
        deltas = []
        for r in sorted(la, key=lambda r: (_num(r["r_min"]), _num(r["exit_threshold"]))):
            ref_r_min = str(max(int(_num(r["r_min"]) or 1), 2))
            ref_r_min = ref_r_min if ref_r_min in std_r_mins else r["r_min"]
            std = [(_num(s["mean_exit_depth"]), _num(s.get(metric))) for s in rows if s["kv_layout"] == layout
                   and s["policy"] != "cb" and s["lookahead"] != "True" and s["r_min"] == ref_r_min]
            d, y = _num(r["mean_exit_depth"]), _num(r.get(metric))
            ref = interpolate(std, d)
            name = f"{layout} q={r['exit_threshold']} r_min={r['r_min']}"
            if math.isnan(ref):
                out.append(f"{name}: depth {d:.2f} outside the r_min={ref_r_min} curve's depths")
                continue
            deltas.append(y - ref)
            out.append(f"{name}: depth {d:.2f}, {metric} {y:.4f} with lookahead vs {ref:.4f} without "
                       f"(r_min={ref_r_min}, interpolated): {y - ref:+.4f}")
        if deltas:
            out.append(f"{layout}: mean change with lookahead at matched depth {sum(deltas) / len(deltas):+.4f} "
                       f"({'lower' if lower_is_better(metric) else 'higher'} is better)")
    return out


def report(csv_path: str | Path, metrics: tuple[str, ...] = ("looped_ppl/bits_per_byte", "score"),
           tols: tuple[float, ...] = (0.01, 0.02)) -> str:
    rows = read(csv_path)
    parts = [table(rows)]
    for m, tol in zip(metrics, tols):
        if m not in rows[0]:
            continue
        kind = f"+{tol:.0%} relative" if lower_is_better(m) else f"-{tol} absolute"
        drops = "\n".join(f"- {s}" for s in drop_points(rows, m, tol))
        parts.append(f"Where {m} starts to drop (tolerance {kind}):\n{drops}")
        parts.append(f"Lookahead at matched mean depth, {m}:\n" + "\n".join(f"- {s}" for s in lookahead_cost(rows, m)))
    return "\n\n".join(parts)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m eval.report", description=__doc__.split("\n")[0])
    p.add_argument("csv", type=Path)
    a = p.parse_args(argv)
    print(report(a.csv))


if __name__ == "__main__":
    main()

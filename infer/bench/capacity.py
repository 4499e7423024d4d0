"""Capacity curves on an emulated GPU (issue 26, deliverable 2): for each (model, workload) pair,
the online bench (online.py) against emulated servers (emulated.py, `--device emulated:h100`) for
CB, CDB no-refill and CDB refill, Poisson arrivals at a ladder of rates; per rate the normalised
latency (s per output token, mean and p90 over requests) and TTFT (mean, p90); the knee of each
policy; its ratio to CB's beside the authors'. The simulator's knee (drain throughput / mean output
length, the authors' definition) on the same cost model sits beside it and places the ladder: the
rates are `--ladder` x the simulated CB knee.

    python -m infer.bench.capacity --pairs ouro-1.4b:alpaca huginn-3.5b:alpaca --num-prompts 128 \
        --out outputs/capacity

`--slowdown S` runs the emulated clock S times slower and sends 1/S of each rate: the queues evolve as on
the GPU, stretched in time, while the host (HTTP, streaming, the client) does 1/S of the GPU's work per
second; rates are reported x S and latencies / S. It is what lets a 2-core host keep up with Ouro-1.4B's
H100 token rates; the host's own latency (~ms per request) is then divided by S too, a small bias.

The knee: the highest swept rate whose mean normalised latency (and every lower rate's) stays within
the limit with no failed request, and the rate where the curve crosses the limit (interpolated;
online.sustained_rate). The limit: `--slo-factor` (3) x the best mean normalised latency at the
lowest rate over the three policies (the online bench's rule), one limit per pair. K (refill's
minimum coda batch): 1 for Ouro, W/4 for Huginn, W the batch window (`max_batch_size`: 64, 8 for
ArXiv as the authors ran it); `--k` sets another (an integer or auto), and `--ks` adds refill at
each of several K (`cdb-refill-k<K>`): its simulator's knee, and an emulated server of its own
beside the three (the same requests and arrivals). Exit depths: binomial around infer.sim's assumed mean depth. Decode
attention: a paged kernel's reads (`ATTENTION`). With fewer prompts than W at a rate nothing queues:
`--num-prompts` must be well above W for a knee to show.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from infer.engine.config import coda_batch_arg
from infer.sim.cost import HOST_JSON, HostCost, RooflineCost, h100_kv_tokens
from infer.sim.dispatch import Dispatch
from infer.sim.runner import ASSUMED_MEAN_DEPTH, binomial_depths, depths_from_distribution
from infer.sim.simulate import served_context, simulate_mode
from infer.sim.workloads import WORKLOADS, make_requests
from looplm.errors import ParamError
from looplm.presets import PAPER_MODELS, paper_config

from . import online

LABELS = ("cb", "cdb-norefill", "cdb-refill")
# the authors' capacity knees, req/s (shells/paper/serving_rate-sweep.sh; issue 26)
AUTHORS = {("ouro-1.4b", "sharegpt"): (4.7, 5.7, 7.2), ("ouro-1.4b", "alpaca"): (34.9, 39.5, 53.9),
           ("ouro-1.4b", "arxiv"): (0.393, 0.474, 0.518), ("huginn-3.5b", "sharegpt"): (1.84, 2.44, 2.43),
           ("huginn-3.5b", "alpaca"): (13.8, 18.0, 17.6), ("huginn-3.5b", "arxiv"): (0.178, 0.244, 0.233)}
LADDER = (0.6, 0.9, 1.1, 1.3, 1.6, 2.0)
# decode attention reads whole KV blocks of each context (a paged kernel, as the authors' vLLM); the
# engine's SDPA gather to the batch's longest context would dominate long-output workloads
ATTENTION = "paged"


def window(workload: str) -> int:
    """W, the batch window (max_batch_size): 8 for ArXiv, as the authors ran it; else the engine's 64."""
    return 8 if workload == "arxiv" else 64


def coda_batch(model: str, workload: str) -> int:
    """K: 1 for Ouro, W/4 for Huginn."""
    return 1 if model.startswith("ouro") else max(1, window(workload) // 4)


def modes(model: str, workload: str, k: int | str | None = None, ks=()) -> list[dict]:
    """CB, no-refill and refill at `k` (default the paper's rule, coda_batch), then refill at each of
    `ks` (`cdb-refill-k<K>`; K an integer or auto)."""
    refill = {"policy": "cdb", "refill": True}
    return [{"name": "cb", "policy": "cb"}, {"name": "cdb-norefill", "policy": "cdb", "refill": False},
            {"name": "cdb-refill", **refill, "min_coda_batch": coda_batch(model, workload) if k is None else k}] + \
        [{"name": f"cdb-refill-k{x}", **refill, "min_coda_batch": x} for x in ks]


def sim_knees(model: str, workload: str, num_requests: int = 1024, seed: int = 0, k: int | str | None = None,
              ks=()) -> dict[str, float]:
    """Per policy (`modes`), the simulator's knee: requests / virtual seconds to drain them all at once."""
    cfg = paper_config(model)
    engine = {"max_batch_size": window(workload)}
    engine["kv_cache_tokens"] = h100_kv_tokens(cfg)
    ctx = served_context(cfg, engine)
    reqs = make_requests(workload, num_requests, seed=seed, scale=1.0, max_model_len=ctx, vocab_size=cfg.vocab_size)
    depths = depths_from_distribution(binomial_depths(cfg.r_max, ASSUMED_MEAN_DEPTH[model]), reqs, seed)
    cost = RooflineCost(cfg, host=HostCost.from_json(HOST_JSON) if HOST_JSON.exists() else None, attention=ATTENTION,
                        dispatch=Dispatch())
    out = {}
    for m in modes(model, workload, k, ks):
        # as the emulated server runs: its CPU path (no re-entry), host and device in series
        raw = simulate_mode(cfg, reqs, m, cost, depths, overlap=False, async_scheduling=False, **engine)
        out[m["name"]] = raw["num_requests"] / raw["seconds"]
    return out


def point_stats(requests: list[dict]) -> dict:
    """One (policy, rate) point from the online bench's per-request records: normalised latency
    (E2E / output tokens) and TTFT, mean and p90 over the completed requests, and the failures."""
    ok = [r for r in requests if r["error"] is None and r["output_len"]]
    nl = [r["e2e"] / r["output_len"] for r in ok]
    ttft = [r["ttft"] for r in ok]
    f = (lambda xs, q=None: (float(np.mean(xs)) if q is None else float(np.percentile(xs, q))) if xs else None)
    return {"completed": len(ok), "failed": len(requests) - len(ok), "norm_latency_mean": f(nl),
            "norm_latency_p90": f(nl, 90), "ttft_mean_s": f(ttft), "ttft_p90_s": f(ttft, 90)}


def knees(points: dict[str, list[dict]], limit: float) -> dict[str, dict]:
    """Per policy, online.sustained_rate's knee and crossing; `censored`: the curve stayed within the
    limit up to the ladder's top rate, so the knee is only a lower bound."""
    out = {}
    for lab, pts in points.items():
        k = online.sustained_rate([(p["rate"], p["norm_latency_mean"], p["failed"]) for p in pts], limit)
        out[lab] = {**k, "censored": k["max_rate_within_limit"] == max(p["rate"] for p in pts)}
    return out


def ratios(knee: dict[str, float | None]) -> dict[str, float | None]:
    cb = knee.get("cb")
    return {lab: (k / cb if k is not None and cb else None) for lab, k in knee.items()}


def run_pair(model: str, workload: str, *, num_prompts: int, ladder, slo_factor: float, max_seconds: float,
             sim_requests: int, seed: int, out: Path, slowdown: float = 1.0, k: int | str | None = None,
             ks=()) -> dict:
    """One pair's curves. With `slowdown` S the emulated clock runs S times slower and the client sends
    1/S of each rate, so the queues evolve as on the GPU in S-times-longer time while the host does 1/S
    of the work per second; every rate is reported x S and every latency / S (the GPU's units). `ks`:
    a refill server at each of these K too (`cdb-refill-k<K>`), side by side with the rest."""
    sk = sim_knees(model, workload, sim_requests, seed, k, ks)
    k = coda_batch(model, workload) if k is None else k
    labels = [*LABELS, *(f"cdb-refill-k{x}" for x in ks)]
    rates = [round(sk["cb"] * f, 4) for f in ladder]  # the GPU's
    sent = [round(r / slowdown, 4) for r in rates]
    d = out / f"{model}_{workload}"
    server_args = (f"--threads 1 --max-batch-size {window(workload)} --min-coda-batch {k} "
                   f"--emulated-attention {ATTENTION} --emulated-slowdown {slowdown:g}")
    summary = online.main(["--model", model, "--device", "emulated:h100", "--policies", ",".join(labels),
                           "--rates", ",".join(f"{r:g}" for r in sent), "--num-prompts", str(num_prompts),
                           "--dataset", workload, "--length-scale", "1", "--max-seconds", str(max_seconds),
                           "--slo-factor", str(slo_factor), "--server-args", server_args, "--seed", str(seed),
                           "--out", str(d)])
    points = {lab: [] for lab in labels}
    for lab in labels:
        for r, sr in zip(rates, sent):
            rec = json.loads((d / f"{lab}_rate{sr:g}_rep0.json").read_text())
            st = point_stats(rec["requests"])
            for k in ("norm_latency_mean", "norm_latency_p90", "ttft_mean_s", "ttft_p90_s"):
                st[k] = None if st[k] is None else st[k] / slowdown
            points[lab].append({"rate": r, "sent_rate": sr, **st,
                                "output_throughput": rec["output_throughput"] * slowdown})
    limit = summary["limit_s_per_token"] / slowdown
    k = knees(points, limit)
    crossing = {lab: v["interpolated_rate_at_limit"] for lab, v in k.items()}
    authors = dict(zip(LABELS, AUTHORS[(model, workload)])) if (model, workload) in AUTHORS else None
    return {"model": model, "workload": workload, "W": window(workload), "K": k, "labels": labels, "slowdown": slowdown,
            "mean_exit_depth": ASSUMED_MEAN_DEPTH[model], "device": summary.get("device"),
            "mean_input_len": summary.get("mean_input_len"), "mean_output_len": summary.get("mean_output_len"),
            "sim_knee": sk, "sim_ratio_to_cb": ratios(sk), "rates": rates, "limit_s_per_token": limit,
            "limit_rule": summary["limit_rule"], "points": points, "knee": k,
            "knee_ratio_to_cb": ratios({lab: v["max_rate_within_limit"] for lab, v in k.items()}),
            "crossing_ratio_to_cb": ratios(crossing), "authors_knee": authors,
            "authors_ratio_to_cb": ratios(authors) if authors else None, "plot": str(d / "normalized_latency.png")}


def table(pairs: list[dict]) -> str:
    """The knee table (markdown): per pair and policy the simulator's and the online knee, and each
    one's ratio to CB beside the authors'."""
    f = (lambda x, p=2: "-" if x is None else f"{x:.{p}f}")
    lines = ["| model | workload | policy | sim knee | online knee (crossing) | online / CB | sim / CB | authors' knee | "
             "authors / CB |", "|---|---|---|---|---|---|---|---|---|"]
    for r in pairs:
        for lab in r.get("labels", LABELS):
            k = r["knee"][lab]
            knee = ("≥ " if k["censored"] else "") + f(k["max_rate_within_limit"]) + \
                f" ({f(k['interpolated_rate_at_limit'])})"
            a = r["authors_knee"] or {}
            lines.append(f"| {r['model']} | {r['workload']} | {lab} | {f(r['sim_knee'][lab])} | {knee} | "
                         f"{f(r['knee_ratio_to_cb'][lab])} ({f(r['crossing_ratio_to_cb'][lab])}) | "
                         f"{f(r['sim_ratio_to_cb'][lab])} | {f(a.get(lab), 3)} | "
                         f"{f((r['authors_ratio_to_cb'] or {}).get(lab))} |")
    return "\n".join(lines)


def curve_table(pair: dict) -> str:
    """One pair's points (markdown): normalised latency and TTFT, mean and p90, per rate and policy."""
    f = (lambda x, p=1: "-" if x is None else f"{x:.{p}f}")
    labels = pair.get("labels", LABELS)
    lines = [f"{pair['model']} {pair['workload']} (limit {1e3 * pair['limit_s_per_token']:.1f} ms/token)", "",
             "| rate (req/s) | " + " | ".join(f"{lab} NL mean / p90 (ms/tok), TTFT mean / p90 (s)" for lab in labels)
             + " |", "|---|" + "---|" * len(labels)]
    for i, rate in enumerate(pair["rates"]):
        cells = []
        for lab in labels:
            p = pair["points"][lab][i]
            nl = [None if p[k] is None else 1e3 * p[k] for k in ("norm_latency_mean", "norm_latency_p90")]
            cells.append(f"{f(nl[0])} / {f(nl[1])}, {f(p['ttft_mean_s'], 2)} / {f(p['ttft_p90_s'], 2)}"
                         + (f" ({p['failed']} failed)" if p["failed"] else ""))
        lines.append(f"| {rate:g} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(pairs: list[dict], path: Path) -> Path:
    """The paper's online figure, one panel per pair: mean normalised latency vs rate per policy
    (p90 dashed), the limit, the knees."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = min(3, len(pairs))  # the six pairs: two rows of three
    rows = -(-len(pairs) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.6 * rows), squeeze=False)
    for ax in axes.flat[len(pairs):]:
        ax.set_visible(False)
    for ax, r in zip(axes.flat, pairs):
        for lab, color in zip(r.get("labels", LABELS), ("#888888", "#4878d0", "#d65f5f", "#6acc64", "#956cb4", "#8c613c")):
            pts = [p for p in r["points"][lab] if p["norm_latency_mean"] is not None]
            ax.plot([p["rate"] for p in pts], [1e3 * p["norm_latency_mean"] for p in pts], "o-", color=color, label=lab)
            ax.plot([p["rate"] for p in pts], [1e3 * p["norm_latency_p90"] for p in pts], ":", color=color)
        ax.axhline(1e3 * r["limit_s_per_token"], color="k", ls="--", lw=0.8, label="limit")
        ax.set_yscale("log")
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel("normalised latency (ms/token)")
        ax.set_title(f"{r['model']} {r['workload']}, emulated H100", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def parse_pair(s: str) -> tuple[str, str]:
    model, _, workload = s.partition(":")
    if model not in PAPER_MODELS or workload not in WORKLOADS:
        raise ParamError("pairs", f"{s!r}: expected MODEL:WORKLOAD with MODEL in {sorted(PAPER_MODELS)} and WORKLOAD "
                                  f"in {list(WORKLOADS)}")
    if model not in ASSUMED_MEAN_DEPTH:
        raise ParamError("pairs", f"{model}: no assumed mean depth (infer.sim's ASSUMED_MEAN_DEPTH)")
    return model, workload


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m infer.bench.capacity", description=__doc__.split("\n\n")[0])
    p.add_argument("--pairs", nargs="+", default=[f"{m}:{w}" for m, w in AUTHORS], help="MODEL:WORKLOAD ...")
    p.add_argument("--num-prompts", type=int, default=128, help="requests per (policy, rate); well above W")
    p.add_argument("--ladder", type=float, nargs="+", default=list(LADDER), help="rates as multiples of the "
                   "simulated CB knee")
    p.add_argument("--slo-factor", type=float, default=3.0)
    p.add_argument("--max-seconds", type=float, default=120.0, help="cap per (policy, rate), sending + waiting")
    p.add_argument("--sim-requests", type=int, default=1024, help="requests of the simulator's drain (few: the "
                   "longest request's tail dominates the drain and the knee comes out low)")
    p.add_argument("--slowdown", type=float, default=1.0, help="the emulated clock runs this many times slower and "
                   "the rates sent are divided by it (a fast device's token rate on a small host); reported in the "
                   "GPU's units")
    p.add_argument("--sim-only", action="store_true", help="only the simulator's knees (virtual time, seconds)")
    p.add_argument("--k", type=coda_batch_arg, default=None, help="refill's minimum coda batch, an integer or auto "
                   "(default: 1 for Ouro, W/4 for Huginn)")
    p.add_argument("--ks", type=coda_batch_arg, nargs="+", default=[], help="also refill at each of these K "
                   "(cdb-refill-k<K>): the simulator's knee, and without --sim-only an emulated server beside the rest")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("outputs/capacity"))
    a = p.parse_args(argv)
    pairs = [parse_pair(s) for s in a.pairs]
    a.out.mkdir(parents=True, exist_ok=True)
    if a.sim_only:
        rows = []
        for model, workload in pairs:
            sk = sim_knees(model, workload, a.sim_requests, a.seed, a.k, a.ks)
            au = dict(zip(LABELS, AUTHORS[(model, workload)])) if (model, workload) in AUTHORS else None
            rows.append({"model": model, "workload": workload, "W": window(workload),
                         "K": coda_batch(model, workload) if a.k is None else a.k,
                         "sim_knee": sk, "sim_ratio_to_cb": ratios(sk), "authors_knee": au,
                         "authors_ratio_to_cb": ratios(au) if au else None})
        (a.out / "sim_knees.json").write_text(json.dumps(rows, indent=1))
        print(json.dumps(rows, indent=1))
        return {"sim": rows}
    res = {"pairs": [], "command": "python -m infer.bench.capacity " + " ".join(
        argv if argv is not None else __import__("sys").argv[1:])}
    for model, workload in pairs:
        res["pairs"].append(run_pair(model, workload, num_prompts=a.num_prompts, ladder=a.ladder,
                                     slo_factor=a.slo_factor, max_seconds=a.max_seconds, sim_requests=a.sim_requests,
                                     seed=a.seed, out=a.out, slowdown=a.slowdown, k=a.k, ks=a.ks))
        (a.out / "capacity.json").write_text(json.dumps(res, indent=1))  # after every pair: a partial run keeps its
    print(json.dumps([{k: v for k, v in r.items() if k not in ("points", "device")} for r in res["pairs"]], indent=1))
    print(f"plot: {plot(res['pairs'], a.out / 'capacity.png')}")
    print(table(res["pairs"]))
    for r in res["pairs"]:
        print("\n" + curve_table(r))
    print(f"json: {a.out / 'capacity.json'}")
    return res


if __name__ == "__main__":
    from looplm.cli import run

    run(main)

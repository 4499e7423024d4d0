"""Benchmark output: the table, the PNG plot, the JSON files (python -m infer.bench and python -m infer.sim)."""
from __future__ import annotations

import json
from pathlib import Path


def ratio_json(out: dict, ratios: dict[str, tuple[dict, dict, str]]) -> dict:
    """Add `name: a[key] / b[key]` for each of `ratios` to a bench's JSON, print it, return it."""
    for name, (a, b, key) in ratios.items():
        out[name] = a[key] / b[key]
    print(json.dumps(out, indent=1))
    return out


def interval(iv: dict | None) -> str:
    """'[lo, hi] verdict' of a speedup interval (offline.ratio_interval), '-' without one."""
    if not iv or iv["rounds"] < 2:
        return "-"
    return f"[{iv['lo']:.3f}, {iv['hi']:.3f}] {iv['verdict'].replace('within ', '')}"


def format_table(block: dict) -> str:
    w = block["workload"]
    lines = [f"== {w['workload']}: {w['num_requests']} requests, prompt {w['mean_prompt_len']:.1f} / output "
             f"{w['mean_output_len']:.1f} tokens (trace {w['trace_mean_prompt_len']:.0f} / "
             f"{w['trace_mean_output_len']:.0f}; lengths scaled x{w['scale']:.3g}"
             + (f", {w['clamped_to_context']} clamped to the context {w['max_model_len']}" if w["clamped_to_context"] else "")
             + ")",
             f"{'mode':16s} {'out tok/s':>10s} {'req/s':>7s} {'depth':>6s} {'alpha':>6s} {'S_dec':>6s} "
             f"{'S_e2e':>6s} {'speedup':>8s} {'95% interval':>22s} {'of bound':>8s} {'S_e2e(lat)':>10s} {'work/CB':>7s} "
             f"{'wbytes/CB':>9s} "
             f"{'pf launches':>11s} {'pf tok/l':>8s} {'pf share':>8s}"]
    disp = any(r.get("dispatch") for r in block["results"])  # the simulator's dispatch charge
    if disp:
        lines[-1] += f" {'dispatch s':>10s} {'eager ops':>10s} {'eager/graphed':>13s}"
    f = (lambda x, p=3: f"{x:.{p}f}" if isinstance(x, (int, float)) else "-")
    pct = (lambda x: f"{100 * x:.1f}%" if isinstance(x, (int, float)) else "-")
    for r in block["results"]:
        pf = r.get("prefill")  # launches carrying prompt tokens, their mean prompt tokens, prompts' share of time
        lines.append(f"{r['mode']:16s} {r['output_tokens_per_s']:10.1f} {r['requests_per_s']:7.2f} "
                     f"{r['mean_exit_depth']:6.2f} {f(r['alpha'], 3):>6s} {f(r['s_dec'], 3):>6s} {f(r['s_e2e'], 3):>6s} "
                     f"{f(r['speedup_vs_cb'], 3):>8s} {interval(r.get('speedup_interval')):>22s} "
                     f"{pct(r['fraction_of_bound']):>8s} {f(r.get('s_e2e_latency'), 3):>10s}"
                     f" {f(r.get('compute_ratio'), 3):>7s} {f(r.get('weight_traffic_ratio'), 3):>9s}"
                     + (f" {pf['launches']:11d} {pf['mean_prompt_tokens']:8.1f} {pct(pf['share']):>8s}" if pf else "")
                     + (f" {d['dispatch_s']:10.3f} {d['eager_ops']:10d} "
                        f"{str(d['eager_launches']) + '/' + str(d['graphed_launches']):>13s}"
                        if disp and (d := r.get("dispatch")) else ""))
    b = block["bounds"]
    st = block["results"][0]["settings"]
    if st.get("simulated"):
        lines.append("(simulated: virtual seconds from the cost model)")
        d = next((r["dispatch"] for r in block["results"] if r.get("dispatch")), None)
        if d:
            lines.append(f"dispatch charged: {d['op_us']:g} us per eager aten op, {d['replay_us']:g} us per graph replay "
                         f"({d['source']}; CUDA graphs {'on' if d['cuda_graphs'] else 'off'}: eager = launches with "
                         "prompt chunks, prefill, speculation" + ("" if d["cuda_graphs"] else ", every launch") + ")")
    elif st.get("emulated"):
        lines.append(f"(EMULATED {st['emulated']}: wall seconds of the real engine, each launch waiting for the cost "
                     f"model's predicted stage time; no weights; {st.get('repeats')} repeat(s) per mode)")
    else:
        lines.append(f"({st.get('stat', 'min')} of {st.get('repeats')} repeats per mode; S_e2e(lat): the bound with this "
                     "machine's fitted stage latencies, see latency_bound in infer/bench/offline.py)")
    lines.append(f"bound: F0/Fr = {b['f0_over_fr']:.3f} at context {b['context']:.0f}, r_max {b['r_max']}; "
                 + b["formula"])
    lines.append("work/CB, wbytes/CB: exact FLOPs and weight bytes of the run over CB's (infer/sim/work.py; the same "
                 "on any machine, unlike the timings)")
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
               label="speedup over CB")
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
        # everything the simulator needs to replay the runs (python -m infer.sim --fitted FILE)
        paths["trace"].write_text(json.dumps({
            "model": meta.get("model"), "layer_split": meta.get("layer_split"),
            "trace": {f"{b['workload']['workload']}/{m}": t for b in blocks for m, t in b["traces"].items()},
            "exit_depths": {b["workload"]["workload"]: b["exit_depths"] for b in blocks},
            "runs": {b["workload"]["workload"]: {
                "workload": b["workload"], "seed": b["results"][0]["settings"].get("seed", 0),
                "settings": {k: v for k, v in b["results"][0]["settings"].items()
                             if k in ("max_batch_size", "kv_layout", "kv_cache_tokens", "lookahead")},
                "modes": {r["mode"]: {k: v for k, v in r["settings"].items() if k in ("policy", "refill", "min_coda_batch",
                                                                                     "full_depth")} for r in b["results"]},
                "measured_tokens_per_s": {r["mode"]: r["output_tokens_per_s"] for r in b["results"]},
                "untraced_seconds_per_step": b["untraced_seconds_per_step"]} for b in blocks}}))
    return paths


def model_meta(model, source: str, tokenizer) -> dict:
    cfg = model.cfg
    return {"model": source, "config": cfg.name, "arch": cfg.arch, "hidden_size": cfg.hidden_size,
            "layers": [cfg.n_prelude, cfg.n_core, cfg.n_coda], "r_max": cfg.r_max, "vocab_size": cfg.vocab_size,
            "max_position": cfg.max_position, "exit_criterion": cfg.exit_criterion,
            "exit_threshold": cfg.exit_threshold, "params": sum(p.numel() for p in model.parameters()),
            "prompts": "real text (model tokenizer)" if tokenizer is not None else "random token ids (no tokenizer)"}

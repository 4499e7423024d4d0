"""What a run measured, summarized: the modes compared, a run's raw record (`raw_from`, from its
step trace and outputs; the simulator's are on the virtual clock), the per-mode results with the
bounds (`summarize`), the speedup's bootstrap interval, and the workload's headline figures.
Shared by the offline benchmark (infer/bench/offline.py), the emulated device's bench and the
simulator."""
from __future__ import annotations

import numpy as np

from infer.engine.config import EngineConfig
from infer.engine.trace import TraceRow

from . import bounds as B
from . import replay as RP
from .work import ratios as work_ratios
from .workloads import Request, mean_decode_context


def modes_for(ks=(1, 4), norefill: bool = True, full_depth: bool = True) -> list[dict]:
    """The policies compared: CB, CDB no-refill, CDB refill per K, and CDB at full depth."""
    # cb: prompts inside the fused iteration (vLLM's chunked prefill); cb_separate: the old CB, whole
    # prompts in prefill launches of their own
    modes = [{"name": "cb", "policy": "cb"}, {"name": "cb_separate", "policy": "cb", "prefill": "separate"}]
    if norefill:
        modes.append({"name": "cdb_norefill", "policy": "cdb", "refill": False})
    modes += [{"name": f"cdb_refill_k{k}", "policy": "cdb", "refill": True,
               "min_coda_batch": k if k == "auto" else int(k)} for k in ks]  # (auto: the default)
    if full_depth:
        # (K=1 pinned: the control that must equal CB, whatever the default K is)
        modes.append({"name": "cdb_full_depth", "policy": "cdb", "refill": True, "min_coda_batch": 1, "full_depth": True})
    return modes


def mode_kwargs(mode: dict) -> dict:
    return {k: v for k, v in mode.items() if k != "name"}


def prefix_cache(after: dict, before: dict | None = None) -> dict:
    """Prefix-cache lookups of one pass (engine metrics after it, minus before it): prompt tokens
    looked up, found, and the hit rate."""
    q, h = (after[k] - (before or {}).get(k, 0) for k in ("prefix_cache_queries", "prefix_cache_hits"))
    return {"queries": q, "hits": h, "hit_rate": h / q if q else 0.0}


def raw_from(mode: dict, trace: list[TraceRow], seconds: float, outs, config: EngineConfig, keep_trace: bool = True,
             prefix_cache: dict | None = None, work: dict | None = None, speculative: dict | None = None,
             auto_coda: dict | None = None) -> dict:
    """The raw record of one run (shared with the simulator, whose trace and seconds are virtual);
    `config` is the engine's resolved config, `work` the run's exact work counts (work.py),
    `speculative` its self-speculation counters (LLMEngine.speculative_metrics), `auto_coda` what
    min_coda_batch="auto" decided (LLMEngine.auto_coda_metrics)."""
    stages: dict[str, dict] = {}
    for r in trace:
        s = stages.setdefault(r["stage"], {"calls": 0, "seconds": 0.0, "items": 0, "score_reads": 0})
        s["calls"] += 1
        s["score_reads"] += r.get("score_reads", 0)  # launches whose exit scores the host read back
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
    pre = prefill_breakdown(trace)
    return {"name": mode["name"], "mode": mode_kwargs(mode), "engine_config": config.describe(), "seconds": seconds,
            "output_tokens": sum(len(o.token_ids) for o in outs), "num_requests": len(outs),
            "mean_exit_depth": sum(d * c for d, c in hist.items()) / ntok if ntok else float("nan"),
            "decode_tokens": ntok, "exit_depth_hist": dict(sorted(hist.items())),
            "prefill_seconds": pre["seconds"], "prefill": {**pre, "share": pre["seconds"] / traced if traced else None},
            "traced_seconds": traced,
            "steps": len(trace), "stages": stages, "trace": trace if keep_trace else None,
            "exit_depths": [list(o.exit_depths) for o in outs], "prefix_cache": prefix_cache, "work": work,
            "speculative": speculative, "auto_coda": auto_coda}


def prefill_breakdown(trace: list[dict]) -> dict:
    """Launches that carry prompt tokens (separate prefill launches, or mixed launches with chunks),
    their mean prompt tokens, and the seconds prompts cost: a prefill launch's time; in a mixed launch
    the simulator's marginal cost (`prompt_seconds`), else the launch's time split by items."""
    rows = [r for r in trace if r.get("prompt_tokens") or r["stage"] == "prefill"]
    tok = sum(r.get("prompt_tokens", r["tokens"]) for r in rows)
    sec = 0.0
    for r in rows:
        if r["stage"] == "prefill":
            sec += r["seconds"]
        elif "prompt_seconds" in r:
            sec += r["prompt_seconds"]
        else:
            sec += r["seconds"] * r["prompt_tokens"] / (r["prompt_tokens"] + r["batch"])
    return {"launches": len(rows), "mean_prompt_tokens": tok / len(rows) if rows else 0.0, "seconds": sec}


def summarize(raws: dict[str, dict], cfg, requests: list[Request], settings: dict) -> list[dict]:
    """Per-mode results with the bounds: alpha is CB's measured prefill share, d each mode's mean
    exit depth, F_0 / F_r counted at the requests' mean decode context."""
    ctx = mean_decode_context(requests)
    cb = raws.get("cb")
    alpha_cb = cb["prefill_seconds"] / cb["traced_seconds"] if cb and cb["traced_seconds"] > 0 else None
    out = []
    for name, r in raws.items():
        tps = r["output_tokens"] / r["seconds"]
        full = r["engine_config"]["full_depth"]
        d = cfg.r_max if full or r["mean_exit_depth"] != r["mean_exit_depth"] else r["mean_exit_depth"]
        res = {"mode": name, "output_tokens_per_s": tps, "requests_per_s": r["num_requests"] / r["seconds"],
               "total_tokens_per_s": (r["output_tokens"] + sum(q.prompt_len for q in requests)) / r["seconds"],
               "seconds": r["seconds"], "seconds_all": r.get("seconds_all", [r["seconds"]]),
               "num_requests": r["num_requests"], "output_tokens": r["output_tokens"],
               "mean_exit_depth": d, "exit_depth_hist": r["exit_depth_hist"],
               "alpha": alpha_cb, "alpha_own": r["prefill_seconds"] / r["traced_seconds"] if r["traced_seconds"] else None,
               "steps": r["steps"], "stages": r["stages"], "prefill": r.get("prefill"),
               "prefix_cache": r.get("prefix_cache"), "work": r.get("work"), "speculative": r.get("speculative"),
               "auto_coda": r.get("auto_coda"),
               # the simulator's dispatch charge (SimRunner.dispatch_stats; None where not charged): host
               # seconds it charged and the eager aten ops issued, with the launch counts in `dispatch`
               "dispatch_s": (r.get("dispatch") or {}).get("dispatch_s"),
               "eager_ops": (r.get("dispatch") or {}).get("eager_ops"), "dispatch": r.get("dispatch"),
               "exit_depths_crc32": RP.depths_crc32(r["exit_depths"]),  # equal digests: equal per-token depths
               **work_ratios(r["work"], cb["work"] if cb else None),
               "settings": {**settings, **r["mode"]}, "engine_config": r["engine_config"]}
        if alpha_cb is not None:
            b = B.bound(cfg, d, alpha_cb, ctx)
            res.update(s_dec=b["s_dec"], s_e2e=b["s_e2e"])
            cb_tps = cb["output_tokens"] / cb["seconds"]
            res["speedup_vs_cb"] = tps / cb_tps
            res["fraction_of_bound"] = res["speedup_vs_cb"] / b["s_e2e"]
            res["speedup_interval"] = ratio_interval(cb.get("seconds_all", [cb["seconds"]]), res["seconds_all"])
        else:
            res.update(s_dec=None, s_e2e=None, speedup_vs_cb=None, fraction_of_bound=None)
        out.append(res)
    return out


def ratio_interval(cb_seconds: list[float], seconds: list[float], iters: int = 2000, seed: int = 0) -> dict:
    """The speedup over CB of one mode from its repeats, each paired with CB's repeat of the same
    round (modes run interleaved, so a round shares the machine's state): the median of the
    per-round ratios CB time / mode time (same output tokens), a 95% bootstrap interval of that
    median, and what the interval says: "faster" or "slower" when it excludes 1, else "within noise"."""
    r = np.asarray(cb_seconds[:len(seconds)]) / np.asarray(seconds[:len(cb_seconds)])
    rng = np.random.default_rng(seed)
    meds = np.median(rng.choice(r, size=(iters, len(r)), replace=True), axis=1)
    lo, hi = (float(x) for x in np.percentile(meds, [2.5, 97.5]))
    verdict = "faster" if lo > 1 else "slower" if hi < 1 else "within noise"
    return {"median": float(np.median(r)), "lo": lo, "hi": hi, "rounds": len(r), "verdict": verdict}


def bounds_block(cfg, requests: list[Request]) -> dict:
    ctx = mean_decode_context(requests)
    f0, fr = B.f0_fr(cfg, ctx)
    return {"f0": f0, "fr": fr, "f0_over_fr": f0 / fr, "r_max": cfg.r_max, "context": ctx,
            "formula": "S_dec = (F0 + r_max Fr)/(F0 + d Fr); S_e2e = 1/(alpha + (1 - alpha)/S_dec)"}


def headline(results: list[dict]) -> dict:
    """The workload's headline figures: CDB at full depth vs CB, and the fastest adaptive CDB mode."""
    by = {r["mode"]: r for r in results}
    out = {}
    if "cdb_full_depth" in by and "cb" in by:
        out["full_depth_vs_cb"] = by["cdb_full_depth"]["output_tokens_per_s"] / by["cb"]["output_tokens_per_s"]
    cdb = [r for r in results if r["mode"].startswith("cdb_") and r["mode"] != "cdb_full_depth"]
    if cdb and "cb" in by:
        best = max(cdb, key=lambda r: r["output_tokens_per_s"])
        out["best"] = {"mode": best["mode"], "speedup_vs_cb": best["speedup_vs_cb"],
                       "fraction_of_bound": best["fraction_of_bound"]}
    return out

"""/metrics: the Prometheus text exposition of the engine snapshot (vLLM-style names, `cdb_` prefix;
vLLM's request histograms under vLLM's own names, histograms.py)."""
from __future__ import annotations

import os

from .async_engine import AsyncEngine
from .histograms import render as render_histograms


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


_RENDERED_ENGINE_KEYS = {"running", "queues", "kv_usage", "kv_free_blocks", "kv_total_blocks", "kv_all_free",
                         "mean_exit_depth", "stage_calls", "waiting", "prefix_cache_queries", "prefix_cache_hits",
                         "prefix_cache_hit_rate"}


def render_metrics(aeng: AsyncEngine, model_name: str, info: dict) -> str:
    """Prometheus text exposition of the engine snapshot (taken after every stage)."""
    s, c = aeng.snapshot, aeng.snapshot["counters"]
    lab = 'model_name="{}"'.format(model_name.replace("\\", "\\\\").replace('"', '\\"'))
    G, C = "gauge", "counter"
    # one sample each: (name, type, value, help)
    scalars = [
        ("cdb_num_requests_running", G, s["running"], "Requests holding a slot (prelude, core or coda queue)."),
        ("cdb_num_requests_waiting", G, s["waiting"], "Requests waiting for prefill (slot / KV memory)."),
        ("cdb_kv_cache_usage_perc", G, s["kv_usage"], "Fraction of KV blocks in use (1 = full)."),
        ("cdb_kv_cache_free_blocks", G, s["kv_free_blocks"], "Free KV blocks."),
        ("cdb_kv_cache_total_blocks", G, s["kv_total_blocks"], "KV blocks in the pool."),
        ("cdb_kv_cache_all_free", G, int(s["kv_all_free"]), "1 when every KV block and state slot is free."),
        ("cdb_generation_tokens_per_second", G, s["tokens_per_s"], f"Output tokens/s over the last {aeng.rate_window_s:g} s."),
        ("cdb_mean_exit_depth", G, s["mean_exit_depth"], "Mean exit depth (loop steps) of decoded tokens since start."),
        ("cdb_prefix_cache_queries_total", C, s["prefix_cache_queries"], "Prompt tokens looked up in the prefix cache."),
        ("cdb_prefix_cache_hits_total", C, s["prefix_cache_hits"], "Prompt tokens found in the prefix cache (not prefilled again)."),
        ("cdb_prefix_cache_hit_rate", G, s["prefix_cache_hit_rate"], "Prefix-cache hits / queries since start (0 when none)."),
        ("cdb_prompt_tokens_total", C, c["prompt_tokens"], "Prompt tokens admitted."),
        ("cdb_generation_tokens_total", C, c["generation_tokens"], "Output tokens generated."),
        ("cdb_request_failure_total", C, c["requests_failed"], "Requests failed by an internal error."),
        ("cdb_request_rejected_total", C, c["requests_rejected"], "Requests refused with 503 (waiting queue full)."),
        ("cdb_request_aborted_total", C, c["requests_aborted"], "Requests aborted before they finished (client gone, shutdown)."),
        ("cdb_engine_step_errors_total", C, c["step_errors"], "Engine stages that raised."),
        ("cdb_engine_alive", G, int(aeng.alive), "1 while the engine thread runs."),
        ("process_resident_memory_bytes", G, _rss_bytes(), "Resident memory of the server process."),
    ]
    rows: list[tuple[str, str, str, list[tuple[str, float]]]] = [(n, k, h, [("", v)]) for n, k, v, h in scalars]
    # one sample per label value
    rows += [
        ("cdb_queue_length", G, "Length of each of the four queues.", [(f'stage="{k}"', v) for k, v in s["queues"].items()]),
        ("cdb_request_success_total", C, "Finished requests by finish reason.",
         [(f'finished_reason="{k}"', v) for k, v in c["requests_finished"].items()]),
        ("cdb_stage_calls_total", C, "Stages run, by kind.", [(f'stage="{k}"', v) for k, v in s["stage_calls"].items()]),
    ]
    if s.get("auto_coda_k_hist") is not None:  # min_coda_batch="auto": the K it chose, coda by coda
        rows.append(("cdb_auto_coda_batch_total", C, "Codas launched by min_coda_batch=auto, by their batch (the K "
                     "chosen); cdb_auto_coda_hold_s / _launch_s: the last decision's predicted seconds of waiting "
                     "vs launching (_padding_s: the part of launching that is the core step's added padding).",
                     [(f'k="{k}"', v) for k, v in s["auto_coda_k_hist"].items()]))
    # every other number LLMEngine.metrics() reports (preemptions, swaps, prefix-cache hits, ...)
    # shows up as a gauge without being wired here
    for k in s.get("engine_keys", ()):
        v = s.get(k)
        if k not in _RENDERED_ENGINE_KEYS and isinstance(v, (int, float)) and not isinstance(v, bool):
            rows.append((f"cdb_{k}", "gauge", f"LLMEngine.metrics()['{k}'].", [("", v)]))
    if info:
        rows.append(("cdb_info", "gauge", "Engine configuration.",
                     [(",".join(f'{k}="{v}"' for k, v in info.items()), 1)]))
    out = []
    for name, kind, help_, samples in rows:
        out += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}"]
        for labels, v in samples:
            out.append(f"{name}{{{lab}{',' + labels if labels else ''}}} {float(v):.9g}")
    if "histograms" in s:  # vLLM's request histograms, under vLLM's names (histograms.py)
        out += render_histograms(s["histograms"], lab)
    return "\n".join(out) + "\n"

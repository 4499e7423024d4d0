"""/metrics: the Prometheus text exposition of the engine snapshot (vLLM-style names, `cdb_` prefix)."""
from __future__ import annotations

import os

from .async_engine import AsyncEngine


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
    rows: list[tuple[str, str, str, list[tuple[str, float]]]] = [
        ("cdb_num_requests_running", "gauge", "Requests holding a slot (prelude, core or coda queue).",
         [("", s["running"])]),
        ("cdb_num_requests_waiting", "gauge", "Requests waiting for prefill (slot / KV memory).",
         [("", s["waiting"])]),
        ("cdb_queue_length", "gauge", "Length of each of the four queues.",
         [(f'stage="{k}"', v) for k, v in s["queues"].items()]),
        ("cdb_kv_cache_usage_perc", "gauge", "Fraction of KV blocks in use (1 = full).", [("", s["kv_usage"])]),
        ("cdb_kv_cache_free_blocks", "gauge", "Free KV blocks.", [("", s["kv_free_blocks"])]),
        ("cdb_kv_cache_total_blocks", "gauge", "KV blocks in the pool.", [("", s["kv_total_blocks"])]),
        ("cdb_kv_cache_all_free", "gauge", "1 when every KV block and state slot is free.",
         [("", int(s["kv_all_free"]))]),
        ("cdb_generation_tokens_per_second", "gauge", f"Output tokens/s over the last {aeng.rate_window_s:g} s.",
         [("", s["tokens_per_s"])]),
        ("cdb_mean_exit_depth", "gauge", "Mean exit depth (loop steps) of decoded tokens since start.",
         [("", s["mean_exit_depth"])]),
        ("cdb_prefix_cache_queries_total", "counter", "Prompt tokens looked up in the prefix cache.",
         [("", s["prefix_cache_queries"])]),
        ("cdb_prefix_cache_hits_total", "counter", "Prompt tokens found in the prefix cache (not prefilled again).",
         [("", s["prefix_cache_hits"])]),
        ("cdb_prefix_cache_hit_rate", "gauge", "Prefix-cache hits / queries since start (0 when none).",
         [("", s["prefix_cache_hit_rate"])]),
        ("cdb_prompt_tokens_total", "counter", "Prompt tokens admitted.", [("", c["prompt_tokens"])]),
        ("cdb_generation_tokens_total", "counter", "Output tokens generated.", [("", c["generation_tokens"])]),
        ("cdb_request_success_total", "counter", "Finished requests by finish reason.",
         [(f'finished_reason="{k}"', v) for k, v in c["requests_finished"].items()]),
        ("cdb_request_failure_total", "counter", "Requests failed by an internal error.",
         [("", c["requests_failed"])]),
        ("cdb_request_rejected_total", "counter", "Requests refused with 503 (waiting queue full).",
         [("", c["requests_rejected"])]),
        ("cdb_request_aborted_total", "counter", "Requests aborted before they finished (client gone, shutdown).",
         [("", c["requests_aborted"])]),
        ("cdb_engine_step_errors_total", "counter", "Engine stages that raised.", [("", c["step_errors"])]),
        ("cdb_stage_calls_total", "counter", "Stages run, by kind.",
         [(f'stage="{k}"', v) for k, v in s["stage_calls"].items()]),
        ("cdb_engine_alive", "gauge", "1 while the engine thread runs.", [("", int(aeng.alive))]),
        ("process_resident_memory_bytes", "gauge", "Resident memory of the server process.", [("", _rss_bytes())]),
    ]
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
    return "\n".join(out) + "\n"

"""Soak test (not in CI): bounded Poisson load against a loopback server, then a report of errors
(target 0), latency percentiles, and server memory (RSS) at start and end (target: flat).

    python -m scripts.soak --model ouro-tiny --rate 4 --duration 600      # starts and stops a server
    python -m scripts.soak --base-url http://127.0.0.1:8000 --rate 4      # a server you started

Stops by itself: sending ends after --duration seconds (at most 3600), in-flight requests get
--drain seconds more. Exit status 1 when any request failed or the server did not return to idle.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import re
import time
from pathlib import Path

import aiohttp
import numpy as np

from infer.bench.online import (POLICY_ARGS, Result, make_prompt, one_request, run_rate, sample_lengths, session,
                                server_info, start_server, stop_server, summarize)

MAX_DURATION = 3600.0


def scrape(text: str, name: str) -> float | None:
    m = re.search(rf"^{name}\{{[^}}]*\}} (\S+)", text, re.M)
    return float(m.group(1)) if m else None


async def metrics(client: aiohttp.ClientSession, url: str) -> str:
    async with client.get(url + "/metrics", timeout=aiohttp.ClientTimeout(total=10)) as r:
        return await r.text()


async def soak(url: str, model: str, vocab: int, lengths: list[tuple[int, int]], rate: float, duration: float,
               drain: float, max_inflight: int, seed: int, api_key: str | None, mem_every: float = 10.0) -> dict:
    rng = np.random.default_rng(seed)
    results: list[Result] = []
    mem: list[tuple[float, float]] = []
    shed = 0
    tasks: set[asyncio.Task] = set()
    async with session(max_inflight + 8) as client:
        t0 = time.perf_counter()
        t_next, next_mem = t0, t0
        i = 0
        while True:
            now = time.perf_counter()
            if now - t0 >= duration:
                break
            if now >= next_mem:
                mem.append((now - t0, scrape(await metrics(client, url), "process_resident_memory_bytes")))
                next_mem += mem_every
            t_next += rng.exponential(1.0 / rate)
            await asyncio.sleep(max(0.0, t_next - time.perf_counter()))
            if len(tasks) >= max_inflight:
                shed += 1  # the client's own bound: count it, never queue without limit
                continue
            p, o = lengths[i % len(lengths)]
            i += 1
            res = Result(p, o)
            results.append(res)
            left = duration + drain - (time.perf_counter() - t0)
            task = asyncio.create_task(one_request(client, url, model, make_prompt(rng, p, vocab), res, left, api_key))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        sent_for = time.perf_counter() - t0
        if tasks:
            await asyncio.wait(set(tasks), timeout=drain)
        for t in list(tasks):
            t.cancel()
        end = time.perf_counter() - t0
        idle_by = time.monotonic() + 30
        while True:  # the server should return to idle: nothing running, every KV block free
            text = await metrics(client, url)
            idle = (scrape(text, "cdb_num_requests_running") == 0 and scrape(text, "cdb_num_requests_waiting") == 0
                    and scrape(text, "cdb_kv_cache_all_free") == 1)
            if idle or time.monotonic() > idle_by:
                break
            await asyncio.sleep(0.2)
        mem.append((time.perf_counter() - t0, scrape(text, "process_resident_memory_bytes")))
    s = summarize(results, sent_for)
    pct = {}
    ok = [r for r in results if r.error is None]
    for key, xs in (("ttft_s", [r.ttft for r in ok]), ("e2e_s", [r.e2e for r in ok]),
                    ("normalized_latency_s_per_token", [r.e2e / r.output_len for r in ok])):
        pct[key] = {f"p{q}": float(np.percentile(xs, q)) for q in (50, 90, 99)} | {"max": float(max(xs))} if xs else {}
    rss = [m for _, m in mem if m]
    return {"rate": rate, "duration_s": sent_for, "wall_s": end, "sent": len(results), "ok": len(ok),
            "errors": s["failed"] + shed, "error_kinds": s["errors"] | ({"client in-flight cap": shed} if shed else {}),
            "percentiles": pct, "output_throughput": s["output_throughput"], "mean_exit_depth": s["mean_exit_depth"],
            "rss_start_mb": rss[0] / 2**20 if rss else None, "rss_end_mb": rss[-1] / 2**20 if rss else None,
            "rss_max_mb": max(rss) / 2**20 if rss else None, "rss_samples_mb": [(round(t, 1), m / 2**20) for t, m in mem
                                                                             if m],
            "idle_at_end": idle, "final_metrics": {k: scrape(text, k) for k in (
                "cdb_num_requests_running", "cdb_num_requests_waiting", "cdb_kv_cache_all_free",
                "cdb_request_failure_total", "cdb_engine_step_errors_total", "cdb_generation_tokens_total")}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m scripts.soak", description=__doc__.split("\n")[0])
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--model", help="start a loopback server with this model (folder or preset)")
    g.add_argument("--base-url", help="a running server (must be loopback)")
    p.add_argument("--policy", default="cdb-refill", choices=sorted(POLICY_ARGS))
    p.add_argument("--server-args", default="--threads 1")
    p.add_argument("--rate", type=float, default=4.0, help="requests/s (Poisson)")
    p.add_argument("--duration", type=float, default=600.0, help=f"seconds of load (at most {MAX_DURATION:g})")
    p.add_argument("--drain", type=float, default=60.0, help="seconds in-flight requests get after the load")
    p.add_argument("--max-inflight", type=int, default=256)
    p.add_argument("--dataset", default="sharegpt")
    p.add_argument("--length-scale", type=float, default=0.25)
    p.add_argument("--api-key", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path(".cache/soak"))
    a = p.parse_args(argv)
    if not 0 < a.duration <= MAX_DURATION:
        p.error(f"--duration must be in (0, {MAX_DURATION:g}]")
    if a.base_url and not re.match(r"https?://(127\.0\.0\.1|localhost|\[::1\])(:\d+)?/?$", a.base_url):
        p.error("--base-url must be a loopback address")
    a.out.mkdir(parents=True, exist_ok=True)
    proc = None
    if a.model:
        proc, url = start_server(a.model, a.policy, a.server_args.split(), a.out / "server.log")
    else:
        url = a.base_url.rstrip("/")
    try:
        name, ctx, vocab = server_info(url, a.api_key)
        lengths = sample_lengths(1000, a.seed, a.dataset, ctx, 32, 64, a.length_scale, None)
        warm, _ = asyncio.run(run_rate(url, name, float("inf"), lengths[:16], vocab or 256, a.seed, 1.0, 120,
                                       a.api_key))  # so that "start" memory is after the first allocations
        report = asyncio.run(soak(url, name, vocab or 256, lengths, a.rate, a.duration, a.drain, a.max_inflight,
                                  a.seed, a.api_key))
    finally:
        if proc is not None:
            stop_server(proc)
            report_exit = proc.returncode
    report |= {"model": a.model or a.base_url, "policy": a.policy if a.model else None,
               "warmup_errors": sum(r.error is not None for r in warm)}
    if proc is not None:
        report["server_exit_code"] = report_exit
    (a.out / "soak.json").write_text(json.dumps(report, indent=1))
    pc = report["percentiles"]
    print(f"soak: {report['sent']} requests in {report['duration_s']:.0f} s at {a.rate:g}/s; errors {report['errors']} "
          f"{report['error_kinds'] or ''}")
    for key, v in pc.items():
        print(f"  {key}: " + ", ".join(f"{q} {x:.4g}" for q, x in v.items()))
    print(f"  RSS start {report['rss_start_mb']:.1f} MB, end {report['rss_end_mb']:.1f} MB, "
          f"max {report['rss_max_mb']:.1f} MB;"
          f" idle at end: {report['idle_at_end']}; written {a.out / 'soak.json'}")
    return 0 if report["errors"] == 0 and report["idle_at_end"] else 1


if __name__ == "__main__":
    raise SystemExit(main())

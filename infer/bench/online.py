"""Online benchmark: Poisson (gamma) arrivals at a list of request rates against a running server,
with vLLM `bench serve` metric definitions; a JSON per (policy, rate) and the paper's online figure
(normalized latency vs request rate, CB vs CDB).

    # start / stop one server per policy (loopback only) and sweep the rates
    python -m infer.bench.online --model checkpoints/ouro-demo --policies cb,cdb-norefill,cdb-refill \
        --rates 2,4,8,16 --num-prompts 64 --out .cache/bench_online
    # an emulated H100 (no weights: each launch waits for the simulator's predicted stage time)
    python -m infer.bench.online --model ouro-1.4b --device emulated:h100 --length-scale 1 --rates 2,4,8
    # against a server you started
    python -m infer.bench.online --base-url http://127.0.0.1:8000 --label mine --rates 4,8

With --repeats N each (policy, rate) point is the median of N interleaved rounds.

Priority classes: `--priority-fraction F` marks a seeded fraction F of the requests as the high
class (the same requests for every policy); servers of a `-priority` policy (`--scheduling-policy
priority`) receive them with `priority` = `--high-priority` (default -1), the others without. Each
point then reports TTFT, E2E and normalized latency per class (`by_class`):

    python -m infer.bench.online --model checkpoints/ouro-demo --policies cdb-refill,cdb-refill-priority \
        --priority-fraction 0.1 --rates 30 --num-prompts 300

Definitions (vLLM): TTFT = first streamed token - send; TPOT = (E2E - TTFT) / (output_len - 1);
ITL = gaps between streamed chunks; E2E = last token - send; normalized latency = mean over
requests of E2E / output_len (s/token). Requests ignore EOS and produce exactly their target length.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp
import httpx
import numpy as np

from infer.sim.workloads import WORKLOADS, load_trace
from looplm.cli import UserError

POLICY_ARGS = {"cb": ["--policy", "cb"], "cdb-norefill": ["--policy", "cdb", "--no-refill"],
               "cdb-refill": ["--policy", "cdb", "--refill"],
               "cdb-refill-priority": ["--policy", "cdb", "--refill", "--scheduling-policy", "priority"]}
ROOT = Path(__file__).resolve().parents[2]


def policy_args(label: str) -> list[str] | None:
    """infer.serve's flags for a policy label: POLICY_ARGS, or `cdb-refill-k<K>` (refill with
    min_coda_batch K, an integer or auto: infer.bench.capacity's side-by-side K). Unknown: None."""
    if label in POLICY_ARGS:
        return POLICY_ARGS[label]
    k = label.removeprefix("cdb-refill-k")
    if label.startswith("cdb-refill-k") and (k == "auto" or k.isdigit() and int(k) >= 1):
        return [*POLICY_ARGS["cdb-refill"], "--min-coda-batch", k]
    return None


@dataclass
class Result:
    prompt_len: int
    target_len: int
    send: float = 0.0
    ttft: float | None = None
    e2e: float | None = None
    output_len: int = 0
    itl: list[float] = field(default_factory=list)
    exit_depths: list[int] = field(default_factory=list)
    error: str | None = None
    high: bool = False  # the high priority class (--priority-fraction)
    priority: int | None = None  # the request body's priority (None: not sent)


# ----------------------------------------------------------------------------- workload
def sample_lengths(n: int, seed: int, dataset: str, ctx: int, input_len: int, output_len: int,
                   scale: float, max_input: int | None) -> list[tuple[int, int]]:
    """(prompt_len, output_len) pairs: fixed, or a real trace scaled by `scale` and fitted to the context."""
    rng = np.random.default_rng(seed)
    if dataset == "fixed":
        return [(input_len, output_len)] * n
    rows = [(p, o) for p, o in load_trace(dataset) if p >= 4 and o >= 4]  # vLLM's ShareGPT filter, before scaling
    cap_in = max_input or ctx // 2
    out = []
    for i in rng.choice(len(rows), size=n, replace=False):
        p, o = rows[i]
        p = int(min(max(2, round(p * scale)), cap_in))
        o = int(min(max(2, round(o * scale)), ctx - p))
        out.append((p, o))
    return out


def make_prompt(rng: np.random.Generator, n: int, vocab: int) -> list[int]:
    return rng.integers(3, vocab, size=n).tolist()  # ids 0-2 are special in our tokenizers


def arrival_gaps(n: int, rate: float, burstiness: float, seed: int) -> np.ndarray:
    """vLLM: gamma(shape=burstiness, scale=1/(rate*burstiness)) gaps; burstiness 1 = Poisson."""
    if math.isinf(rate):
        return np.zeros(n)
    return np.random.default_rng(seed).gamma(burstiness, 1.0 / (rate * burstiness), size=n)


# ----------------------------------------------------------------------------- client
def session(max_connections: int) -> aiohttp.ClientSession:
    """The benchmark's HTTP client: aiohttp, as vLLM's benchmark uses. httpx's async pool costs CPU
    that grows with the connections open (encode/httpx#3215): at 512 streams in flight it cost ~4x more
    per token than at 128 and took most of a core, so the client, not the server, was measured."""
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=max_connections),
                                 timeout=aiohttp.ClientTimeout(total=None, sock_connect=30))


async def one_request(client: aiohttp.ClientSession, url: str, model: str, prompt: list[int], res: Result,
                      timeout: float, api_key: str | None) -> None:
    body = {"model": model, "prompt": prompt, "max_tokens": res.target_len, "temperature": 0.0,
            "ignore_eos": True, "stream": True}
    if res.priority is not None:
        body["priority"] = res.priority
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    res.send = time.perf_counter()
    try:
        await asyncio.wait_for(_stream(client, url, body, headers, res), timeout)
        if res.error is None and res.output_len != res.target_len:
            res.error = f"got {res.output_len} tokens, expected {res.target_len}"
    except asyncio.TimeoutError:
        res.error = f"timed out after {timeout:.0f} s"
    except (aiohttp.ClientError, OSError, ValueError) as e:
        res.error = f"{type(e).__name__}: {e}"


async def _stream(client: aiohttp.ClientSession, url: str, body: dict, headers: dict, res: Result) -> None:
    last = res.send
    async with client.post(url + "/v1/completions", json=body, headers=headers) as r:
        if r.status != 200:
            res.error = f"HTTP {r.status}: {(await r.text())[:200]}"
            return
        async for raw in r.content:  # one SSE line at a time
            line = raw.decode().rstrip("\r\n")
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                res.error = chunk["error"].get("message", "error")
                return
            ch = chunk["choices"][0] if chunk.get("choices") else None
            if not ch or not ch.get("token_ids"):
                continue
            now = time.perf_counter()
            if res.ttft is None:
                res.ttft = now - res.send
            else:
                res.itl.append(now - last)
            last = now
            res.output_len += len(ch["token_ids"])
            res.exit_depths += ch.get("exit_depths", [])
    res.e2e = last - res.send


async def run_rate(url: str, model: str, rate: float, lengths: list[tuple[int, int]], vocab: int, seed: int,
                   burstiness: float, max_seconds: float, api_key: str | None = None,
                   max_connections: int = 1024, max_concurrency: int | None = None,
                   high: list[bool] | None = None, high_priority: int | None = None) -> tuple[list[Result], float]:
    """Send len(lengths) requests with gamma arrivals; stop sending after `max_seconds` (bounded).
    `max_concurrency` (vLLM's --max-concurrency): at most that many requests in flight; an arrival
    waits in the client for a free one (its TTFT counts from when it is sent). `high`: which
    requests are the high priority class; `high_priority`: the priority they are sent with (None:
    sent without one, a fcfs server)."""
    rng = np.random.default_rng(seed + 1)
    gaps = arrival_gaps(len(lengths), rate, burstiness, seed)
    high = high or [False] * len(lengths)
    results = [Result(p, o, high=h, priority=high_priority if h else None) for (p, o), h in zip(lengths, high)]
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
    gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    max_connections = min(max_connections, max_concurrency or max_connections)

    async def send(client: aiohttp.ClientSession, prompt: list[int], res: Result) -> None:
        async with gate or contextlib.nullcontext():
            left = max(1.0, max_seconds - (time.perf_counter() - t0))  # the run's deadline, not the request's
            await one_request(client, url, model, prompt, res, left, api_key)

    async with session(max_connections) as client:
        t0 = time.perf_counter()
        tasks, t_next = [], t0
        for res, gap in zip(results, gaps):
            t_next += gap
            delay = t_next - time.perf_counter()
            if t_next - t0 > max_seconds:
                res.error = "not sent: past --max-seconds"
                continue
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(send(client, make_prompt(rng, res.prompt_len, vocab), res)))
        await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
    return results, duration


def _stats(xs: list[float], scale: float = 1000.0) -> dict:
    if not xs:
        return {"mean": None, "median": None, "p99": None}
    a = np.asarray(xs) * scale
    return {"mean": float(a.mean()), "median": float(np.median(a)), "p99": float(np.percentile(a, 99))}


def class_stats(results: list[Result]) -> dict:
    """TTFT, E2E and normalized latency of one class of requests."""
    ok = [r for r in results if r.error is None]
    return {"requests": len(results), "completed": len(ok), "ttft_ms": _stats([r.ttft for r in ok]),
            "e2e_ms": _stats([r.e2e for r in ok]),
            "normalized_latency_s_per_token": float(np.mean([r.e2e / r.output_len for r in ok])) if ok else None}


def priority_ratios(by_run: dict[tuple[str, float, int], list[Result]]) -> list[dict]:
    """Per round of a `-priority` policy and its fcfs twin: each class's TTFT and E2E, fcfs over
    priority, request by request (the same requests, the same arrivals), as the median ratio with
    its 95% bootstrap interval (infer/sim/stats.py)."""
    from infer.sim.stats import ratio_interval
    out = []
    for (label, rate, rep), res in by_run.items():
        twin = by_run.get((label.removesuffix("-priority"), rate, rep))
        if not label.endswith("-priority") or twin is None:
            continue
        row = {"policy": label, "rate": rate, "repeat": rep}
        for cls, high in (("high", True), ("rest", False)):
            pairs = [(f, p) for f, p in zip(twin, res) if p.high is high and f.error is None and p.error is None]
            for key in ("ttft", "e2e"):
                row[f"{cls}_{key}_fcfs_over_priority"] = ratio_interval([getattr(f, key) for f, _ in pairs],
                                                                         [getattr(p, key) for _, p in pairs])
        out.append(row)
    return out


def summarize(results: list[Result], duration: float) -> dict:
    ok = [r for r in results if r.error is None]
    out_tok = sum(r.output_len for r in ok)
    tpot = [(r.e2e - r.ttft) / (r.output_len - 1) for r in ok if r.output_len > 1]
    depths = [d for r in ok for d in r.exit_depths[1:]]  # the prefill token is at full depth by design
    errors: dict[str, int] = {}
    for r in results:
        if r.error is not None:
            key = re.sub(r"\d+", "N", r.error)[:80]
            errors[key] = errors.get(key, 0) + 1
    return {
        "completed": len(ok), "failed": len(results) - len(ok), "errors": errors, "duration_s": duration,
        "request_throughput": len(ok) / duration, "output_throughput": out_tok / duration,
        "total_token_throughput": (out_tok + sum(r.prompt_len for r in ok)) / duration,
        "mean_input_len": float(np.mean([r.prompt_len for r in results])),
        "mean_output_len": float(np.mean([r.target_len for r in results])),
        "ttft_ms": _stats([r.ttft for r in ok]), "tpot_ms": _stats(tpot),
        "itl_ms": _stats([g for r in ok for g in r.itl]), "e2e_ms": _stats([r.e2e for r in ok]),
        "normalized_latency_s_per_token": float(np.mean([r.e2e / r.output_len for r in ok])) if ok else None,
        "mean_exit_depth": float(np.mean(depths)) if depths else None,
        **({"by_class": {"high": class_stats([r for r in results if r.high]),
                         "rest": class_stats([r for r in results if not r.high])}}
           if any(r.high for r in results) else {}),
    }


# ----------------------------------------------------------------------------- server
def start_server(model: str, policy: str, extra: list[str], log_path: Path, timeout: float = 300.0
                 ) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "infer.serve", "--model", model, "--host", "127.0.0.1", "--port", "0",
           *extra, *policy_args(policy)]  # (the policy's own flags after the shared ones: they win)
    log = open(log_path, "w")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + timeout
    url = None
    while time.monotonic() < deadline:
        if p.poll() is not None:  # pass the server's own one-line error on (a bad --model, a bad setting)
            said = [ln[len("error: "):] for ln in log_path.read_text().splitlines() if ln.startswith("error: ")]
            if said:
                raise UserError(f"the server did not start: {said[-1]} (log: {log_path})")
            raise RuntimeError(f"server exited with {p.returncode}; see {log_path}")
        if url is None:
            m = re.search(r"on (http://127\.0\.0\.1:\d+)", log_path.read_text())
            url = m.group(1) if m else None
        if url is not None:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    return p, url
            except httpx.TransportError:
                pass
        time.sleep(0.2)
    stop_server(p)
    raise TimeoutError(f"server did not become healthy in {timeout:.0f} s; see {log_path}")


def stop_server(p: subprocess.Popen) -> None:
    if p.poll() is None:
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def server_info(url: str, api_key: str | None) -> tuple[str, int, int]:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    m = httpx.get(url + "/v1/models", headers=headers, timeout=10).json()["data"][0]
    vocab = m.get("vocab_size")
    return m["id"], int(m["max_model_len"]), vocab


def server_device(url: str, api_key: str | None) -> dict:
    """What the server runs on (/v1/models `device`; {"emulated": True, ...} for an emulated one)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    m = httpx.get(url + "/v1/models", headers=headers, timeout=10).json()["data"][0]
    return m.get("device") or {"device": "unknown", "emulated": False}


def wait_idle(url: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = httpx.get(url + "/metrics", timeout=10).text
        running = re.search(r"^cdb_num_requests_running\{[^}]*\} (\S+)", text, re.M)
        waiting = re.search(r"^cdb_num_requests_waiting\{[^}]*\} (\S+)", text, re.M)
        if running and waiting and float(running.group(1)) == 0 and float(waiting.group(1)) == 0:
            return
        time.sleep(0.2)


def speculation_counters(url: str) -> dict[str, float]:
    """The server's self-speculation counters (/metrics cdb_spec_*: LLMEngine.speculative_metrics),
    since it started; {} when it reports none."""
    text = httpx.get(url + "/metrics", timeout=10).text
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^cdb_spec_(\w+)\{[^}]*\} (\S+)", text, re.M)}


# ----------------------------------------------------------------------------- sweep
def sustained_rate(points: list[tuple[float, float | None, int]], limit: float) -> dict:
    """Highest swept rate whose normalized latency (and every lower rate's) is within `limit` with no
    failures, and the linearly interpolated crossing rate."""
    best, crossing = None, None
    prev = None
    for rate, nl, failed in sorted(points):
        ok = nl is not None and nl <= limit and failed == 0
        if not ok:
            if prev is not None and nl is not None:
                r0, n0 = prev
                crossing = r0 + (rate - r0) * (limit - n0) / (nl - n0) if nl > n0 else r0
            break
        best, prev = rate, (rate, nl)
    else:
        crossing = best
    return {"max_rate_within_limit": best, "interpolated_rate_at_limit": crossing}


def combine(reps: list[dict]) -> dict:
    """One (policy, rate) point from its repeats: the median normalized latency (robust to a load spike
    on a shared machine), its spread, and the repeats themselves."""
    nls = [r["normalized_latency_s_per_token"] for r in reps if r["normalized_latency_s_per_token"] is not None]
    med = lambda key, sub: float(np.median([r[key][sub] for r in reps if r[key][sub] is not None]))  # noqa: E731
    return {"label": reps[0]["label"], "rate": reps[0]["rate"], "failed": sum(r["failed"] for r in reps),
            "normalized_latency_s_per_token": float(np.median(nls)) if nls else None,
            "normalized_latency_min": min(nls) if nls else None, "normalized_latency_max": max(nls) if nls else None,
            "ttft_ms_median": med("ttft_ms", "median"), "tpot_ms_median": med("tpot_ms", "median"),
            "output_throughput": float(np.median([r["output_throughput"] for r in reps])),
            "mean_exit_depth": reps[0]["mean_exit_depth"], "repeats": reps}


def plot(summary: dict, path: Path, limit: float | None) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    for label, runs in summary["runs"].items():
        pts = sorted((r["rate"], r["normalized_latency_s_per_token"], r.get("normalized_latency_min"),
                      r.get("normalized_latency_max")) for r in runs if r["normalized_latency_s_per_token"] is not None)
        if pts:
            x, y = [p[0] for p in pts], [p[1] for p in pts]
            if all(p[2] is not None for p in pts) and summary.get("repeats", 1) > 1:
                err = [[p[1] - p[2] for p in pts], [p[3] - p[1] for p in pts]]
                ax.errorbar(x, y, yerr=err, marker="o", capsize=3, label=label)
            else:
                ax.plot(x, y, marker="o", label=label)
    if limit is not None:
        ax.axhline(limit, color="gray", ls="--", lw=1, label=f"limit {limit:.3g} s/token")
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("normalized latency (s/token)")
    ax.set_yscale("log")
    ax.set_title(summary.get("title", "online serving"))
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m infer.bench.online", description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--model", help="start one server per policy with this model (folder or preset)")
    g.add_argument("--base-url", help="benchmark a running server instead")
    p.add_argument("--label", default="server", help="name of the --base-url run in the outputs")
    p.add_argument("--policies", default="cb,cdb-norefill,cdb-refill",
                   help=f"from {sorted(POLICY_ARGS)}, or cdb-refill-k<K> (refill at min_coda_batch K: an integer or auto)")
    p.add_argument("--server-args", default="--threads 1", help="extra arguments for infer.serve (one string)")
    p.add_argument("--speculative-tokens", type=int, default=None, metavar="K",
                   help="the servers' --speculative-tokens (self-speculative decoding; greedy requests only)")
    p.add_argument("--device", default=None, help="the servers' --device, e.g. emulated:h100 (a paper model or "
                   "config on an emulated GPU: no weights, real-time waits for the predicted stage times)")
    p.add_argument("--rates", default="1,2,4,8", help="requests/s, comma-separated ('inf': all at once)")
    p.add_argument("--num-prompts", type=int, default=64, help="requests per rate")
    p.add_argument("--repeats", type=int, default=1, help="rounds per rate (median reported; spread plotted)")
    p.add_argument("--max-seconds", type=float, default=120.0, help="hard cap per rate (sending + waiting)")
    p.add_argument("--max-concurrency", type=int, default=None,
                   help="at most this many requests in flight (vLLM's flag); later arrivals wait in the client")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape; 1 = Poisson")
    p.add_argument("--dataset", default="sharegpt",
                   help=f"'fixed', a trace of infer/sim/data {list(WORKLOADS)}, or a CSV path")
    p.add_argument("--length-scale", type=float, default=0.25, help="multiply trace lengths (small demo models)")
    p.add_argument("--max-input", type=int, default=None, help="cap on prompt length (default: context / 2)")
    p.add_argument("--input-len", type=int, default=32, help="--dataset fixed")
    p.add_argument("--output-len", type=int, default=64, help="--dataset fixed")
    p.add_argument("--slo-norm-latency", type=float, default=None,
                   help="limit for the sustained rate, s/token (default: --slo-factor x the best lowest-rate value)")
    p.add_argument("--slo-factor", type=float, default=3.0)
    p.add_argument("--priority-fraction", type=float, default=0.0,
                   help="a seeded fraction of the requests forms the high priority class (the same requests for "
                        "every policy); a -priority policy's server receives them with --high-priority")
    p.add_argument("--high-priority", type=int, default=-1, help="the high class's priority (lower is sooner)")
    p.add_argument("--api-key", default=os.environ.get("LOOPLM_API_KEY"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path(".cache/bench_online"))
    return p


def main(argv: list[str] | None = None) -> dict:
    a = parser().parse_args(argv)
    rates = [float(r) for r in a.rates.split(",")]
    labels = [s.strip() for s in a.policies.split(",")] if a.model else [a.label]
    for lab in labels if a.model else []:
        if policy_args(lab) is None:
            raise SystemExit(f"unknown policy {lab!r}; choose from {sorted(POLICY_ARGS)} or cdb-refill-k<K> "
                             f"(K an integer >= 1 or auto)")
    if a.max_concurrency is not None and a.max_concurrency < 1:  # before any server starts
        raise SystemExit(f"--max-concurrency must be >= 1, got {a.max_concurrency}")
    if not 0 <= a.priority_fraction <= 1:
        raise SystemExit(f"--priority-fraction must be in [0, 1], got {a.priority_fraction}")
    a.out.mkdir(parents=True, exist_ok=True)
    summary = {"model": a.model or a.base_url, "rates": rates, "num_prompts": a.num_prompts, "dataset": a.dataset,
               "length_scale": a.length_scale, "burstiness": a.burstiness, "server_args": a.server_args,
               "repeats": a.repeats, "runs": {}}
    servers: dict[str, tuple[subprocess.Popen | None, str]] = {}
    extra = a.server_args.split() + (["--device", a.device] if a.device else []) + \
        (["--speculative-tokens", str(a.speculative_tokens)] if a.speculative_tokens is not None else [])
    try:
        for label in labels:  # every server up at once (idle ones cost nothing): policies interleave below
            servers[label] = (start_server(a.model, label, extra, a.out / f"server_{label}.log")
                              if a.model else (None, a.base_url.rstrip("/")))
        name, ctx, vocab = server_info(servers[labels[0]][1], a.api_key)
        device = server_device(servers[labels[0]][1], a.api_key)
        summary |= {"device": device, "emulated": bool(device.get("emulated"))}
        if device.get("emulated"):
            print(f"EMULATED device {device['device']} ({device.get('cost_model')} stage times, no weights)", flush=True)
        vocab = vocab or 256
        lengths = sample_lengths(a.num_prompts, a.seed, a.dataset, ctx, a.input_len, a.output_len,
                                 a.length_scale, a.max_input)
        high = [bool(x) for x in np.random.default_rng(a.seed + 7).random(len(lengths)) < a.priority_fraction]
        summary |= {"priority_fraction": a.priority_fraction, "high_priority": a.high_priority,
                    "high_requests": sum(high)}
        summary |= {"mean_input_len": float(np.mean([p for p, _ in lengths])),
                    "mean_output_len": float(np.mean([o for _, o in lengths])), "context": ctx}
        for label in labels:
            asyncio.run(run_rate(servers[label][1], name, math.inf, [(8, 8)] * 4, vocab, a.seed, 1.0, 60,
                                 a.api_key))  # warm-up
            summary["runs"][label] = []
        k, by_run = 0, {}  # (label, rate, repeat) -> its per-request results
        for rate in rates:
            reps: dict[str, list[dict]] = {lab: [] for lab in labels}
            for rep in range(a.repeats):
                # rotate the policy order every round: a shared machine's load drifts over minutes
                for label in labels[k % len(labels):] + labels[:k % len(labels)]:
                    url = servers[label][1]
                    wait_idle(url)
                    prio = a.high_priority if label.endswith("-priority") else None
                    res, dur = asyncio.run(run_rate(url, name, rate, lengths, vocab, a.seed + rep, a.burstiness,
                                                    a.max_seconds, a.api_key, max_concurrency=a.max_concurrency,
                                                    high=high, high_priority=prio))
                    s = {"label": label, "rate": rate, "repeat": rep, "emulated": summary["emulated"],
                         **summarize(res, dur)}
                    (a.out / f"{label}_rate{rate:g}_rep{rep}.json").write_text(json.dumps(
                        {**s, "requests": [asdict(r) | {"itl": None, "exit_depths": None} for r in res]}, indent=1))
                    reps[label].append(s)
                    by_run[(label, rate, rep)] = res
                    print(f"{label:13s} rate {rate:6g} #{rep}: {s['completed']}/{len(res)} ok, norm latency "
                          f"{s['normalized_latency_s_per_token'] or float('nan'):.4f} s/tok, TTFT p50 "
                          f"{s['ttft_ms']['median'] or float('nan'):.0f} ms, TPOT p50 "
                          f"{s['tpot_ms']['median'] or float('nan'):.1f} ms, {s['output_throughput']:.1f} tok/s, "
                          f"depth {s['mean_exit_depth'] or float('nan'):.2f}", flush=True)
                    for cls, c in s.get("by_class", {}).items():
                        print(f"{'':13s}   {cls:4s} ({c['completed']}/{c['requests']}): TTFT mean "
                              f"{c['ttft_ms']['mean'] or float('nan'):.0f} ms p99 {c['ttft_ms']['p99'] or float('nan'):.0f}"
                              f" ms, E2E mean {c['e2e_ms']['mean'] or float('nan'):.0f} ms, norm latency "
                              f"{c['normalized_latency_s_per_token'] or float('nan'):.4f} s/tok", flush=True)
                k += 1
            for label, rs in reps.items():
                summary["runs"][label].append(combine(rs))
        # what self-speculation did on each server over the whole sweep (warm-up included)
        summary["speculative"] = {lab: speculation_counters(url) for lab, (_, url) in servers.items()}
        if a.priority_fraction:
            summary["priority_vs_fcfs"] = priority_ratios(by_run)
    finally:
        for proc, _ in servers.values():
            if proc is not None:
                stop_server(proc)
    lowest = [r["normalized_latency_s_per_token"] for runs in summary["runs"].values() for r in runs
              if r["rate"] == min(rates) and r["normalized_latency_s_per_token"] is not None]
    limit = a.slo_norm_latency or (a.slo_factor * min(lowest) if lowest else None)
    summary["limit_s_per_token"] = limit
    summary["limit_rule"] = ("--slo-norm-latency" if a.slo_norm_latency else
                             f"{a.slo_factor:g} x the best normalized latency at the lowest rate ({min(rates):g}/s)")
    if limit is not None:
        summary["sustained"] = {lab: sustained_rate([(r["rate"], r["normalized_latency_s_per_token"], r["failed"])
                                                     for r in runs], limit) for lab, runs in summary["runs"].items()}
        for lab, s in summary["sustained"].items():
            print(f"{lab:13s} sustains {s['max_rate_within_limit']} req/s within {limit:.4g} s/token "
                  f"(interpolated {s['interpolated_rate_at_limit']})")
    summary["title"] = (f"{Path(str(summary['model'])).name}" + (f" on emulated {summary['device']['device'][9:]}"
                        if summary.get("emulated") else "") + ": normalized latency vs rate")
    (a.out / "summary.json").write_text(json.dumps(summary, indent=1))
    plot(summary, a.out / "normalized_latency.png", limit)
    print(f"wrote {a.out}/summary.json and {a.out}/normalized_latency.png")
    return summary


if __name__ == "__main__":
    from looplm.cli import run

    run(main)

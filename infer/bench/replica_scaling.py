"""Replica scaling on the emulated device (issue 26, deliverable 3): the same load against 1, 2, 4
engine replicas behind `python -m infer.serve --replicas N --device emulated:h100` (Ray Serve).

    python -m infer.bench.replica_scaling --replicas 1 2 4 --num-prompts 256 --out outputs/replicas

On an emulated device the engine's compute is a wait (the cost model's stage time), so what has to
scale is the host: the ingress (HTTP in, a Serve handle call per request, the response streamed
back), each replica (its HTTP app, the async engine, the scheduler, the output processor and the
detokenizer) and the client. Each point starts the server, sends every prompt at once (a rate that
saturates one replica: nothing waits on arrivals), streams the answers like the online bench
(infer/bench/online.py's client) and reads, from /proc, the CPU seconds each part burnt during the
run: the ingress process, the replica actors (`ray::ServeReplica`), the rest of Ray (GCS, raylet,
Serve controller) and the client (this process). CPU per output token, times the tokens/s, says
how many cores a part needs at that throughput: when the parts' sum reaches the machine's cores the
host, not the emulated device, bounds the scaling.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import tempfile
import time
from pathlib import Path

import httpx

from . import online

CLK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """utime + stime of a live process (0 once it is gone)."""
    try:
        f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(f[11]) + int(f[12])) / CLK  # fields 14 and 15 of stat, after the name


def tree(root: int) -> dict[int, str]:
    """The processes under `root` (itself included): pid -> command line."""
    parent, cmd = {}, {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                parent[int(d.name)] = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
                cmd[int(d.name)] = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                pass
    out, todo = {}, [root]
    while todo:
        p = todo.pop()
        out[p] = cmd.get(p, "")
        todo += [c for c, pp in parent.items() if pp == p and c not in out]
    return out


def part_of(pid: int, cmd: str, ingress: int) -> str:
    if pid == ingress:
        return "ingress"
    return "replicas" if cmd.startswith("ray::ServeReplica") else "ray_other"


def cpu_by_part(ingress: int) -> dict[str, float]:
    out = {"ingress": 0.0, "replicas": 0.0, "ray_other": 0.0}
    for pid, cmd in tree(ingress).items():
        out[part_of(pid, cmd, ingress)] += cpu_seconds(pid)
    out["client"] = time.process_time()
    return out


def point(model: str, device: str, replicas: int, lengths: list[tuple[int, int]], seed: int, max_seconds: float,
          log_dir: Path, extra: list[str]) -> dict:
    """One server with `replicas` replicas, every prompt at once; throughput, TTFT, CPU per part."""
    os.environ["RAY_TMPDIR"] = tempfile.mkdtemp(prefix="rt", dir="/tmp")  # short: Ray's socket paths
    ray_args = ["--replicas", str(replicas)] if replicas else []  # 0: the single-process server, no Ray
    proc, url = online.start_server(model, "cdb-refill", ["--device", device, *ray_args, *extra],
                                    log_dir / f"server_r{replicas}.log")
    try:
        name, _, vocab = online.server_info(url, None)
        vocab = vocab or 256
        asyncio.run(online.run_rate(url, name, float("inf"), [(8, 8)] * (4 * replicas), vocab, seed, 1.0, 60))
        online.wait_idle(url)
        before = cpu_by_part(proc.pid)
        res, dur = asyncio.run(online.run_rate(url, name, float("inf"), lengths, vocab, seed, 1.0, max_seconds))
        after = cpu_by_part(proc.pid)
        text = httpx.get(url + "/metrics", timeout=10).text
        dev = httpx.get(url + "/v1/models", timeout=10).json()["data"][0].get("device") or {}
    finally:
        online.stop_server(proc)
    s = online.summarize(res, dur)
    tokens = sum(r.output_len for r in res if r.error is None)
    cpu = {k: after[k] - before[k] for k in before}
    return {"replicas": replicas, "completed": s["completed"], "failed": s["failed"], "duration_s": dur,
            "output_tokens": tokens, "output_throughput": s["output_throughput"], "ttft_ms": s["ttft_ms"],
            "tpot_ms": s["tpot_ms"], "cpu_seconds": cpu,
            "cpu_ms_per_output_token": {k: 1e3 * v / max(1, tokens) for k, v in cpu.items()},
            "cores_busy": {k: v / dur for k, v in cpu.items()}, "cores_busy_total": sum(cpu.values()) / dur,
            "replicas_reporting": float(m.group(1)) if (m := re.search(r"^cdb_replicas (\S+)", text, re.M)) else 0,
            "device": dev}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="ouro-1.4b", help="what the emulated device serves (a paper shape)")
    p.add_argument("--device", default="emulated:h100")
    p.add_argument("--replicas", type=int, nargs="+", default=[1, 2, 4],
                   help="replica counts (0: the single-process server, without Ray, as a baseline)")
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--dataset", default="sharegpt")
    p.add_argument("--length-scale", type=float, default=0.25, help="multiply the trace's lengths")
    p.add_argument("--max-seconds", type=float, default=300.0)
    p.add_argument("--server-args", default="", help="more infer.serve arguments (one string)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("outputs/replicas"))
    a = p.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    lengths = online.sample_lengths(a.num_prompts, a.seed, a.dataset, 4096, 0, 0, a.length_scale, None)
    points = []
    for n in a.replicas:
        pt = point(a.model, a.device, n, lengths, a.seed, a.max_seconds, a.out, a.server_args.split())
        points.append(pt)
        c = pt["cpu_ms_per_output_token"]
        print(f"{n} replica(s): {pt['output_throughput']:8.1f} tok/s ({pt['completed']}/{len(lengths)} ok), "
              f"TTFT p50 {pt['ttft_ms']['median']:.0f} p99 {pt['ttft_ms']['p99']:.0f} ms; CPU ms/token ingress "
              f"{c['ingress']:.3f} replicas {c['replicas']:.3f} ray {c['ray_other']:.3f} client {c['client']:.3f}; "
              f"cores busy {pt['cores_busy_total']:.2f} of {os.cpu_count()}", flush=True)
    base = next((pt["output_throughput"] for pt in points if pt["replicas"] == 1), points[0]["output_throughput"])
    for pt in points:
        pt["throughput_ratio"] = pt["output_throughput"] / base
    out = {"model": a.model, "device": a.device, "dataset": a.dataset, "length_scale": a.length_scale,
           "num_prompts": a.num_prompts, "cores": os.cpu_count(), "points": points,
           "command": "python -m infer.bench.replica_scaling " + " ".join(argv if argv is not None else
                                                                         __import__("sys").argv[1:])}
    path = a.out / "replica_scaling.json"
    path.write_text(json.dumps(out, indent=1))
    print("ratios to 1 replica:", ", ".join(f"{pt['replicas']}: {pt['throughput_ratio']:.2f}x" for pt in points))
    print(f"json: {path}")
    return out


if __name__ == "__main__":
    main()

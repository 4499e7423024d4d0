"""Replica scaling on the emulated device (issue 26, deliverable 3): the same load against 1, 2, 4
engine replicas behind `python -m infer.serve --replicas N --device emulated:h100` (Ray Serve).

    python -m infer.bench.replica_scaling --replicas 1 2 4 --num-prompts 256 --out outputs/replicas

On an emulated device the engine's compute is a wait (the cost model's stage time), so what has to
scale is the host: the ingress (HTTP in, a Serve handle call per request, the response streamed
back), each replica (its HTTP app, the async engine, the scheduler, the output processor and the
detokenizer) and the client. Each point starts the server, sends every prompt at once (a rate that
saturates one replica: nothing waits on arrivals) with at most `--concurrency-per-replica` x replicas
in flight (a closed loop: each replica's batch stays full with a batch's worth waiting, inside its
admission limit, max_batch_size + --max-waiting; past that the single server answers 429 and Ray
Serve's router queues and backs off, so an unbounded burst measured the overload path), streams the
answers like the online bench (infer/bench/online.py's client) and reads, from /proc, the CPU
seconds each part burnt during the run: the ingress process, the replica actors
(`ray::ServeReplica`), the rest of Ray (GCS, raylet, Serve controller) and the client (this
process). CPU per output token, times the tokens/s, says how many cores a part needs at that
throughput: when the parts' sum reaches the machine's cores the host, not the emulated device,
bounds the scaling.

Averages over a run hide a part that saturates only in steady state (the ramp and the tail are
idle), so a sampler also reads every process's CPU and the machine's /proc/stat (busy, and steal:
time the hypervisor gave to other tenants) every `--sample-every` seconds; `steady` is the median
of each over the middle half of the run, beside how many output tokens/s streamed in that window.
"""
from __future__ import annotations

import argparse
import asyncio
from itertools import accumulate
import json
import os
import re
import tempfile
import threading
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


def machine_cpu() -> dict[str, float]:
    """Seconds since boot, summed over the machine's CPUs, from /proc/stat's first line: busy (not
    idle or iowait), steal (given to other virtual machines) and all."""
    f = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    return {"busy": (sum(f) - f[3] - f[4] - f[7]) / CLK, "steal": f[7] / CLK, "all": sum(f) / CLK}


class Sampler(threading.Thread):
    """Every `every` seconds: the cores each process of the server's tree (labelled by part, each
    replica apart) and the client used since the previous sample, and the machine's busy and
    stolen cores. The server's processes are listed once, when it starts (after the warm-up)."""

    def __init__(self, ingress: int, every: float):
        super().__init__(daemon=True)
        self.every, self.rows, self.halt = every, [], threading.Event()
        self.label = {}
        for pid, cmd in tree(ingress).items():
            part = part_of(pid, cmd, ingress)
            self.label[pid] = f"replica:{pid}" if part == "replicas" else part
        self.label[os.getpid()] = "client"

    def read(self) -> tuple[float, dict[str, float], dict[str, float]]:
        parts: dict[str, float] = {}
        for pid, lab in self.label.items():
            parts[lab] = parts.get(lab, 0.0) + cpu_seconds(pid)
        return time.perf_counter(), parts, machine_cpu()

    def run(self) -> None:
        self.t0, last, mlast = self.read()
        t_last = self.t0
        while not self.halt.wait(self.every):
            t, now, m = self.read()
            dt = t - t_last
            self.rows.append({"t": t - self.t0, "cores": {k: (now[k] - last[k]) / dt for k in now},
                              "machine_busy": (m["busy"] - mlast["busy"]) / dt,
                              "machine_steal": (m["steal"] - mlast["steal"]) / dt})
            t_last, last, mlast = t, now, m


def steady(rows: list[dict], res: list, t0: float) -> dict:
    """Medians over the middle half of the run (by time): each part's cores (replicas: each one's
    and the busiest's), the machine's busy and stolen cores, and the output tokens/s streamed then
    (from the client's per-token arrival times)."""
    if len(rows) < 4:
        return {}
    end = rows[-1]["t"]
    mid = [r for r in rows if end / 4 <= r["t"] <= 3 * end / 4]
    med = (lambda xs: sorted(xs)[len(xs) // 2])
    out = {k: med([r["cores"][k] for r in mid]) for k in mid[0]["cores"] if not k.startswith("replica:")}
    reps = sorted({k for k in mid[0]["cores"] if k.startswith("replica:")})
    out["replica_each"] = [med([r["cores"][k] for r in mid]) for k in reps]
    out["replica_busiest"] = med([max([r["cores"][k] for k in reps] or [0.0]) for r in mid])
    out["machine_busy"] = med([r["machine_busy"] for r in mid])
    out["machine_steal"] = med([r["machine_steal"] for r in mid])
    lo, hi = t0 + end / 4, t0 + 3 * end / 4
    n = 0.0
    for r in res:  # each streamed chunk's arrival: send + TTFT + the inter-token gaps so far
        if r.error is None and r.ttft is not None:
            stamps = list(accumulate([r.send + r.ttft, *r.itl]))
            n += sum(lo <= ts <= hi for ts in stamps) * r.output_len / len(stamps)
    out["output_throughput"] = n / (hi - lo)
    out["window_s"] = [end / 4, 3 * end / 4]
    return out


def point(model: str, device: str, replicas: int, lengths: list[tuple[int, int]], seed: int, max_seconds: float,
          log_dir: Path, extra: list[str], sample_every: float = 0.5, per_replica: int = 128) -> dict:
    """One server with `replicas` replicas, every prompt at once with at most `per_replica` x
    replicas in flight; throughput, TTFT, CPU per part."""
    os.environ["RAY_TMPDIR"] = tempfile.mkdtemp(prefix="rt", dir="/tmp")  # short: Ray's socket paths
    ray_args = ["--replicas", str(replicas)] if replicas else []  # 0: the single-process server, no Ray
    proc, url = online.start_server(model, "cdb-refill", ["--device", device, *ray_args, *extra],
                                    log_dir / f"server_r{replicas}.log")
    try:
        name, _, vocab = online.server_info(url, None)
        vocab = vocab or 256
        asyncio.run(online.run_rate(url, name, float("inf"), [(8, 8)] * (4 * replicas), vocab, seed, 1.0, 60))
        online.wait_idle(url)
        sampler = Sampler(proc.pid, sample_every)
        before = cpu_by_part(proc.pid)
        sampler.start()
        res, dur = asyncio.run(online.run_rate(url, name, float("inf"), lengths, vocab, seed, 1.0, max_seconds,
                                               max_concurrency=per_replica * max(1, replicas)))
        sampler.halt.set()
        sampler.join()
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
            "device": dev, "steady": steady(sampler.rows, res, sampler.t0), "samples": sampler.rows}


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
    p.add_argument("--sample-every", type=float, default=0.5, help="seconds between CPU samples")
    p.add_argument("--concurrency-per-replica", type=int, default=128,
                   help="requests in flight per replica (default: twice the engine's default batch of 64)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("outputs/replicas"))
    a = p.parse_args(argv)
    if a.concurrency_per_replica < 1:  # before any server starts
        p.error(f"--concurrency-per-replica must be >= 1, got {a.concurrency_per_replica}")
    a.out.mkdir(parents=True, exist_ok=True)
    lengths = online.sample_lengths(a.num_prompts, a.seed, a.dataset, 4096, 0, 0, a.length_scale, None)
    points = []
    for n in a.replicas:
        pt = point(a.model, a.device, n, lengths, a.seed, a.max_seconds, a.out, a.server_args.split(), a.sample_every,
                   a.concurrency_per_replica)
        points.append(pt)
        c = pt["cpu_ms_per_output_token"]
        print(f"{n} replica(s): {pt['output_throughput']:8.1f} tok/s ({pt['completed']}/{len(lengths)} ok), "
              f"TTFT p50 {pt['ttft_ms']['median']:.0f} p99 {pt['ttft_ms']['p99']:.0f} ms; CPU ms/token ingress "
              f"{c['ingress']:.3f} replicas {c['replicas']:.3f} ray {c['ray_other']:.3f} client {c['client']:.3f}; "
              f"cores busy {pt['cores_busy_total']:.2f} of {os.cpu_count()}", flush=True)
        st = pt["steady"]
        if st:
            print(f"  steady state ({st['window_s'][0]:.0f}-{st['window_s'][1]:.0f} s): {st['output_throughput']:.0f} "
                  f"tok/s; cores: ingress {st.get('ingress', 0):.2f}, replicas {st['replica_each']}, ray "
                  f"{st.get('ray_other', 0):.2f}, client {st.get('client', 0):.2f}; machine busy "
                  f"{st['machine_busy']:.2f}, steal {st['machine_steal']:.2f}", flush=True)
    base = next((pt["output_throughput"] for pt in points if pt["replicas"] == 1), points[0]["output_throughput"])
    for pt in points:
        pt["throughput_ratio"] = pt["output_throughput"] / base
    out = {"model": a.model, "device": a.device, "dataset": a.dataset, "length_scale": a.length_scale,
           "num_prompts": a.num_prompts, "concurrency_per_replica": a.concurrency_per_replica,
           "cores": os.cpu_count(), "points": points,
           "command": "python -m infer.bench.replica_scaling " + " ".join(argv if argv is not None else
                                                                         __import__("sys").argv[1:])}
    path = a.out / "replica_scaling.json"
    path.write_text(json.dumps(out, indent=1))
    print("ratios to 1 replica:", ", ".join(f"{pt['replicas']}: {pt['throughput_ratio']:.2f}x" for pt in points))
    print(f"json: {path}")
    return out


if __name__ == "__main__":
    main()

"""Sweeps pairing accuracy with engine throughput, over exit threshold x r_min x KV layout x lookahead.

The grid lives in a wandb sweep file (eval/sweeps/*.yaml). Each point runs the lm-eval tasks
through the engine (eval.lm) AND the offline throughput bench (infer.bench.throughput) with the
same settings, and logs both to wandb (one run per point, offline unless WANDB_MODE says
otherwise) and to results.csv / results.json; `plot` draws accuracy vs throughput (the Pareto
front) and accuracy vs threshold per r_min.

    python -m eval.sweep run eval/sweeps/ouro-demo.yaml --out outputs/sweeps/ouro-demo
    python -m eval.sweep run eval/sweeps/lab-hops.yaml --throughput sim:h100 --out outputs/sweeps/lab-hops
    python -m eval.sweep plot outputs/sweeps/ouro-demo/results.csv
    wandb sweep eval/sweeps/ouro-demo.yaml && wandb agent <id>   # with a wandb server: runs `point`

`run` executes the grid locally (wandb.sweep() needs a server); points that are the same policy
(with lookahead the exit depth is >= 2 anyway, so r_min=1 and r_min=2 coincide) run once.

The throughput source (`throughput:` in the sweep file, or --throughput): `cpu`, the offline bench
on this machine only; `sim:h100` / `sim:h200` also records the exits each point's policy takes on
the evaluation's own requests (lm-eval's record_exits) and replays them, pooled as lm-eval sent
them, through the simulator (`python -m infer.sim --replay-exits FILE --pool`, the command is in
the row); `emulated:h100` does that and runs the same file through the real engine on the emulated
device (`python -m infer.bench --device emulated:h100`). The replay runs on the checkpoint's own
shape, or on `sim_model` (e.g. ouro-1.4b: the recorded depths on the paper's shape).
"""
from __future__ import annotations

import argparse
import csv
import itertools
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import yaml

from eval.plots import plot
from kv_layouts import DEFAULT_LAYOUT

SETTINGS = ("exit_criterion", "exit_threshold", "r_min", "kv_layout", "lookahead", "policy")
DEFAULTS = dict(tasks="looped_suite", limit=24, bench_workload="alpaca", bench_requests=16, bench_scale=1.0,
                bench_repeats=1, batch_size=32, dtype="float32", device="cpu", load_format="auto", seed=0,
                baselines=True, bootstrap_iters=100, project="looped-eval",
                throughput="cpu", sim_model=None, sim_batch_size=64, samples=False)
THROUGHPUTS = ("cpu", "sim:h100", "sim:h200", "emulated:h100", "emulated:h200")


# ---------------------------------------------------------------- grid
def load_sweep(path: str | Path) -> dict:
    """The sweep file as a dict: `fixed` (parameters with `value`) and `grid` (with `values`)."""
    spec = yaml.safe_load(Path(path).read_text())
    if spec.get("method", "grid") != "grid":
        raise ValueError(f"{path}: the local runner executes grids only (method: grid)")
    fixed, grid = {}, {}
    for k, v in spec.get("parameters", {}).items():
        if "values" in v:
            grid[k] = list(v["values"])
        elif "value" in v:
            fixed[k] = v["value"]
        else:
            raise ValueError(f"{path}: parameter {k!r} needs `value` or `values`")
    return {"name": spec.get("name", Path(path).stem), "fixed": fixed, "grid": grid}


def grid_points(grid: dict[str, list], fixed: dict[str, Any], baselines: bool) -> list[dict]:
    """The grid's points (fixed settings filled in), then (if baselines) one full-depth CB point
    per KV layout."""
    keys = list(grid)
    base = {k: fixed[k] for k in SETTINGS if k in fixed}
    points = [{**base, **dict(zip(keys, vals))} for vals in itertools.product(*(grid[k] for k in keys))]
    if baselines:
        for layout in dict.fromkeys(grid.get("kv_layout", [fixed.get("kv_layout", DEFAULT_LAYOUT)])):
            points.append({"policy": "cb", "kv_layout": layout, "exit_threshold": None, "r_min": None,
                           "lookahead": False})
    return points


def policy_key(p: dict) -> tuple:
    """Points with the same key run the same policy. Lookahead exits at depth >= 2 whatever r_min,
    so r_min 1 and 2 coincide; CB runs at full depth, so threshold and r_min do not matter."""
    if p.get("policy") == "cb":
        return ("cb", p.get("kv_layout"))
    r_min = p.get("r_min") or 1
    if p.get("lookahead"):
        r_min = max(r_min, 2)
    return ("cdb", p.get("exit_criterion"), p.get("kv_layout"), p.get("exit_threshold"), r_min, bool(p.get("lookahead")))


# ---------------------------------------------------------------- one point
def flatten(results: dict) -> dict[str, float]:
    """lm-eval results -> {"task/metric[/filter]": value}, plus `score`: the mean headline
    accuracy (acc or exact_match) over the tasks that have one."""
    out, accs = {}, []
    for task, metrics in results["results"].items():
        for key, v in metrics.items():
            if not isinstance(v, (int, float)) or "_stderr" in key or key.startswith("sample_"):
                continue
            metric, _, filt = key.partition(",")
            out[f"{task}/{metric}" + ("" if filt in ("none", "") else f"/{filt}")] = float(v)
            if metric in ("acc", "exact_match"):
                accs.append(float(v))
    out["score"] = sum(accs) / len(accs) if accs else float("nan")
    return out


def evaluate_point(model, tokenizer, point: dict, cfg: dict, task_manager,
                   record_exits: Path | None = None, samples_to: Path | None = None) -> dict[str, float]:
    """The point's lm-eval metrics and mean exit depth; `record_exits`: also write the exits it
    took (lm-eval's record_exits model arg) to that file; `samples_to` (the sweep's `samples: true`):
    each document's metric values, {task: [{doc_id, metric: value}]}, for paired intervals between
    points (e.g. bits_per_byte's (log-likelihood, bytes) per document: lm-eval gives it no stderr)."""
    from eval.lm import LoopedEvalLM, simple_evaluate

    lm = LoopedEvalLM(model, tokenizer=tokenizer, batch_size=cfg["batch_size"], dtype=cfg["dtype"],
                      device=cfg["device"], record_exits=record_exits,
                      **{k: point[k] for k in SETTINGS if point.get(k) is not None})
    tasks = cfg["tasks"].split(",") if isinstance(cfg["tasks"], str) else list(cfg["tasks"])
    res = simple_evaluate(lm, tasks=tasks, limit=cfg["limit"], task_manager=task_manager,
                          bootstrap_iters=cfg["bootstrap_iters"], log_samples=samples_to is not None,
                          random_seed=cfg["seed"],
                          numpy_random_seed=cfg["seed"], torch_random_seed=cfg["seed"], fewshot_random_seed=cfg["seed"])
    row = flatten(res)
    row["mean_exit_depth"] = lm.mean_exit_depth()
    if samples_to is not None:
        samples_to.parent.mkdir(parents=True, exist_ok=True)
        per_doc = {task: [{"doc_id": x["doc_id"], **{m: x[m] for m in x["metrics"]}} for x in xs]
                   for task, xs in res["samples"].items()}
        samples_to.write_text(json.dumps(per_doc) + "\n")
        row["samples"] = str(samples_to)
    return row


def bench_point(pretrained, point: dict, cfg: dict) -> dict[str, float]:
    from infer.bench import offline as bench

    kw = {k: point[k] for k in SETTINGS if k != "policy" and point.get(k) is not None}
    scale = cfg["bench_scale"] if cfg["bench_scale"] == "auto" else float(cfg["bench_scale"])
    runs = [bench.throughput(pretrained, policy=point.get("policy") or "cdb", workload=cfg["bench_workload"],
                             num_requests=int(cfg["bench_requests"]), scale=scale, seed=int(cfg["seed"]),
                             max_batch_size=int(cfg["batch_size"]), dtype=cfg["dtype"], device=cfg["device"], **kw)
            for _ in range(int(cfg["bench_repeats"]))]
    res = sorted(runs, key=lambda r: r["output_tokens_per_s"])[len(runs) // 2]  # the median run
    return {f"bench/{k}": float(v) for k, v in res.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def check_throughput(source: str) -> str:
    if source not in THROUGHPUTS:
        raise ValueError(f"throughput must be one of {list(THROUGHPUTS)}, got {source!r}")
    return source


# the simulated row's fields: the point's mode in the simulator's (and emulated bench's) JSON
SIM_FIELDS = ("output_tokens_per_s", "speedup_vs_cb", "s_e2e", "fraction_of_bound", "compute_ratio",
              "weight_traffic_ratio", "mean_exit_depth")


def sim_shape(cfg: dict) -> str:
    """What the replay runs on: `sim_model` (a paper shape or preset), else the checkpoint folder."""
    shape = cfg.get("sim_model") or cfg.get("pretrained")
    if not isinstance(shape, (str, Path)):
        raise ValueError(f"throughput {cfg['throughput']} replays on the checkpoint's shape: give `pretrained` (its "
                         "folder) or `sim_model` (e.g. ouro-1.4b)")
    return str(shape)


def replay_argv(point: dict, cfg: dict, exits: Path, out: Path) -> list[str]:
    """The flags that replay a point's recorded exits on the sweep's GPU (infer.sim and the
    emulated bench take the same): the shape, the point's KV layout and lookahead, the batch, the
    file's workloads pooled, and the modes CB, CDB refill K=1 (the engine's default) and full depth."""
    argv = ["--model", sim_shape(cfg), "--replay-exits", str(exits), "--pool", "--ks", "1",
            "--max-batch-size", str(int(cfg["sim_batch_size"])), "--out", str(out)]
    if point.get("kv_layout"):
        argv += ["--kv-layout", point["kv_layout"]]
    if point.get("lookahead"):
        argv += ["--lookahead"]
    return argv


def _mode_fields(block: dict, point: dict, prefix: str) -> dict:
    by = {r["mode"]: r for r in block["results"]}
    r = by["cb" if point.get("policy") == "cb" else "cdb_refill_k1"]
    out = {f"{prefix}/{k}": r[k] for k in SIM_FIELDS}
    out[f"{prefix}/cb_output_tokens_per_s"] = by["cb"]["output_tokens_per_s"]
    out[f"{prefix}/full_depth_vs_cb"] = by["cdb_full_depth"]["output_tokens_per_s"] / by["cb"]["output_tokens_per_s"]
    return out


def sim_point(point: dict, cfg: dict, exits: Path, out: Path) -> dict:
    """The point's recorded exits replayed by `python -m infer.sim` (run here, its command in the
    row): the point's policy (CB for the CB point, else CDB refill K=1) on the sweep's GPU."""
    from infer.sim.__main__ import main as sim_main

    gpu = cfg["throughput"].split(":")[1]
    shutil.rmtree(out, ignore_errors=True)  # (the JSON read back is this run's)
    argv = replay_argv(point, cfg, exits, out) + ["--gpu", gpu]
    sim_main(argv)
    doc = json.loads(next(out.glob("sim_*.json")).read_text())
    own = cfg.get("sim_model") is None
    return {**_mode_fields(doc["workloads"][0], point, "sim"), "sim/gpu": gpu,
            "sim/model": f"{Path(sim_shape(cfg)).name} (own shape)" if own else
            f"{cfg['sim_model']} (recorded depths on its shape)",
            "sim/requests": doc["workloads"][0]["workload"]["num_requests"], "sim/exits": str(exits),
            "sim/command": "python -m infer.sim " + " ".join(argv)}


def emulated_point(point: dict, cfg: dict, exits: Path, out: Path) -> dict:
    """The same replay through the real engine on the emulated device, on the wall clock
    (`python -m infer.bench --device emulated:...`, one repeat), and its ratio to the simulator's."""
    from infer.bench.offline import main as bench_main

    shutil.rmtree(out, ignore_errors=True)
    argv = replay_argv(point, cfg, exits, out) + ["--device", cfg["throughput"], "--repeats", "1",
                                                              "--no-norefill"]
    bench_main(argv)
    doc = json.loads(next(out.glob("*.json")).read_text())
    return {**_mode_fields(doc["workloads"][0], point, "emulated"),
            "emulated/command": "python -m infer.bench " + " ".join(argv)}


def measure_point(model, tokenizer, pretrained, point: dict, cfg: dict, tm, out: Path) -> dict:
    """One point's row: accuracy, the CPU bench, and the sweep's GPU source (module docstring)."""
    source = check_throughput(cfg.get("throughput") or "cpu")
    exits = None if source == "cpu" else out / "exits" / f"{point_name(point)}.exits.json"
    if exits is not None:
        sim_shape(cfg)  # (refused before the evaluation)
    samples = out / "samples" / f"{point_name(point)}.json" if cfg.get("samples") else None
    row = {**evaluate_point(model, tokenizer, point, cfg, tm, exits, samples), **bench_point(pretrained, point, cfg)}
    if exits is not None:
        row.update(sim_point(point, cfg, exits, out / "sim" / point_name(point)))
    if source.startswith("emulated:"):
        row.update(emulated_point(point, cfg, exits, out / "emulated" / point_name(point)))
        row["emulated_vs_sim"] = row["emulated/output_tokens_per_s"] / row["sim/output_tokens_per_s"]
    return row


def point_name(p: dict) -> str:
    if p.get("policy") == "cb":
        return f"cb-full-{p['kv_layout']}"
    la = "-la" if p.get("lookahead") else ""
    return f"q{p.get('exit_threshold')}-rmin{p.get('r_min')}-{p.get('kv_layout')}{la}"


# ---------------------------------------------------------------- logging
def _wandb_run(cfg: dict, group: str, name: str, config: dict, row: dict, out: Path) -> str | None:
    if cfg.get("wandb") is False:
        return None
    os.environ.setdefault("WANDB_MODE", "offline")
    os.environ.setdefault("WANDB_SILENT", "true")
    import wandb

    run = wandb.init(project=cfg["project"], group=group, name=name, job_type="sweep-point", config=config,
                     dir=str(out), reinit="finish_previous")
    run.log({k: v for k, v in row.items() if isinstance(v, (int, float)) and not isinstance(v, bool)})
    run_dir = str(Path(run.dir).parent)
    run.finish()
    return run_dir


def write_table(rows: list[dict], out: Path) -> None:
    keys = list(dict.fromkeys(k for r in rows for k in r))
    with open(out / "results.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)
    (out / "results.json").write_text(json.dumps(rows, indent=2, default=str) + "\n")


def resolve_sweep(sweep: str | Path, overrides: dict[str, Any] | None) -> tuple[dict, dict, dict]:
    """(spec, grid, cfg) of a sweep file with overrides: a list replaces a grid axis, a scalar fixes it."""
    spec = load_sweep(sweep)
    grid = dict(spec["grid"])
    for k, v in (overrides or {}).items():
        if k in grid:
            if isinstance(v, list):
                grid[k] = v
            else:
                del grid[k]
    cfg = {**DEFAULTS, **spec["fixed"], **{k: v for k, v in (overrides or {}).items() if k not in grid}}
    check_throughput(cfg["throughput"])  # before the first point's evaluation, not after it
    return spec, grid, cfg


def run_sweep(sweep: str | Path, out: str | Path, overrides: dict[str, Any] | None = None,
              model=None, tokenizer=None) -> list[dict]:
    """Execute the sweep file's grid locally; returns the rows (also written to out/)."""
    from infer.engine.llm import load_model

    from eval.lm import LoopedEvalLM, task_manager

    spec, grid, cfg = resolve_sweep(sweep, overrides)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    pretrained = cfg.get("pretrained") if model is None else model
    if pretrained is None:
        raise ValueError("the sweep needs a `pretrained` parameter (a checkpoint folder)")
    if model is None:
        model, tok = load_model(pretrained, cfg["dtype"], cfg["device"], load_format=cfg["load_format"])
        tokenizer = tokenizer or tok
    if tokenizer is None and cfg.get("tokenizer"):
        tokenizer = LoopedEvalLM._tokenizer(cfg["tokenizer"])
    tm = task_manager()
    rows, done = [], {}  # done: policy key -> (name, metrics)
    for point in grid_points(grid, cfg, bool(cfg["baselines"])):
        key = policy_key(point)
        t0 = time.perf_counter()
        if key in done:
            first, metrics = done[key]
            metrics = {**metrics, "same_policy_as": first}
        else:
            metrics = measure_point(model, tokenizer, pretrained, point, cfg, tm, out)
            done[key] = (point_name(point), metrics)
        settings = {k: point.get(k) for k in SETTINGS}
        settings["policy"] = settings["policy"] or "cdb"
        row = {"name": point_name(point), **settings, **metrics, "seconds": round(time.perf_counter() - t0, 2)}
        row["wandb_run"] = _wandb_run(cfg, spec["name"], row["name"], {**cfg, **settings}, row, out)
        rows.append(row)
        write_table(rows, out)  # after every point, so a long sweep can be inspected while it runs
        print(json.dumps({k: row[k] for k in ("name", "score", "mean_exit_depth", "bench/output_tokens_per_s",
                                              "sim/speedup_vs_cb", "sim/fraction_of_bound", "emulated_vs_sim",
                                              "seconds") if k in row}), flush=True)
    plot(out / "results.csv")
    return rows


# ---------------------------------------------------------------- the same grid on Ray workers
def _ray_point(pretrained: str, point: dict, cfg: dict, threads: int | None, out: str) -> tuple[dict, float]:
    """One Ray task: load the model on the worker's device, then the point's accuracy + throughput."""
    import torch

    from infer.engine.llm import load_model

    from eval.lm import LoopedEvalLM, task_manager

    if threads:
        torch.set_num_threads(threads)  # the core Ray reserved for this task
    t0 = time.perf_counter()
    model, tok = load_model(pretrained, cfg["dtype"], cfg["device"], load_format=cfg["load_format"])
    if tok is None and cfg.get("tokenizer"):
        tok = LoopedEvalLM._tokenizer(cfg["tokenizer"])
    metrics = measure_point(model, tok, pretrained, point, cfg, task_manager(), Path(out))
    return metrics, time.perf_counter() - t0


def run_sweep_ray(sweep: str | Path, out: str | Path, overrides: dict[str, Any] | None = None,
                  address: str | None = None, workers: int | None = None) -> list[dict]:
    """`run_sweep`'s grid with each distinct policy as a Ray task on one device (a GPU on CUDA, one
    core on CPU), at most `workers` at once; rows, wandb runs and plots are written here, in grid
    order, exactly as `run_sweep` writes them. `address`: an existing cluster (else a local one)."""
    try:
        import ray
    except ImportError:
        raise SystemExit("error: --ray needs Ray: pip install -e '.[distributed]'") from None

    spec, grid, cfg = resolve_sweep(sweep, overrides)
    if cfg.get("pretrained") is None:
        raise ValueError("the sweep needs a `pretrained` parameter (a checkpoint folder)")
    local = Path(cfg["pretrained"])  # workers may run elsewhere: send an absolute path (same on every node)
    pretrained = str(local.resolve()) if local.exists() else cfg["pretrained"]
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    points = grid_points(grid, cfg, bool(cfg["baselines"]))
    todo = list({policy_key(p): p for p in reversed(points)}.items())[::-1]  # first point of each policy
    names = {key: point_name(p) for key, p in todo}
    cuda = str(cfg["device"]).startswith("cuda")
    if address:
        ray.init(address=address)
    else:
        ray.init(include_dashboard=False, num_cpus=workers or os.cpu_count())
    try:
        task = ray.remote(**({"num_gpus": 1, "num_cpus": 1} if cuda else {"num_cpus": 1}))(_ray_point)
        running, results = {}, {}
        while todo or running:
            while todo and len(running) < (workers or len(todo) + len(running)):
                key, p = todo.pop(0)
                running[task.remote(pretrained, p, cfg, None if cuda else 1, str(out.resolve()))] = key
            done, _ = ray.wait(list(running), num_returns=1)
            for ref in done:
                key = running.pop(ref)
                results[key] = ray.get(ref)
                print(json.dumps({"name": names[key], "score": results[key][0].get("score"),
                                  "seconds": round(results[key][1], 2)}), flush=True)
    finally:
        ray.shutdown()
    rows, first = [], {}
    for point in points:
        key = policy_key(point)
        metrics, secs = results[key]
        if key in first:
            metrics, secs = {**metrics, "same_policy_as": first[key]}, 0.0
        else:
            first[key] = point_name(point)
        settings = {k: point.get(k) for k in SETTINGS}
        settings["policy"] = settings["policy"] or "cdb"
        row = {"name": point_name(point), **settings, **metrics, "seconds": round(secs, 2)}
        row["wandb_run"] = _wandb_run(cfg, spec["name"], row["name"], {**cfg, **settings}, row, out)
        rows.append(row)
    write_table(rows, out)
    plot(out / "results.csv")
    return rows


# ---------------------------------------------------------------- CLI
def _value(s: str):
    v = yaml.safe_load(s)
    return None if isinstance(v, str) and v.lower() == "none" else v


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m eval.sweep", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="execute a sweep file's grid locally (offline wandb + CSV/JSON + plots)")
    r.add_argument("sweep", type=Path)
    r.add_argument("--out", type=Path, default=None, help="default: outputs/sweeps/<sweep name>")
    r.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                   help="override parameters, e.g. limit=20 pretrained=checkpoints/x 'r_min=[1,3]' (a list "
                        "replaces a grid axis, a scalar fixes it)")
    r.add_argument("--no-wandb", action="store_true")
    r.add_argument("--throughput", choices=THROUGHPUTS, default=None,
                   help="the GPU throughput source beside the CPU bench (default: the sweep file's `throughput`, "
                        "else cpu only; module docstring)")
    r.add_argument("--ray", action="store_true", help="run the points as Ray tasks, one device each "
                   "(the `distributed` extra; docs/distributed.md)")
    r.add_argument("--ray-address", default=None, help="with --ray: an existing cluster (default: a local one)")
    r.add_argument("--workers", type=int, default=None, help="with --ray: points at once (default: the cluster's)")
    pt = sub.add_parser("point", help="one point (what `wandb agent` runs; flags as --key=value)")
    pt.add_argument("--out", type=Path, default=Path("outputs/sweeps/agent"))
    pl = sub.add_parser("plot", help="redraw the plots from a results.csv")
    pl.add_argument("csv", type=Path)
    pl.add_argument("--metric", default="score")
    a, rest = p.parse_known_args(argv)
    if rest and a.cmd != "point":
        p.error(f"unrecognized arguments: {' '.join(rest)}")
    if a.cmd == "run":
        over = dict(kv.split("=", 1) for kv in a.set)
        over = {k: _value(v) for k, v in over.items()}
        if a.no_wandb:
            over["wandb"] = False
        if a.throughput:
            over["throughput"] = a.throughput
        name = load_sweep(a.sweep)["name"]
        if a.ray:
            run_sweep_ray(a.sweep, a.out or Path("outputs/sweeps") / name, over, a.ray_address, a.workers)
        else:
            run_sweep(a.sweep, a.out or Path("outputs/sweeps") / name, over)
    elif a.cmd == "point":
        print(json.dumps(run_agent_point(rest, a.out)))
    else:
        for f in plot(a.csv, a.metric):
            print(f)


def run_agent_point(flags: list[str], out: Path) -> dict:
    """`wandb agent` calls `python -m eval.sweep point --key=value ...`; the run it opens carries
    the sweep's config, so metrics land in the sweep."""
    import wandb

    from infer.engine.llm import load_model

    from eval.lm import task_manager

    cfg = dict(DEFAULTS)
    for f in flags:
        k, _, v = f.lstrip("-").partition("=")
        cfg[k] = _value(v)
    run = wandb.init(config=cfg, dir=str(out))
    cfg.update(dict(run.config))
    point = {k: cfg.get(k) for k in SETTINGS}
    model, tok = load_model(cfg["pretrained"], cfg["dtype"], cfg["device"], load_format=cfg["load_format"])
    row = measure_point(model, tok or cfg.get("tokenizer"), cfg["pretrained"], point, cfg, task_manager(), out)
    run.log(row)
    run.finish()
    return row


if __name__ == "__main__":
    from looplm.cli import run

    run(main)

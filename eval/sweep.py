"""Sweeps pairing accuracy with engine throughput, over exit threshold x r_min x KV layout x lookahead.

The grid lives in a wandb sweep file (eval/sweeps/*.yaml). Each point runs the lm-eval tasks
through the engine (eval.lm) AND the offline throughput bench (infer.bench.throughput) with the
same settings, and logs both to wandb (one run per point, offline unless WANDB_MODE says
otherwise) and to results.csv / results.json; `plot` draws accuracy vs throughput (the Pareto
front) and accuracy vs threshold per r_min.

    python -m eval.sweep run eval/sweeps/ouro-demo.yaml --out outputs/sweeps/ouro-demo
    python -m eval.sweep plot outputs/sweeps/ouro-demo/results.csv
    wandb sweep eval/sweeps/ouro-demo.yaml && wandb agent <id>   # with a wandb server: runs `point`

`run` executes the grid locally (wandb.sweep() needs a server); points that are the same policy
(with lookahead the exit depth is >= 2 anyway, so r_min=1 and r_min=2 coincide) run once.
"""
from __future__ import annotations

import argparse
import csv
import itertools
import json
import os
import time
from pathlib import Path
from typing import Any

import yaml

from eval.plots import plot
from kv_layouts import DEFAULT_LAYOUT

SETTINGS = ("exit_criterion", "exit_threshold", "r_min", "kv_layout", "lookahead", "policy")
DEFAULTS = dict(tasks="looped_suite", limit=24, bench_workload="alpaca", bench_requests=16, bench_scale=1.0,
                bench_repeats=1, batch_size=32, dtype="float32", device="cpu", load_format="auto", seed=0,
                baselines=True, bootstrap_iters=100, project="looped-eval")


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


def evaluate_point(model, tokenizer, point: dict, cfg: dict, task_manager) -> dict[str, float]:
    from eval.lm import LoopedEvalLM, simple_evaluate

    lm = LoopedEvalLM(model, tokenizer=tokenizer, batch_size=cfg["batch_size"], dtype=cfg["dtype"],
                      device=cfg["device"], **{k: point[k] for k in SETTINGS if point.get(k) is not None})
    tasks = cfg["tasks"].split(",") if isinstance(cfg["tasks"], str) else list(cfg["tasks"])
    res = simple_evaluate(lm, tasks=tasks, limit=cfg["limit"], task_manager=task_manager,
                          bootstrap_iters=cfg["bootstrap_iters"], log_samples=False, random_seed=cfg["seed"],
                          numpy_random_seed=cfg["seed"], torch_random_seed=cfg["seed"], fewshot_random_seed=cfg["seed"])
    row = flatten(res)
    row["mean_exit_depth"] = lm.mean_exit_depth()
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
            metrics = {**evaluate_point(model, tokenizer, point, cfg, tm), **bench_point(pretrained, point, cfg)}
            done[key] = (point_name(point), metrics)
        settings = {k: point.get(k) for k in SETTINGS}
        settings["policy"] = settings["policy"] or "cdb"
        row = {"name": point_name(point), **settings, **metrics, "seconds": round(time.perf_counter() - t0, 2)}
        row["wandb_run"] = _wandb_run(cfg, spec["name"], row["name"], {**cfg, **settings}, row, out)
        rows.append(row)
        write_table(rows, out)  # after every point, so a long sweep can be inspected while it runs
        print(json.dumps({k: row[k] for k in ("name", "score", "mean_exit_depth", "bench/output_tokens_per_s",
                                              "seconds") if k in row}), flush=True)
    plot(out / "results.csv")
    return rows


# ---------------------------------------------------------------- the same grid on Ray workers
def _ray_point(pretrained: str, point: dict, cfg: dict, threads: int | None) -> tuple[dict, float]:
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
    metrics = {**evaluate_point(model, tok, point, cfg, task_manager()), **bench_point(pretrained, point, cfg)}
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
                running[task.remote(pretrained, p, cfg, None if cuda else 1)] = key
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
    row = {**evaluate_point(model, tok or cfg.get("tokenizer"), point, cfg, task_manager()),
           **bench_point(cfg["pretrained"], point, cfg)}
    run.log(row)
    run.finish()
    return row


if __name__ == "__main__":
    from looplm.cli import run

    run(main)

"""The issue-58 rehearsal at real structure on this CPU: a narrow Ouro-1.4B-structure model (24 layers,
r_max 4, hidden 64, 4 heads, the demo tokenizer's vocabulary) trained by `accelerate launch
train/shared_kv.py` on 2 CPU ranks with FSDP2 per-block wrapping (train/configs/cpu_fsdp_2ranks.yaml),
--grad-accum 2 and --gradient-checkpointing, killed after `--kill-after` steps (--max-steps-this-run)
and resumed to `--steps`. Prints one JSON line: wall time and peak RSS of each launch (the largest
rank's), the rank parameter bytes, the losses.

    python -m train.rehearsal --out .cache/rehearsal --ctx 4096
"""
from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "checkpoints" / "ouro-demo"


def make_model(folder: Path, seed: int = 0) -> Path:
    """Ouro-1.4B's config (24 core layers, r_max 4, sandwich norms, exit gate) at width 64."""
    from looplm.io import build_model, load_tokenizer, save_pretrained
    from looplm.presets import init_weights, paper_config
    tok = load_tokenizer(DEMO)
    cfg = paper_config("ouro-1.4b", vocab_size=len(tok), hidden_size=64, intermediate_size=176, num_heads=4,
                       num_kv_heads=4, head_dim=16, max_position=8192, exit_criterion="learned", exit_threshold=0.6)
    model = init_weights(build_model(cfg), seed=seed, std=0.05)
    save_pretrained(model, folder, tokenizer=tok)
    return folder


def launch(args: list[str], log: Path) -> dict:
    """One `accelerate launch` on 2 CPU ranks; its wall time and the largest rank's peak RSS (the
    launcher waits for its workers, so RUSAGE_CHILDREN's max RSS covers them; the max is over the
    whole process's life: each launch runs in its own `python -m train.rehearsal --launch` child)."""
    cmd = [sys.executable, "-m", "train.rehearsal", "--out", "-", "--launch", json.dumps(args)]
    env = dict(os.environ, PYTHONPATH=str(REPO), ACCELERATE_USE_CPU="true", OMP_NUM_THREADS="1", WANDB_MODE="offline")
    t0 = time.time()
    with open(log, "a") as f:
        r = subprocess.run(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT)
    if r.returncode != 0:
        raise SystemExit(f"error: the launch failed (exit {r.returncode}); see {log}")
    peak = json.loads(log.read_text().strip().splitlines()[-1])["peak_rss_mb"]
    return {"wall_s": round(time.time() - t0, 1), "peak_rss_mb_largest_rank": peak}


def run_launch(args: list[str]) -> None:
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(REPO / "train/configs/cpu_fsdp_2ranks.yaml"), "--main_process_port",
           str(29000 + random.SystemRandom().randrange(2000)), "train/shared_kv.py", *args]
    rc = subprocess.run(cmd, cwd=REPO).returncode
    sys.stdout.flush()
    print(json.dumps({"rc": rc, "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024, 1)}))
    sys.exit(rc)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--ctx", type=int, default=4096)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--kill-after", type=int, default=2)
    p.add_argument("--tokens", type=int, default=200_000)
    p.add_argument("--launch", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.launch is not None:
        return run_launch(json.loads(a.launch))
    a.out.mkdir(parents=True, exist_ok=True)
    model = a.out / "model"
    if not (model / "config.json").exists():
        make_model(model)
    tok = a.out / "tok.npy"
    if not tok.exists():
        np.save(tok, np.random.default_rng(0).integers(3, 2048, a.tokens).astype(np.uint16))
    run = a.out / "run"
    args = ["--model", str(model), "--output", str(run), "--tokens", str(tok), "--steps", str(a.steps),
            "--batch", "1", "--grad-accum", "2", "--ctx", str(a.ctx), "--gradient-checkpointing", "--save-every", "1",
            "--log-every", "1", "--eval-every", "0", "--eval-windows", "1", "--staleness-every", "0", "--warmup", "1",
            "--threads", "1", "--no-wandb", "--save-dtype", "float32"]
    log = a.out / "log.txt"
    first = launch(args + ["--max-steps-this-run", str(a.kill_after)], log)
    second = launch(args, log)
    hist = json.loads((run / "history.json").read_text())
    summary = json.loads((run / "summary.json").read_text())
    print(json.dumps({"ctx": a.ctx, "first_launch": first, "resumed_launch": second,
                      "steps": [h["step"] for h in hist if "loss" in h], "loss": [round(h["loss"], 4) for h in hist if "loss" in h],
                      "rank_param_bytes": summary["rank_param_bytes"], "model_param_bytes": summary["model_param_bytes"],
                      "distributed_type": summary["distributed_type"]}))


if __name__ == "__main__":
    main()

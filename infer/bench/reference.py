"""The engine against Ouro's public HF reference code on the same checkpoint and prompts, side by side.

    python -m infer.bench.reference --ref-python /work/scratch_ref/venv/bin/python \
        --ref-code /work/scratch_ref --out docs/results/reference_cpu.json

The reference (LoopedLMs/ouro_rl's modeling_ouro.py under transformers 4.57.6, in a scratch venv:
infer/bench/hf_ouro_worker.py) generates greedily at full depth in static, left-padded batches of B,
as its users run it; the engine serves the same prompts at max_batch_size B: CB (full depth, so its
tokens must equal the reference's) and CDB with the checkpoint's trained exits. Every run is its own
process with the same thread count, its model loaded and warmed up before the timed pass; the
modes run interleaved, round after round, and each speedup is the median of the per-round ratios
with a 95% bootstrap interval (infer/sim/stats.py). Prints one JSON object: per mode the seconds of
every round, output tokens/s, the exact work (forward launches of the reference; the engine's stage
launches, core steps and mean exit depth), whether the outputs equal the reference's, the ratios.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("hf_ouro_worker.py")
ALPACA = ROOT / "infer" / "sim" / "data" / "alpaca_text.jsonl"  # (200 real Alpaca instructions, in the repository)
# (label, runner, engine settings); the reference runs at the batch of each engine mode it is paired with
MODES = {"cb": dict(policy="cb"), "cdb": dict(policy="cdb")}


def prompts(model: str, n: int, new_tokens: int, path: Path) -> list[list[int]]:
    """The first `n` Alpaca instructions, tokenized by the checkpoint's tokenizer, each cut to leave
    room for `new_tokens` in the model's context."""
    from looplm.io import load_tokenizer, read_config
    tok, cfg = load_tokenizer(Path(model)), read_config(Path(model))
    room = cfg.max_position - new_tokens
    rows = [json.loads(line)["prompt"] for line in path.read_text().splitlines()[:n]]
    return [tok.encode(r)[:room] for r in rows]


def engine_worker(model: str, job: dict) -> dict:
    """One timed engine run (in its own process): warm-up, then every prompt at once."""
    import torch

    from infer.engine.llm import LLM
    from infer.engine.sampling_params import SamplingParams
    torch.set_num_threads(job["threads"])
    llm = LLM(model, max_batch_size=job["batch"], **MODES[job["mode"]])
    ps = job["prompts"]
    llm.generate(ps[:job["batch"]], SamplingParams(max_tokens=2, ignore_eos=True, temperature=0.0), use_tqdm=False)
    eng = llm.engine
    m0 = eng.metrics()
    sp = SamplingParams(max_tokens=job["new_tokens"], ignore_eos=True, temperature=0.0)
    t0 = time.perf_counter()
    outs = llm.generate(ps, sp, use_tqdm=False)
    seconds = time.perf_counter() - t0
    m1 = eng.metrics()
    depths = [d for o in outs for d in o.exit_depths]
    calls = {k: v - m0["stage_calls"].get(k, 0) for k, v in m1["stage_calls"].items()}
    return {"seconds": seconds, "outputs": [list(o.token_ids) for o in outs], "stage_calls": calls,
            "mean_exit_depth": statistics.fmean(depths), "threads": torch.get_num_threads()}


def run(cmd: list[str], job: dict, env: dict) -> dict:
    with tempfile.TemporaryDirectory() as d:
        jp, op = Path(d) / "job.json", Path(d) / "out.json"
        jp.write_text(json.dumps(job))
        subprocess.run(cmd + ["--job", str(jp), "--out", str(op)], check=True, env=env, cwd=ROOT)
        return json.loads(op.read_text())


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(ROOT / "checkpoints" / "ouro-demo"))
    ap.add_argument("--ref-python", required=True, help="the Python of a venv with transformers 4.57.6")
    ap.add_argument("--ref-code", required=True, help="the folder holding the package ouro_ref")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--runs", nargs="+", default=["cb:16", "cb:64", "cdb:64"], metavar="MODE:BATCH")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--job", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        res = engine_worker(a.model, json.loads(Path(a.job).read_text()))
        Path(a.out).write_text(json.dumps(res))
        return res
    from infer.sim.stats import ratio_interval
    runs = [(m, int(b)) for m, b in (r.split(":") for r in a.runs)]
    for m, _ in runs:
        if m not in MODES:
            raise SystemExit(f"--runs: unknown mode {m!r} (one of {sorted(MODES)})")
    ps = prompts(a.model, a.num_prompts, a.new_tokens, ALPACA)
    env = {**os.environ, "OMP_NUM_THREADS": str(a.threads), "HF_HUB_OFFLINE": "1"}
    ref_cmd = [a.ref_python, str(WORKER), "--model", a.model]
    ref_env = {**env, "PYTHONPATH": a.ref_code}  # (the reference's package; its venv has none of ours)
    eng_cmd = [sys.executable, "-m", "infer.bench.reference", "--model", a.model, "--ref-python", a.ref_python,
               "--ref-code", a.ref_code, "--worker"]
    batches = sorted({b for _, b in runs})
    secs: dict[str, list[float]] = {}
    last: dict[str, dict] = {}
    for r in range(a.rounds):  # interleaved: a round's runs share the machine's state
        for b in batches:
            job = {"prompts": ps, "batch": b, "new_tokens": a.new_tokens, "threads": a.threads}
            for label, cmd, extra, e in [(f"ref:{b}", ref_cmd, {}, ref_env)] + [
                    (f"{m}:{bb}", eng_cmd, {"mode": m}, env) for m, bb in runs if bb == b]:
                out = run(cmd, {**job, **extra}, e)
                secs.setdefault(label, []).append(out["seconds"])
                last[label] = out
                print(f"round {r + 1}/{a.rounds} {label}: {out['seconds']:.2f} s", file=sys.stderr)
    tokens = a.num_prompts * a.new_tokens
    res = {"model": a.model, "num_prompts": a.num_prompts, "new_tokens": a.new_tokens, "threads": a.threads,
           "rounds": a.rounds, "prompt_tokens": sum(map(len, ps)),
           "reference": {"torch": last[f"ref:{batches[0]}"]["torch"],
                         "transformers": last[f"ref:{batches[0]}"]["transformers"]}, "runs": {}}
    for label, s in secs.items():
        o = last[label]
        row = {"seconds": s, "output_tokens_per_s": tokens / statistics.median(s)}
        if label.startswith("ref:"):
            b = int(label.split(":")[1])
            row["work"] = {"forward_launches": -(-a.num_prompts // b) * a.new_tokens}
        else:
            ref = last[f"ref:{label.split(':')[1]}"]
            same = sum(x == y for x, y in zip(o["outputs"], ref["outputs"]))
            row["work"] = {"stage_calls": o["stage_calls"], "mean_exit_depth": o["mean_exit_depth"]}
            row["outputs_equal_reference"] = f"{same}/{a.num_prompts}"
            row["vs_reference"] = ratio_interval(secs[f"ref:{label.split(':')[1]}"], s)
        res["runs"][label] = row
    text = json.dumps(res, indent=1)
    print(text)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(text + "\n")
    return res


if __name__ == "__main__":
    main()

"""Which gate to serve: a lab checkpoint's held-out exact match against mean exit depth for each gate,
and the accuracy at matched mean depths (linear interpolation across thresholds), through the engine.

    python -m eval.gates --model checkpoints/lab-hops --seed 7 --n 400 --out outputs/gates/lab-hops.json
    python -m eval.gates --model DIR --text .cache/corpus/heldout.txt --n 64 --out outputs/gates/ouro-demo.json

With `--text`, the score is bits per byte (lower is better) of `--n` consecutive windows of that
text, each teacher-forced through the engine after its first token (every other token is decoded at
its gate's depth: `forced_output`, as lm-eval's loglikelihood_rolling through eval.lm).

Gates: `stock` (the checkpoint's criterion), `stock_late` (the same gate read one step late:
lookahead=True), and, where the checkpoint carries them (train/distill_gate.py), `lookahead_head`
(criterion lookahead_gate) and `preloop`. Each runs every threshold of `--thresholds` (r_min 1) on
the same held-out records (eval.lab.run: greedy, policy cdb, batch 128); `tokens_per_s` is that
run's output tokens over its wall time on this machine (noisy; no interval), beside the exact work
(mean exit depth).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from eval.lab import run
from train.tasks.hops import generate

GATES = {"stock": {}, "stock_late": {"lookahead": True}, "lookahead_head": {"exit_criterion": "lookahead_gate"},
         "preloop": {"exit_criterion": "preloop"}}


def at_depth(points: list[dict], depth: float) -> float | None:
    """Accuracy at a mean exit depth, linearly interpolated between the two nearest points of a
    gate's threshold sweep (None outside the depths it reached)."""
    pts = sorted((p["mean_exit_depth"], p["acc"]) for p in points)
    xs, ys = [x for x, _ in pts], [y for _, y in pts]
    if not xs or depth < xs[0] or depth > xs[-1]:
        return None
    return float(np.interp(depth, xs, ys))


def text_run(llm, windows: list[list[int]], nbytes: int, **overrides) -> dict:
    """Teacher-forced bits per byte of `windows` (the first token of each is the prompt) and the
    decoded tokens' mean exit depth."""
    import math
    import time
    from infer.engine.sampling import SamplingParams
    eng, t0 = llm.engine, time.time()
    seqs = [eng.add_request(w[:1], SamplingParams(**overrides), forced_output=w[1:]) for w in windows]
    while eng.has_unfinished():
        eng.step()
    nats = -sum(sum(s.logprobs) for s in seqs)
    depths = [d for s in seqs for d in s.exit_depths[1:]]
    out = {"acc": nats / math.log(2) / nbytes, "mean_exit_depth": float(np.mean(depths)), "hard_over_easy": None,
           "output_tokens": len(depths) + len(seqs), "seconds": time.time() - t0}
    for s in seqs:
        eng.release(s.request_id)
    return out


def compare(model: str, seed: int, n: int, thresholds: list[float], depths: list[float],
            kv_layout: str | None = None, text: Path | None = None) -> dict:
    from infer.engine.llm import LLM
    from looplm.config import LoopConfig
    cfg = LoopConfig.from_json(Path(model) / "config.json")
    gates = {k: v for k, v in GATES.items() if k not in ("lookahead_head", "preloop") or
             getattr(cfg, "lookahead_gate" if k == "lookahead_head" else "preloop_gate")}
    records = generate(seed, n, 1, 4, 3) if text is None else None
    out = {"model": model, "heldout": {"seed": seed, "n": n} if text is None else {"text": str(text), "windows": n},
           "score": "exact match" if text is None else "bits per byte", "kv_layout": kv_layout, "gates": {}}
    for name, kw in gates.items():
        llm = LLM(model, policy="cdb", max_batch_size=128, dtype="float32", device="cpu", kv_layout=kv_layout, **kw)
        if text is not None and records is None:
            L = llm.engine.max_model_len - 1
            ids = llm.tokenizer(Path(text).read_text()[: 400 * L * n])["input_ids"]
            records = [ids[i * L:(i + 1) * L] for i in range(min(n, len(ids) // L))]
            nbytes = sum(len(llm.tokenizer.decode(w[1:]).encode()) for w in records)
            out["heldout"].update(tokens=sum(len(w) - 1 for w in records), bytes=nbytes)
        pts = []
        for q in thresholds:
            r = (run(llm, records, exit_threshold=q, r_min=1) if text is None else
                 text_run(llm, records, nbytes, exit_threshold=q, r_min=1))
            pts.append({"threshold": q, "acc": r["acc"], "mean_exit_depth": r["mean_exit_depth"],
                        "hard_over_easy": r["hard_over_easy"], "tokens_per_s": r["output_tokens"] / r["seconds"]})
            print(json.dumps({"gate": name, **pts[-1]}), flush=True)
        out["gates"][name] = pts
    out["matched"] = {str(d): {g: at_depth(p, d) for g, p in out["gates"].items()} for d in depths}
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--n", type=int, default=400)
    p.add_argument("--thresholds", type=float, nargs="+", default=[0.1, 0.3, 0.5, 0.7, 0.8, 0.9, 0.97])
    p.add_argument("--depths", type=float, nargs="+", default=[2.0, 2.25, 2.5, 2.75, 3.0],
                   help="mean exit depths to compare the gates at")
    p.add_argument("--kv-layout", default=None)
    p.add_argument("--text", type=Path, default=None, help="score bits per byte on this text instead of the lab task")
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args(argv)
    res = compare(a.model, a.seed, a.n, a.thresholds, a.depths, a.kv_layout, a.text)
    print(json.dumps(res["matched"], indent=1))
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(res, indent=2) + "\n")


if __name__ == "__main__":
    main()

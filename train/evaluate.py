"""Held-out evaluation of a looped-LM folder; prints JSON.

    python train/evaluate.py --model checkpoints/ouro-demo [--out eval.json]

Teacher-forced over held-out text in windows of --ctx tokens:
- `ppl_per_depth`: every token runs d loops (d = 1..r_max);
- `default`: exit by the folder's criterion/threshold (looplm/policy.py semantics: first step whose
  signal fires, r_min honoured), each token scored with the logits of its exit step, as Ouro's
  reference computes it (all steps run, exit picked afterwards); depth histogram and mean depth;
- `criteria`: the same for the other criteria the model supports (kl, latent_diff, thresholds);
- `threshold_sweep`: standard vs lookahead gate at matched thresholds (and at --r-min);
- `layouts`: the engine's KV layouts (last_exited = depth-indexed, shared) emulated exactly
  (train/kv_emulation.py, sweeps to the fixed point) on the first --layout-windows windows, with the
  first token of each window as a full-depth prompt.
"""
from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np
import torch

from looplm.io import load_pretrained
from looplm.policy import DEFAULT_THRESHOLDS, ExitPolicy
from train.common import TOKENIZER, collect_outputs, eval_windows, load_tokens, ppl_per_depth, summarize_exit, token_ce
from train.kv_emulation import converge


def layout_eval(model, windows: torch.Tensor, policy: ExitPolicy, layout: str, batch: int, prompt_len: int = 1,
                max_sweeps: int = 24) -> dict:
    ce, depth, sweeps, change = [], [], [], 0.0
    for i in range(0, len(windows), batch):
        w = windows[i:i + batch]
        sw, n, ch = converge(model, w[:, :-1], policy, layout, prompt_len, max_sweeps=max_sweeps, tol=1e-4)
        ce.append(token_ce(sw.exit_logits, w[:, 1:])[:, prompt_len:].flatten())
        depth.append(sw.depths[:, prompt_len:].flatten())
        sweeps.append(n)
        change = max(change, ch)
    d = torch.cat(depth)
    hist = torch.bincount(d, minlength=policy.r_max + 1)[1:].double()
    return {"ppl": math.exp(torch.cat(ce).mean().item()), "mean_depth": d.double().mean().item(),
            "depth_hist": [round(x, 4) for x in (hist / hist.sum()).tolist()],
            "max_sweeps_used": max(sweeps), "last_change": change}


def thresholds_for(criterion: str) -> list[float]:
    if criterion in ("learned", "ouro_gate"):
        return [round(x, 2) for x in np.arange(0.3, 0.96, 0.05)]
    base = DEFAULT_THRESHOLDS.get(criterion, 1e-3)
    return [base * f for f in (0.1, 0.3, 1, 3, 10, 30)]


def evaluate(model, windows: torch.Tensor, synth: torch.Tensor | None, a) -> dict:
    cfg = model.cfg
    t0 = time.time()
    out = collect_outputs(model, windows, cfg.r_max, batch=a.batch)
    full = summarize_exit(out, ExitPolicy("none", None, cfg.r_max, cfg.r_max))
    res = {"model": str(a.model), "arch": cfg.name, "tokens": int(out["ce"][0].numel()), "ctx": a.ctx,
           "ppl_per_depth": ppl_per_depth(out), "full_depth_ppl": full["ppl"]}
    if synth is not None and len(synth):
        res["synthetic_ppl_per_depth"] = ppl_per_depth(collect_outputs(model, synth, cfg.r_max, batch=a.batch,
                                                                       need_kl=False))
    res["looping_gain"] = 1 - res["ppl_per_depth"][-1] / res["ppl_per_depth"][0]
    # a folder fine-tuned with shared_kv.py --lookahead records that its gate signals one step ahead
    default = ExitPolicy.from_config(cfg, lookahead=bool(cfg.extra.get("exit_lookahead", False)))
    if default.adaptive:
        d = summarize_exit(out, default)
        d["rel_ppl_vs_full"] = d["ppl"] / full["ppl"] - 1
        d["depths_over_10pct"] = sum(x >= 0.10 for x in d["depth_hist"])
        d["mean_depth_over_r_max"] = d["mean_depth"] / cfg.r_max
        res["default"] = d
    crits = (["learned"] if cfg.exit_gate else []) + ["kl", "latent_diff"]
    res["criteria"] = {}
    for c in crits:
        if c == cfg.exit_criterion:
            thr = cfg.exit_threshold
        elif c == "learned":
            thr = a.gate_threshold  # the folder's default is another criterion: the gate needs its own q
        else:
            thr = DEFAULT_THRESHOLDS.get(c)
        r = summarize_exit(out, ExitPolicy(c, thr, 1, cfg.r_max))
        r["rel_ppl_vs_full"] = r["ppl"] / full["ppl"] - 1
        res["criteria"][c] = r
    if cfg.exit_gate:
        sweep = []
        for q in thresholds_for("learned"):
            row = {"threshold": q}
            for name, la, rmin in (("standard", False, 1), ("lookahead", True, 1),
                                   (f"standard_rmin{a.r_min}", False, a.r_min), (f"lookahead_rmin{a.r_min}", True, a.r_min)):
                if rmin == 1 and name.endswith(f"rmin{a.r_min}"):
                    continue
                r = summarize_exit(out, ExitPolicy("learned", q, rmin, cfg.r_max, la))
                row[name] = {"ppl": round(r["ppl"], 3), "mean_depth": round(r["mean_depth"], 3),
                             "rel_ppl_vs_full": round(r["ppl"] / full["ppl"] - 1, 4), "depth_hist": r["depth_hist"]}
            sweep.append(row)
        res["threshold_sweep"] = sweep
    if a.layout_windows and default.adaptive:
        lw = windows[: a.layout_windows]
        pol = ExitPolicy.from_config(cfg, lookahead=a.lookahead or default.lookahead)
        res["layouts"] = {"windows": len(lw), "policy": vars_of(pol)}
        for lay in ("full_depth", "last_exited", "shared"):
            res["layouts"][lay] = layout_eval(model, lw, pol, lay, a.batch)
        res["layouts"]["shared_vs_last_exited"] = res["layouts"]["shared"]["ppl"] / res["layouts"]["last_exited"]["ppl"] - 1
    res["eval_seconds"] = round(time.time() - t0, 1)
    return res


def vars_of(p: ExitPolicy) -> dict:
    return {"criterion": p.criterion, "threshold": p.threshold, "r_min": p.r_min, "r_max": p.r_max,
            "lookahead": p.lookahead}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--tokenizer", type=Path, default=None, help="default: the model folder's")
    p.add_argument("--ctx", type=int, default=128)
    p.add_argument("--max-windows", type=int, default=None, help="default: all held-out text")
    p.add_argument("--layout-windows", type=int, default=32, help="0 skips the layout emulation")
    p.add_argument("--lookahead", action="store_true", help="layouts: evaluate with the lookahead policy")
    p.add_argument("--r-min", type=int, default=2, help="threshold sweep: the extra r_min column")
    p.add_argument("--gate-threshold", type=float, default=0.5,
                   help="learned-gate threshold for the criteria table when the folder's default criterion is another")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    model = load_pretrained(a.model, dtype="float32")
    tok = a.tokenizer or (a.model if (a.model / "tokenizer.json").exists() else TOKENIZER)
    windows = eval_windows(load_tokens("heldout", tok), a.ctx, a.max_windows)
    synth = eval_windows(load_tokens("heldout_synthetic", tok), a.ctx)
    res = evaluate(model, windows, synth, a)
    text = json.dumps(res, indent=1)
    if a.out is not None:
        a.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    from train.cli import run
    run(main)

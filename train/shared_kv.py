"""Fine-tune a looped LM for the shared KV layout and for a lookahead / r_min exit gate.

    accelerate launch train/shared_kv.py --model checkpoints/ouro-demo --output .cache/runs/ouro-shared
    python train/shared_kv.py ...                                  (one process, same arguments)

(a) Shared KV layout: at loop step s a decode position attends to earlier positions' exit-depth
K/V and to its own step-s K/V. Training-time attention (train/kv_emulation.py): pass 1 (no grad,
`--pass1-sweeps` parallel sweeps, the first an ordinary causal loop) records every position's exit
depth and its K/V at that depth per core layer; pass 2 (with grad) runs the loop where each core
attention takes keys/values j < p from pass 1 (detached) and j = p fresh. Approximation: pass 1's
context is one sweep short of the sequential fixed point and carries no gradient; at the fixed
point the two passes equal the inference semantics exactly (tests/test_train.py).
Loss: CE of the logits at each position's exit depth + `--step-loss` x mean CE over all steps.

(b) Exit gate: BCE against "CE at the exit depth minus CE at full depth < --gate-margin", where the
exit depth of the signal after step s is s (standard) or s+1 (`--lookahead`); steps whose depth is
below `--r-min` are masked. With `--target-mean-depth` the threshold is chosen at the end.

Checkpoints (accelerate `save_state`) go to OUTPUT/checkpoints every `--save-every` steps; a
re-launch resumes from the latest. The final model is an HF folder in OUTPUT.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from looplm.config import replace
from looplm.io import load_pretrained, load_tokenizer, save_pretrained
from looplm.policy import ExitPolicy
from train.common import TOKENIZER, History, eval_windows, init_wandb, random_windows, token_ce
from train.kv_emulation import LAYOUTS, Sweep, sweep


def gate_logits_detached(model, state: torch.Tensor) -> torch.Tensor:
    """Gate scores whose gradient reaches only the gate head (Huginn's gate reads ln_f, an LM weight)."""
    if hasattr(model, "exit_gate") and hasattr(model, "transformer"):
        with torch.no_grad():
            x = model.transformer.ln_f(state)
        return model.exit_gate(x).squeeze(-1)
    return model.gate_logits(state.detach())


class SharedKVObjective(nn.Module):
    """Wraps the model so DDP/FSDP see one forward: mode "pass1" returns the no-grad sweeps,
    mode "pass2" the losses."""

    def __init__(self, model, a: argparse.Namespace, policy: ExitPolicy):
        super().__init__()
        self.model, self.a, self.policy = model, a, policy

    def forward(self, batch: torch.Tensor, prev: Sweep | None = None, mode: str = "pass2"):
        a, m, pol = self.a, self.model, self.policy
        ids, tgt = batch[:, :-1], batch[:, 1:]
        if mode == "pass1":
            with torch.no_grad():
                cur = None
                for _ in range(a.pass1_sweeps):
                    cur = sweep(m, ids, pol, a.layout, cur, a.prompt_len)
            return cur
        sw = sweep(m, ids, pol, a.layout, prev, a.prompt_len, step_logits=True)
        ce_exit = token_ce(sw.exit_logits, tgt)
        ce_steps = torch.stack([token_ce(lg, tgt) for lg in sw.step_logits])  # [S, B, T]
        lm = ce_exit.mean() + a.step_loss * ce_steps.mean()
        out = {"lm": lm, "ce_exit": ce_exit.mean().detach(), "ce_full": ce_steps[-1].mean().detach(),
               "mean_depth": sw.depths[:, a.prompt_len:].double().mean()}
        if a.train in ("all", "gate") and m.gate_logits(sw.states[0][:1, :1]) is not None:
            S = len(sw.states)
            g = torch.stack([gate_logits_detached(m, s) for s in sw.states[:-1]])  # [S-1, B, T]
            shift = 1 if a.lookahead else 0
            c = ce_steps.detach()
            depth_ce = torch.cat([c[shift:], c[-1:].expand(shift, *c.shape[1:])])[:-1]  # CE at the depth signalled
            labels = (depth_ce - c[-1:] < a.gate_margin).double()
            depth = torch.arange(1, S, device=g.device)[:, None, None] + shift
            mask = ((depth >= a.r_min) & (depth < S)).expand_as(g).clone()
            mask[:, :, : a.prompt_len] = False
            bce = F.binary_cross_entropy_with_logits(g.double(), labels, reduction="none")
            out["gate"] = (bce * mask).sum() / mask.sum().clamp(min=1)
            out["stop_frac"] = (labels * mask).sum() / mask.sum().clamp(min=1)
        else:
            out["gate"] = torch.zeros((), dtype=torch.float64)
        out["loss"] = (lm if a.train in ("all", "lm") else 0.0) + out["gate"].float()
        return out


def policy_for(cfg, a: argparse.Namespace, threshold: float | None = None) -> ExitPolicy:
    return ExitPolicy.from_config(cfg, criterion=a.criterion, threshold=threshold if threshold is not None else a.threshold,
                                  r_min=a.r_min, lookahead=a.lookahead)


@torch.no_grad()
def quick_eval(model, windows: torch.Tensor, a, policy: ExitPolicy, layout: str) -> dict:
    """Held-out ppl / mean depth under `layout` after `--eval-sweeps` sweeps (evaluate.py is exact)."""
    ce, depth = [], []
    for i in range(0, len(windows), a.batch):
        w = windows[i:i + a.batch].to(model.device)
        cur = None
        for _ in range(a.eval_sweeps if layout != "full_depth" else 1):
            cur = sweep(model, w[:, :-1], policy, layout, cur, a.prompt_len)
        ce.append(token_ce(cur.exit_logits, w[:, 1:])[:, a.prompt_len:].flatten())
        depth.append(cur.depths[:, a.prompt_len:].flatten().double())
    return {"ppl": float(torch.cat(ce).mean().exp()), "mean_depth": float(torch.cat(depth).mean())}


def choose_threshold(model, windows, a) -> tuple[float, list[dict]]:
    grid = []
    for q in [round(x, 2) for x in np.arange(0.05, 0.99, 0.05)]:
        r = quick_eval(model, windows, a, policy_for(model.cfg, a, q), a.layout)
        grid.append({"threshold": q, **r})
    best = min(grid, key=lambda r: abs(r["mean_depth"] - a.target_mean_depth))
    return best["threshold"], grid


def fingerprint(model) -> str:
    h = hashlib.sha256()
    for k, v in sorted(model.state_dict().items()):
        h.update(k.encode())
        h.update(v.detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def latest_ckpt(out: Path) -> Path | None:
    cks = [c for c in (out / "checkpoints").glob("step_*") if (c / "meta.json").exists()]
    return max(cks, key=lambda c: int(c.name.split("_")[1])) if cks else None


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", type=Path, required=True, help="HF-format looped-LM folder")
    p.add_argument("--output", type=Path, required=True)
    p.add_argument("--layout", choices=LAYOUTS, default="shared")
    p.add_argument("--train", choices=["all", "lm", "gate"], default="all")
    p.add_argument("--criterion", default=None, help="exit criterion (default: the model's)")
    p.add_argument("--threshold", type=float, default=None, help="exit threshold (default: the model's)")
    p.add_argument("--r-min", type=int, default=1)
    p.add_argument("--lookahead", action="store_true", help="gate signal after step s = exit after s+1")
    p.add_argument("--target-mean-depth", type=float, default=None, help="choose the threshold for this")
    p.add_argument("--gate-margin", type=float, default=0.1)
    p.add_argument("--step-loss", type=float, default=0.5, help="weight of the mean CE over all steps")
    p.add_argument("--pass1-sweeps", type=int, default=2)
    p.add_argument("--prompt-len", type=int, default=1, help="positions run as a full-depth prompt")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=8, help="per process")
    p.add_argument("--ctx", type=int, default=128)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--gate-lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--wd", type=float, default=0.0)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--tokens", type=Path, help=".npy token ids to train on (default: the built corpus)")
    p.add_argument("--heldout-tokens", type=Path, help=".npy held-out token ids")
    p.add_argument("--tokenizer", type=Path, default=None, help="default: the model folder's, else .cache/tokenizer")
    p.add_argument("--eval-windows", type=int, default=16)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--eval-sweeps", type=int, default=4)
    p.add_argument("--save-every", type=int, default=50)
    p.add_argument("--keep", type=int, default=2)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--max-steps-this-run", type=int, default=None, help="stop early (tests an interruption)")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32", help="weights dtype while training")
    p.add_argument("--save-dtype", default="float32")
    p.add_argument("--no-wandb", action="store_true")
    return p.parse_args(argv)


def load_data(a) -> tuple[np.ndarray, np.ndarray]:
    if a.tokens is not None:
        train = np.load(a.tokens).astype(np.int64)
        held = np.load(a.heldout_tokens).astype(np.int64) if a.heldout_tokens else train[-len(train) // 10:]
        return train, held
    from train.common import load_tokens
    tok = a.tokenizer or (a.model if (a.model / "tokenizer.json").exists() else TOKENIZER)
    return load_tokens("train", tok), load_tokens("heldout", tok)


def main(argv=None) -> None:
    a = parse(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    from accelerate import Accelerator
    acc = Accelerator(cpu=not torch.cuda.is_available())
    a.output.mkdir(parents=True, exist_ok=True)
    model = load_pretrained(a.model, dtype=a.dtype, device=acc.device)
    if a.criterion is None and model.cfg.exit_criterion == "ouro_gate" and a.train != "lm":
        a.criterion = "learned"  # the BCE gate is a per-step "stop now" head, not Ouro's CDF
    policy = policy_for(model.cfg, a)
    if not policy.adaptive:
        raise SystemExit(f"criterion {policy.criterion!r} with threshold {policy.threshold} never exits; "
                         "pass --criterion/--threshold")
    train_tok, held = load_data(a)
    val = eval_windows(held, a.ctx, a.eval_windows)
    gate_names = {n for n, _ in model.named_parameters() if "exit_gate" in n}
    for n, p in model.named_parameters():
        p.requires_grad_(a.train == "all" or (a.train == "gate") == (n in gate_names))
    lm_p = [p for n, p in model.named_parameters() if p.requires_grad and n not in gate_names]
    gate_p = [p for n, p in model.named_parameters() if p.requires_grad and n in gate_names]
    groups = [g for g in ({"params": lm_p, "lr": a.lr, "weight_decay": a.wd},
                          {"params": gate_p, "lr": a.gate_lr, "weight_decay": 0.0}) if g["params"]]
    opt = torch.optim.AdamW(groups, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / a.warmup) * max(0.1, 1.0 - s / max(1, a.steps)))
    obj, opt, sched = acc.prepare(SharedKVObjective(model, a, policy), opt, sched)
    hist = History(a.output / "history.json")
    wb = init_wandb(a.output, "looplm-shared-kv", vars(a) | {"world_size": acc.num_processes},
                    enabled=not a.no_wandb and acc.is_main_process)
    step = 0
    ck = latest_ckpt(a.output)
    if ck is not None:
        acc.load_state(str(ck))
        step = json.loads((ck / "meta.json").read_text())["step"]
        hist.truncate(step)
        acc.print(f"resumed from {ck} at step {step}")
    elif acc.is_main_process and a.eval_windows:
        rec = {"step": 0, **{f"{lay}_{k}": v for lay in (a.layout, "last_exited")
                             for k, v in quick_eval(model, val, a, policy, lay).items()}}
        hist.log(rec)
        acc.print(json.dumps(rec))
    t0, ran, logs = time.time(), 0, []
    while step < a.steps and (a.max_steps_this_run is None or ran < a.max_steps_this_run):
        batch = random_windows(train_tok, a.batch, a.ctx, [a.seed, step, acc.process_index]).to(acc.device)
        obj.train()
        prev = obj(batch, mode="pass1")
        out = obj(batch, prev, mode="pass2")
        opt.zero_grad(set_to_none=True)
        acc.backward(out["loss"])
        acc.clip_grad_norm_([p for g in opt.param_groups for p in g["params"]], a.clip)
        opt.step()
        sched.step()
        step, ran = step + 1, ran + 1
        logs.append({k: float(v.detach()) if torch.is_tensor(v) else float(v) for k, v in out.items()})
        if step % a.log_every == 0 or step == a.steps:
            rec = {"step": step, **{k: float(np.mean([x[k] for x in logs])) for k in logs[0]},
                   "time_s": round(time.time() - t0, 1)}
            logs = []
            if a.eval_every and (step % a.eval_every == 0 or step == a.steps) and acc.is_main_process:
                m = acc.unwrap_model(obj).model
                m.eval()
                rec.update({f"{lay}_{k}": v for lay in (a.layout, "last_exited")
                            for k, v in quick_eval(m, val, a, policy, lay).items()})
            if acc.is_main_process:
                hist.log(rec)
                if wb is not None:
                    wb.log(rec, step=step)
            acc.print(json.dumps(rec))
        if step % a.save_every == 0 or step == a.steps:
            d = a.output / "checkpoints" / f"step_{step:06d}"
            acc.save_state(str(d))
            if acc.is_main_process:
                (d / "meta.json").write_text(json.dumps({"step": step}))
                cks = sorted((a.output / "checkpoints").glob("step_*"), key=lambda c: int(c.name.split("_")[1]))
                for old in cks[:-a.keep]:
                    shutil.rmtree(old, ignore_errors=True)
            acc.wait_for_everyone()
    if step < a.steps:
        acc.print(f"stopped at step {step} of {a.steps} (--max-steps-this-run); re-launch to resume")
        return
    model = acc.unwrap_model(obj).model.eval()
    prints = acc.gather_for_metrics([fingerprint(model)], use_gather_object=True)
    if not acc.is_main_process:
        return
    cfg_kw = {"r_min": a.r_min, "exit_criterion": policy.criterion, "exit_threshold": policy.threshold}
    summary = {"steps": step, "rank_fingerprints": prints, "layout": a.layout, "lookahead": a.lookahead}
    if a.target_mean_depth is not None:
        q, grid = choose_threshold(model, val, a)
        cfg_kw["exit_threshold"] = q
        summary.update(threshold_grid=grid, chosen_threshold=q)
    model.cfg = replace(model.cfg, **cfg_kw, extra={**model.cfg.extra, "exit_lookahead": a.lookahead,
                                                   "kv_layout": a.layout})
    save_pretrained(model, a.output, dtype=a.save_dtype, tokenizer=load_tokenizer(a.model))
    (a.output / "summary.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps({k: v for k, v in summary.items() if k != "threshold_grid"}))
    if wb is not None:
        wb.finish()


if __name__ == "__main__":
    main()

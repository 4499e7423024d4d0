"""Distil a lookahead head and / or a preloop gate from a checkpoint's frozen stock exit gate.

    accelerate launch train/distill_gate.py --model checkpoints/ouro-demo
    python train/distill_gate.py --model checkpoints/ouro-demo --output .cache/runs/ouro-gates --gates lookahead

The whole model is frozen; only the new heads train (what the CDB paper's authors do for Ouro).
The teacher is the stock gate of the checkpoint's criterion (`ouro_gate`: Ouro's hazard gate, or our
`learned` per-step gate); its sigmoids at loop steps 1..R are read as exit hazards lambda_s, so the
teacher's exit-depth distribution is pdf_s = lambda_s prod_{j<s} (1 - lambda_j) (pdf_R: the rest).
Features come from one full-depth causal pass per batch (no grad), depth-major as the engine's
prefill: the loop state after every step and the prelude's output.
- lookahead head (Linear(d -> 1) on the stock gate's input, initialised from the stock gate): its
  logit at step s predicts the teacher's hazard at step s+1. Loss = BCE(sigmoid(student at h_s),
  lambda_{s+1}) for s = 1..R-2 + mean |CDF_student - CDF_teacher| where the student's pdf starts at
  depth 2 and the teacher's mass at depth 1 is folded onto depth 2 (a lookahead exit is >= 2).
  Served by the engine's `lookahead_gate` criterion: the score after step s, in the teacher's rule
  (ouro_gate: the CDF of the student's hazards; learned: the probability), decides "exit after s+1".
  `--objective oracle` trains the same head on what serving is scored on instead of on the teacher:
  target 1 at step s when the coda's next-token loss at depth s+1 is within `--epsilon` nats of the
  loss at depth R (exiting after s+1 costs at most epsilon), BCE only, no CDF term; it is served
  in the teacher's rule as above (ouro_gate: these probabilities read as hazards, their CDF). On
  ouro-demo the teacher objective plateaus a little worse in bits/byte than the stock gate read
  late at matched depth: imitating the teacher at s+1 copies its same-step decisions, which lose
  there (docs/results/lab-and-gates.md, issue 25).
- preloop gate (Linear(d -> R) on the prelude output; Ouro: the token embedding): softmax = the
  exit-depth pdf before the loop. Loss = KL(teacher pdf || student) + CDF MAE. Served by the
  `preloop` criterion: depth = the first d whose CDF >= q, clamped to [r_min, r_max].
A learned-gate teacher is a per-step probability, not a hazard; reading it as one is what lets a
pdf be distilled (its serving rule stays its own: compare gates at matched mean depth).

The heads go to OUTPUT/exit_gates.safetensors with `lookahead_gate` / `preloop_gate` /
`gate_teacher` in OUTPUT/config.json (OUTPUT defaults to --model: the checkpoint's own tensors are
not rewritten; another OUTPUT gets a copy of the folder first). The held-out agreement between
teacher and student depths (exact agreement, mean |depth difference|, mean depths) at each
`--thresholds` value is printed and written to OUTPUT/distill_gate.json, beside the same figures
for the stock gate read one step late (today's `lookahead=True`).
"""
from __future__ import annotations

import argparse
import json
import math
import shutil
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from looplm.cli import UserError
from looplm.config import GATE_CRITERIA, replace
from looplm.io import load_pretrained, save_gates
from looplm.model import plain_attend_for
from looplm.policy import ExitPolicy, ExitTracker
from train import cli
from train.common import TOKENIZER
from train.shared_kv import check_model_arg, load_data

GATES = {"both": ("lookahead", "preloop"), "lookahead": ("lookahead",), "preloop": ("preloop",)}


# ---------------------------------------------------------------- teacher and features
@torch.no_grad()
def features(model, ids: torch.Tensor, targets: torch.Tensor | None = None):
    """One full-depth causal pass over `ids` [B, T]: the stock gate's input after every step
    [R, B, T, d], the teacher's hazards [B, T, R], the prelude output [B, T, d] and, with `targets`
    [B, T] (the next tokens), the coda's next-token loss in nats after every step [B, T, R] (else None)."""
    R = model.cfg.r_max
    rope = model.rope(torch.arange(ids.shape[1], device=ids.device))
    state, inj = model.prelude(ids, rope, plain_attend_for)
    pre = inj if inj is not None else state
    feats, logits, nll = [], [], []
    gate = model.stock_gate()
    for _ in range(R):
        state = model.core_step(state, inj, rope, plain_attend_for)
        f = model.gate_features(state)
        feats.append(f.float())
        logits.append(gate(f).squeeze(-1).float())
        if targets is not None:
            out = model.head(model.coda(state, rope, plain_attend_for)).float()
            nll.append(F.cross_entropy(out.transpose(1, 2), targets, reduction="none"))
    return (torch.stack(feats), torch.sigmoid(torch.stack(logits, -1)), pre.float(),
            torch.stack(nll, -1) if targets is not None else None)


def pdf_from_hazards(h: torch.Tensor, first: int = 0, total: int | None = None) -> torch.Tensor:
    """Exit-depth pdf [..., total] from hazards [..., n] placed at depth indices first..first+n-1
    (0-based); the last depth takes the surviving mass, depths before `first` get none."""
    total = total or first + h.shape[-1]
    pdf = h.new_zeros(*h.shape[:-1], total)
    surv = torch.ones_like(h[..., 0])
    for k in range(h.shape[-1]):
        i = first + k
        if i >= total - 1:
            break
        pdf[..., i] = h[..., k] * surv
        surv = surv * (1 - h[..., k])
    pdf[..., -1] = surv
    return pdf


def fold(pdf: torch.Tensor, min_depth: int) -> torch.Tensor:
    """Move the mass of depths below `min_depth` onto it."""
    k = min_depth - 1
    if k <= 0:
        return pdf
    out = pdf.clone()
    out[..., k] += out[..., :k].sum(-1)
    out[..., :k] = 0
    return out


def masked_mean(x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    if mask is None:
        return x.mean()
    m = mask.to(x.dtype)
    while m.dim() < x.dim():
        m = m.unsqueeze(-1)
    m = m.expand_as(x)
    return (x * m).sum() / m.sum().clamp_min(1)


def lookahead_loss(head: nn.Linear, feats: torch.Tensor, hazards: torch.Tensor, mask) -> dict:
    R = hazards.shape[-1]
    z = head(feats[:R - 2]).squeeze(-1).permute(1, 2, 0)  # [B, T, R-2]: student at steps 1..R-2
    target = hazards[..., 1:R - 1]  # the teacher's hazards at steps 2..R-1
    bce = masked_mean(F.binary_cross_entropy_with_logits(z, target, reduction="none"), mask)
    student = pdf_from_hazards(torch.sigmoid(z), first=1, total=R)
    teacher = fold(pdf_from_hazards(hazards), 2)
    cdf = masked_mean((student.cumsum(-1) - teacher.cumsum(-1)).abs().mean(-1), mask)
    return {"loss": bce + cdf, "bce": bce, "cdf_mae": cdf}


def oracle_targets(nll: torch.Tensor, epsilon: float) -> torch.Tensor:
    """[..., R-2] targets of the lookahead head from per-step next-token losses [..., R]: 1 at step s
    (s = 1..R-2) where exiting after s+1 costs at most `epsilon` nats against full depth R."""
    R = nll.shape[-1]
    return (nll[..., 1:R - 1] - nll[..., R - 1:] <= epsilon).to(nll.dtype)


def oracle_loss(head: nn.Linear, feats: torch.Tensor, nll: torch.Tensor, mask, epsilon: float) -> dict:
    """`--objective oracle`: BCE(student logit at h_s, oracle_targets at s); `exit_frac` is the mean
    target (how often one step past s is already good enough)."""
    R = nll.shape[-1]
    z = head(feats[:R - 2]).squeeze(-1).permute(1, 2, 0)  # [B, T, R-2]: student at steps 1..R-2
    target = oracle_targets(nll, epsilon)
    bce = masked_mean(F.binary_cross_entropy_with_logits(z, target, reduction="none"), mask)
    return {"loss": bce, "bce": bce, "exit_frac": masked_mean(target, mask)}


def preloop_loss(head: nn.Linear, pre: torch.Tensor, hazards: torch.Tensor, mask) -> dict:
    logp = F.log_softmax(head(pre), -1)
    teacher = pdf_from_hazards(hazards)
    kl = masked_mean((teacher * (teacher.clamp_min(1e-12).log() - logp)).sum(-1), mask)
    cdf = masked_mean((logp.exp().cumsum(-1) - teacher.cumsum(-1)).abs().mean(-1), mask)
    return {"loss": kl + cdf, "kl": kl, "cdf_mae": cdf}


# ---------------------------------------------------------------- agreement
def depth_of(policy: ExitPolicy, scores: list[float]) -> int:
    """The engine's exit depth for one token's per-step scores (the ExitTracker's rule)."""
    t = ExitTracker(policy)
    for s, x in enumerate(scores, 1):
        if t.after_step(s, x):
            return s
    return policy.r_max


def step_scores_of(rule: str, hazards: torch.Tensor) -> torch.Tensor:
    """Per-step scores [N, n] a gate criterion reads from hazards [N, n]: ouro_gate the CDF, learned
    the probability itself (looplm/exits.py)."""
    return 1 - torch.cumprod(1 - hazards, -1) if rule == "ouro_gate" else hazards


@torch.no_grad()
def agreement(model, teacher: str, heads: dict, windows: torch.Tensor, mask, thresholds: list[float]) -> dict:
    """Teacher vs student exit depths on held-out windows, per threshold."""
    R = model.cfg.r_max
    feats, hazards, pre, nll = features(model, windows[:, :-1], windows[:, 1:])
    keep = (mask[:, 1:] if mask is not None else torch.ones_like(windows[:, 1:], dtype=torch.bool)).reshape(-1)
    hz = hazards.reshape(-1, R)[keep]
    nll = nll.reshape(-1, R)[keep].tolist()
    teach = step_scores_of(teacher, hz).tolist()
    late = teach  # the stock gate read one step late: the same scores, lookahead=True
    out = {"tokens": len(teach)}
    if "lookahead" in heads:
        z = heads["lookahead"](feats).squeeze(-1).permute(1, 2, 0).reshape(-1, R)[keep]
        stud = step_scores_of(teacher, torch.sigmoid(z.double())).tolist()
    if "preloop" in heads:
        cdf = torch.softmax(heads["preloop"](pre).double(), -1).cumsum(-1).reshape(-1, R)[keep].tolist()
    rows = []
    for q in thresholds:
        pol = ExitPolicy(teacher, q, 1, R)
        td = [depth_of(pol, x) for x in teach]
        row = {"threshold": q, "teacher_mean_depth": sum(td) / len(td)}
        folded = [max(2, d) for d in td]  # what a lookahead signal can reach (depth >= 2)
        cands = {"stock_late": [depth_of(ExitPolicy(teacher, q, 1, R, lookahead=True), x) for x in late]}
        if "lookahead" in heads:
            cands["lookahead_head"] = [depth_of(ExitPolicy("lookahead_gate", q, 1, R), x) for x in stud]
        if "preloop" in heads:
            cands["preloop"] = []
            for c in cdf:
                t = ExitTracker(ExitPolicy("preloop", q, 1, R))
                t.at_prelude(c)
                cands["preloop"].append(t.stop_at)
        for name, d in cands.items():
            ref = td if name == "preloop" else folded  # lookahead signals: vs the teacher folded to >= 2
            row[name] = {"agreement": sum(a == b for a, b in zip(d, ref)) / len(d),
                         "mean_abs_diff": sum(abs(a - b) for a, b in zip(d, ref)) / len(d),
                         "mean_depth": sum(d) / len(d),
                         # the next-token loss at the exit depth (teacher-forced, full-depth features)
                         "mean_nll": sum(x[k - 1] for x, k in zip(nll, d)) / len(d)}
        rows.append(row)
    out["thresholds"] = rows
    return out


# ---------------------------------------------------------------- run
def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", type=Path, required=True, help="HF-format looped-LM folder with a stock exit gate")
    p.add_argument("--output", type=Path, default=None, help="default: --model (the heads are added to it)")
    p.add_argument("--gates", choices=sorted(GATES), default="both")
    p.add_argument("--objective", choices=("teacher", "oracle"), default="teacher",
                   help="the lookahead head's loss: teacher = BCE to the stock gate's hazard at step s+1 + exit-CDF "
                        "MAE (the authors'); oracle = BCE to 1 where the coda's next-token loss at depth s+1 is "
                        "within --epsilon nats of the loss at full depth (what serving is scored on, not the "
                        "teacher; no CDF term). The preloop gate is distilled from the teacher either way")
    p.add_argument("--epsilon", type=float, default=0.1,
                   help="--objective oracle: nats of next-token loss an exit after step s+1 may cost against full "
                        "depth and still count as 'exit' (larger: more early exits at a given threshold)")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--batch", type=int, default=8, help="windows per step and process")
    p.add_argument("--ctx", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--min-lr-ratio", type=float, default=0.05, help="the cosine schedule's floor")
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--thresholds", type=float, nargs="+", default=None,
                   help="agreement thresholds (default: 0.3 0.5 0.7 and the checkpoint's)")
    p.add_argument("--eval-windows", type=int, default=32)
    p.add_argument("--dataset", default=None, help="a datasets source (see train/datasource.py)")
    p.add_argument("--text-column", default="text")
    p.add_argument("--heldout-frac", type=float, default=0.1)
    p.add_argument("--tokens", type=Path, help=".npy token ids (default: the built corpus)")
    p.add_argument("--heldout-tokens", type=Path)
    p.add_argument("--loss-mask", type=Path, help=".npy aligned with --tokens: nonzero where a token counts")
    p.add_argument("--heldout-loss-mask", type=Path)
    p.add_argument("--tokenizer", type=Path, default=None)
    p.add_argument("--log-every", type=int, default=100)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--debug", action="store_true", help="tracebacks instead of one-line errors")
    return p.parse_args(argv)


def lr_scale(step: int, a) -> float:
    """Linear warm-up, then cosine to --min-lr-ratio (the authors' schedule)."""
    if step < a.warmup:
        return (step + 1) / a.warmup
    prog = min(1.0, (step - a.warmup) / max(1, a.steps - a.warmup))
    return a.min_lr_ratio + (1 - a.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * prog))


def main(argv=None) -> None:
    a = parse(argv)
    check_model_arg(a.model)
    cli.die_with_launcher()
    if a.threads:
        torch.set_num_threads(a.threads)
    from accelerate import Accelerator
    acc = Accelerator(cpu=not torch.cuda.is_available())
    cli.check_launch(acc, "train/distill_gate.py")
    cli.banner(acc, "train/distill_gate.py", f"gates={a.gates}")
    model = load_pretrained(a.model, dtype="float32", device=acc.device)
    cfg = model.cfg
    teacher = cfg.exit_criterion if cfg.exit_criterion in GATE_CRITERIA else "ouro_gate" if cfg.arch == "ouro" else None
    if teacher is None or model.stock_gate() is None:
        raise UserError(f"--model {a.model}: {cfg.name} has no stock exit gate to distil from (criterion "
                        f"{cfg.exit_criterion!r}); distil_gate needs ouro_gate or learned")
    if cfg.r_max < 3 and a.gates in ("both", "lookahead"):
        raise UserError(f"a lookahead head needs r_max >= 3 (it predicts steps 2..r_max-1), {cfg.name} has "
                        f"{cfg.r_max}")
    for p_ in model.parameters():
        p_.requires_grad_(False)
    names = GATES[a.gates]
    torch.manual_seed(a.seed)
    heads = nn.ModuleDict()
    if "lookahead" in names:
        heads["lookahead"] = nn.Linear(cfg.hidden_size, 1)
        heads["lookahead"].load_state_dict(model.stock_gate().state_dict())  # start from the stock gate
    if "preloop" in names:
        heads["preloop"] = nn.Linear(cfg.hidden_size, cfg.r_max)
    heads = heads.float().to(acc.device)
    tok_dir = a.tokenizer or (a.model if (a.model / "tokenizer.json").exists() else TOKENIZER)
    a.ctx = min(a.ctx, cfg.max_position)
    data = load_data(a, tok_dir, acc)
    if int(data.train.max()) >= cfg.vocab_size:
        raise UserError(f"the training tokens reach id {int(data.train.max())} but the model's vocabulary has "
                        f"{cfg.vocab_size} (another tokenizer? pass --tokenizer)")
    val, val_mask = data.eval(a.ctx, a.eval_windows), data.eval_mask(a.ctx, a.eval_windows)
    thresholds = a.thresholds or sorted({0.3, 0.5, 0.7} | ({cfg.exit_threshold} if cfg.exit_threshold else set()))
    opt = torch.optim.AdamW(heads.parameters(), lr=a.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_scale(s, a))
    heads, opt, sched = acc.prepare(heads, opt, sched)
    raw = acc.unwrap_model(heads)
    before = agreement(model, teacher, {}, val.to(acc.device), val_mask, thresholds) if acc.is_main_process else None
    t0, logs, hist = time.time(), [], []
    for step in range(a.steps):
        seed = [a.seed, step, acc.process_index]
        ids = data.batch(a.batch, a.ctx, seed).to(acc.device)
        bmask = data.batch_mask(a.batch, a.ctx, seed)
        mask = None if bmask is None else bmask[:, 1:].to(acc.device)  # the targets' mask: the inputs are ids[:, :-1]
        oracle = a.objective == "oracle" and "lookahead" in names
        feats, hazards, pre, nll = features(model, ids[:, :-1], ids[:, 1:] if oracle else None)
        parts = {}
        if oracle:
            parts["lookahead"] = oracle_loss(raw["lookahead"], feats, nll, mask, a.epsilon)
        elif "lookahead" in names:
            parts["lookahead"] = lookahead_loss(raw["lookahead"], feats, hazards, mask)
        if "preloop" in names:
            parts["preloop"] = preloop_loss(raw["preloop"], pre, hazards, mask)
        loss = sum(p["loss"] for p in parts.values())
        opt.zero_grad(set_to_none=True)
        acc.backward(loss)
        acc.clip_grad_norm_(heads.parameters(), a.clip)
        opt.step()
        sched.step()
        logs.append({f"{g}_{k}": float(v.detach()) for g, p in parts.items() for k, v in p.items()})
        if (step + 1) % a.log_every == 0 or step + 1 == a.steps:
            rec = {"step": step + 1, **{k: sum(x[k] for x in logs) / len(logs) for k in logs[0]},
                   "time_s": round(time.time() - t0, 1)}
            logs = []
            hist.append(rec)
            acc.print(json.dumps(rec))
    acc.wait_for_everyone()
    if not acc.is_main_process:
        return
    out = a.output or a.model
    if out.resolve() != a.model.resolve():
        if out.exists() and any(out.iterdir()):
            raise UserError(f"--output {out} exists and is not empty")
        shutil.copytree(a.model, out, dirs_exist_ok=True)
    after = agreement(model, teacher, dict(raw.items()), val.to(acc.device), val_mask, thresholds)
    for name in names:
        setattr(model, f"{name}_exit_gate", raw[name].to(next(model.parameters()).dtype))
    model.cfg = replace(cfg, lookahead_gate=cfg.lookahead_gate or "lookahead" in names,
                        preloop_gate=cfg.preloop_gate or "preloop" in names, gate_teacher=teacher)
    save_gates(model, out)
    summary = {"model": str(a.model), "output": str(out), "teacher": teacher, "gates": list(names),
               "objective": a.objective, **({"epsilon": a.epsilon} if a.objective == "oracle" else {}),
               "steps": a.steps, "batch": a.batch, "ctx": a.ctx, "lr": a.lr, "seconds": round(time.time() - t0, 1),
               "world_size": acc.num_processes, "data": {k: v for k, v in data.meta.items() if k != "key"},
               "before": before, "after": after, "history": hist}
    (out / "distill_gate.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps({"output": str(out), "seconds": summary["seconds"], "agreement": after}, indent=1))


if __name__ == "__main__":
    cli.run(main)

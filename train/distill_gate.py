"""Distil a lookahead head and / or a preloop gate from a checkpoint's frozen stock exit gate.

    accelerate launch train/distill_gate.py --model checkpoints/ouro-demo --output .cache/runs/ouro-gates --dataset chat.jsonl
    python train/distill_gate.py --model path/to/huginn-0125 --add-gate --teacher loss --output .cache/runs/huginn-gate
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

`--add-gate` (Huginn without a gate, e.g. Huginn-3.5B; Ouro always has one and is refused) first trains
a new per-step exit gate, the architecture's `exit_gate` Linear(d -> 1) on gate_features(state), on the
frozen model: BCE of its sigmoid at steps r_min..r_max-1 against a teacher's 0/1 targets (`--teacher
loss`: the coda's next-token loss at depth s within `--margin` nats of the loss at r_max, the recipe of
train/pretrain.py's stage II; `--teacher kl|latent_diff|entropy_diff`: that criterion at
`--teacher-threshold` would have exited at or before s). Its threshold is the one whose mean exit depth
on the held-out windows is the teacher's. OUTPUT (required, never --model) gets a copy of --model with
exit_gate.weight / .bias among its own tensors (as checkpoints/huginn-demo keeps its gate) and
config.json `exit_gate: true`, `exit_criterion: "learned"`, that `exit_threshold`: the engine's
`learned` criterion serves it. `--gates` (default none with --add-gate) then distils the heads above
from it as from a stock gate.

The heads go to OUTPUT/exit_gates.safetensors with `lookahead_gate` / `preloop_gate` /
`gate_teacher` in OUTPUT/config.json; OUTPUT (--output, required) gets a copy of --model first (the
checkpoint's own tensors are not rewritten; --model itself, or a folder inside it, is refused: an HF
cache snapshot's files are symlinks into the cache). The held-out agreement between teacher and
student depths (exact agreement, mean |depth difference|, mean depths) at each `--thresholds` value is
printed and written to OUTPUT/distill_gate.json, beside the same figures for the stock gate read one
step late (today's `lookahead=True`); it is streamed `--eval-batch` windows at a time (sums and
counts, never every window's full-vocabulary logits at once).

At scale (issue 59): `--dataset` takes chat / prompt-completion / text datasets (train/datasource.py:
assistant-only / completion-only loss, packed documents kept apart: positions restart per document and
attention stays inside it, in every pass here); the frozen model runs under bf16 autocast on CUDA
(`--mixed-precision`), the heads in float32; checkpoints (accelerate save_state: heads, optimizer,
scheduler) every `--save-every` steps in OUTPUT/checkpoints (the --add-gate phase in
OUTPUT/checkpoints/add_gate), the last 2 kept, meta.json written last; OUTPUT/run.json names the run:
the same command resumes (a larger --steps continues it), another config with that --output fails.
Records go to OUTPUT/history.json (history_add_gate.json) and wandb (offline; --no-wandb). The
authors' defaults: warm-up 500, cosine to 0.05x, 4,096-token windows, assistant-only loss.
Memory and time at Ouro-1.4B / Huginn-3.5B: `python -m train.estimate --script distill ...`.
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import shutil
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from looplm.cli import UserError
from looplm.config import GATE_CRITERIA, replace
from looplm.exits import step_scores
from looplm.io import load_pretrained, save_gates
from looplm.model import plain_attend_for
from looplm.policy import DEFAULT_THRESHOLDS, ExitPolicy, ExitTracker
from train import cli
from train.common import TOKENIZER, History, exit_depths, init_wandb, logits_of, token_ce
from train.datasource import add_dataset_args, dataset_kwargs
from train.packing import doc_attend_for, doc_positions
from train.shared_kv import check_model_arg, load_data

GATES = {"both": ("lookahead", "preloop"), "lookahead": ("lookahead",), "preloop": ("preloop",), "none": ()}


# ---------------------------------------------------------------- teacher and features
def window_pass(model, ids: torch.Tensor, docs: torch.Tensor | None):
    """rope and attend_for of a pass over `ids` [B, T]; with `docs` [B, T] (packed documents,
    train/packing.py) positions restart per document and attention stays inside it."""
    if docs is None:
        return model.rope(torch.arange(ids.shape[1], device=ids.device)), plain_attend_for
    return model.rope(doc_positions(docs)), doc_attend_for(docs)


def frozen_autocast(device, precision: str):
    """The frozen model's passes under bf16 autocast (`--mixed-precision bf16`); the heads run
    outside it, in float32."""
    if precision != "bf16":
        return contextlib.nullcontext()
    return torch.autocast(torch.device(device).type, torch.bfloat16)


def wide(x: torch.Tensor) -> torch.Tensor:
    """At least float32: what the heads read (bf16 autocast outputs widened; a float64 model's, as they are)."""
    return x if x.dtype == torch.float64 else x.float()


@torch.no_grad()
def features(model, ids: torch.Tensor, targets: torch.Tensor | None = None, docs: torch.Tensor | None = None):
    """One full-depth causal pass over `ids` [B, T]: the stock gate's input after every step
    [R, B, T, d], the teacher's hazards [B, T, R], the prelude output [B, T, d] and, with `targets`
    [B, T] (the next tokens), the coda's next-token loss in nats after every step [B, T, R] (else None).
    `docs` [B, T]: the inputs' documents (positions restart, attention stays inside each)."""
    R = model.cfg.r_max
    rope, attend_for = window_pass(model, ids, docs)
    state, inj = model.prelude(ids, rope, attend_for)
    pre = inj if inj is not None else state
    feats, logits, nll = [], [], []
    gate = model.stock_gate()
    for _ in range(R):
        state = model.core_step(state, inj, rope, attend_for)
        f = model.gate_features(state)
        feats.append(wide(f))
        logits.append(wide(gate(f).squeeze(-1)))
        if targets is not None:
            out = wide(model.head(model.coda(state, rope, attend_for)))
            nll.append(F.cross_entropy(out.transpose(1, 2), targets, reduction="none"))
    return (torch.stack(feats), torch.sigmoid(torch.stack(logits, -1)), wide(pre),
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


def in_slices(fn, B: int, k: int | None, dims: tuple[int, ...]) -> tuple:
    """fn(i, j) -> tensors (or None) for windows i..j-1, run `k` windows at a time and written into
    tensors of all B windows along their batch dims `dims`: the values of one call over all B (the
    frozen passes are per window), with the transients (a step's logits, a kl teacher's float64
    log-probs) of k windows only."""
    if k is None or k >= B:
        return fn(0, B)
    out = None
    for i in range(0, B, k):
        part = fn(i, min(i + k, B))
        if out is None:  # preallocated: no second copy of the features from a concatenation
            out = [None if t is None else t.new_empty(t.shape[:d] + (B,) + t.shape[d + 1:]) for t, d in zip(part, dims)]
        for o, t, d in zip(out, part, dims):
            if t is not None:
                o.narrow(d, i, t.shape[d]).copy_(t)
    return tuple(out)


def heads_loss(model, heads, names, windows: torch.Tensor, mask, docs, objective: str = "teacher",
               epsilon: float = 0.1, precision: str = "no", frozen_batch: int | None = None) -> dict:
    """The distilled heads' loss on windows [B, T+1] (inputs windows[:, :-1], targets windows[:, 1:]):
    the frozen model's feature pass (no grad; bf16 autocast with `precision` bf16; `frozen_batch`
    windows at a time), then the heads in float32. `mask` / `docs`: the windows' loss mask and
    documents [B, T+1] (or None). Returns {head: its loss parts} and "loss", their sum."""
    targets_mask = None if mask is None else mask[:, 1:]  # the targets' mask: the inputs are windows[:, :-1]
    oracle = objective == "oracle" and "lookahead" in names

    def frozen(i: int, j: int):
        with frozen_autocast(windows.device, precision):
            return features(model, windows[i:j, :-1], windows[i:j, 1:] if oracle else None,
                            None if docs is None else docs[i:j, :-1])
    feats, hazards, pre, nll = in_slices(frozen, len(windows), frozen_batch, (1, 0, 0, 0))
    parts = {}
    if oracle:
        parts["lookahead"] = oracle_loss(heads["lookahead"], feats, nll, targets_mask, epsilon)
    elif "lookahead" in names:
        parts["lookahead"] = lookahead_loss(heads["lookahead"], feats, hazards, targets_mask)
    if "preloop" in names:
        parts["preloop"] = preloop_loss(heads["preloop"], pre, hazards, targets_mask)
    return {**parts, "loss": sum(x["loss"] for x in parts.values())}


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


CANDIDATE_KEYS = ("agreement", "mean_abs_diff", "mean_depth", "mean_nll")


@torch.no_grad()
def agreement_sums(model, teacher: str, heads: dict, w: torch.Tensor, mask, docs, thresholds: list[float],
                   precision: str = "no") -> dict:
    """agreement()'s sums over the counted tokens of windows `w` [b, T+1]: per threshold the teacher's
    depth sum and, per candidate, the sums of exact agreements, |depth differences|, depths and the
    next-token losses at its depths; "tokens", the count."""
    R = model.cfg.r_max
    with frozen_autocast(w.device, precision):
        feats, hazards, pre, nll = features(model, w[:, :-1], w[:, 1:], None if docs is None else docs[:, :-1])
    keep = (mask[:, 1:].to(w.device) if mask is not None else torch.ones_like(w[:, 1:], dtype=torch.bool)).reshape(-1)
    hz = hazards.reshape(-1, R)[keep]
    nll = nll.reshape(-1, R)[keep].tolist()
    teach = step_scores_of(teacher, hz).tolist()
    late = teach  # the stock gate read one step late: the same scores, lookahead=True
    if "lookahead" in heads:
        z = heads["lookahead"](feats).squeeze(-1).permute(1, 2, 0).reshape(-1, R)[keep]
        stud = step_scores_of(teacher, torch.sigmoid(z.double())).tolist()
    if "preloop" in heads:
        cdf = torch.softmax(heads["preloop"](pre).double(), -1).cumsum(-1).reshape(-1, R)[keep].tolist()
    rows = []
    for q in thresholds:
        pol = ExitPolicy(teacher, q, 1, R)
        td = [depth_of(pol, x) for x in teach]
        row = {"teacher_depth": sum(td)}
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
            row[name] = {"agreement": sum(a == b for a, b in zip(d, ref)),
                         "mean_abs_diff": sum(abs(a - b) for a, b in zip(d, ref)),
                         "mean_depth": sum(d),
                         # the next-token loss at the exit depth (teacher-forced, full-depth features)
                         "mean_nll": sum(x[k - 1] for x, k in zip(nll, d))}
        rows.append(row)
    return {"tokens": len(teach), "rows": rows}


@torch.no_grad()
def agreement(model, teacher: str, heads: dict, windows: torch.Tensor, mask, thresholds: list[float],
              docs=None, batch: int = 1, precision: str = "no") -> dict:
    """Teacher vs student exit depths on held-out windows [N, T+1] (their loss mask / documents
    [N, T+1] or None), per threshold. Streamed `batch` windows at a time, sums and counts
    accumulated: never the full-vocabulary logits of every window at once (at 4,096 tokens 32 windows'
    float32 logits alone are ~26 GB)."""
    dev = model.device
    total, acc = 0, None
    for i in range(0, len(windows), batch):
        part = agreement_sums(model, teacher, heads, windows[i:i + batch].to(dev),
                              None if mask is None else mask[i:i + batch],
                              None if docs is None else docs[i:i + batch].to(dev), thresholds, precision)
        total += part["tokens"]
        if acc is None:
            acc = part["rows"]
            continue
        for row, new in zip(acc, part["rows"]):
            row["teacher_depth"] += new["teacher_depth"]
            for name, sums in row.items():
                if isinstance(sums, dict):
                    for k in CANDIDATE_KEYS:
                        sums[k] += new[name][k]
    n = max(total, 1)
    rows = []
    for q, row in zip(thresholds, acc or []):
        rows.append({"threshold": q, "teacher_mean_depth": row["teacher_depth"] / n,
                     **{name: {k: sums[k] / n for k in CANDIDATE_KEYS} for name, sums in row.items()
                        if isinstance(sums, dict)}})
    return {"tokens": total, "thresholds": rows}


# ---------------------------------------------------------------- --add-gate: a new per-step exit gate
ADD_TEACHERS = ("loss", "kl", "latent_diff", "entropy_diff")
ADDED_GATE_FILE = "model-exit-gate.safetensors"  # the gate's own file beside a sharded checkpoint's shards


def check_add_gate(a, cfg) -> None:
    """--add-gate's refusals, before anything is loaded or trained (one line each)."""
    if cfg.family == "ouro":
        raise UserError(f"--add-gate: {cfg.name} is an Ouro checkpoint, whose early_exit_gate is part of the "
                        f"architecture; distil from it without --add-gate")
    if cfg.exit_gate:
        raise UserError(f"--add-gate: --model {a.model} already has an exit gate (exit_gate: true); distil from it "
                        f"without --add-gate")
    if cfg.r_max < 2:
        raise UserError(f"--add-gate: a per-step gate needs r_max >= 2 (the score at r_max is never read), "
                        f"{cfg.name} has {cfg.r_max}")
    if cfg.r_min >= cfg.r_max:
        raise UserError(f"--add-gate: r_min = r_max = {cfg.r_max} leaves a gate nothing to decide")
    if a.teacher == "loss" and a.teacher_threshold is not None:
        raise UserError("--teacher-threshold is for --teacher kl / latent_diff / entropy_diff (--teacher loss "
                        "uses --margin)")
    if a.teacher_threshold is not None and not a.teacher_threshold >= 0:
        raise UserError(f"--teacher-threshold is a distance >= 0, got {a.teacher_threshold}")


def teacher_policy(cfg, teacher: str, threshold: float | None) -> ExitPolicy | None:
    """The exit policy of a criterion teacher (None for --teacher loss), at the config's depths.
    Default threshold: the config's exit_threshold where the config's criterion is the teacher, else
    the criterion's default (Huginn's "auto" values): another criterion's threshold has another scale
    (a kl threshold of 1e-3 read as a latent_diff one would almost never exit)."""
    if teacher == "loss":
        return None
    if threshold is None:
        threshold = cfg.exit_threshold if cfg.exit_criterion == teacher and cfg.exit_threshold is not None \
            else DEFAULT_THRESHOLDS[teacher]
    return ExitPolicy(teacher, float(threshold), cfg.r_min, cfg.r_max)


def first_exit(target: torch.Tensor, r_min: int) -> torch.Tensor:
    """Depth (1-based) per token from exit targets [R, ...]: the first step s >= r_min with target 1,
    else R (r_max always stops the loop). For a criterion teacher it is the criterion's exit depth."""
    R = target.shape[0]
    step = torch.arange(1, R + 1, device=target.device).view(R, *([1] * (target.dim() - 1)))
    ok = target.bool() & (step >= r_min)
    return torch.where(ok, step, R).min(0).values


@torch.no_grad()
def added_gate_batch(model, ids: torch.Tensor, targets: torch.Tensor, teacher: str, policy: ExitPolicy | None,
                     margin: float, docs: torch.Tensor | None = None):
    """One full-depth causal pass of the frozen model over `ids` [B, T] (no grad): the gate's input
    `gate_features(state)` after every step [R, B, T, d] (float32), the teacher's targets [R, B, T]
    (1 = exit at step s) and the coda's next-token loss [R, B, T] (None for latent_diff, which needs no coda).
    - loss: 1 where the loss at depth s is within `margin` nats of the loss at r_max (`<`, as in
      train/pretrain.py's stage II, which trained the demos' gates);
    - kl / latent_diff / entropy_diff: 1 from the criterion's exit depth on (it would have exited at or
      before s), its scores computed by the engine's own function (looplm.exits.step_scores: float64,
      kl against uniform and entropy_diff against 100 at step 1, latent_diff against the initial state)
      and its depth by train.common.exit_depths (the ExitTracker's rule, r_min honoured).
    `docs` [B, T]: the inputs' documents (positions restart, attention stays inside each)."""
    R = model.cfg.r_max
    rope, attend_for = window_pass(model, ids, docs)
    state, inj = model.prelude(ids, rope, attend_for)  # Huginn: the zero initial state, the injection
    feats, ce, scores, aux = [], [], [], None
    for _ in range(R):
        prev, state = state, model.core_step(state, inj, rope, attend_for)
        feats.append(wide(model.gate_features(state)))
        logits = logits_of(model, state, rope, attend_for) if teacher != "latent_diff" else None
        if logits is not None:
            ce.append(token_ce(logits, targets))
        if policy is not None:
            sc, aux = step_scores(teacher, prev, state, None, logits, aux)
            scores.append(sc)
    ce = torch.stack(ce) if ce else None
    if policy is None:
        target = ce - ce[-1:] < margin
    else:
        depth = exit_depths(torch.stack(scores).cpu(), policy).to(ids.device)
        target = torch.arange(1, R + 1, device=ids.device).view(R, 1, 1) >= depth
    return torch.stack(feats), target.float(), ce


def added_gate_loss(gate: nn.Module, feats: torch.Tensor, target: torch.Tensor, mask, r_min: int = 1) -> dict:
    """Masked BCE of sigmoid(gate(features at step s)) against the teacher's target at s, over the
    steps whose score the engine reads: r_min..r_max-1 (before r_min a signal cannot exit; at r_max
    the loop stops whatever the score). `exit_frac`: the mean target."""
    R = feats.shape[0]
    z = gate(feats[r_min - 1:R - 1]).squeeze(-1).permute(1, 2, 0)  # [B, T, steps]
    t = target[r_min - 1:R - 1].permute(1, 2, 0).to(z.dtype)
    bce = masked_mean(F.binary_cross_entropy_with_logits(z, t, reduction="none"), mask)
    return {"loss": bce, "bce": bce, "exit_frac": masked_mean(t, mask)}


def added_gate_step_loss(model, gate, windows: torch.Tensor, mask, docs, teacher: str, policy, margin: float,
                         r_min: int = 1, precision: str = "no", frozen_batch: int | None = None) -> dict:
    """The new gate's loss on windows [B, T+1]: the frozen model's pass (no grad, bf16 autocast with
    `precision` bf16, `frozen_batch` windows at a time) for the teacher's targets and the gate's input,
    then the gate in float32. `mask` / `docs`: the windows' loss mask and documents [B, T+1] (or None)."""
    def frozen(i: int, j: int):
        with frozen_autocast(windows.device, precision):
            return added_gate_batch(model, windows[i:j, :-1], windows[i:j, 1:], teacher, policy, margin,
                                    None if docs is None else docs[i:j, :-1])
    feats, target, _ = in_slices(frozen, len(windows), frozen_batch, (1, 1, 1))
    return added_gate_loss(gate, feats, target, None if mask is None else mask[:, 1:], r_min)


def init_added_gate(d: int, exit_rate: float) -> nn.Linear:
    """The new gate, Linear(d -> 1) like the architecture's exit_gate. Zero weights and the bias at
    logit(exit_rate): the gate starts as the best constant under BCE (sigmoid = the teacher's mean exit
    rate), so training only has to add what the features tell; a random init on ln_f-normalised
    features (entries ~1) would start with arbitrary logits of order std*sqrt(d) and an arbitrary rate."""
    gate = nn.Linear(d, 1)
    rate = min(max(exit_rate, 1e-4), 1 - 1e-4)
    with torch.no_grad():
        gate.weight.zero_()
        gate.bias.fill_(math.log(rate / (1 - rate)))
    return gate


@torch.no_grad()
def added_gate_eval(model, gate, windows: torch.Tensor, mask, teacher: str, policy, margin: float, batch: int,
                    docs=None, precision: str = "no") -> dict:
    """The held-out tokens' targets, losses and (with `gate`) gate logits, each [R, N] (N: the tokens
    that count), in chunks of `batch` windows (only these [R, N] rows are kept, never the logits)."""
    parts: dict[str, list] = {"target": [], "ce": [], "logits": []}
    dev = model.device
    for i in range(0, len(windows), batch):
        w = windows[i:i + batch].to(dev)
        d = None if docs is None else docs[i:i + batch, :-1].to(dev)
        with frozen_autocast(dev, precision):
            feats, target, ce = added_gate_batch(model, w[:, :-1], w[:, 1:], teacher, policy, margin, d)
        keep = (mask[i:i + batch, 1:].to(dev) if mask is not None else torch.ones_like(w[:, 1:], dtype=torch.bool)).reshape(-1)
        parts["target"].append(target.flatten(1)[:, keep].cpu())
        if ce is not None:
            parts["ce"].append(ce.flatten(1)[:, keep].cpu())
        if gate is not None:
            parts["logits"].append(gate(feats).squeeze(-1).flatten(1)[:, keep].double().cpu())
    return {k: torch.cat(v, 1) if v else None for k, v in parts.items()}


def choose_exit_threshold(logits: torch.Tensor, want_depth: float, r_min: int, r_max: int) -> tuple[float, float]:
    """The `learned` threshold q whose mean exit depth over gate logits [R, N] (the engine's rule,
    train.common.exit_depths) is closest to `want_depth`, and that depth. The depth does not decrease
    as q grows (q = 0: every score exits at r_min), so bisection finds the crossing."""
    def depth(q: float) -> float:
        return exit_depths(logits, ExitPolicy("learned", q, r_min, r_max)).double().mean().item()
    lo, hi = 0.0, 1.0
    for _ in range(50):
        mid = (lo + hi) / 2
        if depth(mid) < want_depth:
            lo = mid
        else:
            hi = mid
    q = min((hi, lo), key=lambda x: abs(depth(x) - want_depth))  # a tie goes to hi: the deeper, the safer
    return q, depth(q)


def added_gate_report(held: dict, q: float, r_min: int, r_max: int) -> dict:
    """Teacher vs gate at threshold q on the held-out tokens: depths, agreement and, where the teacher
    ran the coda, the next-token loss at the exit depth (teacher-forced, full-depth context)."""
    td = first_exit(held["target"], r_min)
    gd = exit_depths(held["logits"], ExitPolicy("learned", q, r_min, r_max))
    out = {"tokens": int(td.numel()), "exit_threshold": q, "teacher_mean_depth": td.double().mean().item(),
           "gate_mean_depth": gd.double().mean().item(), "agreement": (td == gd).double().mean().item(),
           "mean_abs_diff": (td - gd).abs().double().mean().item(),
           "teacher_depth_hist": torch.bincount(td, minlength=r_max + 1)[1:].tolist(),
           "gate_depth_hist": torch.bincount(gd, minlength=r_max + 1)[1:].tolist()}
    if held["ce"] is not None:
        ce = held["ce"].double()
        out.update(full_depth_nll=ce[-1].mean().item(), teacher_nll=ce.gather(0, td[None] - 1).mean().item(),
                   gate_nll=ce.gather(0, gd[None] - 1).mean().item())
    return out


def train_added_gate(model, a, data, val: torch.Tensor, val_mask, val_docs, acc, wb=None) -> dict:
    """--add-gate: train a new exit gate on the frozen model against --teacher, pick its exit
    threshold (the teacher's mean depth on the held-out windows) and install it in `model` (its cfg:
    exit_gate true, exit_criterion learned, that threshold). Returns the run's summary.
    Checkpoints in OUTPUT/checkpoints/add_gate; the finished gate and its summary there too (done.json,
    written last): a re-run with the same --steps takes them, a larger --steps trains on."""
    cfg = model.cfg
    R, r_min = cfg.r_max, cfg.r_min
    policy = teacher_policy(cfg, a.teacher, a.teacher_threshold)
    ckdir = a.output / "checkpoints" / "add_gate"
    done = ckdir / "done.json"
    if done.exists() and json.loads(done.read_text())["steps"] == a.steps:
        rec = json.loads(done.read_text())
        gate = init_added_gate(cfg.hidden_size, 0.5)
        gate.load_state_dict(load_file(str(ckdir / "gate.safetensors")))
        install_gate(model, gate.to(acc.device), rec["added"]["heldout"]["exit_threshold"])
        acc.print(f"the added gate: taken from {ckdir} ({a.steps} steps)")
        return rec["added"]
    # the held-out targets first: their mean exit rate sets the gate's bias (the same on every process;
    # kept for a resumed run, whose gate comes from its checkpoint)
    init = ckdir / "init.json"
    if init.exists():
        rate = json.loads(init.read_text())["init_exit_rate"]
    else:
        held = added_gate_eval(model, None, val, val_mask, a.teacher, policy, a.margin, a.eval_batch, val_docs,
                               a.precision)
        rate = held["target"][r_min - 1:R - 1].mean().item()
        acc.wait_for_everyone()
        if acc.is_main_process:
            ckdir.mkdir(parents=True, exist_ok=True)
            init.write_text(json.dumps({"init_exit_rate": rate}) + "\n")
    torch.manual_seed(a.seed)
    gate = init_added_gate(cfg.hidden_size, rate).float().to(acc.device)
    opt = torch.optim.AdamW(gate.parameters(), lr=a.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_scale(s, a))
    gate, opt, sched = acc.prepare(gate, opt, sched)
    hist = History(a.output / "history_add_gate.json")

    def step_loss(step: int) -> dict:
        seed = [a.seed, 10 ** 6 + step, acc.process_index]  # other windows than the heads' loop draws
        w, m, d = draw(data, a, seed, acc.device)
        part = added_gate_step_loss(model, gate, w, m, d, a.teacher, policy, a.margin, r_min, a.precision,
                                    a.frozen_batch)
        return {"loss": part["loss"], **{f"exit_gate_{k}": v for k, v in part.items()}}

    t0 = time.time()
    train_loop(a, acc, gate, opt, sched, step_loss, ckdir, hist, wb, "add_gate", {})
    raw = acc.unwrap_model(gate)
    held = added_gate_eval(model, raw, val, val_mask, a.teacher, policy, a.margin, a.eval_batch, val_docs,
                           a.precision)
    want = first_exit(held["target"], r_min).double().mean().item()
    q, _ = choose_exit_threshold(held["logits"], want, r_min, R)
    install_gate(model, raw, q)
    added = {"teacher": a.teacher, **({"margin": a.margin} if policy is None else
                                      {"teacher_threshold": policy.threshold}),
             "r_min": r_min, "init_exit_rate": rate, "steps": a.steps, "seconds": round(time.time() - t0, 1),
             "heldout": added_gate_report(held, q, r_min, R), "history": hist.records}
    acc.wait_for_everyone()
    if acc.is_main_process:
        save_file({k: v.detach().float().cpu().contiguous() for k, v in raw.state_dict().items()},
                  str(ckdir / "gate.safetensors"))
        done.write_text(json.dumps({"steps": a.steps, "added": added}) + "\n")  # last: the phase is complete
    acc.wait_for_everyone()
    acc.free_memory()  # the heads' phase prepares its own objects: its save_state / load_state see only those
    return added


def install_gate(model, gate: nn.Linear, threshold: float) -> None:
    """The new gate into `model`: its exit_gate, and config exit_gate true, criterion learned at `threshold`."""
    model.exit_gate = gate.to(model.dtype)
    model.cfg = replace(model.cfg, exit_gate=True, exit_criterion="learned", exit_threshold=threshold)


def write_exit_gate(gate: nn.Linear, folder: Path) -> Path:
    """Add `exit_gate.weight` [1, d] / `exit_gate.bias` [1] (float32) to the copied checkpoint's own
    tensors, where looplm.io reads a Huginn exit gate (checkpoints/huginn-demo keeps its gate in
    model.safetensors): a single model.safetensors is rewritten with them; a sharded checkpoint
    (Huginn-3.5B: 4 shards, 15.6 GB) gets them in a file of their own listed in its index, no shard
    rewritten."""
    tensors = {f"exit_gate.{k}": v.detach().float().cpu().contiguous().clone() for k, v in gate.state_dict().items()}
    index, single = folder / "model.safetensors.index.json", folder / "model.safetensors"
    if not index.exists() and single.exists():
        with safe_open(str(single), framework="pt") as fh:
            meta = fh.metadata()
            state = {k: fh.get_tensor(k) for k in fh.keys()}
        state.update(tensors)
        tmp = folder / "model.safetensors.tmp"
        save_file(state, str(tmp), metadata=meta)
        tmp.replace(single)
        return single
    path = folder / ADDED_GATE_FILE
    save_file(tensors, str(path), metadata={"format": "pt"})
    if index.exists():  # (without an index the loader reads every model*.safetensors: this one too)
        idx = json.loads(index.read_text())
        idx["weight_map"].update({k: path.name for k in tensors})
        if "total_size" in idx.get("metadata", {}):
            idx["metadata"]["total_size"] += sum(v.numel() * v.element_size() for v in tensors.values())
        index.write_text(json.dumps(idx, indent=2) + "\n")
    return path


def finish_added_gate(model, a, acc, added: dict, seconds: float) -> None:
    """--add-gate without other heads: copy --model to --output, write the gate and config.json there."""
    acc.wait_for_everyone()
    if not acc.is_main_process:
        return
    shutil.copytree(a.model, a.output, dirs_exist_ok=True)
    model.cfg.save(a.output / "config.json")
    write_exit_gate(model.exit_gate, a.output)
    summary = {"model": str(a.model), "output": str(a.output), "steps": a.steps, "seconds": round(seconds, 1),
               "add_gate": added}
    (a.output / "distill_gate.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps({"output": str(a.output), "add_gate": added["heldout"]}, indent=1))


# ---------------------------------------------------------------- training, checkpoints
def draw(data, a, seed: list[int], device):
    """One batch of windows [B, T+1] with its loss mask and documents (None where there are none)."""
    w = data.batch(a.batch, a.ctx, seed).to(device)
    m, d = data.batch_mask(a.batch, a.ctx, seed), data.batch_doc(a.batch, a.ctx, seed)
    return w, None if m is None else m.to(device), None if d is None else d.to(device)


KEEP = 2  # checkpoints kept per phase


def latest_ckpt(ckdir: Path, meta: dict) -> Path | None:
    """The newest complete checkpoint (meta.json is written last) whose meta.json matches `meta`."""
    cks = []
    for c in ckdir.glob("step_*"):
        if (c / "meta.json").exists():
            m = json.loads((c / "meta.json").read_text())
            if all(m.get(k) == v for k, v in meta.items()):
                cks.append((m["step"], c))
    return max(cks)[1] if cks else None


def save_ckpt(acc, ckdir: Path, step: int, meta: dict) -> None:
    """accelerate's save_state (the trained module, optimizer, scheduler, RNG) into ckdir/step_XXXXXX;
    meta.json last marks it complete; the older ones beyond the last KEEP go."""
    d = ckdir / f"step_{step:06d}"
    if acc.is_main_process and d.exists():  # a stale one (a phase restarted for a longer --add-gate run)
        shutil.rmtree(d)
    acc.wait_for_everyone()
    acc.save_state(str(d))
    if acc.is_main_process:
        (d / "meta.json").write_text(json.dumps({"step": step, **meta}) + "\n")
        cks = sorted(ckdir.glob("step_*"), key=lambda c: int(c.name.split("_")[1]))
        for old in cks[:-KEEP]:
            shutil.rmtree(old, ignore_errors=True)
    acc.wait_for_everyone()


def train_loop(a, acc, module, opt, sched, step_loss, ckdir: Path, hist: History, wb, phase: str, meta: dict) -> None:
    """One phase's steps: from its latest checkpoint in `ckdir` matching `meta` (else step 0) to
    --steps. `step_loss(step)` -> {"loss": to minimise, name: tensor logged}. A record every
    --log-every steps (and the last) to `hist` (OUTPUT's JSON log) and wandb; a checkpoint every
    --save-every steps and at the last."""
    step = 0
    ck = latest_ckpt(ckdir, meta)
    if ck is not None:
        acc.load_state(str(ck))
        step = json.loads((ck / "meta.json").read_text())["step"]
        acc.print(f"{phase}: resumed from {ck} at step {step}")
    hist.truncate(step)  # a resumed run replays the steps after its checkpoint; a new one starts empty
    t0, logs, tokens, train_s = time.time(), [], 0, 0.0
    while step < a.steps:
        t_step = time.perf_counter()
        parts = step_loss(step)
        opt.zero_grad(set_to_none=True)
        acc.backward(parts["loss"])
        acc.clip_grad_norm_(module.parameters(), a.clip)
        opt.step()
        sched.step()
        logs.append({k: float(v.detach()) for k, v in parts.items() if k != "loss"})
        train_s += time.perf_counter() - t_step
        tokens += a.batch * a.ctx * acc.num_processes
        step += 1
        if step % a.log_every == 0 or step == a.steps:
            rec = {"step": step, **{k: sum(x[k] for x in logs) / len(logs) for k in logs[0]},
                   "lr": sched.get_last_lr()[0], "time_s": round(time.time() - t0, 1),
                   "tokens_per_s": round(tokens / max(train_s, 1e-9), 1)}
            logs, tokens, train_s = [], 0, 0.0
            if acc.is_main_process:
                hist.log(rec)
                if wb is not None:
                    wb.log({f"{phase}/{k}": v for k, v in rec.items()})
            acc.print(json.dumps(rec))
        if step % a.save_every == 0 or step == a.steps:
            save_ckpt(acc, ckdir, step, meta)


# ---------------------------------------------------------------- run
def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", type=Path, required=True,
                   help="HF-format looped-LM folder with a stock exit gate (without one: --add-gate)")
    p.add_argument("--output", type=Path, default=None,
                   help="required: a new folder (or this command's own, to resume it) that gets a copy of --model "
                        "with the heads, the checkpoints, logs and run.json; never --model or a folder inside it")
    p.add_argument("--gates", choices=sorted(GATES), default=None,
                   help="the distilled heads (default: both; with --add-gate: none, else distilled from the new gate)")
    p.add_argument("--add-gate", action="store_true",
                   help="a model without an exit gate (Huginn-3.5B) gets a new per-step gate Linear(d -> 1), "
                        "trained on the frozen model against --teacher and served by the `learned` criterion: "
                        "--output gets a copy of --model with it (config.json: exit_gate true, exit_criterion "
                        "learned, exit_threshold = the one giving the teacher's mean depth on held-out windows)")
    p.add_argument("--teacher", choices=ADD_TEACHERS, default=None,
                   help="--add-gate's targets (default: loss): loss = 1 at step s where the coda's next-token "
                        "loss at depth s is within --margin nats of the loss at r_max; kl / latent_diff / "
                        "entropy_diff = 1 from the step that criterion exits at (at --teacher-threshold) on")
    p.add_argument("--margin", type=float, default=0.1, help="--teacher loss: nats (the recipe's 0.1)")
    p.add_argument("--teacher-threshold", type=float, default=None,
                   help="--teacher kl / latent_diff / entropy_diff: its exit threshold (default: the config's "
                        "exit_threshold where its criterion is the teacher, else the criterion's default)")
    p.add_argument("--objective", choices=("teacher", "oracle"), default="teacher",
                   help="the lookahead head's loss: teacher = BCE to the stock gate's hazard at step s+1 + exit-CDF "
                        "MAE (the authors'); oracle = BCE to 1 where the coda's next-token loss at depth s+1 is "
                        "within --epsilon nats of the loss at full depth (what serving is scored on, not the "
                        "teacher; no CDF term). The preloop gate is distilled from the teacher either way")
    p.add_argument("--epsilon", type=float, default=0.1,
                   help="--objective oracle: nats of next-token loss an exit after step s+1 may cost against full "
                        "depth and still count as 'exit' (larger: more early exits at a given threshold)")
    p.add_argument("--steps", type=int, default=1000, help="optimizer steps (per phase); may grow on a resume")
    p.add_argument("--batch", type=int, default=8, help="windows per step and process")
    p.add_argument("--ctx", type=int, default=4096,
                   help="tokens per window (the authors' 4,096), clamped to the model's max_position")
    p.add_argument("--frozen-batch", type=int, default=1,
                   help="windows per pass of the frozen model within a step (the features of the --batch windows "
                        "are the same; the transients, e.g. a kl teacher's float64 log-probs, are of this many)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=500, help="linear warm-up steps (the authors' 500)")
    p.add_argument("--min-lr-ratio", type=float, default=0.05, help="the cosine schedule's floor")
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--mixed-precision", choices=("auto", "no", "bf16"), default="auto",
                   help="the frozen model's passes under bf16 autocast (auto: bf16 on CUDA, no on CPU); the heads "
                        "and their optimizer stay float32")
    p.add_argument("--thresholds", type=float, nargs="+", default=None,
                   help="agreement thresholds (default: 0.3 0.5 0.7 and the checkpoint's)")
    p.add_argument("--eval-windows", type=int, default=32)
    p.add_argument("--eval-batch", type=int, default=1,
                   help="held-out windows per evaluation pass (streamed: sums and counts accumulated)")
    add_dataset_args(p)  # --dataset and its format, loss and packing options (train/datasource.py)
    p.add_argument("--tokens", type=Path, help=".npy token ids (default: the built corpus)")
    p.add_argument("--heldout-tokens", type=Path)
    p.add_argument("--loss-mask", type=Path, help=".npy aligned with --tokens: nonzero where a token counts")
    p.add_argument("--heldout-loss-mask", type=Path)
    p.add_argument("--tokenizer", type=Path, default=None)
    p.add_argument("--log-every", type=int, default=100)
    p.add_argument("--save-every", type=int, default=500,
                   help="checkpoint (heads, optimizer, scheduler) every N steps and at the end; the last 2 kept; "
                        "the same command again resumes from the latest")
    p.add_argument("--no-wandb", action="store_true", help="no wandb run (default: offline, in OUTPUT/wandb)")
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


def check_args(a) -> None:
    """Bad numbers and a missing / wrong --output, before anything is loaded or created (one line each)."""
    if a.output is None:
        raise UserError("train/distill_gate.py needs --output (a new folder: --model is never written)")
    if a.model.exists():  # never written: --output is neither --model nor inside it (an HF snapshot's symlinks too)
        out, src = a.output.resolve(), a.model.resolve()
        if out == src or src in out.parents:
            raise UserError(f"--output {a.output} is {'--model' if out == src else 'inside --model'} ({a.model}): "
                            "--model is never written; pass another folder")
    for name in ("steps", "batch", "ctx", "eval_batch", "frozen_batch", "save_every", "log_every"):
        if getattr(a, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} {getattr(a, name)}: at least 1")
    if a.warmup < 0:
        raise UserError(f"--warmup {a.warmup}: at least 0")


def identity(a, tok_dir: Path, world_size: int) -> dict:
    """What makes two launches the same run (a resume must match; --steps may grow; --thresholds,
    --eval-batch, --log-every, --save-every and the logging may change)."""
    cfg = Path(a.model) / "config.json"
    data = ({"dataset": a.dataset, "text_column": a.text_column, "heldout_frac": a.heldout_frac, **dataset_kwargs(a)}
            if a.dataset else {"tokens": str(a.tokens), "heldout_tokens": str(a.heldout_tokens),
                               "loss_mask": str(a.loss_mask), "heldout_loss_mask": str(a.heldout_loss_mask)}
            if a.tokens else {"corpus": str(tok_dir)})
    keys = ("gates", "add_gate", "teacher", "margin", "teacher_threshold", "objective", "epsilon", "batch", "ctx",
            "lr", "warmup", "min_lr_ratio", "clip", "precision", "eval_windows", "seed")
    return {"model": str(Path(a.model).resolve()) if Path(a.model).exists() else str(a.model),  # or a hub id
            "model_config_sha256": hashlib.sha256(cfg.read_bytes()).hexdigest()[:16] if cfg.exists() else None,
            **{k: getattr(a, k) for k in keys}, "tokenizer": str(tok_dir), "data": data, "world_size": world_size}


def main(argv=None) -> None:
    a = parse(argv)
    a.gates = a.gates or ("none" if a.add_gate else "both")
    if a.add_gate:
        a.teacher = a.teacher or "loss"
    check_model_arg(a.model)
    check_args(a)
    cli.die_with_launcher()
    if a.threads:
        torch.set_num_threads(a.threads)
    from accelerate import Accelerator
    cuda = torch.cuda.is_available()
    a.precision = ("bf16" if cuda else "no") if a.mixed_precision == "auto" else a.mixed_precision
    # accelerate's own mixed precision stays off: it would autocast the heads too (they stay float32;
    # the frozen model's autocast is frozen_autocast's). The schedule is stepped once per optimizer step
    # (accelerate's would step once per process).
    acc = Accelerator(cpu=not cuda, mixed_precision="no", step_scheduler_with_optimizer=False)
    cli.check_launch(acc, "train/distill_gate.py")
    cli.banner(acc, "train/distill_gate.py", f"gates={a.gates} frozen_model_autocast={a.precision}"
               + (f" add_gate teacher={a.teacher}" if a.add_gate else ""))
    model = load_pretrained(a.model, dtype="float32", device=acc.device)
    cfg = model.cfg
    if a.add_gate:
        check_add_gate(a, cfg)
    elif a.teacher is not None or a.teacher_threshold is not None:
        raise UserError("--teacher / --teacher-threshold train a new gate: they need --add-gate")
    elif a.gates == "none":
        raise UserError("--gates none trains nothing without --add-gate")
    teacher = cfg.exit_criterion if cfg.exit_criterion in GATE_CRITERIA else "ouro_gate" if cfg.family == "ouro" else None
    if a.add_gate:
        teacher = "learned"  # the new gate: the teacher of the heads distilled after it
    elif teacher is None or model.stock_gate() is None:
        raise UserError(f"--model {a.model}: {cfg.name} has no stock exit gate to distil from (criterion "
                        f"{cfg.exit_criterion!r}); distil_gate needs ouro_gate or learned, or --add-gate to train one")
    if cfg.r_max < 3 and a.gates in ("both", "lookahead"):
        raise UserError(f"a lookahead head needs r_max >= 3 (it predicts steps 2..r_max-1), {cfg.name} has "
                        f"{cfg.r_max}")
    for p_ in model.parameters():
        p_.requires_grad_(False)
    a.ctx = min(a.ctx, cfg.max_position)
    tok_dir = a.tokenizer or (a.model if (a.model / "tokenizer.json").exists() else TOKENIZER)
    ident = identity(a, tok_dir, acc.num_processes)
    summary_file = a.output / "distill_gate.json"
    if cli.finished_or_claimed(acc, a.output, ident, summary_file, a.steps):
        return
    if not (a.output / "run.json").exists() and a.output.exists() and any(a.output.iterdir()):
        raise UserError(f"--output {a.output} exists and is not empty (and holds no run of this script: run.json)")
    created = not a.output.exists()
    acc.wait_for_everyone()
    try:
        cli.claim_output(a.output, ident, acc.is_main_process)
        acc.wait_for_everyone()
        run(a, acc, model, teacher, tok_dir)
    except BaseException:
        if acc.is_main_process:
            cli.remove_if_unused(a.output, created)
        raise


def run(a, acc, model, teacher: str, tok_dir: Path) -> None:
    t0 = time.time()
    data = load_data(a, tok_dir, acc)
    if int(data.train.max()) >= model.cfg.vocab_size:
        raise UserError(f"the training tokens reach id {int(data.train.max())} but the model's vocabulary has "
                        f"{model.cfg.vocab_size} (another tokenizer? pass --tokenizer)")
    val, val_mask = data.eval(a.ctx, a.eval_windows), data.eval_mask(a.ctx, a.eval_windows)
    val_docs = data.eval_doc(a.ctx, a.eval_windows)
    wb = init_wandb(a.output, "looplm-distill-gate", vars(a) | {"world_size": acc.num_processes},
                    enabled=not a.no_wandb and acc.is_main_process)
    names = GATES[a.gates]
    added = None
    if a.add_gate:
        added = train_added_gate(model, a, data, val, val_mask, val_docs, acc, wb)
        if not names:
            finish_added_gate(model, a, acc, added, time.time() - t0)
            if wb is not None:
                wb.finish()
            return
    cfg = model.cfg
    torch.manual_seed(a.seed)
    heads = nn.ModuleDict()
    if "lookahead" in names:
        heads["lookahead"] = nn.Linear(cfg.hidden_size, 1)
        heads["lookahead"].load_state_dict(model.stock_gate().state_dict())  # start from the stock gate
    if "preloop" in names:
        heads["preloop"] = nn.Linear(cfg.hidden_size, cfg.r_max)
    heads = heads.float().to(acc.device)
    thresholds = a.thresholds or sorted({0.3, 0.5, 0.7} | ({cfg.exit_threshold} if cfg.exit_threshold else set()))
    opt = torch.optim.AdamW(heads.parameters(), lr=a.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_scale(s, a))
    heads, opt, sched = acc.prepare(heads, opt, sched)
    raw = acc.unwrap_model(heads)
    hist = History(a.output / "history.json")

    def step_loss(step: int) -> dict:
        w, m, d = draw(data, a, [a.seed, step, acc.process_index], acc.device)
        parts = heads_loss(model, raw, names, w, m, d, a.objective, a.epsilon, a.precision, a.frozen_batch)
        return {"loss": parts.pop("loss"), **{f"{g}_{k}": v for g, p in parts.items() for k, v in p.items()}}

    # the heads' checkpoints belong to the gate they were distilled from (a longer --add-gate run: anew)
    train_loop(a, acc, heads, opt, sched, step_loss, a.output / "checkpoints", hist, wb, "heads",
               {"gate_steps": a.steps if a.add_gate else None})
    acc.wait_for_everyone()
    if not acc.is_main_process:
        return
    out = a.output
    shutil.copytree(a.model, out, dirs_exist_ok=True)
    after = agreement(model, teacher, dict(raw.items()), val, val_mask, thresholds, val_docs, a.eval_batch, a.precision)
    # before: the teacher and the stock gate read late, which the heads do not change (one pass for both)
    before = {"tokens": after["tokens"], "thresholds": [{k: v for k, v in row.items() if k not in ("lookahead_head", "preloop")}
                                                        for row in after["thresholds"]]}
    for name in names:
        setattr(model, f"{name}_exit_gate", raw[name].to(next(model.parameters()).dtype))
    model.cfg = replace(cfg, lookahead_gate=cfg.lookahead_gate or "lookahead" in names,
                        preloop_gate=cfg.preloop_gate or "preloop" in names, gate_teacher=teacher)
    save_gates(model, out)
    if a.add_gate:
        write_exit_gate(model.exit_gate, out)
    summary = {"model": str(a.model), "output": str(out), "teacher": teacher, "gates": list(names),
               "objective": a.objective, **({"epsilon": a.epsilon} if a.objective == "oracle" else {}),
               "steps": a.steps, "batch": a.batch, "ctx": a.ctx, "lr": a.lr, "warmup": a.warmup,
               "mixed_precision": a.precision, "seconds": round(time.time() - t0, 1),
               "world_size": acc.num_processes, "data": {k: v for k, v in data.meta.items() if k != "key"},
               "before": before, "after": after, "history": hist.records, **({"add_gate": added} if added else {})}
    (out / "distill_gate.json").write_text(json.dumps(summary, indent=2) + "\n")
    if wb is not None:
        wb.log({f"agreement/{r['threshold']}/{name}/{k}": v for r in after["thresholds"] for name, c in r.items()
                if isinstance(c, dict) for k, v in c.items()})
        wb.finish()
    print(json.dumps({"output": str(out), "seconds": summary["seconds"], "agreement": after}, indent=1))


if __name__ == "__main__":
    cli.run(main)

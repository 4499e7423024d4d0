"""Fine-tune a looped LM for the shared KV layout and for a lookahead / r_min exit gate.

    accelerate launch train/shared_kv.py --model checkpoints/ouro-demo --output .cache/runs/ouro-shared
    python train/shared_kv.py ...                                  (one process, same arguments)

(a) Shared KV layout: at loop step s a decode position attends to earlier positions' exit-depth
K/V and to its own step-s K/V. Training-time attention (train/kv_emulation.py): `--pass1-sweeps`
context sweeps (the first an ordinary causal loop) record every position's exit depth and its K/V at
that depth per core layer; the loss sweep runs the loop where each core attention takes keys/values
j < p from the last context sweep and j = p fresh. The step's loss is `training_loss` (anyone can
call it). The context sweeps run with grad (`--context-grad all`, the default): the gradient is the
exact derivative of the reported loss, including the path through the other tokens' K/V that the
shared layout asks k_proj / v_proj to change (tests/test_train_gradients.py; before issue 58 the
context was detached and the k/v gradient was wrong). What stays approximate is the value: the
context is `--pass1-sweeps` sweeps from the causal start, not the sequential fixed point; how far
(exit depths that differ, logit and CE gaps) is measured every `--staleness-every` steps and
logged (`stale_*`). At the fixed point the sweeps equal the inference semantics exactly
(tests/test_train.py).
Loss: CE of the logits at each position's exit depth + `--step-loss` x mean CE over all steps.

(b) Exit gate: BCE against "CE at the exit depth minus CE at full depth < --gate-margin", where the
exit depth of the signal after step s is s (standard) or s+1 (`--lookahead`); steps whose depth is
below `--r-min` are masked. With `--target-mean-depth` the threshold is chosen at the end.

(c) Rows (`--rows FILE.npz --heldout-rows FILE.npz`, e.g. `python -m train.lab rows`): each
training row is ONE prompt + completion, as the engine serves it: the prompt runs at full depth,
depth-major (its positions attend to each other's step-s K/V, the engine's prefill), and every
completion token is an adaptive decode token. A batch takes rows of one prompt length (a bucket),
so the emulation's scalar prompt_len is exact for every row; rows shorter than the batch's longest
are padded at the END with a zero loss mask (causal attention, per-position exit depths: padding
never reaches an earlier position; tests/test_train.py). The LM loss and gate labels count the
completion tokens only (the first one comes from the prompt's last position, at full depth, as the
engine's prefill gives it). Token windows (`--tokens`, the corpus) instead run every position
after `--prompt-len` as a decode token and cut records at window edges: right for text, wrong for
prompt/answer tasks, whose prompts the engine prefills.

Checkpoints (accelerate `save_state`) go to OUTPUT/checkpoints every `--save-every` steps; a
re-launch resumes from the latest. The final model is an HF folder in OUTPUT.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import os
import shutil
import time
from typing import NamedTuple
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from looplm.config import replace
from looplm.io import load_pretrained, load_tokenizer, model_from_state, resolve_dtype, save_pretrained
from looplm.policy import ExitPolicy
from train import cli
from looplm.cli import UserError
from train.common import TOKENIZER, History, fingerprint, init_wandb, token_ce
from train.datasource import Tokens, add_dataset_args, dataset_kwargs, from_corpus, from_dataset, from_npy, summary
from train.kv_emulation import LAYOUTS, Sweep, converge, sweep
from train.packing import prompt_from_targets, prompt_positions
from train.flops import FlopCount
from train.lora import add_lora, merge_lora


def gate_logits_detached(model, state: torch.Tensor) -> torch.Tensor:
    """Gate scores whose gradient reaches only the gate head (Huginn's gate reads ln_f, an LM weight)."""
    with torch.no_grad():  # detach too: Ouro's gate_features is the state itself, returned as it is
        x = model.gate_features(state).detach()
    return model.stock_gate()(x).squeeze(-1)


@dataclass
class Rows:
    """Prompt + completion rows, one record each (`python -m train.lab rows` writes them): row i is
    ids[offsets[i]:offsets[i + 1]], its first prompt_len[i] tokens the prompt, the rest (>= 1 token,
    e.g. the answer and EOS) the completion, the only targets that count."""
    ids: np.ndarray  # int32, all rows back to back
    offsets: np.ndarray  # int64 [n + 1]
    prompt_len: np.ndarray  # int32 [n]
    meta: dict = field(default_factory=dict)
    pad_id: int = 0

    def __post_init__(self):
        n = len(self.prompt_len)
        lens = np.diff(self.offsets)
        if (len(self.offsets) != n + 1 or self.offsets[0] != 0 or self.offsets[-1] != len(self.ids)
                or (lens < 2).any() or (self.prompt_len < 1).any() or (self.prompt_len >= lens).any()):
            raise UserError("rows: malformed file (need offsets [n+1] from 0 to len(ids), every row a prompt of "
                            ">= 1 token and a completion of >= 1 token)")

    def __len__(self) -> int:
        return len(self.prompt_len)

    def row(self, i: int) -> np.ndarray:
        return self.ids[self.offsets[i]:self.offsets[i + 1]]

    @classmethod
    def from_lists(cls, rows: list[tuple[list[int], list[int]]], meta: dict | None = None) -> "Rows":
        """rows: (prompt ids, completion ids) per row."""
        ids = np.asarray([t for p, c in rows for t in p + c], dtype=np.int32)
        offsets = np.concatenate([[0], np.cumsum([len(p) + len(c) for p, c in rows])]).astype(np.int64)
        return cls(ids, offsets, np.asarray([len(p) for p, _ in rows], dtype=np.int32), meta or {})

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "wb") as f:  # a file handle: np.savez would append .npz to a path
            np.savez(f, ids=self.ids, offsets=self.offsets, prompt_len=self.prompt_len,
                     meta=np.asarray(json.dumps(self.meta)))

    @classmethod
    def load(cls, path: Path) -> "Rows":
        try:
            with np.load(path, allow_pickle=False) as z:
                return cls(z["ids"].astype(np.int32), z["offsets"].astype(np.int64), z["prompt_len"].astype(np.int32),
                           json.loads(str(z["meta"])) if "meta" in z else {})
        except (OSError, KeyError, ValueError) as e:
            raise UserError(f"--rows {path}: not a rows file ({e}); write one with `python -m train.lab rows`")

    def pack(self, idx) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Rows idx (one prompt length) as (tokens [B, T+1], target mask [B, T+1], prompt_len): padded
        at the end with pad_id, mask set on each row's completion tokens."""
        pls = {int(self.prompt_len[i]) for i in idx}
        if len(pls) != 1:
            raise ValueError(f"a batch of rows needs one prompt length, got {sorted(pls)}")
        seqs = [self.row(i) for i in idx]
        T1 = max(len(r) for r in seqs)
        tok = torch.full((len(seqs), T1), self.pad_id, dtype=torch.long)
        mask = torch.zeros(len(seqs), T1, dtype=torch.bool)
        pl = pls.pop()
        for b, r in enumerate(seqs):
            tok[b, :len(r)] = torch.from_numpy(r.astype(np.int64))
            mask[b, pl:len(r)] = True
        return tok, mask, pl

    def batch(self, batch: int, seed: list[int]) -> tuple[torch.Tensor, torch.Tensor, int]:
        """A random bucket (a row drawn uniformly, so buckets come as often as their rows), then
        `batch` rows of it (with replacement only when the bucket is smaller)."""
        rng = np.random.default_rng(seed)
        pl = self.prompt_len[rng.integers(len(self))]
        bucket = np.flatnonzero(self.prompt_len == pl)
        return self.pack(rng.choice(bucket, size=batch, replace=len(bucket) < batch))

    def buckets(self, batch: int, max_rows: int | None = None) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
        """The first max_rows rows (all: None), grouped by prompt length, in chunks of `batch`."""
        n = len(self) if max_rows is None else min(len(self), max_rows)
        out = []
        for pl in sorted(set(self.prompt_len[:n].tolist())):
            idx = np.flatnonzero(self.prompt_len[:n] == pl)
            out += [self.pack(idx[i:i + batch]) for i in range(0, len(idx), batch)]
        return out


def _ce(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per-token CE [B, T]: token_ce (float32) except for float64 logits, kept in float64 so that a
    float64 model's loss can be differenced finely (tests/test_train_gradients.py)."""
    if logits.dtype == torch.float64:
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="none").view(targets.shape)
    return token_ce(logits, targets)


def head_ce(model, hidden: torch.Tensor, targets: torch.Tensor, chunk: int = 1024) -> torch.Tensor:
    """Per-token CE [B, T] of the head's logits over `hidden` [B, T, D], `chunk` positions at a time.
    Under grad each chunk is checkpointed: its [B, chunk, V] logits are recomputed in the backward
    pass, so at most one chunk's full-vocabulary logits is alive at once (0: one chunk)."""
    T = hidden.shape[1]

    def ce(h: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return _ce(model.head(h), t)
    if not chunk or chunk >= T:
        return ce(hidden, targets)
    parts = []
    for a in range(0, T, chunk):
        h, t = hidden[:, a:a + chunk], targets[:, a:a + chunk]
        parts.append(torch.utils.checkpoint.checkpoint(ce, h, t, use_reentrant=False) if torch.is_grad_enabled()
                     else ce(h, t))
    return torch.cat(parts, dim=1)


def context_sweeps(model, x: torch.Tensor, policy: ExitPolicy, layout: str = "shared", prompt_len: int | torch.Tensor = 1,
                   pass1_sweeps: int = 2, context_grad: int | None = None, checkpoint: bool | str = False,
                   backprop_depth: int | None = None, docs: torch.Tensor | None = None) -> Sweep | None:
    """The sweeps that produce the loss sweep's context (`pass1_sweeps` of them, the first an ordinary
    causal loop). `context_grad`: how many of the LAST context sweeps run with grad (None: all). With
    all of them, the loss's gradient is the exact derivative of the loss computed (every context K/V
    carries its graph back to the weights); a smaller number truncates the path through the earlier
    sweeps (their context becomes a constant), 0 is the old detached context. Inside torch.no_grad()
    everything runs without grad, as the caller asked. A context keeps only what the next sweep
    reads: no states, no logits, and under the shared layout each position's K/V at its exit depth
    only (kv_emulation.sweep's reduce_kv)."""
    n_grad = pass1_sweeps if context_grad is None else max(0, min(int(context_grad), pass1_sweeps))
    cur = None
    for i in range(pass1_sweeps):
        with torch.set_grad_enabled(torch.is_grad_enabled() and i >= pass1_sweeps - n_grad):
            cur = sweep(model, x, policy, layout, cur, prompt_len, checkpoint=checkpoint,
                        backprop_depth=backprop_depth, logits=False, reduce_kv=layout == "shared", docs=docs)
        cur = dataclasses.replace(cur, states=[])
    return cur


@torch.no_grad()
def staleness(model, x: torch.Tensor, policy: ExitPolicy, layout: str, prompt_len: int | torch.Tensor, sw: Sweep,
              targets: torch.Tensor | None = None, mask: torch.Tensor | None = None, rows: int | None = None,
              tol: float = 1e-3, docs: torch.Tensor | None = None) -> dict:
    """How far the training sweep `sw` is from the fixed point (the engine's sequential semantics),
    over the decode positions (>= prompt_len; with `mask` [B, T] the counted targets) of the first
    `rows` rows: the share of exit depths that differ, the largest and the mean per-position max
    |logit difference| at the exit, the exit CE difference (training minus fixed point), the sweeps
    the fixed point took and the seconds spent here (the cost of measuring)."""
    t0 = time.perf_counter()
    B = x.shape[0] if rows is None else min(rows, x.shape[0])
    x = x[:B]
    docs = None if docs is None else docs[:B]
    prompt = prompt_positions(prompt_len, x.shape, docs, x.device)[:B]
    first_decode = int(prompt.sum(1).min())  # the sweeps that settle every position: T - first_decode + 2
    # tol: exit depths unchanged and logits within tol for one sweep (bit-exact settling can take T
    # sweeps in float arithmetic; 1e-3 is far below the gaps measured)
    fp, n, _ = converge(model, x, policy, layout, prompt_len=prompt if isinstance(prompt_len, torch.Tensor) else prompt_len,
                        max_sweeps=x.shape[1] - first_decode + 2, tol=tol, docs=docs)
    keep = torch.ones_like(x, dtype=torch.bool) if mask is None else mask[:B].bool().clone()
    keep &= ~prompt
    out = {"stale_depth_frac": 0.0, "stale_logit_gap": 0.0, "stale_logit_gap_mean": 0.0, "stale_ce_gap": 0.0}
    logits = sw.exit_logits[:B] if sw.exit_logits is not None else model.head(sw.exit_hidden[:B])
    if keep.any():
        gap = (logits.detach().double() - fp.exit_logits.double()).abs().amax(-1)[keep]
        out.update(stale_depth_frac=float((sw.depths[:B] != fp.depths)[keep].double().mean()),
                   stale_logit_gap=float(gap.max()), stale_logit_gap_mean=float(gap.mean()))
        if targets is not None:
            t = targets[:B]
            out["stale_ce_gap"] = float((_ce(logits.detach(), t) - _ce(fp.exit_logits, t))[keep].mean())
    out.update(fixed_point_sweeps=float(n), staleness_s=time.perf_counter() - t0)
    return out


def loss_sweep(model, ids: torch.Tensor, policy: ExitPolicy, prev: Sweep | None, layout: str = "shared",
               prompt_len: int | torch.Tensor = 1, *, docs: torch.Tensor | None = None, mask: torch.Tensor | None = None, step_loss: float = 0.5, train: str = "all",
               gate_margin: float = 0.1, gate_grad: str = "head", prompt_grad: bool = False,
               checkpoint: bool | str = False, backprop_depth: int | None = None, ce_chunk: int = 1024,
               measure_staleness: bool = False, staleness_rows: int | None = 2) -> dict:
    """The loss sweep against the context `prev` and the losses: a dict with "loss" (what the run
    reports and backpropagates) and its parts (see training_loss)."""
    x, tgt = ids[:, :-1], ids[:, 1:]
    tm = None if mask is None else mask[:, 1:]
    xd = None if docs is None else docs[:, :-1]
    prompt = prompt_positions(prompt_len, x.shape, xd, x.device)
    sw = sweep(model, x, policy, layout, prev, prompt_len, step_hidden=True, checkpoint=checkpoint,
               prompt_grad=prompt_grad, backprop_depth=backprop_depth, logits=False, record_core=False, docs=xd)
    ce_exit = head_ce(model, sw.exit_hidden, tgt, ce_chunk)
    ce_steps = torch.stack([head_ce(model, h, tgt, ce_chunk) for h in sw.step_hidden])  # [S, B, T]
    lm = masked_mean(ce_exit, tm) + step_loss * masked_mean(ce_steps, tm)
    out = {"lm": lm, "ce_exit": masked_mean(ce_exit, tm).detach(), "ce_full": masked_mean(ce_steps[-1], tm).detach(),
           "mean_depth": decode_mean(sw.depths.double(), tm, prompt)}
    if train in ("all", "gate") and model.gate_logits(sw.states[0][:1, :1]) is not None:
        S = len(sw.states)
        gl = (lambda st: gate_logits_detached(model, st)) if gate_grad == "head" else model.gate_logits
        g = torch.stack([gl(st) for st in sw.states[:-1]])  # [S-1, B, T]
        shift = 1 if policy.lookahead else 0
        c = ce_steps.detach()
        depth_ce = torch.cat([c[shift:], c[-1:].expand(shift, *c.shape[1:])])[:-1]  # CE at the depth signalled
        labels = (depth_ce - c[-1:] < gate_margin).double()
        depth = torch.arange(1, S, device=g.device)[:, None, None] + shift
        gmask = ((depth >= policy.r_min) & (depth < S)).expand_as(g).clone()
        gmask &= ~prompt[None]
        if tm is not None:
            gmask &= tm[None]
        bce = F.binary_cross_entropy_with_logits(g.double(), labels, reduction="none")
        out["gate"] = (bce * gmask).sum() / gmask.sum().clamp(min=1)
        out["stop_frac"] = (labels * gmask).sum() / gmask.sum().clamp(min=1)
        out["_gate_labels"] = labels.bool()
    else:
        out["gate"] = torch.zeros((), dtype=torch.float64, device=ids.device)
    out["loss"] = (lm if train in ("all", "lm") else 0.0) + out["gate"].to(lm.dtype)
    out["_depths"] = sw.depths
    if measure_staleness:
        out.update(staleness(model, x, policy, layout, prompt_len, sw, tgt, tm, staleness_rows, docs=xd))
    return out


def training_loss(model, ids: torch.Tensor, policy: ExitPolicy, layout: str = "shared",
                  prompt_len: int | torch.Tensor = 1, *, docs: torch.Tensor | None = None, mask: torch.Tensor | None = None, step_loss: float = 0.5, train: str = "all",
                  gate_margin: float = 0.1, pass1_sweeps: int = 2, context_grad: int | None = None,
                  gate_grad: str = "head", prompt_grad: bool = False, checkpoint: bool | str = False,
                  backprop_depth: int | None = None, ce_chunk: int = 1024,
                  measure_staleness: bool = False, staleness_rows: int | None = 2,
                  parts: dict | None = None) -> torch.Tensor:
    """The loss of one training step of train/shared_kv.py, the tensor the run reports and backpropagates.

    ids: [B, T+1] token windows (inputs ids[:, :-1], targets ids[:, 1:]); mask [B, T+1]: the tokens
    that count as targets (None: all); positions < prompt_len are a full-depth prompt. `docs` [B, T+1]:
    the documents packed into each window (train/packing.py: positions restart, no attention across
    them; prompt_len then counts per document, or is a bool [B, T] of the inputs' prompt positions,
    packing.prompt_from_targets); a packed window is then the same computation as its documents run
    one by one. The policy
    gives the exits (criterion, threshold, r_min, lookahead). `pass1_sweeps` context sweeps
    (context_sweeps), then the loss sweep: CE at each position's exit depth + `step_loss` x mean CE
    over all steps (train "all"/"lm"), + the exit gate's BCE (train "all"/"gate"; labels: the CE at
    the depth signalled within `gate_margin` of full depth's).

    What reaches the parameters is the derivative of this loss, with two named exceptions:
    - `context_grad` (default None: every context sweep carries grad, nothing truncated): the number
      of last context sweeps with grad; fewer cut the path through the earlier sweeps' K/V (0: the
      context is a constant, the behaviour before issue 58; k/v projections then learn only from each
      token's own fresh K/V, measured in train/README.md).
    - `gate_grad` (default "head"): the gate's BCE reaches the gate head only (its input state is
      detached, Huginn's ln_f too): the LM is not bent to make its own exits easier to predict. "all":
      the BCE's full derivative reaches every parameter.
    Exit depths and gate labels are discrete: piecewise constant in the weights, no gradient (a
    finite difference small enough not to flip one sees none either).

    `prompt_grad` matters only with context_grad=0 (kv_emulation.sweep). `checkpoint`: activation
    checkpointing per core step. `measure_staleness`: the fixed point is computed (no grad) on the
    first `staleness_rows` rows and the loss sweep compared with it (`staleness`). `parts`: filled
    with the parts the run logs (lm, ce_exit, ce_full, mean_depth, gate, stop_frac, the staleness)
    and, under keys starting with "_", the discrete decisions (exit depths, gate labels)."""
    if gate_grad not in ("head", "all"):
        raise ValueError(f"gate_grad must be 'head' or 'all', not {gate_grad!r}")
    prev = context_sweeps(model, ids[:, :-1], policy, layout, prompt_len, pass1_sweeps, context_grad, checkpoint,
                          backprop_depth, None if docs is None else docs[:, :-1])
    out = loss_sweep(model, ids, policy, prev, layout, prompt_len, docs=docs, mask=mask, step_loss=step_loss, train=train,
                     gate_margin=gate_margin, gate_grad=gate_grad, prompt_grad=prompt_grad, checkpoint=checkpoint,
                     backprop_depth=backprop_depth, ce_chunk=ce_chunk,
                     measure_staleness=measure_staleness, staleness_rows=staleness_rows)
    if parts is not None:
        parts.update(out)
    return out["loss"]


def fixed_point_loss(model, ids: torch.Tensor, policy: ExitPolicy, layout: str = "shared", prompt_len: int = 1,
                     **options) -> torch.Tensor:
    """training_loss at the exact fixed point: T context sweeps (the dependency is causal, so T
    sweeps reach the sequential semantics exactly, values and derivatives), all with grad."""
    options = {k: v for k, v in options.items() if k not in ("pass1_sweeps", "context_grad")}
    return training_loss(model, ids, policy, layout, prompt_len, pass1_sweeps=ids.shape[1] - 1, context_grad=None,
                         **options)


def loss_options(a: argparse.Namespace) -> dict:
    """training_loss's options from the script's arguments."""
    cg = a.context_grad
    if cg not in (None, "all") and not (str(cg).isdigit()):
        raise UserError(f"--context-grad {cg!r}: 'all' or a number of sweeps (0: the context detached)")
    return {"step_loss": a.step_loss, "train": a.train, "gate_margin": a.gate_margin, "pass1_sweeps": a.pass1_sweeps,
            "context_grad": None if a.context_grad in (None, "all") else int(a.context_grad),
            "gate_grad": a.gate_grad, "prompt_grad": prompt_grad(a), "checkpoint": a.gradient_checkpointing,
            "backprop_depth": a.backprop_depth, "ce_chunk": a.ce_chunk}


class SharedKVObjective(nn.Module):
    """Wraps the model so DDP/FSDP see one forward: mode "step" (the training loop's) returns
    training_loss's parts (the loss under "loss"); "pass1" / "pass2" split it in two calls (the context
    sweeps, then the loss sweep against them), the same computation."""

    def __init__(self, model, a: argparse.Namespace, policy: ExitPolicy):
        super().__init__()
        self.model, self.a, self.policy = model, a, policy
        self.autocast: str | None = None  # the autocast dtype seen in the first forward (mixed precision)

    def forward(self, batch: torch.Tensor, prev: Sweep | None = None, mode: str = "step",
                mask: torch.Tensor | None = None, prompt_len: int | None = None, measure_staleness: bool = False,
                docs: torch.Tensor | None = None):
        """`mask` [B, T+1] (--loss-mask, rows, --dataset): the windows' tokens that count as targets (None:
        all); `prompt_len`: the batch's full-depth prompt positions (default --prompt-len; rows: the
        bucket's); `docs` [B, T+1]: packed documents (--dataset), each with its own prompt: through the
        position that predicts its first counted token (a chat's first reply), at least --prompt-len."""
        a, m, pol = self.a, self.model, self.policy
        pl = a.prompt_len if prompt_len is None else prompt_len
        if docs is not None and not isinstance(pl, torch.Tensor):
            pl = prompt_from_targets(None if mask is None else mask[:, 1:], docs[:, :-1], pl)
        if self.autocast is None:
            dev = batch.device.type
            self.autocast = str(torch.get_autocast_dtype(dev)) if torch.is_autocast_enabled(dev) else "off"
        opts = loss_options(a)
        if mode == "pass1":
            return context_sweeps(m, batch[:, :-1], pol, a.layout, pl, opts["pass1_sweeps"], opts["context_grad"],
                                  opts["checkpoint"], opts["backprop_depth"], None if docs is None else docs[:, :-1])
        staleness_rows = getattr(a, "staleness_rows", 2)
        if mode == "pass2":
            opts = {k: v for k, v in opts.items() if k not in ("pass1_sweeps", "context_grad")}
            out = loss_sweep(m, batch, pol, prev, a.layout, pl, docs=docs, mask=mask, measure_staleness=measure_staleness,
                             staleness_rows=staleness_rows, **opts)
        else:
            out = {}
            training_loss(m, batch, pol, a.layout, pl, docs=docs, mask=mask, measure_staleness=measure_staleness,
                          staleness_rows=staleness_rows, parts=out, **opts)
        return {k: v for k, v in out.items() if not k.startswith("_")}


@contextlib.contextmanager
def flop_counter(enabled: bool):
    """A FLOP count around one training step (None when not enabled): train.flops.FlopCount, torch's
    per-op formulas without FlopCounterMode's module tracking (which kept the checkpointed layers'
    activations alive: 4.5x the step's peak at 1,024 tokens)."""
    if not enabled:
        yield None
        return
    with FlopCount() as fc:
        yield fc


# dense bf16 peak FLOP/s by device name, for the MFU the log reports (--peak-tflops overrides)
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0, "L40S": 362.0, "A10G": 125.0}


def throughput(tokens: int, seconds: float, flops_per_token: float | None, peak_tflops: float | None,
               gpus: int) -> dict:
    """tokens/s over all ranks (training steps only: evaluation and saving excluded), FLOPs per
    trained token (measured on the launch's first step: forward, backward and every recomputation),
    and on CUDA the MFU against the device's dense bf16 peak."""
    out = {"tokens_per_s": tokens / seconds if seconds > 0 else 0.0}
    if flops_per_token is not None:
        out["flops_per_token"] = flops_per_token
        peak = peak_tflops
        if peak is None and torch.cuda.is_available():
            name = torch.cuda.get_device_name()
            peak = next((v for k, v in PEAK_TFLOPS.items() if k in name), None)
        if peak:
            out["mfu"] = flops_per_token * out["tokens_per_s"] / (peak * 1e12 * gpus)
    return out


def masked_mean(x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Mean of x [..., B, T] over the positions where mask [B, T] is set (all without a mask)."""
    if mask is None:
        return x.mean()
    m = mask.expand_as(x)
    return (x * m).sum() / m.sum().clamp(min=1)


def prompt_grad(a: argparse.Namespace) -> bool:
    """--prompt-grad: default on with --rows (whose prompts are whole records' prompts), off otherwise."""
    return a.prompt_grad == "on" or (a.prompt_grad == "auto" and getattr(a, "rows", None) is not None)


def decode_mean(x: torch.Tensor, mask: torch.Tensor | None, prompt_len: int | torch.Tensor) -> torch.Tensor:
    """Mean of x [B, T] over the decode positions (>= prompt_len, or not in a bool [B, T] prompt) that are
    targets (mask [B, T]; None: all)."""
    keep = torch.ones_like(x, dtype=torch.bool) if mask is None else mask.bool().clone()
    keep &= ~prompt_positions(prompt_len, x.shape, None, x.device)
    # no data-dependent shapes nor host reads: no GPU sync per step (0 when nothing is kept)
    return (x * keep).sum() / keep.sum().clamp(min=1)


def policy_for(cfg, a: argparse.Namespace, threshold: float | None = None) -> ExitPolicy:
    return ExitPolicy.from_config(cfg, criterion=a.criterion, threshold=threshold if threshold is not None else a.threshold,
                                  r_min=a.r_min, lookahead=a.lookahead)


@torch.no_grad()
def quick_eval(model, windows: torch.Tensor, a, policy: ExitPolicy, layout: str,
               masks: torch.Tensor | None = None, docs: torch.Tensor | None = None) -> dict:
    """Held-out ppl / mean depth under `layout` after `--eval-sweeps` sweeps (evaluate.py is exact)
    over the decode positions; with `masks` (--heldout-loss-mask, --dataset) the counted targets only,
    with `docs` the packed documents kept apart, each with its own prompt (SharedKVObjective.forward)."""
    ce, depth = [], []
    for i in range(0, len(windows), a.batch):
        w = windows[i:i + a.batch].to(model.device)
        x, tgt = w[:, :-1], w[:, 1:]
        tm = None if masks is None else masks[i:i + a.batch, 1:].to(model.device)
        d = None if docs is None else docs[i:i + a.batch, :-1].to(model.device)
        pl = a.prompt_len if d is None else prompt_from_targets(tm, d, a.prompt_len)
        cur = None
        for _ in range(a.eval_sweeps if layout != "full_depth" else 1):
            cur = sweep(model, x, policy, layout, cur, pl, docs=d)
        keep = (torch.ones_like(tgt, dtype=torch.bool) if tm is None else tm.bool()) & \
            ~prompt_positions(pl, x.shape, d, x.device)
        ce.append(token_ce(cur.exit_logits, tgt)[keep])
        depth.append(cur.depths[keep].double())
    return {"ppl": float(torch.cat(ce).mean().exp()), "mean_depth": float(torch.cat(depth).mean())}


@torch.no_grad()
def rows_eval(model, held: Rows, a, policy: ExitPolicy, layout: str) -> dict:
    """Held-out rows under `layout`, exact (sweeps to the fixed point, as serving decodes): CE and
    mean exit depth over the completion targets, and teacher-forced exact match (every target the
    argmax at its exit depth; equal to greedy decoding's exact match at that fixed point)."""
    ce, depth, em = [], [], []
    for tok, mask, pl in held.buckets(a.batch, a.eval_windows):
        tok, mask = tok.to(model.device), mask.to(model.device)
        ids, tgt, tm = tok[:, :-1], tok[:, 1:], mask[:, 1:]
        cur, _, _ = converge(model, ids, policy, layout, prompt_len=pl, max_sweeps=ids.shape[1] - pl + 2)
        ce.append(token_ce(cur.exit_logits, tgt)[tm])
        dec = tm.clone()
        dec[:, :pl] = False
        depth.append(cur.depths[dec].double())
        em.append(((cur.exit_logits.argmax(-1) == tgt) | ~tm).all(-1).double())
    return {"ppl": float(torch.cat(ce).mean().exp()), "mean_depth": float(torch.cat(depth).mean()),
            "em": float(torch.cat(em).mean())}


def held_eval(model, val, a, policy: ExitPolicy, layout: str, masks=None, docs=None) -> dict:
    return rows_eval(model, val, a, policy, layout) if isinstance(val, Rows) else \
        quick_eval(model, val, a, policy, layout, masks, docs)


def choose_threshold(model, windows, a, masks=None, docs=None) -> tuple[float, list[dict]]:
    grid = []
    for q in [round(x, 2) for x in np.arange(0.05, 0.99, 0.05)]:
        r = held_eval(model, windows, a, policy_for(model.cfg, a, q), a.layout, masks, docs)
        grid.append({"threshold": q, **r})
    best = min(grid, key=lambda r: abs(r["mean_depth"] - a.target_mean_depth))
    return best["threshold"], grid


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
    p.add_argument("--pass1-sweeps", type=int, default=2,
                   help="context sweeps before the loss sweep (the first a causal loop); see --staleness-every")
    p.add_argument("--context-grad", default="all",
                   help="how many of the last context sweeps carry grad: all (default: the gradient is the exact "
                        "derivative of the reported loss) or a number (0: the context detached, as before issue 58)")
    p.add_argument("--gate-grad", choices=["head", "all"], default="head",
                   help="the gate BCE's gradient: head (default: the gate head only, its input state detached) or all")
    p.add_argument("--staleness-every", type=int, default=10,
                   help="every N steps compare the training sweep with the fixed point (no grad; logged as stale_*); 0: never")
    p.add_argument("--staleness-rows", type=int, default=2, help="rows of the batch the staleness is measured on")
    p.add_argument("--max-stale-depth", type=float, default=None,
                   help="bound on the share of exit depths that differ from the fixed point: when a staleness "
                        "measurement (largest over ranks) exceeds it, --pass1-sweeps grows by one (up to "
                        "--max-pass1-sweeps) for the rest of the run; default: off")
    p.add_argument("--max-pass1-sweeps", type=int, default=8)
    p.add_argument("--min-pass1-sweeps", type=int, default=None,
                   help="with --max-stale-depth: a staleness measurement with no exit depth off the fixed point "
                        "takes one context sweep away (down to this many); default: never fewer")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="the GPU's dense bf16 peak for the logged MFU (default: known by device name on CUDA)")
    p.add_argument("--prompt-len", type=int, default=1, help="positions run as a full-depth prompt")
    p.add_argument("--prompt-grad", choices=["auto", "on", "off"], default="auto",
                   help="pass 2 reads the prompt's context K/V from a fresh pass over the prompt, with grad (same "
                        "values; the decode tokens' loss reaches the prompt's K/V); auto: on with --rows")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=8, help="per process and micro-batch")
    p.add_argument("--grad-accum", type=int, default=1,
                   help="micro-batches of --batch per optimizer step (accelerate's accumulate): one step sees "
                        "batch x grad-accum x processes sequences; --steps, the lr schedule and the logs count "
                        "optimizer steps")
    p.add_argument("--ctx", type=int, default=128)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--gate-lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--wd", type=float, default=0.0)
    p.add_argument("--clip", type=float, default=1.0)
    add_dataset_args(p)  # --dataset and its format, loss and packing options (train/datasource.py)
    p.add_argument("--tokens", type=Path, help=".npy token ids to train on (default: the built corpus)")
    p.add_argument("--heldout-tokens", type=Path, help=".npy held-out token ids")
    p.add_argument("--loss-mask", type=Path, help=".npy aligned with --tokens: nonzero where a token counts as a "
                   "target (LM loss, gate labels), e.g. a task's answers only (python -m train.lab tokens --mask-out)")
    p.add_argument("--heldout-loss-mask", type=Path, help="the same for --heldout-tokens (the held-out ppl)")
    p.add_argument("--rows", type=Path, help=".npz of prompt + completion rows (python -m train.lab rows): one record "
                   "per row, the prompt at full depth as the engine prefills it, loss on the completion; batches of "
                   "one prompt length (see the module docstring); instead of --tokens / --dataset")
    p.add_argument("--heldout-rows", type=Path, help="held-out rows for --rows (held-out ppl, depth, exact match; "
                   "--eval-windows of them)")
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
    p.add_argument("--save-dtype", default="bfloat16",
                   help="dtype of the saved model (default bfloat16, the releases'; float32 keeps the trained weights exactly)")
    p.add_argument("--max-shard-size", default="5GB",
                   help="the saved model's safetensors shard limit (HF spelling: 5GB, 500MB, or bytes); a larger "
                        "model is written as shards with model.safetensors.index.json")
    p.add_argument("--mixed-precision", choices=["no", "bf16", "fp16"], default=None,
                   help="autocast (default: the launcher's / accelerate config's, else bf16 on CUDA (TF32 on) "
                        "and no on CPU)")
    p.add_argument("--gradient-checkpointing", action="store_true",
                   help="activation checkpointing per layer and loop step: each layer's activations are recomputed "
                        "in the backward pass (only its input is kept)")
    p.add_argument("--backprop-depth", type=int, default=None,
                   help="truncated backprop: only the last K loop steps of each sweep carry grad (Huginn's "
                        "mean_backprop_depth recipe); default: every step")
    p.add_argument("--lora-rank", type=int, default=0,
                   help="train LoRA adapters of this rank (peft) on every attention and MLP projection instead "
                        "of the LM weights (frozen); the gate heads train fully; merged into the saved model; "
                        "0 (default): full fine-tuning")
    p.add_argument("--lora-alpha", type=float, default=None, help="LoRA scale numerator (default: 2 x rank)")
    p.add_argument("--ce-chunk", type=int, default=1024,
                   help="positions per chunk of the loss's cross-entropy: each chunk's full-vocabulary logits are "
                        "recomputed in the backward pass, never all alive at once (0: no chunking)")
    p.add_argument("--no-wandb", action="store_true")
    p.add_argument("--debug", action="store_true", help="tracebacks instead of one-line errors")
    return p.parse_args(argv)


def check_model_arg(model: Path) -> None:
    """A missing --model fails before anything is created (no empty --output left behind)."""
    if model.exists():
        if not (model / "config.json").exists():
            raise UserError(f"--model {model}: the folder has no config.json (not an HF-format looped LM)")
        return
    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes")
    if offline or str(model).startswith((".", "/", "~")) or str(model).count("/") != 1:
        raise UserError(f"--model {model}: no such folder" + (" (hub ids need HF_HUB_OFFLINE unset)" if offline else ""))


def load_data(a, tokenizer_dir: Path, acc) -> Tokens | tuple[Rows, Rows]:
    """The training data named by `a` (train/distill_gate.py shares it and has no --rows)."""
    if getattr(a, "rows", None) is not None:
        if a.heldout_rows is None or a.dataset is not None or a.tokens is not None:
            raise UserError("--rows needs --heldout-rows and no --dataset / --tokens")
        return Rows.load(a.rows), Rows.load(a.heldout_rows)
    if a.dataset is not None:
        data = from_dataset(a.dataset, a.text_column, tokenizer_dir, a.ctx, a.heldout_frac,
                            is_main=acc.is_main_process, wait=acc.wait_for_everyone, **dataset_kwargs(a))
        acc.print(summary(data.meta))
        return data
    if a.tokens is not None:
        return from_npy(a.tokens, a.heldout_tokens, a.loss_mask, a.heldout_loss_mask)
    train, held = from_corpus(("train", "heldout"), tokenizer_dir)
    return Tokens(train, held, meta={"source": "corpus", "train_tokens": int(len(train))})


def identity(a, tokenizer_dir: Path, world_size: int) -> dict:
    """What makes two launches the same run (a resume must match; --steps may grow)."""
    cfg = Path(a.model) / "config.json"
    data = ({"rows": str(a.rows), "heldout_rows": str(a.heldout_rows)} if a.rows else
            {"dataset": a.dataset, "text_column": a.text_column, "heldout_frac": a.heldout_frac, **dataset_kwargs(a)}
            if a.dataset else
            {"tokens": str(a.tokens), "heldout_tokens": str(a.heldout_tokens)} if a.tokens else {"corpus": str(tokenizer_dir)})
    keys = ("layout", "train", "criterion", "threshold", "r_min", "lookahead", "gate_margin", "step_loss", "pass1_sweeps",
            "context_grad", "gate_grad", "max_stale_depth", "prompt_len", "prompt_grad", "batch", "ctx", "lr", "gate_lr", "warmup", "wd", "clip", "seed", "dtype")
    return {"model": str(Path(a.model).resolve()) if Path(a.model).exists() else str(a.model),
            "model_config_sha256": hashlib.sha256(cfg.read_bytes()).hexdigest()[:16] if cfg.exists() else None,
            **{k: getattr(a, k) for k in keys}, "data": data, "world_size": world_size,
            # only when set: runs from before these settings (no such keys) stay resumable
            **{k: getattr(a, k) for k, default in LATER_KEYS.items() if getattr(a, k) != default}}


# settings added after runs existed, with their defaults (identity: recorded only when not the default)
LATER_KEYS = {"grad_accum": 1, "backprop_depth": None, "lora_rank": 0, "lora_alpha": None, "min_pass1_sweeps": None}


def local_param_bytes(module: nn.Module) -> int:
    """Bytes of the parameters this rank holds (an FSDP rank: its shard; DDP: the whole model)."""
    from torch.distributed.tensor import DTensor
    seen, total = set(), 0
    flat = [m for m in module.modules() if hasattr(m, "_flat_param") or type(m).__name__ == "FlatParameter"]
    for p in module.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        t = p.to_local() if isinstance(p, DTensor) else p  # FSDP2: a DTensor whose local part is this rank's shard
        total += t.numel() * t.element_size()
    if flat:  # FSDP1 (use_orig_params): the original params are views; count the local flat shards
        shards = {id(m._flat_param): m._flat_param for m in flat if getattr(m, "_flat_param", None) is not None}
        total = sum(fp._local_shard.numel() * fp._local_shard.element_size() if hasattr(fp, "_local_shard")
                    else fp.numel() * fp.element_size() for fp in shards.values())
    return int(total)


def choose_mixed_precision(cuda: bool, flag: str | None, launcher: str | None) -> str:
    """The autocast mode: --mixed-precision, else the launcher's choice, else bf16 on CUDA (the
    releases' dtype; halves activations and runs on tensor cores) and no on CPU."""
    if flag is not None:
        return flag
    if launcher is not None:
        return launcher
    return "bf16" if cuda else "no"


def shard_bytes(size: str) -> int:
    """HF's max_shard_size spelling ("5GB", "500MB", "10KB", "5GiB", or bytes) in bytes."""
    s = str(size).strip().upper()
    for unit, mult in (("GIB", 2 ** 30), ("MIB", 2 ** 20), ("KIB", 2 ** 10), ("GB", 10 ** 9), ("MB", 10 ** 6),
                       ("KB", 10 ** 3), ("B", 1)):
        if s.endswith(unit):
            s, scale = s[:-len(unit)], mult
            break
    else:
        scale = 1
    try:
        n = int(float(s) * scale)
    except ValueError:
        n = 0
    if n <= 0:
        raise UserError(f"--max-shard-size {size!r}: a size such as 5GB, 500MB or a number of bytes")
    return n


def check_output_arg(output: Path, model: Path) -> None:
    """The input folder is never written: --output may be neither --model nor inside it."""
    if model.exists():
        out, src = output.resolve(), model.resolve()
        if out == src or src in out.parents:
            raise UserError(f"--output {output} is {'--model' if out == src else 'inside --model'} ({model}): "
                            "the input folder is never written; pass another --output")


class Micro(NamedTuple):
    """One micro-batch: windows [B, T+1], their loss mask and documents (None: all count / one
    document per window) and the prompt (an int, or the inputs' bool [B, T] prompt positions)."""
    batch: torch.Tensor
    mask: torch.Tensor | None
    prompt_len: int | torch.Tensor
    docs: torch.Tensor | None = None


def optimizer_step(acc, obj, opt, sched, micros: list, clip: float, stale: bool = False) -> list[dict]:
    """One optimizer step over `micros`, the --grad-accum micro-batches (Micro or its tuple):
    accelerate's accumulate scales each loss by 1/N and syncs gradients (DDP / FSDP) on the last one
    only; the optimizer and the lr schedule step once. Returns each micro-batch's loss parts (floats);
    the staleness is measured on the first."""
    outs = []
    for i, mb in enumerate(Micro(*m) for m in micros):
        with acc.accumulate(obj):
            out = obj(mb.batch, mask=mb.mask, prompt_len=mb.prompt_len, docs=mb.docs, measure_staleness=stale and i == 0)
            acc.backward(out["loss"])
            if acc.sync_gradients:
                for m in fsdp2_units(obj):  # the gathered blocks' parameters hold no gradient: the shards do
                    m.reshard()
                acc.clip_grad_norm_(obj.parameters(), clip)
            opt.step()  # accelerate's optimizer skips the step (and zero_grad) until the last micro-batch
            opt.zero_grad(set_to_none=True)
        outs.append({k: float(v.detach()) if torch.is_tensor(v) else float(v) for k, v in out.items()})
    if not acc.sync_gradients:
        raise RuntimeError(f"{len(micros)} micro-batches do not end an accumulation of {acc.gradient_accumulation_steps}")
    sched.step()
    return outs


def fsdp2_units(obj: nn.Module) -> list[nn.Module]:
    """FSDP2's units (one per block and the root), set to stay gathered from their first forward until
    the optimizer step: the shared layout's gradient reaches a block's K/V projections through the next
    sweep's attention, outside the block's forward, and FSDP2 re-gathers a block for backward only
    when the gradient reaches the block's outputs (its pre-backward hook): resharded blocks fail there
    ("setStorage: ... storage of size 0"). Gradients are still reduce-scattered per block and the
    optimizer state and the weights between steps stay sharded. [] without FSDP2."""
    from torch.distributed.fsdp import FSDPModule
    units = [m for m in obj.modules() if isinstance(m, FSDPModule)]
    for m in units:
        m.set_reshard_after_forward(False, recurse=False)
        m.set_reshard_after_backward(False, recurse=False)
    return units


def main(argv=None) -> None:
    a = parse(argv)
    check_model_arg(a.model)
    check_output_arg(a.output, a.model)
    if a.grad_accum < 1:
        raise UserError(f"--grad-accum {a.grad_accum}: at least 1")
    shard_bytes(a.max_shard_size)
    cli.die_with_launcher()
    if a.threads:
        torch.set_num_threads(a.threads)
    from accelerate import Accelerator
    from accelerate.utils import DistributedType
    cuda = torch.cuda.is_available()
    if cuda:  # TF32 matmuls on Ampere+ (float32 weights' matmuls, the optimizer's): ~10 bits of mantissa
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    # the scheduler is stepped by hand once per optimizer step (accelerate's would step once per
    # process: the lr decayed num_processes times too fast on several ranks)
    acc = Accelerator(cpu=not cuda, mixed_precision=choose_mixed_precision(cuda, a.mixed_precision,
                                                                           cli.launcher_mixed_precision()),
                      gradient_accumulation_steps=a.grad_accum, step_scheduler_with_optimizer=False)
    cli.check_launch(acc, "train/shared_kv.py")
    cli.fsdp_on_cpu(acc)
    fsdp = acc.distributed_type == DistributedType.FSDP
    cli.banner(acc, "train/shared_kv.py", f"gradient_checkpointing={a.gradient_checkpointing} grad_accum={a.grad_accum}")
    tok_dir = a.tokenizer or (a.model if (a.model / "tokenizer.json").exists() else TOKENIZER)
    ident = identity(a, tok_dir, acc.num_processes)
    summary_file = a.output / "summary.json"
    if cli.finished_or_claimed(acc, a.output, ident, summary_file, a.steps):
        return
    if not (a.output / "run.json").exists() and summary_file.exists():
        acc.print(f"already finished: {a.output} holds a finished run (summary.json); pass a new --output")
        return
    created = not a.output.exists()
    acc.wait_for_everyone()
    try:
        cli.claim_output(a.output, ident, acc.is_main_process)
        acc.wait_for_everyone()
        train(a, acc, tok_dir, fsdp)
    except BaseException:
        if acc.is_main_process:
            cli.remove_if_unused(a.output, created)
        raise


def train(a, acc, tok_dir: Path, fsdp: bool) -> None:
    model = load_pretrained(a.model, dtype=a.dtype, device=acc.device)
    if a.criterion is None and model.cfg.exit_criterion == "ouro_gate" and a.train != "lm":
        a.criterion = "learned"  # the BCE gate is a per-step "stop now" head, not Ouro's CDF
    policy = policy_for(model.cfg, a)
    if not policy.adaptive:
        raise UserError(f"criterion {policy.criterion!r} with threshold {policy.threshold} never exits; "
                        "pass --criterion/--threshold")
    data = load_data(a, tok_dir, acc)
    rows = isinstance(data, tuple)
    if rows:
        data, val = data
        val_mask, val_docs, top = None, None, int(max(data.ids.max(), val.ids.max()))
        meta = {"source": "rows", "rows": str(a.rows), "n_rows": len(data), "heldout_rows": str(a.heldout_rows),
                "n_heldout": len(val), "rows_meta": data.meta, "heldout_meta": val.meta}
    else:
        val, val_mask = data.eval(a.ctx, a.eval_windows), data.eval_mask(a.ctx, a.eval_windows)
        val_docs = data.eval_doc(a.ctx, a.eval_windows)
        if val_docs is not None and prompt_grad(a):
            raise UserError("--prompt-grad on needs one prompt per row (--rows); --dataset packs documents, "
                            "each with its own prompt")
        top, meta = int(data.train.max()), data.meta
    if top >= model.cfg.vocab_size:
        raise UserError(f"the training tokens reach id {top} but the model's vocabulary has "
                        f"{model.cfg.vocab_size} (another tokenizer? pass --tokenizer)")
    gate_names = {n for n, _ in model.named_parameters() if "exit_gate" in n}
    for n, p in model.named_parameters():
        p.requires_grad_(a.train == "all" or (a.train == "gate") == (n in gate_names))
    if a.lora_rank:  # the LM part trains through adapters only; the gate heads stay fully trainable
        if fsdp:
            raise UserError("--lora-rank is the single-GPU option (frozen base weights): launch it without FSDP")
        add_lora(model, a.lora_rank, a.lora_alpha)
        for n, p in model.named_parameters():
            p.requires_grad_((".lora_" in n and a.train != "gate") or (n in gate_names and a.train != "lm"))
    hist = History(a.output / "history.json")
    ck = latest_ckpt(a.output)
    if ck is None and acc.is_main_process and a.eval_windows:
        model.eval()
        rec = {"step": 0, **{f"{lay}_{k}": v for lay in (a.layout, "last_exited")
                             for k, v in held_eval(model, val, a, policy, lay, val_mask, val_docs).items()}}
        hist.records = []
        hist.log(rec)
        acc.print(json.dumps(rec))
    lm_p = [p for n, p in model.named_parameters() if p.requires_grad and n not in gate_names]
    gate_p = [p for n, p in model.named_parameters() if p.requires_grad and n in gate_names]
    groups = [g for g in ({"params": lm_p, "lr": a.lr, "weight_decay": a.wd},
                          {"params": gate_p, "lr": a.gate_lr, "weight_decay": 0.0}) if g["params"]]
    opt = torch.optim.AdamW(groups, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / a.warmup) * max(0.1, 1.0 - s / max(1, a.steps)))
    obj = SharedKVObjective(model, a, policy)
    # FSDP's transformer-based wrap (train/configs/*fsdp*.yaml, no class names there): one unit per
    # block; accelerate reads the class names from `_no_split_modules` and keeps the ones present
    obj._no_split_modules = ["OuroLayer", "SandwichBlock", "RavenBlock"]
    obj, opt, sched = acc.prepare(obj, opt, sched)
    fsdp2_units(obj)  # FSDP2: blocks stay gathered through a step (see there)
    param_bytes = local_param_bytes(obj)
    cfg0 = model.cfg

    def full_model():
        """The whole model on the main rank, None elsewhere (a collective under FSDP: every rank calls
        it). FSDP ranks hold shards only: the full weights are gathered to the main rank's CPU into a
        model built for this call (no full copy kept between evaluations)."""
        if not fsdp:
            return acc.unwrap_model(obj).model
        if getattr(acc.state.fsdp_plugin, "fsdp_version", 1) == 2:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
            inner = acc.unwrap_model(obj).model
            state = get_model_state_dict(inner, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        else:  # FSDP1: summon_full_params is the gather that works on gloo (get_state_dict gave shard views)
            from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
            with FSDP.summon_full_params(obj, writeback=False):
                inner = acc.unwrap_model(obj).model
                state = {k: v.detach().cpu().clone() for k, v in inner.state_dict().items()} if acc.is_main_process else {}
        if not acc.is_main_process:
            return None
        return model_from_state(cfg0, dict(state), a.dtype, "cpu").eval()

    wb = init_wandb(a.output, "looplm-shared-kv", vars(a) | {"world_size": acc.num_processes},
                    enabled=not a.no_wandb and acc.is_main_process)
    step = 0
    if ck is not None:
        acc.load_state(str(ck))
        meta_ck = json.loads((ck / "meta.json").read_text())
        step = meta_ck["step"]
        a.pass1_sweeps = meta_ck.get("pass1_sweeps", a.pass1_sweeps)  # as --max-stale-depth left it
        hist.truncate(step)
        acc.print(f"resumed from {ck} at step {step}")
    t0, ran, logs, first_batch = time.time(), 0, [], None
    window_tokens, train_s, flops_per_token = 0, 0.0, None  # throughput of the steps in the log window
    while step < a.steps and (a.max_steps_this_run is None or ran < a.max_steps_this_run):
        micros = []
        for micro in range(a.grad_accum):
            # micro-batch 0 keeps the seed of the runs before --grad-accum (same data at --grad-accum 1)
            seed = [a.seed, step, acc.process_index] + ([micro] if micro else [])
            if rows:
                mb = Micro(*data.batch(a.batch, seed))
            else:
                mb = Micro(data.batch(a.batch, a.ctx, seed), data.batch_mask(a.batch, a.ctx, seed), a.prompt_len,
                           data.batch_doc(a.batch, a.ctx, seed))
            micros.append(Micro(*(x.to(acc.device) if torch.is_tensor(x) else x for x in mb)))
        if first_batch is None:
            first_batch = micros[0][0].tolist()
        obj.train()
        stale = bool(a.staleness_every) and (step + 1) % a.staleness_every == 0
        t_step = time.perf_counter()
        with flop_counter(ran == 0) as fc:  # FLOPs of one whole step (recomputations included), once a launch
            outs = optimizer_step(acc, obj, opt, sched, micros, a.clip, stale)  # training_loss's parts per micro-batch
        tokens = sum(int(mb.batch[:, 1:].numel()) for mb in micros)  # the targets this rank trained on
        if fc is not None:
            flops_per_token = fc.flops / tokens
        train_s += time.perf_counter() - t_step
        window_tokens += tokens * acc.num_processes
        # the step's record: the mean over its micro-batches (the staleness: micro-batch 0's)
        out = {k: float(np.mean([o[k] for o in outs if k in o])) for k in dict.fromkeys(k for o in outs for k in o)}
        out["pass1_sweeps"] = a.pass1_sweeps
        if stale and a.max_stale_depth is not None:
            worst = float(acc.reduce(torch.tensor(float(out["stale_depth_frac"]), device=acc.device), "max"))
            if worst > a.max_stale_depth and a.pass1_sweeps < a.max_pass1_sweeps:
                a.pass1_sweeps += 1  # the staleness bound: one more context sweep from the next step on
                acc.print(f"step {step + 1}: stale depth share {worst:.3f} > {a.max_stale_depth}: "
                          f"--pass1-sweeps now {a.pass1_sweeps}")
            elif worst == 0.0 and a.min_pass1_sweeps is not None and a.pass1_sweeps > a.min_pass1_sweeps:
                a.pass1_sweeps -= 1  # no exit depth off the fixed point: try one sweep fewer (measured again)
                acc.print(f"step {step + 1}: stale depth share 0: --pass1-sweeps now {a.pass1_sweeps}")
        step, ran = step + 1, ran + 1
        logs.append(out)
        if step % a.log_every == 0 or step == a.steps:
            keys = list(dict.fromkeys(k for x in logs for k in x))  # the staleness keys: on measured steps only
            rec = {"step": step, **{k: float(np.mean([x[k] for x in logs if k in x])) for k in keys},
                   "time_s": round(time.time() - t0, 1), **throughput(window_tokens, train_s, flops_per_token, a.peak_tflops, acc.num_processes)}
            logs, window_tokens, train_s = [], 0, 0.0
            if a.eval_every and (step % a.eval_every == 0 or step == a.steps):
                m = full_model()
                if acc.is_main_process:
                    m.eval()
                    rec.update({f"{lay}_{k}": v for lay in (a.layout, "last_exited")
                                for k, v in held_eval(m, val, a, policy, lay, val_mask, val_docs).items()})
            if acc.is_main_process:
                hist.log(rec)
                if wb is not None:
                    wb.log(rec, step=step)
            acc.print(json.dumps(rec))
        if step % a.save_every == 0 or step == a.steps:
            d = a.output / "checkpoints" / f"step_{step:06d}"
            acc.save_state(str(d))
            if acc.is_main_process:
                (d / "meta.json").write_text(json.dumps({"step": step, "pass1_sweeps": a.pass1_sweeps}))
                cks = sorted((a.output / "checkpoints").glob("step_*"), key=lambda c: int(c.name.split("_")[1]))
                for old in cks[:-a.keep]:
                    shutil.rmtree(old, ignore_errors=True)
            acc.wait_for_everyone()
    if step < a.steps:
        acc.print(f"stopped at step {step} of {a.steps} (--max-steps-this-run); re-launch to resume")
        return
    model = full_model()
    # every rank's view of the weights: DDP ranks hold full replicas; FSDP ranks hold shards, so
    # their fingerprint is the gathered model's (main rank) and the shard sizes are recorded instead
    prints = acc.gather_for_metrics([fingerprint(model) if model is not None else None], use_gather_object=True)
    bytes_per_rank = acc.gather_for_metrics([param_bytes], use_gather_object=True)
    autocast = acc.gather_for_metrics([acc.unwrap_model(obj).autocast], use_gather_object=True)
    if not acc.is_main_process:
        return
    model = model.eval()
    cfg_kw = {"r_min": a.r_min, "exit_criterion": policy.criterion, "exit_threshold": policy.threshold}
    summary = {"steps": step, "rank_fingerprints": [p for p in prints if p is not None],
               "world_size": acc.num_processes, "distributed_type": acc.distributed_type.value,
               "mixed_precision": acc.mixed_precision, "autocast": autocast[0],
               "gradient_checkpointing": a.gradient_checkpointing,
               "rank_param_bytes": bytes_per_rank, "model_param_bytes": sum(p.numel() * p.element_size()
                                                                             for p in {id(p): p for p in model.parameters()}.values()),
               "layout": a.layout, "lookahead": a.lookahead, "pass1_sweeps_final": a.pass1_sweeps,
               "context_grad": a.context_grad, "gate_grad": a.gate_grad,
               "data": {k: v for k, v in meta.items() if k != "key"}, "first_batch_rank0": first_batch}
    stale = [k for k in ("lookahead_gate", "preloop_gate") if getattr(model.cfg, k, False)]
    if stale:  # heads distilled (train/distill_gate.py) from the model before this fine-tuning
        cfg_kw.update({k: False for k in stale})
        summary["dropped_distilled_gates"] = stale
        print(f"note: the distilled heads {stale} were distilled from the model before this run; not saved "
              "(re-run train/distill_gate.py on the output)")
    if a.target_mean_depth is not None:
        q, grid = choose_threshold(model, val, a, val_mask, val_docs)
        cfg_kw["exit_threshold"] = q
        summary.update(threshold_grid=grid, chosen_threshold=q)
    if {"exit_lookahead", "kv_layout"} <= {f.name for f in dataclasses.fields(model.cfg)}:
        model.cfg = replace(model.cfg, **cfg_kw, exit_lookahead=a.lookahead, kv_layout=a.layout)
    else:  # an older LoopConfig: the keys ride in `extra`
        model.cfg = replace(model.cfg, **cfg_kw, extra={**model.cfg.extra, "exit_lookahead": a.lookahead,
                                                       "kv_layout": a.layout})
    limit = shard_bytes(a.max_shard_size)
    size = sum(v.numel() * torch.empty((), dtype=resolve_dtype(a.save_dtype)).element_size()
               for v in model.state_dict().values())
    # one model.safetensors when it fits the limit (as HF writes it), else shards and an index
    if a.lora_rank:
        merge_lora(model)  # a plain folder: the adapters folded into the weights the engine loads
    save_pretrained(model, a.output, dtype=a.save_dtype, tokenizer=load_tokenizer(a.model),
                    max_shard_bytes=limit if size > limit else None)
    (a.output / "summary.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps({k: v for k, v in summary.items() if k not in ("threshold_grid", "first_batch_rank0")}))
    if wb is not None:
        wb.finish()

if __name__ == "__main__":
    cli.run(main)

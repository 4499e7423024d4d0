"""Teacher-forced emulation of the engine's KV layouts over whole sequences, in parallel.

The engine decodes token by token: at loop step s, position p attends to the *stored* K/V of the
positions before it (`shared`: each one's exit-depth K/V; `last_exited`: its step-min(s, d_j) K/V)
and to its own fresh step-s K/V. Stored K/V depend on the earlier positions' own exits, so the
exact computation is sequential. Here it is a fixed-point iteration of parallel sweeps:

- sweep 0 runs the ordinary causal loop (every position sees every position's step-s K/V);
- sweep k runs the loop again where each core attention takes the context K/V (positions j < p)
  from sweep k-1 at the layout's depth for j, and position p's own fresh step-s K/V.

Position j's result is exact once sweeps have settled positions < j; in practice a few sweeps
reach the fixed point, which is the sequential result (it is unique: the dependency is causal).
`converge` iterates until exit depths and logits stop changing; tests check it against
looplm.reference.reference_generate in float64.

Training (train/shared_kv.py: `training_loss`) runs `pass1_sweeps` context sweeps, then the loss
sweep against the last one. A sweep never detaches its context: the context K/V carry whatever graph
`prev` carries, so when the context sweeps run with grad the loss's gradient is the exact derivative
of the loss computed (the path through the other tokens' K/V included, which is what the shared
layout asks k_proj / v_proj to change). Cutting it is the caller's named choice (`context_grad`).
The approximation left is the value: the context is `pass1_sweeps` sweeps from the causal start, not
the fixed point (its staleness is measured during training).

Positions < `prompt_len` are prompt: full depth, attending depth-major to each other's fresh
step-s K/V (the engine's prefill). The coda (Huginn) is not looped: a token's coda attends to the
earlier positions' coda K/V from their exit states; per-step logits (kl criterion) do the same.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import torch.utils.checkpoint

from kv_layouts import LAYOUTS as ENGINE_LAYOUTS
from looplm.layers import causal_attend
from looplm.model import LoopedLM
from looplm.policy import ExitPolicy
from train.common import checkpointed_step, exit_depths, layer_checkpointing
from train.packing import doc_attend, doc_positions, prompt_positions, same_doc

LAYOUTS = tuple(sorted(ENGINE_LAYOUTS))  # the engine's layouts, each emulated exactly below


SCORE_CHUNK = 1024  # positions per chunk of the no-grad criterion scores that need logits (kl, entropy_diff)


@dataclass
class Sweep:
    states: list[torch.Tensor]  # s_1..s_S, each [B, T, D]
    scores: torch.Tensor | None  # [S, B, T] criterion scores (None: full depth)
    depths: torch.Tensor  # [B, T] exit depth of each position
    # per core layer: K, V [S, B, T, KVH, Dh]; with kv_at_depth, [1, B, T, KVH, Dh]: each position's
    # K/V at its exit depth only (sweep(..., reduce_kv=True), the shared layout's context)
    core_kv: list[tuple[torch.Tensor, torch.Tensor]]
    coda_kv: list[tuple[torch.Tensor, torch.Tensor]]  # per coda layer: K, V [B, T, KVH, Dh] (exit states)
    exit_logits: torch.Tensor | None  # [B, T, V] (sweep(..., logits=True))
    step_hidden: list[torch.Tensor] | None = None  # per step what the head reads [B, T, D], when asked for
    exit_hidden: torch.Tensor | None = None  # [B, T, D] what the head reads at each position's exit depth
    kv_at_depth: bool = False


def context_mask(T: int, prompt_len: int | torch.Tensor, device, docs: torch.Tensor | None = None) -> torch.Tensor:
    """[T, 2T] keys each query attends to over [fresh K/V; context K/V]: a decode query p >= prompt_len
    its own fresh K/V and the context K/V of j < p; a prompt query the fresh K/V of j <= p.
    With packed documents (`docs` [B, T], train/packing.py) or per-position prompts (`prompt_len` a
    bool [B, T]): [B, 1, T, 2T], the same inside each document and nothing across documents."""
    p = torch.arange(T, device=device)[:, None]
    j = torch.arange(T, device=device)[None, :]
    if docs is None and not isinstance(prompt_len, torch.Tensor):
        fresh = (j == p) | ((p < prompt_len) & (j <= p))
        return torch.cat([fresh, (j < p) & (p >= prompt_len)], dim=1)
    B = docs.shape[0] if docs is not None else prompt_len.shape[0]
    prompt = prompt_positions(prompt_len, (B, T), docs, device)[:, None, :, None]  # [B, 1, T(query), 1]
    same = same_doc(docs) if docs is not None else torch.ones(1, 1, T, T, dtype=torch.bool, device=device)
    fresh = ((j == p) | (prompt & (j <= p))) & same
    return torch.cat([fresh, (j < p) & ~prompt & same], dim=-1)


def context_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor,
                   prompt_len: int, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Query p attends to context K/V (kc, vc) at positions j < p and to its own fresh (k, v);
    queries in the prompt (p < prompt_len) attend to the fresh K/V of every j <= p instead.
    q: [B, T, H, Dh]; k, v, kc, vc: [B, T, KVH, Dh]. One SDPA over the 2T keys with a mask
    (`context_mask`, built once per sweep when given): no T x T scores are kept for the backward
    pass by the fused kernels (flash on CPU, memory-efficient on CUDA)."""
    T = q.shape[1]
    if mask is None:
        mask = context_mask(T, prompt_len, q.device)
    keys = torch.cat([k, kc], dim=1).transpose(1, 2)
    values = torch.cat([v, vc], dim=1).transpose(1, 2)
    y = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=mask,
                                       enable_gqa=q.shape[2] != k.shape[2])
    return y.transpose(1, 2)


class _Recorder:
    """attend_for over a sweep: records every core/coda K/V and mixes in the context."""

    def __init__(self, layout: str, prev: Sweep | None, prompt_len: int | torch.Tensor, record_core: bool = True,
                 docs: torch.Tensor | None = None):
        self.layout, self.prev, self.prompt_len, self.record_core = layout, prev, prompt_len, record_core
        self.docs = docs
        # the attention without a context: causal, inside each document when documents are packed
        self.plain = causal_attend if docs is None else doc_attend(docs)
        self.core: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self.coda: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        # off once the sweep ends: a layer recomputed in the backward pass (checkpointing) records nothing
        self.recording = True
        self._mask: torch.Tensor | None = None

    def context(self, layer: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        K, V = self.prev.core_kv[layer]  # [S, B, T, KVH, Dh] ([1, ...] at depth)
        if self.prev.kv_at_depth:
            if self.layout != "shared":
                raise ValueError(f"a context reduced to exit depths serves the shared layout only, not {self.layout!r}")
            return K[0], V[0]
        d = self.prev.depths
        if self.layout == "last_exited":
            d = d.clamp(max=step)
        idx = (d - 1)[None, :, :, None, None].expand(1, *K.shape[1:])
        return K.gather(0, idx)[0], V.gather(0, idx)[0]

    def mask(self, q: torch.Tensor) -> torch.Tensor:
        if self._mask is None:
            self._mask = context_mask(q.shape[1], self.prompt_len, q.device, self.docs)
        return self._mask

    def fixed(self, step: int, coda_mode: str):
        """attend_for at loop `step` (0: outside the loop) with `coda_mode` "exit" (the exit-state coda,
        recorded) or "step" (per-step logits against the context's coda K/V). Both are fixed when the
        attend functions are made: a checkpointed recomputation in the backward pass sees them too."""
        def attend_for(stage: str, layer: int):
            def attend(q, k, v):
                if stage == "core":
                    if self.recording and self.record_core:
                        self.core.setdefault(layer, []).append((k, v))
                    if self.prev is None or self.layout == "full_depth":
                        return self.plain(q, k, v)
                    return context_attend(q, k, v, *self.context(layer, step), self.prompt_len, self.mask(q))
                if stage == "coda":
                    if coda_mode == "exit":
                        if self.recording:
                            self.coda[layer] = (k, v)
                    elif self.prev is not None:
                        return context_attend(q, k, v, *self.prev.coda_kv[layer], self.prompt_len, self.mask(q))
                return self.plain(q, k, v)
            return attend
        return attend_for

    def __call__(self, stage: str, layer: int):  # the prelude's attend_for
        return self.fixed(0, "exit")(stage, layer)


@torch.no_grad()
def _scores(model: LoopedLM, policy: ExitPolicy, prev_state, state, hidden, prev_hidden, aux):
    """Criterion scores [B, T] of one step (no grad) and what the next step's needs (aux). `hidden`:
    what the head reads at this step (criteria on logits: kl, entropy_diff), turned into logits
    SCORE_CHUNK positions at a time (never [B, T, V] in float64 at once)."""
    c = policy.criterion
    if c in ("ouro_gate", "learned"):
        return model.gate_logits(state).detach().double(), None
    if c == "latent_diff":
        return ((prev_state - state).double().norm(dim=-1) / state.double().norm(dim=-1)).detach(), None
    if c not in ("kl", "entropy_diff"):
        return None, None
    out = []
    for a in range(0, hidden.shape[1], SCORE_CHUNK):
        logp = F.log_softmax(model.head(hidden[:, a:a + SCORE_CHUNK]).double(), dim=-1)
        if c == "kl":
            if prev_hidden is None:
                prev = torch.full_like(logp, -math.log(logp.shape[-1]))
            else:
                prev = F.log_softmax(model.head(prev_hidden[:, a:a + SCORE_CHUNK]).double(), dim=-1)
            out.append((prev.exp() * (prev - logp)).sum(-1))
        else:
            out.append(-(logp.exp() * logp).sum(-1))
    sc = torch.cat(out, dim=1)
    if c == "kl":
        return sc, None
    return (sc - (aux if aux is not None else torch.full_like(sc, 100.0))).abs(), sc


def sweep(model: LoopedLM, ids: torch.Tensor, policy: ExitPolicy, layout: str = "shared", prev: Sweep | None = None,
          prompt_len: int | torch.Tensor = 1, step_hidden: bool = False, checkpoint: bool | str = False,
          prompt_grad: bool = False, backprop_depth: int | None = None, logits: bool = True, record_core: bool = True,
          reduce_kv: bool = False, docs: torch.Tensor | None = None) -> Sweep:
    """One parallel pass of the loop over ids [B, T] (see the module docstring). Runs with or
    without grad, as the caller's context decides. Context K/V from `prev` are used as they are:
    if `prev` ran with grad, the gradient flows into it (nothing is detached here; a caller that
    wants a truncated gradient passes a `prev` computed without grad, see shared_kv.training_loss).
    `checkpoint`: activation checkpointing, True / "layer" per core layer and loop step (and the
    per-step coda), "step" per loop step. `backprop_depth` K: only the last K loop steps carry grad
    (the earlier ones run without it and their state is a constant: truncated backprop, Huginn's
    recipe). `logits`: also the [B, T, V] exit logits (a loss computes them in chunks from
    exit_hidden instead). `step_hidden`: keep what the head reads after every step. `record_core`:
    record the core K/V (a loss sweep's are never read). `reduce_kv`: keep each position's core K/V
    at its exit depth only (the shared layout's context), never all steps stacked.
    `prompt_grad` (with a `prev` whose K/V carry no grad): the prompt's context K/V come from a
    fresh pass over the prompt alone, with grad: the same values (a prompt never depends on a sweep:
    full depth, fresh depth-major attention), but the loss of the positions after it now reaches the
    prompt's K/V (e.g. the final-step K/V that `shared` decode tokens read). A `prev` with grad
    already carries that path, and the fresh pass is skipped.
    `docs` [B, T]: the documents packed into each row (train/packing.py): positions restart and no
    attention crosses a boundary; an int `prompt_len` is then every document's, and a bool [B, T]
    `prompt_len` names the prompt positions themselves (each a leading run of its document)."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; supported: {LAYOUTS}")
    if checkpoint not in (False, True, "layer", "step"):
        raise ValueError(f"checkpoint must be False, True / 'layer' or 'step', not {checkpoint!r}")
    S, T = policy.r_max, ids.shape[1]
    per_position = docs is not None or isinstance(prompt_len, torch.Tensor)
    if prompt_grad and per_position:
        raise ValueError("prompt_grad needs one document per row with one prompt length (rows), not packed documents")
    if backprop_depth is not None and backprop_depth < 1:
        raise ValueError(f"backprop_depth must be >= 1 (or None: every step), not {backprop_depth}")
    if prev is not None:
        core, coda = list(prev.core_kv), list(prev.coda_kv)
        prev_has_grad = any(k.requires_grad for k, _ in core)
        if prompt_grad and not prev_has_grad and prompt_len > 0 and layout != "full_depth" and torch.is_grad_enabled():
            P = min(prompt_len, T)
            # (reduced as prev is: the prompt runs at full depth, its context is its last step's)
            pre = sweep(model, ids[:, :P], policy, layout, None, P, checkpoint=checkpoint,
                        backprop_depth=backprop_depth, logits=False, reduce_kv=prev.kv_at_depth)
            core = [(torch.cat([pk, k[:, :, P:]], 2), torch.cat([pv, v[:, :, P:]], 2))
                    for (pk, pv), (k, v) in zip(pre.core_kv, core)]
            coda = [(torch.cat([pk, k[:, P:]], 1), torch.cat([pv, v[:, P:]], 1)) for (pk, pv), (k, v) in zip(pre.coda_kv, coda)]
        prev = dataclasses.replace(prev, core_kv=core, coda_kv=coda, step_hidden=None)
    grad = torch.is_grad_enabled()
    first_grad = 0 if backprop_depth is None else max(0, S - backprop_depth)
    by_layer = checkpoint in (True, "layer") and grad
    rec = _Recorder(layout, prev, prompt_len, record_core, docs)
    rope = model.rope(doc_positions(docs) if docs is not None else torch.arange(T, device=ids.device))
    need_hidden = step_hidden or policy.criterion in ("kl", "entropy_diff")
    states, scores, hidden_list, aux, prev_hidden = [], [], [], None, None
    with layer_checkpointing(model, by_layer):
        state, inj = model.prelude(ids, rope, rec)
        for s in range(1, S + 1):
            with torch.set_grad_enabled(grad and s > first_grad):
                new = checkpointed_step(model, state, inj, rope, rec.fixed(s, "exit"), checkpoint == "step")
            if not (grad and s > first_grad):
                new = new.detach()
            hidden = None
            if need_hidden:
                hidden = _coda(model, new, rope, rec.fixed(s, "step"), by_layer)
                hidden_list.append(hidden)
            sc, aux = _scores(model, policy, state, new, hidden, prev_hidden, aux)
            if sc is not None:
                scores.append(sc)
            states.append(new)
            state, prev_hidden = new, hidden
        sc = torch.stack(scores) if scores and policy.adaptive else None
        if sc is None:
            depths = torch.full(ids.shape, S, dtype=torch.long, device=ids.device)
        else:
            depths = exit_depths(sc.cpu(), policy).to(ids.device)
        if per_position:  # the prompt runs at full depth
            depths = torch.where(prompt_positions(prompt_len, ids.shape, docs, ids.device), S, depths)
        else:
            depths[:, :prompt_len] = S
        st = torch.stack(states)  # [S, B, T, D]
        exit_state = st.gather(0, (depths - 1)[None, :, :, None].expand(1, *st.shape[1:]))[0]
        exit_hidden = model.coda(exit_state, rope, rec.fixed(0, "exit"))
    rec.recording = False
    # the recorder outlives the sweep (checkpointed layers keep its attend functions for their
    # recomputation): hand its recorded K/V over and empty it, one layer at a time, so that no
    # step's K/V stays alive through it, nor twice at once
    core_kv = []
    for l in sorted(rec.core):
        ks, vs = zip(*rec.core.pop(l))
        core_kv.append((_at_depth(ks, depths), _at_depth(vs, depths)) if reduce_kv else (torch.stack(ks), torch.stack(vs)))
        del ks, vs
    coda_kv = [rec.coda.pop(l) for l in sorted(rec.coda)]
    return Sweep(states, sc, depths, core_kv, coda_kv, model.head(exit_hidden) if logits else None,
                 hidden_list if step_hidden else None, exit_hidden, kv_at_depth=reduce_kv)


def _at_depth(per_step: tuple[torch.Tensor, ...], depths: torch.Tensor) -> torch.Tensor:
    """[1, B, T, ...]: each position's entry of per_step (one [B, T, ...] per loop step) at its exit
    depth, without stacking the steps (torch.where's backward keeps only the condition)."""
    out = per_step[0]
    for s in range(1, len(per_step)):
        pick = (depths > s).view(*depths.shape, *([1] * (out.dim() - depths.dim())))
        out = torch.where(pick, per_step[s], out)
    return out[None]


def _coda(model: LoopedLM, state: torch.Tensor, rope, attend_for, checkpoint: bool) -> torch.Tensor:
    """A step's coda (per-step logits), checkpointed with the layers: only its input is kept."""
    if checkpoint and torch.is_grad_enabled() and model.cfg.n_coda > 0:  # (Ouro's coda is the identity)
        return torch.utils.checkpoint.checkpoint(model.coda, state, rope, attend_for, use_reentrant=False)
    return model.coda(state, rope, attend_for)


@torch.no_grad()
def converge(model: LoopedLM, ids: torch.Tensor, policy: ExitPolicy, layout: str, prompt_len: int | torch.Tensor = 1,
             max_sweeps: int = 12, tol: float = 1e-5, docs: torch.Tensor | None = None) -> tuple[Sweep, int, float]:
    """Sweeps until exit depths and logits stop changing. Returns (sweep, sweeps run, last change)."""
    cur = sweep(model, ids, policy, layout, None, prompt_len, docs=docs)
    if layout == "full_depth":
        return cur, 1, 0.0
    change = float("inf")
    for n in range(2, max_sweeps + 1):
        nxt = sweep(model, ids, policy, layout, cur, prompt_len, docs=docs)
        change = (nxt.exit_logits - cur.exit_logits).abs().max().item()
        same_depths = bool((nxt.depths == cur.depths).all())
        cur = nxt
        if same_depths and change <= tol:
            return cur, n, change
    return cur, max_sweeps, change

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

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kv_layouts import LAYOUTS as ENGINE_LAYOUTS
from looplm.layers import causal_attend
from looplm.model import LoopedLM
from looplm.policy import ExitPolicy
from train.common import checkpointed_step, exit_depths

LAYOUTS = tuple(sorted(ENGINE_LAYOUTS))  # the engine's layouts, each emulated exactly below


@dataclass
class Sweep:
    states: list[torch.Tensor]  # s_1..s_S, each [B, T, D]
    scores: torch.Tensor | None  # [S, B, T] criterion scores (None: full depth)
    depths: torch.Tensor  # [B, T] exit depth of each position
    core_kv: list[tuple[torch.Tensor, torch.Tensor]]  # per core layer: K, V [S, B, T, KVH, Dh]
    coda_kv: list[tuple[torch.Tensor, torch.Tensor]]  # per coda layer: K, V [B, T, KVH, Dh] (exit states)
    exit_logits: torch.Tensor  # [B, T, V]
    step_logits: list[torch.Tensor] | None  # per step [B, T, V], when asked for


def context_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor,
                   prompt_len: int) -> torch.Tensor:
    """Query p attends to context K/V (kc, vc) at positions j < p and to its own fresh (k, v);
    queries in the prompt (p < prompt_len) attend to the fresh K/V of every j <= p instead.
    q: [B, T, H, Dh]; k, v, kc, vc: [B, T, KVH, Dh]."""
    B, T, H, Dh = q.shape
    rep = H // k.shape[2]

    def heads(x: torch.Tensor) -> torch.Tensor:  # [B, T, KVH, Dh] -> [B, H, T, Dh]
        return x.transpose(1, 2).repeat_interleave(rep, dim=1)

    qh, kh, vh, kch, vch = q.transpose(1, 2), heads(k), heads(v), heads(kc), heads(vc)
    p = torch.arange(T, device=q.device)[:, None]
    j = torch.arange(T, device=q.device)[None, :]
    fresh = (j == p) | ((p < prompt_len) & (j <= p))  # [T, T]
    scale = Dh ** -0.5
    scores = torch.where(fresh, qh @ kh.transpose(-1, -2), qh @ kch.transpose(-1, -2)) * scale
    scores = scores.masked_fill(j > p, float("-inf"))
    # half precision: softmax in fp32, as SDPA does
    a = torch.softmax(scores.float() if q.dtype in (torch.float16, torch.bfloat16) else scores, dim=-1).to(q.dtype)
    out = (a * fresh) @ vh + (a * ~fresh) @ vch
    return out.transpose(1, 2)


class _Recorder:
    """attend_for over a sweep: records every core/coda K/V and mixes in the context."""

    def __init__(self, layout: str, prev: Sweep | None, prompt_len: int):
        self.layout, self.prev, self.prompt_len = layout, prev, prompt_len
        self.step = 0  # current core step (1-based); 0 outside the loop
        self.core: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self.coda: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.coda_mode = "exit"  # "exit": the exit-state coda (recorded); "step": per-step logits

    def context(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        K, V = self.prev.core_kv[layer]  # [S, B, T, KVH, Dh]
        d = self.prev.depths
        if self.layout == "last_exited":
            d = d.clamp(max=self.step)
        idx = (d - 1)[None, :, :, None, None].expand(1, *K.shape[1:])
        return K.gather(0, idx)[0], V.gather(0, idx)[0]

    def __call__(self, stage: str, layer: int):
        def attend(q, k, v):
            if stage == "core":
                self.core.setdefault(layer, []).append((k, v))
                if self.prev is None or self.layout == "full_depth":
                    return causal_attend(q, k, v)
                return context_attend(q, k, v, *self.context(layer), self.prompt_len)
            if stage == "coda":
                if self.coda_mode == "exit":
                    self.coda[layer] = (k, v)
                elif self.prev is not None:
                    return context_attend(q, k, v, *self.prev.coda_kv[layer], self.prompt_len)
            return causal_attend(q, k, v)
        return attend


def _scores(model: LoopedLM, policy: ExitPolicy, prev_state, state, logits, aux):
    c = policy.criterion
    if c in ("ouro_gate", "learned"):
        return model.gate_logits(state).detach().double(), None
    if c == "latent_diff":
        return ((prev_state - state).double().norm(dim=-1) / state.double().norm(dim=-1)).detach(), None
    if c in ("kl", "entropy_diff"):
        logp = F.log_softmax(logits.detach().double(), dim=-1)
        if c == "kl":
            prev = aux if aux is not None else torch.full_like(logp, -torch.log(torch.tensor(logp.shape[-1], dtype=logp.dtype)))
            return (prev.exp() * (prev - logp)).sum(-1), logp
        ent = -(logp.exp() * logp).sum(-1)
        return (ent - (aux if aux is not None else torch.full_like(ent, 100.0))).abs(), ent
    return None, None


def sweep(model: LoopedLM, ids: torch.Tensor, policy: ExitPolicy, layout: str = "shared", prev: Sweep | None = None,
          prompt_len: int = 1, step_logits: bool = False, checkpoint: bool = False, prompt_grad: bool = False) -> Sweep:
    """One parallel pass of the loop over ids [B, T] (see the module docstring). Runs with or
    without grad, as the caller's context decides. Context K/V from `prev` are used as they are:
    if `prev` ran with grad, the gradient flows into it (nothing is detached here; a caller that
    wants a truncated gradient passes a `prev` computed without grad, see shared_kv.training_loss).
    `checkpoint`: activation checkpointing per core step (the recomputation restores the step).
    `prompt_grad` (with a `prev` whose K/V carry no grad): the prompt's context K/V come from a
    fresh pass over the prompt alone, with grad: the same values (a prompt never depends on a sweep:
    full depth, fresh depth-major attention), but the loss of the positions after it now reaches the
    prompt's K/V (e.g. the final-step K/V that `shared` decode tokens read). A `prev` with grad
    already carries that path, and the fresh pass is skipped."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; supported: {LAYOUTS}")
    if prev is not None:
        core, coda = list(prev.core_kv), list(prev.coda_kv)
        prev_has_grad = any(k.requires_grad for k, _ in core)
        if prompt_grad and not prev_has_grad and prompt_len > 0 and layout != "full_depth" and torch.is_grad_enabled():
            P = min(prompt_len, ids.shape[1])
            pre = sweep(model, ids[:, :P], policy, layout, None, P, checkpoint=checkpoint)
            core = [(torch.cat([pk, k[:, :, P:]], 2), torch.cat([pv, v[:, :, P:]], 2))
                    for (pk, pv), (k, v) in zip(pre.core_kv, core)]
            coda = [(torch.cat([pk, k[:, P:]], 1), torch.cat([pv, v[:, P:]], 1)) for (pk, pv), (k, v) in zip(pre.coda_kv, coda)]
        prev = Sweep(prev.states, prev.scores, prev.depths, core, coda, prev.exit_logits, None)
    S, T = policy.r_max, ids.shape[1]
    rec = _Recorder(layout, prev, prompt_len)
    rope = model.rope(torch.arange(T, device=ids.device))
    state, inj = model.prelude(ids, rope, rec)
    need_logits = step_logits or policy.criterion in ("kl", "entropy_diff")
    states, scores, logits_list, aux = [], [], [], None
    for s in range(1, S + 1):
        rec.step = s
        new = checkpointed_step(model, state, inj, rope, rec, checkpoint, before=lambda s=s: setattr(rec, "step", s))
        logits = None
        if need_logits:
            rec.coda_mode = "step"
            logits = model.head(model.coda(new, rope, rec))
            logits_list.append(logits)
        sc, aux = _scores(model, policy, state, new, logits, aux)
        if sc is not None:
            scores.append(sc)
        states.append(new)
        state = new
    rec.step, rec.coda_mode = 0, "exit"
    sc = torch.stack(scores) if scores and policy.adaptive else None
    if sc is None:
        depths = torch.full(ids.shape, S, dtype=torch.long, device=ids.device)
    else:
        depths = exit_depths(sc.cpu(), policy).to(ids.device)
    depths[:, :prompt_len] = S  # the prompt runs at full depth
    st = torch.stack(states)  # [S, B, T, D]
    exit_state = st.gather(0, (depths - 1)[None, :, :, None].expand(1, *st.shape[1:]))[0]
    exit_logits = model.head(model.coda(exit_state, rope, rec))
    core_kv = [(torch.stack([k for k, _ in rec.core[l]]), torch.stack([v for _, v in rec.core[l]]))
               for l in sorted(rec.core)]
    coda_kv = [rec.coda[l] for l in sorted(rec.coda)]
    return Sweep(states, sc, depths, core_kv, coda_kv, exit_logits, logits_list if step_logits else None)


@torch.no_grad()
def converge(model: LoopedLM, ids: torch.Tensor, policy: ExitPolicy, layout: str, prompt_len: int = 1,
             max_sweeps: int = 12, tol: float = 1e-5) -> tuple[Sweep, int, float]:
    """Sweeps until exit depths and logits stop changing. Returns (sweep, sweeps run, last change)."""
    cur = sweep(model, ids, policy, layout, None, prompt_len)
    if layout == "full_depth":
        return cur, 1, 0.0
    change = float("inf")
    for n in range(2, max_sweeps + 1):
        nxt = sweep(model, ids, policy, layout, cur, prompt_len)
        change = (nxt.exit_logits - cur.exit_logits).abs().max().item()
        same_depths = bool((nxt.depths == cur.depths).all())
        cur = nxt
        if same_depths and change <= tol:
            return cur, n, change
    return cur, max_sweeps, change

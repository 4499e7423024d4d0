"""Stage functions over a flat batch of tokens: the one implementation of the math that the
reference decoder and the engine's runner both call.

A `TokenBatch` holds N tokens that may belong to different sequences and sit at different loop
depths. Attention writes each token's K/V into the KV layout first, then reads:
- prefill (`seq_ids` set): the fresh K/V of the same prompt, causally (depth-major prefill: at
  step s every prompt position attends to the prompt's step-s K/V); nothing is read from the cache;
- decode (`ctx_rows` set): the layout's slots for positions 0..pos of its own sequence, at its own
  loop step (depth-indexed) or the last written state (shared).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kv_layouts import KVLayout
from looplm.exits import OUTPUT_CRITERIA, step_scores
from looplm.layers import Attend
from looplm.model import LoopedLM


@dataclass
class TokenBatch:
    ids: torch.Tensor  # [N] token ids (read by the prelude)
    positions: torch.Tensor  # [N]
    rows: torch.Tensor  # [N] KV rows written (the layout's scratch row for padding)
    steps: torch.Tensor  # [N] loop step (1-based) of each item in a core step
    seq_ids: torch.Tensor | None = None  # prefill: [N] which prompt each token belongs to
    ctx_rows: torch.Tensor | None = None  # decode: [N, L] rows of positions 0..pos (padded)
    ctx_len: torch.Tensor | None = None  # decode: [N] valid entries of ctx_rows
    # memoised per batch (they depend on positions / context only, not on the loop step), so a
    # runner that reuses a batch across consecutive core steps computes them once
    _rope: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)
    _mask: torch.Tensor | None = field(default=None, repr=False)

    def rope(self, model: LoopedLM) -> tuple[torch.Tensor, torch.Tensor]:
        if self._rope is None:
            self._rope = model.rope(self.positions)
        return self._rope

    def mask(self) -> torch.Tensor:
        """prefill: [N, N] block-causal over the packed prompts; decode: [N, L] valid context."""
        if self._mask is None:
            if self.seq_ids is not None:
                s, p = self.seq_ids, self.positions
                self._mask = (s[:, None] == s[None, :]) & (p[None, :] <= p[:, None])
            else:
                L = self.ctx_rows.shape[1]
                self._mask = torch.arange(L, device=self.ctx_len.device)[None, :] < self.ctx_len[:, None]
        return self._mask


class KVAttention:
    """`attend_for(stage, layer)` over a KV layout for one TokenBatch. `step` overrides the items'
    loop steps (prefill advances all positions one step at a time)."""

    def __init__(self, layout: KVLayout, batch: TokenBatch, step: int | None = None):
        self.layout, self.batch, self.step = layout, batch, step
        self.mask = batch.mask()

    def steps(self) -> torch.Tensor:
        return self.batch.steps if self.step is None else torch.full_like(self.batch.steps, self.step)

    def __call__(self, stage: str, layer: int) -> Attend:
        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            lay, b = self.layout, self.batch
            kc, vc = lay.cache(stage, layer)
            steps = self.steps()
            idx = lay.index(stage, steps, b.rows)
            kc.index_copy_(0, idx, k.to(kc.dtype))
            vc.index_copy_(0, idx, v.to(vc.dtype))
            gqa = q.shape[1] != k.shape[1]
            if b.seq_ids is not None:  # q, k, v: [N, heads, D] -> one packed sequence
                y = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                                   v.transpose(0, 1)[None], attn_mask=self.mask, enable_gqa=gqa)
                return y[0].transpose(0, 1)
            cidx = lay.index(stage, steps[:, None], b.ctx_rows)  # [N, L]
            K, V = kc[cidx].transpose(1, 2), vc[cidx].transpose(1, 2)  # [N, KV, L, D]
            y = F.scaled_dot_product_attention(q[:, :, None, :], K.to(q.dtype), V.to(q.dtype),
                                               attn_mask=self.mask[:, None, None, :], enable_gqa=gqa)
            return y[:, :, 0, :]
        return attend


def prefill(model: LoopedLM, layout: KVLayout, batch: TokenBatch, last_index: torch.Tensor,
            num_steps: int | None = None) -> torch.Tensor:
    """Whole prompts at full depth, depth-major; writes every layer's KV for every prompt position.
    Returns the logits of the positions in `last_index` [B] -> [B, V]."""
    rope = batch.rope(model)
    att = KVAttention(layout, batch)
    state, inj = model.prelude(batch.ids, rope, att)
    for s in range(1, (num_steps or model.cfg.r_max) + 1):
        att.step = s
        state = model.core_step(state, inj, rope, att)
    att.step = None
    hidden = model.coda(state, rope, att)  # every position: the coda's KV is needed later
    return model.head(hidden[last_index])


def prelude(model: LoopedLM, layout: KVLayout, batch: TokenBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Decode tokens -> (initial loop state, injection input)."""
    return model.prelude(batch.ids, batch.rope(model), KVAttention(layout, batch))


def core_step(model: LoopedLM, layout: KVLayout, batch: TokenBatch, state: torch.Tensor, inj: torch.Tensor | None,
              criterion: str, aux: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One loop step for items at mixed depths (`batch.steps`). Returns the new states, one exit
    score per item (see looplm/exits.py) and the criterion's per-item memory."""
    rope = batch.rope(model)
    att = KVAttention(layout, batch)
    new = model.core_step(state, inj, rope, att)
    gate = model.gate_logits(new) if criterion in ("ouro_gate", "learned") else None
    logits = model.head(model.coda(new, rope, att)) if criterion in OUTPUT_CRITERIA else None
    scores, aux = step_scores(criterion, state, new, gate, logits, aux)
    return new, scores, aux


def coda(model: LoopedLM, layout: KVLayout, batch: TokenBatch, state: torch.Tensor) -> torch.Tensor:
    """Exited tokens -> logits [N, V]."""
    rope = batch.rope(model)
    return model.head(model.coda(state, rope, KVAttention(layout, batch)))


def fused(model: LoopedLM, layout: KVLayout, batch: TokenBatch, r_max: int) -> torch.Tensor:
    """CB's iteration: decode tokens through prelude, `r_max` core steps and coda -> logits [N, V]."""
    rope = batch.rope(model)
    att = KVAttention(layout, batch)
    state, inj = model.prelude(batch.ids, rope, att)
    for s in range(1, r_max + 1):
        att.step = s
        state = model.core_step(state, inj, rope, att)
    att.step = None
    return model.head(model.coda(state, rope, att))

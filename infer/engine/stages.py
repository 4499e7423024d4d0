"""Stage functions over a flat batch of tokens: the one implementation of the math that the
reference decoder and the engine's runner both call.

A `TokenBatch` holds N tokens that may belong to different sequences and sit at different loop
depths. Attention writes each token's K/V into the KV layout first, then reads:
- prefill (`seq_ids` set): the fresh K/V of the same prompt, causally (depth-major prefill: at
  step s every prompt position attends to the prompt's step-s K/V); nothing is read from the cache;
- decode (`ctx_rows` set): the layout's slots for positions 0..pos of its own sequence, at its own
  loop step (depth-indexed) or the last written state (shared). Two implementations with the same
  numbers: the gather of every item's context to the batch's longest one then SDPA (the CPU path
  and the oracle; it reads N x L_max rows and writes a copy), and `paged_attention` (`paged` set:
  FlexAttention over the block tables, reading only each item's own blocks).
- mixed (`segments` set): the first `num_decode` items are decode items (as above), the rest are
  prompt chunks riding in the same launch. Each `Segment` is one chunk: one SDPA with q = the
  chunk's positions and k/v = the layout's rows of positions 0..last at the chunk's loop step,
  causal with the chunk's offset. Because every item's K/V is written before anything is read, a
  chunk sees its own step-s K/V, and an earlier chunk's step-s K/V is already in its depth slot
  (depth-indexed layouts), so a chunked prompt equals the whole-prompt prefill.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kv_layouts import KVLayout
from looplm.exits import OUTPUT_CRITERIA, gate_for, score_rule, step_scores
from looplm.layers import Attend
from looplm.model import LoopedLM


@dataclass
class PagedContext:
    """Decode context as block tables, for attention that reads only each item's own blocks
    (`paged_attention`): the items' block tables [N, nb] and an inverse page table (the logical
    index of each physical block in its owner's table). The mask checks every page against the
    item's own table, so a stale inverse entry (a freed block) can never let an item read it."""
    block_table: torch.Tensor  # [N, nb] physical blocks of each item's context
    page_index: torch.Tensor  # [num_blocks + 1] logical block index of each physical block
    block_size: int
    q_block: int = 16  # items per query tile of the kernel
    flex: object = None  # flex_attention, compiled (CUDA); None: the eager one


@dataclass
class Segment:
    """One prompt chunk of a mixed batch: items [start, start + length) are positions
    offset..offset+length-1 of one prompt; `ctx_rows` [offset + length] are the KV rows of its
    positions 0..offset+length-1."""
    start: int
    length: int
    offset: int
    ctx_rows: torch.Tensor
    _mask: torch.Tensor | None = field(default=None, repr=False)

    def mask(self) -> torch.Tensor:
        """[length, offset + length]: position offset+i sees positions 0..offset+i."""
        if self._mask is None:
            d = self.ctx_rows.device
            self._mask = (torch.arange(self.offset + self.length, device=d)[None, :] <=
                          torch.arange(self.offset, self.offset + self.length, device=d)[:, None])
        return self._mask


@dataclass
class TokenBatch:
    ids: torch.Tensor  # [N] token ids (read by the prelude)
    positions: torch.Tensor  # [N]
    rows: torch.Tensor  # [N] KV rows written (the layout's scratch row for padding)
    steps: torch.Tensor  # [N] loop step (1-based) of each item in a core step
    seq_ids: torch.Tensor | None = None  # prefill: [N] which prompt each token belongs to
    ctx_rows: torch.Tensor | None = None  # decode: [N, L] rows of positions 0..pos (padded)
    ctx_len: torch.Tensor | None = None  # decode: [N] valid entries of ctx_rows
    paged: PagedContext | None = None  # decode: attend through the block tables (paged_attention)
    segments: list[Segment] | None = None  # mixed: prompt chunks after the first `num_decode` items
    num_decode: int | None = None  # mixed: decode items (padding included) before the chunks
    # memoised per batch (they depend on positions / context only, not on the loop step), so a
    # runner that reuses a batch across consecutive core steps computes them once
    _rope: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)
    _mask: torch.Tensor | None = field(default=None, repr=False)

    def rope(self, model: LoopedLM) -> tuple[torch.Tensor, torch.Tensor]:
        if self._rope is None:
            self._rope = model.rope(self.positions)
        return self._rope

    def decode_part(self) -> TokenBatch:
        """The decode items of a mixed batch as a batch of their own (all items otherwise)."""
        if self.segments is None:
            return self
        n = self.num_decode
        return TokenBatch(ids=self.ids[:n], positions=self.positions[:n], rows=self.rows[:n], steps=self.steps[:n],
                          ctx_rows=self.ctx_rows, ctx_len=self.ctx_len)

    def mask(self) -> torch.Tensor:
        """prefill: [N, N] block-causal over the packed prompts; decode: [N, L] valid context."""
        if self._mask is None:
            if self.segments is not None and not self.num_decode:
                self._mask = torch.zeros(0, 0, dtype=torch.bool)  # chunks only: each segment has its own
            elif self.seq_ids is not None:
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
        self.mask = batch.mask() if batch.paged is None else None
        self._masks: dict = {}  # paged: block masks by (depth slots, step override)

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
            if b.segments is not None:
                return self._mixed(q, kc, vc, stage, steps, gqa)
            if b.seq_ids is not None:  # q, k, v: [N, heads, D] -> one packed sequence
                y = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                                   v.transpose(0, 1)[None], attn_mask=self.mask, enable_gqa=gqa)
                return y[0].transpose(0, 1)
            if b.paged is not None:
                core = stage == "core" and lay.slots > 1
                n_slots = lay.slots if core else 1
                depth = lay.slot_of(steps) if core else torch.zeros_like(steps)
                key = (n_slots, self.step)  # one mask per stage and depth (fused: per loop step)
                if key not in self._masks:
                    self._masks[key] = paged_mask(b.paged, b.positions, depth, n_slots, kc.shape[0] // n_slots)
                return paged_attention(q, kc, vc, depth, n_slots, self._masks[key], b.paged.flex)
            cidx = lay.index(stage, steps[:, None], b.ctx_rows)  # [N, L]
            K, V = kc[cidx].transpose(1, 2), vc[cidx].transpose(1, 2)  # [N, KV, L, D]
            y = F.scaled_dot_product_attention(q[:, :, None, :], K.to(q.dtype), V.to(q.dtype),
                                               attn_mask=self.mask[:, None, None, :], enable_gqa=gqa)
            return y[:, :, 0, :]
        return attend

    def _mixed(self, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, stage: str, steps: torch.Tensor,
               gqa: bool) -> torch.Tensor:
        """Decode items through the padded gather, each prompt chunk through one causal SDPA over its
        context rows (no [N, L_max] gather for prompt positions: long prompts stay linear in memory)."""
        lay, b, n = self.layout, self.batch, self.batch.num_decode
        out = []
        if n:
            cidx = lay.index(stage, steps[:n, None], b.ctx_rows)
            K, V = kc[cidx].transpose(1, 2), vc[cidx].transpose(1, 2)
            y = F.scaled_dot_product_attention(q[:n, :, None, :], K.to(q.dtype), V.to(q.dtype),
                                               attn_mask=self.mask[:, None, None, :], enable_gqa=gqa)
            out.append(y[:, :, 0, :])
        for g in b.segments:
            cidx = lay.index(stage, steps[g.start], g.ctx_rows)  # every position of a chunk is at one step
            K, V = kc[cidx].transpose(0, 1)[None], vc[cidx].transpose(0, 1)[None]  # [1, KV, L, D]
            qs = q[g.start:g.start + g.length].transpose(0, 1)[None]  # [1, H, n, D]
            y = F.scaled_dot_product_attention(qs, K.to(q.dtype), V.to(q.dtype), attn_mask=g.mask(), enable_gqa=gqa)
            out.append(y[0].transpose(0, 1))
        return torch.cat(out) if len(out) > 1 else out[0]


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
    # mixed batch: only the decode items (the first num_decode) are scored; prompt chunks never exit
    n = new.shape[0] if batch.segments is None else batch.num_decode
    if n == 0:
        return new, new.new_zeros(0), aux
    dec = batch.decode_part()
    gate = gate_for(model, criterion, new[:n])
    logits = (model.head(model.coda(new[:n], dec.rope(model), KVAttention(layout, dec)))
              if criterion in OUTPUT_CRITERIA else None)
    scores, aux = step_scores(score_rule(criterion, model.cfg), state[:n], new[:n], gate, logits, aux)
    return new, scores, aux


def coda(model: LoopedLM, layout: KVLayout, batch: TokenBatch, state: torch.Tensor,
         head_index: torch.Tensor | None = None) -> torch.Tensor:
    """Exited tokens -> logits [N, V] (of the items in `head_index` when given: a mixed batch runs
    the coda for every prompt position, whose coda KV is needed later, and the head on few)."""
    rope = batch.rope(model)
    hidden = model.coda(state, rope, KVAttention(layout, batch))
    return model.head(hidden if head_index is None else hidden[head_index])


def fused(model: LoopedLM, layout: KVLayout, batch: TokenBatch, r_max: int,
          head_index: torch.Tensor | None = None) -> torch.Tensor:
    """CB's iteration: decode tokens (and, in a mixed batch, prompt chunks at the same loop steps)
    through prelude, `r_max` core steps and coda -> logits [N, V] (`head_index`: see `coda`)."""
    rope = batch.rope(model)
    att = KVAttention(layout, batch)
    state, inj = model.prelude(batch.ids, rope, att)
    for s in range(1, r_max + 1):
        att.step = s
        state = model.core_step(state, inj, rope, att)
    att.step = None
    hidden = model.coda(state, rope, att)
    return model.head(hidden if head_index is None else hidden[head_index])


def paged_mask(ctx: PagedContext, positions: torch.Tensor, depth: torch.Tensor, depth_slots: int, R: int):
    """The block-sparse FlexAttention mask of one decode stage (shared by every layer that reads the
    same depth slots): per depth slot and query tile of `q_block` items, the tile's pages at that
    depth, valid ones first. `depth` [N]: the 0-based depth slot each item reads; R: rows per slot."""
    from torch.nn.attention.flex_attention import BlockMask
    B, QB, dev = ctx.block_size, ctx.q_block, positions.device
    N, nb = ctx.block_table.shape
    pad = -(-N // QB) * QB - N
    z = lambda t, v=0: torch.cat([t, t.new_full((pad, *t.shape[1:]), v)]) if pad else t  # noqa: E731
    valid = z(torch.arange(nb, device=dev)[None, :] * B <= positions[:, None])  # [Np, nb] pages in the context
    bt, pos_q, depth_q = z(ctx.block_table), z(positions), z(depth)
    at = valid[None] & (depth_q[None, :, None] == torch.arange(depth_slots, device=dev)[:, None, None])
    at = at.reshape(depth_slots, -1, QB * nb)
    order = torch.sort(at.to(torch.int8), dim=-1, descending=True, stable=True).indices
    pages = bt.reshape(-1, QB * nb).expand(depth_slots, -1, -1).gather(-1, order)
    num = at.sum(-1, dtype=torch.int32)
    nkv = -(-R // B)  # the mask's KV block axis spans the whole storage; only the first `num` are read
    if pages.shape[-1] >= nkv:
        pages = pages[..., :nkv]  # a tile's valid pages are distinct blocks: at most nkv of them
    else:
        pages = torch.cat([pages, pages.new_zeros(*pages.shape[:-1], nkv - pages.shape[-1])], -1)
    index = ctx.page_index

    def mask_mod(b, h, qi, kv):
        page = kv // B
        li = index[page]
        return (bt[qi, li.clamp(max=nb - 1)] == page) & (li * B + kv % B <= pos_q[qi]) & (depth_q[qi] == b)

    return BlockMask.from_kv_blocks(num[:, None], pages[:, None].to(torch.int32), BLOCK_SIZE=(QB, B),
                                    mask_mod=mask_mod, seq_lengths=(N + pad, R))


def paged_attention(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, depth: torch.Tensor, depth_slots: int,
                    mask, flex=None) -> torch.Tensor:
    """Decode attention over the KV layout's flat storage without gathering it: FlexAttention with
    the block-sparse `mask` (paged_mask) whose KV blocks are the items' own pages. q [N, H, D];
    kc, vc [depth_slots * R, KV, D]. The storage is viewed as [depth_slots, KV, R, D] (the depth
    slot is the batch dimension, so pages stay block-aligned) and each item's query sits in the
    batch of its depth slot; a query tile reads the union of its items' pages, so the KV read per
    stage is the sum of the contexts rounded up to whole blocks. `flex` is flex_attention (compiled
    on CUDA); by default it runs eagerly (the CPU test path: exact, but it materialises scores)."""
    from torch.nn.attention.flex_attention import flex_attention
    N, H, D = q.shape
    R, KV = kc.shape[0] // depth_slots, kc.shape[1]
    K = kc.view(depth_slots, R, KV, D).transpose(1, 2)  # views: no copy of the cache
    V = vc.view(depth_slots, R, KV, D).transpose(1, 2)
    Np = mask.shape[-2]
    Q = q.transpose(0, 1)  # [H, N, D]
    if Np > N:
        Q = torch.cat([Q, Q.new_zeros(H, Np - N, D)], 1)
    Q = Q[None].expand(depth_slots, -1, -1, -1)
    y = (flex or flex_attention)(Q, K, V, block_mask=mask, enable_gqa=H != KV)
    return y[depth, :, torch.arange(N, device=q.device)]  # [N, H, D]

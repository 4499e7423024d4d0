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
- mixed: prompt chunks ride in the same launch, each position an item of its own (mixed.py). On
  the paged path they attend as decode items do (positions 0..pos of their sequence at their loop
  step). On the SDPA path (`segments` set) the first `num_decode` items are decode items (the
  gather), and each `Segment` is one chunk: one SDPA with q = the chunk's positions and k/v = the
  layout's rows of positions 0..last at the chunk's loop step, causal with the chunk's offset. Both
  read the same keys: every item's K/V is written before anything is read, so a chunk sees its own
  step-s K/V, and an earlier chunk's step-s K/V is already in its depth slot (depth-indexed
  layouts): a chunked prompt equals the whole-prompt prefill.
"""
from __future__ import annotations

import inspect
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
    q_block: int | None = None  # items per query tile of the kernel; None: paged_q_block's (what inductor accepts)
    flex: object = None  # flex_attention, compiled (CUDA: compile_paged_flex); None: the eager one


@dataclass
class Segment:
    """One prompt chunk of a mixed batch on the SDPA path: the items `idx` [length] are positions
    offset..offset+length-1 of one prompt, in order; `ctx_rows` [offset + length] are the KV rows of
    its positions 0..offset+length-1."""
    idx: torch.Tensor
    offset: int
    ctx_rows: torch.Tensor
    _mask: torch.Tensor | None = field(default=None, repr=False)

    def mask(self) -> torch.Tensor:
        """[length, offset + length]: position offset+i sees positions 0..offset+i."""
        if self._mask is None:
            d, n = self.ctx_rows.device, self.idx.shape[0]
            self._mask = (torch.arange(self.offset + n, device=d)[None, :] <=
                          torch.arange(self.offset, self.offset + n, device=d)[:, None])
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
    segments: list[Segment] | None = None  # mixed, SDPA path: the prompt chunks' attention groups
    num_decode: int | None = None  # mixed, SDPA path: the decode items (the first ones, gathered context)
    scored: int | None = None  # the first items that get exit scores and the head (None: all; mixed.py)
    # memoised per batch (they depend on positions / context only, not on the loop step), so a
    # runner that reuses a batch across consecutive core steps computes them once
    _rope: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)
    _mask: torch.Tensor | None = field(default=None, repr=False)

    def rope(self, model: LoopedLM) -> tuple[torch.Tensor, torch.Tensor]:
        if self._rope is None:
            self._rope = model.rope(self.positions)
        return self._rope

    def scored_part(self) -> TokenBatch:
        """The scored items (`scored`) as a batch of their own (all items: itself)."""
        n = self.positions.shape[0] if self.scored is None else self.scored
        if n == self.positions.shape[0] and self.segments is None:
            return self
        paged = None if self.paged is None else PagedContext(self.paged.block_table[:n], self.paged.page_index,
                                                              self.paged.block_size, self.paged.q_block, self.paged.flex)
        return TokenBatch(ids=self.ids[:n], positions=self.positions[:n], rows=self.rows[:n], steps=self.steps[:n],
                          ctx_rows=None if self.ctx_rows is None else self.ctx_rows[:n],
                          ctx_len=None if self.ctx_len is None else self.ctx_len[:n], paged=paged)

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
                core = stage == "core" and lay.num_depth_slots > 1
                n_slots = lay.num_depth_slots if core else 1
                depth = lay.depth_slot_of(steps) if core else torch.zeros_like(steps)
                key = (n_slots, self.step)  # one mask per stage and depth (fused: per loop step)
                if key not in self._masks:
                    self._masks[key] = paged_mask(b.paged, b.positions, depth, n_slots, kc.shape[0] // n_slots,
                                                  q.shape[1] // kc.shape[1])
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
        context rows (no [N, L_max] gather for prompt positions: long prompts stay linear in memory).
        Padding items attend nothing (zeros: their rows are never read)."""
        lay, b, n = self.layout, self.batch, self.batch.num_decode
        out = torch.zeros_like(q)
        if n:
            cidx = lay.index(stage, steps[:n, None], b.ctx_rows)
            K, V = kc[cidx].transpose(1, 2), vc[cidx].transpose(1, 2)
            y = F.scaled_dot_product_attention(q[:n, :, None, :], K.to(q.dtype), V.to(q.dtype),
                                               attn_mask=self.mask[:, None, None, :], enable_gqa=gqa)
            out[:n] = y[:, :, 0, :]
        for g in b.segments:
            cidx = lay.index(stage, steps[g.idx[:1]], g.ctx_rows)  # every position of a chunk is at one step
            K, V = kc[cidx].transpose(0, 1)[None], vc[cidx].transpose(0, 1)[None]  # [1, KV, L, D]
            qs = q[g.idx].transpose(0, 1)[None]  # [1, H, n, D]
            y = F.scaled_dot_product_attention(qs, K.to(q.dtype), V.to(q.dtype), attn_mask=g.mask(), enable_gqa=gqa)
            out.index_copy_(0, g.idx, y[0].transpose(0, 1))
        return out


def prefill(model: LoopedLM, layout: KVLayout, batch: TokenBatch, last_index: torch.Tensor,
            num_steps: int | None = None) -> torch.Tensor:
    """Whole prompts at full depth, depth-major; writes every layer's KV for every prompt position
    (the coda's too: it is needed later). Returns the logits of the positions in `last_index` [B] ->
    [B, V]. The same math as CB's iteration, `fused`, over prompt positions."""
    return fused(model, layout, batch, num_steps or model.cfg.r_max, last_index)


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
    # only the first `scored` items get a score (mixed.py: the decode items are among them); prompt
    # positions never exit
    n = new.shape[0] if batch.scored is None else batch.scored
    if n == 0:
        return new, new.new_zeros(0), aux
    dec = batch.scored_part()
    gate = gate_for(model, criterion, new[:n])
    logits = (model.head(model.coda(new[:n], dec.rope(model), KVAttention(layout, dec)))
              if criterion in OUTPUT_CRITERIA else None)
    scores, aux = step_scores(score_rule(criterion, model.cfg), state[:n], new[:n], gate, logits, aux)
    return new, scores, aux


def head_of(model: LoopedLM, hidden: torch.Tensor, head_index: torch.Tensor | int | None) -> torch.Tensor:
    """The logits of the rows that need them: all (None), the first `head_index` (an int: a mixed batch
    runs the coda for every prompt position, whose coda KV is needed later, and the head on few), or
    the rows in `head_index`."""
    if head_index is None:
        return model.head(hidden)
    return model.head(hidden[:head_index] if isinstance(head_index, int) else hidden[head_index])


def coda(model: LoopedLM, layout: KVLayout, batch: TokenBatch, state: torch.Tensor,
         head_index: torch.Tensor | int | None = None) -> torch.Tensor:
    """Exited tokens -> logits [N, V] (of the rows `head_index` names: head_of)."""
    rope = batch.rope(model)
    return head_of(model, model.coda(state, rope, KVAttention(layout, batch)), head_index)


def fused(model: LoopedLM, layout: KVLayout, batch: TokenBatch, r_max: int,
          head_index: torch.Tensor | int | None = None) -> torch.Tensor:
    """CB's iteration: decode tokens (and, in a mixed batch, prompt chunks at the same loop steps)
    through prelude, `r_max` core steps and coda -> logits [N, V] (`head_index`: see `coda`)."""
    rope = batch.rope(model)
    att = KVAttention(layout, batch)
    state, inj = model.prelude(batch.ids, rope, att)
    for s in range(1, r_max + 1):
        att.step = s
        state = model.core_step(state, inj, rope, att)
    att.step = None
    return head_of(model, model.coda(state, rope, att), head_index)


# The query block of the paged mask, from what inductor's two FlexAttention lowerings accept (torch 2.13,
# torch/_inductor/kernel/flex/):
# - flex-decoding, chosen for a query length under 128 with static batch and heads, a block mask broadcast
#   over heads (GQA) and a power-of-two group (flex_decoding.py:40-96, picked at flex_attention.py:243-254),
#   puts every query row of a KV head's group in one tile of BLOCK_M = max(16, next_pow2(Q_LEN * group))
#   rows (flex_decoding.py:279-291) and skips every config whose SPARSE_Q_BLOCK_SIZE is not a multiple of
#   it (flex_decoding.py:330); with none left, autotune_select_algorithm raises NoValidChoicesError
#   (select_algorithm.py:3890). So the query block must be at least the whole batch times the group;
#   its block row 0 is the only one the kernel reads (flex_decode.py.jinja:94).
# - the flex-attention template (everything else: 128 queries or more, a group that is not a power of two)
#   needs SPARSE_Q_BLOCK_SIZE to be a multiple of its config's BLOCK_M (flex_attention.py:443-461; the
#   configs' BLOCK_M are 16..128, template_heuristics/triton.py).
PAGED_DECODE_MAX_QUERIES = 128  # flex-decoding only below this query length (flex_decoding.py:49-51)


def paged_q_block(n: int, group: int = 1) -> int:
    """Query items per tile of the paged mask of a stage of `n` (padded) items whose query heads share
    a KV head in groups of `group`: below 128 items one tile of the whole batch, a power of two that both
    lowerings accept (>= next_pow2(n * group) for flex-decoding, a multiple of 128 for the template);
    from 128 items on, tiles of 128 (only the template runs there)."""
    if n >= PAGED_DECODE_MAX_QUERIES:
        return PAGED_DECODE_MAX_QUERIES
    return max(PAGED_DECODE_MAX_QUERIES, 1 << (n * group - 1).bit_length())


def paged_mask(ctx: PagedContext, positions: torch.Tensor, depth: torch.Tensor, depth_slots: int, R: int,
               group: int = 1):
    """The block-sparse FlexAttention mask of one decode stage (shared by every layer that reads the
    same depth slots): per depth slot and query tile (`paged_q_block` items), the distinct pages its
    items read at that depth, in ascending order. `depth` [N]: the 0-based depth slot each item reads;
    R: rows per slot; `group`: query heads per KV head.

    Every tensor the mask holds has a shape fixed by N and depth_slots alone (not by the context
    length), so a compiled flex_attention sees one static shape per (padded batch, depth slots):
    compile_paged_flex's recompile budget counts exactly those."""
    from torch.nn.attention.flex_attention import BlockMask
    B, dev = ctx.block_size, positions.device
    N, nb = ctx.block_table.shape
    QB = ctx.q_block or paged_q_block(N, group)
    nq = -(-N // QB)  # query tiles (one below 128 items)
    nkv = -(-R // B)  # the mask's KV block axis spans the whole storage of a depth slot
    # own[i, p]: physical block p holds part of item i's context. Table entries past the context go to
    # the extra column nkv, dropped below; a table lists distinct blocks, so no two writes of a row collide
    valid = torch.arange(nb, device=dev)[None, :] * B <= positions[:, None]  # [N, nb]
    own = torch.zeros(N, nkv + 1, dtype=torch.bool, device=dev)
    own.scatter_(1, torch.where(valid, ctx.block_table, nkv), valid)
    # the blocks each (depth slot, tile) reads: a union, so a block that several of its items share (a
    # cached prefix) is listed once; listed twice, the kernel would count its keys twice in the softmax
    used = torch.zeros(depth_slots * nq, nkv + 1, dtype=torch.int32, device=dev)
    used.index_add_(0, depth * nq + torch.arange(N, device=dev) // QB, own.to(torch.int32))
    used = used[:, :nkv].view(depth_slots, nq, nkv) > 0
    num = used.sum(-1, dtype=torch.int32)
    pages = torch.sort(used.to(torch.int8), dim=-1, descending=True, stable=True).indices  # used ones first
    index = ctx.page_index

    def mask_mod(b, h, qi, kv):
        # its own page, a row of the context (the last page is partly filled), at the item's depth slot
        page = kv // B
        return own[qi, page] & (index[page] * B + kv % B <= positions[qi]) & (depth[qi] == b)

    return BlockMask.from_kv_blocks(num[:, None], pages[:, None].to(torch.int32), BLOCK_SIZE=(QB, B),
                                    mask_mod=mask_mod, seq_lengths=(N, R))


def paged_attention(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, depth: torch.Tensor, depth_slots: int,
                    mask, flex=None) -> torch.Tensor:
    """Decode attention over the KV layout's flat storage without gathering it: FlexAttention with
    the block-sparse `mask` (paged_mask) whose KV blocks are the items' own pages. q [N, H, D];
    kc, vc [depth_slots * R, KV, D]. The storage is viewed as [depth_slots, KV, R, D] (the depth
    slot is the batch dimension, so pages stay block-aligned) and each item's query sits in the
    batch of its depth slot; a query tile reads the union of its items' pages, so the KV read per
    stage is the sum of the contexts rounded up to whole blocks (a block shared by several items of a
    tile once). `flex` is flex_attention compiled (compile_paged_flex, CUDA); by default it runs
    eagerly (the CPU test path: exact, but it materialises scores)."""
    from torch.nn.attention.flex_attention import flex_attention
    N, H, D = q.shape
    R, KV = kc.shape[0] // depth_slots, kc.shape[1]
    K = kc.view(depth_slots, R, KV, D).transpose(1, 2)  # views: no copy of the cache
    V = vc.view(depth_slots, R, KV, D).transpose(1, 2)
    Q = q.transpose(0, 1)[None].expand(depth_slots, -1, -1, -1)  # [depth_slots, H, N, D] (the mask's Q_LEN is N)
    options = None
    G = H // KV
    if flex is not None and (N >= PAGED_DECODE_MAX_QUERIES or G & (G - 1)):
        # the flex-attention template, not flex-decoding: its KV tile must divide the page (flex_attention.py:
        # 450-461), and its configs' BLOCK_N (32..128) exceed the 16-row default block; flex-decoding
        # clamps its own (flex_decoding.py:327-328). Options set BLOCK_N before the configs (:444)
        options = {"BLOCK_N": min(mask.BLOCK_SIZE[1], 128)}
    y = (flex or flex_attention)(Q, K, V, block_mask=mask, enable_gqa=H != KV, kernel_options=options)
    return y[depth, :, torch.arange(N, device=q.device)]  # [N, H, D]


def compile_paged_flex(num_shapes: int, backend: str = "inductor"):
    """flex_attention compiled for the paged decode path of one runner, which meets at most
    `num_shapes` static shapes (ModelRunner.enable_paged counts them: padded batch sizes x depth-slot
    counts; paged_mask keeps the context length out of every shape).

    - dynamic=False: flex-decoding needs static batch and head sizes (flex_decoding.py:53-54) and
      sizes its query tile from the query length (:279-291); each shape is one compiled kernel.
    - a recompile limit of at least num_shapes: Dynamo keeps 8 compiled entries per code object by
      default (torch/_dynamo/config.py:121) and past them runs the frame uncompiled
      (convert_frame.py:1986-2039, RUN_ONLY), i.e. eager flex_attention, which materialises
      [depth slots, H, N, R] scores over the whole KV storage: slow at best, out of memory at worst,
      with one log line. `_recompile_options` makes the room: this runner's own count where
      torch.compile takes `recompile_limit=` and `isolate_recompiles=` (torch 2.13), else the
      process-wide limit raised by this runner's shapes (torch 2.11, the GPU hosts' torch: neither
      keyword exists there, and passing them raised TypeError), shared with every other compile of
      flex_attention in the process (torch/__init__.py:2718-2732).
    - fullgraph=True: at a limit Dynamo raises FailOnRecompileLimitHit instead of running eagerly
      (convert_frame.py:2030-2033). And `ShapeBudget` keeps this runner's count itself, on every
      torch: a shape past num_shapes raises the same error before Dynamo is asked, so a shape this
      count missed fails loudly even where the limit is shared. Dynamo's global cap,
      accumulated_recompile_limit (256 entries of the code object over all regions:
      _dynamo/cache_size.py:100-103), still applies, also loudly."""
    from torch.nn.attention.flex_attention import flex_attention
    return ShapeBudget(torch.compile(flex_attention, dynamic=False, fullgraph=True, backend=backend,
                                     **_recompile_options(num_shapes)), num_shapes)


class ShapeBudget:
    """A compiled flex_attention that refuses a new static shape past `num_shapes` (the shapes of its
    query, keys and values, their dtype and the kernel options: what its compiled entries differ by)."""

    def __init__(self, fn, num_shapes: int):
        self.fn, self.num_shapes, self.shapes = fn, num_shapes, set()

    def __call__(self, q, k, v, **kw):
        key = (tuple(q.shape), tuple(k.shape), tuple(v.shape), q.dtype, kw.get("enable_gqa"),
               tuple(sorted((kw.get("kernel_options") or {}).items())))
        if key not in self.shapes:
            if len(self.shapes) >= self.num_shapes:
                from torch._dynamo.exc import FailOnRecompileLimitHit
                raise FailOnRecompileLimitHit(f"paged flex_attention: a static shape past this runner's "
                                              f"{self.num_shapes} (q {tuple(q.shape)}, kv {tuple(k.shape)}); "
                                              f"ModelRunner.enable_paged counts the shapes a runner meets")
            self.shapes.add(key)
        return self.fn(q, k, v, **kw)


def _recompile_options(num_shapes: int) -> dict:
    """torch.compile's keywords for a per-runner recompile budget where this torch has them (feature
    detection, not a version number); else the process-wide limits raised to make room."""
    accepted = inspect.signature(torch.compile).parameters
    if "recompile_limit" in accepted and "isolate_recompiles" in accepted:
        return {"recompile_limit": num_shapes, "isolate_recompiles": True}
    cfg = torch._dynamo.config
    name = "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"  # (the name before 2.6)
    # shared with every other compile of flex_attention in the process (another engine's, say): this
    # runner's shapes come on top of what is there
    setattr(cfg, name, getattr(cfg, name) + num_shapes)
    if hasattr(cfg, "accumulated_recompile_limit"):
        cfg.accumulated_recompile_limit = max(cfg.accumulated_recompile_limit, getattr(cfg, name))
    elif hasattr(cfg, "accumulated_cache_size_limit"):
        cfg.accumulated_cache_size_limit = max(cfg.accumulated_cache_size_limit, getattr(cfg, name))
    return {}

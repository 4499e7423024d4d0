"""The device batch state: per-slot decode metadata kept on the device across stages (vLLM V1's
persistent batch), and the one host-to-device upload of a stage.

Position, loop step and block table of the sequence in each state slot live in one flat long
tensor. A stage sends, in one copy, its slots, the last tokens of its items if it embeds them
(prelude, fused), the metadata of the sequences the scheduler reports in `Work.changed` (admitted,
swapped in, resumed) or that were invalidated, and the new block-table entries of those in
`Work.grown`; nothing else is per item. Positions advance on the device: a prelude (or fused)
launch moves each of its slots one position on, since every decode token passes through exactly
one. The host keeps no per-token mirror: it knows which block tables it sent (`_own`, `_nblk`),
and the context length of a batch is its longest block table.

Prompt chunks ride as items of their own (mixed.py): each position of a chunk in flight holds a
*token slot*, a row after the sequences' slots with its own position and loop step whose block
table is its sequence's (`owner`), written once when the chunk enters (`Riders`). So a launch
carrying chunks gathers its batch like a decode launch, and can replay a graph as one.

The incremental state is a cache of what the Sequences say; `check(seqs)` is its oracle: it
rebuilds the state of `seqs` from scratch and compares it with the device's (tests call it after
every decode launch).
"""
from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from itertools import chain, repeat
from typing import Callable

import torch

from .sequence import Sequence, Stage
from .stages import PagedContext, TokenBatch


def next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def to_device(xs: list | array | torch.Tensor, device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """Host numbers -> a tensor on the device: the engine's one host -> device path (on CUDA: pinned,
    asynchronous, so the stream never waits for the host; host_syncs.py counts every other one). An
    array('q') converts 3x faster than a list (torch.tensor walks the list item by item)."""
    if isinstance(xs, array):
        xs = torch.frombuffer(xs, dtype=torch.long) if len(xs) else torch.zeros(0, dtype=torch.long)
    if device.type != "cuda":
        return xs if isinstance(xs, torch.Tensor) else torch.tensor(xs, dtype=dtype)
    t = xs.pin_memory() if isinstance(xs, torch.Tensor) else torch.tensor(xs, dtype=dtype, pin_memory=True)
    return t.to(device, non_blocking=True)


# The launch shapes, in one place (the model runner pads by them, infer/sim/runner.py prices them)
def padded_batch(n: int, max_batch_size: int, pad_pow2: bool, ladder: bool = False) -> int:
    """The batch a launch of n items runs at: the next power of two, so that graphs and kernels see a
    few shapes, but no larger than the next power of two of max_batch_size. A mixed launch's prompt
    positions make n larger: then n itself, or with `ladder` (the paged path: graphs and the compiled
    kernel see few shapes) the next power of two, from 256 on with midpoints (256, 384, 512, 768, ...:
    at most a third padding where launches are large)."""
    if not pad_pow2:
        return n
    cap = next_pow2(max_batch_size)
    if n <= cap or not ladder:
        return min(next_pow2(n), max(cap, n))
    p = next_pow2(n)
    return p * 3 // 4 if p >= 512 and n <= p * 3 // 4 else p


def launch_sizes(max_batch_size: int, pad_pow2: bool, most: int, ladder: bool) -> list[int]:
    """Every padded item count (padded_batch) of a launch of 1..`most` items."""
    sizes, n = set(), 1
    while n <= most:
        p = padded_batch(n, max_batch_size, pad_pow2, ladder)
        sizes.add(p)
        n = p + 1
    return sorted(sizes)


@dataclass
class Riders:
    """The prompt chunks riding in a launch as the upload sends them (mixed.py): their items' token
    slots in item order (after the decode items), the prompt ids they embed (stages that embed
    tokens), (token slot, position before, owner slot) of each item entering the loop now (prelude,
    fused), and the sequences whose block tables they read."""
    slots: list[int]
    owners: list
    ids: list[int] = field(default_factory=list)
    fresh: list[tuple[int, int, int]] = field(default_factory=list)


def table_width(max_position: int, block_size: int, num_blocks: int) -> int:
    """A block table's width: the most blocks one sequence can hold (the model's context, or the
    whole pool when that is smaller: a 65,536-token checkpoint on a pool of a few hundred tokens)."""
    return min(-(-max_position // block_size), num_blocks)


def context_blocks(nb: int, width: int, bucketed: bool) -> int:
    """Context blocks the SDPA path attends for a longest context of nb blocks: bucketed (on CUDA)
    to powers of two up to the table's width, so that graphs and kernels see a handful of shapes."""
    return min(next_pow2(nb), width) if bucketed else nb


class BatchState:
    def __init__(self, num_slots: int, block_size: int, max_position: int, num_blocks: int, scratch_row: int,
                 padded: Callable[[int], int], device: torch.device, token_slots: int = 0):
        """`num_slots` state slots, the last of which is the scratch slot of padding items (its
        table stays 0, its rows are the layout's `scratch_row`), then `token_slots` token slots (one
        per prompt position in flight); `padded(n)`: the padded batch size."""
        S, B, T = num_slots, block_size, token_slots
        MB = table_width(max_position, B, num_blocks)
        self.block_size, self.device, self.padded, self.scratch_row = B, device, padded, scratch_row
        self.scratch_slot = S - 1
        long = dict(dtype=torch.long, device=device)
        # one flat tensor: [S + T, 3] (position, loop step, the slot whose block table it reads), then the
        # block tables [S, MB], so that the rewrites of a stage are one index_copy_ of (flat index, value) pairs
        self._flat = torch.zeros((S + T) * 3 + S * MB, **long)
        self.slot_meta = self._flat[:3 * (S + T)].view(S + T, 3)
        self.pos, self.step, self.owner = self.slot_meta.unbind(1)
        self.owner.copy_(torch.cat([torch.arange(S, **long), torch.full((T,), S - 1, **long)]))
        self._bt0 = 3 * (S + T)  # where the block tables start in _flat
        self.bt = self._flat[self._bt0:].view(S, MB)
        self._j = torch.arange(MB * B, **long)  # context offsets, sliced per stage
        # on-device token re-entry (EngineConfig.async_scheduling): each slot's last sampled id, written
        # on the device by the stage that sampled it (ModelRunner.reenter); a prelude or fused item
        # whose token the host has not read yet is uploaded as -1 and embeds this one instead
        self.tok = torch.zeros(S + T, **long)
        # paged attention (stages.paged_attention): decode attention reads each item's own blocks
        # through the block tables instead of gathering every context to the longest. Set by
        # ModelRunner.enable_paged (EngineConfig.attention_backend="paged", the CUDA default)
        self.paged = False
        # contexts padded to power-of-two buckets (CUDA: few graph keys; a graph-replay emulator on CPU too)
        self.bucketed = device.type == "cuda"
        # the rows that get the head (and a core step's exit scores): the first padded(max_batch_size),
        # where a mixed launch puts its decode items and final chunk positions (mixed.py); set by the runner
        self.head_rows = 1 << 62
        self.ladder = False  # (the paged path) mixed launches padded on the ladder of padded_batch: few shapes
        self.flex = None  # a compiled flex_attention for paged attention on CUDA (ModelRunner.enable_paged)
        # inverse page table: each block's index in its owner's table (one entry more: the block of
        # the layout's scratch row); stale entries of freed blocks are harmless (see PagedContext)
        self.page_index = torch.zeros(num_blocks + 1, **long)
        self._own: list[Sequence | None] = [None] * S  # whose block table the device holds, per slot
        self._nblk = [0] * S  # how many entries of it
        self._redo: list[Sequence] = []  # to rewrite at the next upload (Work.changed, invalidate)
        self._grown: list[Sequence] = []  # new block-table entries to send at the next upload (Work.grown)
        self._prev: tuple = (None, None, 0)  # the last upload (seqs, slots, context blocks): see upload
        self.attention_stats: dict | None = None  # see _count_attention

    def to_device(self, xs: list | array | torch.Tensor) -> torch.Tensor:
        return to_device(xs, self.device)

    # ------------------------------------------------------------------ what changed
    def note(self, changed: list[Sequence], grown: list[Sequence]) -> None:
        """A Work's `changed` (rewritten whole) and `grown` (new table entries) sequences, sent at
        this or the next upload."""
        if changed:
            self._redo += changed
        if grown:
            self._grown += grown

    def invalidate(self, slot: int) -> None:
        """Forget what the device holds for `slot`: its sequence's metadata and whole block table are
        rewritten at the next upload (call it when they change behind the scheduler's back)."""
        s = self._own[slot]
        self._own[slot] = None
        if s is not None:
            self._redo.append(s)

    def invalidate_all(self) -> None:
        for sl, n in enumerate(self._nblk):
            if n:
                self.invalidate(sl)

    # ------------------------------------------------------------------ the upload
    def upload(self, seqs: list[Sequence], tokens: bool = False, context: bool = True,
               riders: Riders | None = None) -> tuple[torch.Tensor, int]:
        """Bring the per-slot state up to date with one host-to-device copy. Returns the stage's
        input, the padded batch's slots [N] (the decode items', then `riders`' token slots; padding:
        the scratch slot), followed with `tokens` by each item's token [N], and its context length in
        blocks (1 without `context`: a stage with no attention layer, Ouro's prelude, reads none). A
        stage over the same sequences as the previous one with nothing to send (consecutive core
        steps) reuses the previous slots: no copy, no per-item work."""
        redo, grown = self._redo, self._grown
        if riders is None and not tokens and not redo and not grown and seqs == self._prev[0]:  # identity compare
            if not context:  # (a coda without attention layers after the core step of the same items)
                return self._prev[1], 1
            if self.attention_stats is not None:
                self._count_attention(seqs, self._prev[1].shape[0], self._prev[2])
            return self._prev[1], self._prev[2]
        own, nblk, MB = self._own, self._nblk, self.bt.shape[1]
        if riders is not None:  # the tables the chunks read, where the device lacks them (rewritten whole)
            redo = redo + [s for s in riders.owners if own[s.slot] is not s or nblk[s.slot] != len(s.blocks)]
        idx: list[int] = []  # flat indices into _flat (position, loop step, block-table entries)
        val: list[int] = []
        new_pages: list[int] = []  # (block, its index in the table) for the paged path's inverse table
        # rewrites (redo: position, loop step, and the table from what the device holds of it) and
        # growth (grown: the new table entries only; the device holds the rest, the position and
        # the loop step, unless the table never reached it: admitted or swapped in since)
        bt0 = self._bt0
        for s, meta in chain(zip(grown, repeat(False)), zip(redo, repeat(True))) if grown or redo else ():
            sl = s.slot
            if sl < 0:  # finished or swapped out since
                continue
            blocks = s.blocks
            held = own[sl] is s and nblk[sl] <= len(blocks)
            if meta or not held:
                idx += (3 * sl, 3 * sl + 1)
                val += (self.position_of(s), s.step)
            own[sl] = s
            for c in range(nblk[sl] if held else 0, len(blocks)):
                idx.append(bt0 + sl * MB + c)
                val.append(blocks[c])
                new_pages += (blocks[c], c)
            nblk[sl] = len(blocks)
        if grown:
            self._grown = []
        if self._redo:
            self._redo = []
        slots = [s.slot for s in seqs]
        nb = max(map(nblk.__getitem__, slots)) if context and slots else 1
        if riders is not None:
            for t, pos, owner in riders.fresh:  # a chunk position entering the loop: its metadata, once
                idx += (3 * t, 3 * t + 1, 3 * t + 2)
                val += (pos, 0, owner)
            if context and riders.owners:
                nb = max(nb, max(nblk[s.slot] for s in riders.owners))
            slots = slots + riders.slots
        N = self.padded(len(slots), ladder=self.ladder)
        head = slots + [self.scratch_slot] * (N - len(slots))
        if tokens:  # the token each item embeds: its last output (-1 while on the device: BatchState.tok)
            head += [s.output_ids[-1] for s in seqs] + (riders.ids if riders is not None else []) + [0] * (N - len(slots))
        k = len(idx)
        buf = self.to_device(array("q", head + idx + val + new_pages if self.paged else head + idx + val))
        h = len(head)
        if k:
            self._flat.index_copy_(0, buf[h:h + k], buf[h + k:h + 2 * k])
            if self.paged and new_pages:
                pg = buf[h + 2 * k:].view(-1, 2)
                self.page_index.index_copy_(0, pg[:, 0], pg[:, 1])
        inp = buf[:h] if k else buf
        if self.attention_stats is not None and context:  # (a stage without attention reads no KV)
            self._count_attention(seqs, N, nb)
        self._prev = (seqs, inp[:N] if tokens else inp, nb) if context and riders is None else (None, None, 0)
        return inp, nb

    @staticmethod
    def position_of(s: Sequence) -> int:
        """The device position of a sequence: that of the last token whose prelude ran (a decode
        token waiting in the prelude queue has not had it yet; a prompt's first prelude gives
        position L)."""
        out = s.output_ids
        return len(s.prompt_ids) + len(out) - (2 if out and s.stage is Stage.PRELUDE else 1)

    def _count_attention(self, seqs: list[Sequence], N: int, nb: int) -> None:
        """Decode attention traffic of one stage, in KV rows per attention layer: what the SDPA path
        reads (N x L, padded), what a paged kernel reads (whole blocks of each context), and the
        real context sum. Off unless `attention_stats` is a dict (bench_host turns it on)."""
        B, st = self.block_size, self.attention_stats
        ctx = [s.num_tokens for s in seqs]
        st["stages"] = st.get("stages", 0) + 1
        st["rows_read"] = st.get("rows_read", 0) + N * self.ctx_blocks(nb) * B
        st["rows_paged"] = st.get("rows_paged", 0) + sum(-(-c // B) * B for c in ctx)
        st["context"] = st.get("context", 0) + sum(ctx)

    def ctx_blocks(self, nb: int) -> int:
        """Context blocks the SDPA path attends (on CUDA, a few power-of-two buckets so that graphs
        and kernels see a handful of shapes)."""
        return context_blocks(nb, self.bt.shape[1], self.bucketed)

    # ------------------------------------------------------------------ on the device
    def rows(self, slots: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """KV rows of positions `pos` of the items in `slots` (the scratch row for padding)."""
        B = self.block_size
        rows = self.bt[self.owner[slots], pos // B] * B + pos % B
        return torch.where(slots == self.scratch_slot, self.scratch_row, rows)

    def gather(self, stage: Stage, inp: torch.Tensor, nb: int, paged: bool | None = None,
               context_items: int | None = None) -> tuple[torch.Tensor, TokenBatch]:
        """The stage's slots and TokenBatch, gathered on the device from the per-slot state (inside
        the CUDA graph when graphs are used): ids, positions, rows, loop steps, context rows
        [N, nb * B] (or, `paged`, the block tables; `context_items`: only the first that many items'
        context rows, the decode items of an SDPA mixed launch). A stage that embeds tokens (`inp` =
        slots + tokens) first moves each real slot one position on: the token it embeds is the one
        after its previous position."""
        B = self.block_size
        if stage.reads_tokens:
            N = inp.shape[0] // 2
            slots, ids = inp[:N], inp[N:]
            ids = torch.where(ids >= 0, ids, self.tok[slots])  # -1: the id the device sampled (re-entry)
            self.pos.index_add_(0, slots, (slots != self.scratch_slot).long())
        else:
            slots, ids = inp, None
        pos = self.pos[slots]
        steps = self.step[slots] + 1 if stage is Stage.CORE else torch.ones_like(pos)
        tables = self.bt[self.owner[slots]][:, :nb]  # (a chunk position reads its sequence's table)
        batch = TokenBatch(ids=pos if ids is None else ids, positions=pos, rows=self.rows(slots, pos), steps=steps,
                           ctx_len=pos + 1, scored=min(slots.shape[0], self.head_rows))  # (only the prelude reads ids)
        if self.paged if paged is None else paged:
            batch.paged = PagedContext(tables, self.page_index, B, flex=self.flex)
        else:
            if context_items is not None:
                tables, batch.ctx_len = tables[:context_items], batch.ctx_len[:context_items]
            j = self._j[: nb * B]
            batch.ctx_rows = tables[:, j // B] * B + j % B
        return slots, batch

    # ------------------------------------------------------------------ the oracle
    def check(self, seqs: list[Sequence]) -> None:
        """The oracle of the incremental state, after a decode launch over `seqs` (before the
        scheduler's postprocess): rewrite everything these sequences own from the Sequences alone
        (position = the last token's, every block-table entry, the inverse page entries when paged)
        and compare with what the device holds; raises AssertionError naming the first mismatch."""
        if not seqs:
            return
        S, MB = self.bt.shape
        slots = [s.slot for s in seqs]
        want_pos = torch.tensor([s.num_tokens - 1 for s in seqs], dtype=torch.long)
        want_bt = torch.zeros(len(seqs), MB, dtype=torch.long)
        for i, s in enumerate(seqs):
            assert 0 <= s.slot < S - 1, f"{s.request_id}: slot {s.slot}"
            assert self._own[s.slot] is s and self._nblk[s.slot] == len(s.blocks), \
                f"{s.request_id}: the host's record of slot {s.slot} is not its table ({self._nblk[s.slot]} entries)"
            want_bt[i, :len(s.blocks)] = torch.tensor(s.blocks, dtype=torch.long)
        got_pos = self.pos[slots].cpu()
        got_bt = self.bt[slots].cpu()
        for i, s in enumerate(seqs):
            n = len(s.blocks)
            assert int(got_pos[i]) == int(want_pos[i]), \
                f"{s.request_id}: device position {int(got_pos[i])}, the sequence's {int(want_pos[i])}"
            assert got_bt[i, :n].tolist() == want_bt[i, :n].tolist(), \
                f"{s.request_id}: device block table {got_bt[i, :n].tolist()}, the sequence's {s.blocks}"
            if self.paged:
                assert self.page_index[s.blocks].tolist() == list(range(n)), f"{s.request_id}: inverse page table"

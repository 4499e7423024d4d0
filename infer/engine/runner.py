"""The model runner: executes one stage on a batch of sequences at mixed depths.

Tensors live here. Per-sequence loop state (state, injection, criterion memory) sits in static
buffers indexed by the sequence's slot; KV goes through the layout (kv_layouts). Decode batches
are padded to powers of two: padded items use the scratch slot and the layout's scratch row, so
they write no real KV and are never sampled.

Decode stages (prelude, core, coda, CB's fused iteration) share one metadata format, so on CUDA
each can replay a CUDA graph captured per (stage, padded batch, context bucket) from static
input buffers (graphs.py). The CPU path runs the same `body` eagerly. A core step returns its
exit scores as a pending host copy, which lets the engine prepare the next batch while the
device still runs this one (the lookahead pipeline).

`Runner` is what the engine needs from a runner; `ModelRunner` runs the model, the simulator's
`SimRunner` (infer/bench/sim.py) charges a cost model instead.
"""
from __future__ import annotations

from array import array
from itertools import chain, repeat
from operator import is_
from typing import Protocol, runtime_checkable

import torch

from kv_layouts import make_layout
from looplm.exits import initial_aux
from looplm.model import LoopedLM

from . import mixed, stages
from .block_manager import BlockManager
from .graphs import GraphCache
from .scheduler import Scores, SwapOp, Work
from .swap import swap_ops
from .sequence import Sequence, Stage
from .stages import PagedContext, TokenBatch


@runtime_checkable
class Runner(Protocol):
    """What the engine calls on a runner: one stage per `run`. Returns the logits [B, V] of a stage
    that emits tokens (prefill, coda, fused), the exit `Scores` of a core step, None for a prelude."""

    def run(self, work: Work) -> torch.Tensor | Scores | None: ...

    def padded(self, n: int) -> int: ...


def next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


class PendingScores:
    """Exit scores of a launched core step (a `Scores`)."""

    def __init__(self, scores: torch.Tensor, n: int):
        self.n = n
        if scores.device.type == "cuda":
            self.host = torch.empty(scores.shape, dtype=scores.dtype, pin_memory=True)
            self.host.copy_(scores, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host, self.event = scores, None

    def get(self) -> list[float]:
        """The scores; waits for (only) the step that produced them."""
        if self.event is not None:
            self.event.synchronize()
        return self.host[: self.n].tolist()


class ModelRunner:
    def __init__(self, model: LoopedLM, kv_layout: str, blocks: BlockManager, criterion: str,
                 pad_pow2: bool = True, max_batch_size: int = 64, cuda_graphs: bool = False):
        self.model, self.cfg, self.blocks, self.criterion = model, model.cfg, blocks, criterion
        self.device, self.dtype = model.device, model.dtype
        self.pad_pow2, self.max_batch_size = pad_pow2, max_batch_size
        self._pad_cap = next_pow2(max_batch_size)
        self.layout = make_layout(kv_layout, self.cfg, blocks.num_blocks * blocks.block_size, self.dtype, self.device)
        S, D = blocks.num_slots + 1, self.cfg.hidden_size  # slot S-1 is the scratch slot for padding
        self.scratch_slot = S - 1
        self.state = torch.zeros(S, D, dtype=self.dtype, device=self.device)
        self.inj = torch.zeros(S, D, dtype=self.dtype, device=self.device) if self.cfg.arch == "huginn" else None
        self.aux = initial_aux(criterion, S, self.cfg.vocab_size, self.device)
        if cuda_graphs and self.device.type != "cuda":
            raise ValueError("cuda_graphs needs a CUDA device")
        self.graphs = GraphCache(self) if cuda_graphs else None
        self._init_batch_state(S)
        self._bodies = {Stage.PRELUDE: self._prelude_body, Stage.CORE: self._core_body, Stage.CODA: self._coda_body,
                        Stage.FUSED: self._fused_body}
        self._stages = {Stage.PREFILL: self._prefill, Stage.PRELUDE: self._prelude, Stage.CORE: self._core,
                        Stage.CODA: self._coda, Stage.FUSED: self._fused}

    def _t(self, xs: list | array | torch.Tensor) -> torch.Tensor:
        """Host ints -> a long tensor on the device (on CUDA: pinned, asynchronous). An array('q')
        converts 3x faster than a list (torch.tensor walks the list item by item)."""
        if isinstance(xs, array):
            xs = torch.frombuffer(xs, dtype=torch.long) if len(xs) else torch.zeros(0, dtype=torch.long)
        if self.device.type != "cuda":
            return xs if isinstance(xs, torch.Tensor) else torch.tensor(xs, dtype=torch.long)
        t = xs.pin_memory() if isinstance(xs, torch.Tensor) else torch.tensor(xs, dtype=torch.long, pin_memory=True)
        return t.to(self.device, non_blocking=True)

    def padded(self, n: int) -> int:
        return min(next_pow2(n), max(self._pad_cap, n)) if self.pad_pow2 else n

    # ------------------------------------------------------------------ persistent batch state
    def _init_batch_state(self, S: int) -> None:
        """Per-slot decode metadata on the device, kept across stages (vLLM V1's persistent batch):
        position, loop step and block table of the sequence in each state slot. A stage sends, in
        one host-to-device copy, its slots, the last tokens of its items if it embeds them (prelude,
        fused), the metadata of the sequences the scheduler reports in `Work.changed` (admitted,
        swapped in, resumed) or that were invalidated, and the new block-table entries of those in
        `Work.grown`; nothing else is per item.
        Positions advance on the device: a prelude (or fused) launch moves each of its slots one
        position on, since every decode token passes through exactly one. The host keeps no
        per-token mirror: it knows which block tables it sent (`_own`, `_nblk`), and the context
        length of a batch is its longest block table."""
        B = self.blocks.block_size
        MB = -(-self.cfg.max_position // B)
        long = dict(dtype=torch.long, device=self.device)
        # one flat tensor: [S, 2] (position, loop step), then the block tables [S, MB], so that the
        # rewrites of a stage are one index_copy_ of (flat index, value) pairs
        self._flat = torch.zeros(S * 2 + S * MB, **long)
        self.slot_meta = self._flat[:2 * S].view(S, 2)
        self.pos, self.step = self.slot_meta.unbind(1)
        self.bt = self._flat[2 * S:].view(S, MB)  # the scratch slot's table stays 0
        self._j = torch.arange(MB * B, **long)  # context offsets, sliced per stage
        # paged attention (stages.paged_attention): decode attention reads each item's own blocks
        # through the block tables instead of gathering every context to the longest. Off by
        # default: on CUDA it needs scripts/gpu_check.py's parity and speed check first.
        self.paged = False
        self.flex = None  # a compiled flex_attention for paged attention on CUDA (set by enable_paged)
        # inverse page table: each block's index in its owner's table (one entry more: the block of
        # the layout's scratch row); stale entries of freed blocks are harmless (see PagedContext)
        self.page_index = torch.zeros(self.blocks.num_blocks + 1, **long)
        self._own: list[Sequence | None] = [None] * S  # whose block table the device holds, per slot
        self._nblk = [0] * S  # how many entries of it
        self._redo: list[Sequence] = []  # to rewrite at the next upload (Work.changed, invalidate)
        self._grown: list[Sequence] = []  # new block-table entries to send at the next upload (Work.grown)
        self._prev: tuple = (None, None, 0)  # the last upload (seqs, slots, context blocks): see _upload
        self.attention_stats: dict | None = None  # see _count_attention

    def invalidate(self, slot: int) -> None:
        """Forget what the device holds for `slot`: its sequence's metadata and whole block table are
        rewritten at the next upload (call it when they change behind the scheduler's back)."""
        s = self._own[slot]
        self._own[slot] = None
        if s is not None:
            self._redo.append(s)

    def _upload(self, seqs: list[Sequence], tokens: bool = False, context: bool = True) -> tuple[torch.Tensor, int]:
        """Bring the per-slot state up to date with one host-to-device copy. Returns the stage's
        input, the padded batch's slots [N] (padding: the scratch slot), followed with `tokens` by
        each item's last token [N], and its context length in blocks (1 without `context`: a stage
        with no attention layer, Ouro's prelude, reads none). A stage over the same
        sequences as the previous one with nothing to send (consecutive core steps) reuses the
        previous slots: no copy, no per-item work."""
        redo, grown = self._redo, self._grown
        if not tokens and not redo and not grown and seqs == self._prev[0]:  # identity compare, C speed
            if self.attention_stats is not None:
                self._count_attention(seqs, self._prev[1].shape[0], self._prev[2])
            return self._prev[1], self._prev[2]
        own, nblk, MB, S = self._own, self._nblk, self.bt.shape[1], self.slot_meta.shape[0]
        idx: list[int] = []  # flat indices into _flat (position, loop step, block-table entries)
        val: list[int] = []
        new_pages: list[int] = []  # (block, its index in the table) for the paged path's inverse table
        # rewrites (redo: position, loop step, and the table from what the device holds of it) and
        # growth (grown: the new table entries only; the device holds the rest, the position and
        # the loop step, unless the table never reached it: admitted or swapped in since)
        for s, meta in chain(zip(grown, repeat(False)), zip(redo, repeat(True))) if grown or redo else ():
            sl = s.slot
            if sl < 0:  # finished or swapped out since
                continue
            blocks = s.blocks
            held = own[sl] is s and nblk[sl] <= len(blocks)
            if meta or not held:
                out = s.output_ids
                # the device position is that of the last token whose prelude ran: a decode token
                # waiting in the prelude queue has not had it yet (a prompt's first prelude gives position L)
                p = len(s.prompt_ids) + len(out) - (2 if out and s.stage is Stage.PRELUDE else 1)
                idx += (2 * sl, 2 * sl + 1)
                val += (p, s.step)
            own[sl] = s
            for c in range(nblk[sl] if held else 0, len(blocks)):
                idx.append(2 * S + sl * MB + c)
                val.append(blocks[c])
                new_pages += (blocks[c], c)
            nblk[sl] = len(blocks)
        if grown:
            self._grown = []
        if redo:
            self._redo = []
        slots = [s.slot for s in seqs]
        nb = max(map(nblk.__getitem__, slots)) if context and slots else 1
        n, N = len(seqs), self.padded(len(seqs))
        head = slots + [self.scratch_slot] * (N - n)
        if tokens:  # the token each item embeds: its last output
            head += [s.output_ids[-1] for s in seqs] + [0] * (N - n)
        k = len(idx)
        buf = self._t(array("q", head + idx + val + new_pages if self.paged else head + idx + val))
        h = len(head)
        if k:
            self._flat.index_copy_(0, buf[h:h + k], buf[h + k:h + 2 * k])
            if self.paged:
                pg = buf[h + 2 * k:].view(-1, 2)
                self.page_index.index_copy_(0, pg[:, 0], pg[:, 1])
        inp = buf[:h] if k else buf
        if self.attention_stats is not None and context:  # (a stage without attention reads no KV)
            self._count_attention(seqs, N, nb)
        self._prev = (seqs, inp[:N] if tokens else inp, nb) if context else (None, None, 0)
        return inp, nb

    def _count_attention(self, seqs: list[Sequence], N: int, nb: int) -> None:
        """Decode attention traffic of one stage, in KV rows per attention layer: what the SDPA path
        reads (N x L, padded), what a paged kernel reads (whole blocks of each context), and the
        real context sum. Off unless `attention_stats` is a dict (bench_host turns it on)."""
        B, st = self.blocks.block_size, self.attention_stats
        ctx = [s.num_tokens for s in seqs]
        st["stages"] = st.get("stages", 0) + 1
        st["rows_read"] = st.get("rows_read", 0) + N * self._ctx_blocks(nb) * B
        st["rows_paged"] = st.get("rows_paged", 0) + sum(-(-c // B) * B for c in ctx)
        st["context"] = st.get("context", 0) + sum(ctx)

    def _ctx_blocks(self, nb: int) -> int:
        """Context blocks the SDPA path attends (on CUDA, a few power-of-two buckets so that graphs
        and kernels see a handful of shapes)."""
        if self.device.type == "cuda":
            nb = min(next_pow2(nb), self.bt.shape[1])
        return nb

    def _rows(self, slots: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """KV rows of positions `pos` of the sequences in `slots` (the scratch row for padding)."""
        B = self.blocks.block_size
        rows = self.bt[slots, pos // B] * B + pos % B
        return torch.where(slots == self.scratch_slot, self.layout.scratch_row, rows)

    def batch_from(self, stage: Stage, inp: torch.Tensor, nb: int) -> tuple[torch.Tensor, TokenBatch]:
        """The stage's slots and TokenBatch, gathered on the device from the per-slot state (inside
        the CUDA graph when graphs are used): ids, positions, rows, loop steps, context rows
        [N, nb * B]. A stage that embeds tokens (`inp` = slots + tokens) first moves each real
        slot one position on: the token it embeds is the one after its previous position."""
        B = self.blocks.block_size
        if stage.reads_tokens:
            N = inp.shape[0] // 2
            slots, ids = inp[:N], inp[N:]
            self.pos.index_add_(0, slots, (slots != self.scratch_slot).long())
        else:
            slots, ids = inp, None
        pos = self.pos[slots]
        steps = self.step[slots] + 1 if stage is Stage.CORE else torch.ones_like(pos)
        batch = TokenBatch(ids=pos if ids is None else ids, positions=pos, rows=self._rows(slots, pos), steps=steps,
                           ctx_len=pos + 1)  # (only the prelude reads ids)
        if self.paged:
            batch.paged = PagedContext(self.bt[slots][:, :nb], self.page_index, B, flex=self.flex)
        else:
            j = self._j[: nb * B]
            batch.ctx_rows = self.bt[slots][:, :nb][:, j // B] * B + j % B
        return slots, batch

    def enable_paged(self, compile: bool | None = None) -> None:
        """Switch decode attention to paged FlexAttention (compiled on CUDA unless `compile` is
        False). Block tables already on the device get their inverse page table rebuilt."""
        self.paged = True
        if compile if compile is not None else self.device.type == "cuda":
            from torch.nn.attention.flex_attention import flex_attention
            self.flex = torch.compile(flex_attention, dynamic=False)
        for sl, n in enumerate(self._nblk):  # re-upload every table at its next stage
            if n:
                self.invalidate(sl)

    def body(self, stage: Stage, inp: torch.Tensor, nb: int, r_max: int = 0) -> torch.Tensor | None:
        """One decode stage over a padded batch (`inp`: slots [N], + their tokens for a prelude or
        fused stage; `nb` context blocks), reading and writing only static buffers (so it can be
        captured in a CUDA graph). Returns scores [N] (core), logits [N, V] (coda, fused)."""
        return self._bodies[stage](*self.batch_from(stage, inp, nb), r_max)

    def _prelude_body(self, slots: torch.Tensor, batch: TokenBatch, r_max: int) -> None:
        state, inj = stages.prelude(self.model, self.layout, batch)
        self.step.index_fill_(0, slots, 0)
        self.state.index_copy_(0, slots, state)
        if self.inj is not None:
            self.inj.index_copy_(0, slots, inj)
        if self.aux is not None:
            self.aux.index_copy_(0, slots, initial_aux(self.criterion, slots.shape[0], self.cfg.vocab_size,
                                                       self.device))

    def _core_body(self, slots: torch.Tensor, batch: TokenBatch, r_max: int) -> torch.Tensor:
        inj = self.inj[slots] if self.inj is not None else None
        aux = self.aux[slots] if self.aux is not None else None
        new, scores, aux = stages.core_step(self.model, self.layout, batch, self.state[slots], inj, self.criterion,
                                            aux)
        self.state.index_copy_(0, slots, new)
        if aux is not None:
            self.aux.index_copy_(0, slots, aux)
        self.step.index_copy_(0, slots, batch.steps)
        self.step[self.scratch_slot:].zero_()  # padding keeps loop step 1 (its KV index stays in range)
        return scores

    def _coda_body(self, slots: torch.Tensor, batch: TokenBatch, r_max: int) -> torch.Tensor:
        # the layout's on-exit hook (last_exited fill) first; the loop step of each slot is its exit depth
        self.layout.on_exit(batch.rows, self.step[slots])
        return stages.coda(self.model, self.layout, batch, self.state[slots])

    def _fused_body(self, slots: torch.Tensor, batch: TokenBatch, r_max: int) -> torch.Tensor:
        """CB: prelude + r_max core steps + coda, no scheduling in between."""
        return stages.fused(self.model, self.layout, batch, r_max)

    def _decode(self, stage: Stage, seqs: list[Sequence], r_max: int = 0):
        inp, nb = self._upload(seqs, tokens=stage.reads_tokens,
                               context=stage is not Stage.PRELUDE or self.cfg.n_prelude > 0)
        nb = self._ctx_blocks(nb)
        if self.graphs is not None:
            return self.graphs.run(stage, inp, nb, r_max), len(seqs)
        return self.body(stage, inp, nb, r_max), len(seqs)

    # ------------------------------------------------------------------ stages
    def run(self, work: Work) -> torch.Tensor | PendingScores | None:
        if torch.is_inference_mode_enabled():  # the engine's loops already are (entering costs ~5 us a stage)
            return self._run(work)
        with torch.inference_mode():
            return self._run(work)

    def _run(self, work: Work) -> torch.Tensor | PendingScores | None:
        if work.changed:  # rewritten at this or the next stage that uploads (a prefill does not)
            self._redo += work.changed
        if work.grown:
            self._grown += work.grown
        # a launch with prompt chunks riding along runs the mixed path (mixed.py), eagerly
        if work.chunks:
            return self._mixed_core(work) if work.stage is Stage.CORE else mixed.run(self, work)
        return self._stages[work.stage](work)

    def _prelude(self, work: Work) -> None:
        self._decode(Stage.PRELUDE, work.seqs)

    def _core(self, work: Work) -> PendingScores:
        """One loop step for every item, each at its own depth."""
        scores, n = self._decode(Stage.CORE, work.seqs)
        return PendingScores(scores, n)

    def _mixed_core(self, work: Work) -> PendingScores:
        return PendingScores(mixed.run(self, work), len(work.seqs))

    def _coda(self, work: Work) -> torch.Tensor:
        logits, n = self._decode(Stage.CODA, work.seqs)
        return logits[:n]

    def _fused(self, work: Work) -> torch.Tensor:
        logits, n = self._decode(Stage.FUSED, work.seqs, r_max=work.r_max)
        return logits[:n]

    def _prefill(self, work: Work) -> torch.Tensor:
        return self.prefill(work.seqs)

    def prefill(self, seqs: list[Sequence]) -> torch.Tensor:
        """Whole prompts at full depth; returns the last position's logits [B, V]."""
        B = self.blocks.block_size
        ids, pos, blocks, keep, sid, last = [], [], [], [], [], []
        for i, s in enumerate(seqs):
            L = len(s.prompt_ids)
            ids += s.prompt_ids
            pos += range(L)
            nb = -(-L // B)
            blocks += s.blocks[:nb]
            keep += [True] * L + [False] * (nb * B - L)  # the rows of positions 0..L-1 of its blocks
            sid += [i] * L
            last.append(len(ids) - 1)
        span = (torch.tensor(blocks, dtype=torch.long)[:, None] * B + torch.arange(B)).view(-1)
        rows = span[torch.tensor(keep)]
        batch = TokenBatch(ids=self._t(ids), positions=self._t(pos), rows=self._t(rows),
                           steps=torch.ones(len(ids), dtype=torch.long, device=self.device), seq_ids=self._t(sid))
        # echo / prompt log-probs: after the B last rows, every position of the prompts that ask
        # for them (the same full-depth prefill, more rows through the head)
        want = [(s, last[i] - len(s.prompt_ids) + 1) for i, s in enumerate(seqs) if s.params.prompt_logprobs is not None]
        idx = last + [j for s, a in want for j in range(a, a + len(s.prompt_ids))]
        logits = self.prefill_body(batch, self._t(idx))
        n = len(seqs)
        for s, _ in want:
            s.prompt_logits, n = logits[n:n + len(s.prompt_ids)], n + len(s.prompt_ids)
        return logits[:len(seqs)]

    def prefill_body(self, batch: TokenBatch, last: torch.Tensor) -> torch.Tensor:
        return stages.prefill(self.model, self.layout, batch, last)

    # ------------------------------------------------------------------ preemption (swap.py)
    @torch.inference_mode()
    def swap(self, ops: list[SwapOp]) -> None:
        """Run the scheduler's swap operations in order (see infer/engine/swap.py)."""
        host = self.__dict__.setdefault("_host_swap", {})
        swap_ops(self.layout, [self.state, self.inj, self.aux], self.blocks.block_size, host, ops)
        for op in ops:
            if op.kind == "in":
                self.invalidate(op.slot)  # its block table and loop state are rewritten at its next stage

"""The model runner: executes one stage on a batch of sequences at mixed depths.

Tensors live here. Per-sequence loop state (state, injection, criterion memory) sits in static
buffers indexed by the sequence's slot; KV goes through the layout (kv_layouts). Decode batches
are padded to powers of two: padded items use the scratch slot and the layout's scratch row, so
they write no real KV and are never sampled. On CUDA, core steps can replay CUDA graphs captured
per (padded batch, context bucket) - see `graphs.py`; the CPU path is the same code without them.
"""
from __future__ import annotations

import torch

from kv_layouts import make_layout
from looplm import stages
from looplm.exits import initial_aux
from looplm.model import LoopedLM
from looplm.stages import TokenBatch

from .block_manager import BlockManager
from .sequence import Sequence


def next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


class ModelRunner:
    def __init__(self, model: LoopedLM, kv_layout: str, blocks: BlockManager, criterion: str,
                 pad_pow2: bool = True, max_batch_size: int = 64):
        self.model, self.cfg, self.blocks, self.criterion = model, model.cfg, blocks, criterion
        self.device, self.dtype = model.device, model.dtype
        self.pad_pow2, self.max_batch_size = pad_pow2, max_batch_size
        self.layout = make_layout(kv_layout, self.cfg, blocks.num_blocks * blocks.block_size, self.dtype, self.device)
        S, D = blocks.num_slots + 1, self.cfg.hidden_size  # slot S-1 is the scratch slot for padding
        self.scratch_slot = S - 1
        self.state = torch.zeros(S, D, dtype=self.dtype, device=self.device)
        self.inj = torch.zeros(S, D, dtype=self.dtype, device=self.device) if self.cfg.arch == "huginn" else None
        self.aux = initial_aux(criterion, S, self.cfg.vocab_size, self.device)

    def _t(self, xs) -> torch.Tensor:
        return torch.tensor(xs, dtype=torch.long).to(self.device, non_blocking=True)

    def padded(self, n: int) -> int:
        return min(next_pow2(n), max(next_pow2(self.max_batch_size), n)) if self.pad_pow2 else n

    # ------------------------------------------------------------------ batches
    def decode_batch(self, seqs: list[Sequence], steps: list[int] | None = None) -> tuple[TokenBatch, torch.Tensor]:
        """TokenBatch for the current decode token of each sequence (+ padding) and their slots."""
        bm, B = self.blocks, self.blocks.block_size
        n = len(seqs)
        N = self.padded(n)
        pad = N - n
        pos = [s.position for s in seqs]
        ctx_len = [p + 1 for p in pos] + [1] * pad
        L = -(-max(ctx_len) // B) * B
        nb = L // B
        bt = [s.blocks[:nb] + [0] * (nb - min(nb, len(s.blocks))) for s in seqs] + [[0] * nb] * pad
        rows = [bm.row(s.blocks, p) for s, p in zip(seqs, pos)] + [self.layout.scratch_row] * pad
        bt_t = self._t(bt)
        j = torch.arange(L, device=self.device)
        ctx_rows = bt_t[:, j // B] * B + j % B  # [N, L]
        batch = TokenBatch(
            ids=self._t([s.output_ids[-1] for s in seqs] + [0] * pad), positions=self._t(pos + [0] * pad),
            rows=self._t(rows), steps=self._t((steps or [s.step + 1 for s in seqs]) + [1] * pad),
            ctx_rows=ctx_rows, ctx_len=self._t(ctx_len))
        slots = self._t([s.slot for s in seqs] + [self.scratch_slot] * pad)
        return batch, slots

    # ------------------------------------------------------------------ stages
    @torch.inference_mode()
    def prefill(self, seqs: list[Sequence]) -> torch.Tensor:
        """Whole prompts at full depth; returns the last position's logits [B, V]."""
        bm = self.blocks
        ids, pos, rows, sid, last = [], [], [], [], []
        for i, s in enumerate(seqs):
            L = len(s.prompt_ids)
            ids += s.prompt_ids
            pos += range(L)
            rows += [bm.row(s.blocks, p) for p in range(L)]
            sid += [i] * L
            last.append(len(ids) - 1)
        batch = TokenBatch(ids=self._t(ids), positions=self._t(pos), rows=self._t(rows),
                           steps=torch.ones(len(ids), dtype=torch.long, device=self.device), seq_ids=self._t(sid))
        return stages.prefill(self.model, self.layout, batch, self._t(last))

    @torch.inference_mode()
    def prelude(self, seqs: list[Sequence]) -> None:
        batch, slots = self.decode_batch(seqs, steps=[1] * len(seqs))
        state, inj = stages.prelude(self.model, self.layout, batch)
        self.state.index_copy_(0, slots, state)
        if self.inj is not None:
            self.inj.index_copy_(0, slots, inj)
        if self.aux is not None:
            self.aux[slots] = initial_aux(self.criterion, 1, self.cfg.vocab_size, self.device)

    @torch.inference_mode()
    def core(self, seqs: list[Sequence]) -> list[float]:
        """One loop step for every item (each at its own depth); returns their exit scores."""
        batch, slots = self.decode_batch(seqs)
        inj = self.inj[slots] if self.inj is not None else None
        aux = self.aux[slots] if self.aux is not None else None
        new, scores, aux = stages.core_step(self.model, self.layout, batch, self.state[slots], inj, self.criterion, aux)
        self.state.index_copy_(0, slots, new)
        if aux is not None:
            self.aux.index_copy_(0, slots, aux)
        return scores[: len(seqs)].tolist()

    def mark_exited(self, seqs: list[Sequence]) -> None:
        """The layout's on-exit hook (last_exited fill) for tokens that left the loop."""
        rows = self._t([self.blocks.row(s.blocks, s.position) for s in seqs])
        self.layout.on_exit(rows, self._t([s.step for s in seqs]))

    @torch.inference_mode()
    def coda(self, seqs: list[Sequence]) -> torch.Tensor:
        batch, slots = self.decode_batch(seqs)
        return stages.coda(self.model, self.layout, batch, self.state[slots])[: len(seqs)]

    @torch.inference_mode()
    def fused(self, seqs: list[Sequence], r_max: int) -> torch.Tensor:
        """CB's decode iteration: prelude + r_max core steps + coda as one forward, no scheduling
        in between (what a token-level engine runs). Returns logits [n, V]."""
        batch, _ = self.decode_batch(seqs, steps=[1] * len(seqs))
        m, lay = self.model, self.layout
        state, inj = stages.prelude(m, lay, batch)
        rope = m.rope(batch.positions)
        att = stages.KVAttention(lay, batch)
        for s in range(1, r_max + 1):
            att.step = s
            state = m.core_step(state, inj, rope, att)
        att.step = None
        return m.head(m.coda(state, rope, att))[: len(seqs)]

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

import dataclasses
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from kv_layouts import make_layout
from looplm.exits import initial_aux
from looplm.model import LoopedLM

from . import stages
from .block_manager import BlockManager
from .graphs import GraphCache
from .scheduler import Scores, Work
from .sequence import Sequence, Stage
from .stages import TokenBatch


@runtime_checkable
class Runner(Protocol):
    """What the engine calls on a runner: one stage per `run`. Returns the logits [B, V] of a stage
    that emits tokens (prefill, coda, fused), the exit `Scores` of a core step, None for a prelude."""

    def run(self, work: Work) -> torch.Tensor | Scores | None: ...

    def padded(self, n: int) -> int: ...


def next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


@dataclass
class Meta:
    """Host-side metadata of a padded decode batch."""
    ids: list[int]
    pos: list[int]
    rows: list[int]
    steps: list[int]
    bt: list[list[int]]  # block tables [N, L // block_size]
    ctx_len: list[int]
    slots: list[int]
    n: int  # real items (the rest is padding)
    L: int  # context length attended (a multiple of the block size)


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
        self.layout = make_layout(kv_layout, self.cfg, blocks.num_blocks * blocks.block_size, self.dtype, self.device)
        S, D = blocks.num_slots + 1, self.cfg.hidden_size  # slot S-1 is the scratch slot for padding
        self.scratch_slot = S - 1
        self.state = torch.zeros(S, D, dtype=self.dtype, device=self.device)
        self.inj = torch.zeros(S, D, dtype=self.dtype, device=self.device) if self.cfg.arch == "huginn" else None
        self.aux = initial_aux(criterion, S, self.cfg.vocab_size, self.device)
        if cuda_graphs and self.device.type != "cuda":
            raise ValueError("cuda_graphs needs a CUDA device")
        self.graphs = GraphCache(self) if cuda_graphs else None
        self._last_key, self._last, self._last_steps = None, None, None  # batch reuse (see _decode)
        self._bodies = {Stage.PRELUDE: self._prelude_body, Stage.CORE: self._core_body, Stage.CODA: self._coda_body,
                        Stage.FUSED: self._fused_body}
        self._stages = {Stage.PREFILL: self._prefill, Stage.PRELUDE: self._prelude, Stage.CORE: self._core,
                        Stage.CODA: self._coda, Stage.FUSED: self._fused}

    def _t(self, xs) -> torch.Tensor:
        t = torch.tensor(xs, dtype=torch.long)
        if self.device.type == "cuda":
            return t.pin_memory().to(self.device, non_blocking=True)
        return t

    def padded(self, n: int) -> int:
        return min(next_pow2(n), max(next_pow2(self.max_batch_size), n)) if self.pad_pow2 else n

    # ------------------------------------------------------------------ decode batches
    def meta(self, seqs: list[Sequence], steps: list[int] | None = None, bucket_ctx: bool = False) -> Meta:
        bm, B = self.blocks, self.blocks.block_size
        n = len(seqs)
        pad = self.padded(n) - n
        pos = [s.position for s in seqs]
        ctx_len = [p + 1 for p in pos] + [1] * pad
        L = -(-max(ctx_len) // B) * B
        if bucket_ctx:  # graphs: a few context buckets instead of one graph per length
            L = min(max(B, next_pow2(L)), -(-self.cfg.max_position // B) * B)
        nb = L // B
        bt = [s.blocks[:nb] + [0] * (nb - min(nb, len(s.blocks))) for s in seqs] + [[0] * nb] * pad
        return Meta(ids=[s.output_ids[-1] for s in seqs] + [0] * pad, pos=pos + [0] * pad,
                    rows=[bm.row(s.blocks, p) for s, p in zip(seqs, pos)] + [self.layout.scratch_row] * pad,
                    steps=(steps or [s.step + 1 for s in seqs]) + [1] * pad, bt=bt, ctx_len=ctx_len,
                    slots=[s.slot for s in seqs] + [self.scratch_slot] * pad, n=n, L=L)

    def tensors(self, m: Meta) -> dict[str, torch.Tensor]:
        return {"ids": self._t(m.ids), "pos": self._t(m.pos), "rows": self._t(m.rows), "steps": self._t(m.steps),
                "bt": self._t(m.bt), "ctx_len": self._t(m.ctx_len), "slots": self._t(m.slots)}

    def batch_from(self, t: dict[str, torch.Tensor]) -> TokenBatch:
        B = self.blocks.block_size
        L = t["bt"].shape[1] * B
        j = torch.arange(L, device=self.device)
        ctx_rows = t["bt"][:, j // B] * B + j % B  # [N, L]
        return TokenBatch(ids=t["ids"], positions=t["pos"], rows=t["rows"], steps=t["steps"], ctx_rows=ctx_rows,
                          ctx_len=t["ctx_len"])

    def body(self, stage: Stage, t: dict[str, torch.Tensor], r_max: int = 0, batch: TokenBatch | None = None
             ) -> torch.Tensor | None:
        """One decode stage over a padded batch, reading and writing only static buffers (so it
        can be captured in a CUDA graph). Returns scores [N] (core), logits [N, V] (coda, fused)."""
        batch = batch if batch is not None else self.batch_from(t)
        return self._bodies[stage](t["slots"], batch, r_max)

    def _prelude_body(self, slots: torch.Tensor, batch: TokenBatch, r_max: int) -> None:
        state, inj = stages.prelude(self.model, self.layout, batch)
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
        return scores

    def _coda_body(self, slots: torch.Tensor, batch: TokenBatch, r_max: int) -> torch.Tensor:
        return stages.coda(self.model, self.layout, batch, self.state[slots])

    def _fused_body(self, slots: torch.Tensor, batch: TokenBatch, r_max: int) -> torch.Tensor:
        """CB: prelude + r_max core steps + coda, no scheduling in between."""
        return stages.fused(self.model, self.layout, batch, r_max)

    def _decode(self, stage: Stage, seqs: list[Sequence], steps: list[int] | None = None, r_max: int = 0):
        graphed = self.graphs is not None
        # on CUDA, eager batches use the graphs' context buckets too: same shapes, same kernels
        meta = self.meta(seqs, steps, bucket_ctx=self.device.type == "cuda")
        if graphed:
            return self.graphs.run(stage, meta, r_max), meta.n
        # Consecutive stages over the same tokens (prelude, core steps, coda of one cohort) reuse
        # the batch tensors, its RoPE and its mask; only the loop steps change.
        key = (tuple(s.seq_id for s in seqs), tuple(meta.pos), meta.L)
        if key == self._last_key:
            t, batch = self._last
            if meta.steps != self._last_steps:
                t = {**t, "steps": self._t(meta.steps)}
                batch = dataclasses.replace(batch, steps=t["steps"])
        else:
            t = self.tensors(meta)
            batch = self.batch_from(t)
        self._last_key, self._last, self._last_steps = key, (t, batch), meta.steps
        return self.body(stage, t, r_max, batch), meta.n

    # ------------------------------------------------------------------ stages
    @torch.inference_mode()
    def run(self, work: Work) -> torch.Tensor | PendingScores | None:
        return self._stages[work.stage](work)

    def _prelude(self, work: Work) -> None:
        self._decode(Stage.PRELUDE, work.seqs, steps=[1] * len(work.seqs))

    def _core(self, work: Work) -> PendingScores:
        """One loop step for every item, each at its own depth."""
        scores, n = self._decode(Stage.CORE, work.seqs)
        return PendingScores(scores, n)

    def _coda(self, work: Work) -> torch.Tensor:
        # the layout's on-exit hook (last_exited fill) first: nothing has read the skipped slots yet
        seqs = work.seqs
        self.layout.on_exit(self._t([self.blocks.row(s.blocks, s.position) for s in seqs]),
                            self._t([s.step for s in seqs]))
        logits, n = self._decode(Stage.CODA, seqs)
        return logits[:n]

    def _fused(self, work: Work) -> torch.Tensor:
        logits, n = self._decode(Stage.FUSED, work.seqs, steps=[1] * len(work.seqs), r_max=work.r_max)
        return logits[:n]

    def _prefill(self, work: Work) -> torch.Tensor:
        return self.prefill(work.seqs)

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

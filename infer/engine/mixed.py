"""Mixed launches: one prelude, core step, coda or fused iteration over decode items *and* prompt
chunks (chunks.py has the scheduling). The runner gathers the decode items' batch from its batch
state as for a decode-only launch and runs the same stage body; this module appends the chunks:
each is a `Segment` of the batch (stages.py) whose attention is one causal SDPA over its own
context rows, and whose positions' loop state the runner keeps between launches (by seq_id).
Runs eagerly (no CUDA graph: a chunk's length varies per launch).
"""
from __future__ import annotations

from typing import Callable

import torch

from .block_manager import kv_rows
from .scheduler import Work
from .sequence import Stage
from .stages import Segment, TokenBatch


class Chunks:
    """The prompt chunks of a mixed launch, the rows after its N decode items. A stage body reads
    `state` / `inj` (their loop state, core and coda), `head` (the rows through the head: coda,
    fused) and hands back their new loop state with `keep` (prelude, core)."""

    def __init__(self, work: Work, block_size: int, to_device: Callable, states: dict, device: torch.device):
        self.work, self.block_size, self.to_device, self.device = work, block_size, to_device, device
        self.states = states  # seq_id -> (loop state, injection) of its chunk's positions (the runner's)
        self.state = self.inj = self.head = None
        self.segments: list[Segment] = []
        if work.stage in (Stage.CORE, Stage.CODA):
            kept = [states[s.seq_id] for s in work.chunks]
            self.state = torch.cat([st for st, _ in kept])
            self.inj = torch.cat([i for _, i in kept]) if kept[0][1] is not None else None

    def extend(self, dec: TokenBatch | None, N: int) -> TokenBatch:
        """The mixed TokenBatch: the N padded decode items of `dec` (None: none), then one segment per
        chunk. Sets `head` for a stage that emits."""
        work, B, t = self.work, self.block_size, self.to_device
        parts = [[dec.ids], [dec.positions], [dec.rows], [dec.steps]] if dec is not None else [[], [], [], []]
        long = dict(dtype=torch.long, device=self.device)
        start = N
        for s in work.chunks:
            a, e = s.chunk
            blocks = s.blocks
            rows = t(kv_rows(blocks, B, e))  # KV rows of positions 0..e-1
            step = s.step + 1 if work.stage is Stage.CORE else 1
            for part, x in zip(parts, (t(s.prompt_ids[a:e]), torch.arange(a, e, **long), rows[a:e],
                                       torch.full((e - a,), step, **long))):
                part.append(x)
            self.segments.append(Segment(start, e - a, a, rows))
            start += e - a
        ids, pos, rows, steps = (torch.cat(p) for p in parts)
        batch = TokenBatch(ids=ids, positions=pos, rows=rows, steps=steps, ctx_rows=dec.ctx_rows if dec else None,
                           ctx_len=dec.ctx_len if dec else None, segments=self.segments, num_decode=N)
        if work.stage.emits:
            self.head = t(head_rows(work, self.segments))  # (the upload path: no pageable copy on CUDA)
        return batch

    def keep(self, state: torch.Tensor, inj: torch.Tensor | None) -> None:
        """Keep each chunk's rows of the loop state a body computed, for its next launch."""
        for s, g in zip(self.work.chunks, self.segments):
            sl = slice(g.start, g.start + g.length)
            self.states[s.seq_id] = (state[sl], inj[sl] if inj is not None else None)


def head_rows(work: Work, segments: list[Segment]) -> list[int]:
    """Rows that go through the head: the real decode items, the last position of each chunk that
    ends its prompt (its first token), then every position of chunks whose request asked for prompt
    log-probs (`prompt_logits` reads them back in this order)."""
    idx = list(range(len(work.seqs)))
    finals = {id(s) for s in work.finals}
    for s, g in zip(work.chunks, segments):
        if id(s) in finals:
            idx.append(g.start + g.length - 1)
    for s, g in zip(work.chunks, segments):
        if s.params.prompt_logprobs is not None:
            idx += range(g.start, g.start + g.length)
    return idx


def prompt_logits(work: Work, logits: torch.Tensor, n: int, partial: dict[int, torch.Tensor]
                  ) -> dict[int, torch.Tensor] | None:
    """The prompt logits [L, V] of each prompt this launch completes that asked for them (by seq_id).
    The rows after the first `n` (sampled) rows of `logits` are the chunks' positions (`head_rows`);
    a chunk that does not end its prompt leaves its part in `partial` for the prompt's next chunk."""
    finals = {id(s) for s in work.finals}
    done: dict[int, torch.Tensor] = {}
    at = n
    for s in work.chunks:
        if s.params.prompt_logprobs is None:
            continue
        k = s.chunk[1] - s.chunk[0]
        part, at = logits[at:at + k], at + k
        prev = partial.pop(s.seq_id, None)
        whole = part if prev is None else torch.cat([prev, part])
        if id(s) in finals:
            done[s.seq_id] = whole
        else:
            partial[s.seq_id] = whole
    return done or None


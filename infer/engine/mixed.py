"""Mixed launches: prompt chunks riding in a prelude, core step, coda or fused launch (chunks.py has
the scheduling). Each position of a chunk is an item of the launch, like a decode token: it holds a
*token slot* of the runner (a row of its loop-state buffers and of the batch state, after the
sequences' slots) from the chunk's prelude to its coda, with its own position and loop step and its
sequence's block table (BatchState.owner). So the launch gathers its batch as a decode launch does,
and on the paged attention path (the CUDA default) replays a CUDA graph per padded item count.

Item order: the decode items, then the last position of each chunk that ends its prompt (its row
gives the first token), then the other chunk positions, then padding. The rows that need the head
(and, in a core step, an exit score) are then among the first `padded(max_batch_size)`: every
sequence holds a slot, so decode items plus final chunks never exceed max_batch_size; the head runs
on those rows only (BatchState.head_rows). A chunk of a request that asks for prompt log-probs needs
every position's logits: such a launch runs eagerly with the head on an explicit row list.

On the SDPA path (the CPU, attention_backend="sdpa") a launch with chunks runs eagerly: decode items
attend through the padded gather, each chunk through one causal SDPA over its own context rows
(`Segment`), so a long prompt stays linear in memory.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .batch_state import Riders
from .block_manager import kv_rows
from .scheduler import Work
from .sequence import Sequence, Stage
from .stages import Segment


@dataclass
class Layout:
    """Where a launch's chunk positions sit: `riders` (what the upload sends), each chunk's item rows in
    position order (`rows`, by seq_id), and the explicit head rows when a chunk wants prompt log-probs."""
    riders: Riders
    rows: dict[int, list[int]]
    head: list[int] | None


class TokenSlots:
    """The runner's token slots: a chunk takes one per position at its prelude (or fused) launch and
    gives them back after its coda (or that launch), or when its prompt is aborted."""

    def __init__(self, first: int, count: int):
        self.free = list(range(first + count - 1, first - 1, -1))  # (pop() takes the lowest first)
        self.held: dict[int, list[int]] = {}  # seq_id -> its chunk's token slots, in position order

    def take(self, s: Sequence) -> list[int]:
        n = s.chunk[1] - s.chunk[0]
        if n > len(self.free):
            raise RuntimeError(f"{s.request_id}: a chunk of {n} prompt tokens, {len(self.free)} token slots free: "
                               "more prompt tokens in flight than EngineConfig.max_launch_tokens() allows")
        self.held[s.seq_id] = [self.free.pop() for _ in range(n)]
        return self.held[s.seq_id]

    def give_back(self, seq_id: int) -> None:
        self.free += reversed(self.held.pop(seq_id, ()))


def layout(work: Work, slots: TokenSlots, n_decode: int, tokens: bool) -> Layout:
    """The items of `work`'s chunks after its `n_decode` decode items (module docstring): token slots
    taken at the chunk's first launch (prelude, fused), with the metadata the upload writes then."""
    fresh = work.stage in (Stage.PREFILL, Stage.PRELUDE, Stage.FUSED)
    finals = {s.seq_id for s in work.finals}
    mine = {s.seq_id: slots.take(s) if fresh else slots.held[s.seq_id] for s in work.chunks}
    order = [(s, len(mine[s.seq_id]) - 1) for s in work.finals]  # each final chunk's last position first
    order += [(s, i) for s in work.chunks for i in range(len(mine[s.seq_id]) - int(s.seq_id in finals))]
    r = Riders(slots=[mine[s.seq_id][i] for s, i in order], owners=list(work.chunks))
    rows: dict[int, list[int]] = {s.seq_id: [0] * len(mine[s.seq_id]) for s in work.chunks}
    for k, (s, i) in enumerate(order):
        rows[s.seq_id][i] = n_decode + k
    if tokens:
        r.ids = [s.prompt_ids[s.chunk[0] + i] for s, i in order]
    if fresh:  # the position before each one's own (the launch moves every item one position on), step 0
        r.fresh = [(mine[s.seq_id][i], s.chunk[0] + i - 1, s.slot) for s, i in order]
    head = None
    if work.stage.emits and any(s.params.prompt_logprobs is not None for s in work.chunks):
        # the sampled rows, then every position of each chunk that asks for prompt log-probs (prompt_logits)
        head = list(range(n_decode + len(work.finals)))
        head += [j for s in work.chunks if s.params.prompt_logprobs is not None for j in rows[s.seq_id]]
    return Layout(r, rows, head)


def segments(work: Work, lay: Layout, block_size: int, to_device) -> list[Segment]:
    """The SDPA path's attention groups: one per chunk, its item rows and its context rows."""
    out = []
    for s in work.chunks:
        a, e = s.chunk
        out.append(Segment(to_device(lay.rows[s.seq_id]), a, to_device(kv_rows(s.blocks, block_size, e))))
    return out


def prompt_logits(work: Work, logits: torch.Tensor, n: int, partial: dict[int, torch.Tensor]
                  ) -> dict[int, torch.Tensor] | None:
    """The prompt logits [L, V] of each prompt this launch completes that asked for them (by seq_id).
    The rows after the first `n` (sampled) rows of `logits` are the chunks' positions (`layout`'s head);
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

"""Preemption, stall and resume: what the scheduler does when a decode token's next KV row needs a
block and none is free. Pure Python (no torch), replayed by the simulator like the scheduler.

A sequence that moves to the prelude queue gets the block of its next token's row first (`grow`;
the BlockManager changes the table itself: `grow_seq`, `free_seq`, `allocate_seq`).
When none is free, the most recently admitted running sequence (of the worst priority, under
scheduling_policy "priority") is preempted: its blocks and slot
are freed and a `SwapOp` tells the engine to copy its KV rows and per-slot state to host memory
before the next stage runs (which may reuse them). Swapped sequences come back (`resume`), oldest
(best priority) first and before any new admission, into fresh blocks, and re-enter the queue they left (the core
queue too: the loop state travels with them). Exact for every layout: the numbers are copied, not
recomputed. Host swap space is counted in blocks; when it is full the sequence that needs a block
waits (`stalled`) while others run, unless nothing else could run (then it is swapped out all the
same: `swap_overcommits`, so that nothing deadlocks).
A prefilling sequence (a prompt chunk in a queue, or a prompt between chunks) is never preempted:
its chunk's loop state lives in token slots (mixed.py), which a swap does not copy.

Where a preempted sequence waits is its `status`: `Status.STALLED` (in `stalled`, holding its blocks
and slot, back to the prelude queue once a block is free) or `Status.SWAPPED` (in `swapped`, holding
neither; the entry keeps the stage it returns to and the blocks its host copy holds). Its `stage`
stays the queue it returns to; it is RUNNING again once back in that queue.
"""
from __future__ import annotations

from dataclasses import dataclass
from operator import attrgetter
from typing import Callable

from .block_manager import BlockManager
from .sequence import Sequence, Stage, Status

# the preemption order: the worst priority first (scheduling_policy "priority"; under fcfs every
# priority is 0), then the most recently admitted (seq_ids grow with arrival)
_rank = attrgetter("priority", "seq_id")


@dataclass
class SwapOp:
    """Copy a sequence's KV `blocks` and state `slot` to host ("out"), from host into new blocks
    and slot ("in"), or forget its host copy ("drop": aborted while swapped)."""
    kind: str
    seq: Sequence
    blocks: list[int]
    slot: int


class Preemption:
    def __init__(self, blocks: BlockManager, queues: dict[Stage, list[Sequence]], swap_blocks: int):
        """`queues`: the scheduler's decode queue of each stage (changed in place only, so these are
        the scheduler's own lists); `swap_blocks`: the host budget, in blocks. The scheduler's
        callbacks come with each call, not kept: kept, they would make scheduler and preemption a
        reference cycle, and a dropped engine's KV pool would wait for the cyclic GC."""
        self.blocks, self.queues, self.swap_blocks = blocks, queues, swap_blocks
        self.prelude_q = queues[Stage.PRELUDE]
        self.swapped: list[tuple[Sequence, Stage, int]] = []  # (seq, queue to return to, blocks), by seq_id
        self.stalled: list[Sequence] = []  # decode tokens waiting for a block (swap space full)
        self.ops: list[SwapOp] = []  # for the engine to run before the next stage
        self.counters = {"preemptions": 0, "swapped_out_blocks": 0, "swapped_in_blocks": 0, "stalls": 0,
                         "swap_overcommits": 0}

    @property
    def swapped_blocks(self) -> int:
        return sum(n for _, _, n in self.swapped)

    def take_ops(self) -> list[SwapOp]:
        ops, self.ops = self.ops, []
        return ops

    def holders(self) -> list[Sequence]:
        """The decode sequences that hold blocks and a slot (the preemption candidates; a prompt chunk
        in the queues is not one: module docstring)."""
        return [s for s in self.prelude_q + self.queues[Stage.CORE] + self.queues[Stage.CODA] if s.chunk is None] + \
            self.stalled

    def drop(self, seq: Sequence) -> None:
        """Forget a stalled or swapped sequence (aborted): it leaves its container, and a swapped
        one's host copy goes."""
        if seq.status is Status.STALLED:
            self.stalled.remove(seq)
            return
        for i, (s, _, _) in enumerate(self.swapped):
            if s is seq:
                del self.swapped[i]
                self.ops.append(SwapOp("drop", seq, [], -1))
                return

    def grow(self, s: Sequence, read_scores: Callable[[], None]) -> bool:
        """Give `s` (in the prelude queue) the block of its next token's row, preempting the most
        recently admitted running sequences (possibly `s` itself) until one is free (`read_scores`:
        reads the exit scores of the core step in flight, the lookahead pipeline, before a core item
        leaves: Scheduler._read_scores_now). True: `s`
        grew (Work.grown); False: it stalled or was swapped out."""
        while not self.blocks.grow_seq(s, s.num_tokens):  # the rows of positions 0..position
            victim = max(self.holders(), key=_rank)
            others_run = any(x is not victim and x.chunk is None for x in self.prelude_q + self.queues[Stage.CORE] +
                             self.queues[Stage.CODA] if x is not s)
            if self.swapped_blocks + len(victim.blocks) > self.swap_blocks:
                if others_run:  # swap space full: wait for a running sequence to finish
                    self.counters["stalls"] += 1
                    self.prelude_q.remove(s)
                    self.stalled.append(s)
                    s.status = Status.STALLED  # (its stage stays PRELUDE: the queue it returns to)
                    return False
                self.counters["swap_overcommits"] += 1  # nothing else could run: never deadlock
            self.swap_out(victim, read_scores)
            if victim is s:
                return False
        return True

    def swap_out(self, s: Sequence, read_scores: Callable[[], None]) -> None:
        stage = s.stage  # the queue it returns to (a stalled one's: PRELUDE)
        if s.status is Status.STALLED:
            self.stalled.remove(s)
        else:
            if stage is Stage.CORE:
                read_scores()  # read its in-flight exit score now, while it is a core item
            self.queues[stage].remove(s)
        n = len(s.blocks)
        self.ops.append(SwapOp("out", s, s.blocks, s.slot))  # (keeps the old table: free_seq gives s a new one)
        self.blocks.free_seq(s)
        self.swapped.append((s, stage, n))
        self.swapped.sort(key=lambda x: _rank(x[0]))  # (resumed from the front: the best priority, oldest first)
        self.counters["preemptions"] += 1
        self.counters["swapped_out_blocks"] += n
        s.status = Status.SWAPPED

    def resume(self, keep_free: Callable[[int], int]) -> list[Sequence]:
        """Before scheduling: stalled sequences take freed blocks, then swapped ones come back,
        oldest first (FIFO; new admissions wait until none is swapped). Returns the sequences that
        got blocks and a slot back (Work.changed). `keep_free`: the blocks admission leaves free
        (Scheduler._keep_free)."""
        back: list[Sequence] = []
        for s in list(self.stalled):
            if not self.blocks.grow_seq(s, s.position + 1):
                break
            self.stalled.remove(s)
            self.prelude_q.append(s)
            s.status = Status.RUNNING  # (its stage: PRELUDE)
            back.append(s)
        while self.swapped and not self.stalled:
            s, stage, n = self.swapped[0]
            if not self.blocks.can_allocate(s.position + 1, keep_free(0)):
                break
            self.blocks.allocate_seq(s, s.position + 1)
            self.swapped.pop(0)
            self.ops.append(SwapOp("in", s, s.blocks, s.slot))
            back.append(s)
            self.counters["swapped_in_blocks"] += n
            self.queues[stage].append(s)
            s.status, s.stage = Status.RUNNING, stage
        return back

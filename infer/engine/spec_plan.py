"""The launch plan of a speculative stage (speculative.py): which launches it runs, in which order,
over which window positions. Pure Python: the model runner (speculative.speculate) and the
simulator's runner (infer/sim) both iterate it, so the schedule is written once.

A stage verifies a window of `ks[b]` positions after each sequence's last token. Positions are
numbered flat, sequence-major (`owner[i]`: the sequence, `index[i]`: the window position, `pos[i]`:
the token position). The plan yields `Launch`es:

1. draft, one round per window position j: a prelude over position j of every window that has one,
   core steps 1..draft_depth over those still in the loop, then a coda over the positions whose
   next position needs a drafted input (its argmax is the draft);
2. verify: core steps from draft_depth+1 over every position still in the loop (all at the same
   step: a position leaves the loop only at its exit), then one coda over every position.

Exits are the caller's: after a core launch it reports the positions that exited there
(`exited`), which is why the plan is an iterator and not a list (the model's exits are known only
once a step's scores are read; the simulator knows its recorded depths up front).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

from .sequence import Stage
from .trace import TraceRow, trace_row


@dataclass(slots=True)
class Launch:
    stage: Stage  # PRELUDE, CORE or CODA
    phase: str  # "draft" or "verify"
    items: list[int]  # the window positions it runs (flat indices, ascending)
    step: int = 0  # CORE: the loop step every item runs


class SpecPlan:
    def __init__(self, ks: list[int], draft_depth: int, last: list[int]):
        """`ks[b]`: the positions sequence b verifies (1: a plain decode of its token); `last[b]`:
        the position of its last token (the window's first position)."""
        self.ks, self.draft_depth = list(ks), draft_depth
        self.owner = [b for b, k in enumerate(ks) for _ in range(k)]
        self.index = [j for k in ks for j in range(k)]
        self.pos = [last[b] + j for b, j in zip(self.owner, self.index)]
        self.first = []  # flat index of each sequence's window position 0
        n = 0
        for k in ks:
            self.first.append(n)
            n += k
        self.steps = [0] * n  # the last loop step each position ran (its exit depth once it exited)
        self.done = [False] * n

    def __len__(self) -> int:
        return len(self.pos)

    def exited(self, items: list[int]) -> None:
        """The positions that left the loop at the core launch just run (at their `steps`)."""
        for i in items:
            self.done[i] = True

    def __iter__(self) -> Iterator[Launch]:
        ks, first, done = self.ks, self.first, self.done
        for j in range(max(ks)):  # draft round j: window position j of every sequence whose window has one
            idx = [first[b] + j for b, k in enumerate(ks) if j < k]
            yield Launch(Stage.PRELUDE, "draft", idx)
            for s in range(1, self.draft_depth + 1):
                live = [i for i in idx if not done[i]]
                if not live:
                    break
                yield self._core(live, s, "draft")
            guess = [i for i in idx if j < ks[self.owner[i]] - 1]  # positions whose next one needs an input
            if guess:
                yield Launch(Stage.CODA, "draft", guess)
        while True:  # verify: the live positions, depth-major, each to its own exit
            live = [i for i in range(len(done)) if not done[i]]
            if not live:
                break
            yield self._core(live, self.steps[live[0]] + 1, "verify")  # every live position is at one step
        yield Launch(Stage.CODA, "verify", list(range(len(done))))

    def _core(self, live: list[int], step: int, phase: str) -> Launch:
        for i in live:
            self.steps[i] = step
        return Launch(Stage.CORE, phase, live, step)

    def context(self, items: list[int]) -> int:
        """The context tokens a launch over `items` reads (each position attends to 0..pos)."""
        pos = self.pos
        return sum(pos[i] + 1 for i in items)

    def depths(self) -> list[list[int]]:
        """Each sequence's exit depth at each window position (once the plan has run)."""
        return [self.steps[f:f + k] for f, k in zip(self.first, self.ks)]



def spec_row(launch: Launch, context: int, r_max: int, seconds: float, score_reads: int) -> TraceRow:
    """The trace row of one launch of a speculative stage, with its `phase` (infer/sim/work.py
    counts it as any other): its items are decode items, unpadded (the eager path's batches of
    their own)."""
    n = len(launch.items)
    return trace_row(launch.stage.value, n, padded=n, tokens=n, context=context, r_max=r_max, seconds=seconds,
                     score_reads=score_reads, phase=launch.phase)

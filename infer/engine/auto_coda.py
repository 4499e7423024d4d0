"""`min_coda_batch="auto"`: when to launch the waiting exits' coda (and how to split a core step),
decided from what launches cost.

A coda (and the prelude that puts its tokens back into the loop) costs about the same for 4 exits
as for 40 on a GPU: it reads the coda's and the head's weights once. Launching it for every exit
pays that fixed cost often; holding exits back keeps their sequences out of the loop, so the core
steps in between carry fewer tokens. This is the economic order quantity trade-off: an order's
fixed cost against the cost of holding stock. The rule here is its online form. Every launch made
while exits wait charges them its time (without the prompt chunks riding in it, which cost the same
either way), in proportion to their share of the running sequences (`held`: what waiting has cost
so far). The coda runs once that cost, plus what one more core step would add, reaches the cost of
launching: the fixed cost of a coda and its prelude (the part that does not grow with the batch,
which is what running two codas as one saves), plus what re-entering the exits would add to the next
core step beyond their share (`padding`: pushing it past a padded size, where every row costs). That
is the balance at the economic order quantity (holding cost per cycle = order cost), with no
constant tuned. Ouro-1.4B's coda is its head alone (cheap next to 24 core layers), so it runs at
once (K = 1 in effect). Huginn-3.5B's is two layers plus the head (more than its 4-layer core step),
so exits gather, as the paper's K ~ W/4 does by hand.

The same rule decides refill (refill=True): the prelude that puts the exits back into the loop follows their
coda (its fixed cost is in the launch side), so holding the coda is holding the refill, and a hold
that never reaches the launch cost lets the loop drain as a no-refill cohort does, then runs one
coda and one prelude for all of it. New prompts still enter the loop as they are admitted.

The same table decides how many core items one launch takes (`core_plan`). Launches run at padded
sizes (powers of two, for CUDA graphs); where every padded row costs (long contexts, whose SDPA
gather reads each row's longest context), a loop of 80 items is cheaper as launches of 64 and 16
rows than as one of 128. The items not stepped go first in the next core launch. Where the weights
are the cost, one launch wins and nothing splits.

Costs come from `StageCosts`: the seconds each launch took (a virtual runner's `last_seconds`, the
simulator's or the emulated device's cost model; the wall clock on a CPU, where launches are
synchronous), per stage and padded batch, as a moving average. Until a stage has been seen, the
coda runs at once (K = 1). On CUDA launches are asynchronous: `LaunchTimer` puts CUDA events
around each and reads those that are done at later steps (`query`, never a wait), and the held
cost uses the table's prediction until then. The engine queues each launch (`unlearned`) and they are
learned together, in order, when a decision reads the table (`catch_up`). Pure bookkeeping: no
launch, no tensor. Scheduling never changes tokens or exit depths, so exactness is untouched.
"""
from __future__ import annotations

from bisect import bisect_left, insort
from collections import Counter
from typing import Callable

from .sequence import Stage

EMA = 0.2  # weight of a new observation in a stage's moving average
# core_batch's splits follow the core row every REPLAN core launches (the moving average's time
# constant is 1 / EMA = 5 launches) and when a padded size is first seen, once that launch is learned
# (at most REPLAN launches queued later: core_batch): planned at every launch, they cost 3 of a 25 us
# core step's host time (python -m infer.bench.host --vs-auto, batch 16)
REPLAN = 8
# the launches queued unlearned (AutoCoda.unlearned) are learned at the latest when this many have gathered
CATCH_UP = 64
CORE, CODA = Stage.CORE, Stage.CODA  # (module constants: _observe runs for every launch)


class StageCosts:
    """Seconds per launch, per (stage, padded batch): a moving average of what launches took.
    `predict` interpolates linearly between the padded sizes seen (flat outside them). Launches
    that carried prompt chunks cost what the chunks add too (a chunk rides through every core
    step): they count only until the stage has run without any, then its row starts again."""

    def __init__(self):
        self.table: dict[Stage, dict[int, float]] = {}
        self.clean: set[Stage] = set()  # stages whose row holds launches without prompt chunks only
        self.sizes: dict[Stage, list[int]] = {}  # each row's padded sizes, sorted (at() reads them at every decision)
        self._fixed: dict[Stage, float] = {}  # (fixed(), until one of the sizes it was drawn through changes)
        self._through: dict[Stage, tuple[int, ...]] = {}  # (those sizes: the row's two smallest)

    def observe(self, stage: Stage, padded: int, seconds: float, chunks: bool = False) -> bool:
        """Learn a launch's seconds; True where the row gained a padded size (or started again)."""
        if chunks:
            if stage in self.clean:
                return False
        elif stage not in self.clean:
            self.clean.add(stage)
            self.table.pop(stage, None)
            self.sizes.pop(stage, None)
        row = self.table.get(stage)
        if row is None:
            row = self.table[stage] = {}
        old = row.get(padded)
        row[padded] = seconds if old is None else old + EMA * (seconds - old)
        if old is None:
            insort(self.sizes.setdefault(stage, []), padded)
        if old is None or padded in self._through.get(stage, ()):
            self._fixed.pop(stage, None)
        return old is None

    def predict(self, stage: Stage, padded: int) -> float | None:
        row = self.table.get(stage)
        return at(row, padded, self.sizes[stage]) if row else None

    def fixed(self, stage: Stage) -> float | None:
        """The part of a launch's cost that does not grow with its batch: the line through the two
        smallest padded sizes seen, at batch 0 (the cost at the smallest if only one was seen)."""
        f = self._fixed.get(stage)
        if f is not None:
            return f
        row = self.table.get(stage)
        if not row:
            return None
        xs = self._through[stage] = tuple(self.sizes[stage][:2])
        if len(xs) == 1:
            f = row[xs[0]]
        else:
            (x0, x1), (y0, y1) = xs, (row[xs[0]], row[xs[1]])
            f = min(y0, max(0.0, y0 - (y1 - y0) / (x1 - x0) * x0))
        self._fixed[stage] = f
        return f


def at(row: dict[int, float], padded: int, xs: list[int] | None = None) -> float:
    """A stage's row at a padded size: linear between the sizes seen, flat outside them. `xs`: the
    row's sizes sorted (StageCosts.sizes; sorted here if not given)."""
    t = row.get(padded)
    if t is not None:
        return t
    if xs is None:
        xs = sorted(row)
    i = bisect_left(xs, padded)  # (padded is not in xs: xs[i - 1] < padded < xs[i])
    if i == 0:
        return row[xs[0]]
    if i == len(xs):
        return row[xs[-1]]
    lo, hi = xs[i - 1], xs[i]
    return row[lo] + (row[hi] - row[lo]) * (padded - lo) / (hi - lo)


class AutoCoda:
    """The decision (module docstring) and what it decided: a histogram of the batch each coda
    ran with (the K chosen), and the last decision's predicted costs."""

    def __init__(self, padded: Callable[[int], int]):
        self._padded = padded
        self._pads: dict[int, int] = {}  # (the runner's padding, computed once per batch size)
        self._plans: dict[int, tuple[float, int]] = {}  # (core_plan's, until the core row changes)
        self._firsts: dict[int, int] = {}  # (core_batch's, until they follow the core row: REPLAN)
        self._core_seen = 0  # (core launches learned since the splits were planned)
        self._least = 0.0  # (the core row's cheapest launch, kept with the plans)
        self.costs = StageCosts()
        self.held = 0.0  # seconds of running capacity the waiting exits have cost since the last coda
        self.k_hist: Counter[int] = Counter()  # coda batch -> codas launched with it
        self.splits = 0  # core steps split into launches at smaller padded sizes (core_plan)
        self.last: tuple | None = None  # the last decision: (exits waiting, hold, launch cost, its padding part, now?)
        # launches not learned yet, oldest first, as observe's arguments: LLMEngine._timed appends one per
        # launch (at most CATCH_UP), and catch_up learns them when a decision reads what they change (held,
        # the table). Learned one by one at their launches they cost ~2 us of a 26 us host step at batch 16,
        # together about a third of that (python -m infer.bench.host --vs-auto: the step's cache stays warm)
        self.unlearned: list[tuple[Stage, int, float | None, int, int, bool]] = []

    def padded(self, n: int) -> int:
        p = self._pads.get(n)
        if p is None:
            p = self._pads[n] = self._padded(n)
        return p

    def core_plan(self, n: int) -> tuple[float | None, int]:
        """Stepping `n` core items once: its predicted seconds, and the items its first launch takes.
        One launch at the padded batch, or one at the padded size below it with the rest planned
        alike, whichever the table predicts cheaper. Where a launch's cost is its weights, one launch
        wins; where every padded row costs (long contexts: SDPA gathers each padded row to the
        batch's longest context), 80 items run as 64 + 16 rows, not 128. Sizes not seen yet are
        predicted flat beyond the table's ends, so a split needs a measured smaller size."""
        plan = self._plans.get(n)
        if plan is None:
            row = self.costs.table.get(Stage.CORE)
            if not row:
                return None, n
            if not self._plans:
                self._least = min(row.values())
            plan = self._plans[n] = self._plan(row, n, self._least, self.costs.sizes[CORE])
        return plan

    def _plan(self, row: dict[int, float], n: int, least: float, xs: list[int]) -> tuple[float, int]:
        """core_plan's recursion, unrolled (it runs at every coda decision): plan(n) is one launch, or
        one at the padded size below plus plan(rest). Going down, each level whose piece plus the
        cheapest launch still costs less than its whole is kept; coming back up, each takes the cheaper."""
        pads, kept = self._pads, []
        while True:
            p = pads.get(n) or self.padded(n)
            whole = row.get(p)
            if whole is None:
                whole = at(row, p, xs)
            a = pads.get(p // 2) or self.padded(p // 2)
            if not 0 < a < n:
                break
            part = row.get(a)
            if part is None:
                part = at(row, a, xs)
            if part + least >= whole:  # (no plan for the rest costs less than the cheapest launch)
                break
            kept.append((whole, part, a, n))
            n -= a
        cost, first = whole, n
        for whole, part, a, m in reversed(kept):
            split = part + cost
            cost, first = (split, a) if split < whole else (whole, m)
        return cost, first

    def core_batch(self, n: int) -> int:
        """How many of the `n` core items the next core launch takes (core_plan). Planned again with
        the launches learned (catch_up) for an item count not planned yet, or once REPLAN launches
        wait to be learned: a plan is at most that many launches older than the table's news."""
        a = self._firsts.get(n)
        if a is None or len(self.unlearned) >= REPLAN:
            self.catch_up()
            a = self._firsts.get(n)  # (learning may have cleared it)
            if a is None:
                a = self._firsts[n] = self.core_plan(n)[1]
        if a < n:
            self.splits += 1
        return a

    def coda_now(self, exits: int, in_loop: int, idle: int, slots: int) -> bool:
        """Launch the coda of the `exits` waiting now, rather than one more core launch over (the
        first of) `in_loop` items first? `idle` of the `slots` running sequences wait on it
        (Scheduler.idle)."""
        self.catch_up()
        step, first = self.core_plan(in_loop)  # (stepping the loop once; its next launch's items)
        core = step if first == in_loop else self.costs.predict(Stage.CORE, self.padded(first))
        # what merging two codas (and their preludes) saves: the part of their cost that does not
        # grow with the batch (weights, launch); the per-item part is paid either way
        coda, pre = self.costs.fixed(Stage.CODA), self.costs.fixed(Stage.PRELUDE)
        if core is None or coda is None or pre is None:
            return True  # nothing measured yet: K = 1
        hold = self.held + idle * core / max(1, slots)  # ... if they wait one more core launch
        pad = self.padding(in_loop, exits, step)
        launch = coda + pre + pad
        now = hold >= launch
        self.last = (exits, hold, launch, pad, now)
        return now

    def padding(self, in_loop: int, exits: int, step: float) -> float:
        """What the exits' re-entry adds to the next core step beyond their own share: the step's
        cost with them (core_plan) above the cost per item it has now (`step`: core_plan's for
        `in_loop`), times its new item count.
        Zero while they fit in the padded rows the step pays for anyway (or where its cost is mostly
        the weights, which more items share); large where they push it past a padded size and
        every row costs (long contexts, whose attention dominates: SDPA gathers per padded row)."""
        if not in_loop:
            return 0.0
        return max(0.0, self.core_plan(in_loop + exits)[0] - step * (in_loop + exits) / in_loop)

    def observe(self, stage: Stage, batch: int, seconds: float | None, idle: int, slots: int,
                chunks: bool = False) -> None:
        """A launch of `batch` decode items (and prompt chunks, if `chunks`) took `seconds` (None:
        not known); `idle` of `slots` waited through it (coda_now). Learned now, after the launches
        queued unlearned (the engine queues its launches there instead: catch_up)."""
        self.catch_up()
        self._observe(stage, batch, seconds, idle, slots, chunks)

    def queue(self, stage: Stage, batch: int, seconds: float | None, idle: int, slots: int, chunks: bool) -> None:
        """`observe`, deferred: the launch joins `unlearned`, learned when a decision reads the table
        (catch_up) or once CATCH_UP launches have gathered. The engine calls this at every launch."""
        self.unlearned.append((stage, batch, seconds, idle, slots, chunks))
        if len(self.unlearned) >= CATCH_UP:
            self.catch_up()

    def catch_up(self) -> None:
        """Learn the launches queued unlearned, in launch order."""
        p = self.unlearned
        if p:
            for launch in p:
                self._observe(*launch)
            p.clear()

    def _observe(self, stage: Stage, batch: int, seconds: float | None, idle: int, slots: int,
                 chunks: bool) -> None:
        if stage is CODA:
            self.k_hist[batch] += 1
            self.held = 0.0
        elif idle:
            t = seconds
            if chunks or t is None:  # (None: CUDA, known later)
                # with prompt chunks riding, the waiting exits are charged the launch's decode part (the
                # table's chunk-free prediction): the chunks cost the same whether or not they wait, and
                # the step they miss is made up later in a launch priced as that one
                p = self.costs.predict(stage, self.padded(batch))
                t = t if p is None else p
            self.held += idle * (t or 0.0) / max(1, slots)
        if seconds is not None:
            self.learn(stage, batch, seconds, chunks)

    def learn(self, stage: Stage, batch: int, seconds: float, chunks: bool = False) -> None:
        """What a launch took, once known (on CUDA, when its events are done: LaunchTimer)."""
        if batch:
            new = self.costs.observe(stage, self._pads.get(batch) or self.padded(batch), seconds, chunks)
            if stage is CORE:
                self._plans.clear()
                self._core_seen += 1
                if new or self._core_seen >= REPLAN:
                    self._firsts.clear()
                    self._core_seen = 0

    def describe(self) -> dict:
        """The K chosen over time (coda batch histogram) and why (the last decision's costs)."""
        self.catch_up()
        n = sum(self.k_hist.values())
        return {"codas": n, "mean_k": sum(k * c for k, c in self.k_hist.items()) / n if n else None,
                "k_hist": dict(sorted(self.k_hist.items())), "split_core_steps": self.splits,
                "last_decision": None if self.last is None else dict(zip(("waiting", "hold_s", "launch_s", "padding_s",
                                                                          "coda_now"), self.last))}


class LaunchTimer:
    """CUDA: each launch between two events on the device's current stream; `done()` returns
    (stage, batch, chunks, seconds) of the launches whose end event has completed, oldest first,
    without waiting for any (Event.query)."""

    def __init__(self, device):
        import torch
        self._cuda, self.device = torch.cuda, device
        # the launches timed whose end event has not been read yet, oldest first
        self.in_flight: list[tuple[Stage, int, bool, object, object]] = []

    def _record(self):
        ev = self._cuda.Event(enable_timing=True)
        ev.record(self._cuda.current_stream(self.device))
        return ev

    def start(self):
        return self._record()

    def stop(self, start, stage: Stage, batch: int, chunks: bool) -> None:
        self.in_flight.append((stage, batch, chunks, start, self._record()))

    def done(self) -> list[tuple[Stage, int, bool, float]]:
        out = []
        while self.in_flight and self.in_flight[0][4].query():
            stage, batch, chunks, start, end = self.in_flight.pop(0)
            out.append((stage, batch, chunks, start.elapsed_time(end) * 1e-3))
        return out

"""The CDB scheduler: four queues, three policies, and every queue transition. Pure Python (no
torch), so the simulator (infer/sim/) replays it on a cost model.

Queues (the paper's four): `waiting` (prefill), `prelude_q` (items waiting for the prelude),
`core_q` (items at mixed depths waiting for their next core step), `coda_q` (exited items waiting
for the coda). An item is a sequence with the positions it runs at one loop step (`Work`): a
decode token, or under mixed prefill a prompt chunk. `schedule()` picks the next stage and its batch:
- `cb`: token-level continuous batching (the baseline): prefill new requests between
  iterations, else one fused iteration (prelude + r_max core steps + coda) over the running
  sequences that share the oldest one's r_max (requests may ask for a lower r_max).
- `cdb`, refill=False: a cohort runs prelude, core steps until all its tokens exited (exited
  tokens leave the batch), then one coda; new requests are prefilled between cohorts.
- `cdb`, refill=True (the default): right after a prefill or a coda, the prelude; else the coda once
  at least `min_coda_batch` exits wait (or no core work is left); else a prefill; else a core step
  (under min_coda_batch="auto", the first of its items when two launches at smaller padded sizes
  cost less than one: auto_coda.py). Under min_coda_batch="auto" (the default) the cost rule also
  chooses between refilling and letting the loop drain: the prelude that re-enters exits follows
  their coda, and a coda held until no core work is left is the cohort's schedule (auto_coda.py).
One ladder (`_policy`) serves both prefill modes; they differ in one step, `_prefill`:
- `prefill="separate"`: whole prompts run in prefill launches of their own, of at most
  `max_num_batched_tokens` prompt tokens (a longer prompt is admitted alone).
- `prefill="mixed"` (the default): prompt chunks (chunks.py: the admission rule and the token
  budget) are admitted into the prelude queue right before a prelude launch (CB: the fused
  iteration), where the separate prefill would have run. A chunk is then an item of the same
  queues as the decode tokens, with two rules of its own: it runs r_max core steps (it never exits
  early, and a split core step takes every chunk), and a chunk waiting for its coda counts as K
  exits (its coda gives the prompt's first token).

Memory: admission (FIFO) gives a request its prompt's blocks (with prefix caching, the cached
blocks of its prompt's head shared read-only: chunks.py), leaving a watermark free; a token that
moves to the prelude queue gets the block of its next row first, and when none is free someone
is preempted (preemption.py: swap out, stall, resume). These files decide when; the BlockManager
changes the block tables and slots (`allocate_seq`, `grow_seq`, `shrink_seq`, `free_seq`). Each
sequence's `status` (and, running, its `stage`) names the one container that holds it (`finish`
takes it out of exactly that one): WAITING the waiting queue, STALLED and SWAPPED preemption's,
RUNNING the queue of its stage (between two chunks of its prompt: the chunker's `partial`).

`postprocess(work, ...)` applies a stage's outcome: who moves to which queue, who finished. With
the lookahead pipeline a core step's exit scores are read one core step late (while the next
runs on the device); lookahead makes that exact, because the signal of step t already decides
who exits after step t+1.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from operator import attrgetter
from typing import TYPE_CHECKING, Protocol

from looplm.policy import ExitTracker

from .auto_coda import AutoCoda
from .block_manager import BlockManager
from .chunks import Chunker
from .preemption import Preemption, SwapOp
from .sequence import Sequence, Stage, Status

if TYPE_CHECKING:
    from .config import EngineConfig

PREFILL, PRELUDE, CORE, CODA, FUSED, SPEC = (Stage.PREFILL, Stage.PRELUDE, Stage.CORE, Stage.CODA, Stage.FUSED,
                                             Stage.SPEC)
WAITING, RUNNING, STALLED, SWAPPED, FINISHED = (Status.WAITING, Status.RUNNING, Status.STALLED, Status.SWAPPED,
                                                 Status.FINISHED)
_seq_id = attrgetter("seq_id")


class Scores(Protocol):
    """The exit scores of a launched core step (one float per item); `get()` may wait for them."""

    def get(self) -> list[float]: ...


@dataclass
class Work:
    """One launch: its stage and its scheduled items. An item is a sequence with the positions it
    runs, at one loop step (`seq.step`): a decode token (its last position; `seq.chunk` is None) or
    a prompt chunk (positions `seq.chunk` = [a, e): chunks.py); a separate prefill launch's items are
    whole prompts, chunks that end their prompts. An item emits a token when the launch ends
    with logits and it covers its sequence's last position: every decode item, and a chunk that
    ends its prompt. The runner lays decode items and chunk positions out differently (mixed.py),
    so the launch keeps the two views of `items`, in item order: `seqs` and `chunks`."""
    stage: Stage
    items: list[Sequence]
    r_max: int = 0  # FUSED: the loop steps of this iteration
    # sequences whose slot or block table changed since the previous Work (admitted, swapped in,
    # resumed): the runner rewrites their per-slot metadata; every other slot is known to it already
    changed: list[Sequence] = field(default_factory=list)
    # decode sequences whose block table grew at its end since the previous Work (one block on
    # crossing into it): the runner sends only the new entries
    grown: list[Sequence] = field(default_factory=list)
    # prompts aborted while prefilling since the previous Work: the runner drops their chunk state
    released: list[Sequence] = field(default_factory=list)
    # SPEC: the positions each sequence verifies (its window; 1: a plain decode of its token) and the draft's depth cap
    spec: list[int] = field(default_factory=list)
    spec_blocks: list[int] = field(default_factory=list)  # SPEC: each table's length before the window grew it
    draft_depth: int = 0
    # the views of `items` (set from it: `_split`)
    seqs: list[Sequence] = field(init=False, repr=False)  # the decode items
    chunks: list[Sequence] = field(init=False, repr=False)  # the prompt chunks
    finals: list[Sequence] = field(init=False, repr=False)  # the chunks whose prompt's first token this launch samples

    def __post_init__(self) -> None:
        self._split()

    def _split(self) -> None:
        items = self.items
        ch = [s for s in items if s.chunk is not None]
        self.chunks = ch
        self.seqs = [s for s in items if s.chunk is None] if ch else items
        self.finals = [s for s in ch if s.chunk[1] == len(s.prompt_ids)] if ch and self.stage.emits else []

    @property
    def emitting(self) -> list[Sequence]:
        """The items that get a token from this launch, in the order of its logits' rows: the decode
        items, then the final chunks."""
        return self.seqs + self.finals if self.finals else self.seqs

    def keep_decode(self, keep: list[int]) -> None:
        """Keep only the decode items at `keep` (indices into `seqs`; the chunks all stay)."""
        seqs = self.seqs
        self.items = [seqs[i] for i in keep] + self.chunks
        self._split()


class Scheduler:
    def __init__(self, cfg: EngineConfig, blocks: BlockManager, max_model_len: int, pipeline: bool = False,
                 swap_blocks: int | None = None, r_full: int = 0):
        self.cfg, self.blocks, self.max_model_len, self.pipeline = cfg, blocks, max_model_len, pipeline
        self.watermark = 0 if cfg.reserve_kv else int(cfg.watermark * blocks.num_blocks)
        self.changed: list[Sequence] = []  # slot or block table changed since the last Work (Work.changed)
        self.grown: list[Sequence] = []  # block table grew since the last Work (Work.grown)
        self.released: list[Sequence] = []  # aborted while prefilling since the last Work (Work.released)
        self.waiting: deque[Sequence] = deque()
        self.prelude_q: list[Sequence] = []
        self.core_q: list[Sequence] = []
        self.coda_q: list[Sequence] = []
        # the decode queue of each stage (built once: the queues are only ever changed in place)
        self.queues = {PRELUDE: self.prelude_q, CORE: self.core_q, CODA: self.coda_q}
        # prompt admission for both prefill modes (separate: whole prompts, launched on their own);
        # r_full: the model's r_max, the prompt's depth
        self.mixed = cfg.prefill == "mixed"
        self.chunker = Chunker(cfg.max_num_batched_tokens, bool(cfg.chunked_prefill), r_full, blocks, max_model_len,
                               cfg.reserve_kv, bool(cfg.enable_prefix_caching))
        self.preemption = Preemption(blocks, self.queues, blocks.num_blocks if swap_blocks is None else swap_blocks)
        # preempted sequences (preemption.py's containers, changed in place only)
        self.swapped, self.stalled = self.preemption.swapped, self.preemption.stalled
        self.last_stage: Stage | None = None
        # min_coda_batch="auto" (auto_coda.py): set by the engine, which knows the runner's padding
        self.auto: AutoCoda | None = None
        # pipeline: the last core step's items and exit scores, not read yet (read one core step late)
        self._unread_scores: tuple[list[Sequence], Scores] | None = None

    # ---------------------------------------------------------------- state
    @property
    def num_running(self) -> int:
        """Sequences holding KV blocks and a state slot: decoding, stalled, or prefilling in chunks."""
        return (len(self.prelude_q) + len(self.core_q) + len(self.coda_q) + len(self.stalled) +
                len(self.chunker.partial))

    def has_work(self) -> bool:
        return bool(self.waiting) or bool(self.swapped) or self.num_running > 0

    @property
    def counters(self) -> dict[str, int]:
        """Preemption counters (preemption.py), and prefix-cache lookups under mixed prefill (chunks.py)."""
        c = self.preemption.counters
        return {**c, **self.chunker.counters} if self.mixed else dict(c)

    def take_swaps(self) -> list[SwapOp]:
        return self.preemption.take_ops()

    def queue_lengths(self) -> dict[str, int]:
        return {"waiting": len(self.waiting), "prelude": len(self.prelude_q), "core": len(self.core_q),
                "coda": len(self.coda_q)}

    def add(self, seq: Sequence) -> None:
        """Queue a new request: last (fcfs), or behind every waiting request of its priority or a
        better one (scheduling_policy "priority"), so the head is always the next to admit."""
        seq.status, seq.stage = WAITING, PREFILL
        q = self.waiting
        if self.cfg.scheduling_policy == "priority" and q and q[-1].priority > seq.priority:
            i = len(q) - 1
            while i > 0 and q[i - 1].priority > seq.priority:
                i -= 1
            q.insert(i, seq)
        else:
            q.append(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Take a sequence (stopped or aborted) out of the one container its status (running: its
        stage) names, and release its memory."""
        st = seq.status
        if st is RUNNING:
            if seq.chunk is not None or seq.stage is PREFILL:  # prefilling: the runner holds chunk state
                self.chunker.drop(seq)
                self.released.append(seq)
            if seq.stage is not PREFILL:  # (between chunks: in the chunker's `partial` only)
                self.queues[seq.stage].remove(seq)
        elif st is WAITING:
            self.waiting.remove(seq)
        elif st is STALLED or st is SWAPPED:
            self.preemption.drop(seq)
        self._release(seq, reason)

    def _release(self, seq: Sequence, reason: str) -> None:
        """Free a finished sequence's blocks and slot (it is in no container any more)."""
        if seq.blocks or seq.slot >= 0:
            self.blocks.free_seq(seq)
        seq.status, seq.finish_reason = FINISHED, reason

    # ---------------------------------------------------------------- policy
    def schedule(self) -> Work | None:
        back = self.preemption.resume(self._keep_free)
        if back:
            self.changed += back
        work = self._speculate() if self.cfg.speculative_tokens else None
        if work is None:
            work = self._policy()
        if work is not None:
            self.last_stage = work.stage
            if self.changed:
                work.changed, self.changed = self.changed, []
            if self.grown:
                work.grown, self.grown = self.grown, []
            if self.released:
                work.released, self.released = self.released, []
        return work

    def _policy(self) -> Work | None:
        """The policy ladder (module docstring), for both prefill modes: `_prefill` is the prefill
        step, `_prelude` a prelude launch (under mixed prefill it takes the chunks admissible)."""
        c = self.cfg
        if c.policy == "cb":
            return self._prefill() or self._fused()
        if not c.refill:
            return self._take(CORE) or self._take(CODA) or self._prefill() or self._prelude()
        if self.last_stage in (PREFILL, CODA) and self.prelude_q:
            return self._prelude()
        if self.coda_q and (not self.core_q or self._chunk_in(self.coda_q) or self._coda_now()):
            return self._take(CODA)  # (a finished chunk counts as K exits: its first token waits)
        return self._prefill() or self._core() or self._prelude()

    def _core(self) -> Work | None:
        """Refill's core step: every item in the loop, or under "auto" the first of them when two
        launches at smaller padded sizes cost less than one (AutoCoda.core_plan). The items stepped
        go to the back of the queue, so the next core launch takes those that were not."""
        q = self.core_q
        n = self._decode_items(q)
        a = self.auto.core_batch(n) if self.auto is not None and n > 1 else n
        if a == n:
            return self._take(CORE)
        decode = [s for s in q if s.chunk is None] if n < len(q) else q
        items = decode[:a] + [s for s in q if s.chunk is not None]  # (the chunks in flight: every core step)
        q[:] = decode[a:] + items
        return Work(CORE, items)

    def _chunk_in(self, q: list[Sequence]) -> bool:
        return self.chunker.flying > 0 and any(s.chunk is not None for s in q)

    def _decode_items(self, q: list[Sequence]) -> int:
        """The decode items in a queue (its other items: prompt chunks in flight)."""
        if not self.chunker.flying:
            return len(q)
        return sum(1 for s in q if s.chunk is None)

    def _coda_now(self) -> bool:
        """Refill: the waiting exits' coda now, rather than another core step first: K of them wait,
        or under "auto" the cost rule says so (auto_coda.py)."""
        if self.auto is None:  # (a fixed K; "auto" without the engine's costs: at once, as auto's cold start)
            k = self.cfg.min_coda_batch
            return k == "auto" or len(self.coda_q) >= k
        return self.auto.coda_now(len(self.coda_q), self._decode_items(self.core_q), *self.idle())

    def idle(self) -> tuple[int, int]:
        """(min_coda_batch="auto") The exits waiting for a coda, and the running sequences. (Waiting
        requests are not counted: most wait for KV memory, which an earlier coda does not free.)
        With no exit waiting the running count is not needed (0). (LLMEngine._timed reads them at
        every launch.) A prompt chunk waiting for its coda is not an exit."""
        n = self._decode_items(self.coda_q)
        return n, self.num_running if n else 0

    def _speculate(self) -> Work | None:
        """Self-speculation (speculative.py) when few sequences run: at most
        `speculative_max_batch` hold memory, no prompt waits for a free slot (a new request's first
        token comes first; with every slot taken it waits either way), no prompt chunk is in flight
        and nothing is swapped out or stalled. Below that batch
        the launches are latency-bound, so verifying k positions costs about what one does; a full
        batch is already compute-bound and a rejected draft would be wasted work. Then the batch is
        gathered at a token boundary (core steps, then the coda, as a no-refill cohort: a sequence
        left mid-loop while others speculate stage after stage would starve) and the whole batch
        runs one speculative stage. Greedy requests that did not opt out verify min(k, tokens left)
        positions, within their blocks plus what the pool has free beyond the watermark
        (speculation never preempts); the rest decode their one token in the same stage."""
        c, q = self.cfg, self.prelude_q
        running = self.num_running
        if not q and not self.core_q and not self.coda_q or running > c.speculative_max_batch or \
                self.waiting and running < c.max_batch_size or self.swapped or self.stalled or \
                self.chunker.held:
            return None
        if not any(s.params.speculate and not s.sampled and s.forced is None and s.max_out - len(s.output_ids) >= 2
                   for s in (*q, *self.core_q, *self.coda_q)):
            return None  # nothing to speculate: the policy's own schedule
        if self.core_q:
            return self._take(Stage.CORE)
        if self.coda_q:
            return self._take(Stage.CODA)
        B, ks, held = self.blocks.block_size, [], [len(s.blocks) for s in q]
        spare = self.blocks.num_free - self.watermark  # blocks the chunks may take
        for s in q:
            n = 1
            if s.params.speculate and not s.sampled and s.forced is None:
                n = max(1, min(c.speculative_tokens, s.max_out - len(s.output_ids)))
                p0 = s.num_tokens - 1
                extra = self.blocks.blocks_for(p0 + n) - len(s.blocks)
                if extra > spare:
                    n, extra = min(n, len(s.blocks) * B - p0), 0  # the rows its own blocks hold (>= 1: p0's)
                if extra > 0:
                    self.blocks.grow_seq(s, p0 + n)
                    spare -= extra
            ks.append(n)
        if max(ks) < 2:  # nothing to speculate (the blocks grown are none: every n is 1)
            return None
        return Work(Stage.SPEC, list(q), spec=ks, spec_blocks=held, draft_depth=c.draft_depth)

    def _prefill(self) -> Work | None:
        """The prefill step, the one point where the prefill modes differ (module docstring)."""
        if not self.mixed:
            return self._prefill_launch()
        return self._fused_chunks() if self.cfg.policy == "cb" else self._prelude_chunks()

    def _prefill_launch(self) -> Work | None:
        """Separate prefill's step: a prefill launch of the waiting prompts (FIFO) that fit, whole (the
        chunker's admission, with no decode item beside them); they wait for no queue (stage PREFILL)."""
        out = self.chunker.admit(self.waiting, 0, self.num_running, self.cfg.max_batch_size, new=not self.swapped,
                                 keep_free=self._keep_free)
        for s in out:
            s.stage = PREFILL
        self.changed += out
        return Work(PREFILL, out) if out else None

    def _prelude_chunks(self) -> Work | None:
        """Mixed prefill's step under CDB: a prelude launch, if a new prompt chunk was admitted."""
        return self._take(PRELUDE) if self._admit() else None

    def _fused_chunks(self) -> Work | None:
        """Mixed prefill's step under CB (vLLM's chunked prefill): prompt chunks admitted into the
        fused iteration, which then runs at the model's r_max; a group of requests that asked for a
        lower r_max runs without them (round robin, as in `_fused`)."""
        r_full, q = self.chunker.r_full, self.prelude_q
        if q and q[0].policy.r_max != r_full:
            return None
        if not self._admit():  # (under CB a chunk is admitted and done in one launch: none was waiting)
            return None
        return Work(FUSED, [s for s in q if s.chunk is not None or s.policy.r_max == r_full], r_max=r_full)

    def _admit(self) -> list[Sequence]:
        ch = self.chunker
        decode = len(self.prelude_q) + len(self.core_q) + len(self.coda_q) - ch.flying
        # swapped sequences come back before any new admission (FIFO); admission leaves the watermark
        out = ch.admit(self.waiting, decode, self.num_running, self.cfg.max_batch_size,
                       new=not self.swapped, keep_free=self._keep_free)
        self.prelude_q += out
        self.changed += out  # new slots and block tables (a later chunk's: unchanged, rewritten all the same)
        return out

    def _prelude(self) -> Work | None:
        if self.mixed:
            self._admit()
        return self._take(PRELUDE)

    def _take(self, stage: Stage) -> Work | None:
        q = self.queues[stage]
        return Work(stage, list(q)) if q else None

    def _fused(self) -> Work | None:
        """CB runs one depth per iteration: the running sequences that share the r_max of the one
        that has waited longest (round robin between groups, so none starves)."""
        if not self.prelude_q:
            return None
        d = self.prelude_q[0].policy.r_max
        return Work(FUSED, [s for s in self.prelude_q if s.policy.r_max == d], r_max=d)

    # ---------------------------------------------------------------- transitions
    def postprocess(self, work: Work, scores: Scores | None = None, finished: dict[int, str] | None = None) -> None:
        """Apply a stage's outcome. CORE: its exit `scores`; stages that emit a token: `finished`
        maps the seq_id of each sequence that stopped to its finish reason; the rest decode on.
        The per-item loops here run once per item per stage: they stay free of calls where they can
        (the host time per stage is what a GPU waits on; infer/bench/host.py measures it)."""
        seqs, chunks = work.seqs, work.chunks
        if work.stage is PRELUDE:
            self._drop(work.items, self.prelude_q)
            for s in seqs:
                s.stage, s.step, s.step_scored = CORE, 0, 0
                t = s.tracker
                if t is None:
                    s.tracker = ExitTracker(s.policy)
                else:
                    t.reset()
            for s in chunks:  # (a chunk never exits early: no tracker)
                s.stage = CORE
            if scores is not None:  # preloop: each item's exit-depth CDF fixes its depth now
                for s, cdf in zip(seqs, scores.get()):
                    s.tracker.at_prelude(cdf)
            self.core_q += work.items
        elif work.stage is CORE:
            self._after_core(seqs, scores, chunks)
        else:
            src = self.coda_q if work.stage is CODA else self.prelude_q if work.stage in (FUSED, SPEC) else None
            if src is not None:
                self._drop(work.items, src)
            done = self.chunker.done(chunks) if chunks else None
            if work.stage is SPEC:  # rollback: the blocks the window took past the last accepted
                B = self.blocks.block_size  # position go back (never one held before: reserve_kv's stay)
                for s, n in zip(seqs, work.spec_blocks):
                    if not finished or s.seq_id not in finished:
                        self.blocks.shrink_seq(s, max(n * B, s.num_tokens))
            going = seqs + done if done else seqs  # done: chunks that completed their prompt (first token sampled)
            if finished:
                for s in going:
                    if s.seq_id in finished:
                        self._release(s, finished[s.seq_id])  # (out of its queue already)
                going = [s for s in going if s.seq_id not in finished]
            # the block of the next token's row, oldest first (it keeps its memory); only a sequence
            # whose next row falls past its last block needs one (one token in block_size)
            need = []
            for s in going:
                s.stage = PRELUDE
                if len(s.output_ids) > s.room:
                    need.append(s)
            self.prelude_q += going
            if need:
                need.sort(key=_seq_id)
                for s in need:
                    if s.slot >= 0 and self.preemption.grow(s, self._read_scores_now):  # (slot < 0: preempted for an older one meanwhile)
                        self.grown.append(s)

    @staticmethod
    def _drop(seqs: list[Sequence], q: list[Sequence]) -> None:
        """Take a stage's batch out of the queue it was taken from (all of it, usually)."""
        if len(seqs) == len(q):  # the batch is a copy of the whole queue (`_take`), nothing joined since
            q.clear()
        elif seqs:
            ids = {id(s) for s in seqs}
            q[:] = [s for s in q if id(s) not in ids]

    def _after_core(self, seqs: list[Sequence], scores: Scores, chunks: list[Sequence]) -> None:
        """Advance every item one step, feed the exit trackers, move the items that exit to the coda
        queue. Synchronous: this step's scores decide now. Pipelined (lookahead): the previous core
        step's scores are read here, and they already decide who exits after this step. A prompt
        chunk (`chunks`) has no score: it goes to the coda after r_full steps."""
        exited = []
        if self.pipeline:
            prev, self._unread_scores = self._unread_scores, (seqs, scores)
            if prev is not None:
                self._score(*prev)
            for s in seqs:
                s.step = st = s.step + 1
                if st >= s.tracker.stop_at:
                    exited.append(s)
        elif scores is None:  # preloop: every depth was fixed at the prelude, nothing to read
            for s in seqs:
                s.step = st = s.step + 1
                if st >= s.tracker.stop_at:
                    exited.append(s)
        else:
            for s, x in zip(seqs, scores.get()):
                s.step = st = s.step + 1
                t = s.tracker
                if t.open:
                    t.after_step(st, x)
                if st >= t.stop_at:
                    exited.append(s)
        if chunks:
            r_full = self.chunker.r_full
            for s in chunks:
                s.step += 1
                if s.step >= r_full:
                    exited.append(s)
        if exited:
            self._drop(exited, self.core_q)
            for s in exited:
                s.stage = CODA
            self.coda_q += exited

    @staticmethod
    def _score(items: list[Sequence], scores: Scores | None) -> None:
        if scores is None:
            return
        for s, x in zip(items, scores.get()):
            # still looping on the step that was scored (not preempted or finished since)
            if s.stage is CORE and s.status is RUNNING and s.step_scored < s.step:
                t = s.tracker
                if t.open:
                    t.after_step(s.step, x)
                s.step_scored = s.step

    # ---------------------------------------------------------------- memory
    def _keep_free(self, admitted: int) -> int:
        """Blocks admission leaves free for running sequences to grow (none if nothing runs)."""
        return self.watermark if self.num_running + admitted > 0 else 0

    def _read_scores_now(self) -> None:
        """Pipeline: read the in-flight core step's exit scores now (a core item is leaving: preemption.py)."""
        if self._unread_scores is not None:
            self._score(*self._unread_scores)

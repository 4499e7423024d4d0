"""The CDB scheduler: four queues and three policies behind one interface. Pure Python (no torch),
so `sim.py` can replay it on a cost model.

Queues (the paper's four): `waiting` (prefill), `prelude_q` (decode tokens waiting for the
prelude), `core_q` (items at mixed depths waiting for their next core step), `coda_q` (exited
tokens waiting for the coda). `schedule()` picks the next stage and its batch:
- `cb`: token-level continuous batching (the baseline): prefill new requests between
  iterations, else one fused iteration (prelude + r_max core steps + coda) over every running
  sequence.
- `cdb`, refill=False: a cohort runs prelude, core steps until all its tokens exited (exited
  tokens leave the batch), then one coda; new requests are prefilled between cohorts.
- `cdb`, refill=True: right after a prefill or a coda, the prelude; else the coda once at least
  `min_coda_batch` exits wait (or no core work is left); else a prefill; else a core step.
Prefill batches hold at most `max_prefill_tokens` prompt tokens; a longer prompt is admitted
alone (whole, never chunked: chunking would change the numbers under the shared layout).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from looplm.policy import ExitTracker

from .block_manager import BlockManager
from .sequence import Sequence, Stage

POLICIES = ("cb", "cdb")


@dataclass(frozen=True)
class SchedulerConfig:
    policy: str = "cdb"
    refill: bool = True
    min_coda_batch: int = 1
    max_batch_size: int = 64
    max_prefill_tokens: int = 2048
    max_position: int = 2048

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"unknown policy {self.policy!r}; supported: {POLICIES}")
        for name in ("min_coda_batch", "max_batch_size", "max_prefill_tokens", "max_position"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


@dataclass
class Work:
    stage: str  # "prefill" | "prelude" | "core" | "coda" | "fused"
    seqs: list[Sequence]


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, blocks: BlockManager):
        self.cfg, self.blocks = cfg, blocks
        self.waiting: deque[Sequence] = deque()
        self.prelude_q: list[Sequence] = []
        self.core_q: list[Sequence] = []
        self.coda_q: list[Sequence] = []
        self.last_stage: str | None = None

    # ---------------------------------------------------------------- state
    @property
    def num_running(self) -> int:
        return len(self.prelude_q) + len(self.core_q) + len(self.coda_q)

    def has_work(self) -> bool:
        return bool(self.waiting) or self.num_running > 0

    def queue_lengths(self) -> dict[str, int]:
        return {"waiting": len(self.waiting), "prelude": len(self.prelude_q), "core": len(self.core_q),
                "coda": len(self.coda_q)}

    def add(self, seq: Sequence) -> None:
        seq.stage = Stage.WAITING
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Take a sequence out of whichever queue holds it and release its memory (abort / finish)."""
        for q in (self.prelude_q, self.core_q, self.coda_q):
            if seq in q:
                q.remove(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)
        if seq.blocks or seq.slot >= 0:
            self.blocks.free(seq.blocks, seq.slot)
            seq.blocks, seq.slot = [], -1
        seq.stage = Stage.FINISHED

    # ---------------------------------------------------------------- policy
    def schedule(self) -> Work | None:
        c = self.cfg
        if c.policy == "cb":
            work = self._prefill() or (Work("fused", list(self.prelude_q)) if self.prelude_q else None)
        elif not c.refill:
            work = (Work("core", list(self.core_q)) if self.core_q else
                    Work("coda", list(self.coda_q)) if self.coda_q else
                    self._prefill() or (Work("prelude", list(self.prelude_q)) if self.prelude_q else None))
        else:
            if self.last_stage in ("prefill", "coda") and self.prelude_q:
                work = Work("prelude", list(self.prelude_q))
            elif self.coda_q and (len(self.coda_q) >= c.min_coda_batch or not self.core_q):
                work = Work("coda", list(self.coda_q))
            else:
                work = (self._prefill() or (Work("core", list(self.core_q)) if self.core_q else None) or
                        (Work("prelude", list(self.prelude_q)) if self.prelude_q else None))
        if work is not None:
            self.last_stage = work.stage
        return work

    def _prefill(self) -> Work | None:
        batch: list[Sequence] = []
        tokens = 0
        while self.waiting and self.num_running + len(batch) < self.cfg.max_batch_size:
            seq = self.waiting[0]
            n = len(seq.prompt_ids)
            if batch and tokens + n > self.cfg.max_prefill_tokens:
                break
            need = seq.reserved_tokens(self.cfg.max_position)
            if not self.blocks.can_allocate(need):
                break  # FIFO: the head waits for memory, nobody overtakes it
            seq.blocks, seq.slot = self.blocks.allocate(need)
            batch.append(self.waiting.popleft())
            tokens += n
        return Work("prefill", batch) if batch else None

    # ---------------------------------------------------------------- transitions
    def to_prelude(self, seqs: list[Sequence]) -> None:
        """After a prefill or a coda produced their next token (and they are not finished)."""
        for s in seqs:
            s.stage = Stage.PRELUDE
        self.prelude_q.extend(seqs)

    def after_prelude(self, seqs: list[Sequence]) -> None:
        ids = {id(s) for s in seqs}
        self.prelude_q = [s for s in self.prelude_q if id(s) not in ids]
        for s in seqs:
            s.stage, s.step, s.step_scored, s.tracker = Stage.CORE, 0, 0, ExitTracker(s.policy)
        self.core_q.extend(seqs)

    def after_core(self, seqs: list[Sequence], scores: list[float]) -> list[Sequence]:
        """Advance every item one step; returns the items that exit now (they join the coda queue)."""
        exited = []
        for s, score in zip(seqs, scores):
            s.step += 1
            if s.tracker.after_step(s.step, score):
                exited.append(s)
        return self._to_coda(exited)

    def take_exited(self, seqs: list[Sequence]) -> list[Sequence]:
        """Pipelined core (lookahead): items whose exit after their current step is already known
        (decided from the previous step's signal, or r_max) leave for the coda queue."""
        return self._to_coda([s for s in seqs if s.step >= s.policy.r_max or
                              (s.tracker.exit_at is not None and s.step >= s.tracker.exit_at)])

    def _to_coda(self, exited: list[Sequence]) -> list[Sequence]:
        if exited:
            ids = {id(s) for s in exited}
            self.core_q = [s for s in self.core_q if id(s) not in ids]
            for s in exited:
                s.stage = Stage.CODA
            self.coda_q.extend(exited)
        return exited

    def after_coda(self, seqs: list[Sequence]) -> None:
        ids = {id(s) for s in seqs}
        self.coda_q = [s for s in self.coda_q if id(s) not in ids]
        if self.cfg.policy == "cb":  # a fused iteration consumed the prelude queue
            self.prelude_q = [s for s in self.prelude_q if id(s) not in ids]

"""Prefill that rides on the decode stages: prompt chunks as multi-token scheduler items. Pure Python.

With `prefill="mixed"` a prompt (or a chunk of one: positions `seq.chunk = (start, end)`) is one
item that goes through the prelude, core and coda queues alongside the decode items and never exits
early: it joins a prelude launch, then rides in the next r_max core launches (every position of the
chunk at the same loop step, so the prompt stays depth-major), then in the next coda launch, which
writes the coda KV of every position and, for the prompt's last chunk, runs the head on its last
position: the first token, at full depth. Under CB the whole path is one fused launch.

Admission (`admit`, called when a prelude or, under CB, a fused launch is formed): the sequences
whose earlier chunk is done come first (they hold a slot and their blocks), then the waiting queue in
FIFO order. Every launch holds at most `max_num_batched_tokens` items: the running decode items (at most
one per running sequence) plus the prompt tokens in flight, so a new chunk gets what is left. A
prompt longer than that is split (`chunked`: the depth-indexed layouts, where a chunk reads the
earlier chunks' K/V at its own depth slot) or admitted whole (`shared`, or chunking off). When
nothing else is prefilling, a chunk gets at least `block_size` tokens (a whole prompt if it cannot be
split), so that a budget smaller than the decode batch still makes progress. The chunks of one prompt
run one after another (chunk k+1 needs chunk k's coda KV).

Memory: a prompt's first admission allocates the blocks of its whole prompt (with `reserve_kv`:
prompt + max_tokens), leaving the scheduler's watermark free, so its later chunks never wait for
memory and prefilling sequences can never deadlock each other; the block of its first output
token is grown like any decode token's when the prompt completes. A prefilling sequence is never a
preemption victim (its chunk state is not in the per-slot buffers); new prompts wait while a
preempted sequence is swapped out.

Prefix caching (`caching`; block_manager.py keeps the blocks): at its first admission a prompt
takes the cached blocks of its longest run of leading full blocks, at most (len - 1) // block_size
of them so that at least one position is computed (its logits give the first token), and starts
its first chunk at the first position after them; the budget counts only that suffix. A request
that asks for prompt log-probs takes none (it needs every position's logits). Once the coda (CB:
the fused launch) of a chunk has run, the prompt's full blocks up to the chunk's end hold their
final K/V in every layer and depth slot, and are registered. Exact for the depth-indexed layouts:
that K/V depends only on the tokens up to each position, decode tokens never write prompt rows
(the last_exited fill writes only the exited decode token's own row), and the suffix reads the
cached rows at its own loop step, as a later chunk of the same prompt would.
"""
from __future__ import annotations

import time
from collections import deque
from typing import Callable

from .block_manager import BlockManager, block_hashes
from .sequence import Sequence, Stage, Status


class Chunker:
    """The scheduler's prompt admission: which prompt chunks a launch admits, and what a chunk's coda
    leaves (the prompt done, or its next chunk to admit). Under mixed prefill the chunks in flight are
    items of the scheduler's own queues (`seq.chunk` set); under separate prefill they are whole
    prompts in a prefill launch of their own (no decode item counts against the budget then). This
    keeps only their counts and the prompts between chunks (`partial`)."""

    def __init__(self, budget: int, chunked: bool, r_full: int, blocks: BlockManager, max_model_len: int,
                 reserve_kv: bool = False, caching: bool = False):
        self.budget, self.chunked, self.r_full = budget, chunked, r_full
        self.blocks, self.max_model_len, self.reserve_kv = blocks, max_model_len, reserve_kv
        self.caching = caching
        # prompt tokens looked up in the prefix cache and found there (Scheduler.counters merges them)
        self.counters = {"prefix_cache_queries": 0, "prefix_cache_hits": 0}
        self.flying = 0  # chunk items in the scheduler's queues
        self.tokens = 0  # their prompt positions
        self.partial: deque[Sequence] = deque()  # admitted, a chunk done, the next one not yet admitted

    @property
    def held(self) -> int:
        """Sequences that hold a slot while prefilling."""
        return len(self.partial) + self.flying

    def drop(self, seq: Sequence) -> None:
        """Forget a prefilling sequence (aborted): a chunk in flight (`seq.chunk` set; the scheduler
        takes it out of its queue) or a prompt between chunks (out of `partial`)."""
        if seq.chunk is None:
            self.partial.remove(seq)
        else:
            self.flying -= 1
            self.tokens -= seq.chunk[1] - seq.chunk[0]

    def admit(self, waiting: deque[Sequence], decode_items: int, running: int, max_batch: int, new: bool = True,
              keep_free: Callable[[int], int] = lambda admitted: 0) -> list[Sequence]:
        """New chunks for the next prelude (or fused) launch (see the module docstring); the
        scheduler puts them in its prelude queue."""
        inflight = self.tokens
        room = self.budget - decode_items - inflight
        out: list[Sequence] = []
        while self.partial or (waiting and new):
            started = bool(self.partial)
            s = self.partial[0] if started else waiting[0]
            hits = [] if started else self._lookup(s)
            left = len(s.prompt_ids) - s.prefilled - len(hits) * self.blocks.block_size
            alone = not out and not inflight
            if self.chunked:
                n = min(left, max(room, self.blocks.block_size) if alone else room)
            else:
                n = left if (left <= room or alone) else 0
            if n <= 0:
                break
            if not started:
                if running + len(out) >= max_batch:
                    break
                need = s.reserved_tokens(self.max_model_len) if self.reserve_kv else len(s.prompt_ids)
                if not self.blocks.can_allocate(need, keep_free(len(out)), hits):
                    break  # FIFO: the head waits for memory, nobody overtakes it
                self.blocks.allocate_seq(s, need, hits)
                s.prefilled = len(hits) * self.blocks.block_size
                if self.caching and s.params.prompt_logprobs is None:
                    self.counters["prefix_cache_queries"] += len(s.prompt_ids)
                    self.counters["prefix_cache_hits"] += s.prefilled
                if s.scheduled_time is None:
                    s.scheduled_time = time.perf_counter()
                waiting.popleft()
            else:
                self.partial.popleft()
            s.chunk, s.step = (s.prefilled, s.prefilled + n), 0
            s.status, s.stage = Status.RUNNING, Stage.PRELUDE
            out.append(s)
            room -= n
            self.tokens += n
        self.flying += len(out)
        return out

    def done(self, chunks: list[Sequence]) -> list[Sequence]:
        """The chunks whose coda (or CB's fused launch) ran, out of the scheduler's queue already:
        returns those whose prompt is now complete (their first token was sampled in this launch);
        the others wait in `partial` for their next chunk's admission."""
        complete = []
        for s in chunks:
            if self.caching:
                self._register(s)
            self.tokens -= s.chunk[1] - s.chunk[0]
            s.prefilled, s.chunk, s.step = s.chunk[1], None, 0
            if s.prefilled == len(s.prompt_ids):
                complete.append(s)
            else:
                s.stage = Stage.PREFILL  # (running: its next chunk waits for admission)
                self.partial.append(s)
        self.flying -= len(chunks)
        return complete

    def _lookup(self, s: Sequence) -> list[int]:
        """The cached blocks a new prompt starts with (see the module docstring)."""
        if not self.caching or s.params.prompt_logprobs is not None:
            return []
        cap = (len(s.prompt_ids) - 1) // self.blocks.block_size
        return self.blocks.match(block_hashes(s.prompt_ids, self.blocks.block_size, s.block_hashes)[:cap])

    def _register(self, s: Sequence) -> None:
        """Register the full prompt blocks that the finished chunk `s.chunk` completed."""
        B = self.blocks.block_size
        hashes = block_hashes(s.prompt_ids, B, s.block_hashes)
        for i in range(s.chunk[0] // B, s.chunk[1] // B):
            self.blocks.register(s.blocks[i], hashes[i])

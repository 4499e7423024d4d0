"""The model runner: executes one stage on a batch of sequences at mixed depths.

Tensors live here. Per-sequence loop state (state, injection, criterion memory) sits in static
buffers indexed by the sequence's slot; KV goes through the layout (kv_layouts). Decode batches
are padded to powers of two: padded items use the scratch slot and the layout's scratch row, so
they write no real KV and are never sampled.

Decode stages (prelude, core, coda, CB's fused iteration) share one metadata format, the per-slot
state of `BatchState` (batch_state.py: positions, loop steps, block tables, the one upload per
stage), so on CUDA each can replay a CUDA graph captured per (stage, padded batch, context
bucket) from static input buffers (graphs.py). The CPU path runs the same `body` eagerly. A launch
with prompt chunks riding along is the same: each chunk position is an item in a token slot of its
own (mixed.py), so on the paged attention path it replays a graph too; on the SDPA path it runs the
same body eagerly, each chunk attending as one causal segment. A separate prefill launch is CB's
fused iteration over such items alone (its prompts are chunks that end their prompts). Only a
speculative stage runs eagerly on CUDA (speculative.py). A core step returns its
exit scores as a pending host copy, which lets the engine prepare the next batch while the
device still runs this one (the lookahead pipeline).

`Runner` is what the engine needs from a runner; `ModelRunner` runs the model, the simulator's
`SimRunner` (infer/sim/runner.py) charges a cost model instead.
"""
from __future__ import annotations

from functools import partial
from typing import NamedTuple, Protocol, runtime_checkable

import torch

from kv_layouts import make_layout
from looplm.exits import initial_aux, preloop_cdf, score_rule
from looplm.model import LoopedLM

from . import mixed, speculative, stages
from .batch_state import BatchState, launch_sizes, padded_batch
from .block_manager import BlockManager
from . import graphs as graph_cache
from .scheduler import Scores, SwapOp, Work
from .swap import swap_ops
from .sequence import Sequence, Stage
from .stages import TokenBatch

SpecOut = speculative.SpecOut


@runtime_checkable
class Runner(Protocol):
    """Everything the engine, the server and the instruments call on a runner; ModelRunner, the
    simulator's SimRunner and the emulated device's EmulatedRunner (infer/sim) implement all of it
    (tests/test_runner_protocol.py checks each member and its signature).

    `run`: one stage. Returns the `Emitted` logits of a stage that emits tokens (prefill, coda,
    fused), the exit `Scores` of a core step, None for a prelude, a `SpecOut` for a speculative
    stage (only with EngineConfig.speculative_tokens). Under the preloop criterion the prelude
    returns each item's exit-depth CDF (`Scores` of rows) and a core step None: no score is read
    during the loop. `padded`: the batch a decode launch of n items runs at. `swap`: the
    scheduler's preemption copies, before the next stage. On-device token re-entry
    (EngineConfig.async_scheduling): `reenter` keeps the ids a stage sampled on the device, where the
    next prelude (or fused) launch of those sequences embeds them; `to_host` starts the one
    device -> host copy of a stage's sampled values, read later with `get()` (waiting for that
    launch only)."""

    # decode attention traffic counters (a dict: counting; None: off; only ModelRunner counts)
    attention_stats: dict | None
    # the device a virtual runner stands for (what the server's /v1/models shows); None: a real one
    device_info: dict | None
    # seconds on the virtual clock (the simulator's and emulated device's); None: wall time is real
    clock: float | None
    # the seconds a virtual runner priced the last launch at (what min_coda_batch="auto" learns); None: real
    last_seconds: float | None

    def run(self, work: Work) -> Emitted | Scores | SpecOut | None: ...

    def padded(self, n: int) -> int: ...

    def swap(self, ops: list[SwapOp]) -> None: ...

    def reenter(self, seqs: list[Sequence], ids: torch.Tensor) -> None: ...

    def to_host(self, values: torch.Tensor, n: int) -> Scores: ...


class Emitted(NamedTuple):
    """What a stage that emits tokens returns: the logits [rows, V] of its decode items then of
    its final prompt chunks (`Work.finals`), and the prompt logits [L, V] of each whole prompt
    completed in it whose request asked for prompt log-probs (by seq_id; None: no such prompt)."""
    logits: torch.Tensor
    prompt_logits: dict[int, torch.Tensor] | None = None


class PendingScores:
    """Device values the host reads later (a `Scores`): a core step's exit scores, a stage's sampled
    ids. A graph's output buffer is overwritten by the next replay, so they are copied out at once
    (on CUDA into pinned memory, stream-ordered, with an event); an eager CPU launch's own tensor is
    kept as it is (`copy=False`)."""

    def __init__(self, scores: torch.Tensor, n: int, copy: bool = False):
        self.n = n
        if scores.device.type == "cuda":
            self.host = torch.empty(scores.shape, dtype=scores.dtype, pin_memory=True)
            self.host.copy_(scores, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record(torch.cuda.current_stream(scores.device))  # (its device's stream: cuda:1 too)
        else:
            self.host, self.event = scores.clone() if copy else scores, None

    def get(self) -> list[float]:
        """The scores; waits for (only) the step that produced them."""
        if self.event is not None:
            self.event.synchronize()
        return self.host[: self.n].tolist()


class ModelRunner:
    def __init__(self, model: LoopedLM, kv_layout: str, blocks: BlockManager, criterion: str,
                 pad_pow2: bool = True, max_batch_size: int = 64, cuda_graphs: bool = False,
                 attention_backend: str = "sdpa", token_slots: int = 0):
        self.model, self.cfg, self.blocks, self.criterion = model, model.cfg, blocks, criterion
        self.device, self.dtype = model.device, model.dtype
        self.pad_pow2, self.max_batch_size = pad_pow2, max_batch_size
        self.layout = make_layout(kv_layout, self.cfg, blocks.num_blocks * blocks.block_size, self.dtype, self.device)
        S, D = blocks.num_slots + 1, self.cfg.hidden_size  # slot S-1 is the scratch slot for padding
        T = token_slots  # then one slot per prompt position in flight (mixed.py), rows S..S+T-1
        self.scratch_slot = S - 1
        # the per-slot loop state (state, Huginn's injection; token slots too), written by the bodies, and
        # the criterion's memory (sequence slots only: a token slot's rows are clamped to the scratch slot)
        self.state = torch.zeros(S + T, D, dtype=self.dtype, device=self.device)
        self.inj = torch.zeros(S + T, D, dtype=self.dtype, device=self.device) if self.cfg.arch == "huginn" else None
        self.token_slots = mixed.TokenSlots(S, T)
        self.rule = score_rule(criterion, self.cfg)  # the score arithmetic (lookahead head: its teacher's)
        self.preloop = criterion == "preloop"
        self.aux = initial_aux(self.rule, S, self.cfg.vocab_size, self.device)
        # preemption's host copies (swap.py): per swapped-out sequence, its KV rows and state slot
        self.host_swap: dict[int, tuple[list[torch.Tensor], list[torch.Tensor | None]]] = {}
        # the per-slot decode metadata (positions, loop steps, block tables) and the upload
        self.batch_state = bs = BatchState(S, blocks.block_size, self.cfg.max_position, blocks.num_blocks,
                                           self.layout.scratch_row,
                                           partial(padded_batch, max_batch_size=max_batch_size, pad_pow2=pad_pow2),
                                           self.device, T)
        bs.head_rows = self.padded(max_batch_size)
        # (no reference cycle anywhere in the runner: the graph cache holds a weak proxy of it, the stage
        # tables below are of method names and BatchState gets a plain function, so a dropped engine
        # frees its KV pool at once, not at the cyclic GC's next pass; tests/test_gpu_discipline.py)
        self.graphs = graph_cache.make_graphs(self, self.device, cuda_graphs)
        self.step = bs.step  # the loop step of each slot (the bodies write it)
        self._t = bs.to_device
        if attention_backend == "paged":  # before any capture: the graphs the engine captures at start-up run paged
            self.enable_paged()
        # mixed prefill: the prompt logits of a prompt whose earlier chunks asked for them (by seq_id; mixed.py)
        self._prompt_logits: dict[int, torch.Tensor] = {}

    # each stage's body and launch, by method name (bound methods kept on self would be a reference cycle)
    _BODIES = {Stage.PRELUDE: "_prelude_body", Stage.CORE: "_core_body", Stage.CODA: "_coda_body",
               Stage.FUSED: "_fused_body"}
    _STAGES = {Stage.PREFILL: "_prefill", Stage.PRELUDE: "_prelude", Stage.CORE: "_core", Stage.CODA: "_coda",
               Stage.FUSED: "_fused", Stage.SPEC: "_spec"}

    device_info = None  # a real device (Runner.device_info)
    clock = None  # wall time is real (Runner.clock)
    last_seconds = None  # (Runner.last_seconds: a real launch is not priced; the engine times it)

    def padded(self, n: int) -> int:
        return padded_batch(n, self.max_batch_size, self.pad_pow2)

    def attends(self, stage: Stage) -> bool:
        """Whether a decode stage has attention layers (reads context): not Ouro's prelude or coda
        (0-N-0), whose launches then run at one context bucket (one graph per batch size)."""
        return {Stage.PRELUDE: self.cfg.n_prelude > 0, Stage.CODA: self.cfg.n_coda > 0}.get(stage, True)

    def graph_keys(self, fused: bool, r_max: int, separate: bool = False) -> list[tuple]:
        """Every graph key (GraphCache.run's) a launch can hit: the padded batch sizes of 1..max_batch_size
        items (slots, + their tokens for a stage that embeds them), and on the paged path the sizes of
        launches with prompt chunks up to max_launch_tokens more items (mixed.py), times the context
        buckets up to the table's width (one for a stage without attention layers), for CB's fused
        iteration at `r_max` or for CDB's prelude, core step and coda. `separate` (separate prefill):
        the prompts run in fused launches at `r_max` of their own, so the ladder is theirs and CDB's
        stages stop at max_batch_size."""
        bs = self.batch_state
        sizes = self.launch_sizes()
        decode = [n for n in sizes if n <= self.padded(self.max_batch_size)] if separate else sizes
        buckets = sorted({bs.ctx_blocks(nb) for nb in range(1, bs.bt.shape[1] + 1)})
        keys = []
        for st in [Stage.FUSED] if fused else [Stage.PRELUDE, Stage.CORE, Stage.CODA]:
            ctx = buckets if self.attends(st) else [1]
            keys += [(st, 2 * n if st.reads_tokens else n, nb, r_max if fused else 0)
                     for n in (sizes if fused else decode) for nb in ctx]
        if separate and not fused and bs.ladder:  # (eager on the SDPA path: no keys)
            keys += [(Stage.FUSED, 2 * n, nb, r_max) for n in sizes for nb in buckets]
        return keys

    def launch_sizes(self) -> list[int]:
        """The padded item counts of the launches with static shapes: decode launches, and on the paged
        path (mixed launches replay graphs and run the compiled kernel too) every rung of the ladder up
        to the most items one can carry."""
        ladder = self.batch_state.ladder
        most = self.max_batch_size + (len(self.token_slots.free) if ladder else 0)
        return launch_sizes(self.max_batch_size, self.pad_pow2, most, ladder)

    @property
    def attention_stats(self) -> dict | None:
        """Decode attention traffic counters (BatchState._count_attention); None: off."""
        return self.batch_state.attention_stats

    @attention_stats.setter
    def attention_stats(self, value: dict | None) -> None:
        self.batch_state.attention_stats = value

    def enable_paged(self, compile: bool | None = None) -> dict | None:
        """Switch decode attention to paged FlexAttention (compiled on CUDA unless `compile` is
        False): EngineConfig.attention_backend="paged" (the CUDA default) calls it at construction,
        before the engine captures its graphs. Block tables already on the device get their inverse
        page table rebuilt. CUDA graphs captured before (through the gather + SDPA path) are captured
        again, so that replays run paged; returns that capture's count and seconds
        (GraphCache.capture), None when there was none."""
        bs = self.batch_state
        bs.paged = True
        bs.ladder = True  # launches with prompt chunks: few shapes, they replay graphs too (mixed.py)
        if compile if compile is not None else self.device.type == "cuda":
            # every static shape the compiled kernel meets: a launch's padded item count (launch_sizes)
            # times the depth slots its stage reads (1: prelude, coda, a one-slot core; the layout's slots: a
            # depth-indexed core step). Context lengths are no shape (stages.paged_mask); speculative
            # stages never run paged
            sizes = set(self.launch_sizes())
            bs.flex = stages.compile_paged_flex(len(sizes) * len({1, self.layout.num_depth_slots}))
        bs.invalidate_all()  # re-upload every table at its next stage
        graphs = self.graphs
        if graphs is None or not graphs.graphs:
            return None
        # a captured graph replays the attention it was captured with: drop them all (and their memory
        # pool) and capture the same keys again, now through the paged path (in inference mode, as every
        # capture: graphs.py; a compiled flex_attention also guards on the grad mode)
        return graphs.capture(graphs.clear())

    # ------------------------------------------------------------------ stage bodies
    def body(self, stage: Stage, inp: torch.Tensor, nb: int, r_max: int = 0) -> torch.Tensor | None:
        """One decode stage over a padded batch (`inp`: slots [N], + their tokens for a prelude or
        fused stage; `nb` context blocks), reading and writing only static buffers (so it can be
        captured in a CUDA graph). Returns scores [N] (core), logits [N, V] (coda, fused)."""
        return getattr(self, self._BODIES[stage])(*self.batch_state.gather(stage, inp, nb), r_max)

    # Each body runs a stage over the N items of `batch` (their slots: `slots`: decode items, then prompt
    # chunk positions in token slots, then padding; mixed.py). Exit scores and the head are for the first
    # `batch.scored` items only, or the head for the rows `head` names (stages.head_of).
    def _prelude_body(self, slots: torch.Tensor, batch: TokenBatch, r_max: int,
                      head: torch.Tensor | int | None = None) -> torch.Tensor | None:
        state, inj = stages.prelude(self.model, self.layout, batch)
        N = slots.shape[0]
        self.step.index_fill_(0, slots, 0)
        self.state.index_copy_(0, slots, state)
        if self.inj is not None:
            self.inj.index_copy_(0, slots, inj)
        if self.aux is not None:
            self.aux.index_copy_(0, self._aux_slots(slots), initial_aux(self.rule, N, self.cfg.vocab_size, self.device))
        if self.preloop:  # the scored items' exit-depth CDFs [n, r_max]: their depths, read once here
            n = batch.scored
            return preloop_cdf(self.model, state[:n], inj[:n] if inj is not None else None)
        return None

    def _core_body(self, slots: torch.Tensor, batch: TokenBatch, r_max: int,
                   head: torch.Tensor | int | None = None) -> torch.Tensor:
        state = self.state[slots]
        inj = self.inj[slots] if self.inj is not None else None
        scored = self._aux_slots(slots[:batch.scored])
        aux = self.aux[scored] if self.aux is not None else None
        new, scores, aux = stages.core_step(self.model, self.layout, batch, state, inj, self.criterion, aux)
        self.state.index_copy_(0, slots, new)
        if aux is not None:
            self.aux.index_copy_(0, scored, aux)
        self.step.index_copy_(0, slots, batch.steps)
        self.step[self.scratch_slot].zero_()  # padding keeps loop step 1 (its KV index stays in range)
        return scores

    def _coda_body(self, slots: torch.Tensor, batch: TokenBatch, r_max: int,
                   head: torch.Tensor | int | None = None) -> torch.Tensor:
        # the layout's on-exit hook (last_exited fill) first; the loop step of each slot is its exit
        # depth (prompt positions are at r_max: nothing to fill)
        self.layout.on_exit(batch.rows, self.step[slots])
        return stages.coda(self.model, self.layout, batch, self.state[slots],
                           head_index=batch.scored if head is None else head)

    def _fused_body(self, slots: torch.Tensor, batch: TokenBatch, r_max: int,
                    head: torch.Tensor | int | None = None) -> torch.Tensor:
        """CB: prelude + r_max core steps + coda, no scheduling in between (prompt positions at the
        same loop steps as the decode items)."""
        return stages.fused(self.model, self.layout, batch, r_max, head_index=batch.scored if head is None else head)

    def _aux_slots(self, slots: torch.Tensor) -> torch.Tensor:
        """The criterion memory's rows of `slots`: a token slot's is the scratch slot's (never read)."""
        return slots.clamp(max=self.scratch_slot)

    # ------------------------------------------------------------------ launches
    def _launch(self, work: Work, stage: Stage | None = None, r_max: int = 0):
        """One launch: the upload, then the body of `stage` (default: the work's) over its items (a CUDA
        graph replay when graphs are on). Prompt chunks riding along are items in token slots (mixed.py):
        on the paged path such a launch is like a decode launch; it runs eagerly on the SDPA path (each
        chunk one causal segment) and where a chunk wants prompt log-probs (the head on an explicit row
        list). Returns the body's output."""
        stage, seqs, r_max = stage or work.stage, work.seqs, r_max or work.r_max
        bs = self.batch_state
        lay = mixed.layout(work, self.token_slots, len(seqs), stage.reads_tokens) if work.chunks else None
        inp, nb = bs.upload(seqs, tokens=stage.reads_tokens, context=self.attends(stage),
                            riders=lay.riders if lay is not None else None)
        nb = bs.ctx_blocks(nb)
        if lay is None or (bs.paged and lay.head is None):
            if self.graphs is not None:
                return self.graphs.run(stage, inp, nb, r_max)
            return self.body(stage, inp, nb, r_max)
        n = len(seqs)
        slots, batch = bs.gather(stage, inp, nb, context_items=None if bs.paged else n)
        if not bs.paged:
            batch.segments = mixed.segments(work, lay, self.blocks.block_size, self._t)
            batch.num_decode = batch.scored = n
        head = self._t(lay.head) if lay.head is not None else n + len(work.finals)
        return getattr(self, self._BODIES[stage])(slots, batch, r_max, head)

    def run(self, work: Work) -> Emitted | PendingScores | None:
        if torch.is_inference_mode_enabled():  # the engine's loops already are (entering costs ~5 us a stage)
            return self._run(work)
        with torch.inference_mode():
            return self._run(work)

    def _run(self, work: Work) -> Emitted | PendingScores | None:
        if work.changed or work.grown:  # rewritten at this or the next stage that uploads (a prefill does not)
            self.batch_state.note(work.changed, work.grown)
        if work.released:  # prompts aborted mid-prefill: their chunks' token slots and partial logits go
            for s in work.released:
                self.token_slots.give_back(s.seq_id)
                self._prompt_logits.pop(s.seq_id, None)
        return getattr(self, self._STAGES[work.stage])(work)

    def _prelude(self, work: Work) -> PendingScores | None:
        out = self._launch(work)
        return PendingScores(out, len(work.seqs), self.graphs is not None) if self.preloop else None

    def _core(self, work: Work) -> PendingScores | None:
        """One loop step for every item, each at its own depth. No scores to read under the preloop
        criterion (depths fixed at the prelude) or at full depth (criterion none: every item loops to
        its r_max, and no request can override that), so such a step makes no device -> host read."""
        scores = self._launch(work)
        if self.preloop or self.criterion == "none":
            return None
        return PendingScores(scores, len(work.seqs), self.graphs is not None)

    def _coda(self, work: Work) -> Emitted:
        return self._emitted(work, self._launch(work))

    _fused = _coda

    def _emitted(self, work: Work, logits: torch.Tensor) -> Emitted:
        n = len(work.seqs)
        if not work.chunks:
            return Emitted(logits[:n])
        # the chunks are done with this launch: their token slots go back; prompt log-probs rows after
        # the sampled ones
        for s in work.chunks:
            self.token_slots.give_back(s.seq_id)
        n += len(work.finals)
        return Emitted(logits[:n], mixed.prompt_logits(work, logits, n, self._prompt_logits))

    def _prefill(self, work: Work) -> Emitted:
        """Separate prefill: whole prompts at full depth, depth-major. Its items are prompt chunks that
        end their prompts, so this is CB's fused iteration at the model's r_max over their token slots
        (mixed.py), with nothing else in the launch: a graph replay on the paged path."""
        return self._emitted(work, self._launch(work, Stage.FUSED, self.cfg.r_max))

    def _spec(self, work: Work) -> speculative.SpecOut:
        """Draft and verify (speculative.py), eagerly on batches of its own; the per-slot metadata of
        its sequences (positions moved several tokens on, block tables grown and cut back) is
        rewritten whole at their next stage."""
        out = speculative.speculate(self.model, self.layout, self.blocks.block_size, self.criterion, work.seqs,
                                    work.spec, work.draft_depth)
        for s in work.seqs:
            self.batch_state.invalidate(s.slot)
        return out

    # ------------------------------------------------------------------ token re-entry
    def reenter(self, seqs: list[Sequence], ids: torch.Tensor) -> None:
        """The ids a stage sampled [len(seqs)] (on the device) become the tokens its sequences'
        next prelude or fused launch embeds (BatchState.tok, read where the upload sends -1), with
        no device -> host copy in between: stream order puts this write after the stage that
        sampled them and before the next launch."""
        if seqs:
            self.batch_state.tok.index_copy_(0, self._t([s.slot for s in seqs]), ids)

    def to_host(self, values: torch.Tensor, n: int) -> PendingScores:
        return PendingScores(values, n)

    # ------------------------------------------------------------------ preemption (swap.py)
    @torch.inference_mode()
    def swap(self, ops: list[SwapOp]) -> None:
        """Run the scheduler's swap operations in order (see infer/engine/swap.py)."""
        # (the re-entry token too: a sequence swapped out before its next prelude embeds it from its new slot)
        swap_ops(self.layout, [self.state, self.inj, self.aux, self.batch_state.tok], self.blocks.block_size,
                 self.host_swap, ops)
        for op in ops:
            if op.kind == "in":
                self.batch_state.invalidate(op.slot)  # its block table and loop state are rewritten at its next stage

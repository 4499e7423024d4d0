"""`SimRunner`: a `Runner` on a virtual clock. It has ModelRunner's constructor and methods; each
`run` advances the clock by the cost model's time for the stage and batch (cost.py) and returns
tiny tensors: core steps return exit scores that make every token leave at a depth drawn from a
recorded trace or a distribution (the engine runs the "learned" criterion at threshold 0.5,
`SIM_EXITS`; the runner answers exit probability 1 / 0). Also the exit-depth draws."""
from __future__ import annotations

import random
from math import comb

import torch

from infer.engine.memory import state_slot_bytes
from infer.engine.batch_state import context_blocks, padded_batch, table_width
from infer.engine.runner import Emitted
from infer.engine.scheduler import SwapOp, Work
from infer.engine.sequence import Sequence, Stage
from infer.engine.spec_plan import SpecPlan, spec_row
from infer.engine.trace import TraceRow, trace_row
from infer.engine.speculative import SpecOut
from kv_layouts import layout_class
from looplm.config import LoopConfig, replace

from .cost import Call
from .dispatch import LaunchOps, real_criterion
from .workloads import Request

# Assumed mean exit depths for the GPU predictions (the seed gives none; see docs/results/simulator.md).
ASSUMED_MEAN_DEPTH = {"ouro-1.4b": 2.5, "huginn-3.5b": 9.0}
# How the simulated runner makes a token exit at its recorded depth: the "learned" criterion reads
# its exit probability, which SimRunner answers 1 or 0 (`_fires`); lookahead depths start at 2.
SIM_EXITS = dict(exit_criterion="learned", exit_threshold=0.5)


# ---------------------------------------------------------------------------------- exit depths
def binomial_depths(r_max: int, mean: float) -> dict[int, float]:
    """d = 1 + Binomial(r_max - 1, p) with mean `mean`: a unimodal spread over 1..r_max."""
    if not 1 <= mean <= r_max:
        raise ValueError(f"mean depth {mean} outside [1, {r_max}]")
    n = r_max - 1
    p = (mean - 1) / n if n else 0.0
    return {1 + k: comb(n, k) * p ** k * (1 - p) ** (n - k) for k in range(n + 1)}


def depths_from_distribution(probs: dict[int, float], requests: list[Request], seed: int = 0) -> list[list[int]]:
    """Per request, the exit depth of every output token (index 0, the prefill's, unused)."""
    ds, ws = zip(*sorted(probs.items()))
    out = []
    for i, r in enumerate(requests):
        rng = random.Random(f"depths:{seed}:{i}")
        out.append([max(ds)] + rng.choices(ds, ws, k=max(0, r.output_len - 1)))
    return out


# ---------------------------------------------------------------------------------- the runner
class SimModel:
    """What LLMEngine reads from a model: its config, dtype and device."""

    def __init__(self, cfg: LoopConfig, dtype: torch.dtype = torch.bfloat16):
        # the engine runs SIM_EXITS' stand-in criterion ("learned", answered by SimRunner), which it
        # accepts only on a model with a gate head: a model that ships none (Huginn-3.5B's release, a
        # gate-stripped folder) gets one here; the cost model still charges its own criterion
        # (dispatch.real_criterion reads the model's exit_criterion, not this head)
        self.cfg = cfg if cfg.exit_gate else replace(cfg, exit_gate=True)
        self.dtype, self.device = dtype, torch.device("cpu")


class _Scores:
    """Values the host reads later (a core step's exit scores, `to_host`'s ids): reading them waits,
    on the runner's clocks, for the launch that made them (`SimRunner.read`)."""

    def __init__(self, scores: list[float], runner: SimRunner | None = None, end: float = 0.0):
        self.scores, self.runner, self.end = scores, runner, end

    def get(self) -> list[float]:
        if self.runner is not None:
            self.runner.read(self.end)
        return self.scores


class SimRunner:
    """A `Runner` on a virtual clock (see the module docstring): ModelRunner's constructor, each
    `run` charges the cost model's time for the stage and batch, each `swap` the bytes a
    preemption moves (KV blocks + the state slot, each way) at `pcie_bandwidth` bytes/s. Swaps are
    charged in series with the stages: ModelRunner queues its copies on the compute stream.

    Two clocks, as on a GPU (`overlap`): the host's, which pays each launch's host share (the cost
    model's `host_seconds`), the part before the launch (`host_pre_seconds`: scheduling, upload)
    before it and the rest (reading results, output processing) after it, and the device's, which
    runs the launches in order, each starting when both the host has launched it and the device has
    finished the one before. The host waits for the device only where the
    engine reads a launch's results: a core step's exit scores when the scheduler reads them (at
    once, or one core step late with the lookahead pipeline), an emitting stage's rows before its
    next launch (the sampler reads them), or, with on-device token re-entry (`reentry`), when the
    engine reads the ids it copied out (`to_host`), one launch later, and then also pays that
    read's host time (`resolve_seconds`). `overlap=False`: the host waits for every launch (the
    cost of a step is host + device, in series: the emulated device's wall-clock pacing). A cost
    model without a host share (FittedCost) is device time only, which the overlap leaves as it is.

    Dispatch (issue 62; a cost model with a `dispatch` block, dispatch.py: the simulator's and the
    emulated device's roofline): issuing a launch costs the host its eager aten ops x `op_us` (each
    launch of a speculative stage, a launch carrying prompt chunks on the SDPA path or for prompt
    log-probs, a separate prefill's there too, and with `graphs` off every launch) or one graph replay,
    `replay_us` (every other launch, `graphs` on: the CUDA default; on the paged path launches with
    prompt chunks too, mixed.py, and separate prefill's). The ops are counted from the engine (dispatch.LaunchOps). Dispatch is host
    work the device cannot run ahead of, and it comes after the host's work before the launch
    (`pre`: scheduling, upload). The device does not wait for the whole of it: kernels run as they
    are issued, so the launch starts on the device when the host starts issuing it (or when the
    device is free) and cannot end before the host has issued its last kernel: device end =
    max(start + device time, host dispatch end). The alternative, the device starting only once all
    of it is issued, would charge a 17 ms eager chunk launch its ~1-4 ms of device time in series
    instead of beside it. What the engine's CUDA events would show (`last_seconds`, learned by
    min_coda_batch="auto", and the trace's seconds) is the priced seconds plus the time the device
    waited for the host to issue (`_stall`)."""

    attention_stats = None  # (Runner.attention_stats: only ModelRunner counts KV rows read)
    device_info = None  # (Runner.device_info: the emulated device names the GPU it stands for)

    def __init__(self, model, kv_layout, blocks, criterion, pad_pow2=True, max_batch_size=64, *,
                 cost, depths: list[list[int]], pcie_bandwidth: float = 25e9, acceptance: float = 1.0,
                 acceptance_seed: int = 0, overlap: bool = False, reentry: bool = False, graphs: bool = True, **_):
        self.model, self.cfg, self.blocks = model, model.cfg, blocks
        # speculation: each drafted token is accepted with probability `acceptance` (seeded draws)
        self.acceptance, self._accept_rng = acceptance, random.Random(f"accept:{acceptance_seed}")
        self.spec_token = 1  # the token every emitting row gives (`_rows`)
        self.pad_pow2, self.max_batch_size = pad_pow2, max_batch_size
        self.cost, self.depths = cost, depths
        self.block_bytes = blocks.block_size * layout_class(kv_layout).bytes_per_row(model.cfg, model.dtype)
        self.fill_depth_slots = layout_class(kv_layout).fill_depth_slots  # (cfg, exit depth) -> slots its on_exit copies
        self.slot_bytes = state_slot_bytes(model, criterion)
        # full depth (criterion none): a core step has no scores, so the host reads none (ModelRunner._core)
        self.scores = criterion != "none"
        self.pcie_bandwidth = pcie_bandwidth
        self.overlap, self.reentry = overlap, reentry
        self.host_at = self.device_at = 0.0  # the host's clock; when the device has run everything launched
        # the last emitting launch: its end, and the host's cost of reading its ids one launch later
        # (re-entry); `_unread`: its end while the host still reads its rows at once (no to_host);
        # `_reads`: launch end -> the host cost of the first read of its copied-out ids (ids and
        # log-probs are two copies, one read)
        self._emitted: tuple[float, float] = (0.0, 0.0)
        self._unread: float | None = None
        self._reads: dict[float, float] = {}
        # the last launch's host work after it (reading its results, output processing): done once
        # the host reads its results, or at once where it reads none before the next launch
        self._post, self._post_end = 0.0, -1.0
        self.swap_seconds = 0.0
        # dispatch (class docstring): the costs (None: not charged), the op counts, what was charged
        self.dispatch = getattr(cost, "dispatch", None)
        self.graphed = graphs  # (not `graphs`: LLMEngine reads that as a GraphCache)
        # where attention is paged (mixed.py) launches with prompt chunks are padded on the ladder and replay graphs
        self.ladder = getattr(cost, "attention", "paged") != "sdpa"
        self.ops = (LaunchOps(model.cfg, kv_layout, getattr(cost, "attention", "sdpa"))
                    if self.dispatch is not None else None)
        self.op_criterion = real_criterion(model.cfg, criterion)  # what a real engine's launches run
        self.dispatched = {"dispatch_s": 0.0, "eager_ops": 0, "eager_launches": 0, "graphed_launches": 0}
        self._stall = 0.0  # how long the last launch's device waited for the host to issue it
        self.last_seconds = 0.0  # the last launch's priced seconds (what min_coda_batch="auto" learns)
        self._out: dict[int, int] = {}  # seq_id -> blocks swapped out (a swap-in copies those back)
        self.trace: list[TraceRow] = []
        self.first_at: dict[int, float] = {}  # seq_id -> virtual time of its first / latest token
        self.last_at: dict[int, float] = {}

    @property
    def clock(self) -> float:
        """Virtual seconds so far: when both the host and the device are done."""
        return max(max(self.host_at, self._unread or 0.0) + self._post, self.device_at)

    def _charge(self, device: float, pre: float = 0.0, post: float = 0.0, dispatch: float = 0.0) -> float:
        """One launch on the clocks (class docstring): the host's work before it (`pre`), then the
        launch, which the host issues in `dispatch` seconds while the device runs what is issued;
        returns when it ends on the device. `post`, the host's work after it, comes when the host
        reads the launch's results (`read`, `to_host`) or, when it reads none, before the next
        launch."""
        if self._unread is not None:  # the host read the last emitting launch's rows before this launch
            self.host_at = max(self.host_at, self._unread)
            self._unread = None
        self.host_at += self._post + pre
        start = max(self.host_at, self.device_at)
        self.host_at += dispatch  # (the host issues the launch's kernels; the device runs them as they come)
        done = start + device
        # the device's wait for the host's last kernel (exactly 0 without one: what auto learns is unchanged)
        self._stall = self.host_at - done if self.host_at > done else 0.0
        self.device_at = end = done + self._stall
        if not self.overlap:
            self.host_at = end
        self._post, self._post_end = post, end
        return end

    def read(self, end: float) -> None:
        """The host reads results of the launch that ends at `end`: it waits for it (then, for the
        launch just made, does its work after it)."""
        self.host_at = max(self.host_at, end) + self._reads.pop(end, 0.0)
        if end == self._post_end:
            self.host_at += self._post
            self._post = 0.0

    def _split(self, stage: Stage, padded: int, t: float) -> tuple[float, float, float]:
        """(device, host before the launch, host after it) of a launch the cost model prices at `t`."""
        share = getattr(self.cost, "host_seconds", None)
        if share is None:
            return t, 0.0, 0.0
        host = share(stage, padded, self.reentry)
        split = getattr(self.cost, "host_pre_seconds", None)  # (none: all of it before the launch)
        pre = split(stage, padded, self.reentry) if self.overlap and split is not None else host
        return t - share(stage, padded), pre, host - pre

    def swap(self, ops: list[SwapOp]) -> None:
        for op in ops:
            sid = op.seq.seq_id
            if op.kind == "out":
                self._out[sid] = n = len(op.blocks)
            else:
                n = self._out.pop(sid, 0)
            if op.kind != "drop":
                t = (n * self.block_bytes + self.slot_bytes) / self.pcie_bandwidth
                self._charge(t)
                self.swap_seconds += t

    def padded(self, n: int) -> int:
        return padded_batch(n, self.max_batch_size, self.pad_pow2)

    def reenter(self, seqs: list[Sequence], ids: torch.Tensor) -> None:
        """(Runner.reenter: the next prelude's tokens need no device state here.)"""

    def to_host(self, values: torch.Tensor, n: int) -> _Scores:
        """(Runner.to_host: the engine reads the last emitting launch's ids later, not before the
        next launch.)"""
        end, cost = self._emitted
        self._unread = None
        self._reads[end] = cost
        if end == self._post_end:  # the ids stay on the device: the rest of the step does not wait
            self.host_at += self._post
            self._post = 0.0
        return _Scores(values[:n].tolist(), self, end)

    def run(self, work: Work) -> Emitted | _Scores | SpecOut | None:
        prefill = work.stage is Stage.PREFILL
        seqs = work.chunks if prefill else work.seqs  # (a separate prefill's prompts: chunks ending them)
        n = len(seqs)
        if work.stage is Stage.SPEC:
            return self._spec(work)
        if prefill:
            lens = [len(s.prompt_ids) for s in seqs]
            c = Call(work.stage, n, n, sum(lens), sum(lens), sum(x * x for x in lens))
        else:
            filled = sum(self.fill_depth_slots(self.cfg, s.step) for s in seqs) if work.stage is Stage.CODA else 0
            ctx = [s.num_tokens for s in seqs]
            bs = self.blocks.block_size
            # the rows the SDPA path gathers per item: the longest context, bucketed as on CUDA
            width = table_width(self.cfg.max_position, bs, self.blocks.num_blocks)
            L = context_blocks(-(-max(ctx) // bs), width, True) * bs if ctx else 0
            N = self.padded(n) if n else 0
            spans = [s.chunk for s in work.chunks]
            k = sum(e - a for a, e in spans)
            # a mixed launch pads its items together (mixed.py: on the paged path on the ladder); on the SDPA
            # path only its decode items gather their context (the chunks attend as segments)
            extra = padded_batch(n + k, self.max_batch_size, self.pad_pow2, self.ladder) - k - N if k else 0
            c = Call(work.stage, n, N, n, sum(ctx), r_max=work.r_max, filled=filled, rows_sdpa=(n if k else N) * L,
                     rows_paged=sum(-(-x // bs) * bs for x in ctx), prompt_tokens=sum(e - a for a, e in spans),
                     prompt_rows=sum(e for _, e in spans),
                     prompt_pairs=sum((e - a) * a + (e - a) * (e - a + 1) // 2 for a, e in spans),
                     finals=len(work.finals), extra_rows=extra)
        t = self.cost(c)
        eager = not self.graphed or bool(work.chunks) and (  # (what runs eagerly on CUDA: class docstring)
            not self.ladder or any(s.params.prompt_logprobs is not None for s in work.chunks))
        end = self._charge(*self._split(work.stage, c.padded, t),
                           self._dispatch(eager, work.stage, 0 if prefill else n, len(work.chunks)))
        t = self.last_seconds = t + self._stall  # (what the launch's CUDA events would show)
        self.trace.append(trace_row(
            work.stage.value, n, padded=c.padded, tokens=c.tokens, context=c.context, seconds=t,
            score_reads=int(work.stage is Stage.CORE and self.scores), prompt_tokens=c.tokens if prefill else c.prompt_tokens,
            chunks=n if prefill else len(work.chunks),
            # what work.py counts: causal prefix rows of the prompt positions, head rows of final chunks
            context_pairs=(c.context_sq + c.tokens) // 2 if prefill else 0, prompt_pairs=c.prompt_pairs,
            finals=c.finals, r_max=work.r_max or self.cfg.r_max,
            # the launch's cost that the prompts add (weights are paid by the decode items anyway)
            prompt_seconds=(t - self.cost(c.without_prompts()) if n else t) if work.chunks and not prefill else None))
        if work.stage.emits:
            self._stamp(work.emitting, end)
            resolve = getattr(self.cost, "resolve_seconds", None)
            self._emitted = (end, resolve(work.stage, c.padded) if resolve is not None and self.reentry else 0.0)
            self._unread = end
        if work.stage is Stage.PRELUDE:
            return None
        if work.stage is Stage.CORE:
            if not self.scores:
                return None
            # the "learned" criterion's score is an exit probability (looplm/exits.py)
            return _Scores([1.0 if self._fires(s) else 0.0 for s in seqs], self, end)
        return Emitted(self._rows(len(work.emitting)))

    def _dispatch(self, eager: bool, stage: Stage, items: int, chunks: int = 0, phase: str | None = None) -> float:
        """The host seconds issuing a launch costs (class docstring), counted in `dispatched`: an
        eager launch its ops x op_us (a speculative launch's by its `phase`), a graphed one a replay."""
        if self.dispatch is None:
            return 0.0
        d = self.dispatched
        if not eager:
            d["graphed_launches"] += 1
            s = self.dispatch.replay_us * 1e-6
        else:
            ops = (self.ops.spec(phase, stage, items, self.op_criterion) if phase is not None else
                   self.ops.launch(stage, items, chunks, self.op_criterion))
            ops = max(0, round(ops))
            d["eager_launches"] += 1
            d["eager_ops"] += ops
            s = ops * self.dispatch.op_us * 1e-6
        d["dispatch_s"] += s
        return s

    def dispatch_stats(self) -> dict | None:
        """What dispatch charged (None: not charged): host seconds, eager ops, eager and graphed
        launches, the costs and where they came from."""
        if self.dispatch is None:
            return None
        return {**self.dispatched, **self.dispatch.describe(), "cuda_graphs": self.graphed}

    def _stamp(self, seqs: list[Sequence], at: float) -> None:
        """The virtual time of each sequence's first and latest token, the end of the launch that
        gave it (the engine stamps wall time)."""
        for s in seqs:
            self.first_at.setdefault(s.seq_id, at)
            self.last_at[s.seq_id] = at

    def _rows(self, n: int) -> torch.Tensor:
        """Logits of n emitting rows: every token is id `spec_token` (1)."""
        return torch.tensor([[0.0, 1.0]]).expand(n, 2)

    def _spec(self, work: Work) -> SpecOut:
        """A speculative stage on the clock: the launches of the plan the model runner runs
        (infer/engine/spec_plan.py), each priced as a decode launch of its items (unpadded, the
        eager path's SDPA gather to the longest context), and the outcome: every window position
        exits at its recorded depth, and a draft whose predecessors were accepted is accepted with
        probability `acceptance` (LLMEngine.speculative_metrics' draft_accept_prob), independently
        of its depth (in the engine the draft of a position that exits within the draft depth is
        always right; the rate here is an overall one, as measured on a checkpoint)."""
        bs, seqs = self.blocks.block_size, work.seqs
        plan = SpecPlan(work.spec, work.draft_depth, [s.num_tokens - 1 for s in seqs])
        exit_at = []  # each window position's recorded depth, clamped to its policy's range
        for b, j in zip(plan.owner, plan.index):
            p = seqs[b].policy
            exit_at.append(max(p.r_min, min(p.r_max, self.depths_at(seqs[b], len(seqs[b].output_ids) + j))))
        rows: list[TraceRow] = []
        launches = {"draft": 0, "verify": 0}
        for launch in plan:
            idx = launch.items
            ctx = [plan.pos[i] + 1 for i in idx]
            last = launch.stage is Stage.CODA and launch.phase == "verify"
            filled = sum(self.fill_depth_slots(self.cfg, exit_at[i]) for i in idx) if last else 0
            n = len(idx)
            t = self.cost(Call(launch.stage, n, n, n, sum(ctx), filled=filled, rows_sdpa=n * max(ctx),
                               rows_paged=sum(-(-x // bs) * bs for x in ctx)))
            # (the plan reads each core launch's exits before its next launch: a read per launch)
            end = self._charge(*self._split(launch.stage, n, t),
                               self._dispatch(True, launch.stage, n, phase=launch.phase))
            t += self._stall
            self.read(end)
            launches[launch.phase] += 1
            rows.append(spec_row(launch, sum(ctx), self.cfg.r_max, t, int(launch.stage is Stage.CORE)))
            if launch.stage is Stage.CORE:
                plan.exited([i for i in idx if exit_at[i] == launch.step])
        self.trace += rows
        self._stamp(seqs, self.clock)
        drafts, tok = [], self.spec_token
        for k in work.spec:  # a rejected draft is any other id: acceptance stops there (later draws unused)
            drafts.append([tok if self._accept_rng.random() < self.acceptance else tok + 1 for _ in range(k - 1)])
        return SpecOut(self._rows(len(plan)), list(work.spec), drafts, plan.depths(), launches, rows)

    def depths_at(self, s: Sequence, i: int) -> int:
        """The recorded exit depth of the sequence's output token i."""
        return self.depths[int(s.request_id)][i]

    def depth_of(self, s: Sequence) -> int:
        """The recorded exit depth of the token the sequence is looping on (requests are numbered)."""
        return self.depths_at(s, len(s.output_ids))

    def _fires(self, s: Sequence) -> bool:
        """The exit signal after this step, for a token whose recorded exit depth is d (lookahead:
        the signal comes a step early)."""
        p = s.policy
        d = max(p.r_min, min(p.r_max, self.depth_of(s)))
        step = s.step + 1
        return step == d - 1 if p.lookahead else step == d

"""The engine: requests in, stages scheduled and run, tokens out. `step()` is schedule -> run ->
process -> postprocess, like nano-vllm's, except that one step runs one *stage* (a prefill, a
prelude, one core step, a coda, or CB's fused iteration): the scheduler picks the stage and its
batch, the runner runs it, the output processor (output.py) turns the logits of a stage that
emits into each sequence's token and applies the stop rules, and the scheduler applies the
outcome to its queues (and frees the memory of what finished)."""
from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from looplm.errors import ParamError
from looplm.model import LoopedLM
from looplm.policy import ExitTracker

from .auto_coda import AutoCoda, LaunchTimer
from .block_manager import BlockManager
from .cpu_malloc import keep_freed_memory
from .config import EngineConfig
from .memory import kv_bytes_per_token, size_pool, state_slot_bytes
from .batch_state import to_device
from .output import OutputProcessor, UnreadSample
from .runner import Emitted, ModelRunner, Runner, SpecOut
from .sampler import Sampler
from .sampling_params import SamplingParams, check_priority, check_prompt, check_token_ids
from .scheduler import Scheduler, Scores, Work
from .sequence import Sequence, Stage
from .trace import TraceRow, trace_row


log = logging.getLogger("infer.engine")
STAGE_NAMES = {s: s.value for s in Stage}  # (Enum.value is a descriptor call: this runs once per stage)
# the stages whose output goes through the output processor: those that end with logits, and a
# speculative stage (its verified rows, OutputProcessor._accept)
EMITS = frozenset(s for s in Stage if s.emits) | {Stage.SPEC}


class KeptScores:
    """Scores of a launch read for some of its items only (`keep`: their indices)."""

    def __init__(self, scores: Scores, keep: list[int]):
        self.scores, self.keep = scores, keep

    def get(self) -> list[float]:
        v = self.scores.get()
        return [v[i] for i in self.keep]


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    exit_depths: list[int]
    finish_reason: str | None
    text: str = ""
    prompt: str | None = None
    logprobs: list[float] | None = None
    metrics: dict = field(default_factory=dict)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


def speculative_rates(sp: dict) -> dict:
    """Speculation counters with the rates added: the acceptance rate (accepted / drafted tokens,
    vLLM's; drafts after a rejected one count as not accepted), the draft acceptance probability
    (accepted / (accepted + rejected): the chance that a draft whose predecessors were accepted is
    accepted too, what the simulator's --acceptance draws), and the tokens per verification
    (tokens emitted from windows of more than one position / such windows)."""
    seen = sp["accepted"] + sp["rejected"]
    return {**sp, "acceptance_rate": sp["accepted"] / sp["drafted"] if sp["drafted"] else 0.0,
            "draft_accept_prob": sp["accepted"] / seen if seen else 0.0,
            "tokens_per_verification": sp["verified_tokens"] / sp["verifications"] if sp["verifications"] else 0.0}


class LLMEngine:
    def __init__(self, model: LoopedLM, config: EngineConfig | None = None, tokenizer=None, runner_cls=None):
        """`config` settings left at None come from the checkpoint (EngineConfig.resolve).
        `runner_cls` replaces ModelRunner (same constructor, a `Runner`): the simulator plugs in a
        cost-model runner so that the real scheduler and engine run without the model."""
        self.model, self.tokenizer = model, tokenizer
        cfg = model.cfg
        if model.device.type == "cpu" and runner_cls is None:  # (a real CPU engine: launches allocate and free MBs)
            keep_freed_memory()
        # every setting decided once: resolve() fills the checkpoint's and the device's defaults,
        # size_pool() the pool-dependent ones; everything below reads this config
        self.config = c = size_pool(model, (config or EngineConfig()).resolve(cfg, model.device))
        self.policy = c.exit_policy(cfg)
        self.max_model_len = c.max_model_len
        self.kv_bytes_per_token = kv_bytes_per_token(model, c.kv_layout)
        self.blocks = BlockManager(c.kv_cache_tokens // c.block_size, c.block_size, c.max_batch_size)
        # bytes one swapped block moves (KV rows); a preemption also moves one state slot
        self.block_bytes = c.block_size * self.kv_bytes_per_token
        self.slot_bytes = state_slot_bytes(model, c.exit_criterion)
        # c.pipeline, the lookahead pipeline: the exit signal of step t decides step t+2, so a core
        # step is launched before the previous step's scores are read (Scheduler._after_core)
        self.scheduler = Scheduler(c, self.blocks, c.max_model_len, c.pipeline, c.swap_space // self.block_bytes,
                                   r_full=cfg.r_max)
        self.runner: Runner = (runner_cls or ModelRunner)(model, c.kv_layout, self.blocks, self.policy.criterion,
                                                          c.pad_pow2, c.max_batch_size, cuda_graphs=c.cuda_graphs,
                                                          attention_backend=c.attention_backend,
                                                          token_slots=c.max_launch_tokens())
        self._launch_timer: LaunchTimer | None = None
        self._virtual = self.runner.clock is not None  # the simulator's or the emulated device's runner
        if c.min_coda_batch == "auto" and c.policy == "cdb" and c.refill:
            self.scheduler.auto = AutoCoda(self.runner.padded)
            if not self._virtual and model.device.type == "cuda":
                self._launch_timer = LaunchTimer(model.device)
        # CUDA graphs: every key the scheduler can emit, captured now rather than while requests wait
        graphs = getattr(self.runner, "graphs", None)
        self.graph_capture = (graphs.capture(self.runner.graph_keys(c.policy == "cb", cfg.r_max, c.prefill == "separate"))
                              if graphs else None)
        if self.graph_capture:
            log.info("captured %d CUDA graphs in %.1f s", self.graph_capture["captured"], self.graph_capture["seconds"])
        self.seqs: dict[str, Sequence] = {}
        self._ids = itertools.count()
        self._seq_ids = itertools.count()
        self.eos_ids = frozenset(t for t in [cfg.eos_token_id, *cfg.stop_token_ids,
                                    getattr(tokenizer, "eos_token_id", None)] if t is not None)
        self.trace: list[TraceRow] = []
        # instruments around each launch (LLMEngine._launch): f(work, None) before, f(work, seconds) after
        self.on_launch: list[Callable[[Work, float | None], None]] = []
        # score_reads: stages whose exit scores the host read back (core steps; the prelude under the
        # preloop criterion, which reads each depth once and no core step's scores)
        self.stats = {"stage_calls": {}, "score_reads": {"core": 0, "prelude": 0}}
        # logits -> tokens, depths, log-probs, text, stop rules, finish (output.py); it counts what it
        # emitted (processor.stats: decode tokens, their depths, speculation)
        self.processor = OutputProcessor(Sampler(c.seed, model.device), tokenizer, cfg.r_max, c.seed)
        # on-device token re-entry (c.async_scheduling): the ids of the last stage that emitted, still on
        # the device; read after the next launch that is not a prelude (step, _resolve)
        self._unread_sample: UnreadSample | None = None

    # ------------------------------------------------------------------ requests
    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, arrival_time: float | None = None,
                    forced_output: list[int] | None = None, tracker: ExitTracker | None = None,
                    priority: int = 0) -> Sequence:
        """Validate and queue a request. Bad input raises ParamError (a ValueError naming the field)
        and changes nothing. `forced_output` teacher-forces the continuation: each token is decoded
        with the adaptive exit policy and its log-prob recorded (what lm-eval's loglikelihood needs).
        `tracker`: an exit tracker of the caller's for this request's policy instead of the
        scheduler's own (a replay forcing recorded depths, infer/sim/replay.py). `priority`
        (scheduling_policy "priority", vLLM's): lower is served sooner."""
        params = params or SamplingParams()
        cfg = self.model.cfg
        check_priority(priority, self.config.scheduling_policy)
        if forced_output is not None:
            if not forced_output:
                raise ParamError("forced_output", "forced_output must be a non-empty list of token ids")
            check_token_ids(forced_output, cfg.vocab_size, "forced_output")
            params = SamplingParams(**{**params.__dict__, "max_tokens": len(forced_output), "logprobs": True,
                                       "ignore_eos": True, "stop": [], "stop_token_ids": []})
        params.validate()
        text_prompt = prompt if isinstance(prompt, str) else None
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ParamError("prompt", "a text prompt needs a tokenizer; pass token ids or load a folder with one")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = list(prompt)
        check_prompt(ids, cfg.vocab_size, self.max_model_len)
        rid = request_id if request_id is not None else str(next(self._ids))
        if rid in self.seqs:
            raise ParamError("request_id", f"request id {rid!r} is already in use")
        policy = self.policy.override(threshold=params.exit_threshold, r_min=params.r_min, r_max=params.r_max)
        seq = Sequence(next(self._seq_ids), rid, ids, params, policy,
                       arrival_time=arrival_time if arrival_time is not None else time.perf_counter(),
                       text_prompt=text_prompt, forced=list(forced_output) if forced_output is not None else None,
                       priority=priority,
                       eos_ids=self.eos_ids, max_model_len=self.max_model_len, tracker=tracker)
        # No pool check: a request never holds more than max_model_len tokens (it stops for length
        # there), and memory.size_pool lowered max_model_len to the pool's whole blocks, so every
        # request can run alone once everything else is preempted: no deadlock, and no request is
        # refused for a max_tokens beyond the pool (vLLM's rule: max_tokens is capped, not refused).
        self.processor.add(seq)
        self.seqs[rid] = seq
        self.scheduler.add(seq)
        return seq

    def abort(self, request_id: str) -> None:
        seq = self.seqs.get(request_id)
        if seq is not None and not seq.finished:
            self.processor.finish(seq)
            self.scheduler.finish(seq, "abort")

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or self._unread_sample is not None

    # ------------------------------------------------------------------ stepping
    def step(self) -> list[Sequence]:
        """Run one stage. Returns the sequences whose new token the host learnt (or that finished)
        in it: those of this stage, or, with on-device token re-entry, those of the last stage that
        emitted (their ids are read after this launch; `_resolve`)."""
        work = self.scheduler.schedule()
        self._swap(self.scheduler.take_swaps())
        if work is None:
            return self._resolve(None, None)[0] if self._unread_sample is not None else []
        record = self._record(work) if self.config.trace else None  # sizes before the stage changes them
        out = self._timed(work) if self.scheduler.auto is not None else self._run(work)
        resolved, out = self._reenter(work, out)
        emitted = self._process(work, out)
        self._count(work, out, record)
        return resolved + emitted if resolved else emitted

    def _reenter(self, work: Work, out):
        """On-device token re-entry: the ids of the last stage that emitted are read now that the device
        has this launch queued behind it (a prelude's is too short to hide the host's output processing
        behind: the next launch, a core step, does). Returns the sequences resolved and the output."""
        if self._unread_sample is not None and work.stage is not Stage.PRELUDE:
            return self._resolve(work, out)
        return [], out

    def _process(self, work: Work, out) -> list[Sequence]:
        """The output path: a core step's exit scores (preloop: the prelude's CDFs) go to the scheduler;
        an emitting stage's logits become tokens, now or, with re-entry, one launch later (`defer`).
        Returns the sequences whose token the host learnt now."""
        if work.stage not in EMITS:
            self.scheduler.postprocess(work, scores=out)
            return []
        if self.config.async_scheduling and self.processor.can_defer(work, out):
            self._unread_sample, finished = self.processor.defer(work, out, self.runner)
            emitted: list[Sequence] = []
        else:
            finished = self.processor.process(work, out)
            emitted = work.emitting
        self.scheduler.postprocess(work, finished=finished)
        return emitted

    def _resolve(self, work: Work | None, out):
        """Read the unread sample's ids (OutputProcessor.resolve) and apply their stops: a sequence that
        stops now (a stop token or string found one launch late) leaves the scheduler, and if the
        launch just made (`work`, `out`) carried it, it leaves that stage's batch and output too,
        so its extra work is discarded exactly (it wrote only its own KV rows and state slot, which
        are freed). Returns the sequences resolved and the stage's output."""
        p, self._unread_sample = self._unread_sample, None
        finished = self.processor.resolve(p)
        if finished:
            for s in p.seqs:
                reason = finished.get(s.seq_id)
                if reason is not None:
                    self.scheduler.finish(s, reason)  # (out of its queue; a retired one gets its reason)
            if work is not None and any(s.finish_reason is not None for s in work.seqs):
                out = self._without_finished(work, out)
        return p.seqs, out

    def _without_finished(self, work: Work, out):
        """`work` and its output without the decode items that stopped after it was launched."""
        keep = [i for i, s in enumerate(work.seqs) if s.finish_reason is None]
        n = len(work.seqs)
        work.keep_decode(keep)
        if out is None or isinstance(out, SpecOut):  # (no speculation under re-entry: EngineConfig.refuse)
            return out
        if isinstance(out, Emitted):  # decode rows, then the final chunks' rows
            rows = to_device(keep + list(range(n, out.logits.shape[0])), out.logits.device)
            return Emitted(out.logits.index_select(0, rows), out.prompt_logits)
        return KeptScores(out, keep)

    def _timed(self, work: Work):
        """A launch whose cost min_coda_batch="auto" learns (auto_coda.py): a virtual runner's priced
        seconds; on a CPU the wall clock (launches are synchronous); on CUDA its events, read once
        done at a later step (LaunchTimer). Queued (AutoCoda.queue) with the exits that waited
        through it and the running sequences (Scheduler.idle)."""
        sch = self.scheduler
        idle, slots = sch.idle()
        if self._launch_timer is not None:
            out, secs = self._timed_cuda(work), None
        else:
            t0 = time.perf_counter()
            out = self._run(work)
            secs = self.runner.last_seconds if self._virtual else time.perf_counter() - t0
        sch.auto.queue(work.stage, len(work.seqs), secs, idle, slots, bool(work.chunks))
        return out

    def _timed_cuda(self, work: Work):
        """The launch between two CUDA events; the launches whose events are done are learned first
        (after those queued before them: the table learns in launch order)."""
        auto, timer = self.scheduler.auto, self._launch_timer
        done = timer.done()
        if done:
            auto.catch_up()
            for stage, n, ch, secs in done:
                auto.learn(stage, n, secs, ch)
        ev = timer.start()
        out = self._run(work)
        timer.stop(ev, work.stage, len(work.seqs), bool(work.chunks))
        return out

    def _run(self, work: Work):
        """The launch: `runner.run`, with the `on_launch` instruments around it when there are any."""
        return self._launch(work) if self.on_launch else self.runner.run(work)

    def _launch(self, work: Work):
        """`runner.run` with the instruments of `on_launch` around it: each is called with
        (work, None) before the launch and (work, host seconds of runner.run) after it."""
        for f in self.on_launch:
            f(work, None)
        t0 = time.perf_counter()
        out = self.runner.run(work)
        dt = time.perf_counter() - t0
        for f in self.on_launch:
            f(work, dt)
        return out

    def speculative_metrics(self, since: dict | None = None) -> dict:
        """Self-speculation counters (EngineConfig.speculative_tokens): speculative stages, windows of
        more than one position verified and the tokens they gave, tokens drafted / accepted /
        emitted, draft and verify launches; and the two rates. `since`: an earlier result, whose
        counts are subtracted (one benchmark pass on a reused engine). metrics() shows them as spec_*."""
        sp = {k: v - (since or {}).get(k, 0) for k, v in self.processor.stats["speculative"].items()}
        return speculative_rates(sp)

    def _swap(self, ops: list) -> None:
        """The scheduler's preemption copies, before the stage: it may write into the blocks a
        swap-out frees (the simulator's runner charges the copies' time)."""
        if ops:
            swap = getattr(self.runner, "swap", None)
            if swap is not None:
                swap(ops)

    def _count(self, work: Work, out, record: tuple[TraceRow, float] | None) -> None:
        """Stage counters (a speculative stage's own: OutputProcessor._accept), and the trace row of
        a traced stage (`record`, from `_record`; a speculative stage brings one row per launch)."""
        calls = self.stats["stage_calls"]
        name = STAGE_NAMES[work.stage]
        calls[name] = calls.get(name, 0) + 1
        reads = out is not None and work.stage not in EMITS
        if reads:
            self.stats["score_reads"][name] += 1
        if record is not None:
            if work.stage is Stage.SPEC:  # one row per launch it ran, counted by work.py as any other
                self.trace += out.rows
                return
            if self.model.device.type == "cuda":
                torch.cuda.synchronize(self.model.device)
            row, t0 = record
            row["score_reads"], row["seconds"] = int(reads), time.perf_counter() - t0
            self.trace.append(row)

    def _record(self, work: Work) -> tuple[TraceRow, float]:
        """A trace row (infer/engine/trace.py) and the stage's start time: the stage, its batch, the
        context tokens it reads, and what infer/sim/work.py counts (causal prefix rows of prompt
        positions, head rows of final chunks, the loop steps of a fused launch)."""
        prefill = work.stage is Stage.PREFILL  # (its batch: the prompts, each a chunk that ends its prompt)
        n = len(work.chunks if prefill else work.seqs)
        if prefill:
            ctx = tokens = prompt = sum(len(s.prompt_ids) for s in work.chunks)
            pairs = sum(len(s.prompt_ids) * (len(s.prompt_ids) + 1) // 2 for s in work.chunks)
        else:
            ctx, tokens, pairs = sum(s.num_tokens for s in work.seqs), n, 0
            prompt = sum(s.chunk[1] - s.chunk[0] for s in work.chunks)
        spans = [s.chunk for s in work.chunks]
        row = trace_row(work.stage.value, n, padded=n if prefill or not n else self.runner.padded(n),
                        tokens=tokens, context=ctx, prompt_tokens=prompt, chunks=len(work.chunks), context_pairs=pairs,
                        prompt_pairs=0 if prefill else sum((e - a) * a + (e - a) * (e - a + 1) // 2 for a, e in spans),
                        finals=0 if prefill else len(work.finals), r_max=work.r_max or self.model.cfg.r_max, seconds=0.0, score_reads=0)
        return row, time.perf_counter()

    # ------------------------------------------------------------------ outputs
    def output(self, s: Sequence) -> RequestOutput:
        n = s.num_resolved  # (a token whose id is still on the device is not shown yet)
        return RequestOutput(
            request_id=s.request_id, prompt_token_ids=s.prompt_ids, token_ids=s.output_ids[:n],
            exit_depths=s.exit_depths[:n], finish_reason=s.finish_reason, text=s.text,
            prompt=s.text_prompt, logprobs=list(s.logprobs) if s.params.logprobs else None,
            metrics={"arrival_time": s.arrival_time, "first_token_time": s.first_token_time,
                     "finish_time": s.finish_time, "token_times": list(s.token_times)})

    def release(self, request_id: str) -> None:
        """Forget a finished request's bookkeeping."""
        s = self.seqs.get(request_id)
        if s is not None and s.finished:
            del self.seqs[request_id]

    def started(self, request_id: str) -> bool:
        """Whether a known request has been admitted (it holds memory or produced a token)."""
        s = self.seqs.get(request_id)
        return s is not None and s.started

    def reset_prefix_cache(self) -> None:
        """Forget the cached prompt prefixes (vLLM's name): a benchmark pass that repeats the same
        requests on one engine then starts cold instead of hitting the previous pass's blocks."""
        self.blocks.reset_cache()

    @property
    def mean_exit_depth(self) -> float:
        out = self.processor.stats
        return out["depth_sum"] / max(1, out["tokens"])

    def auto_coda_metrics(self) -> dict | None:
        """What min_coda_batch="auto" decided so far (AutoCoda.describe); None under a fixed K."""
        return self.scheduler.auto.describe() if self.scheduler.auto is not None else None

    def metrics(self) -> dict:
        """Queue lengths, KV memory and token counters (what a server's /metrics shows)."""
        b = self.blocks
        auto = self.auto_coda_metrics()
        return {**(_auto_coda_gauges(auto) if auto else {}),
                "running": self.scheduler.num_running, "queues": self.scheduler.queue_lengths(),
                "kv_usage": b.usage, "kv_free_blocks": b.num_free, "kv_total_blocks": b.num_blocks,
                "kv_all_free": b.all_free, "mean_exit_depth": self.mean_exit_depth,
                "decode_tokens": self.processor.stats["tokens"],
                "stage_calls": dict(self.stats["stage_calls"]),
                "core_score_reads": self.stats["score_reads"]["core"] + self.processor.stats["spec_core_reads"],
                "prelude_score_reads": self.stats["score_reads"]["prelude"],
                **{f"spec_{k}": v for k, v in self.speculative_metrics().items()}, **self.memory_metrics()}

    def memory_metrics(self) -> dict:
        """KV pool, preemption and prefix-cache counters (swap bytes: KV blocks + one state slot per
        copy; prefix cache: prompt tokens looked up and found, vLLM's names, and cached free blocks)."""
        sch, c = self.scheduler, self.scheduler.counters
        moved = c["swapped_out_blocks"] + c["swapped_in_blocks"]
        q, h = c.get("prefix_cache_queries", 0), c.get("prefix_cache_hits", 0)
        return {"kv_pool_tokens": self.blocks.num_blocks * self.blocks.block_size,
                "kv_bytes_per_token": self.kv_bytes_per_token, "max_model_len": self.max_model_len,
                "swapped": len(sch.swapped), "stalled": len(sch.stalled), **c,
                "swap_bytes": moved * self.block_bytes + 2 * c["preemptions"] * self.slot_bytes,
                "prefix_cache_queries": q, "prefix_cache_hits": h, "prefix_cache_hit_rate": h / q if q else 0.0,
                "prefix_cache_blocks": len(self.blocks.cached), "prefix_cache_evictions": self.blocks.evictions}


def _auto_coda_gauges(d: dict) -> dict:
    """min_coda_batch="auto" in metrics(): codas run, their mean batch (the K chosen), the coda
    batch histogram, and the last decision's predicted costs (waiting vs launching, seconds)."""
    last = d["last_decision"] or {}
    return {"auto_coda_codas": d["codas"], "auto_coda_mean_k": d["mean_k"] or 0.0, "auto_coda_k_hist": d["k_hist"],
            "auto_coda_hold_s": last.get("hold_s", 0.0), "auto_coda_launch_s": last.get("launch_s", 0.0),
            "auto_coda_padding_s": last.get("padding_s", 0.0), "auto_coda_waiting": last.get("waiting", 0),
            "auto_coda_split_core_steps": d["split_core_steps"]}

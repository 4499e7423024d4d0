"""The engine: requests in, stages scheduled and run, tokens out. `step()` is schedule -> run ->
postprocess, like nano-vllm's, except that one step runs one *stage* (prefill, prelude, a core
step, coda, or CB's fused iteration)."""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

import torch

from kv_layouts import layout_class
from looplm.model import LoopedLM
from looplm.policy import ExitPolicy
from looplm.sampling import choose_token

from .block_manager import BlockManager
from .runner import ModelRunner
from .sampling import SamplingParams, find_stop
from .scheduler import Scheduler, SchedulerConfig, Work
from .sequence import Sequence, Stage


@dataclass
class EngineConfig:
    policy: str = "cdb"  # "cb" | "cdb"
    refill: bool = True
    min_coda_batch: int = 1
    kv_layout: str = "last_exited"  # "last_exited" | "full_depth" | "shared"
    max_batch_size: int = 64  # sequences running at once (= state slots)
    max_prefill_tokens: int = 2048
    kv_cache_tokens: int | None = None  # KV pool size in tokens (default: every slot can fill the context)
    kv_cache_bytes: int | None = None  # alternative budget in bytes
    block_size: int = 16
    exit_criterion: str | None = None  # default: the model config's
    exit_threshold: float | None = None
    r_min: int | None = None
    lookahead: bool = False
    full_depth: bool = False  # disable exits (also implied by kv_layout="full_depth" and policy="cb")
    pad_pow2: bool = True
    cuda_graphs: bool | None = None  # default: on for CUDA devices
    pipeline: bool | None = None  # lookahead pipeline; default: on for CUDA with lookahead
    seed: int = 0
    trace: bool = False

    def __post_init__(self) -> None:
        layout_class(self.kv_layout)  # validates the name
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")


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


class LLMEngine:
    def __init__(self, model: LoopedLM, config: EngineConfig | None = None, tokenizer=None, runner_cls=None):
        """`runner_cls` replaces ModelRunner (same constructor and methods): infer/sim.py plugs in a
        cost-model runner so that the real scheduler and engine run without the model."""
        self.model, self.tokenizer = model, tokenizer
        self.config = c = config or EngineConfig()
        cfg = model.cfg
        self.full_depth = c.full_depth or c.kv_layout == "full_depth" or c.policy == "cb"
        self.policy = ExitPolicy.from_config(cfg, criterion=c.exit_criterion, threshold=c.exit_threshold,
                                             r_min=c.r_min, lookahead=c.lookahead, full_depth=self.full_depth)
        rows = self._kv_rows(c, cfg, model.dtype)
        num_blocks = max(1, rows // c.block_size)
        self.blocks = BlockManager(num_blocks, c.block_size, c.max_batch_size)
        self.scheduler = Scheduler(SchedulerConfig(c.policy, c.refill, c.min_coda_batch, c.max_batch_size,
                                                   c.max_prefill_tokens, cfg.max_position), self.blocks)
        on_cuda = model.device.type == "cuda"
        graphs = on_cuda if c.cuda_graphs is None else c.cuda_graphs
        self.runner = (runner_cls or ModelRunner)(model, c.kv_layout, self.blocks, self.policy.criterion, c.pad_pow2, c.max_batch_size,
                                  cuda_graphs=graphs)
        # Lookahead pipeline: the exit signal of step t decides step t+2, so a core step is launched
        # before the previous step's scores are read (see _core_pipelined).
        self.pipeline = (on_cuda and c.lookahead) if c.pipeline is None else c.pipeline
        if self.pipeline and not c.lookahead:
            raise ValueError("pipeline=True needs lookahead=True (the exit signal must come one step early)")
        self._pending = None  # (items, PendingScores) of the last launched core step
        self.seqs: dict[str, Sequence] = {}
        self._ids = itertools.count()
        self._seq_ids = itertools.count()
        self.eos_ids = {t for t in [cfg.eos_token_id, *cfg.stop_token_ids,
                                    getattr(tokenizer, "eos_token_id", None)] if t is not None}
        self.trace: list[dict] = []
        self.stats = {"tokens": 0, "depth_sum": 0, "stage_calls": {}}

    @staticmethod
    def _kv_rows(c: EngineConfig, cfg, dtype) -> int:
        if c.kv_cache_tokens is not None:
            return int(c.kv_cache_tokens)
        if c.kv_cache_bytes is not None:
            return int(c.kv_cache_bytes) // layout_class(c.kv_layout).bytes_per_row(cfg, dtype)
        return c.max_batch_size * cfg.max_position

    # ------------------------------------------------------------------ requests
    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, arrival_time: float | None = None,
                    forced_output: list[int] | None = None) -> Sequence:
        """Validate and queue a request. Bad input raises ValueError and changes nothing.
        `forced_output` teacher-forces the continuation: each token is decoded with the adaptive
        exit policy and its log-prob recorded (what lm-eval's loglikelihood needs)."""
        params = params or SamplingParams()
        if forced_output is not None:
            if not forced_output or not all(isinstance(t, int) and 0 <= t < self.model.cfg.vocab_size
                                            for t in forced_output):
                raise ValueError("forced_output must be a non-empty list of token ids in the vocabulary")
            params = SamplingParams(**{**params.__dict__, "max_tokens": len(forced_output), "logprobs": True,
                                       "ignore_eos": True, "stop": [], "stop_token_ids": []})
        params.validate()
        cfg = self.model.cfg
        text_prompt = prompt if isinstance(prompt, str) else None
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("a text prompt needs a tokenizer; pass token ids or load a folder with one")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = list(prompt)
        if not ids:
            raise ValueError("prompt is empty")
        if not all(isinstance(t, int) and 0 <= t < cfg.vocab_size for t in ids):
            bad = next(t for t in ids if not (isinstance(t, int) and 0 <= t < cfg.vocab_size))
            raise ValueError(f"prompt has token id {bad!r} outside the vocabulary [0, {cfg.vocab_size})")
        if len(ids) >= cfg.max_position:
            raise ValueError(f"prompt of {len(ids)} tokens does not fit the model's context of "
                             f"{cfg.max_position} tokens (at least one position must remain for the output)")
        rid = request_id if request_id is not None else str(next(self._ids))
        if rid in self.seqs:
            raise ValueError(f"request id {rid!r} is already in use")
        policy = self._policy_for(params)
        seq = Sequence(next(self._seq_ids), rid, ids, params, policy,
                       arrival_time=arrival_time if arrival_time is not None else time.perf_counter())
        need = self.blocks.blocks_for(seq.reserved_tokens(cfg.max_position))
        if need > self.blocks.num_blocks:
            raise ValueError(f"request needs {need * self.blocks.block_size} KV tokens, more than the whole pool "
                             f"({self.blocks.num_blocks * self.blocks.block_size}); lower max_tokens or raise "
                             f"kv_cache_tokens")
        seq.text_prompt = text_prompt
        seq.forced = list(forced_output) if forced_output is not None else None
        seq.generator = torch.Generator().manual_seed(params.seed if params.seed is not None
                                                      else self.config.seed * 1_000_003 + seq.seq_id)
        self.seqs[rid] = seq
        self.scheduler.add(seq)
        return seq

    def _policy_for(self, p: SamplingParams) -> ExitPolicy:
        base = self.policy
        if p.exit_threshold is None and p.r_min is None and p.r_max is None:
            return base
        r_max = base.r_max if p.r_max is None else p.r_max
        if r_max > self.model.cfg.r_max:
            raise ValueError(f"invalid sampling parameter r_max: {r_max} exceeds the model's r_max "
                             f"{self.model.cfg.r_max}")
        if self.full_depth:
            return ExitPolicy("none", None, r_max, r_max)
        r_min = min(base.r_min if p.r_min is None else p.r_min, r_max)
        thr = base.threshold if p.exit_threshold is None else float(p.exit_threshold)
        return ExitPolicy(base.criterion, thr, r_min, r_max, base.lookahead)

    def abort(self, request_id: str) -> None:
        seq = self.seqs.get(request_id)
        if seq is not None and not seq.finished:
            self._finish(seq, "abort")

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    # ------------------------------------------------------------------ stepping
    def step(self) -> list[Sequence]:
        """Run one stage. Returns the sequences that produced a token (or finished) in it."""
        work = self.scheduler.schedule()
        if work is None:
            return []
        t0 = time.perf_counter()
        out = self._run(work)
        if self.config.trace:
            if self.model.device.type == "cuda":
                torch.cuda.synchronize()
            self._record(work, time.perf_counter() - t0)
        return out

    def _run(self, work: Work) -> list[Sequence]:
        r, sch, seqs = self.runner, self.scheduler, work.seqs
        calls = self.stats["stage_calls"]
        calls[work.stage] = calls.get(work.stage, 0) + 1
        if work.stage == "prefill":
            logits = r.prefill(seqs)
            return self._emit(seqs, logits, [self.model.cfg.r_max] * len(seqs), decode=False)
        if work.stage == "prelude":
            r.prelude(seqs)
            sch.after_prelude(seqs)
            return []
        if work.stage == "core":
            exited = self._core_pipelined(seqs) if self.pipeline else sch.after_core(seqs, r.core(seqs))
            if exited:
                r.mark_exited(exited)
            return []
        if work.stage == "coda":
            logits = r.coda(seqs)
            sch.after_coda(seqs)
            return self._emit(seqs, logits, [s.step for s in seqs])
        if work.stage == "fused":
            r_maxes = {s.policy.r_max for s in seqs}
            if len(r_maxes) > 1:  # CB runs one depth per iteration: split by requested r_max
                out = []
                for d in sorted(r_maxes):
                    out += self._run(Work("fused", [s for s in seqs if s.policy.r_max == d]))
                return out
            d = r_maxes.pop()
            logits = r.fused(seqs, d)
            sch.after_coda(seqs)
            return self._emit(seqs, logits, [d] * len(seqs))
        raise AssertionError(work.stage)

    def _core_pipelined(self, seqs: list[Sequence]) -> list[Sequence]:
        """Launch step t, then read step t-1's scores while t runs. With lookahead the scores of
        t-1 already decide who exits after t, so the device never waits for the host's decision;
        the decisions equal the synchronous path's (same tracker calls in the same order)."""
        launched = self.runner.core_async(seqs)
        prev, self._pending = self._pending, (seqs, launched)
        if prev is not None:
            items, pending = prev
            for s, score in zip(items, pending.get()):
                if s.stage is Stage.CORE and s.step_scored < s.step:
                    s.tracker.after_step(s.step, score)
                    s.step_scored = s.step
        for s in seqs:
            s.step += 1
        return self.scheduler.take_exited(seqs)

    def _emit(self, seqs: list[Sequence], logits: torch.Tensor, depths: list[int], decode: bool = True
              ) -> list[Sequence]:
        """Sample the next token of each sequence, check its stop conditions, queue the rest."""
        greedy = logits.argmax(-1).tolist()
        need_lp = any(s.params.logprobs for s in seqs)
        logp = torch.log_softmax(logits.double(), -1) if need_lp else None
        now = time.perf_counter()
        cont = []
        for i, (s, d) in enumerate(zip(seqs, depths)):
            p = s.params
            if s.forced is not None:
                tok = s.forced[len(s.output_ids)]
                s.forced_greedy = s.forced_greedy and tok == greedy[i]
            elif p.temperature == 0:
                tok = greedy[i]
            else:
                tok = choose_token(logits[i], p.temperature, p.top_k, p.top_p, s.generator)
            s.output_ids.append(tok)
            s.exit_depths.append(d)
            s.token_times.append(now)
            if s.first_token_time is None:
                s.first_token_time = now
            if logp is not None and p.logprobs:
                s.logprobs.append(float(logp[i, tok]))
            if decode:  # the prefill's token is at full depth by design: keep it out of the mean
                self.stats["tokens"] += 1
                self.stats["depth_sum"] += d
            reason = self._stop_reason(s, tok)
            if reason:
                self._finish(s, reason)
            else:
                cont.append(s)
        self.scheduler.to_prelude(cont)
        return seqs

    def _stop_reason(self, s: Sequence, tok: int) -> str | None:
        p = s.params
        if tok in p.stop_token_ids or (not p.ignore_eos and tok in self.eos_ids):
            return "stop"
        if self.tokenizer is not None:
            s.text = self.tokenizer.decode(s.output_ids, skip_special_tokens=True)
            if p.stop:
                i = find_stop(s.text, p.stop, s.stop_checked)
                s.stop_checked = len(s.text)
                if i != -1:
                    s.text = s.text[:i]
                    return "stop"
        if len(s.output_ids) >= p.max_tokens or s.num_tokens >= self.model.cfg.max_position:
            return "length"
        return None

    def _finish(self, s: Sequence, reason: str) -> None:
        s.finish_reason = reason
        s.finish_time = time.perf_counter()
        self.scheduler.remove(s)

    def _record(self, work: Work, seconds: float) -> None:
        n = len(work.seqs)
        if work.stage == "prefill":
            ctx = sum(len(s.prompt_ids) for s in work.seqs)
            tokens = ctx
        else:
            ctx = sum(s.num_tokens for s in work.seqs)
            tokens = n
        self.trace.append({"stage": work.stage, "batch": n, "padded": self.runner.padded(n) if work.stage != "prefill"
                           else n, "tokens": tokens, "context": ctx, "seconds": seconds})

    # ------------------------------------------------------------------ outputs
    def output(self, s: Sequence) -> RequestOutput:
        return RequestOutput(
            request_id=s.request_id, prompt_token_ids=s.prompt_ids, token_ids=list(s.output_ids),
            exit_depths=list(s.exit_depths), finish_reason=s.finish_reason, text=s.text,
            prompt=getattr(s, "text_prompt", None), logprobs=list(s.logprobs) if s.params.logprobs else None,
            metrics={"arrival_time": s.arrival_time, "first_token_time": s.first_token_time,
                     "finish_time": s.finish_time, "token_times": list(s.token_times)})

    def release(self, request_id: str) -> None:
        """Forget a finished request's bookkeeping."""
        s = self.seqs.get(request_id)
        if s is not None and s.finished:
            del self.seqs[request_id]

    @property
    def mean_exit_depth(self) -> float:
        return self.stats["depth_sum"] / max(1, self.stats["tokens"])

    def kv_usage(self) -> float:
        return self.blocks.usage

    def queue_lengths(self) -> dict[str, int]:
        return self.scheduler.queue_lengths()

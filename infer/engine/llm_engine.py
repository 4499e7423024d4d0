"""The engine: requests in, stages scheduled and run, tokens out. `step()` is schedule -> run ->
postprocess, like nano-vllm's, except that one step runs one *stage* (a prefill, a prelude, one
core step, a coda, or CB's fused iteration): the scheduler picks the stage and its batch, the
runner runs it, the engine samples a token for each sequence of a stage that ends in logits and
checks its stop conditions, and the scheduler applies the outcome to its queues."""
from __future__ import annotations

import dataclasses
import itertools
import time
from dataclasses import dataclass, field
from operator import attrgetter

import torch

from looplm.errors import ParamError
from looplm.model import LoopedLM

from .block_manager import BlockManager
from .config import EngineConfig
from .memory import fit_model_len, pool_blocks, state_slot_bytes
from .detokenizer import IncrementalDetokenizer
from .runner import ModelRunner, Runner
from .sampler import Sampler
from .sampling import SamplingParams, find_stop
from .scheduler import Scheduler, Work
from .sequence import Sequence, Stage


_step = attrgetter("step")
STAGE_NAMES = {s: s.value for s in Stage}  # (Enum.value is a descriptor call: this runs once per stage)
EMITS = frozenset(s for s in Stage if s.emits)


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


def top_logprobs(logp: torch.Tensor, k: int, tok: int) -> dict[int, float]:
    """The k most likely tokens of one position's log-probs [V], plus the chosen token (vLLM's rule)."""
    vals, ids = logp.topk(min(k, logp.shape[-1])) if k else (logp[:0], logp[:0].long())
    out = dict(zip(ids.tolist(), vals.tolist()))
    out.setdefault(tok, float(logp[tok]))
    return out


def prompt_logprobs(s: Sequence) -> None:
    """The prompt's log-probs from the prefill's logits at every position (vLLM's prompt_logprobs):
    token j > 0 is scored by position j-1's logits; the first token has none."""
    logp = torch.log_softmax(s.prompt_logits.double(), -1)
    ids, k = s.prompt_ids, s.params.prompt_logprobs
    s.prompt_logprobs = [None] + logp[torch.arange(len(ids) - 1), torch.tensor(ids[1:], dtype=torch.long)].tolist()
    s.prompt_top_logprobs = [None] + [top_logprobs(logp[j], k, ids[j + 1]) for j in range(len(ids) - 1)]
    s.prompt_logits = None  # [L, V] is large: keep only the numbers asked for


class LLMEngine:
    def __init__(self, model: LoopedLM, config: EngineConfig | None = None, tokenizer=None, runner_cls=None):
        """`config` settings left at None come from the checkpoint (EngineConfig.resolve).
        `runner_cls` replaces ModelRunner (same constructor, a `Runner`): the simulator plugs in a
        cost-model runner so that the real scheduler and engine run without the model."""
        self.model, self.tokenizer = model, tokenizer
        cfg = model.cfg
        self.config = c = (config or EngineConfig()).resolve(cfg)
        self.policy = c.exit_policy(cfg)
        num_blocks, knob, self.kv_bytes_per_token = pool_blocks(model, c)
        self.config = c = dataclasses.replace(c, max_model_len=fit_model_len(c, num_blocks * c.block_size, knob))
        self.max_model_len = c.max_model_len
        self.blocks = BlockManager(num_blocks, c.block_size, c.max_batch_size)
        # bytes one swapped block moves (KV rows); a preemption also moves one state slot
        self.block_bytes = c.block_size * self.kv_bytes_per_token
        self.slot_bytes = state_slot_bytes(model, c.exit_criterion)
        on_cuda = model.device.type == "cuda"
        # Lookahead pipeline: the exit signal of step t decides step t+2, so a core step is launched
        # before the previous step's scores are read (Scheduler._after_core).
        self.pipeline = (on_cuda and c.lookahead) if c.pipeline is None else c.pipeline
        if self.pipeline and not c.lookahead:
            raise ParamError("pipeline", "pipeline=True needs lookahead=True (the exit signal must come one step "
                                         "early)")
        swap_blocks = None if c.swap_space is None else c.swap_space // self.block_bytes
        self.scheduler = Scheduler(c, self.blocks, c.max_model_len, self.pipeline, swap_blocks, r_full=cfg.r_max)
        graphs = on_cuda if c.cuda_graphs is None else c.cuda_graphs
        self.runner: Runner = (runner_cls or ModelRunner)(model, c.kv_layout, self.blocks, self.policy.criterion,
                                                          c.pad_pow2, c.max_batch_size, cuda_graphs=graphs)
        self.sampler = Sampler(c.seed, model.device)
        self._detok: dict[int, IncrementalDetokenizer] = {}  # by seq_id, while a request decodes
        self._sampling: set[int] = set()  # seq_ids of the unfinished requests that sample (Sequence.sampled)
        self.seqs: dict[str, Sequence] = {}
        self._ids = itertools.count()
        self._seq_ids = itertools.count()
        self.eos_ids = {t for t in [cfg.eos_token_id, *cfg.stop_token_ids,
                                    getattr(tokenizer, "eos_token_id", None)] if t is not None}
        self.trace: list[dict] = []
        self.stats = {"tokens": 0, "depth_sum": 0, "stage_calls": {}}

    # ------------------------------------------------------------------ requests
    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, arrival_time: float | None = None,
                    forced_output: list[int] | None = None) -> Sequence:
        """Validate and queue a request. Bad input raises ParamError (a ValueError naming the field)
        and changes nothing. `forced_output` teacher-forces the continuation: each token is decoded
        with the adaptive exit policy and its log-prob recorded (what lm-eval's loglikelihood needs)."""
        params = params or SamplingParams()
        cfg = self.model.cfg
        if forced_output is not None:
            if not forced_output or not all(isinstance(t, int) and 0 <= t < cfg.vocab_size for t in forced_output):
                raise ParamError("forced_output", "forced_output must be a non-empty list of token ids in the "
                                                  "vocabulary")
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
        if not ids:
            raise ParamError("prompt", "prompt is empty")
        bad = [t for t in ids if not (isinstance(t, int) and 0 <= t < cfg.vocab_size)]
        if bad:
            raise ParamError("prompt", f"prompt has token id {bad[0]!r} outside the vocabulary [0, {cfg.vocab_size})")
        if len(ids) >= self.max_model_len:
            raise ParamError("prompt", f"prompt of {len(ids)} tokens does not fit the model's context of "
                                       f"{self.max_model_len} tokens (max_model_len; at least one position must "
                                       f"remain for the output)")
        rid = request_id if request_id is not None else str(next(self._ids))
        if rid in self.seqs:
            raise ParamError("request_id", f"request id {rid!r} is already in use")
        policy = self.policy.override(threshold=params.exit_threshold, r_min=params.r_min, r_max=params.r_max)
        seq = Sequence(next(self._seq_ids), rid, ids, params, policy,
                       arrival_time=arrival_time if arrival_time is not None else time.perf_counter())
        # the pool must hold the whole request (prompt + max_tokens, capped by the checkpoint's
        # context) so that it can run alone once everything else is preempted: no deadlock
        need = self.blocks.blocks_for(seq.reserved_tokens(cfg.max_position))
        if need > self.blocks.num_blocks:
            raise ParamError("max_tokens", f"request needs {need * self.blocks.block_size} KV tokens, more than the "
                                           f"whole pool ({self.blocks.num_blocks * self.blocks.block_size}); lower "
                                           f"max_tokens or raise kv_cache_tokens / kv_cache_memory")
        seq.text_prompt = text_prompt
        seq.forced = list(forced_output) if forced_output is not None else None
        # what _emit's call-free path checks per token (the same rules as _stop_reason)
        seq.stop_ids = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else frozenset(self.eos_ids))
        seq.max_out = min(params.max_tokens, self.max_model_len - len(ids))
        seq.simple = (seq.forced is None and not params.logprobs and params.prompt_logprobs is None
                      and self.tokenizer is None)
        seq.sampled = params.temperature > 0 and seq.forced is None
        seq.generator = torch.Generator().manual_seed(params.seed if params.seed is not None
                                                      else self.config.seed * 1_000_003 + seq.seq_id)
        self.seqs[rid] = seq
        if seq.sampled:
            self._sampling.add(seq.seq_id)
        self.scheduler.add(seq)
        return seq

    def abort(self, request_id: str) -> None:
        seq = self.seqs.get(request_id)
        if seq is not None and not seq.finished:
            seq.finish_time = time.perf_counter()
            self.scheduler.finish(seq, "abort")
            self._detok.pop(seq.seq_id, None)
            self._sampling.discard(seq.seq_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    # ------------------------------------------------------------------ stepping
    def step(self) -> list[Sequence]:
        """Run one stage. Returns the sequences that produced a token (or finished) in it."""
        work = self.scheduler.schedule()
        ops = self.scheduler.take_swaps()
        if ops:  # before the stage: it may write into the blocks a swap-out frees
            swap = getattr(self.runner, "swap", None)  # the simulator's runner charges the copies' time
            if swap is not None:
                swap(ops)
        if work is None:
            return []
        record = self._record(work) if self.config.trace else None  # sizes before the stage changes them
        t0 = time.perf_counter()
        out = self.runner.run(work)
        stage = work.stage
        emits = stage in EMITS
        if emits:
            finished = self._emit(work, out)
            self.scheduler.postprocess(work, finished=finished)
            if finished and self._sampling:
                self._sampling.difference_update(finished)
        else:
            self.scheduler.postprocess(work, scores=out)
        calls = self.stats["stage_calls"]
        name = STAGE_NAMES[stage]
        calls[name] = calls.get(name, 0) + 1
        if record is not None:
            if self.model.device.type == "cuda":
                torch.cuda.synchronize()
            record["seconds"] = time.perf_counter() - t0
            self.trace.append(record)
        if not emits:
            return []
        return work.seqs + work.finals if work.finals else work.seqs

    def _emit(self, work: Work, logits: torch.Tensor) -> dict[int, str]:
        """Sample the next token of each sequence and check its stop conditions; returns the finish
        reason of each sequence (by seq_id) that stops. A decode item with nothing beyond a token,
        its depth and the length / stop-id checks (`Sequence.simple`) takes a call-free path: this
        loop runs once per item per coda."""
        seqs = work.seqs + work.finals  # finals: prompt chunks whose first token this launch samples
        chosen = self.sampler(logits, seqs, bool(self._sampling))  # one batched call, one device-to-host copy
        now = time.perf_counter()
        n_decode = 0 if work.stage is Stage.PREFILL else len(work.seqs)  # the prefill's tokens: full depth
        fused = work.r_max if work.stage is Stage.FUSED else 0
        finished: dict[int, str] = {}
        decode = work.seqs if n_decode else ()
        other = False  # a decode item that is not `simple`: it goes through _emit_one below
        for s, tok in zip(decode, chosen):
            if s.simple:
                out = s.output_ids
                out.append(tok)
                s.exit_depths.append(fused or s.step)
                s.token_times.append(now)
                if tok in s.stop_ids or len(out) >= s.max_out:
                    finished[s.seq_id] = "stop" if tok in s.stop_ids else "length"
                    s.finish_time = now
            else:
                other = True
        # (row, exit depth) of every other row; the first tokens of prompt chunks come from full depth
        slow = [(i, fused or s.step) for i, s in enumerate(decode) if not s.simple] if other else []
        r_full = self.model.cfg.r_max
        slow += ((i, r_full) for i in range(n_decode, len(seqs)))
        if slow:
            need_lp = any(seqs[i].params.logprobs for i, _ in slow)
            logp = torch.log_softmax(logits.double(), -1) if need_lp else None
            for i, d in slow:
                chosen[i] = self._emit_one(seqs[i], chosen[i], d, i, logp, now, finished)
        self.stats["tokens"] += n_decode  # the prefill's full-depth token stays out of the mean exit depth
        if n_decode:  # (summed in C, not in the loop above)
            self.stats["depth_sum"] += fused * n_decode if fused else sum(map(_step, work.seqs))
        return finished

    def _emit_one(self, s: Sequence, tok: int, d: int, i: int, logp: torch.Tensor | None, now: float,
                  finished: dict[int, str]) -> int:
        """One row of `_emit` with everything a request may ask for; returns the token it emitted."""
        p = s.params
        if s.forced is not None:  # the sampler gave the argmax: was the forced token the greedy one?
            forced = s.forced[len(s.output_ids)]
            s.forced_greedy = s.forced_greedy and tok == forced
            tok = forced
        s.output_ids.append(tok)
        s.exit_depths.append(d)
        s.token_times.append(now)
        if s.first_token_time is None:
            s.first_token_time = now
        if logp is not None and p.logprobs:
            s.logprobs.append(float(logp[i, tok]))
            if p.top_logprobs:
                s.top_logprobs.append(top_logprobs(logp[i], p.top_logprobs, tok))
        if s.prompt_logits is not None:
            prompt_logprobs(s)
        reason = self._stop_reason(s, tok)
        if reason:
            finished[s.seq_id] = reason
            s.finish_time = now
        return tok

    def _stop_reason(self, s: Sequence, tok: int) -> str | None:
        p = s.params
        detok = self._detok.get(s.seq_id)
        if detok is None and self.tokenizer is not None:
            detok = self._detok[s.seq_id] = IncrementalDetokenizer(self.tokenizer)
        reason = None
        if tok in p.stop_token_ids or (not p.ignore_eos and tok in self.eos_ids):
            reason = "stop"
            if detok is not None:  # the text ends before the stop token
                s.text = detok.finish(s.output_ids[:-1])
        elif detok is not None:
            s.text = detok.update(s.output_ids)
            if p.stop:  # only the new tail can complete a stop string (find_stop starts near stop_checked)
                i = find_stop(s.text, p.stop, s.stop_checked)
                s.stop_checked = len(s.text)
                if i != -1:
                    s.text, reason = s.text[:i], "stop"
        if reason is None and (len(s.output_ids) >= p.max_tokens or s.num_tokens >= self.max_model_len):
            reason = "length"
            if detok is not None:
                s.text = detok.finish(s.output_ids)
        if reason is not None:
            self._detok.pop(s.seq_id, None)
        return reason

    def _record(self, work: Work) -> dict:
        """A trace row: the stage, its batch, and the context tokens it reads."""
        n = len(work.seqs)
        if work.stage is Stage.PREFILL:
            ctx = tokens = prompt = sum(len(s.prompt_ids) for s in work.seqs)
        else:
            ctx, tokens = sum(s.num_tokens for s in work.seqs), n
            prompt = sum(s.chunk[1] - s.chunk[0] for s in work.chunks)
        return {"stage": work.stage.value, "batch": n,
                "padded": n if work.stage is Stage.PREFILL or not n else self.runner.padded(n), "tokens": tokens,
                "context": ctx, "prompt_tokens": prompt, "chunks": len(work.chunks) if work.chunks else
                (n if work.stage is Stage.PREFILL else 0)}

    # ------------------------------------------------------------------ outputs
    def output(self, s: Sequence) -> RequestOutput:
        return RequestOutput(
            request_id=s.request_id, prompt_token_ids=s.prompt_ids, token_ids=list(s.output_ids),
            exit_depths=list(s.exit_depths), finish_reason=s.finish_reason, text=s.text,
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
        return self.stats["depth_sum"] / max(1, self.stats["tokens"])

    def metrics(self) -> dict:
        """Queue lengths, KV memory and token counters (what a server's /metrics shows)."""
        b = self.blocks
        return {"running": self.scheduler.num_running, "queues": self.scheduler.queue_lengths(),
                "kv_usage": b.usage, "kv_free_blocks": b.num_free, "kv_total_blocks": b.num_blocks,
                "kv_all_free": b.all_free, "mean_exit_depth": self.mean_exit_depth, "decode_tokens": self.stats["tokens"],
                "stage_calls": dict(self.stats["stage_calls"]), **self.memory_metrics()}

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

"""An asyncio front for the single-threaded `LLMEngine`.

One engine thread owns the engine (and the tokenizer): it drains a command queue (add, abort),
runs one stage with `step()`, and hands each request's new tokens to the event loop as a `Delta`.
The event loop never touches the engine, so the HTTP side stays responsive while a stage runs.

Failure isolation: an error while turning one request's tokens into a `Delta` fails that request
only; an error inside `step()` (which runs a whole batch) fails the requests that were running and
the engine thread keeps serving the rest of the queue.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
import traceback
import uuid
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import torch

from looplm.errors import ParamError
from infer.engine.llm_engine import LLMEngine
from infer.engine.sampling_params import SamplingParams, check_prompt, context_exceeded
from infer.engine.sequence import Sequence
from infer.sim import replay as RP

from .histograms import RequestHistograms
from .protocol import APIError, end_of_turn_ids, render_chat

log = logging.getLogger("infer.serve")


@dataclass
class Delta:
    """What one request gained since its previous delta."""
    token_ids: list[int]
    exit_depths: list[int]
    text: str = ""  # new text; held back near a possible stop string or a partial UTF-8 character
    logprobs: list[float] | None = None
    tokens: list[str] | None = None  # token strings (with logprobs)
    finish_reason: str | None = None
    error: str | None = None  # the request failed; the stream ends here
    top: list[dict[str, float]] | None = None  # per token: the top_logprobs alternatives (+ the token)
    prompt: dict | None = None  # echo (first delta only): text, token_ids, tokens, logprobs, top

    @property
    def done(self) -> bool:
        return self.finish_reason is not None or self.error is not None


@dataclass
class RequestStream:
    request_id: str
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    prompt_tokens: int = 0
    finished: bool = False
    interval: int = 1  # --stream-interval: tokens per delta after the first (the last may have fewer)
    started: bool = False  # a delta with tokens went out: the first goes at once (clients time TTFT by it)

    async def next(self) -> Delta:
        """The next delta, merged with any others already queued (one SSE chunk under backpressure),
        and, after the first token, with later ones until it holds `interval` tokens or ends: each
        chunk costs host CPU (JSON, HTTP, and under Ray a Serve object per hop) whatever it holds."""
        d = await self.queue.get()
        while not d.done and (not self.queue.empty() or (self.started and len(d.token_ids) < self.interval)):
            d = merge(d, self.queue.get_nowait() if not self.queue.empty() else await self.queue.get())
        self.started = self.started or bool(d.token_ids)
        if d.done:
            self.finished = True
        return d


def merge(a: Delta, b: Delta) -> Delta:
    return Delta(a.token_ids + b.token_ids, a.exit_depths + b.exit_depths, a.text + b.text,
                 None if a.logprobs is None else a.logprobs + (b.logprobs or []),
                 None if a.tokens is None else a.tokens + (b.tokens or []), b.finish_reason, b.error,
                 None if a.top is None else a.top + (b.top or []), a.prompt or b.prompt)


class Overloaded(Exception):
    """The waiting queue is full or the server is shutting down (HTTP 503)."""


@dataclass
class _Pub:  # per-request publishing state (engine thread)
    sent_tokens: int = 0
    sent_chars: int = 0
    holdback: int = 0
    echo_text: str | None = None  # echo: the whole prompt's text


class AsyncEngine:
    # record_exits: the file is rewritten after this many more finished requests (and at shutdown)
    RECORD_EVERY = 64

    def __init__(self, engine: LLMEngine, max_waiting: int = 256, rate_window_s: float = 10.0,
                 stream_interval: int = 1, record_exits: Path | None = None, model_name: str = "server"):
        """`record_exits`: write the exit scores of every request that finishes (the recorded-exits
        format, infer/sim/replay.py, one workload "server") for `python -m infer.sim --replay-exits`."""
        if not isinstance(stream_interval, int) or stream_interval < 1:
            raise ValueError(f"stream_interval must be an integer >= 1 (tokens per streamed chunk), "
                             f"got {stream_interval!r}")
        self.engine, self.tokenizer = engine, engine.tokenizer
        self.stream_interval = stream_interval
        # the one context length of every layer: the checkpoint's context capped by what the KV pool
        # holds (resolved once by the engine); prompt checks and default max_tokens use it
        self.max_model_len = engine.max_model_len
        self.max_waiting = max_waiting
        self.rate_window_s = rate_window_s
        self.chat_stop_ids = end_of_turn_ids(self.tokenizer)
        self.loop: asyncio.AbstractEventLoop | None = None
        self.streams: dict[str, RequestStream] = {}  # event-loop side
        self.not_started: set[str] = set()  # accepted, no token yet (event-loop side): the waiting queue
        self._cmds: deque = deque()
        self._wake = threading.Event()
        self._stop = False
        self._thread: threading.Thread | None = None
        self._pub: dict[str, _Pub] = {}  # engine-thread side
        self.closing = False
        self.counters = {"requests_finished": {}, "requests_failed": 0, "requests_rejected": 0, "requests_aborted": 0,
                         "prompt_tokens": 0, "generation_tokens": 0, "step_errors": 0}
        self.snapshot: dict = {}
        self.histograms = RequestHistograms(engine.max_model_len)  # vLLM's request histograms
        self.record_path, self.model_name = (Path(record_exits) if record_exits else None), model_name
        self.recorded: list[dict] = []  # engine-thread side
        self._hists = self.histograms.copy()
        self._rate: deque = deque()  # (time, generated tokens so far)
        self._publish_snapshot()

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    async def shutdown(self) -> None:
        """Abort whatever is still in flight and stop the engine thread (after uvicorn drained)."""
        self.closing = True
        for rid, stream in list(self.streams.items()):
            self.abort(rid)
            stream.queue.put_nowait(Delta([], [], error="the server is shutting down"))
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 30)

    # ------------------------------------------------------------------ requests (event loop)
    async def add(self, prompt: str | list[int] | None, params: dict, *, messages: list[dict] | None = None,
                  max_tokens_given: bool = True, teacher_force: bool = False) -> RequestStream:
        """Queue a request. Raises APIError (400) on bad input, Overloaded (503) when full.
        Without `max_tokens_given`, max_tokens becomes the rest of max_model_len after the prompt
        (vLLM's default), capped by params["max_tokens"] when that is set (completions: 16).
        `teacher_force`: score the prompt instead (its first token is prefilled, the others are
        forced outputs decoded through the exit policy); the stream's tokens are prompt[1:]."""
        if self.closing or not self.alive:
            raise Overloaded("the server is shutting down")
        if len(self.not_started) >= self.max_waiting:
            self.counters["requests_rejected"] += 1
            raise Overloaded(f"the server is at capacity: {len(self.not_started)} requests are already waiting "
                             f"for a free slot / KV memory (limit --max-waiting {self.max_waiting}); retry later")
        rid = uuid.uuid4().hex
        stream = RequestStream(rid, interval=self.stream_interval)
        fut = self.loop.create_future()
        self.streams[rid] = stream
        self.not_started.add(rid)
        self._cmds.append(("add", rid, prompt, messages, (params, teacher_force), max_tokens_given, fut,
                           time.perf_counter()))
        self._wake.set()
        try:
            stream.prompt_tokens = await fut
        except BaseException:
            self.abort(rid)  # rejected (a no-op then) or cancelled while queued (the engine may have added it)
            raise
        return stream

    def abort(self, rid: str) -> None:
        """Stop a request and free its KV (no-op if it already finished). Safe from the event loop."""
        if self.streams.pop(rid, None) is not None or rid in self.not_started:
            self.not_started.discard(rid)
            self._cmds.append(("abort", rid))
            self._wake.set()

    def _deliver(self, items: list[tuple[str, Delta]]) -> None:  # runs on the event loop
        for rid, d in items:
            self.not_started.discard(rid)
            stream = self.streams.get(rid)
            if stream is None:
                continue
            stream.queue.put_nowait(d)
            if d.done:
                del self.streams[rid]

    # ------------------------------------------------------------------ engine thread
    def _run(self) -> None:
        with torch.inference_mode():
            while not self._stop:
                self._wake.clear()
                self._drain()
                if self.engine.has_unfinished():
                    self._step()
                else:
                    self._publish_snapshot()
                    self._wake.wait(0.25)
            self._drain()
            for rid in list(self._pub):  # stop: free everything that is left
                self.counters["requests_aborted"] += 1
                self.engine.abort(rid)
                self.engine.release(rid)
            self._pub.clear()
            self._publish_snapshot()
            self.write_recorded()

    def _drain(self) -> None:
        while self._cmds:
            cmd = self._cmds.popleft()
            if cmd[0] == "abort":
                rid = cmd[1]
                if rid in self._pub:
                    self.counters["requests_aborted"] += 1
                    self.engine.abort(rid)
                    self.engine.release(rid)
                    del self._pub[rid]
                continue
            _, rid, prompt, messages, params, given, fut, arrival = cmd
            try:
                n = self._add(rid, prompt, messages, params, given, arrival)
            except Exception as e:  # noqa: BLE001 - reported to the caller, the thread keeps going
                err = e if isinstance(e, APIError) else APIError(
                    500, f"internal error while adding the request: {type(e).__name__}: {e}",
                    type_="internal_server_error")
                if not isinstance(e, APIError):
                    log.error("add failed: %s", traceback.format_exc())
                self._resolve(fut, exc=err)
            else:
                self._resolve(fut, result=n)

    def _resolve(self, fut: asyncio.Future, result=None, exc: BaseException | None = None) -> None:
        def set_():
            if not fut.done():
                fut.set_exception(exc) if exc is not None else fut.set_result(result)
        self.loop.call_soon_threadsafe(set_)

    def _add(self, rid: str, prompt, messages, params_tf: tuple[dict, bool], given: bool, arrival: float) -> int:
        (params, teacher_force), tok, field_ = params_tf, self.tokenizer, "prompt"
        if messages is not None:
            field_ = "messages"
            if tok is None:
                raise APIError(400, "this model has no tokenizer, so chat is unavailable; send token ids to "
                                    "/v1/completions", "messages")
            prompt = render_chat(messages, tok)
            ids = tok.encode(prompt, add_special_tokens=False)
            if not params["ignore_eos"]:  # the template's end-of-turn ids are EOS ids (vLLM: ignore_eos drops them)
                params = {**params, "stop_token_ids": params["stop_token_ids"] + self.chat_stop_ids}
        elif isinstance(prompt, str):
            if tok is None:
                raise APIError(400, "this model has no tokenizer: send the prompt as an array of token ids", "prompt")
            ids = tok.encode(prompt)
        else:
            ids = list(prompt)
        if params["stop"] and tok is None:
            raise APIError(400, "stop strings need a tokenizer, which this model lacks; use stop_token_ids", "stop")
        ctx, n = self.max_model_len, len(ids)
        what = "messages" if field_ == "messages" else "prompt"
        try:  # the engine's checks, before max_tokens is filled in from the prompt's length
            check_prompt(ids, self.engine.model.cfg.vocab_size, ctx, what)
            if given and n + params["max_tokens"] > ctx:  # vLLM's server refuses (the engine would cap)
                raise context_exceeded(ctx, n, what, params["max_tokens"])
        except ParamError as e:
            raise APIError(400, str(e), field_ if e.param == what else e.param, code=e.code) from None
        if not given:  # vLLM's rule: the rest of the context (completions: at most OpenAI's default of 16)
            cap = params["max_tokens"]
            params = {**params, "max_tokens": ctx - n if cap is None else min(cap, ctx - n)}
        forced = None
        if teacher_force:  # score prompt[1:] through the exit policy (a 1-token prompt has nothing to score)
            params = {**params, "prompt_logprobs": 0, "logprobs": True}
            if len(ids) > 1:
                ids, forced = ids[:1], ids[1:]
        try:
            params = dict(params)
            priority = params.pop("priority", 0)
            sp = SamplingParams(**params)
            tracker = None
            if self.record_path is not None:  # keeps every exit score it reads, for the request's policy
                tracker = RP.RecordingTracker(self.engine.policy.override(
                    threshold=sp.exit_threshold, r_min=sp.r_min, r_max=sp.r_max))
            self.engine.add_request(ids, sp, request_id=rid, arrival_time=arrival, forced_output=forced,
                                    priority=priority, tracker=tracker)
        except ParamError as e:
            raise APIError(400, str(e), field_ if e.param == "prompt" else e.param) from None
        holdback = max((len(s) for s in sp.stop), default=1) - 1
        echo_text = None
        if sp.prompt_logprobs is not None:
            echo_text = prompt if isinstance(prompt, str) else self._decode(ids + (forced or []))
        self._pub[rid] = _Pub(holdback=holdback, echo_text=echo_text)
        self.counters["prompt_tokens"] += len(ids)
        return len(ids)

    def _step(self) -> None:
        try:
            seqs = self.engine.step()
        except Exception as e:  # noqa: BLE001 - one batch failed: fail its requests, keep serving
            self.counters["step_errors"] += 1
            log.error("engine step failed: %s", traceback.format_exc())
            self._fail_running(f"internal error in the engine: {type(e).__name__}: {e}")
            return
        items = []
        for s in seqs:
            pub = self._pub.get(s.request_id)
            if pub is None:
                continue
            try:
                d = self.delta(s, pub)
            except Exception as e:  # noqa: BLE001 - this request fails, the others go on
                log.error("request %s failed: %s", s.request_id, traceback.format_exc())
                self.engine.abort(s.request_id)
                d = Delta([], [], error=f"internal error while processing the request: {type(e).__name__}: {e}")
            if d.done:
                self._finish(s.request_id, d, s)
            items.append((s.request_id, d))
        if items:
            self.loop.call_soon_threadsafe(self._deliver, items)
        self._publish_snapshot()

    def _finish(self, rid: str, d: Delta, s: Sequence | None = None) -> None:
        self.engine.release(rid)
        self._pub.pop(rid, None)
        if d.error is not None:
            self.counters["requests_failed"] += 1
        else:
            fr = self.counters["requests_finished"]
            fr[d.finish_reason] = fr.get(d.finish_reason, 0) + 1
            if s is not None:  # (the copy is what /metrics reads, on the event loop)
                self.histograms.observe(s)
                self._hists = self.histograms.copy()
                if self.record_path is not None and s.output_ids:
                    self.recorded.append({"prompt_len": len(s.prompt_ids), "output_len": len(s.output_ids),
                                          "scores": s.tracker.rows})
                    if len(self.recorded) % self.RECORD_EVERY == 0:
                        self.write_recorded()

    def write_recorded(self) -> None:
        """record_exits: (re)write the file with every request recorded so far."""
        if self.record_path is None:
            return
        eng = self.engine
        RP.write(self.record_path, model=self.model_name, policy=eng.policy, model_r_min=eng.model.cfg.r_min,
                 kv_layout=eng.config.kv_layout,
                 workloads={"server": {"scale": None, "seed": None, "requests": self.recorded}})

    def _fail_running(self, message: str) -> None:
        """After a failed step the batch's state is unknown: fail every request that had started."""
        items = []
        for rid in list(self._pub):
            if not self.engine.started(rid):
                continue  # still waiting for prefill: untouched, keep it
            self.engine.abort(rid)
            d = Delta([], [], error=message)
            self._finish(rid, d)
            items.append((rid, d))
        if items:
            self.loop.call_soon_threadsafe(self._deliver, items)
        self._publish_snapshot()

    def delta(self, s: Sequence, pub: _Pub) -> Delta:
        """The tokens and text `s` produced since the last delta."""
        n0, n1 = pub.sent_tokens, s.num_resolved  # (a token whose id is still on the device waits: re-entry)
        ids, depths = s.output_ids[n0:n1], s.exit_depths[n0:n1]
        pub.sent_tokens = n1
        self.counters["generation_tokens"] += len(ids)
        lps = toks = top = echo = None
        if s.params.logprobs:
            lps = s.logprobs[n0:n1]
            toks = [self._tokstr(t) for t in ids]
            if s.params.top_logprobs:
                top = [self._tops(d) for d in s.top_logprobs[n0:n1]]
            else:  # the chosen token only (OpenAI's logprobs=0)
                top = [{t: lp} for t, lp in zip(toks, lps)]
        if n0 == 0 and ids and s.params.prompt_logprobs is not None:
            echo = {"text": pub.echo_text, "token_ids": list(s.prompt_ids), "forced": s.forced is not None,
                    "tokens": [self._tokstr(t) for t in s.prompt_ids], "logprobs": list(s.prompt_logprobs),
                    "top": [None if d is None else self._tops(d) for d in s.prompt_top_logprobs]}
        visible = s.text
        if not s.finished:  # never send what a stop string could still cut, nor half a character
            visible = visible[:len(visible) - pub.holdback].rstrip("\ufffd")
        text = visible[pub.sent_chars:] if len(visible) > pub.sent_chars else ""
        pub.sent_chars = max(pub.sent_chars, len(visible))
        return Delta(ids, depths, text, lps, toks, s.finish_reason, top=top, prompt=echo)

    def _tokstr(self, t: int) -> str:
        return self.tokenizer.decode([t]) if self.tokenizer is not None else f"token_id:{t}"

    def _tops(self, d: dict[int, float]) -> dict[str, float]:
        return {self._tokstr(t): lp for t, lp in d.items()}

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids) if self.tokenizer is not None else ""

    def _publish_snapshot(self) -> None:
        now = time.perf_counter()
        m = self.engine.metrics()
        gen = self.counters["generation_tokens"]
        if not self._rate or now - self._rate[-1][0] >= 0.05:  # a few hundred points per window at most
            self._rate.append((now, gen))
        while len(self._rate) > 2 and now - self._rate[1][0] > self.rate_window_s:
            self._rate.popleft()
        t0, g0 = self._rate[0]
        self.snapshot = {  # replaced whole: readers on the event loop see one consistent dict
            **m, "waiting": m["queues"]["waiting"] + sum(c[0] == "add" for c in list(self._cmds)),
            "tokens_per_s": (gen - g0) / (now - t0) if now > t0 else 0.0,
            "counters": {**self.counters, "requests_finished": dict(self.counters["requests_finished"])},
            "engine_keys": list(m), "histograms": self._hists,
            "time": now}


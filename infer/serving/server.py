"""The OpenAI-compatible HTTP app: /v1/completions, /v1/chat/completions (SSE streaming), /v1/models,
/health, /metrics, and vLLM's /tokenize, /detokenize, /tokenizer_info. `build_app` wraps an `AsyncEngine`; `infer.serve` is the command line.

Extensions beyond OpenAI: request fields `exit_threshold`, `r_min`, `r_max` (the per-request exit
policy), `top_k`, `stop_token_ids`, `ignore_eos`, `echo_logprobs_depth`; every choice (and every
streamed chunk) carries the `token_ids` it produced and the `exit_depths` (loop steps) of those
tokens; with `echo`, also `prompt_token_ids` and `prompt_exit_depths` (None for the first token).

vLLM's completions contract (what lm-eval's local-completions uses): a list of prompts (strings or
token-id lists) per request, `n`, `echo` with prompt log-probs (and `max_tokens: 0`), `logprobs: k`
with `top_logprobs` (chat: `logprobs` + `top_logprobs: k`). Choice `index` = prompt * n + sample.
What an echoed prompt token's log-prob means: see protocol.parse_completion.
"""
from __future__ import annotations

import asyncio
import copy
import hmac
import signal
import socket
import time
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .async_engine import AsyncEngine, Delta, Overloaded, RequestStream, merge
from .metrics import render_metrics
from .protocol import (APIError, GenRequest, bad, get, parse_chat, parse_completion, parse_json, render_chat,
                       token_ids)
from .responses import choice, echo_choice, sse, usage

if TYPE_CHECKING:
    import uvicorn


async def _read_body(request: Request, limit: int) -> bytes:
    too_big = APIError(413, f"the request body exceeds the limit of {limit} bytes (--max-request-bytes)",
                       code="request_too_large")
    cl = request.headers.get("content-length")
    if cl is not None and cl.isdigit() and int(cl) > limit:
        raise too_big
    buf = bytearray()
    async for chunk in request.stream():
        buf += chunk
        if len(buf) > limit:
            raise too_big
    return bytes(buf)


async def _disconnected(request: Request) -> None:
    """Returns when the client goes away (the body has already been read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def build_app(aeng: AsyncEngine, model_name: str, api_key: str | None = None,
              max_request_bytes: int = 1 << 20, echo_logprobs_depth: str = "full") -> FastAPI:
    """`echo_logprobs_depth`: the default meaning of echoed prompt log-probs ("full": the full-depth
    prefill, vLLM's; "policy": teacher-forced through the exit policy); a request may override it."""
    cfg = aeng.engine.model.cfg
    max_model_len = aeng.max_model_len  # the one context length (the checkpoint's, capped by the KV pool)
    engine_cfg = aeng.engine.config.describe()  # the resolved settings (checkpoint defaults filled in)
    info = {k: engine_cfg[k] for k in ("policy", "refill", "min_coda_batch", "kv_layout", "max_batch_size", "lookahead",
                                       "exit_criterion", "exit_threshold", "r_min", "full_depth")}
    # what the engine runs on; an emulated device (infer/sim/emulated.py) says so everywhere
    device = getattr(aeng.engine.runner, "device_info", None) or {"device": str(aeng.engine.model.device),
                                                                    "emulated": False}
    info |= {"device": device["device"], "emulated": str(device["emulated"]).lower()}
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(_app):
        aeng.start()
        yield
        await aeng.shutdown()

    app = FastAPI(title="looplm-cdb", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.aeng = aeng

    @app.exception_handler(APIError)
    async def api_error(_r, e: APIError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_r, e: StarletteHTTPException):
        return JSONResponse(APIError(e.status_code, str(e.detail)).body(), status_code=e.status_code)

    @app.exception_handler(Exception)
    async def internal_error(_r, e: Exception):
        err = APIError(500, f"internal error: {type(e).__name__}: {e}", type_="internal_server_error")
        return JSONResponse(err.body(), status_code=500)

    def auth(request: Request) -> None:
        if api_key is None:
            return
        got = request.headers.get("authorization", "")
        if not hmac.compare_digest(got.encode(), f"Bearer {api_key}".encode()):
            raise APIError(401, "invalid or missing API key (send 'Authorization: Bearer <key>')",
                           type_="authentication_error", code="invalid_api_key")

    async def add_choices(req: GenRequest) -> list[dict[str, RequestStream]]:
        """One engine request per choice (prompt x n), plus a teacher-forced one per choice for echo
        under echo_logprobs_depth "policy". All or nothing: a rejection aborts the ones added."""
        jobs: list[dict[str, RequestStream]] = []
        zero = req.sampling["max_tokens"] == 0  # echo only: prefill, keep the prompt, drop the token
        try:
            for prompt in (req.prompts or [None]):
                for j in range(req.n):
                    sp = dict(req.sampling)
                    if sp["seed"] is not None and j:  # n samples from one seed must differ
                        sp["seed"] = (sp["seed"] + j) % 2**63
                    job: dict[str, RequestStream] = {}
                    jobs.append(job)
                    policy = req.echo and req.echo_depth == "policy"
                    if policy:
                        job["forced"] = await aeng.add(prompt, {**sp, "max_tokens": 1, "logprobs": True,
                                                                "top_logprobs": req.top_logprobs},
                                                       teacher_force=True)
                    if req.echo and not policy:
                        sp["prompt_logprobs"] = req.top_logprobs
                    if not (policy and zero):
                        sp["max_tokens"] = max(1, sp["max_tokens"]) if sp["max_tokens"] is not None else None
                        job["gen"] = await aeng.add(prompt, sp, messages=req.messages,
                                                    max_tokens_given=req.max_tokens_given)
        except BaseException:
            for job in jobs:
                for s in job.values():
                    aeng.abort(s.request_id)
            raise
        return jobs

    async def generate(request: Request, kind: str):
        auth(request)
        body = parse_json(await _read_body(request, max_request_bytes))
        if kind == "completion":
            req = parse_completion(body, cfg.vocab_size, cfg.r_max, echo_logprobs_depth)
        else:
            req = parse_chat(body, cfg.vocab_size, cfg.r_max)
        if req.model is not None and req.model != model_name:
            raise bad("model", f"the model '{req.model}' does not exist; this server serves '{model_name}'",
                      code="model_not_found")
        try:
            jobs = await add_choices(req)
        except Overloaded as e:
            raise APIError(503, str(e), type_="server_overloaded", code="overloaded") from None
        streams = [s for job in jobs for s in job.values()]
        head = {"id": ("chatcmpl-" if kind == "chat" else "cmpl-") + streams[0].request_id,
                "object": "chat.completion.chunk" if kind == "chat" else "text_completion",
                "created": int(time.time()), "model": model_name}
        if req.stream:  # (protocol refuses echo with stream: every job has "gen" only)
            gens = [job["gen"] for job in jobs]
            return StreamingResponse(_stream(req, gens, head), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        collect = asyncio.ensure_future(asyncio.gather(*(_collect(req, s) for s in streams)))
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not collect.done():  # the client left (or we are being cancelled): stop the requests
                collect.cancel()
                for s in streams:
                    aeng.abort(s.request_id)
        if not collect.done() or collect.cancelled():
            return Response(status_code=499)
        done = iter(collect.result())
        results = [{name: next(done) for name in job} for job in jobs]
        for r in results:
            for d in r.values():
                if d.error is not None:
                    raise APIError(500, d.error, type_="internal_server_error")
        if kind == "chat":
            head["object"] = "chat.completion"
        choices, prompt_tokens, depths = [], 0, []
        for i, (job, r) in enumerate(zip(jobs, results)):
            d = r.get("gen")
            if req.echo:
                d = echo_choice(d, r.get("forced"), cfg.r_max, drop_output=req.sampling["max_tokens"] == 0)
                if not req.logprobs:
                    d.logprobs = None
            choices.append(choice(kind, d, stream=False, index=i, k=req.top_logprobs))
            if i % req.n == 0:  # usage counts each prompt once (as vLLM does)
                prompt_tokens += job["gen"].prompt_tokens if "gen" in job else len(d.prompt["token_ids"])
            depths.append(d.exit_depths)
        return {**head, "choices": choices, "usage": usage(prompt_tokens, depths)}

    async def _collect(req: GenRequest, stream: RequestStream) -> Delta:
        acc = Delta([], [], "", [], [], top=[])
        while not acc.done:
            acc = merge(acc, await stream.next())
        if not req.logprobs and acc.prompt is None:
            acc.logprobs = acc.tokens = acc.top = None
        return acc

    async def _stream(req: GenRequest, streams: list[RequestStream], head: dict):
        """SSE chunks of every choice as they come (each chunk names its choice `index`), as vLLM sends
        them: chat's `delta: {"role": "assistant"}` chunk of a choice goes out with its first token
        (clients time TTFT at the first chunk); usage only with `stream_options.include_usage`, then
        `usage: null` on every chunk (the usage so far with `continuous_usage_stats`) and one final
        `choices: []` chunk with the usage."""
        depths: list[list[int]] = [[] for _ in streams]
        offsets = [0] * len(streams)
        started = [False] * len(streams)
        prompt_tokens = sum(s.prompt_tokens for i, s in enumerate(streams) if i % req.n == 0)
        extra = {"usage": None} if req.include_usage else {}
        merged: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, s: RequestStream) -> None:
            while True:
                d = await s.next()
                merged.put_nowait((i, d))
                if d.done:
                    return
        pumps = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
        failed = False
        try:
            left = len(streams)
            while left:
                i, d = await merged.get()
                if d.error is not None:
                    yield sse({"error": APIError(500, d.error, type_="internal_server_error").body()["error"]})
                    failed = True
                    break
                out = ""
                if req.continuous_usage:
                    extra = {"usage": usage(prompt_tokens, depths)}
                if req.kind == "chat" and not started[i]:
                    out = sse({**head, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                                     "logprobs": None, "finish_reason": None}], **extra})
                started[i] = True
                depths[i] += d.exit_depths
                if req.continuous_usage:
                    extra = {"usage": usage(prompt_tokens, depths)}
                chunk = {**head, "choices": [choice(req.kind, d, stream=True, offset=offsets[i], index=i,
                                                     k=req.top_logprobs)], **extra}
                offsets[i] += len(d.text)
                if d.finish_reason is not None:
                    left -= 1
                yield out + sse(chunk)
            if req.include_usage and not failed:
                yield sse({**head, "choices": [], "usage": usage(prompt_tokens, depths)})
            yield sse("[DONE]")
        finally:  # client gone mid-stream (cancelled here) or an error: free the requests' KV
            for p in pumps:
                p.cancel()
            for s in streams:
                if not s.finished:
                    aeng.abort(s.request_id)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate(request, "completion")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await generate(request, "chat")

    # vLLM's tokenizer endpoints (lm-eval's API models use them when no local tokenizer is given).
    # The engine thread owns the engine's tokenizer; these use a copy of it, so the two threads
    # never share one tokenizer object.
    front_tok = copy.deepcopy(aeng.tokenizer) if aeng.tokenizer is not None else None

    def need_tokenizer(request: Request):
        auth(request)
        if front_tok is None:
            raise APIError(404, "this model has no tokenizer: send token ids", code="no_tokenizer")
        return front_tok

    @app.post("/tokenize")
    async def tokenize(request: Request):
        tok = need_tokenizer(request)
        body = parse_json(await _read_body(request, max_request_bytes))
        special = get(body, "add_special_tokens", "boolean", True)
        if "messages" in body:
            text = render_chat(parse_chat({"messages": body["messages"]}, cfg.vocab_size, cfg.r_max).messages, tok)
            ids = tok.encode(text, add_special_tokens=False)
        else:
            prompt = get(body, "prompt", "string")
            if prompt is None:
                raise bad("prompt", "'prompt' (a string) or 'messages' is required")
            ids = tok.encode(prompt, add_special_tokens=special)
        return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        tok = need_tokenizer(request)
        body = parse_json(await _read_body(request, max_request_bytes))
        return {"prompt": tok.decode(token_ids(body.get("tokens"), "tokens", cfg.vocab_size))}

    @app.get("/tokenizer_info")
    async def tokenizer_info(request: Request):
        tok = need_tokenizer(request)
        return {"tokenizer_class": type(tok).__name__, "eos_token": tok.eos_token, "bos_token": tok.bos_token,
                "pad_token": tok.pad_token, "chat_template": getattr(tok, "chat_template", None),
                "model_max_length": max_model_len}

    @app.get("/v1/models")
    async def models(request: Request):
        auth(request)
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "looplm-cdb", "max_model_len": max_model_len,
                                            "vocab_size": cfg.vocab_size,
                                            "r_max": cfg.r_max, "arch": cfg.arch,
                                            # prelude-core-coda layer counts as served (--layer-split shows here)
                                            "layers": [cfg.n_prelude, cfg.n_core, cfg.n_coda], "engine": engine_cfg,
                                            "device": device}]}

    @app.get("/health")
    async def health():
        if not aeng.alive or aeng.closing:
            return JSONResponse({"status": "unavailable"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(render_metrics(aeng, model_name, info),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    return app


def bind(host: str, port: int) -> socket.socket:
    """A bound socket for `run` (port 0: any free port, read back with getsockname)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    return sock


def run(server: uvicorn.Server, sock: socket.socket, banner: str) -> None:
    """Announce `<banner> on http://host:port` once the socket listens, then serve until SIGTERM or
    Ctrl-C; both drain in-flight requests (uvicorn's graceful shutdown) and exit 0."""
    # A SIGTERM before uvicorn installs its own handlers (and the one it re-raises after its graceful
    # shutdown) asks for the same graceful exit: uvicorn then skips its main loop and shuts down.
    # Raising SystemExit from this handler instead would land wherever the main thread is, inside
    # asyncio's setup, with the lifespan's engine thread possibly half started.
    signal.signal(signal.SIGTERM, lambda *_: setattr(server, "should_exit", True))
    sock.listen(server.config.backlog)  # a client that connects after the line below waits in the backlog
    host, port = sock.getsockname()[:2]
    print(f"{banner} on http://{host}:{port}", flush=True)
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:
        pass

"""The OpenAI-compatible HTTP app: /v1/completions, /v1/chat/completions (SSE streaming), /v1/models,
/health, /metrics. `build_app` wraps an `AsyncEngine`; `infer.serve` is the command line.

Extensions beyond OpenAI: request fields `exit_threshold`, `r_min`, `r_max` (the per-request exit
policy), `top_k`, `stop_token_ids`, `ignore_eos`; every choice (and every streamed chunk) carries
the `token_ids` it produced and the `exit_depths` (loop steps) of those tokens.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import os
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .async_engine import AsyncEngine, Delta, Overloaded, RequestStream
from .protocol import APIError, GenRequest, bad, parse_chat, parse_completion, parse_json


def _usage(prompt_tokens: int, depths: list[int]) -> dict:
    """OpenAI usage, plus the mean exit depth of the decoded tokens (the first token comes from the
    prefill, at full depth, and is left out as in the engine's mean)."""
    n = len(depths)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": n, "total_tokens": prompt_tokens + n,
            "mean_exit_depth": sum(depths[1:]) / (n - 1) if n > 1 else None}


def _logprobs(kind: str, d: Delta, offset: int) -> dict | None:
    if d.logprobs is None:
        return None
    if kind == "chat":
        return {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
                            for t, lp in zip(d.tokens, d.logprobs)]}
    offsets = []
    for t in d.tokens:
        offsets.append(offset)
        offset += len(t)
    return {"tokens": d.tokens, "token_logprobs": d.logprobs, "top_logprobs": None, "text_offset": offsets}


def _choice(kind: str, d: Delta, stream: bool, offset: int = 0) -> dict:
    c = {"index": 0}
    if kind == "chat" and stream:
        c["delta"] = {"content": d.text} if d.text or not d.finish_reason else {}
    elif kind == "chat":
        c["message"] = {"role": "assistant", "content": d.text}
    else:
        c["text"] = d.text
    c.update(logprobs=_logprobs(kind, d, offset), finish_reason=d.finish_reason, token_ids=d.token_ids,
             exit_depths=d.exit_depths)
    return c


def _sse(obj: dict | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, separators=(',', ':'))}\n\n"


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
              max_request_bytes: int = 1 << 20) -> FastAPI:
    cfg = aeng.engine.model.cfg
    engine_cfg = aeng.engine.config.describe()  # the resolved settings (checkpoint defaults filled in)
    info = {k: engine_cfg[k] for k in ("policy", "refill", "kv_layout", "max_batch_size", "lookahead",
                                       "exit_criterion", "exit_threshold", "r_min", "exits_disabled")}
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

    async def generate(request: Request, kind: str):
        auth(request)
        body = parse_json(await _read_body(request, max_request_bytes))
        req = (parse_completion if kind == "completion" else parse_chat)(body, cfg.vocab_size, cfg.r_max)
        if req.model is not None and req.model != model_name:
            raise bad("model", f"the model '{req.model}' does not exist; this server serves '{model_name}'",
                      code="model_not_found")
        try:
            stream = await aeng.add(req.prompt, req.sampling, messages=req.messages,
                                    max_tokens_given=req.max_tokens_given)
        except Overloaded as e:
            raise APIError(503, str(e), type_="server_overloaded", code="overloaded") from None
        head = {"id": ("chatcmpl-" if kind == "chat" else "cmpl-") + stream.request_id,
                "object": "chat.completion.chunk" if kind == "chat" else "text_completion",
                "created": int(time.time()), "model": model_name}
        if req.stream:
            return StreamingResponse(_stream(req, stream, head), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        collect = asyncio.ensure_future(_collect(req, stream))
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not collect.done():  # the client left (or we are being cancelled): stop the request
                collect.cancel()
                aeng.abort(stream.request_id)
        if not collect.done() or collect.cancelled():
            return Response(status_code=499)
        d = collect.result()
        if d.error is not None:
            raise APIError(500, d.error, type_="internal_server_error")
        if kind == "chat":
            head["object"] = "chat.completion"
        return {**head, "choices": [_choice(kind, d, stream=False)],
                "usage": _usage(stream.prompt_tokens, d.exit_depths)}

    async def _collect(req: GenRequest, stream: RequestStream) -> Delta:
        acc = Delta([], [], "", [] if req.logprobs else None, [] if req.logprobs else None)
        while not acc.done:
            d = await stream.next()
            acc = Delta(acc.token_ids + d.token_ids, acc.exit_depths + d.exit_depths, acc.text + d.text,
                        None if acc.logprobs is None else acc.logprobs + (d.logprobs or []),
                        None if acc.tokens is None else acc.tokens + (d.tokens or []), d.finish_reason, d.error)
        return acc

    async def _stream(req: GenRequest, stream: RequestStream, head: dict):
        depths: list[int] = []
        offset = 0
        try:
            if req.kind == "chat":
                yield _sse({**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                 "logprobs": None, "finish_reason": None}]})
            while True:
                d = await stream.next()
                if d.error is not None:
                    yield _sse({"error": APIError(500, d.error, type_="internal_server_error").body()["error"]})
                    break
                depths += d.exit_depths
                chunk = {**head, "choices": [_choice(req.kind, d, stream=True, offset=offset)]}
                offset += len(d.text)
                if d.finish_reason is not None:
                    chunk["usage"] = _usage(stream.prompt_tokens, depths)
                yield _sse(chunk)
                if d.done:
                    break
            if req.include_usage and d.error is None:
                yield _sse({**head, "choices": [], "usage": _usage(stream.prompt_tokens, depths)})
            yield _sse("[DONE]")
        finally:  # client gone mid-stream (cancelled here) or an error: free the request's KV
            if not stream.finished:
                aeng.abort(stream.request_id)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate(request, "completion")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await generate(request, "chat")

    @app.get("/v1/models")
    async def models(request: Request):
        auth(request)
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "looplm-cdb", "max_model_len": cfg.max_position,
                                            "vocab_size": cfg.vocab_size,
                                            "r_max": cfg.r_max, "arch": cfg.arch, "engine": engine_cfg}]}

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


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def render_metrics(aeng: AsyncEngine, model_name: str, info: dict) -> str:
    """Prometheus text exposition of the engine snapshot (taken after every stage)."""
    s, c = aeng.snapshot, aeng.snapshot["counters"]
    lab = 'model_name="{}"'.format(model_name.replace("\\", "\\\\").replace('"', '\\"'))
    rows: list[tuple[str, str, str, list[tuple[str, float]]]] = [
        ("cdb_num_requests_running", "gauge", "Requests holding a slot (prelude, core or coda queue).",
         [("", s["running"])]),
        ("cdb_num_requests_waiting", "gauge", "Requests waiting for prefill (slot / KV memory).",
         [("", s["waiting"])]),
        ("cdb_queue_length", "gauge", "Length of each of the four queues.",
         [(f'stage="{k}"', v) for k, v in s["queues"].items()]),
        ("cdb_kv_cache_usage_perc", "gauge", "Fraction of KV blocks in use (1 = full).", [("", s["kv_usage"])]),
        ("cdb_kv_cache_free_blocks", "gauge", "Free KV blocks.", [("", s["kv_free_blocks"])]),
        ("cdb_kv_cache_total_blocks", "gauge", "KV blocks in the pool.", [("", s["kv_total_blocks"])]),
        ("cdb_kv_cache_all_free", "gauge", "1 when every KV block and state slot is free.",
         [("", int(s["kv_all_free"]))]),
        ("cdb_generation_tokens_per_second", "gauge", f"Output tokens/s over the last {aeng.rate_window_s:g} s.",
         [("", s["tokens_per_s"])]),
        ("cdb_mean_exit_depth", "gauge", "Mean exit depth (loop steps) of decoded tokens since start.",
         [("", s["mean_exit_depth"])]),
        ("cdb_prompt_tokens_total", "counter", "Prompt tokens admitted.", [("", c["prompt_tokens"])]),
        ("cdb_generation_tokens_total", "counter", "Output tokens generated.", [("", c["generation_tokens"])]),
        ("cdb_request_success_total", "counter", "Finished requests by finish reason.",
         [(f'finished_reason="{k}"', v) for k, v in c["requests_finished"].items()]),
        ("cdb_request_failure_total", "counter", "Requests failed by an internal error.",
         [("", c["requests_failed"])]),
        ("cdb_request_rejected_total", "counter", "Requests refused with 503 (waiting queue full).",
         [("", c["requests_rejected"])]),
        ("cdb_engine_step_errors_total", "counter", "Engine stages that raised.", [("", c["step_errors"])]),
        ("cdb_stage_calls_total", "counter", "Stages run, by kind.",
         [(f'stage="{k}"', v) for k, v in s["stage_calls"].items()]),
        ("cdb_engine_alive", "gauge", "1 while the engine thread runs.", [("", int(aeng.alive))]),
        ("process_resident_memory_bytes", "gauge", "Resident memory of the server process.", [("", _rss_bytes())]),
    ]
    if info:
        rows.append(("cdb_info", "gauge", "Engine configuration.",
                     [(",".join(f'{k}="{v}"' for k, v in info.items()), 1)]))
    out = []
    for name, kind, help_, samples in rows:
        out += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}"]
        for labels, v in samples:
            out.append(f"{name}{{{lab}{',' + labels if labels else ''}}} {float(v):.9g}")
    return "\n".join(out) + "\n"

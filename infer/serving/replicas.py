"""Engine replicas behind one endpoint, on Ray Serve: `python -m infer.serve --model DIR --replicas N`.

    python -m infer.serve --model checkpoints/ouro-demo --replicas 2 [--ray-address HEAD:6379]

What runs where: each replica is a Ray Serve deployment replica (one actor, one GPU on CUDA, on CPU
`--threads` cores, default 1) holding one engine and the single-process app (`build_app`), which
it runs in-process for every request, so the routes, validation and SSE are the single server's.
This process is the ingress: a small HTTP app that forwards each request through a Serve handle
(the router picks the less loaded of two replicas) and streams the replica's response back.

Failure: Serve health-checks the replicas (`check_health`: the engine thread is alive) and starts
a replacement for one that dies. A request whose replica dies before any byte reached the client
is sent again to another replica and its response carries `x-looplm-retried: N`; one that had
already streamed gets an SSE error event (502) and ends. Every response names its replica
(`x-looplm-replica: host:pid`). `/metrics` sums the replicas' own metrics (pushed every second to
a small board actor, so dead replicas drop out) and adds `cdb_replicas`.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

try:
    import ray
    from ray import serve
except ImportError:  # the core install has no Ray
    raise SystemExit("error: --replicas needs Ray: pip install -e '.[distributed]'") from None

from looplm import PRESETS

APP = "looplm"
RETRIED, REPLICA = "x-looplm-retried", "x-looplm-replica"
PUSH_EVERY_S, STALE_AFTER_S = 1.0, 3.0
LOCAL_SERVE_ENV = {"RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "1.0", "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS": "2000",
                   "RAY_USAGE_STATS_ENABLED": "0"}


@ray.remote(num_cpus=0)
class MetricsBoard:
    """The latest /metrics text of every replica, with the time it arrived."""

    def __init__(self):
        self.texts: dict[str, tuple[float, str]] = {}

    def put(self, replica: str, text: str) -> None:
        self.texts[replica] = (time.time(), text)

    def fresh(self, max_age_s: float) -> dict[str, str]:
        now = time.time()
        return {r: t for r, (ts, t) in self.texts.items() if now - ts <= max_age_s}


class Replica:
    """One engine and the single-process app, on the device Ray gave this actor."""

    async def __init__(self, a: argparse.Namespace, board, build) -> None:  # async: the engine thread needs this loop
        """`build(a) -> LLMEngine`: how the single server builds its engine (cli.make_engine: a
        checkpoint, a preset or an emulated device)."""
        import torch

        from .async_engine import AsyncEngine
        from .server import build_app

        if a.device == "cpu" or a.device.startswith("emulated"):
            torch.set_num_threads(a.threads or 1)  # the share of cores Ray reserved (num_cpus)
        engine = build(a)
        self.aeng = AsyncEngine(engine, max_waiting=a.max_waiting, stream_interval=a.stream_interval)
        self.app = build_app(self.aeng, served_name(a), a.api_key, a.max_request_bytes,
                             echo_logprobs_depth=a.echo_logprobs_depth)
        self.aeng.start()
        self.id = f"{socket.gethostname()}:{os.getpid()}"
        self.board = board
        self._pusher = asyncio.get_running_loop().create_task(self._push_metrics())

    def check_health(self) -> None:  # Serve replaces a replica whose check raises
        if not self.aeng.alive:
            raise RuntimeError("the engine thread has stopped")

    async def http(self, method: str, path: str, query: bytes, headers: list[tuple[bytes, bytes]],
                   body: bytes) -> AsyncIterator[tuple | bytes]:
        """Runs one HTTP request through the app: yields (status, headers), then the body chunks."""
        out: asyncio.Queue = asyncio.Queue()
        gone = asyncio.Event()
        sent = False

        async def receive() -> dict:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            await gone.wait()  # set when the ingress cancels us (client gone): the app aborts the request
            return {"type": "http.disconnect"}

        async def send(msg: dict) -> None:
            out.put_nowait(msg)

        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method,
                 "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": query,
                 "root_path": "", "headers": headers, "client": None, "server": None}
        task = asyncio.ensure_future(self.app(scope, receive, send))
        task.add_done_callback(lambda _: out.put_nowait(None))
        try:
            done = False
            while not done:
                msgs = [await out.get()]
                while not out.empty():  # what the app sent meanwhile goes as one chunk: under load a
                    msgs.append(out.get_nowait())  # stream's tokens outpace Ray's per-chunk cost
                body = b""
                for msg in msgs:
                    if msg is None:
                        done = True
                    elif msg["type"] == "http.response.start":
                        hs = [(k.decode(), v.decode()) for k, v in msg.get("headers", [])]
                        yield msg["status"], hs + [(REPLICA, self.id)]
                    elif msg["type"] == "http.response.body" and msg.get("body"):
                        body += msg["body"]
                if body:
                    yield body
            task.result()
        finally:
            gone.set()

    async def _get(self, path: str) -> str:
        return b"".join([c async for c in self.http("GET", path, b"", [], b"") if isinstance(c, bytes)]).decode()

    async def _push_metrics(self) -> None:
        while True:
            try:
                await self.board.put.remote(self.id, await self._get("/metrics"))
            except Exception as e:  # the board is gone (shutdown) or a transient error: keep serving
                print(f"replica {self.id}: metrics push failed: {e}", file=sys.stderr)
            await asyncio.sleep(PUSH_EVERY_S)


def served_name(a: argparse.Namespace) -> str:  # as infer.serve names a single server
    return a.served_model_name or (a.model if a.model in PRESETS else Path(a.model).resolve().name)


# ---------------------------------------------------------------- the ingress
_DIED = (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError)


def _error(status: int, message: str, type_: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": type_, "param": None, "code": status}},
                        status_code=status)


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def build_ingress(handle, board, retries: int = 2, max_request_bytes: int = 1 << 20) -> FastAPI:
    """The endpoint: forwards every route to a replica through `handle`, aggregates /metrics."""
    app = FastAPI(title="looplm-cdb replicas", docs_url=None, redoc_url=None, openapi_url=None)

    @app.get("/metrics")
    async def metrics():
        texts = await board.fresh.remote(STALE_AFTER_S)
        return PlainTextResponse(aggregate_metrics(list(texts.values())),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.api_route("/{path:path}", methods=["GET", "POST"])
    async def forward(request: Request, path: str):
        cl = request.headers.get("content-length")
        if cl is not None and cl.isdigit() and int(cl) > max_request_bytes:  # the replica checks bodies too
            return _error(413, f"the request body exceeds the limit of {max_request_bytes} bytes "
                               "(--max-request-bytes)", "invalid_request_error")
        args = (request.method, request.url.path, request.url.query.encode(), request.headers.raw,
                await request.body())
        failure = ""
        for attempt in range(retries + 1):
            gen = handle.options(method_name="http", stream=True).remote(*args)
            head = asyncio.ensure_future(_head(gen))
            gone = asyncio.ensure_future(_disconnected(request))
            await asyncio.wait({head, gone}, return_when=asyncio.FIRST_COMPLETED)
            gone.cancel()
            if not head.done():  # the client left before anything came back: stop the request
                head.cancel()
                gen.cancel()
                return Response(status_code=499)
            try:
                (status, headers), first = head.result()
            except _DIED as e:  # the replica died before a byte reached the client: send it elsewhere
                failure = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                await asyncio.sleep(0.2 * attempt)
                continue
            except Exception as e:  # a bug, not a death: retrying would repeat it
                return _error(500, f"internal error in the replica: {type(e).__name__}: "
                                   f"{str(e).splitlines()[-1] if str(e) else ''}", "internal_server_error")
            if attempt:
                headers.append((RETRIED, str(attempt)))
            return StreamingResponse(_rest(gen, first), status_code=status, headers=dict(headers))
        return _error(503, f"no engine replica could serve the request after {retries + 1} attempts "
                           f"(last: {failure}); Ray Serve replaces dead replicas, retry shortly",
                      "replica_unavailable")

    return app


async def _head(gen) -> tuple[tuple, bytes]:
    """The status line and the first body chunk: nothing is sent to the client before both exist,
    so a request whose replica dies before its first chunk can be retried safely."""
    start = await gen.__anext__()
    try:
        first = await gen.__anext__()
    except StopAsyncIteration:
        first = b""
    return start, first


async def _rest(gen, first: bytes) -> AsyncIterator[bytes]:
    try:
        yield first
        async for chunk in gen:
            yield chunk
    except _DIED as e:  # mid-stream: the status is already sent, so the error goes in the stream
        err = {"message": f"the engine replica serving this request died mid-stream ({type(e).__name__}); "
                          "the tokens above are all it produced", "type": "replica_died", "param": None,
               "code": 502}
        yield f"data: {json.dumps({'error': err})}\n\n".encode()
    finally:
        gen.cancel()  # no-op when finished; otherwise the replica sees a disconnect and aborts


_MEAN = {"cdb_kv_cache_usage_perc"}  # gauges that are fractions: the mean over replicas
_MIN = {"cdb_kv_cache_all_free"}
_MAX = {"cdb_info"}
_TOKENS = "cdb_generation_tokens_total"  # weights for the mean exit depth


def aggregate_metrics(texts: list[str]) -> str:
    """Prometheus texts of the replicas -> one text: counters and most gauges summed per series,
    fractions averaged, the mean exit depth weighted by each replica's generated tokens."""
    fams: dict[str, tuple[list[str], dict[str, list[tuple[float, float]]]]] = {}
    for text in texts:
        rows = [ln for ln in text.splitlines() if ln]
        weight = next((float(ln.rsplit(" ", 1)[1]) for ln in rows if ln.startswith(_TOKENS)), 0.0)
        for ln in rows:
            if ln.startswith("#"):
                name = ln.split()[2]
                comments = fams.setdefault(name, ([], {}))[0]
                if ln not in comments:
                    comments.append(ln)
            else:
                series, v = ln.rsplit(" ", 1)
                name = series.split("{", 1)[0]
                fams.setdefault(name, ([], {}))[1].setdefault(series, []).append((float(v), weight))
    out = ["# HELP cdb_replicas Engine replicas reporting metrics.", "# TYPE cdb_replicas gauge",
           f"cdb_replicas {len(texts)}"]
    for name, (comments, series) in fams.items():
        out += comments
        for s, vw in series.items():
            vs = [v for v, _ in vw]
            if name == "cdb_mean_exit_depth":
                tot = sum(w for _, w in vw)
                v = sum(v * w for v, w in vw) / tot if tot else sum(vs) / len(vs)
            else:
                v = (sum(vs) / len(vs) if name in _MEAN else min(vs) if name in _MIN
                     else max(vs) if name in _MAX else sum(vs))
            out.append(f"{s} {v:.9g}")
    return "\n".join(out) + "\n"


# ---------------------------------------------------------------- start / stop
def start(a: argparse.Namespace, build):
    """Connects to (or starts) Ray, deploys `a.replicas` engine replicas (each engine from
    `build(a)`, see Replica); returns (handle, board)."""
    from infer.engine.config import engine_config_from_args

    if a.replicas < 1:
        raise SystemExit(f"error: --replicas must be >= 1, got {a.replicas}")
    cuda = a.device.startswith("cuda")
    # an emulated device is a clock: its replicas reserve no core of their own (their host work,
    # what replica scaling measures, shares the machine's cores with the ingress and the client)
    opts = {"num_gpus": 1, "num_cpus": 1} if cuda else {"num_cpus": 0.01} if a.device.startswith("emulated") \
        else {"num_cpus": a.threads or 1}
    if a.ray_address:
        ray.init(address=a.ray_address)
    else:  # a local cluster (all of this machine's cores and GPUs), no dashboard
        # Serve's defaults poll for a large cluster: the controller loop every 0.1 s and every
        # replica's metrics export every 0.1 s took ~20% of a core here, taken from the engines
        # (the workers inherit this process's environment; an explicit setting wins)
        for k, v in LOCAL_SERVE_ENV.items():
            os.environ.setdefault(k, v)
        ray.init(include_dashboard=False)
    kind, each = ("GPU", 1) if cuda else ("CPU", opts["num_cpus"])
    have = ray.cluster_resources().get(kind, 0)
    if have < a.replicas * each:
        stop(a)
        raise SystemExit(f"error: {a.replicas} replicas need {a.replicas * each:g} {kind} "
                         f"({each:g} each) but the Ray cluster has {have:g}")
    board = MetricsBoard.remote()
    cfg = engine_config_from_args(a)
    serve.start(proxy_location="Disabled")  # this process is the HTTP ingress
    dep = serve.deployment(Replica, name="engine", num_replicas=a.replicas, ray_actor_options=opts,
                           max_ongoing_requests=cfg.max_batch_size + a.max_waiting,
                           health_check_period_s=2, graceful_shutdown_timeout_s=a.drain_timeout)
    handle = serve.run(dep.bind(a, board, build), name=APP, route_prefix=None)
    return handle, board


def stop(a: argparse.Namespace) -> None:
    """Removes what `start` made: the whole local cluster, or only our app on an existing one."""
    if not ray.is_initialized():
        return
    if a.ray_address:
        serve.delete(APP)
    else:
        serve.shutdown()
    ray.shutdown()


def main(a: argparse.Namespace, build) -> None:
    import uvicorn

    from .server import bind, run

    try:
        handle, board = start(a, build)
        sock = bind(a.host, a.port)
        app = build_ingress(handle, board, max_request_bytes=a.max_request_bytes)
        server = uvicorn.Server(uvicorn.Config(app, log_level=a.log_level, timeout_graceful_shutdown=a.drain_timeout,
                                               limit_concurrency=a.limit_concurrency, access_log=False))
        run(server, sock, f"serving {a.model} on {a.replicas} replicas (Ray Serve)")
    finally:
        stop(a)

"""OpenAI-compatible server for looped LMs on the CDB engine.

    python -m infer.serve --model checkpoints/ouro-demo [--policy cdb --refill] [--port 8000]
    python -m infer.serve --model ouro-tiny          # a preset: random weights, token-id prompts only

Binds 127.0.0.1 unless told otherwise. SIGINT / SIGTERM: stop accepting, let in-flight requests
finish for up to --drain-timeout seconds, abort the rest, exit.
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
from pathlib import Path

from looplm import PRESETS

from .async_engine import AsyncEngine
from .engine import EngineConfig, LLMEngine
from .llm import load_model
from .server import build_app


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m infer.serve", description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", required=True, help=f"checkpoint folder or a preset {sorted(PRESETS)}")
    p.add_argument("--served-model-name", default=None, help="name in /v1/models (default: the folder's name)")
    e = p.add_argument_group("engine")
    e.add_argument("--policy", choices=["cb", "cdb"], default="cdb")
    e.add_argument("--refill", action=argparse.BooleanOptionalAction, default=True, help="cdb: refill mode")
    e.add_argument("--min-coda-batch", type=int, default=1)
    e.add_argument("--kv-layout", default="last_exited", choices=["last_exited", "full_depth", "shared"])
    e.add_argument("--max-batch-size", type=int, default=64, help="sequences running at once")
    e.add_argument("--max-prefill-tokens", type=int, default=2048)
    e.add_argument("--kv-cache-tokens", type=int, default=None, help="KV pool size in tokens")
    e.add_argument("--exit-criterion", default=None)
    e.add_argument("--exit-threshold", type=float, default=None)
    e.add_argument("--r-min", type=int, default=None)
    e.add_argument("--r-max", type=int, default=None, help="override the model's r_max")
    e.add_argument("--lookahead", action="store_true")
    e.add_argument("--dtype", default="float32")
    e.add_argument("--device", default="cpu")
    e.add_argument("--seed", type=int, default=0)
    e.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    s = p.add_argument_group("server")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000, help="0: any free port (printed)")
    s.add_argument("--api-key", default=os.environ.get("LOOPLM_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1 (default: $LOOPLM_API_KEY)")
    s.add_argument("--max-waiting", type=int, default=256, help="requests waiting for a slot before 503")
    s.add_argument("--max-request-bytes", type=int, default=1 << 20)
    s.add_argument("--limit-concurrency", type=int, default=None, help="open connections before 503 (uvicorn)")
    s.add_argument("--drain-timeout", type=float, default=10.0, help="seconds in-flight requests get at shutdown")
    s.add_argument("--log-level", default="warning")
    return p


def make_server(a: argparse.Namespace):
    """(uvicorn.Server, bound socket) for parsed arguments; used by main() and by the tests."""
    import torch
    import uvicorn

    if a.threads:
        torch.set_num_threads(a.threads)
    model, tok = load_model(a.model, a.dtype, a.device, a.r_max)
    cfg = EngineConfig(policy=a.policy, refill=a.refill, min_coda_batch=a.min_coda_batch, kv_layout=a.kv_layout,
                       max_batch_size=a.max_batch_size, max_prefill_tokens=a.max_prefill_tokens,
                       kv_cache_tokens=a.kv_cache_tokens, exit_criterion=a.exit_criterion,
                       exit_threshold=a.exit_threshold, r_min=a.r_min, lookahead=a.lookahead, seed=a.seed)
    engine = LLMEngine(model, cfg, tok)
    name = a.served_model_name or (a.model if a.model in PRESETS else Path(a.model).resolve().name)
    info = {"policy": a.policy, "refill": a.refill, "kv_layout": a.kv_layout, "max_batch_size": a.max_batch_size}
    app = build_app(AsyncEngine(engine, max_waiting=a.max_waiting), name, a.api_key, a.max_request_bytes, info)
    sock = socket.socket(socket.AF_INET6 if ":" in a.host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((a.host, a.port))
    config = uvicorn.Config(app, log_level=a.log_level, timeout_graceful_shutdown=a.drain_timeout,
                            limit_concurrency=a.limit_concurrency, access_log=False)
    return uvicorn.Server(config), sock


def main(argv: list[str] | None = None) -> None:
    a = parser().parse_args(argv)
    logging.basicConfig(level=a.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    server, sock = make_server(a)
    host, port = sock.getsockname()[:2]
    if a.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"warning: listening on {a.host}, reachable beyond this machine"
              + ("" if a.api_key else " without an API key"), flush=True)
    print(f"serving {a.model} ({a.policy}{', refill' if a.policy == 'cdb' and a.refill else ''}) "
          f"on http://{host}:{port}", flush=True)
    # uvicorn re-raises the signal it shut down on; after a graceful shutdown that is a clean exit
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()

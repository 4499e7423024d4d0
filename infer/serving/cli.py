"""OpenAI-compatible server for looped LMs on the CDB engine.

    python -m infer.serve --model checkpoints/ouro-demo [--policy cdb --refill] [--port 8000]
    python -m infer.serve --model ouro-tiny          # a preset: random weights, token-id prompts only
    python -m infer.serve --model ouro-1.4b --device emulated:h100   # no weights: an emulated GPU's timing

Binds 127.0.0.1 unless told otherwise. SIGINT / SIGTERM: stop accepting, let in-flight requests
finish for up to --drain-timeout seconds, abort the rest, exit.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from looplm import PRESETS
from looplm.errors import ParamError

from infer.engine.config import add_engine_args, engine_config_from_args
from infer.engine.llm import add_load_args, load_model
from infer.engine.llm_engine import LLMEngine

from .async_engine import AsyncEngine
from .protocol import ECHO_DEPTHS
from .server import bind, build_app, run


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m infer.serve", description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help=f"checkpoint folder or a preset {sorted(PRESETS)}")
    p.add_argument("--served-model-name", default=None, help="name in /v1/models (default: the folder's name)")
    m = p.add_argument_group("model")
    m.add_argument("--r-max", type=int, default=None, help="override the model's r_max")
    m.add_argument("--dtype", default="float32")
    m.add_argument("--device", default="cpu", help="a torch device, or emulated:h100 (also h200, a100): the engine "
                   "runs on a device that only waits for the simulator's predicted stage times (infer/sim/"
                   "emulated.py); --model is then a paper model, a preset or a config.json folder")
    add_load_args(p, m)
    m.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    m.add_argument("--mean-depth", type=float, default=None,
                   help="emulated device: mean exit depth of a binomial spread (default: infer.sim's assumption)")
    m.add_argument("--replay-exits", type=Path, default=None, metavar="FILE",
                   help="emulated device: exit depths from a recorded-exits file (python -m infer.bench "
                        "--record-exits), its records given to requests in turn")
    m.add_argument("--emulated-attention", choices=("sdpa", "paged", "context"), default=None,
                   help="emulated device: what decode attention reads (infer.sim's --attention; default: the engine's "
                        "--attention-backend as on CUDA, paged unless it says sdpa)")
    m.add_argument("--emulated-slowdown", type=float, default=None, metavar="S",
                   help="emulated device: its clock runs S times slower (every predicted stage time x S), so a small "
                        "host keeps up; rates map back x S, latencies / S (default 1)")
    m.add_argument("--replay-workload", default=None, help="with --replay-exits: which workload (default: the "
                   "file's first)")
    add_engine_args(p)
    s = p.add_argument_group("server")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000, help="0: any free port (printed)")
    s.add_argument("--api-key", default=os.environ.get("LOOPLM_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1 (default: $LOOPLM_API_KEY)")
    s.add_argument("--max-waiting", type=int, default=256, help="requests waiting for a slot before 503")
    s.add_argument("--stream-interval", type=int, default=1, metavar="N",
                   help="tokens per streamed chunk after the first (vLLM's name): N > 1 sends fewer, larger chunks, "
                        "cutting the host CPU per token (HTTP, JSON, Ray hops) at a coarser inter-chunk latency")
    s.add_argument("--max-request-bytes", type=int, default=1 << 20)
    s.add_argument("--limit-concurrency", type=int, default=None, help="open connections before 503 (uvicorn)")
    s.add_argument("--drain-timeout", type=float, default=10.0, help="seconds in-flight requests get at shutdown")
    s.add_argument("--echo-logprobs-depth", choices=ECHO_DEPTHS, default="full",
                   help="what an echoed prompt token's log-prob means: full = the full-depth prefill (vLLM's); "
                        "policy = teacher-forced through the exit policy (requests may override it with "
                        "'echo_logprobs_depth')")
    s.add_argument("--record-exits", type=Path, default=None, metavar="FILE",
                   help="write the exit scores of every request the server finishes (the recorded-exits format, one "
                        "workload 'server'; every 64 requests and at shutdown): python -m infer.sim --replay-exits "
                        "FILE gives what this traffic's exits would do on an H100 (with --echo-logprobs-depth "
                        "policy, lm-eval's loglikelihood requests are decoded through the exit policy too)")
    s.add_argument("--log-level", default="warning")
    r = p.add_argument_group("replicas (Ray Serve; needs the `distributed` extra, see docs/distributed.md)")
    r.add_argument("--replicas", type=int, default=None, help="run N engine replicas behind this endpoint")
    r.add_argument("--ray-address", default=None, help="an existing Ray cluster (default: start a local one)")
    return p


EMULATED = "emulated:"


def make_engine(a: argparse.Namespace) -> LLMEngine:
    """The engine for parsed arguments: a checkpoint or preset on a torch device, or a model's shape
    on an emulated one (`--device emulated:...`, infer/sim/emulated.py)."""
    if a.device.startswith(EMULATED):
        from infer.sim.emulated import engine_from_args  # (only for an emulated device)
        return engine_from_args(a)
    for k in ("mean_depth", "replay_exits", "replay_workload", "emulated_attention", "emulated_slowdown"):
        if getattr(a, k, None) is not None:
            raise ParamError(k, f"--{k.replace('_', '-')} is for an emulated device (--device emulated:h100)")
    model, tok = load_model(a.model, a.dtype, a.device, a.r_max, a.load_format, a.layer_split)
    return LLMEngine(model, engine_config_from_args(a), tok)


def make_server(a: argparse.Namespace):
    """(uvicorn.Server, bound socket) for parsed arguments; used by main() and by the tests."""
    import torch
    import uvicorn

    if a.threads:
        torch.set_num_threads(a.threads)
    engine = make_engine(a)
    name = a.served_model_name or (a.model if a.model in PRESETS else Path(a.model).resolve().name)
    aeng = AsyncEngine(engine, max_waiting=a.max_waiting, stream_interval=a.stream_interval,
                       record_exits=a.record_exits, model_name=name)
    app = build_app(aeng, name, a.api_key, a.max_request_bytes, echo_logprobs_depth=a.echo_logprobs_depth)
    sock = bind(a.host, a.port)
    config = uvicorn.Config(app, log_level=a.log_level, timeout_graceful_shutdown=a.drain_timeout,
                            limit_concurrency=a.limit_concurrency, access_log=False)
    return uvicorn.Server(config), sock


def main(argv: list[str] | None = None) -> None:
    p = parser()
    a = p.parse_args(argv)
    if a.stream_interval < 1:  # before any weights load or Ray starts
        p.error(f"--stream-interval must be >= 1 (tokens per streamed chunk), got {a.stream_interval}")
    if a.record_exits is not None and a.replicas is not None:
        p.error("--record-exits records one engine's requests; it does not combine with --replicas")
    if a.replicas is not None:  # Ray is imported on this path only
        from .replicas import main as replicas_main
        # each replica builds its engine as this process would (an emulated device included)
        return replicas_main(a, make_engine)
    logging.basicConfig(level=a.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    server, sock = make_server(a)
    if a.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"warning: listening on {a.host}, reachable beyond this machine"
              + ("" if a.api_key else " without an API key"), flush=True)
    aeng = server.config.app.state.aeng
    if aeng.tokenizer is None:
        print("warning: this model has no tokenizer: /v1/completions takes token-id prompts only (no text, stop "
              "strings or chat)", file=sys.stderr, flush=True)
    c = aeng.engine.config
    split = f" (layer split {a.layer_split})" if a.layer_split else ""
    dev = getattr(aeng.engine.runner, "device_info", None)
    exits = dev and dev["exits"]
    on = (f" on an EMULATED {dev['device'][len(EMULATED):].upper()} (no weights; {dev['cost_model']} stage times; "
          + (f"exits replayed from {exits['replay_exits']}" if "replay_exits" in exits else
             f"exit depths binomial, mean {exits['mean_depth']:g}") + ")" if dev else "")
    run(server, sock, f"serving {a.model}{split}{on} ({c.policy}"
                      f"{f', refill K={c.min_coda_batch}' if c.policy == 'cdb' and c.refill else ''}, {c.kv_layout})")


if __name__ == "__main__":
    from looplm.cli import run

    run(main)

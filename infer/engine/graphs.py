"""CUDA graphs for the launches, one per (stage, padded batch, context blocks, r_max).

The engine captures, at start-up, every key its scheduler can emit (`ModelRunner.graph_keys`:
vLLM's capture sizes, the padded batch sizes, times the context buckets), so that no request waits
on a capture mid-serving; a key met later anyway (CB at a request's lower r_max) is captured then.

A launch's only per-stage input is its slots [N] (the scratch slot for padding), plus the items'
tokens for a stage that embeds them (prelude, fused): the body gathers position, loop step and
block table from the runner's persistent per-slot state (BatchState.gather), computes the KV rows
on the device, and writes only the runner's static state and the KV layout. Prompt chunks riding
along are items too (token slots, mixed.py): on the paged attention path a launch that carries
them replays a graph of its padded item count (the keys past max_batch_size: ModelRunner.launch_sizes). So a captured
graph replays after one device-to-device copy of that input. Warm-up and capture use the scratch
slot only, so they never touch a real sequence's KV or state.

Two rules every capture keeps, whoever calls it (`capture`, or `run` meeting a new key):
- inference mode. A body run with autograd on records a graph through the in-place writes into the
  runner's state and the KV pool (index_copy_), so every layer's saved K/V stays alive with it: at
  Ouro-1.4B's shape three core keys retain ~1 TiB (issue 62). Loaders freeze the weights too
  (`requires_grad_(False)`), but a model handed in with trainable weights must not matter here.
- largest key first (vLLM's order). All graphs share one memory pool; a segment allocated for a
  small key cannot serve a larger one, so smallest-first grows the pool to about twice the largest
  key's intermediates, while largest-first lets every smaller key reuse the first one's segments.
  memory.activation_reserve's decode peak (the largest decode body) is what the pool then needs.

`GraphStandIn` is the CPU stand-in with the same interface (tests, gpu_check's dry run): it traces
each key once and replays the trace, as a CUDA graph would (see its docstring). `make_graphs` is
the one place a runner gets its graph cache; the stand-in is installed by replacing it
(`use_stand_in`).
"""
from __future__ import annotations

import contextlib
import time
import weakref

import torch

from .sequence import Stage


def key_order(key: tuple) -> tuple:
    """Capture order: most items (padded batch), then widest context, first (the stage breaks ties).
    A stage that embeds tokens has slots + tokens as its input: its items are half its size."""
    stage, size, nb, r_max = key
    return (-(size // 2 if stage.reads_tokens else size), -nb, -r_max, stage.value)


class GraphCache:
    def __init__(self, runner):
        self.runner = runner
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor | None]] = {}
        self.pool = None
        self.stream: torch.cuda.Stream | None = None  # the capture stream, on the runner's device

    def _capture(self, key: tuple):
        with torch.cuda.device(self.runner.device):  # streams, the capture and its syncs on the runner's device
            return self._capture_on_device(key)

    def _capture_on_device(self, key: tuple):
        stage, size, nb, r_max = key
        r = self.runner
        slots = torch.full((size,), r.scratch_slot, dtype=torch.long, device=r.device)
        if stage.reads_tokens:
            slots[size // 2:] = 0  # token ids of the padding items
        if self.stream is None:  # (torch.cuda.graph's default is a stream of whichever device captures first)
            self.stream = torch.cuda.Stream(r.device)
        s = self.stream
        s.wait_stream(torch.cuda.current_stream(r.device))
        with torch.cuda.stream(s):
            for _ in range(2):  # warm-up (allocator, cuBLAS workspaces) on the scratch slot only
                r.body(stage, slots, nb, r_max)
        torch.cuda.current_stream(r.device).wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=self.pool, stream=s):
            out = r.body(stage, slots, nb, r_max)
        self.pool = g.pool()
        self.graphs[key] = (g, slots, out)
        return self.graphs[key]

    def _captured(self, key: tuple):
        """Capture one key, in inference mode (module docstring)."""
        if torch.is_inference_mode_enabled():
            return self._capture(key)
        with torch.inference_mode():
            return self._capture(key)

    def capture(self, keys: list[tuple]) -> dict:
        """Capture every key of `keys` not captured yet, largest first; returns the count and the
        seconds it took."""
        t0, n = time.perf_counter(), 0
        for key in sorted(keys, key=key_order):
            if key not in self.graphs:
                self._captured(key)
                n += 1
        return {"captured": n, "seconds": time.perf_counter() - t0}

    def clear(self) -> list[tuple]:
        """Drop every graph and the pool (the next captures start a new one); returns their keys."""
        keys = list(self.graphs)
        self.graphs.clear()
        self.pool = None
        return keys

    def run(self, stage: Stage, slots: torch.Tensor, nb: int, r_max: int = 0):
        key = (stage, slots.shape[0], nb, r_max if stage is Stage.FUSED else 0)
        g, static, out = self.graphs.get(key) or self._captured(key)
        static.copy_(slots, non_blocking=True)
        g.replay()
        return out


class GraphStandIn(GraphCache):
    """A CUDA graph stand-in for CPU (tests, gpu_check's dry run): GraphCache's interface and capture
    rules (inference mode, largest key first), with a traced FX graph per key in place of a CUDA graph.

    What a CUDA graph does that an eager CPU run does not, and this reproduces:
    - the body runs once, at capture, on the scratch slot only; every later call replays the ops
      recorded then on the new input. Anything the body decided on the host (a Python branch on a
      tensor's value, a host-made tensor, a shape read from the data) is frozen at capture: make_fx
      records the aten ops of the real run, with the runner's buffers (state, loop steps, KV pool,
      block tables) as the very tensors the replay mutates;
    - a graph's output is a static buffer, valid until the next replay of ANY graph (they share one
      memory pool): each replay first poisons every key's output (NaN, or -1 for integers), so an
      engine that reads an output after the next launch reads garbage and fails the parity tests;
    - contexts are bucketed to powers of two (BatchState.bucketed), as on CUDA, so the keys are CUDA's."""

    def __init__(self, runner):
        super().__init__(runner)
        self.graphs: dict[tuple, tuple[torch.fx.GraphModule, torch.Tensor | None]] = {}
        self.replays = 0

    def _capture(self, key: tuple):
        from torch._guards import TracingContext, tracing
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.fx.experimental.proxy_tensor import make_fx
        stage, size, nb, r_max = key
        r = self.runner
        slots = torch.full((size,), r.scratch_slot, dtype=torch.long, device=r.device)
        if stage.reads_tokens:
            slots[size // 2:] = 0  # token ids of the padding items (as GraphCache's capture)
        # one fake mode for the trace's metadata: without it make_fx ("real" mode) builds a FakeTensorMode
        # for every value it records, each extracting the Python stack (1-2 ms at pytest's depth: most
        # of a trace's time)
        with tracing(TracingContext(FakeTensorMode(allow_fallback_kernels=True))):
            gm = make_fx(lambda inp: r.body(stage, inp, nb, r_max))(slots)
        out = gm(slots)  # (the capture's own run: scratch slot only, like GraphCache's warm-up)
        self.graphs[key] = (gm, None if out is None else torch.empty_like(out))
        return self.graphs[key]

    def run(self, stage: Stage, slots: torch.Tensor, nb: int, r_max: int = 0):
        key = (stage, slots.shape[0], nb, r_max if stage is Stage.FUSED else 0)
        gm, static = self.graphs.get(key) or self._captured(key)
        for _, buf in self.graphs.values():  # the shared pool: every earlier output is gone now
            if buf is not None:
                buf.fill_(float("nan") if buf.is_floating_point() else -1)
        out = gm(slots)
        self.replays += 1
        if static is None:
            return None
        static.copy_(out)
        return static


def make_graphs(runner, device: torch.device, cuda_graphs: bool) -> GraphCache | None:
    """The runner's graph cache: CUDA graphs where `cuda_graphs` (the config's resolved setting),
    else none. Holds a weak proxy of the runner (no reference cycle: a dropped engine frees its pool)."""
    if cuda_graphs and device.type != "cuda":
        raise ValueError("cuda_graphs needs a CUDA device")
    return GraphCache(weakref.proxy(runner)) if cuda_graphs else None


def _stand_in_graphs(runner, device: torch.device, cuda_graphs: bool) -> GraphCache:
    runner.batch_state.bucketed = True  # contexts bucketed as on CUDA, so the keys are CUDA's
    return GraphStandIn(weakref.proxy(runner))


@contextlib.contextmanager
def use_stand_in():
    """Inside: every ModelRunner built on a CPU gets the graph stand-in, captured at engine start-up
    as CUDA graphs are (the start-up path of a CUDA engine, run on CPU: tests, gpu_check's dry run)."""
    global make_graphs
    real = make_graphs

    def pick(runner, device, cuda_graphs):
        return _stand_in_graphs(runner, device, cuda_graphs) if device.type != "cuda" else real(runner, device,
                                                                                                  cuda_graphs)
    make_graphs = pick
    try:
        yield
    finally:
        make_graphs = real


def autograd_leaks(runner) -> list[str]:
    """What of a runner holds autograd state (empty: nothing): each tensor of the runner, its KV layout
    and batch state (their attributes, and the dicts / lists / tuples in them, 3 levels) and of its
    graphs' entries (static inputs and outputs) with a grad_fn or requires_grad. A capture with autograd
    on chains every saved activation to the runner's buffers (issue 62: ~1 TiB at Ouro-1.4B's shape).
    Weights that require grad are no leak by themselves (a model handed to LLMEngine may): what autograd
    recorded on them is."""
    roots = [("runner", runner), ("runner.layout", getattr(runner, "layout", None)),
             ("runner.batch_state", getattr(runner, "batch_state", None))]
    out, seen = [], set()
    for owner, obj in roots:
        for name, v in _attrs(obj).items():
            for path, t in _tensors(v, f"{owner}.{name}"):
                if id(t) not in seen and (t.grad_fn is not None or t.requires_grad):
                    out.append(f"{path}: " + (f"grad_fn {type(t.grad_fn).__name__}" if t.grad_fn is not None
                                              else "requires_grad"))
                seen.add(id(t))
    g = getattr(runner, "graphs", None)
    for key, entry in (getattr(g, "graphs", None) or {}).items():
        for path, t in _tensors(entry, f"graph {key[0].value} {key[1:]}"):
            if t.grad_fn is not None or t.requires_grad:
                out.append(f"{path}: {'grad_fn' if t.grad_fn is not None else 'requires_grad'}")
    return out


def _tensors(v, path: str, depth: int = 0):
    """(path, tensor) of `v` and of the dicts, lists and tuples in it (3 levels)."""
    if isinstance(v, torch.Tensor):
        yield path, v
    elif depth < 3 and isinstance(v, dict):
        for k, x in v.items():
            yield from _tensors(x, f"{path}[{k!r}]", depth + 1)
    elif depth < 3 and isinstance(v, (list, tuple)):
        for i, x in enumerate(v):
            yield from _tensors(x, f"{path}[{i}]", depth + 1)


def _attrs(obj) -> dict:
    if obj is None:
        return {}
    if hasattr(obj, "__dict__"):
        return vars(obj)
    return {s: getattr(obj, s) for s in getattr(type(obj), "__slots__", ()) if hasattr(obj, s)}

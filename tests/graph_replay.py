"""A CUDA graph stand-in for CPU tests (issue 38): `ReplayGraphs` has GraphCache's interface, traces
each key once and replays the trace, as a CUDA graph would.

What a CUDA graph does that an eager CPU run does not, and this reproduces:
- the body runs once, at capture, on the scratch slot only (GraphCache._capture); every later call
  replays the ops recorded then on the new input. Anything the body decided on the host (a Python
  branch on a tensor's value, a host-made tensor, a shape read from the data) is frozen at capture:
  make_fx records the aten ops of the real run, with the runner's buffers (state, loop steps, KV
  pool, block tables) as the very tensors the replay mutates;
- a graph's output is a static buffer, valid until the next replay of ANY graph (they share one
  memory pool): each replay first poisons every key's output (NaN, or -1 for integers), so an engine
  that reads an output after the next launch reads garbage and fails the parity tests;
- contexts are bucketed to powers of two (BatchState.bucketed), as on CUDA, so the keys are CUDA's.
"""
from __future__ import annotations

import weakref

import torch
from torch._guards import TracingContext, tracing
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from infer.engine.graphs import GraphCache
from infer.engine.sequence import Stage


class ReplayGraphs(GraphCache):
    """GraphCache with a traced FX graph per key in place of a CUDA graph (`capture` is GraphCache's)."""

    def __init__(self, runner):
        super().__init__(weakref.proxy(runner))
        self.graphs: dict[tuple, tuple[torch.fx.GraphModule, torch.Tensor | None]] = {}
        self.replays = 0

    def _capture(self, key: tuple):
        stage, size, nb, r_max = key
        r = self.runner
        slots = torch.full((size,), r.scratch_slot, dtype=torch.long, device=r.device)
        if stage.reads_tokens:
            slots[size // 2:] = 0  # token ids of the padding items (as GraphCache._capture)
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
        gm, static = self.graphs.get(key) or self._capture(key)
        for _, buf in self.graphs.values():  # the shared pool: every earlier output is gone now
            if buf is not None:
                buf.fill_(float("nan") if buf.is_floating_point() else -1)
        out = gm(slots)
        self.replays += 1
        if static is None:
            return None
        static.copy_(out)
        return static


def install(engine) -> ReplayGraphs:
    """Run `engine`'s decode stages through graph replay (its runner must be a ModelRunner)."""
    r = engine.runner
    r.graphs = ReplayGraphs(r)
    r.batch_state.bucketed = True
    return r.graphs

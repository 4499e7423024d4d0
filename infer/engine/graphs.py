"""CUDA graphs for the decode stages, one per (stage, padded batch, context blocks, r_max).

The engine captures, at start-up, every key its scheduler can emit (`ModelRunner.graph_keys`:
vLLM's capture sizes, the padded batch sizes, times the context buckets), so that no request waits
on a capture mid-serving; a key met later anyway (CB at a request's lower r_max) is captured then.

A decode stage's only per-stage input is its slots [N] (the scratch slot for padding), plus the
items' tokens for a stage that embeds them (prelude, fused): the body gathers position, loop step
and block table from the runner's persistent per-slot state (BatchState.gather), computes the KV
rows on the device, and writes only the runner's static state and the KV layout. So a captured
graph replays after one device-to-device copy of that input. All graphs share one memory pool.
Warm-up and capture use the scratch slot only, so they never touch a real sequence's KV or state.
"""
from __future__ import annotations

import time

import torch

from .sequence import Stage


class GraphCache:
    def __init__(self, runner):
        self.runner = runner
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor | None]] = {}
        self.pool = None

    def _capture(self, key: tuple):
        with torch.cuda.device(self.runner.device):  # streams, the capture and its syncs on the runner's device
            return self._capture_on_device(key)

    def _capture_on_device(self, key: tuple):
        stage, size, nb, r_max = key
        r = self.runner
        slots = torch.full((size,), r.scratch_slot, dtype=torch.long, device=r.device)
        if stage.reads_tokens:
            slots[size // 2:] = 0  # token ids of the padding items
        s = torch.cuda.Stream(r.device)
        s.wait_stream(torch.cuda.current_stream(r.device))
        with torch.cuda.stream(s):
            for _ in range(2):  # warm-up (allocator, cuBLAS workspaces) on the scratch slot only
                r.body(stage, slots, nb, r_max)
        torch.cuda.current_stream(r.device).wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=self.pool):
            out = r.body(stage, slots, nb, r_max)
        self.pool = g.pool()
        self.graphs[key] = (g, slots, out)
        return self.graphs[key]

    def capture(self, keys: list[tuple]) -> dict:
        """Capture every key of `keys` not captured yet; returns the count and the seconds it took."""
        t0, n = time.perf_counter(), 0
        for key in keys:
            if key not in self.graphs:
                self._capture(key)
                n += 1
        return {"captured": n, "seconds": time.perf_counter() - t0}

    def run(self, stage: Stage, slots: torch.Tensor, nb: int, r_max: int = 0):
        key = (stage, slots.shape[0], nb, r_max if stage is Stage.FUSED else 0)
        g, static, out = self.graphs.get(key) or self._capture(key)
        static.copy_(slots, non_blocking=True)
        g.replay()
        return out

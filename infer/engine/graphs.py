"""CUDA graphs for the decode stages, captured lazily per (stage, padded batch, context bucket).

Every decode stage reads its inputs from static buffers and writes only the runner's static
state and the KV layout, so a captured graph replays with new metadata copied into its input
buffers. All graphs share one memory pool. Warm-up and capture use the scratch slot and the
layout's scratch row only, so they never touch a real sequence's KV or state.
"""
from __future__ import annotations

import torch

from .sequence import Stage


class GraphCache:
    def __init__(self, runner):
        self.runner = runner
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, dict[str, torch.Tensor], torch.Tensor | None]] = {}
        self.pool = None

    def _static(self, N: int, nb: int) -> dict[str, torch.Tensor]:
        r, dev = self.runner, self.runner.device
        z = lambda *shape: torch.zeros(*shape, dtype=torch.long, device=dev)  # noqa: E731
        return {"ids": z(N), "pos": z(N), "rows": torch.full((N,), r.layout.scratch_row, dtype=torch.long, device=dev),
                "steps": torch.ones(N, dtype=torch.long, device=dev), "bt": z(N, nb),
                "ctx_len": torch.ones(N, dtype=torch.long, device=dev),
                "slots": torch.full((N,), r.scratch_slot, dtype=torch.long, device=dev)}

    def _capture(self, key: tuple):
        stage, N, nb, r_max = key
        r = self.runner
        static = self._static(N, nb)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):  # warm-up (allocator, cuBLAS workspaces) on scratch rows only
                r.body(stage, static, r_max)
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=self.pool):
            out = r.body(stage, static, r_max)
        self.pool = g.pool()
        self.graphs[key] = (g, static, out)
        return self.graphs[key]

    def run(self, stage: Stage, meta, r_max: int = 0):
        N, nb = len(meta.slots), len(meta.bt[0])
        key = (stage, N, nb, r_max if stage is Stage.FUSED else 0)
        g, static, out = self.graphs.get(key) or self._capture(key)
        host = {"ids": meta.ids, "pos": meta.pos, "rows": meta.rows, "steps": meta.steps, "bt": meta.bt,
                "ctx_len": meta.ctx_len, "slots": meta.slots}
        for k, v in host.items():
            static[k].copy_(torch.tensor(v, dtype=torch.long).pin_memory(), non_blocking=True)
        g.replay()
        return out

"""Preemption by swapping: a sequence's KV rows and per-slot state move to host memory and back.

What is copied is everything the sequence's future depends on: its KV rows in every prelude /
core / coda layer and every depth slot of the layout (`KVLayout.read_rows`), and its state slot
(loop state, Huginn's injection, the exit criterion's memory). The exit tracker, pipelined scores
and token lists stay on the `Sequence` (pure Python). Copies are exact, so a swapped sequence
continues with the numbers it would have had, under every layout; recompute-by-prefill would not
be (a generated token's KV depends on its exit depth, and under `shared` on the order of writes).

On CUDA the host copies are pinned and asynchronous on the current stream: the stage that next
writes into the freed blocks is queued after the copy, and the copy back is queued before the
stage that reads the new blocks.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .block_manager import kv_rows

if TYPE_CHECKING:
    from kv_layouts import KVLayout

    from .scheduler import SwapOp


def _to_host(t: torch.Tensor) -> torch.Tensor:
    if t.device.type != "cuda":
        return t.clone()
    h = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    h.copy_(t, non_blocking=True)
    return h


def block_rows(blocks: list[int], block_size: int, device) -> torch.Tensor:
    return torch.tensor(kv_rows(blocks, block_size, len(blocks) * block_size), dtype=torch.long, device=device)


def swap_ops(layout: KVLayout, bufs: list[torch.Tensor | None], block_size: int,
             host: dict[int, tuple[list[torch.Tensor], list[torch.Tensor | None]]], ops: list[SwapOp]) -> None:
    """Apply `ops` to a KV layout and the per-slot state buffers `bufs` (loop state, injection,
    criterion memory; None where the model has none); `host` maps seq_id -> host copies."""
    bs, dev = block_size, layout.k_core.device
    for op in ops:
        sid = op.seq.seq_id
        if op.kind == "out":
            kv = [_to_host(t) for t in layout.read_rows(block_rows(op.blocks, bs, dev))]
            host[sid] = kv, [_to_host(b[op.slot]) if b is not None else None for b in bufs]
        elif op.kind == "in":
            kv, state = host.pop(sid)
            rows = block_rows(op.blocks, bs, dev)[: kv[0].shape[1]]  # it may come back with one block more
            layout.write_rows(rows, kv)
            for b, x in zip(bufs, state):
                if b is not None:
                    b[op.slot] = x.to(dev, non_blocking=True)
        else:
            host.pop(sid, None)

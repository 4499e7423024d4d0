"""Depth-indexed KV: r_max slots per core layer per token; loop step s writes and reads slot s.
(`first_then_shared` subclasses it with S slots and step s -> slot min(s, S); the fill below is
written over the layout's slots and serves both.)

A token that exited at depth d < r_max never wrote slots d+1..r_max. `last_exited` fill copies
its depth-d K/V into them on exit, so a later token that loops deeper attends to the exit-depth
state (accuracy-preserving; what the CDB paper does). `full_depth` is the same storage for a run
where every token runs every step (nothing to fill).
"""
from __future__ import annotations

import torch

from .base import KVLayout


class DepthIndexedKV(KVLayout):
    name = "last_exited"
    depth_slots_exact = True

    @classmethod
    def depth_slots(cls, cfg) -> int:
        return cfg.r_max

    @classmethod
    def fill_depth_slots(cls, cfg, depth: int) -> int:
        return max(0, cls.depth_slots(cfg) - depth)

    def on_exit(self, rows: torch.Tensor, depths: torch.Tensor) -> None:
        """Fill the depth slots d+1..slots that a token exiting at depth d skipped with its depth-d
        K/V (`last_exited`: slots = r_max; `first_then_shared`: slots = S, so d >= S fills nothing).
        Static shapes and no host sync (it runs inside the coda's CUDA graph): every (token, depth
        slot) pair is a copy, the pairs with nothing to fill (depth slots <= the exit depth, and
        padding, whose depth is 0) copy the scratch row onto itself."""
        R = self.num_rows + 1
        slot = torch.arange(1, self.num_depth_slots + 1, device=rows.device)  # 1-based depth slots
        fill = (slot[None, :] > depths[:, None]) & (depths[:, None] >= 1)  # [n, slots]: the skipped slots
        scratch = torch.full_like(rows, self.scratch_row)[:, None]
        # a filled slot k > d has d < slots, so the source is d's own private slot d
        dst = torch.where(fill, (slot[None, :] - 1) * R + rows[:, None], scratch).view(-1)
        src = torch.where(fill, (depths[:, None] - 1) * R + rows[:, None], scratch).view(-1)
        for cache in (self.k_core, self.v_core):
            cache[:, dst] = cache[:, src]


class FullDepthKV(DepthIndexedKV):
    name = "full_depth"
    disables_exits = True

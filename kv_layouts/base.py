"""The KV-layout interface: preallocated K/V storage for every attention layer of a looped LM.

Storage is addressed by *rows*: one row per token position of a sequence, handed out by the
caller's allocator (the engine's block manager, or the reference decoder's range). Row
`num_rows` is a scratch row: padded batch items write there and nobody reads it, so shapes stay
static. Non-looped layers (prelude, coda) keep one copy per row; how the core layers map
`(loop step, row)` to a depth slot is what a layout decides: `depth_slots(cfg)` depth slots per row
(`num_depth_slots`; the engine's plain "slot" is a sequence's state slot, not this).
"""
from __future__ import annotations

import torch

from looplm.config import LoopConfig


class KVLayout:
    name = "base"
    disables_exits = False  # a layout for runs where every token runs every loop step
    # every loop step of a position keeps its own K/V, so a prompt chunk reads the earlier chunks at
    # its own step: chunked prefill equals the whole-prompt prefill (not so with one shared slot)
    depth_slots_exact = False

    @classmethod
    def depth_slots(cls, cfg: LoopConfig) -> int:
        """Slots per row per core layer."""
        return 1

    @classmethod
    def slots_per_row(cls, cfg: LoopConfig) -> int:
        """K/V slots (one per attention layer and depth slot) that one token position occupies."""
        return cfg.n_prelude + cfg.n_coda + cfg.n_core * cls.depth_slots(cfg)

    @classmethod
    def bytes_per_row(cls, cfg: LoopConfig, dtype: torch.dtype) -> int:
        per_slot = 2 * cfg.num_kv_heads * cfg.head_dim * torch.empty((), dtype=dtype).element_size()
        return per_slot * cls.slots_per_row(cfg)

    def __init__(self, cfg: LoopConfig, num_rows: int, dtype: torch.dtype, device: torch.device | str = "cpu"):
        if num_rows < 1:
            raise ValueError(f"a KV layout needs at least one row, got {num_rows}")
        self.cfg, self.num_rows = cfg, num_rows
        self.scratch_row = num_rows
        self.num_depth_slots = self.depth_slots(cfg)
        R, KV, D = num_rows + 1, cfg.num_kv_heads, cfg.head_dim
        n_plain = cfg.n_prelude + cfg.n_coda
        # [layer, row, kv_head, head_dim] and [layer, depth_slot * rows, kv_head, head_dim]
        self.k_plain = torch.zeros(n_plain, R, KV, D, dtype=dtype, device=device)
        self.v_plain = torch.zeros_like(self.k_plain)
        self.k_core = torch.zeros(cfg.n_core, self.num_depth_slots * R, KV, D, dtype=dtype, device=device)
        self.v_core = torch.zeros_like(self.k_core)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.k_plain, self.v_plain, self.k_core, self.v_core))

    def cache(self, stage: str, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The flat K and V storage [slots, kv_heads, head_dim] of one layer."""
        if stage == "core":
            return self.k_core[layer], self.v_core[layer]
        i = layer if stage == "prelude" else self.cfg.n_prelude + layer
        return self.k_plain[i], self.v_plain[i]

    @classmethod
    def fill_depth_slots(cls, cfg: LoopConfig, depth: int) -> int:
        """Core depth slots that `on_exit` fills for a token exiting at `depth` (the simulator
        prices these copies): none by default."""
        return 0

    def depth_slot_of(self, steps: torch.Tensor) -> torch.Tensor:
        """The 0-based depth slot that core loop `steps` (1-based) write and read: step s -> slot
        min(s, slots) - 1 (depth-indexed: s - 1; one shared slot: 0; first_then_shared: min(s, S) - 1)."""
        return (steps - 1).clamp(0, self.num_depth_slots - 1)

    def index(self, stage: str, step: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Flat row index (depth slot major) of `rows` for a token at loop `step` (1-based; ignored outside the core).
        `step` broadcasts against `rows`."""
        if stage != "core" or self.num_depth_slots == 1:
            return rows
        return self.depth_slot_of(step) * (self.num_rows + 1) + rows

    def _core_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """Every depth slot of `rows` in the core storage, depth slot major."""
        slot = torch.arange(self.num_depth_slots, device=rows.device)[:, None] * (self.num_rows + 1)
        return (slot + rows[None, :]).reshape(-1)

    def read_rows(self, rows: torch.Tensor) -> list[torch.Tensor]:
        """Copies of everything stored for `rows`: every prelude / coda layer and every depth slot
        of every core layer (what a swapped-out request takes to host memory)."""
        c = self._core_rows(rows)
        return [self.k_plain[:, rows], self.v_plain[:, rows], self.k_core[:, c], self.v_core[:, c]]

    def write_rows(self, rows: torch.Tensor, data: list[torch.Tensor]) -> None:
        """Store `read_rows`' output at `rows` (possibly other rows than it was read from)."""
        c = self._core_rows(rows)
        for t, idx, d in zip((self.k_plain, self.v_plain, self.k_core, self.v_core), (rows, rows, c, c), data):
            t[:, idx] = d.to(t.device, non_blocking=True)

    def on_exit(self, rows: torch.Tensor, depths: torch.Tensor) -> None:
        """Called once a decode token has left the loop at `depths` (its rows and exit depths)."""

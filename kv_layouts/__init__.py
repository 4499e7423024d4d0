"""KV layouts for looped LMs: `last_exited` (depth-indexed, the default), `full_depth`, `shared`."""
from __future__ import annotations

import torch

from looplm.config import LoopConfig
from looplm.errors import ParamError

from .base import KVLayout
from .depth_indexed import DepthIndexedKV, FullDepthKV
from .shared import SharedKV

LAYOUTS: dict[str, type[KVLayout]] = {"last_exited": DepthIndexedKV, "full_depth": FullDepthKV, "shared": SharedKV}
DEFAULT_LAYOUT = "last_exited"  # a checkpoint that names no layout is served with this one


def layout_class(name: str) -> type[KVLayout]:
    if name not in LAYOUTS:
        raise ParamError("kv_layout", f"unknown kv_layout {name!r}; supported: {sorted(LAYOUTS)}")
    return LAYOUTS[name]


def make_layout(name: str, cfg: LoopConfig, num_rows: int, dtype: torch.dtype = torch.float32,
                device: torch.device | str = "cpu") -> KVLayout:
    """Allocate a layout with `num_rows` token rows, once."""
    return layout_class(name)(cfg, num_rows, dtype, device)


__all__ = ["KVLayout", "DepthIndexedKV", "FullDepthKV", "SharedKV", "LAYOUTS", "DEFAULT_LAYOUT", "layout_class",
           "make_layout"]

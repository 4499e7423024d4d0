"""KV layouts for looped LMs: `last_exited` (depth-indexed, the default), `full_depth`, `shared`,
and `first_then_shared[:S]` (S slots: step s -> slot min(s, S); S = 2 unless named)."""
from __future__ import annotations

import torch

from looplm.config import LoopConfig
from looplm.errors import ParamError

from . import first_then_shared as _fts
from .base import KVLayout
from .depth_indexed import DepthIndexedKV, FullDepthKV
from .first_then_shared import FirstThenSharedKV
from .shared import SharedKV

# the fixed-name layouts (train/kv_emulation.py emulates each of these); the parametric family
# `first_then_shared[:S]` is parsed by layout_class
LAYOUTS: dict[str, type[KVLayout]] = {"last_exited": DepthIndexedKV, "full_depth": FullDepthKV, "shared": SharedKV}
LAYOUT_NAMES = (*LAYOUTS, f"{_fts.FAMILY}[:S]")  # every accepted name, for help texts and errors
DEFAULT_LAYOUT = "last_exited"  # a checkpoint that names no layout is served with this one


def layout_class(name: str) -> type[KVLayout]:
    """The class of a layout name (`first_then_shared:S`: one cached subclass per S; S is checked
    against the model's r_max by `depth_slots(cfg)`)."""
    if name in LAYOUTS:
        return LAYOUTS[name]
    cls = _fts.parse(name) if isinstance(name, str) else None
    if cls is None:
        raise ParamError("kv_layout", f"unknown kv_layout {name!r}; supported: {', '.join(LAYOUT_NAMES)}")
    return cls


def make_layout(name: str, cfg: LoopConfig, num_rows: int, dtype: torch.dtype = torch.float32,
                device: torch.device | str = "cpu") -> KVLayout:
    """Allocate a layout with `num_rows` token rows, once."""
    return layout_class(name)(cfg, num_rows, dtype, device)


__all__ = ["KVLayout", "DepthIndexedKV", "FullDepthKV", "SharedKV", "FirstThenSharedKV", "LAYOUTS", "LAYOUT_NAMES",
           "DEFAULT_LAYOUT", "layout_class", "make_layout"]

"""First-then-shared KV: S depth slots per core layer per token (default S = 2); loop step s
writes and reads slot min(s, S).

The first S - 1 loop steps of a token keep private slots; every step >= S overwrites one shared
slot, which ends up holding the token's last computed step. Core KV memory per token is S slots:
between `shared` (S = 1, which this layout equals) and `last_exited` (S = r_max, which it equals).
Named `first_then_shared` (S = 2) or `first_then_shared:S`; 1 <= S <= the model's r_max.

Exits. A token that exits at depth d < S never wrote slots d+1..S. Its authors require r_min >= S
for gated exits; here the on-exit fill copies the depth-d K/V into those skipped private slots
(what `last_exited` does for its slots d+1..r_max: `DepthIndexedKV.on_exit` serves both), so any
r_min works and a later, deeper token reads the exit-depth state there. A token exiting at d >= S
has written slot S last at step d: nothing to fill.

What a reader sees at step s in slot k = min(s, S) of an earlier, finished position j of exit depth
d_j: step k when k < S and d_j >= k; its exit step d_j when d_j < k (the fill); for k = S, step
d_j (its last write, or the fill when d_j < S).

Exactness. The prompt is prefilled depth-major over all its positions, so at step s every prompt
position's slot min(s, S) holds step s when it is read: prefill equals the depth-indexed one.
Chunked prefill does not: a later chunk at step s >= S would read an earlier chunk's slot S,
which already holds that chunk's step r_max, not step s. Nor does prefix caching (a cached block
holds only each position's final state in slot S). Both are refused (`depth_slots_exact = False`,
checked by infer/engine/config.py's check_chunking / check_prefix_caching), for every S; at S =
r_max they would be exact, but the check knows only the layout's name.
"""
from __future__ import annotations

from looplm.config import LoopConfig
from looplm.errors import ParamError

from .depth_indexed import DepthIndexedKV

FAMILY = "first_then_shared"
DEFAULT_S = 2


class FirstThenSharedKV(DepthIndexedKV):
    """S = `shared_from`: the loop step from which a token's steps share one slot."""
    name = FAMILY
    shared_from = DEFAULT_S
    depth_slots_exact = False

    @classmethod
    def depth_slots(cls, cfg: LoopConfig) -> int:
        if cls.shared_from > cfg.r_max:
            raise ParamError("kv_layout", f"kv_layout {cls.name!r}: S={cls.shared_from} exceeds the model's "
                                          f"r_max={cfg.r_max} (S must be in 1..r_max)")
        return cls.shared_from


_BY_S: dict[int, type[FirstThenSharedKV]] = {DEFAULT_S: FirstThenSharedKV}


def first_then_shared(S: int) -> type[FirstThenSharedKV]:
    """The layout class for S (one subclass per S, cached)."""
    if S not in _BY_S:
        _BY_S[S] = type(f"FirstThenSharedKV{S}", (FirstThenSharedKV,), {"name": f"{FAMILY}:{S}", "shared_from": S})
    return _BY_S[S]


def parse(name: str) -> type[FirstThenSharedKV] | None:
    """The class of `first_then_shared` / `first_then_shared:S`; None for a name of another family.
    A malformed S raises ParamError("kv_layout")."""
    if name == FAMILY:
        return FirstThenSharedKV
    if not name.startswith(FAMILY + ":"):
        return None
    s = name[len(FAMILY) + 1:]
    if not (s.isascii() and s.isdigit()) or int(s) < 1:
        raise ParamError("kv_layout", f"kv_layout {name!r}: S must be an integer >= 1 ({FAMILY}:S), got {s!r}")
    return first_then_shared(int(s))

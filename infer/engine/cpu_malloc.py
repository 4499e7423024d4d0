"""glibc malloc on a CPU engine: keep freed memory instead of giving it back to the OS at every launch.

A launch on the CPU allocates and frees the same large tensors every time (activations, gathered
context, logits: hundreds of KB to MB). glibc serves a block above its mmap threshold with a fresh
mmap and unmaps it on free, so each launch pays page faults for memory it just released; the
threshold adapts upwards only after certain frees, so whether a process ever stops paying depends on
the order of its first allocations. Measured on ouro-demo at batch 64 (infer/bench/reference.py): the
same run takes 2.3-2.9 s or 4.0-4.8 s from process to process, 2.3-2.9 s every time with the
thresholds fixed. vLLM's CPU backend and PyTorch's CPU tuning guide answer this with tcmalloc or
jemalloc via LD_PRELOAD; fixing glibc's two thresholds (mallopt, what MALLOC_MMAP_THRESHOLD_ /
MALLOC_TRIM_THRESHOLD_ set) gets the same effect without a new library. Process-wide, once; a
process that set either variable itself, or runs another allocator, is left alone.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
KEEP_BYTES = 256 << 20  # blocks below this come from the heap, and up to this much freed memory stays there
_done: list[bool] = []


def keep_freed_memory() -> bool:
    """Fix glibc's mmap and trim thresholds at KEEP_BYTES (module docstring); True if set now or before."""
    if _done:
        return _done[0]
    ok = False
    name = ctypes.util.find_library("c")  # (glibc: "libc.so.6"; mallopt is glibc's)
    if name and name.startswith("libc.so") and not any(
            v in os.environ for v in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "LD_PRELOAD")):
        try:
            libc = ctypes.CDLL(name)
            ok = bool(libc.mallopt(M_MMAP_THRESHOLD, KEEP_BYTES)) and bool(libc.mallopt(M_TRIM_THRESHOLD, KEEP_BYTES))
        except (OSError, AttributeError):
            ok = False
    _done.append(ok)
    return ok

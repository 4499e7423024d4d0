"""Shared KV: one slot per core layer per token, overwritten at every loop step.

A token attends to earlier positions' last written state (their exit depth) and to its own
current-step K/V. Core KV memory is 1/r_max of depth-indexed. This is Huginn's `compress-s4`
lookup; models may need `train/shared_kv.py` to keep accuracy under it.
"""
from __future__ import annotations

from .base import KVLayout


class SharedKV(KVLayout):
    name = "shared"

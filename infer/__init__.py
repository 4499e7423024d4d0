"""The Continuous Depth Batching inference engine: `from infer import LLM, SamplingParams`."""
import importlib

_EXPORTS = {"LLM": "llm", "SamplingParams": "sampling", "LLMEngine": "engine", "EngineConfig": "engine",
            "RequestOutput": "engine"}
__all__ = list(_EXPORTS)


def __getattr__(name: str):  # lazy: the scheduler and bookkeeping import without torch
    if name not in _EXPORTS:
        raise AttributeError(f"module 'infer' has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)

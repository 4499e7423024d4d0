"""Looped language models (Ouro- and Huginn-style): config, layers, checkpoint IO, exit criteria.

Attributes load lazily so that pure-Python parts (config, policy) import without torch.
"""
import importlib

_EXPORTS = {
    "LoopConfig": "config", "ExitPolicy": "policy", "ExitTracker": "policy", "LoopedLM": "model",
    "LoopOutput": "model", "build_model": "io", "load_pretrained": "io", "load_tokenizer": "io",
    "save_pretrained": "io", "resolve_dtype": "io", "PRESETS": "presets", "preset_config": "presets",
    "tiny_model": "presets", "PAPER_MODELS": "presets", "paper_config": "presets", "paper_model": "presets",
    "dummy_model": "presets", "ParamError": "errors",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'looplm' has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)

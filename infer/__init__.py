"""The Continuous Depth Batching inference engine: `from infer import LLM, SamplingParams`.

Subpackages: `engine/` (the core: scheduler, runner, stages, reference decoder), `sim/` (the virtual
device: cost models, the simulator, the emulated device, and the workloads and summaries the
benchmarks share), `serving/` (the OpenAI-compatible server), `bench/` (the measurement CLIs)."""
import importlib

_EXPORTS = {"LLM": "engine.llm", "SamplingParams": "engine.sampling_params", "LLMEngine": "engine.llm_engine",
            "EngineConfig": "engine.config", "RequestOutput": "engine.llm_engine"}
__all__ = list(_EXPORTS)


def __getattr__(name: str):  # lazy: the scheduler and bookkeeping import without torch
    if name not in _EXPORTS:
        raise AttributeError(f"module 'infer' has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)

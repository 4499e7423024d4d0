"""The CUDA discipline, checked on CPU (issue 38): what a GPU run needs and a CPU run would not notice.

Lifetime: a dropped engine frees its KV pool at once. A reference cycle anywhere in it (a bound method
kept on the object it is bound to, a child holding its parent) keeps the pool alive until the cyclic
GC's next pass, which on a GPU means out of memory at the next engine of a benchmark, and later engines
sized from what the earlier ones still hold. The tests turn the cyclic GC off, so only reference
counting can free the pool.
"""
import gc
import weakref

import pytest
import torch

from infer import LLM, EngineConfig, LLMEngine, SamplingParams

from helpers import ARCHS, engine_settings, model, random_requests


def _pool_refs(eng: LLMEngine) -> list[weakref.ref]:
    """Weak references to the engine's KV pool and per-slot state tensors."""
    r = eng.runner
    held = [v for v in vars(r.layout).values() if isinstance(v, torch.Tensor)] + [r.state]
    assert held and sum(t.numel() for t in held) > 0
    return [weakref.ref(t) for t in held]


def _dropped(refs: list[weakref.ref]) -> list[int]:
    return [i for i, r in enumerate(refs) if r() is not None]


@pytest.fixture
def no_cyclic_gc():
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


SETTINGS = {
    "cdb-refill": engine_settings("refill_k1", "last_exited", False),
    "cb": engine_settings("cb", "shared", False),
    "lookahead-pipeline": engine_settings("norefill", "full_depth", True),
    "separate-prefill": dict(engine_settings("refill_k1", "last_exited", False), prefill="separate"),
    "speculation": dict(engine_settings("refill_k1", "last_exited", False), speculative_tokens=2),
    "swap": dict(engine_settings("refill_k1", "last_exited", False), kv_cache_tokens=64),
}


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_a_dropped_engine_frees_its_pool_without_the_cyclic_gc(arch, name, no_cyclic_gc):
    """Fails on the old runner (stage tables of bound methods, BatchState holding runner.padded) and
    scheduler (its prefill step and Preemption's callbacks were bound methods kept on them)."""
    settings = {"kv_cache_tokens": 512, "max_batch_size": 4, **SETTINGS[name]}
    eng = LLMEngine(model(arch), EngineConfig(**settings))
    for p, n in random_requests(1, n=5, prompt_len=(2, 20), max_new=(2, 8)):
        eng.add_request(p, SamplingParams(max_tokens=n, ignore_eos=True))
    while eng.has_unfinished():
        eng.step()
    refs = _pool_refs(eng)
    del eng
    assert _dropped(refs) == [], f"{name}: the pool outlives its engine (a reference cycle holds it)"


def test_a_dropped_llm_frees_its_pool_without_the_cyclic_gc():
    """The case the issue confirmed: `LLM(...)`, generate, `del llm` with the cyclic GC disabled.
    (Loading leaves cycles of its own, frames of a caught exception in the checkpoint loader: they are
    collected before the GC is turned off; the engine itself must need no collection.)"""
    llm = LLM("checkpoints/ouro-demo", kv_cache_tokens=4096)
    llm.generate(["a looped model"], SamplingParams(max_tokens=4))
    refs = _pool_refs(llm.engine)
    gc.collect()
    gc.disable()
    try:
        del llm
        assert _dropped(refs) == []
    finally:
        gc.enable()

"""The `Runner` protocol (infer/engine/runner.py) is everything the engine, the server and the
instruments call on a runner: ModelRunner, the simulator's SimRunner and the emulated device's
EmulatedRunner implement every member, methods with the protocol's parameters."""
import inspect
import typing
from functools import partial

import pytest

from infer import EngineConfig, LLMEngine, SamplingParams
from infer.engine.runner import ModelRunner, Runner
from infer.sim import emulated as E
from infer.sim.runner import SimModel, SimRunner
from looplm import tiny_model

MEMBERS = sorted(set(typing.get_type_hints(Runner)) |
                 {n for n, v in vars(Runner).items() if inspect.isfunction(v) and not n.startswith("_")})


def test_the_protocol_names_what_callers_use():
    # what the engine (run, padded, swap; reenter and to_host under on-device token re-entry), the
    # server (device_info, clock), the instruments (attention_stats) and min_coda_batch="auto"
    # (last_seconds) read: a member callers use but the protocol lacks would not be listed
    assert MEMBERS == ["attention_stats", "clock", "device_info", "last_seconds", "padded", "reenter", "run", "swap",
                       "to_host"]


@pytest.mark.parametrize("cls", [ModelRunner, SimRunner, E.EmulatedRunner])
def test_each_runner_class_has_every_method_with_its_signature(cls):
    for name in MEMBERS:
        want = getattr(Runner, name, None)
        if inspect.isfunction(want):
            assert list(inspect.signature(getattr(cls, name)).parameters) == \
                list(inspect.signature(want).parameters), (cls.__name__, name)


def built():
    m = tiny_model("ouro-tiny")
    yield "model", LLMEngine(m, EngineConfig(kv_cache_tokens=64)).runner
    yield "sim", LLMEngine(SimModel(m.cfg), EngineConfig(kv_cache_tokens=64),
                           runner_cls=partial(SimRunner, cost=lambda c: 1e-3, depths=[[4, 2, 3]])).runner
    yield "emulated", E.emulated_engine("ouro-1.4b", "emulated:h100").runner


def test_each_built_runner_is_a_runner_with_every_member():
    for name, r in built():
        assert isinstance(r, Runner), name
        missing = [k for k in MEMBERS if not hasattr(r, k)]
        assert not missing, (name, missing)
        if name == "model":
            assert r.clock is None and r.device_info is None  # wall time, a real device
        else:
            assert isinstance(r.clock, float) and r.attention_stats is None
    assert E.emulated_engine("ouro-1.4b", "emulated:h100").runner.device_info["emulated"] is True


def test_the_sim_runner_drives_the_engine_to_its_recorded_depths():
    fake = LLMEngine(SimModel(tiny_model("ouro-tiny").cfg), EngineConfig(kv_cache_tokens=64),
                     runner_cls=partial(SimRunner, cost=lambda c: 1e-3, depths=[[4, 2, 3]]))
    fake.add_request([1, 2], SamplingParams(max_tokens=3, ignore_eos=True), request_id="0")
    while fake.has_unfinished():
        fake.step()
    assert fake.output(fake.seqs["0"]).exit_depths == [4, 2, 3]

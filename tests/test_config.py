"""Settings resolved once: the engine's config has every value decided (no None where a value is
meant), one context length (max_model_len) bounds admission, and `max_launch_tokens` (what the CUDA
memory budget measures) bounds every launch the scheduler really builds."""
import random

import pytest

from infer import EngineConfig, LLMEngine, SamplingParams
from infer.sim import latency
from infer.sim.__main__ import main as sim_main
from looplm import tiny_model

from helpers import model, run_staggered

# inputs that size the pool (one of them is used) and stay as given
POOL_INPUTS = {"kv_cache_bytes", "kv_cache_memory"}


@pytest.mark.parametrize("kw", [{}, dict(policy="cb"), dict(kv_layout="shared"), dict(kv_layout="full_depth"),
                                dict(prefill="separate", lookahead=True), dict(kv_cache_tokens=96)])
@pytest.mark.parametrize("arch", ["ouro-tiny", "huginn-tiny"])
def test_resolved_config_leaves_nothing_to_default(arch, kw):
    c = LLMEngine(model(arch), EngineConfig(**kw)).config
    unset = {k for k, v in c.describe().items() if v is None} - POOL_INPUTS
    assert not unset, unset
    assert c.max_model_len <= c.kv_cache_tokens and c.max_model_len <= model(arch).cfg.max_position
    assert c.full_depth == (kw.get("policy") == "cb" or kw.get("kv_layout") == "full_depth")
    assert c.chunked_prefill == c.enable_prefix_caching == (kw.get("kv_layout") != "shared"
                                                            and kw.get("prefill") != "separate")
    assert c.cuda_graphs is False and c.pipeline is False  # a CPU device
    # resolving a resolved config changes nothing (a second engine from llm.config runs the same)
    assert LLMEngine(model(arch), c).config == c


def test_checkpoint_layout_is_resolved_and_refusals_name_the_setting():
    shared = tiny_model("ouro-tiny", kv_layout="shared")
    c = EngineConfig().resolve(shared.cfg)
    assert c.kv_layout == "shared" and c.chunked_prefill is False and c.enable_prefix_caching is False
    with pytest.raises(ValueError, match="chunked_prefill=True is not exact") as e:
        EngineConfig(chunked_prefill=True).resolve(shared.cfg)
    assert e.value.param == "chunked_prefill"
    with pytest.raises(ValueError, match="cuda_graphs=True needs a CUDA device") as e:
        EngineConfig(cuda_graphs=True).resolve(shared.cfg, "cpu")
    with pytest.raises(ValueError, match="pipeline=True needs lookahead=True") as e:
        EngineConfig(pipeline=True).resolve(shared.cfg)  # the checkpoint's lookahead is off
    assert e.value.param == "pipeline"


def test_one_context_length_when_the_pool_is_smaller_than_the_checkpoint():
    m = tiny_model("ouro-tiny", max_position=65536)
    eng = LLMEngine(m, EngineConfig(kv_cache_tokens=256, max_batch_size=4))
    assert eng.max_model_len == eng.config.max_model_len == 256 == eng.metrics()["max_model_len"]
    # a max_tokens beyond the pool is admitted: the request is capped by max_model_len and stops at it
    s = eng.add_request(list(range(1, 241)), SamplingParams(max_tokens=100_000, ignore_eos=True))
    while eng.has_unfinished():
        eng.step()
    assert s.finish_reason == "length" and s.num_tokens == 256
    with pytest.raises(ValueError, match="max_model_len") as e:
        eng.add_request([5] * 256, SamplingParams(max_tokens=1))
    assert e.value.param == "prompt"


@pytest.mark.parametrize("kw", [dict(kv_layout="shared"), dict(kv_layout="last_exited", max_num_batched_tokens=12),
                                dict(kv_layout="shared", prefill="separate"), dict(kv_layout="shared", policy="cb"),
                                dict(kv_layout="last_exited", policy="cb", max_num_batched_tokens=12)])
def test_max_launch_tokens_bounds_every_launch(kw):
    """What memory.cuda_budget measures (EngineConfig.max_launch_tokens) is at least every launch
    the scheduler emits, on prompts up to the whole context with a small budget: the whole prompts
    of `shared` (not chunked) go over the budget, alone, and so does a one-block chunk admitted
    alone under a budget smaller than a block; both must still be inside the bound."""
    seed = 7
    print("seed", seed)
    rng = random.Random(seed)
    m = tiny_model("ouro-tiny", max_position=256)
    eng = LLMEngine(m, EngineConfig(**{"max_num_batched_tokens": 24, **kw}, max_batch_size=6, kv_cache_tokens=2048,
                                    trace=True))
    c = eng.config
    reqs = [([rng.randrange(1, 256) for _ in range(rng.choice([3, 20, 60, 200, 250]))], rng.randint(1, 5))
            for _ in range(16)]
    run_staggered(eng, reqs, seed, logprobs=False)
    sizes = [r["tokens"] if r["stage"] == "prefill" else r["batch"] + r["prompt_tokens"] for r in eng.trace]
    assert max(sizes) <= c.max_launch_tokens(), (max(sizes), c.max_launch_tokens())
    assert max(sizes) > c.max_num_batched_tokens  # not vacuous: the bound's exception was exercised
    if not c.chunked_prefill:
        assert max(sizes) > 200


def test_clis_take_the_engine_flags(tmp_path, capsys):
    """infer.sim.latency and infer.sim build their engine flags from EngineConfig (add_engine_args) and
    run the layout the flags resolve to (the checkpoint's by default)."""
    latency.main(["sweep", "--model", "ouro-tiny", "--batch-sizes", "1", "--contexts", "8", "--repeats", "1",
                  "--kv-layout", "shared", "--block-size", "8", "--out", str(tmp_path)])
    rows = latency.sweep(tiny_model("ouro-tiny", kv_layout="shared"), [1], [8], repeats=1)
    assert rows and rows[0]["stage"] == "core"
    sim_main(["--model", "ouro-1.4b", "--workloads", "alpaca", "--num-requests", "3", "--ks", "1", "--kv-layout",
              "shared", "--max-num-batched-tokens", "512", "--out", str(tmp_path)])
    import json
    out = json.loads(next(tmp_path.glob("sim_*.json")).read_text())
    ec = out["workloads"][0]["results"][0]["engine_config"]
    assert ec["kv_layout"] == "shared" and ec["max_num_batched_tokens"] == 512


@pytest.mark.parametrize("module,argv", [("infer.bench.offline", []), ("infer.sim.__main__", []),
                                         ("infer.serving.cli", []), ("infer.bench.memory", []),
                                         ("infer.sim.latency", ["sweep"])])
def test_every_cli_parses_its_engine_flags(module, argv, capsys):
    """Each CLI with engine flags (its own + add_engine_args) builds them without a conflict and
    lists them in its help. (infer.bench.online passes --server-args to infer.serve.)"""
    import importlib
    with pytest.raises(SystemExit) as e:
        importlib.import_module(module).main(argv + ["--help"])
    assert e.value.code == 0 and "--kv-layout" in capsys.readouterr().out

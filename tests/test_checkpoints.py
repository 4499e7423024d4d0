"""The shipped demo checkpoints: they load (weights, config, tokenizer), the engine serves each with the
settings its config.json records (layout, exit policy) unless told otherwise, and the CDB engine serves each
with its default exit policy token for token and depth for depth like the reference decoder (greedy, float64)."""
from pathlib import Path

import pytest

from infer import LLM, SamplingParams
from infer.engine.reference import reference_generate
from looplm import ExitPolicy

ROOT = Path(__file__).resolve().parents[1] / "checkpoints"
SHIPPED = ("huginn-demo", "ouro-demo", "ouro-demo-sharedkv")  # the README promises these
LAB = ("lab-hops", "lab-hops-sharedkv")  # the lab's task model and its shared-KV adaptation (tests/test_lab.py; its own character tokenizer)
TEXTS = ["The history of the city", "x = 4; y = x + 3; z = y * 2; so z =", "In 1998 the company"]


def test_every_shipped_checkpoint_is_present():
    found = sorted(p.name for p in ROOT.iterdir() if (p / "config.json").exists()) if ROOT.exists() else []
    assert found == sorted(SHIPPED + LAB), f"checkpoints/ holds {found}, expected {sorted(SHIPPED + LAB)}"


@pytest.mark.parametrize("name", SHIPPED)
def test_checkpoint_engine_equals_reference(name):
    folder = ROOT / name
    assert (folder / "config.json").exists() and (folder / "README.md").exists(), f"{folder} is missing"
    llm = LLM(str(folder), dtype="float64", policy="cdb", refill=True, max_batch_size=4, kv_cache_tokens=256)
    m, tok = llm.model, llm.tokenizer
    assert tok is not None
    layout = m.cfg.kv_layout or "last_exited"  # train/shared_kv.py records the layout it adapted to
    assert llm.config.kv_layout == layout
    pol = ExitPolicy.from_config(m.cfg, lookahead=bool(m.cfg.exit_lookahead))
    assert pol.adaptive, f"{name}: the default policy never exits early"
    prompts = [tok(t).input_ids for t in TEXTS]
    refs = [reference_generate(m, p, 12, pol, kv_layout=layout) for p in prompts]
    outs = llm.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True))
    depths = []
    for out, r in zip(outs, refs):
        assert out.token_ids == r.token_ids
        assert out.exit_depths == r.exit_depths
        depths += out.exit_depths[1:]  # the first token follows the full-depth prefill
    assert min(depths) < m.cfg.r_max, f"{name}: no token exited early"
    assert llm.engine.blocks.all_free


def test_checkpoint_settings_are_defaults_and_arguments_override_them():
    folder = str(ROOT / "ouro-demo-sharedkv")
    llm = LLM(folder, kv_cache_tokens=256)
    assert llm.config.kv_layout == "shared" and llm.config.exit_criterion == "learned"
    assert llm.config.exit_threshold == 0.7 and llm.config.lookahead is False
    over = LLM(folder, kv_layout="last_exited", exit_threshold=0.9, kv_cache_tokens=256)
    assert over.config.kv_layout == "last_exited" and over.config.exit_threshold == 0.9
    assert LLM(str(ROOT / "ouro-demo"), kv_cache_tokens=256).config.kv_layout == "last_exited"

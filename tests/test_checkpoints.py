"""The shipped demo checkpoints: they load (weights, config, tokenizer), and the CDB engine serves each with
its default exit policy token for token and depth for depth like the reference decoder (greedy, float64)."""
from pathlib import Path

import pytest
import torch

from infer import EngineConfig, LLMEngine, SamplingParams
from looplm import ExitPolicy, load_pretrained
from looplm.io import load_tokenizer
from infer.engine.reference import reference_generate

ROOT = Path(__file__).resolve().parents[1] / "checkpoints"
FOLDERS = sorted(p.name for p in ROOT.iterdir() if (p / "config.json").exists()) if ROOT.exists() else []
TEXTS = ["The history of the city", "x = 4; y = x + 3; z = y * 2; so z =", "In 1998 the company"]


@pytest.mark.parametrize("name", FOLDERS)
def test_checkpoint_engine_equals_reference(name):
    folder = ROOT / name
    m = load_pretrained(folder, dtype=torch.float64)
    tok = load_tokenizer(folder)
    assert tok is not None and (folder / "README.md").exists()
    layout = m.cfg.extra.get("kv_layout", "last_exited")  # shared_kv.py records the layout it adapted to
    pol = ExitPolicy.from_config(m.cfg)
    assert pol.adaptive, f"{name}: the default policy never exits early"
    prompts = [tok(t).input_ids for t in TEXTS]
    refs = [reference_generate(m, p, 12, pol, kv_layout=layout) for p in prompts]
    eng = LLMEngine(m, EngineConfig(policy="cdb", refill=True, kv_layout=layout, max_batch_size=4,
                                    kv_cache_tokens=256))
    seqs = [eng.add_request(p, SamplingParams(max_tokens=12, ignore_eos=True)) for p in prompts]
    while eng.has_unfinished():
        eng.step()
    depths = []
    for s, r in zip(seqs, refs):
        out = eng.output(s)
        assert out.token_ids == r.token_ids
        assert out.exit_depths == r.exit_depths
        depths += out.exit_depths[1:]  # the first token follows the full-depth prefill
    assert min(depths) < m.cfg.r_max, f"{name}: no token exited early"
    assert eng.blocks.all_free

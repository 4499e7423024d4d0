"""Parity with the public reference implementations (Ouro: LoopedLMs/ouro_rl modeling_ouro.py;
Huginn: seal-rg/recurrent-pretraining raven_modeling_minimal.py), on tiny random checkpoints whose
outputs were computed by running that code (tests/fixtures/parity/README.md says how)."""
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from looplm import ExitPolicy, load_pretrained
from infer.engine.reference import reference_generate

FIX = Path(__file__).parent / "fixtures" / "parity"
OURO, HUGINN = ["ouro_a", "ouro_b"], ["huginn_a", "huginn_b"]
TOL = 1e-4  # fp32


def _load(name, **kw):
    return load_pretrained(FIX / name, dtype="float32", **kw), load_file(FIX / name / "expected.safetensors")


@pytest.mark.parametrize("name", OURO)
def test_ouro_step_logits_and_gate(name):
    m, exp = _load(name)
    ids = exp["input_ids"]
    T = exp["step_logits"].shape[0]
    with torch.no_grad():
        for t in range(1, T + 1):
            out = m(ids, num_steps=t)
            assert (out.logits - exp["step_logits"][t - 1]).abs().max() < TOL, f"step {t}"
        assert (out.gate_logits - exp["gate_logits"]).abs().max() < TOL


@pytest.mark.parametrize("name", HUGINN)
def test_huginn_logits_per_num_steps(name):
    m, exp = _load(name)
    ids = exp["input_ids"]
    with torch.no_grad():
        for r in range(1, exp["logits"].shape[0] + 1):
            assert (m(ids, num_steps=r).logits - exp["logits"][r - 1]).abs().max() < TOL, f"num_steps={r}"


CASES = [("ouro_a", "gen_greedy", "last_exited"), ("ouro_b", "gen_greedy", "last_exited")] + [
    (h, key, lay) for h in HUGINN for key, lay in (("gen_latest_m4", "last_exited"), ("gen_compress_s4", "shared"))]


@pytest.mark.parametrize("name,key,layout", CASES)
def test_fixed_depth_generation(name, key, layout):
    """Greedy generation at fixed depth; Huginn's `compress-s4` cache is our `shared` layout and
    `latest-m4` our `last_exited`."""
    m, exp = load_pretrained(FIX / name, dtype="float64"), load_file(FIX / name / "expected.safetensors")
    prompt, gen = exp["input_ids"][0].tolist(), exp[key][0].tolist()
    g = reference_generate(m, prompt, len(gen) - len(prompt), ExitPolicy.from_config(m.cfg, full_depth=True),
                           kv_layout=layout)
    assert prompt + g.token_ids == gen


@pytest.mark.parametrize("cache,layout", [("latest_m4", "last_exited"), ("compress_s4", "shared")])
def test_huginn_adaptive_kl_generation(cache, layout):
    """Huginn's generate_with_adaptive_compute(criterion='kl', exit_threshold=0.1, num_steps=8):
    same tokens and the same per-token step counts (its prefill ran all 8 steps, as ours does)."""
    m = load_pretrained(FIX / "huginn_b", dtype="float64", r_max=8)
    exp = load_file(FIX / "huginn_b" / "expected.safetensors")
    prompt, gen = exp["input_ids"][0].tolist(), exp[f"gen_adaptive_kl_{cache}"][0].tolist()
    g = reference_generate(m, prompt, len(gen) - len(prompt),
                           ExitPolicy.from_config(m.cfg, criterion="kl", threshold=0.1), kv_layout=layout)
    assert prompt + g.token_ids == gen
    assert g.exit_depths == exp[f"steps_adaptive_kl_{cache}"].tolist()

"""train/estimate.py: the fake-tensor estimate of a training step's peak memory equals a real run's
(the same step on real tensors under the tracker, which follows the real live storages), --json
gives its keys, bad input is one line. The 24-layer check at 2,048 tokens: `python -m train.estimate
--check` (docs/results/train-estimate.md); here a 2-layer model at 128 tokens keeps it to seconds."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from looplm.config import replace
from train import estimate

SEED = 1234


def narrow_ouro(**kw):
    """Ouro-1.4B's structure (sandwich-norm layers, gate, r_max 4, MHA) at a width a test can run."""
    cfg = estimate.model_config("ouro-1.4b")
    return replace(cfg, hidden_size=64, intermediate_size=176, num_heads=1, num_kv_heads=1, head_dim=64,
                   vocab_size=512, n_core=2, **kw)


@pytest.mark.parametrize("options", [
    {"checkpoint": True, "pass1_sweeps": 2, "context_grad": None, "backprop_depth": None, "ce_chunk": 64},
    {"checkpoint": False, "pass1_sweeps": 2, "context_grad": 0, "backprop_depth": 2, "ce_chunk": 0},
])
def test_fake_peak_matches_a_real_run(options):
    print(f"seed {SEED}, options {options}")
    torch.manual_seed(SEED)
    cfg = narrow_ouro()
    fake = estimate.run_step(cfg, 128, 1, options, autocast=False, fake=True)
    real = estimate.run_step(cfg, 128, 1, options, autocast=False, fake=False, seed=SEED)
    assert real["loss_finite"]
    ratio = fake["peak"] / real["peak"]
    print(f"estimated {fake['peak']} B, measured {real['peak']} B, ratio {ratio:.4f}")
    assert 0.9 <= ratio <= 1.1
    # the categories are not vacuous: weights, AdamW state and saved activations all counted
    assert real["parameters"] > 0 and real["optimizer_state"] >= 2 * real["parameters"] and real["activations"] > 0
    assert fake["flops"] > 0 and fake["roofline_s"] > 0


def test_json_keys_and_sharding(capsys):
    base = ["--model", "ouro-tiny", "--ctx", "64", "--json"]
    estimate.main(base)
    one = json.loads(capsys.readouterr().out)
    for k in ("peak_bytes", "tokens_per_s", "flops_per_token", "bytes", "method", "ctx", "gpus", "checkpoint"):
        assert k in one, k
    assert isinstance(one["peak_bytes"], int) and isinstance(one["tokens_per_s"], float)
    assert one["peak_bytes"] == pytest.approx(sum(one["bytes"].values()), rel=0.05)
    estimate.main(base + ["--gpus", "4", "--fsdp"])
    four = json.loads(capsys.readouterr().out)
    # FSDP2 shards the fp32 weights, gradients and AdamW state (16 B/param) four ways
    assert four["bytes"]["optimizer_state"] == 8 * four["trainable_params"] // 4
    assert four["tokens_per_s"] > one["tokens_per_s"]


def test_lora_trains_adapters_and_gate_heads_only(capsys):
    estimate.main(["--model", "huginn-tiny", "--ctx", "32", "--lora", "--lora-rank", "4", "--json"])
    r = json.loads(capsys.readouterr().out)
    assert 0 < r["trainable_params"] < r["params"] / 5
    assert r["bytes"]["optimizer_state"] < r["bytes"]["parameters"]


@pytest.mark.slow
@pytest.mark.parametrize("args,words", [(["--model", "no-such-model"], "no-such-model"),
                                        (["--model", "ouro-tiny", "--ctx", "0"], "--ctx")])
def test_bad_input_is_one_line(args, words):
    p = subprocess.run([sys.executable, "-m", "train.estimate", *args], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and words in lines[0], p.stderr


def narrow_huginn(**kw):
    """Huginn-3.5B's structure (prelude / core / coda, no gate: what --add-gate starts from) at a test's width."""
    cfg = estimate.model_config("huginn-3.5b")
    return replace(cfg, hidden_size=64, intermediate_size=176, num_heads=1, num_kv_heads=1, head_dim=64,
                   vocab_size=512, n_prelude=1, n_core=1, n_coda=1, r_max=4, exit_gate=False, exit_criterion="kl", **kw)


@pytest.mark.parametrize("arch,phase,kw,autocast", [
    ("ouro", "heads", {"gates": "both"}, False),
    ("ouro", "heads", {"gates": "lookahead", "objective": "oracle"}, True),
    ("huginn", "add_gate", {"teacher": "kl"}, False),
    ("huginn", "add_gate", {"teacher": "loss"}, True),
])
def test_distill_fake_peak_matches_a_real_run(arch, phase, kw, autocast):
    """--script distill: train/distill_gate.py's step (frozen no-grad pass, bf16 autocast or not, the
    heads' loss, backward, AdamW) on fake tensors vs the same step on real ones, both under the tracker."""
    print(f"seed {SEED}, {arch} {phase} {kw} autocast {autocast}")
    torch.manual_seed(SEED)
    cfg = narrow_ouro() if arch == "ouro" else narrow_huginn()
    fake = estimate.run_distill_step(cfg, 128, 2, phase, autocast=autocast, fake=True, **kw)
    real = estimate.run_distill_step(cfg, 128, 2, phase, autocast=autocast, fake=False, seed=SEED, **kw)
    assert real["loss_finite"]
    ratio = fake["peak"] / real["peak"]
    print(f"estimated {fake['peak']} B, measured {real['peak']} B, ratio {ratio:.4f}")
    assert 0.9 <= ratio <= 1.1
    for k in estimate.CATEGORIES:  # the same storages in every category, not only the same total
        assert fake[k] == pytest.approx(real[k], rel=0.1, abs=4096), k
    # the frozen model's weights and the heads' AdamW state (2 x the heads) are counted, no model gradient
    assert real["parameters"] > 0 and real["optimizer_state"] > 0 and real["gradients"] < real["parameters"] / 100
    assert fake["flops"] > 0 and fake["roofline_s"] > 0


def test_distill_json(capsys):
    estimate.main(["--script", "distill", "--model", "huginn-tiny", "--ctx", "32", "--batch", "2", "--add-gate",
                   "--teacher", "kl", "--gates", "lookahead", "--json"])
    r = json.loads(capsys.readouterr().out)
    assert r["script"] == "distill" and [p["phase"] for p in r["phases"]] == ["add_gate", "heads"]
    assert r["peak_bytes"] == max(p["peak_bytes"] for p in r["phases"])
    for p in r["phases"]:
        assert p["tokens_per_s"] > 0 and p["trainable_params"] > 0
    with pytest.raises(estimate.UserError, match="Ouro"):
        estimate.main(["--script", "distill", "--model", "ouro-tiny", "--ctx", "32", "--add-gate"])

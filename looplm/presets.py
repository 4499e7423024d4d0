"""Named model shapes: tiny presets for every family (tests, CI, the demo fallback), the paper's two
models and the newer looped families at their real shapes (the simulator, GPU timing runs,
`load_format="dummy"`), and random init."""
from __future__ import annotations

import torch

from .config import LoopConfig
from .io import build_model
from .model import LoopedLM

PRESETS: dict[str, dict] = {
    # Ouro-style 0-2-0, r_max 4, GQA
    "ouro-tiny": dict(arch="ouro", vocab_size=256, hidden_size=64, intermediate_size=128, num_heads=4,
                      num_kv_heads=2, head_dim=16, n_prelude=0, n_core=2, n_coda=0, r_max=4, rope_theta=10000.0,
                      max_position=512, exit_criterion="ouro_gate", exit_threshold=0.6, eos_token_id=0),
    # Huginn-style 2-2-2, r_max 6, learned gate head
    "huginn-tiny": dict(arch="huginn", vocab_size=256, hidden_size=64, intermediate_size=128, num_heads=4,
                        num_kv_heads=4, head_dim=16, n_prelude=2, n_core=2, n_coda=2, r_max=6, rope_theta=50000.0,
                        max_position=512, qk_bias=True, tie_embeddings=True, embed_scale=8.0, exit_gate=True,
                        exit_criterion="learned", exit_threshold=0.6, eos_token_id=0),
    # the retrofitted-recurrence Llama layout: 2-2-1, GQA, Llama-3 RoPE scaling, untied, ln_f once;
    # a learned gate (train/distill_gate.py --add-gate gives a real checkpoint one)
    "raven-llama-tiny": dict(arch="huginn", family="raven_llama", vocab_size=256, hidden_size=64,
                             intermediate_size=128, num_heads=4, num_kv_heads=2, head_dim=16, n_prelude=2, n_core=2,
                             n_coda=1, r_max=5, rope_theta=500000.0, max_position=512,
                             rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                               high_freq_factor=4.0, original_max_position_embeddings=64),
                             exit_gate=True, exit_criterion="learned", exit_threshold=0.6, eos_token_id=0),
    # the OLMo-2 retrofit: post-norm blocks with q/k norms, 1-2-1
    "raven-olmo-tiny": dict(arch="huginn", family="raven_olmo", vocab_size=256, hidden_size=64,
                            intermediate_size=128, num_heads=4, num_kv_heads=4, head_dim=16, n_prelude=1, n_core=2,
                            n_coda=1, r_max=5, rope_theta=500000.0, max_position=512, exit_gate=True,
                            exit_criterion="learned", exit_threshold=0.6, eos_token_id=0),
    # Nanbeige4.2's structure: pre-norm Llama layers run r_max = num_loops = 2 times, q/o not square
    "nanbeige-tiny": dict(arch="ouro", family="nanbeige", vocab_size=256, hidden_size=64, intermediate_size=128,
                          num_heads=4, num_kv_heads=2, head_dim=32, n_prelude=0, n_core=2, n_coda=0, r_max=2,
                          rope_theta=7e7, max_position=512, exit_gate=True, exit_criterion="learned",
                          exit_threshold=0.6, eos_token_id=0),
}


# The CDB paper's two models at their real shapes (FACTS.md section 1), vocabulary as stored; the context
# is capped at 4,096 (the benchmark traces fit it) and the exit policy is the simulator's stand-in.
PAPER_MODELS: dict[str, dict] = {
    "ouro-1.4b": dict(arch="ouro", vocab_size=49152, hidden_size=2048, intermediate_size=5632, num_heads=16,
                      num_kv_heads=16, head_dim=128, n_prelude=0, n_core=24, n_coda=0, r_max=4, rope_theta=1e6,
                      max_position=4096, exit_criterion="ouro_gate", exit_threshold=0.5),
    "huginn-3.5b": dict(arch="huginn", vocab_size=65536, hidden_size=5280, intermediate_size=17920, num_heads=55,
                        num_kv_heads=55, head_dim=96, n_prelude=2, n_core=4, n_coda=2, r_max=16, rope_theta=50000.0,
                        max_position=4096, qk_bias=True, tie_embeddings=True, embed_scale=72.6636,
                        exit_gate=True, exit_criterion="learned", exit_threshold=0.5),
}


# Smaller shapes that keep a paper model's structure (width, heads, vocabulary, r_max, gate) with fewer
# layers: real-shape stages whose cost a CPU can pay (dummy weights, infer.bench).
# The looped models users run beyond the paper's two (FACTS.md section 8), at their real shapes, context
# capped at 4,096 as above. The gateless releases get the simulator's stand-in criterion (infer/sim);
# r_max is the largest released recurrence (retrofits: train-recurrence-32) or the release's loop count.
_LLAMA3_SCALING = dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                       original_max_position_embeddings=8192)
PAPER_MODELS.update({
    "ouro-2.6b": {**PAPER_MODELS["ouro-1.4b"], "n_core": 48},
    "retro-llama-3.2-1b": dict(arch="huginn", family="raven_llama", vocab_size=128256, hidden_size=2048,
                               intermediate_size=8192, num_heads=32, num_kv_heads=8, head_dim=64, n_prelude=4,
                               n_core=6, n_coda=4, r_max=32, rope_theta=500000.0, rope_scaling=_LLAMA3_SCALING,
                               max_position=4096, norm_eps=1e-5, exit_criterion="latent_diff", exit_threshold=0.03),
    "retro-tinyllama-1.1b": dict(arch="huginn", family="raven_llama", vocab_size=32000, hidden_size=2048,
                                 intermediate_size=5632, num_heads=32, num_kv_heads=4, head_dim=64, n_prelude=4,
                                 n_core=8, n_coda=4, r_max=32, rope_theta=10000.0, max_position=2048, norm_eps=1e-5,
                                 exit_criterion="latent_diff", exit_threshold=0.03),
    "retro-olmo2-1b": dict(arch="huginn", family="raven_olmo", vocab_size=100352, hidden_size=2048,
                           intermediate_size=8192, num_heads=16, num_kv_heads=16, head_dim=128, n_prelude=4, n_core=6,
                           n_coda=4, r_max=32, rope_theta=500000.0, max_position=4096, norm_eps=1e-6,
                           exit_criterion="latent_diff", exit_threshold=0.03),
    "nanbeige4.2-3b": dict(arch="ouro", family="nanbeige", vocab_size=166144, hidden_size=3072,
                           intermediate_size=10752, num_heads=48, num_kv_heads=8, head_dim=128, n_prelude=0,
                           n_core=22, n_coda=0, r_max=2, rope_theta=7e7, max_position=4096, norm_eps=1e-6),
})
PAPER_MODELS["ouro-1.4b-4l"] = {**PAPER_MODELS["ouro-1.4b"], "n_core": 4}
PAPER_MODELS["huginn-3.5b-1-1-1"] = {**PAPER_MODELS["huginn-3.5b"], "n_prelude": 1, "n_core": 1, "n_coda": 1}
# Ouro-1.4B's structure (0-N-0 core, sandwich norms, exit gate, r_max 4, MHA with 128-wide heads... here
# 64-wide) at a quarter of its width, four core layers and an 8k vocabulary, so that the LM head's share of a
# token's FLOPs (F0 / Fr = 0.33; Ouro-1.4B 0.08) stays small: a core step of a batch of 16 costs milliseconds
# on one CPU thread, far above the engine's ~50 us of host time per stage (the demo's real-structure run)
PAPER_MODELS["ouro-mini"] = {**PAPER_MODELS["ouro-1.4b"], "vocab_size": 8192, "hidden_size": 512,
                             "intermediate_size": 1408, "num_heads": 8, "num_kv_heads": 8, "head_dim": 64,
                             "n_core": 4, "max_position": 2048}


def paper_config(name: str, **overrides) -> LoopConfig:
    if name not in PAPER_MODELS:
        raise ValueError(f"unknown paper model {name!r}; available: {sorted(PAPER_MODELS)}")
    return LoopConfig(**{**PAPER_MODELS[name], **overrides})


def paper_model(name: str, dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu") -> LoopedLM:
    """A paper model's shape with random weights (seed 0), built directly on `device`: GPU timing."""
    return dummy_model(paper_config(name), dtype, device)


def dummy_model(cfg: LoopConfig, dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu") -> LoopedLM:
    """Random weights (torch's default init, seed 0) for any config, built directly in `dtype` on
    `device` (no float32 copy of a billion-parameter model first): vLLM's load_format="dummy", frozen
    as vLLM's loaders leave a model (nothing records autograd on it)."""
    torch.manual_seed(0)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = build_model(cfg)
    finally:
        torch.set_default_dtype(old)
    return model.to(dtype).eval().requires_grad_(False)


def preset_config(name: str, **overrides) -> LoopConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; available: {sorted(PRESETS)}")
    return LoopConfig(**{**PRESETS[name], **overrides})


def init_weights(model: LoopedLM, seed: int = 0, std: float = 0.02, randomize_norms: bool = False) -> LoopedLM:
    """GPT-style init (normal(0, std) matrices, zero biases). `randomize_norms` also perturbs norm
    weights and biases so that tests notice a tensor a loader skipped."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or ".norm_" in name or "layernorm" in name or name.endswith("ln_f.weight"):
                p.copy_(1.0 + (0.2 * torch.randn(p.shape, generator=g) if randomize_norms else 0.0))
            elif p.ndim == 1 or "qk_bias" in name:
                p.copy_(0.2 * torch.randn(p.shape, generator=g) if randomize_norms else torch.zeros(p.shape))
            else:
                p.copy_(std * torch.randn(p.shape, generator=g))
    return model


def tiny_model(name: str, seed: int = 0, dtype: torch.dtype = torch.float32, std: float = 0.02,
               **overrides) -> LoopedLM:
    """A randomly initialised preset model (tests and the demo fallback)."""
    model = build_model(preset_config(name, **overrides))
    init_weights(model, seed=seed, std=std, randomize_norms=True)
    return model.to(dtype).eval()

"""The seed paper's upper bounds on the speedup of depth-adaptive decoding, from FLOPs counted on
the model config. Pure Python (no torch).

F_r: FLOPs of one core loop step for one decode token (the shared block, Huginn's adapter, the
exit gate); F_0: the loop-independent FLOPs (prelude and coda layers, LM head; the embedding is a
lookup). Attention FLOPs grow with the context the token attends to, so both take a context length.

    S_dec = (F_0 + r_max F_r) / (F_0 + d F_r)   (<= r_max / d)
    S_e2e = 1 / (a + (1 - a) / S_dec)            a = prefill share of CB's time

Matmul FLOPs count 2 per multiply-add; norms, RoPE, softmax and activations are left out (a few
per cent of a layer at most). The same counts give the bytes the roofline cost model reads.
"""
from __future__ import annotations

from looplm.config import LoopConfig


def layer_params(cfg: LoopConfig) -> int:
    """Matmul weights of one transformer layer (attention projections + SwiGLU)."""
    d, H, KV, hd, f = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
    return d * (H + 2 * KV) * hd + H * hd * d + 3 * d * f


def layer_flops(cfg: LoopConfig, context: float) -> float:
    """FLOPs of one layer for one token attending `context` positions (QK^T and AV: 4 H hd c)."""
    return 2 * layer_params(cfg) + 4 * cfg.num_heads * cfg.head_dim * context


def stage_params(cfg: LoopConfig) -> dict[str, int]:
    """Weights each decode stage reads: prelude (layers; the embedding reads one row per token),
    one core step (layers + adapter + gate), coda (layers + LM head)."""
    d = cfg.hidden_size
    core = cfg.n_core * layer_params(cfg) + (2 * d * d if cfg.arch == "huginn" else 0) + (d if cfg.exit_gate else 0)
    return {"prelude": cfg.n_prelude * layer_params(cfg), "core": core, "coda": cfg.n_coda * layer_params(cfg) + d * cfg.vocab_size}


def stage_flops(cfg: LoopConfig, context: float) -> dict[str, float]:
    """FLOPs per decode token of each stage at a given context length."""
    d = cfg.hidden_size
    core = cfg.n_core * layer_flops(cfg, context)
    if cfg.arch == "huginn":
        core += 2 * (2 * d) * d  # adapter: [state, injection] (2d) -> d
    if cfg.exit_gate:
        core += 2 * d
    return {"prelude": cfg.n_prelude * layer_flops(cfg, context),
            "core": core,
            "coda": cfg.n_coda * layer_flops(cfg, context) + 2 * d * cfg.vocab_size}


def f0_fr(cfg: LoopConfig, context: float) -> tuple[float, float]:
    """(F_0, F_r) per decode token at a context length."""
    f = stage_flops(cfg, context)
    return f["prelude"] + f["coda"], f["core"]


def kv_bytes_per_token(cfg: LoopConfig, layers: int, dtype_bytes: int = 2) -> int:
    """K and V of one token position in `layers` attention layers."""
    return layers * 2 * cfg.num_kv_heads * cfg.head_dim * dtype_bytes


def s_dec(f0: float, fr: float, r_max: float, depth: float) -> float:
    """Decode speedup bound of exiting at mean depth `depth` instead of running r_max steps."""
    if depth <= 0:
        raise ValueError(f"mean depth must be > 0, got {depth}")
    return (f0 + r_max * fr) / (f0 + depth * fr)


def s_e2e(alpha: float, sdec: float) -> float:
    """End-to-end bound: prefill (share `alpha` of CB's time) gains nothing."""
    if not 0 <= alpha <= 1:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    return 1.0 / (alpha + (1.0 - alpha) / sdec)


def bound(cfg: LoopConfig, mean_depth: float, alpha: float, context: float) -> dict[str, float]:
    """F_0, F_r, S_dec, S_e2e (and the loose r_max/d) for one measured run."""
    f0, fr = f0_fr(cfg, context)
    sd = s_dec(f0, fr, cfg.r_max, mean_depth)
    return {"f0": f0, "fr": fr, "f0_over_fr": f0 / fr, "r_max": cfg.r_max, "mean_exit_depth": mean_depth,
            "context": context, "alpha": alpha, "s_dec": sd, "s_e2e": s_e2e(alpha, sd),
            "r_max_over_d": cfg.r_max / mean_depth}

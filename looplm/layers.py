"""Building blocks shared by every family: RMSNorm, the two RoPE styles (with Llama-3 frequency
scaling), GQA attention (optionally with OLMo-2's q/k norms), SwiGLU.

Attention does not own a KV cache. It projects q/k/v and hands them to an `attend(q, k, v)` callable
chosen by the caller: plain causal attention for a full forward, or a KV-layout context for the
stage functions (looplm/stages.py). That keeps one implementation of the math for training,
the reference decoder and the engine.
"""
from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # normalise in (at least) fp32, cast back, then scale: what both references do
        xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None, cdt: torch.dtype,
                  device: torch.device | str = "cpu") -> torch.Tensor:
    """RoPE's inverse frequencies; `scaling` {"rope_type": "llama3", factor, low_freq_factor,
    high_freq_factor, original_max_position_embeddings} rescales them as Llama 3.1+ does (transformers'
    `_compute_llama3_parameters`): wavelengths above the original context / low_freq_factor are
    divided by `factor`, those below / high_freq_factor are kept, and the band between interpolates."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=cdt, device=device) / head_dim))
    if scaling is None:
        return inv
    factor, lo, hi = float(scaling["factor"]), float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > old / lo, inv / factor, inv)
    smooth = (old / wavelen - lo) / (hi - lo)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old / hi) & ~(wavelen > old / lo)
    return torch.where(medium, smoothed, scaled)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype,
                 scaling: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of shape [*positions.shape, head_dim // 2], computed in fp32 (fp64 for fp64 models)."""
    cdt = torch.float64 if dtype == torch.float64 else torch.float32
    inv = rope_inv_freq(head_dim, theta, scaling, cdt, positions.device)  # made there: no host-device copy
    ang = positions.to(cdt)[..., None] * inv
    return ang.cos(), ang.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """x: [..., T, H, D]; cos/sin: [..., T, D/2]. `interleaved` rotates adjacent pairs (2i, 2i+1) as
    Huginn does; otherwise halves (i, i + D/2) as Llama/Qwen/Ouro's rotate_half."""
    cos, sin = cos[..., None, :], sin[..., None, :]  # broadcast over heads
    xf = x.to(cos.dtype)
    if interleaved:
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
        out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    else:
        half = x.shape[-1] // 2
        x1, x2 = xf[..., :half], xf[..., half:]
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out.to(x.dtype)


def causal_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Plain causal self-attention over full sequences. q: [B, T, H, D]; k, v: [B, T, KVH, D]."""
    y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                       is_causal=True, enable_gqa=q.shape[2] != k.shape[2])
    return y.transpose(1, 2)


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)). Ouro keeps gate/up separate; Huginn fuses them into `fc`."""

    def __init__(self, dim: int, hidden: int, fused: bool):
        super().__init__()
        self.fused = fused
        if fused:
            self.fc = nn.Linear(dim, 2 * hidden, bias=False)  # rows: gate | up
            self.proj = nn.Linear(hidden, dim, bias=False)
        else:
            self.gate_proj = nn.Linear(dim, hidden, bias=False)
            self.up_proj = nn.Linear(dim, hidden, bias=False)
            self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            g, u = self.fc(x).chunk(2, dim=-1)
            return self.proj(F.silu(g) * u)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Attention(nn.Module):
    """GQA attention. Separate q/k/v/o projections (Ouro, Nanbeige) or a fused `Wqkv` (rows q | k | v)
    with `proj` (the huginn_raven families). `interleaved` RoPE rotates adjacent pairs (Huginn-0125),
    otherwise halves (every Llama-style family). Huginn-0125's optional `qk_bias` is added before RoPE;
    the OLMo-2 retrofit's `qk_norm` RMS-normalises q and k over their full width before the heads split."""

    def __init__(self, dim: int, heads: int, kv_heads: int, head_dim: int, theta: float, fused: bool,
                 qk_bias: bool = False, interleaved: bool | None = None, qk_norm: bool = False, eps: float = 1e-6):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.theta, self.fused = heads, kv_heads, head_dim, theta, fused
        self.interleaved = fused if interleaved is None else interleaved
        if fused:
            self.Wqkv = nn.Linear(dim, (heads + 2 * kv_heads) * head_dim, bias=False)
            self.proj = nn.Linear(heads * head_dim, dim, bias=False)
            if qk_bias:
                # the reference stores [2, 1, heads, head_dim]: one row for q, one for k
                self.qk_bias = nn.Parameter(torch.zeros(2, 1, heads, head_dim))
            if qk_norm:
                self.q_norm = RMSNorm(heads * head_dim, eps)
                self.k_norm = RMSNorm(kv_heads * head_dim, eps)
        else:
            self.q_proj = nn.Linear(dim, heads * head_dim, bias=False)
            self.k_proj = nn.Linear(dim, kv_heads * head_dim, bias=False)
            self.v_proj = nn.Linear(dim, kv_heads * head_dim, bias=False)
            self.o_proj = nn.Linear(heads * head_dim, dim, bias=False)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], attend: Attend) -> torch.Tensor:
        shp = x.shape[:-1]
        H, KV, D = self.heads, self.kv_heads, self.head_dim
        if self.fused:
            q, k, v = self.Wqkv(x).split([H * D, KV * D, KV * D], dim=-1)
            if hasattr(self, "q_norm"):
                q, k = self.q_norm(q), self.k_norm(k)
            q, k, v = q.view(*shp, H, D), k.view(*shp, KV, D), v.view(*shp, KV, D)
            if hasattr(self, "qk_bias"):
                q, k = q + self.qk_bias[0], k + self.qk_bias[1]  # [1, H, D] over tokens; KV == H (config)
        else:
            q = self.q_proj(x).view(*shp, H, D)
            k = self.k_proj(x).view(*shp, KV, D)
            v = self.v_proj(x).view(*shp, KV, D)
        q = apply_rope(q, *rope, interleaved=self.interleaved)
        k = apply_rope(k, *rope, interleaved=self.interleaved)
        y = attend(q, k, v)
        out = y.reshape(*shp, H * D)
        return self.proj(out) if self.fused else self.o_proj(out)

"""The huginn_raven format: a prelude, then the prelude output injected through an adapter at every
loop step (from a zero state), a coda.

- Huginn-0125 (tomg-group-umd/huginn-0125, `2-4-2`): sandwich blocks (`norm_1..norm_4`), interleaved
  RoPE, an optional `qk_bias`, ln_f used twice (before and after the coda).
- The retrofitted-recurrence checkpoints (McLeish et al. 2025; LoopedLMs/retrofitting-recurrence):
  Llama layers under the same names, pre-norm (`raven_llama`: Llama-3.2, TinyLlama) or post-norm with
  q/k norms over the full q/k width (`raven_olmo`: OLMo-2), Llama RoPE, GQA, ln_f once (after the coda).

Key names follow the released checkpoints: `transformer.wte`, `transformer.{prelude,core_block,coda}.{i}`
with `norm_*`, `attn.Wqkv`, `attn.qk_bias` / `attn.{q,k}_norm`, `attn.proj`, `mlp.fc`, `mlp.proj`;
`transformer.adapter`, `transformer.ln_f`, `lm_head`. Our optional learned gate is `exit_gate`.
"""
from __future__ import annotations

import torch
from torch import nn

from .config import LoopConfig
from .layers import Attend, Attention, RMSNorm, SwiGLU
from .model import AttendFor, LoopedLM


class SandwichBlock(nn.Module):
    def __init__(self, cfg: LoopConfig):
        super().__init__()
        d = cfg.hidden_size
        self.norm_1 = RMSNorm(d, cfg.norm_eps)
        self.attn = Attention(d, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rope_theta, fused=True,
                              qk_bias=cfg.qk_bias)
        self.norm_2 = RMSNorm(d, cfg.norm_eps)
        self.mlp = SwiGLU(d, cfg.intermediate_size, fused=True)
        self.norm_3 = RMSNorm(d, cfg.norm_eps)
        self.norm_4 = RMSNorm(d, cfg.norm_eps)

    def forward(self, x: torch.Tensor, rope, attend: Attend) -> torch.Tensor:
        # norms sit on the residual sum, not on the branch
        x = self.norm_2(x + self.attn(self.norm_1(x), rope, attend))
        return self.norm_4(x + self.mlp(self.norm_3(x)))


class RavenBlock(nn.Module):
    """A retrofitted model's Llama layer under the huginn_raven names: pre-norm (Llama:
    x + attn(norm_1(x)), then x + mlp(norm_2(x))) or post-norm (OLMo-2: x + norm_1(attn(x)), then
    x + norm_2(mlp(x)), with q/k norms)."""

    def __init__(self, cfg: LoopConfig):
        super().__init__()
        d = cfg.hidden_size
        self.post_norm = cfg.family == "raven_olmo"
        self.norm_1 = RMSNorm(d, cfg.norm_eps)
        self.attn = Attention(d, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rope_theta, fused=True,
                              interleaved=False, qk_norm=self.post_norm, eps=cfg.norm_eps)
        self.norm_2 = RMSNorm(d, cfg.norm_eps)
        self.mlp = SwiGLU(d, cfg.intermediate_size, fused=True)

    def forward(self, x: torch.Tensor, rope, attend: Attend) -> torch.Tensor:
        if self.post_norm:
            x = x + self.norm_1(self.attn(x, rope, attend))
            return x + self.norm_2(self.mlp(x))
        x = x + self.attn(self.norm_1(x), rope, attend)
        return x + self.mlp(self.norm_2(x))


class HuginnLM(LoopedLM):
    def __init__(self, cfg: LoopConfig):
        super().__init__()
        self.cfg = cfg
        d = cfg.hidden_size
        Block = SandwichBlock if cfg.family == "huginn" else RavenBlock
        # Huginn-0125 norms the loop state before its coda as well as after it; the retrofits do not
        self.ln_f_twice = cfg.family == "huginn"
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(cfg.vocab_size, d),
            prelude=nn.ModuleList(Block(cfg) for _ in range(cfg.n_prelude)),
            adapter=nn.Linear(2 * d, d, bias=False),
            core_block=nn.ModuleList(Block(cfg) for _ in range(cfg.n_core)),
            coda=nn.ModuleList(Block(cfg) for _ in range(cfg.n_coda)),
            ln_f=RMSNorm(d, cfg.norm_eps),
        ))
        self.lm_head = nn.Linear(d, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.transformer.wte.weight
        if cfg.exit_gate:
            self.exit_gate = nn.Linear(d, 1)
        self.add_distilled_gates()

    def prelude(self, ids, rope, attend_for: AttendFor, init_scale: float = 0.0):
        e = self.transformer.wte(ids) * self.cfg.embed_scale
        for i, block in enumerate(self.transformer.prelude):
            e = block(e, rope, attend_for("prelude", i))
        return self.initial_state(e, init_scale), e

    def initial_state(self, e: torch.Tensor, init_scale: float = 0.0) -> torch.Tensor:
        std = self.cfg.init_std * init_scale
        if std <= 0:
            return torch.zeros_like(e)  # deterministic: what the engine uses
        x = torch.empty_like(e)
        nn.init.trunc_normal_(x, mean=0.0, std=std, a=-3 * std, b=3 * std)
        return x * self.cfg.embed_scale

    def core_step(self, state, inj, rope, attend_for: AttendFor):
        x = self.transformer.adapter(torch.cat([state, inj], dim=-1))  # order: state, then injection
        for i, block in enumerate(self.transformer.core_block):
            x = self.block(block, x, rope, attend_for("core", i))
        return x

    def gate_features(self, state):
        return self.transformer.ln_f(state)

    def stock_gate(self):
        return self.exit_gate if self.cfg.exit_gate else None

    def input_embedding(self) -> nn.Embedding:
        return self.transformer.wte

    def coda(self, state, rope, attend_for: AttendFor):
        x = self.transformer.ln_f(state) if self.ln_f_twice else state
        for i, block in enumerate(self.transformer.coda):
            x = block(x, rope, attend_for("coda", i))
        return self.transformer.ln_f(x)

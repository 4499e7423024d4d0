"""Huginn (tomg-group-umd/huginn-0125): `2-4-2` with input injection through an adapter.

Key names follow the released checkpoint: `transformer.wte`, `transformer.{prelude,core_block,coda}.{i}`
with `norm_1..norm_4`, `attn.Wqkv`, `attn.qk_bias`, `attn.proj`, `mlp.fc`, `mlp.proj`;
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


class HuginnLM(LoopedLM):
    def __init__(self, cfg: LoopConfig):
        super().__init__()
        self.cfg = cfg
        d = cfg.hidden_size
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(cfg.vocab_size, d),
            prelude=nn.ModuleList(SandwichBlock(cfg) for _ in range(cfg.n_prelude)),
            adapter=nn.Linear(2 * d, d, bias=False),
            core_block=nn.ModuleList(SandwichBlock(cfg) for _ in range(cfg.n_core)),
            coda=nn.ModuleList(SandwichBlock(cfg) for _ in range(cfg.n_coda)),
            ln_f=RMSNorm(d, cfg.norm_eps),  # used twice: after the loop and before the head
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

    def coda(self, state, rope, attend_for: AttendFor):
        x = self.transformer.ln_f(state)
        for i, block in enumerate(self.transformer.coda):
            x = block(x, rope, attend_for("coda", i))
        return self.transformer.ln_f(x)

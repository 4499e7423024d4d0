"""`0-L-0` models, every layer in the loop and the normed output of a pass the next pass's input:
Ouro (ByteDance/Ouro-1.4B, 2.6B and their -Thinking versions) and Nanbeige4.2 (`num_loops` passes of
its 22 layers).

Key names follow the released checkpoints: `model.embed_tokens`, `model.layers.{i}.self_attn.*`,
`model.layers.{i}.mlp.*`, `model.norm`, `lm_head`; Ouro's layers have four sandwich norms and its
`model.early_exit_gate`; Nanbeige's are pre-norm Llama layers (`input_layernorm`,
`post_attention_layernorm`) and it has no gate (ours, when added, is `exit_gate`).
"""
from __future__ import annotations

import torch
from torch import nn

from .config import LoopConfig
from .layers import Attend, Attention, RMSNorm, SwiGLU
from .model import AttendFor, LoopedLM


class OuroLayer(nn.Module):
    """A layer under the HF Llama names: Ouro's sandwich norms (the branch output normed again before
    the residual add) or, for Nanbeige, plain pre-norm."""

    def __init__(self, cfg: LoopConfig):
        super().__init__()
        d = cfg.hidden_size
        self.sandwich = cfg.family == "ouro"
        self.self_attn = Attention(d, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rope_theta, fused=False)
        self.mlp = SwiGLU(d, cfg.intermediate_size, fused=False)
        self.input_layernorm = RMSNorm(d, cfg.norm_eps)
        if self.sandwich:
            self.input_layernorm_2 = RMSNorm(d, cfg.norm_eps)
        self.post_attention_layernorm = RMSNorm(d, cfg.norm_eps)
        if self.sandwich:
            self.post_attention_layernorm_2 = RMSNorm(d, cfg.norm_eps)

    def forward(self, x: torch.Tensor, rope, attend: Attend) -> torch.Tensor:
        if self.sandwich:
            x = x + self.input_layernorm_2(self.self_attn(self.input_layernorm(x), rope, attend))
            return x + self.post_attention_layernorm_2(self.mlp(self.post_attention_layernorm(x)))
        x = x + self.self_attn(self.input_layernorm(x), rope, attend)
        return x + self.mlp(self.post_attention_layernorm(x))


class OuroBody(nn.Module):
    def __init__(self, cfg: LoopConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(OuroLayer(cfg) for _ in range(cfg.n_core))
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        if cfg.family == "ouro":
            self.early_exit_gate = nn.Linear(cfg.hidden_size, 1)


class OuroLM(LoopedLM):
    def __init__(self, cfg: LoopConfig):
        super().__init__()
        self.cfg = cfg
        self.model = OuroBody(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        if cfg.family != "ouro" and cfg.exit_gate:
            self.exit_gate = nn.Linear(cfg.hidden_size, 1)
        self.add_distilled_gates()

    def prelude(self, ids, rope, attend_for: AttendFor, init_scale: float = 0.0):
        return self.model.embed_tokens(ids), None  # no scaling, no injection

    def core_step(self, state, inj, rope, attend_for: AttendFor):
        for i, layer in enumerate(self.model.layers):
            state = self.block(layer, state, rope, attend_for("core", i))
        # the normed state is both this step's output and the next step's input
        return self.model.norm(state)

    def gate_features(self, state):
        return state

    def stock_gate(self):
        if self.cfg.family == "ouro":
            return self.model.early_exit_gate
        return self.exit_gate if self.cfg.exit_gate else None

    def input_embedding(self) -> nn.Embedding:
        return self.model.embed_tokens

    def coda(self, state, rope, attend_for: AttendFor):
        return state  # coda = lm_head only

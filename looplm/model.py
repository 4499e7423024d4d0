"""The looped-LM interface every family implements, and the full-sequence forward built on it.

A looped LM is `embed -> prelude (P layers) -> core (C layers) x r -> coda (Q layers) -> head`.
Each piece is a method over tokens of any leading shape ([B, T] for a full forward, [N] for a flat
batch of tokens from different sequences in the engine), so the full forward below, the reference
decoder and the engine's runner all call the same math. Attention goes through `attend_for`
(see layers.py), which is where KV layouts plug in.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.utils.checkpoint
from torch import nn

from .config import LoopConfig
from .layers import Attend, causal_attend, rope_cos_sin

# attend_for(stage, layer) -> the attention callable for that layer; stage in {"prelude", "core", "coda"}
AttendFor = Callable[[str, int], Attend]


def plain_attend_for(stage: str, layer: int) -> Attend:
    return causal_attend


@dataclass
class LoopOutput:
    logits: torch.Tensor  # [B, T, V] after num_steps loops
    gate_logits: torch.Tensor | None  # [num_steps, B, T] pre-sigmoid, where the model has a gate
    states: list[torch.Tensor] | None = None  # per-step loop states, when asked for


class LoopedLM(nn.Module):
    cfg: LoopConfig
    # training only (train/common.layer_checkpointing): each core layer call under activation
    # checkpointing, so a loop step keeps only its layers' inputs for the backward pass
    checkpoint_layers: bool = False

    def block(self, layer: nn.Module, x: torch.Tensor, rope, attend: Attend) -> torch.Tensor:
        """One core layer; recomputed in the backward pass when `checkpoint_layers` is set."""
        if self.checkpoint_layers and torch.is_grad_enabled():
            return torch.utils.checkpoint.checkpoint(layer, x, rope, attend, use_reentrant=False)
        return layer(x, rope, attend)

    # ---- stage pieces, implemented per architecture -------------------------------------------
    def prelude(self, ids: torch.Tensor, rope, attend_for: AttendFor, init_scale: float = 0.0
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Token ids -> (initial loop state, injection input or None)."""
        raise NotImplementedError

    def core_step(self, state: torch.Tensor, inj: torch.Tensor | None, rope, attend_for: AttendFor
                  ) -> torch.Tensor:
        """One application of the shared block."""
        raise NotImplementedError

    def gate_features(self, state: torch.Tensor) -> torch.Tensor:
        """What the stock exit gate reads from a loop state (the distilled lookahead head reads the same)."""
        raise NotImplementedError

    def stock_gate(self) -> nn.Linear | None:
        """The stock exit-gate head (Ouro's early_exit_gate, our Huginn exit_gate), None without one."""
        raise NotImplementedError

    def gate_logits(self, state: torch.Tensor) -> torch.Tensor | None:
        """Pre-sigmoid exit-gate score of a loop state (None without a gate head)."""
        gate = self.stock_gate()
        return None if gate is None else gate(self.gate_features(state)).squeeze(-1)

    # ---- heads distilled from the stock gate (train/distill_gate.py) ------------------------------
    def add_distilled_gates(self) -> None:
        """Create the heads the config names (call at the end of an architecture's __init__): a
        lookahead head Linear(d -> 1) on the stock gate's input, whose score after step s predicts the
        stock gate's at step s+1, and a preloop gate Linear(d -> preloop_depths) on the prelude output
        (preloop_depths: the r_max it was distilled at, config.py)."""
        d = self.cfg.hidden_size
        if self.cfg.lookahead_gate:
            self.lookahead_exit_gate = nn.Linear(d, 1)
        if self.cfg.preloop_gate:
            self.preloop_exit_gate = nn.Linear(d, self.cfg.preloop_depths)

    def lookahead_logits(self, state: torch.Tensor) -> torch.Tensor:
        return self.lookahead_exit_gate(self.gate_features(state)).squeeze(-1)

    def preloop_logits(self, state: torch.Tensor, inj: torch.Tensor | None) -> torch.Tensor:
        """[..., preloop_depths] exit-depth logits from the prelude's output: Huginn's injection input (its
        initial loop state is zeros), Ouro's embedding (its initial loop state)."""
        return self.preloop_exit_gate(inj if inj is not None else state)

    def coda(self, state: torch.Tensor, rope, attend_for: AttendFor) -> torch.Tensor:
        """Loop state -> hidden state the head reads (runs the coda layers, writing their KV)."""
        raise NotImplementedError

    def input_embedding(self) -> nn.Embedding:
        """The token embedding (what a tied LM head shares)."""
        raise NotImplementedError

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    # ---- helpers -------------------------------------------------------------------------------
    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return rope_cos_sin(positions, self.cfg.head_dim, self.cfg.rope_theta, self.dtype, self.cfg.rope_scaling)

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    def forward(self, input_ids: torch.Tensor, num_steps: int | None = None, init_scale: float = 0.0,
                return_states: bool = False) -> LoopOutput:
        """Full causal forward of `input_ids` [B, T] with `num_steps` loops (default r_max)."""
        steps = self.cfg.r_max if num_steps is None else int(num_steps)
        if steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {steps}")
        T = input_ids.shape[1]
        if T > self.cfg.max_position:
            raise ValueError(f"sequence of {T} tokens exceeds the context of {self.cfg.max_position}")
        rope = self.rope(torch.arange(T, device=input_ids.device))
        state, inj = self.prelude(input_ids, rope, plain_attend_for, init_scale)
        gates, states = [], []
        for _ in range(steps):
            state = self.core_step(state, inj, rope, plain_attend_for)
            g = self.gate_logits(state)
            if g is not None:
                gates.append(g)
            if return_states:
                states.append(state)
        logits = self.head(self.coda(state, rope, plain_attend_for))
        return LoopOutput(logits, torch.stack(gates) if gates else None, states if return_states else None)

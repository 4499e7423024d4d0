"""The reference decoder: slow, sequential, one request at a time. Ground truth for the engine.

It implements BLUEPRINT sections 2-3 directly: the prompt is prefilled at full depth (depth-major,
every layout), the first token comes from full depth, then each decode token runs the prelude,
core steps until the exit policy stops it (looplm/policy.py), the KV layout's on-exit hook, and the coda.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kv_layouts import DEFAULT_LAYOUT, layout_class, make_layout
from looplm.exits import preloop_cdf
from looplm.model import LoopedLM
from looplm.policy import ExitPolicy, ExitTracker
from looplm.sampling import choose_token

from . import stages
from .stages import TokenBatch


@dataclass
class Generation:
    token_ids: list[int]
    exit_depths: list[int]  # per generated token; the first comes from the full-depth prefill
    finish_reason: str  # "stop" | "length"
    logprobs: list[float] = field(default_factory=list)  # log-prob of each chosen token


def _t(x, device) -> torch.Tensor:
    return torch.as_tensor(x, dtype=torch.long, device=device)


def decode_batch(token: int, pos: int, steps: int, device) -> TokenBatch:
    """A one-token decode batch whose rows are its positions (the reference's row allocation)."""
    return TokenBatch(ids=_t([token], device), positions=_t([pos], device), rows=_t([pos], device),
                      steps=_t([steps], device), ctx_rows=torch.arange(pos + 1, device=device)[None],
                      ctx_len=_t([pos + 1], device))


@torch.no_grad()
def reference_generate(model: LoopedLM, prompt_ids: list[int], max_new_tokens: int, policy: ExitPolicy,
                       kv_layout: str = DEFAULT_LAYOUT, temperature: float = 0.0, top_k: int = 0,
                       top_p: float = 1.0, seed: int | None = None, stop_token_ids: tuple[int, ...] = (),
                       forced_tokens: list[int] | None = None) -> Generation:
    """Generate up to `max_new_tokens` after `prompt_ids`. `forced_tokens` teacher-forces the
    continuation (the chosen tokens are these; log-probs are theirs)."""
    cfg, dev = model.cfg, model.device
    if not prompt_ids:
        raise ValueError("empty prompt")
    if layout_class(kv_layout).disables_exits:  # the layout decides (as in EngineConfig.resolve)
        policy = ExitPolicy("none", None, policy.r_max, policy.r_max)
    L = len(prompt_ids)
    n_rows = min(L + max_new_tokens, cfg.max_position)
    if L >= cfg.max_position:
        raise ValueError(f"prompt of {L} tokens leaves no room in the context of {cfg.max_position}")
    layout = make_layout(kv_layout, cfg, n_rows, model.dtype, dev)
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    stops = set(stop_token_ids)

    pb = TokenBatch(ids=_t(prompt_ids, dev), positions=torch.arange(L, device=dev), rows=torch.arange(L, device=dev),
                    steps=torch.ones(L, dtype=torch.long, device=dev), seq_ids=torch.zeros(L, dtype=torch.long, device=dev))
    logits = stages.prefill(model, layout, pb, _t([L - 1], dev))[0]
    out = Generation([], [], "length")

    def emit(logits: torch.Tensor, depth: int) -> bool:
        i = len(out.token_ids)
        tok = forced_tokens[i] if forced_tokens is not None else choose_token(logits, temperature, top_k, top_p, gen)
        out.token_ids.append(tok)
        out.exit_depths.append(depth)
        out.logprobs.append(float(torch.log_softmax(logits.double(), -1)[tok]))
        if tok in stops:
            out.finish_reason = "stop"
            return True
        return len(out.token_ids) >= max_new_tokens or L + len(out.token_ids) >= n_rows

    done = emit(logits, cfg.r_max)
    while not done:
        pos = L + len(out.token_ids) - 1
        b = decode_batch(out.token_ids[-1], pos, 1, dev)
        state, inj = stages.prelude(model, layout, b)
        tracker, aux, s = ExitTracker(policy), None, 0
        if policy.criterion == "preloop":
            tracker.at_prelude(preloop_cdf(model, state, inj)[0].tolist())
        while True:
            s += 1
            b.steps.fill_(s)
            state, scores, aux = stages.core_step(model, layout, b, state, inj, policy.criterion, aux)
            if tracker.after_step(s, float(scores[0])):
                break
        layout.on_exit(b.rows, _t([s], dev))
        done = emit(stages.coda(model, layout, b, state)[0], s)
    return out

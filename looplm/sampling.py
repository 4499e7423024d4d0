"""Choosing the next token from one row of logits; shared by the reference decoder and the engine."""
from __future__ import annotations

import torch


def choose_token(logits: torch.Tensor, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                 generator: torch.Generator | None = None) -> int:
    """logits: [V]. temperature 0 is greedy. top_k 0 and top_p 1 disable those filters."""
    if temperature == 0.0:
        return int(torch.argmax(logits))
    x = logits.double() / temperature
    if 0 < top_k < x.shape[-1]:
        kth = torch.topk(x, top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if top_p < 1.0:
        sorted_x, idx = torch.sort(x, descending=True)
        cum = torch.softmax(sorted_x, -1).cumsum(-1)
        drop = cum - torch.softmax(sorted_x, -1) >= top_p  # keep the smallest prefix reaching top_p
        x = x.index_fill(0, idx[drop], float("-inf"))
    probs = torch.softmax(x, -1).cpu()
    return int(torch.multinomial(probs, 1, generator=generator))

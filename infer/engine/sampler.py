"""Batched sampling: one call per stage that emits tokens, for the whole batch.

Rows fall in three groups, decided per request:
- greedy (temperature 0, and teacher-forced rows, whose argmax says whether the forced token was
  the greedy one): one argmax over the batch;
- sampled without a seed: vectorised over the batch on the device (temperature, top-k, top-p,
  then a draw by the exponential race argmax(p / E), E ~ Exp(1), which picks token i with
  probability p_i), from the engine's generator;
- sampled with a seed: the request's own generator and the reference decoder's `choose_token`,
  row by row, so that its tokens equal the reference's and do not depend on its batch mates
  (a batched draw would consume one generator for the whole batch).
The chosen ids of every row come back to the host in one device-to-host copy.
"""
from __future__ import annotations

from operator import attrgetter

import torch

from looplm.sampling import choose_token

from .batch_state import to_device
from .sequence import Sequence

_sampled = attrgetter("sampled")


def sample_batched(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                   generator: torch.Generator | None = None) -> torch.Tensor:
    """logits [n, V], per-row temperature (> 0), top_k (0 = off), top_p (1 = off) -> token ids [n].
    Same filters as `choose_token`: keep the k largest, then the smallest prefix (by probability)
    whose mass reaches top_p."""
    x = logits.float() / temperature[:, None].float()
    V = x.shape[-1]
    xs, idx = torch.sort(x, dim=-1, descending=True)
    rank = torch.arange(V, device=x.device)
    k = torch.where(top_k > 0, top_k, V).clamp(max=V)
    xs = xs.masked_fill(rank[None, :] >= k[:, None], float("-inf"))
    p = torch.softmax(xs, -1)
    xs = xs.masked_fill(p.cumsum(-1) - p >= top_p[:, None], float("-inf"))  # the most likely token stays
    p = torch.softmax(xs, -1)
    e = torch.empty_like(p).exponential_(generator=generator)
    return idx.gather(1, (p / e).argmax(-1, keepdim=True))[:, 0]


class Sampler:
    def __init__(self, seed: int, device: torch.device):
        self.generator = torch.Generator(device=device).manual_seed(seed)

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence], maybe_sampled: bool = True) -> list[int]:
        """The next token of each row of `logits` [n, V] (teacher-forced rows: the argmax).
        `maybe_sampled=False`: the caller knows that no row samples (the engine counts the running
        requests that do), which spares a pass over the batch (~9 us at batch 256)."""
        toks = self.device_ids(logits, seqs, maybe_sampled).tolist()  # the one device-to-host copy of the batch's ids
        if maybe_sampled:
            for i, s in enumerate(seqs):
                p = s.params
                if s.sampled and p.seed is not None:
                    toks[i] = choose_token(logits[i], p.temperature, p.top_k, p.top_p, s.generator)
        return toks

    def device_ids(self, logits: torch.Tensor, seqs: list[Sequence], maybe_sampled: bool = True) -> torch.Tensor:
        """The ids [n] on the device, no host read: the argmax, with the rows that sample without a
        seed drawn from the engine's generator. A seeded row keeps its argmax here (`__call__` draws
        it on the host; on-device re-entry leaves such stages to the host: OutputProcessor.can_defer)."""
        greedy = logits.argmax(-1)
        if not maybe_sampled or not any(map(_sampled, seqs)):
            return greedy
        rest = [i for i, s in enumerate(seqs) if s.sampled and s.params.seed is None]
        if rest:
            ps = [seqs[i].params for i in rest]
            n, dev = len(rest), logits.device
            # two uploads (pinned, asynchronous on CUDA): rows and top-k, temperatures and top-p
            ints = to_device(rest + [p.top_k for p in ps], dev)
            floats = to_device([p.temperature for p in ps] + [p.top_p for p in ps], dev, torch.float64)
            rows = ints[:n]
            drawn = sample_batched(logits[rows], floats[:n], ints[n:], floats[n:].float(), self.generator)
            greedy = greedy.index_copy(0, rows, drawn)
        return greedy

"""Documents packed into one training window, kept apart: positions restart per document and
attention never crosses a document boundary (a block-diagonal causal mask through SDPA).

A window's documents are given by `docs` [B, T]: each position's document index (train/datasource.py
writes them: 0, 1, 2, ... per window, padding its own document). A packed batch is then the same
computation as its documents run one by one (tests/test_train_packing.py checks the loss and its
gradient), which is what plain concatenation with EOS is not: there the later documents attend to the
earlier ones and their positions run on.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from looplm.layers import Attend
from looplm.model import AttendFor


def doc_positions(docs: torch.Tensor) -> torch.Tensor:
    """[B, T] position of each token inside its document (0 at every document's first token)."""
    T = docs.shape[-1]
    idx = torch.arange(T, device=docs.device).expand_as(docs)
    new = torch.ones_like(docs, dtype=torch.bool)
    new[..., 1:] = docs[..., 1:] != docs[..., :-1]
    start = torch.where(new, idx, torch.zeros_like(idx)).cummax(dim=-1).values
    return idx - start


def same_doc(docs: torch.Tensor) -> torch.Tensor:
    """[B, 1, T, T]: query p and key j are in one document (broadcast over heads)."""
    return (docs[:, :, None] == docs[:, None, :])[:, None]


def doc_causal_mask(docs: torch.Tensor) -> torch.Tensor:
    """[B, 1, T, T] keys each query attends to: the earlier positions of its own document."""
    T = docs.shape[-1]
    causal = torch.ones(T, T, dtype=torch.bool, device=docs.device).tril()
    return same_doc(docs) & causal


def doc_attend(docs: torch.Tensor) -> Attend:
    """Causal self-attention that stays inside each document; q: [B, T, H, D]; k, v: [B, T, KVH, D].
    (One mask per batch: the memory-efficient SDPA kernels take it without keeping T x T scores.)"""
    mask = doc_causal_mask(docs)

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           attn_mask=mask, enable_gqa=q.shape[2] != k.shape[2])
        return y.transpose(1, 2)
    return attend


def doc_attend_for(docs: torch.Tensor) -> AttendFor:
    """attend_for (looplm.model) with every stage's attention kept inside the documents."""
    attend = doc_attend(docs)
    return lambda stage, layer: attend


def prompt_positions(prompt_len: int | torch.Tensor, shape: tuple[int, int], docs: torch.Tensor | None,
                     device) -> torch.Tensor:
    """[B, T] bool: the positions run as prompt (full depth, prefilled). An int P: the first P positions
    of every document (of the window without `docs`); a bool tensor is taken as it is."""
    if isinstance(prompt_len, torch.Tensor):
        return prompt_len.to(device=device, dtype=torch.bool)
    pos = doc_positions(docs) if docs is not None else torch.arange(shape[1], device=device).expand(shape)
    return pos < prompt_len


def prompt_from_targets(targets: torch.Tensor | None, docs: torch.Tensor, min_len: int = 1) -> torch.Tensor:
    """[B, T] bool prompt positions of packed documents whose targets say where a reply starts
    (`targets` [B, T]: position p's next-token prediction counts; e.g. the assistant-only mask): each
    document's prompt runs through the position that predicts its first counted token (that prediction
    is the prefill's, at full depth, as a served request's first token is), and at least its first
    `min_len` positions. A document without a counted target is all prompt (it carries no loss)."""
    pos = doc_positions(docs)
    prompt = pos < min_len
    if targets is None:
        return prompt
    B, T = docs.shape
    # the first counted position of every document: a scatter_reduce over (row, document) pairs
    big = torch.full_like(pos, T)
    first_at = torch.where(targets.bool(), pos, big)
    key = docs - docs.min(dim=1, keepdim=True).values  # 0.. per row
    first = torch.full((B, int(key.max()) + 1), T, dtype=pos.dtype, device=docs.device)
    first = first.scatter_reduce(1, key, first_at, reduce="amin")
    return prompt | (pos <= first.gather(1, key))

"""Mixed launches: one prelude, core step, coda or fused iteration over decode items *and* prompt
chunks (chunks.py has the scheduling). The decode items keep their per-slot state and padded
context gather (runner.py); each chunk is a `Segment` of the batch (stages.py): its positions' loop
state lives on the Sequence between launches (`seq.chunk_state`), its attention is one causal SDPA
over its own context rows. Runs eagerly (no CUDA graph: a chunk's length varies per launch).
"""
from __future__ import annotations

import torch

from looplm.exits import initial_aux

from . import stages
from .scheduler import Work
from .sequence import Sequence, Stage
from .stages import Segment, TokenBatch

# `r` below is the ModelRunner (runner.py imports this module, so it is not imported back here)
ModelRunner = object


def _chunk_rows(r: ModelRunner, s: Sequence) -> list[int]:
    """KV rows of positions 0..end-1 of a chunk's prompt."""
    B, blocks = r.blocks.block_size, s.blocks
    return [blocks[p // B] * B + p % B for p in range(s.chunk[1])]


def build(r: ModelRunner, work: Work) -> tuple[TokenBatch, torch.Tensor, int]:
    """The mixed TokenBatch: the padded decode items first (as `batch_from` gathers them), then one
    segment per chunk. Returns it with the decode slots [N] and N."""
    stage = Stage.PRELUDE if work.stage is Stage.FUSED else work.stage
    long = dict(dtype=torch.long, device=r.device)
    if work.seqs:
        inp, nb = r._upload(work.seqs, tokens=stage.reads_tokens)
        nb = r._ctx_blocks(nb)
        slots, dec = r.batch_from(stage, inp, nb)
        if dec.ctx_rows is None:  # paged decode attention is on: a mixed launch (eager) gathers instead
            B, j = r.blocks.block_size, r._j[: nb * r.blocks.block_size]
            dec.ctx_rows, dec.paged = r.bt[slots][:, :nb][:, j // B] * B + j % B, None
        parts = [[dec.ids], [dec.positions], [dec.rows], [dec.steps]]
    else:
        slots, dec = torch.zeros(0, **long), None
        parts = [[], [], [], []]
    N = slots.shape[0]
    segs, start = [], N
    for s in work.chunks:
        a, e = s.chunk
        rows = r._t(_chunk_rows(r, s))
        step = s.step + 1 if work.stage is Stage.CORE else 1
        for part, x in zip(parts, (r._t(s.prompt_ids[a:e]), torch.arange(a, e, **long), rows[a:e],
                                   torch.full((e - a,), step, **long))):
            part.append(x)
        segs.append(Segment(start, e - a, a, rows))
        start += e - a
    ids, pos, rows, steps = (torch.cat(p) for p in parts)
    batch = TokenBatch(ids=ids, positions=pos, rows=rows, steps=steps, ctx_rows=dec.ctx_rows if dec else None,
                       ctx_len=dec.ctx_len if dec else None, segments=segs, num_decode=N)
    return batch, slots, N


def _head_index(work: Work, batch: TokenBatch, N: int, device) -> tuple[torch.Tensor, list[tuple[Sequence, int]]]:
    """Rows that go through the head: the real decode items, the last position of each chunk that
    ends its prompt (its first token), then every position of chunks whose request asked for prompt
    log-probs. Returns the index and, per such chunk, where its rows start in the logits."""
    idx = list(range(len(work.seqs)))
    finals = {id(s) for s in work.finals}
    for s, g in zip(work.chunks, batch.segments):
        if id(s) in finals:
            idx.append(g.start + g.length - 1)
    want = []
    for s, g in zip(work.chunks, batch.segments):
        if s.params.prompt_logprobs is not None:
            want.append((s, len(idx)))
            idx += range(g.start, g.start + g.length)
    return torch.tensor(idx, dtype=torch.long, device=device), want


def _stash_prompt_logits(logits: torch.Tensor, want: list[tuple[Sequence, int]]) -> None:
    for s, at in want:
        n = s.chunk[1] - s.chunk[0]
        part = logits[at:at + n]
        s.prompt_logits = part if s.prompt_logits is None else torch.cat([s.prompt_logits, part])


def _chunk_states(work: Work) -> tuple[torch.Tensor, torch.Tensor | None]:
    st = [s.chunk_state[0] for s in work.chunks]
    inj = [s.chunk_state[1] for s in work.chunks]
    return torch.cat(st), (torch.cat(inj) if inj[0] is not None else None)


def _keep_chunk_states(work: Work, batch: TokenBatch, N: int, state: torch.Tensor, inj: torch.Tensor | None) -> None:
    for s, g in zip(work.chunks, batch.segments):
        sl = slice(g.start, g.start + g.length)
        s.chunk_state = (state[sl], inj[sl] if inj is not None else None)


def run(r: ModelRunner, work: Work) -> torch.Tensor | None:
    """One mixed launch. Returns what the plain stage returns: None (prelude), scores of the decode
    items (core), logits [decode items + final chunks, V] (coda, fused)."""
    batch, slots, N = build(r, work)
    m, lay = r.model, r.layout
    if work.stage is Stage.PRELUDE:
        state, inj = stages.prelude(m, lay, batch)
        if N:
            r.step.index_fill_(0, slots, 0)
            r.state.index_copy_(0, slots, state[:N])
            if r.inj is not None:
                r.inj.index_copy_(0, slots, inj[:N])
            if r.aux is not None:
                r.aux.index_copy_(0, slots, initial_aux(r.criterion, N, r.cfg.vocab_size, r.device))
        _keep_chunk_states(work, batch, N, state, inj)
        return None
    if work.stage is Stage.CORE:
        cs, ci = _chunk_states(work)
        state = torch.cat([r.state[slots], cs])
        inj = torch.cat([r.inj[slots], ci]) if r.inj is not None else None
        aux = r.aux[slots] if r.aux is not None else None
        new, scores, aux = stages.core_step(m, lay, batch, state, inj, r.criterion, aux)
        if N:
            r.state.index_copy_(0, slots, new[:N])
            if aux is not None:
                r.aux.index_copy_(0, slots, aux)
            r.step.index_copy_(0, slots, batch.steps[:N])
            r.step[r.scratch_slot:].zero_()
        _keep_chunk_states(work, batch, N, new, inj)
        return scores
    idx, want = _head_index(work, batch, N, r.device)
    if work.stage is Stage.CODA:
        if N:  # the last_exited fill of the decode items first (prompt positions are at r_max)
            lay.on_exit(batch.rows[:N], r.step[slots])
        cs, _ = _chunk_states(work)
        logits = stages.coda(m, lay, batch, torch.cat([r.state[slots], cs]), head_index=idx)
    else:  # FUSED: CB's iteration, prompt positions at the same loop steps as the decode items
        logits = stages.fused(m, lay, batch, work.r_max, head_index=idx)
    _stash_prompt_logits(logits, want)
    return logits[:len(work.seqs) + len(work.finals)]

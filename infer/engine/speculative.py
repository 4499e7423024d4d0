"""Exact self-speculative decoding: draft with the same weights at a shallow loop depth, verify at
the serving exit policy in one depth-major pass, keep what the verifier would have produced.

Why it is exact (depth-indexed KV layouts only). The state of (position p, loop step s) depends on
the step-s K/V of positions <= p and on (p, s-1); a position's exit decision depends only on its
own states. So a window of positions that runs depth-major (every live position's step s in one
launch, before any position's step s+1; a position that exits has its later depth slots filled
with its exit-step K/V at once, before a later position reads them) computes, for every position
whose input token is the true one, exactly what token-by-token decoding computes. The window is the
current token (its input is known) and k-1 drafted tokens after it:

1. draft, one round per window position: prelude, the policy's core steps capped at `draft_depth`
   (a position whose policy exits at d <= draft_depth is already final: filled, done), then a coda
   on the capped state whose argmax is the next position's input (the draft's guess);
2. verify: the positions still in the loop continue from step draft_depth+1, one launch per loop
   step, each to its own exit (the draft's shallow slots are reused, not recomputed); then one
   coda launch over every window position at its final state (coda K/V written before it is read,
   causally, as in the depth-major prefill);
3. accept (engine side, OutputProcessor.accept_speculative): position i's token is the verifier's; the next position counts
   only if its drafted input equals that token. The first mismatch ends the window; the rows of the
   rejected positions are garbage that the next real decode of those positions overwrites (every
   depth slot of a decoded position is written or filled before anything reads it), and the
   scheduler gives their blocks back (rollback).

Not exact, hence refused (EngineConfig): a layout where loop steps share a depth slot (`shared`,
`first_then_shared`: a decoding token reads earlier positions at their FINAL step, a depth-major
pass at the current one) and the output criteria (kl, entropy_diff: their per-step score runs the
coda, which reads earlier positions' final coda K/V that the pass has not computed yet).
Pure torch on the runner's layout; the per-item Python is small because speculation only runs
when few sequences decode (Scheduler._speculate).
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, NamedTuple

import torch

from looplm.exits import initial_aux, preloop_cdf, score_rule
from looplm.model import LoopedLM
from looplm.policy import ExitTracker

from . import stages
from .block_manager import kv_rows
from .sequence import Sequence, Stage
from .spec_plan import SpecPlan, spec_row
from .stages import TokenBatch
from .trace import TraceRow

if TYPE_CHECKING:
    from kv_layouts import KVLayout


class SpecOut(NamedTuple):
    """What a speculative stage returns: the verifier's logits [sum(ks), V] of every window position
    (sequence-major), and per sequence the drafted tokens (the inputs of window positions 1..k-1)
    and each position's exit depth; the launches it ran (draft / verify counts, and one trace row
    per launch in the format of LLMEngine._record, `phase` added: infer/sim/work.py counts them)."""
    logits: torch.Tensor
    ks: list[int]
    drafts: list[list[int]]
    depths: list[list[int]]
    launches: dict[str, int]
    rows: list[TraceRow]


@torch.inference_mode()
def speculate(model: LoopedLM, layout: KVLayout, block_size: int, criterion: str, seqs: list[Sequence],
              ks: list[int], draft_depth: int) -> SpecOut:
    """Draft and verify windows of `ks[b]` positions after each sequence's last token (a window of 1
    is a plain decode of that token), launch by launch as the plan (spec_plan.py) says. Each
    sequence's block table covers every window position."""
    cfg, dev = model.cfg, model.device
    rule = score_rule(criterion, cfg)
    plan = SpecPlan(ks, draft_depth, [s.num_tokens - 1 for s in seqs])
    owner, index, pos, M = plan.owner, plan.index, plan.pos, len(plan)
    B = block_size
    seq_rows = []  # per sequence: the KV rows of positions 0..p0+k-1
    for s, k in zip(seqs, ks):
        seq_rows.append(torch.tensor(kv_rows(s.blocks, B, s.num_tokens - 1 + k), dtype=torch.long))
    rows = torch.stack([seq_rows[b][p] for b, p in zip(owner, pos)])
    state = torch.zeros(M, cfg.hidden_size, dtype=model.dtype, device=dev)
    inj = torch.zeros_like(state) if cfg.arch == "huginn" else None
    aux = initial_aux(rule, M, cfg.vocab_size, dev)
    trackers = [ExitTracker(seqs[b].policy) for b in owner]
    drafts: list[list[int]] = [[] for _ in seqs]
    launches = {"draft": 0, "verify": 0}
    trace: list[TraceRow] = []
    t0 = time.perf_counter()
    logits = None

    def batch(idx: list[int], ids: list[int] | None = None, step: int = 1) -> TokenBatch:
        L = max(pos[i] for i in idx) + 1
        ctx = torch.full((len(idx), L), layout.scratch_row, dtype=torch.long)
        for r, i in enumerate(idx):
            ctx[r, :pos[i] + 1] = seq_rows[owner[i]][:pos[i] + 1]
        t = lambda x: torch.as_tensor(x, dtype=torch.long).to(dev)  # noqa: E731
        return TokenBatch(ids=t(ids if ids is not None else [0] * len(idx)), positions=t([pos[i] for i in idx]),
                          rows=t(rows[idx]), steps=torch.full((len(idx),), step, dtype=torch.long, device=dev),
                          ctx_rows=ctx.to(dev), ctx_len=t([pos[i] + 1 for i in idx]))

    for launch in plan:
        idx, stage = launch.items, launch.stage
        ix = torch.tensor(idx, dtype=torch.long, device=dev)
        exits = None
        if stage is Stage.PRELUDE:  # a draft round's inputs: the last token, then the drafts before
            ids = [seqs[owner[i]].output_ids[-1] if index[i] == 0 else drafts[owner[i]][index[i] - 1] for i in idx]
            st, ij = stages.prelude(model, layout, batch(idx, ids))
            state[ix] = st
            if inj is not None:
                inj[ix] = ij
            if criterion == "preloop":  # every depth is fixed here, no score is read during the loop
                for i, cdf in zip(idx, preloop_cdf(model, st, ij).tolist()):
                    trackers[i].at_prelude(cdf)
        elif stage is Stage.CORE:  # one loop step for the items (all at launch.step); exits are filled at once
            new, scores, a = stages.core_step(model, layout, batch(idx, step=launch.step), state[ix],
                                              inj[ix] if inj is not None else None, criterion,
                                              aux[ix] if aux is not None else None)
            state[ix] = new
            if a is not None:
                aux[ix] = a
            scores = scores.tolist() if criterion != "preloop" else [0.0] * len(idx)
            exits = [i for i, x in zip(idx, scores) if trackers[i].after_step(launch.step, x)]
        elif launch.phase == "draft":  # the coda on the capped state: its argmax is the next input
            toks = stages.coda(model, layout, batch(idx), state[ix]).argmax(-1).tolist()
            for i, tok in zip(idx, toks):
                drafts[owner[i]].append(tok)
        else:  # every window position at its final state
            logits = stages.coda(model, layout, batch(idx), state)
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
        # the launch's trace row (seconds since the last one: a core step's score read waits for
        # the device, so on CUDA these are close to device time)
        now = time.perf_counter()
        launches[launch.phase] += 1
        trace.append(spec_row(launch, plan.context(idx), cfg.r_max, now - t0,
                              int(stage is Stage.CORE and criterion != "preloop")))
        t0 = now
        if exits:
            plan.exited(exits)
            layout.on_exit(rows[exits].to(dev), torch.tensor([launch.step] * len(exits), dtype=torch.long,
                                                             device=dev))
    return SpecOut(logits, list(ks), drafts, plan.depths(), launches, trace)

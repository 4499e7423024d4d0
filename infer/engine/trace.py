"""A trace row: one launch as the engine records it (EngineConfig.trace), as the simulator records
its virtual launches (infer/sim/runner.py), and as `infer.bench --save-trace` writes it. What reads
rows: infer/sim/work.py (exact work counts), infer/sim/stats.py (per-stage tables), the latency fit
(infer/sim/latency.py), the emulated device's host share. Rows stay plain dicts, typed by
`TraceRow`, because they go to JSON and come back from it (`infer.sim.latency fit FILE`,
`infer.sim --fitted FILE`); `trace_row` is their one builder, so every writer fills every key."""
from __future__ import annotations

from typing import TypedDict


class TraceRow(TypedDict, total=False):
    stage: str  # Stage.value
    batch: int  # decode items (a prefill: whole prompts)
    padded: int  # the batch the launch ran at (runner.padded)
    tokens: int  # rows through the stage's layers that are decode items (a prefill: prompt tokens)
    context: int  # context tokens the decode items read (a prefill: prompt tokens)
    prompt_tokens: int  # prompt positions riding in it (mixed prefill chunks; a prefill: all)
    chunks: int  # prompt chunks riding in it (a prefill: its prompts)
    context_pairs: int  # a prefill's causal (query, key) pairs
    prompt_pairs: int  # the prompt chunks' causal (query, key) pairs, their earlier positions included
    finals: int  # prompt chunks that end their prompt (one head row each)
    r_max: int  # loop steps of a fused launch or a prefill
    seconds: float  # the launch's time (wall on a device, virtual in the simulator)
    score_reads: int  # 1 when the host read the launch's exit scores back
    phase: str  # a speculative stage's launches: "draft" or "verify"
    prompt_seconds: float  # simulator: the share of the launch's cost that its prompt chunks add


def trace_row(stage: str, batch: int, *, padded: int, tokens: int, context: int, r_max: int, seconds: float,
              score_reads: int, prompt_tokens: int = 0, chunks: int = 0, context_pairs: int = 0,
              prompt_pairs: int = 0, finals: int = 0, phase: str | None = None,
              prompt_seconds: float | None = None) -> TraceRow:
    row = TraceRow(stage=stage, batch=batch, padded=padded, tokens=tokens, context=context,
                   prompt_tokens=prompt_tokens, chunks=chunks, context_pairs=context_pairs,
                   prompt_pairs=prompt_pairs, finals=finals, r_max=r_max, seconds=seconds, score_reads=score_reads)
    if phase is not None:
        row["phase"] = phase
    if prompt_seconds is not None:
        row["prompt_seconds"] = prompt_seconds
    return row

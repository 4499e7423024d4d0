"""Staggered arrivals: requests join a running engine a few at a time at seeded random steps, so that
admissions happen mid-decode (prompt chunks beside decode items, launches of every size). The one
driver of the engine's equality tests (tests/helpers.py) and of scripts/gpu_check.py."""
from __future__ import annotations

import random

from infer.engine.llm_engine import LLMEngine
from infer.engine.sequence import Sequence


def run_staggered(eng: LLMEngine, adds: list[dict], seed: int | str, join: float = 0.4, burst: int = 3,
                  max_steps: int = 20000) -> list[Sequence]:
    """Run `adds` (add_request's keywords) to the end: at each step, with probability `join` (always
    when the engine is idle), 1..`burst` more arrive. Returns the sequences in input order."""
    rng, pending, seqs, steps = random.Random(seed), list(adds), [], 0
    while pending or eng.has_unfinished():
        if pending and (not eng.has_unfinished() or rng.random() < join):
            for _ in range(rng.randint(1, burst)):
                if pending:
                    seqs.append(eng.add_request(**pending.pop(0)))
        eng.step()
        steps += 1
        if steps >= max_steps:  # a hang would spend a GPU's one run, or a test's minutes
            raise RuntimeError(f"the engine made no progress in {max_steps} steps")
    return seqs

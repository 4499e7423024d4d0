"""The exit policy and the per-token exit decision. Pure Python (no torch): the scheduler uses it.

The runner computes one float `score` per item after each core step (looplm/exits.py); an
`ExitTracker` turns the sequence of scores into the exit depth:
- `ouro_gate`: score = gate logit, lambda = sigmoid; exit at the first step whose CDF
  1 - prod(1 - lambda) >= q (Ouro's exit distribution).
- `learned`: score = gate logit; exit when sigmoid(score) >= q (a per-step "stop now" head).
- `kl`: KL(prev || current) of the output distributions < q (prev = uniform at step 1).
- `latent_diff`: ||s_t - s_{t-1}|| / ||s_t|| < q (s_0 = the initial state).
- `entropy_diff`: |H_t - H_{t-1}| < q (H_0 = 100, as in Huginn's reference).
- `none`: never (full depth).
Standard: a signal after step s with s >= r_min exits at depth s. Lookahead: a signal after step s
means "exit after step s+1", so depths are >= 2 and the scheduler learns at the end of step s who
takes part in step s+2. r_max always stops the loop.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from .config import CRITERIA, LoopConfig

DEFAULT_THRESHOLDS = {"kl": 1e-3, "latent_diff": 0.03, "entropy_diff": 1e-3}  # Huginn's "auto" values
OUTPUT_CRITERIA = ("kl", "entropy_diff")  # need the coda + head at every step


@dataclass(frozen=True)
class ExitPolicy:
    criterion: str
    threshold: float | None  # None with a criterion: never exits
    r_min: int
    r_max: int
    lookahead: bool = False

    def __post_init__(self) -> None:
        if self.criterion not in CRITERIA:
            raise ValueError(f"unknown exit criterion {self.criterion!r}; supported: {CRITERIA}")
        if self.r_max < 1:
            raise ValueError(f"r_max must be >= 1, got {self.r_max}")
        if not 1 <= self.r_min <= self.r_max:
            raise ValueError(f"r_min must be in [1, r_max={self.r_max}], got {self.r_min}")
        if self.threshold is not None and not math.isfinite(self.threshold):
            raise ValueError(f"exit threshold must be finite, got {self.threshold}")

    @property
    def adaptive(self) -> bool:
        return self.criterion != "none" and self.threshold is not None

    @classmethod
    def from_config(cls, cfg: LoopConfig, *, criterion: str | None = None, threshold: float | None = None,
                    r_min: int | None = None, r_max: int | None = None, lookahead: bool = False,
                    full_depth: bool = False) -> ExitPolicy:
        """Config defaults with per-call overrides. `full_depth` disables exits explicitly (never a
        threshold value: Ouro's bf16 gate can saturate to 1.0)."""
        crit = criterion or cfg.exit_criterion
        thr = threshold if threshold is not None else cfg.exit_threshold
        if thr is None and crit in DEFAULT_THRESHOLDS:
            thr = DEFAULT_THRESHOLDS[crit]
        rmax = cfg.r_max if r_max is None else int(r_max)
        if full_depth:
            return cls("none", None, rmax, rmax, False)
        return cls(crit, thr, int(r_min if r_min is not None else min(cfg.r_min, rmax)), rmax, bool(lookahead))


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))


class ExitTracker:
    """Exit bookkeeping of one decode token. `after_step(s, score)` is called after loop step s
    (1-based) and says whether the token leaves the loop now."""

    __slots__ = ("policy", "survival", "exit_at")

    def __init__(self, policy: ExitPolicy):
        self.policy = policy
        self.survival = 1.0  # ouro_gate: prod_{j<=s} (1 - lambda_j)
        self.exit_at: int | None = None  # lookahead: the depth already decided

    def signal(self, score: float) -> bool:
        p = self.policy
        if not p.adaptive:
            return False
        if p.criterion == "ouro_gate":
            lam = _sigmoid(score)
            cdf = 1.0 - self.survival * (1.0 - lam)
            self.survival *= 1.0 - lam
            return cdf >= p.threshold
        if p.criterion == "learned":
            return _sigmoid(score) >= p.threshold
        return score < p.threshold  # kl, latent_diff, entropy_diff

    def after_step(self, s: int, score: float) -> bool:
        p = self.policy
        if self.exit_at is not None:
            return s >= self.exit_at
        if s >= p.r_max:
            return True
        sig = self.signal(score)
        if p.lookahead:
            if sig and s + 1 >= p.r_min:
                self.exit_at = s + 1
            return False
        return sig and s >= p.r_min

    def leaves_after(self, s: int) -> bool:
        """Known at the end of step s: the token does not take part in step s + 2 (lookahead)."""
        return self.exit_at is not None and self.exit_at <= s + 1

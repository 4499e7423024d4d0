"""The exit policy and the per-token exit decision. Pure Python (no torch): the scheduler uses it.

The runner computes one float `score` per item after each core step (looplm/exits.py, on the
device for the whole batch); an `ExitTracker` turns the sequence of scores into the exit depth:
- `ouro_gate`: score = the exit CDF 1 - prod_j (1 - lambda_j), lambda_j = sigmoid(gate logit of
  step j); exit at the first step whose CDF >= q (Ouro's exit distribution).
- `learned`: score = sigmoid(gate logit); exit when score >= q (a per-step "stop now" head).
- `lookahead_gate`: a head distilled from the stock gate (train/distill_gate.py) whose score after
  step s predicts the stock gate's at step s+1 (its teacher's rule: the CDF for ouro_gate, the
  probability for learned); always lookahead: exit after s+1 when score >= q, so depths are >= 2.
- `preloop`: a distilled head on the prelude output gives an exit-depth distribution before the
  loop; the depth is the first d whose CDF >= q, clamped to [r_min, r_max] (`at_prelude`), and no
  score is read during the loop.
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
from bisect import bisect_left
from dataclasses import dataclass

from .config import CRITERIA, LoopConfig, check_depths
from .errors import ParamError

DEFAULT_THRESHOLDS = {"kl": 1e-3, "latent_diff": 0.03, "entropy_diff": 1e-3}  # Huginn's "auto" values
OUTPUT_CRITERIA = ("kl", "entropy_diff")  # need the coda + head at every step
PROBABILITY_CRITERIA = ("ouro_gate", "learned", "lookahead_gate", "preloop")  # threshold in [0, 1]
# the criterion's head each checkpoint must carry (LoopConfig flags)
HEADS = {"ouro_gate": "exit_gate", "learned": "exit_gate", "lookahead_gate": "lookahead_gate", "preloop": "preloop_gate"}
DISTANCE_CRITERIA = ("kl", "latent_diff", "entropy_diff")  # threshold >= 0


@dataclass(frozen=True, slots=True)  # slots: the exit tracker reads these once per item per core step
class ExitPolicy:
    criterion: str
    threshold: float | None  # None with a criterion: never exits
    r_min: int
    r_max: int
    lookahead: bool = False

    def __post_init__(self) -> None:
        if self.criterion not in CRITERIA:
            raise ParamError("exit_criterion", f"unknown exit criterion {self.criterion!r}; supported: {CRITERIA}")
        # the distilled heads fix when a signal acts: the lookahead head's always decides one step
        # ahead, the preloop gate's before the loop (so lookahead has no meaning there)
        if self.criterion in ("lookahead_gate", "preloop"):
            object.__setattr__(self, "lookahead", self.criterion == "lookahead_gate")
        check_depths(self.r_min, self.r_max)
        if self.threshold is not None and not math.isfinite(self.threshold):
            raise ParamError("exit_threshold", f"exit threshold must be finite, got {self.threshold}")
        # the one range check (engine, LLM, lm-eval model and server all build an ExitPolicy):
        # the gate criteria compare a probability, the others a distance
        if self.threshold is not None and self.criterion in PROBABILITY_CRITERIA and not 0 <= self.threshold <= 1:
            raise ParamError("exit_threshold", f"exit_threshold for the {self.criterion} criterion is a probability "
                                               f"in [0, 1], got {self.threshold}")
        if self.threshold is not None and self.criterion in DISTANCE_CRITERIA and self.threshold < 0:
            raise ParamError("exit_threshold", f"exit_threshold for the {self.criterion} criterion is a distance "
                                               f">= 0, got {self.threshold}")

    @property
    def adaptive(self) -> bool:
        return self.criterion != "none" and self.threshold is not None

    @classmethod
    def from_config(cls, cfg: LoopConfig, *, criterion: str | None = None, threshold: float | None = None,
                    r_min: int | None = None, r_max: int | None = None, lookahead: bool = False,
                    full_depth: bool = False) -> ExitPolicy:
        """Config defaults with overrides. `full_depth` disables exits explicitly (never a
        threshold value: Ouro's bf16 gate can saturate to 1.0)."""
        crit = criterion or cfg.exit_criterion
        head = HEADS.get(crit)
        if head is not None and not getattr(cfg, head) and not full_depth:
            raise ParamError("exit_criterion", f"exit criterion {crit!r} needs the checkpoint's {head} head, which "
                                               f"{cfg.name} lacks" + ("" if head == "exit_gate" else
                                                                      " (train/distill_gate.py distils one)"))
        if crit == "preloop" and not full_depth and cfg.r_max > cfg.preloop_depths:
            # its distribution stops at the depth it was distilled at, whose bin means "forced exit there"
            raise ParamError("r_max", f"r_max={cfg.r_max} exceeds the {cfg.preloop_depths} depths the model's "
                                      f"preloop_gate head covers (the r_max it was distilled at): use r_max <= "
                                      f"{cfg.preloop_depths} or another exit criterion")
        if lookahead and not full_depth and cfg.r_max < 3:
            # a lookahead signal read after step s exits after step s + 1 >= 2, already r_max here
            raise ParamError("lookahead", f"lookahead needs r_max >= 3: with {cfg.name} a signal read after step 1 "
                                          f"exits after step 2 = r_max, so no token could leave the loop early; "
                                          f"use lookahead=False (the exit is then decided after each step)")
        thr = threshold if threshold is not None else cfg.exit_threshold
        if thr is None and crit in DEFAULT_THRESHOLDS:
            thr = DEFAULT_THRESHOLDS[crit]
        base = cls("none", None, cfg.r_max, cfg.r_max) if full_depth else \
            cls(crit, thr, min(cfg.r_min, cfg.r_max), cfg.r_max, bool(lookahead))
        return base.override(r_min=r_min, r_max=r_max)

    def override(self, *, threshold: float | None = None, r_min: int | None = None, r_max: int | None = None
                 ) -> ExitPolicy:
        """This policy with one request's overrides (None keeps this policy's value). r_max may only
        go down; this policy's own r_min follows a lower r_max down. Full depth stays full depth."""
        check_depths(r_min, r_max)
        if r_max is not None and r_max > self.r_max:
            raise ParamError("r_max", f"r_max {r_max} exceeds the model's r_max {self.r_max}")
        if threshold is None and r_min is None and r_max is None:
            return self
        rmax = self.r_max if r_max is None else r_max
        if self.criterion == "none":  # full depth: the loop always runs to r_max
            return ExitPolicy("none", None, rmax, rmax)
        return ExitPolicy(self.criterion, self.threshold if threshold is None else float(threshold),
                          min(self.r_min, rmax) if r_min is None else r_min, rmax, self.lookahead)


class ExitTracker:
    """Exit bookkeeping of one decode token: `after_step(s, score)` takes the signal computed after
    loop step s (1-based), may fix the exit depth (s, or s + 1 with lookahead) and says whether the
    token leaves the loop after step s. `stop_at` is that step (r_max until an exit is decided) and `open` whether scores still matter: the scheduler's
    per-item hot loop reads both instead of calling methods (infer/engine/scheduler.py)."""

    __slots__ = ("policy", "exit_at", "stop_at", "open", "_r_max", "_adaptive", "_prob", "_thr", "_r_min",
                 "_look")

    def __init__(self, policy: ExitPolicy):
        self.policy = policy
        # the policy read once (it is frozen): reset() runs once per item per prelude and after_step
        # once per item per core step; `adaptive` is a property
        self._r_max, self._adaptive = policy.r_max, policy.adaptive
        self._prob = policy.criterion in PROBABILITY_CRITERIA  # the score is an exit probability (else a distance)
        self._thr, self._r_min, self._look = policy.threshold, policy.r_min, policy.lookahead
        self.reset()

    def reset(self) -> None:
        """Start over for the sequence's next token (the engine keeps one tracker per sequence)."""
        self.exit_at: int | None = None  # the exit depth, once decided
        self.stop_at = self._r_max  # the loop step after which the token leaves the loop
        self.open = self._adaptive  # no decision yet: the next score may decide the exit

    def after_step(self, s: int, score: float) -> bool:
        """Take step s's signal; returns whether the token leaves the loop after step s. This runs once per item per core step:
        one comparison (the score's arithmetic ran on the device, looplm/exits.py)."""
        if self.open:
            if s >= self._r_max:
                self.open = False
            elif (score >= self._thr) if self._prob else (score < self._thr):  # (`open` is False for none)
                depth = s + 1 if self._look else s
                if depth >= self._r_min:  # depth <= r_max: s < r_max
                    self.exit_at = self.stop_at = depth
                    self.open = False
        return s >= self.stop_at

    def at_prelude(self, cdf: list[float]) -> None:
        """The preloop criterion: fix the exit depth from the exit-depth CDF [preloop_depths >= r_max]
        read at the prelude (the first depth whose CDF >= q, clamped to [r_min, r_max]: a depth past
        r_max is the forced exit at r_max)."""
        if self.open:
            d = bisect_left(cdf, self._thr) + 1  # a cumsum of probabilities is non-decreasing
            self.exit_at = self.stop_at = min(max(d, self._r_min), self._r_max)
            self.open = False

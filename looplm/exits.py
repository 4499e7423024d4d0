"""Exit scores computed on the device after each core step (see policy.py for the decision)."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .policy import DEFAULT_THRESHOLDS, OUTPUT_CRITERIA, ExitPolicy, ExitTracker  # noqa: F401  (re-export)


def score_rule(criterion: str, cfg) -> str:
    """The score arithmetic a criterion runs: the distilled lookahead head's is its teacher's (on
    its own logits); the preloop criterion scores nothing during the loop."""
    return cfg.gate_teacher if criterion == "lookahead_gate" else criterion


def gate_for(model, criterion: str, state: torch.Tensor) -> torch.Tensor | None:
    """The gate logits a criterion reads after a core step (None: it reads none)."""
    if criterion in ("ouro_gate", "learned"):
        return model.gate_logits(state)
    if criterion == "lookahead_gate":
        return model.lookahead_logits(state)
    return None


def preloop_cdf(model, state: torch.Tensor, inj: torch.Tensor | None) -> torch.Tensor:
    """The preloop gate's exit-depth CDF [N, preloop_depths] (float64) from the prelude's output.
    Below the head's depths (r_max overridden lower, or a request's r_max) it is not cut and
    renormalised: the tracker clamps the depth to r_max (ExitTracker.at_prelude), so the mass of the
    deeper depths is a forced exit at r_max, as the loop treats r_max under every criterion."""
    return torch.softmax(model.preloop_logits(state, inj).double(), dim=-1).cumsum(-1)


def initial_aux(criterion: str, n: int, vocab: int, device) -> torch.Tensor | None:
    """The criterion memory of a token before its first step (batched runners keep it per slot)."""
    if criterion == "kl":
        return torch.full((n, vocab), -math.log(vocab), dtype=torch.float64, device=device)
    if criterion == "entropy_diff":
        return torch.full((n,), 100.0, dtype=torch.float64, device=device)
    if criterion == "ouro_gate":  # survival prod_j (1 - lambda_j) of no step yet
        return torch.ones(n, dtype=torch.float64, device=device)
    return None


def step_scores(criterion: str, prev_state: torch.Tensor, state: torch.Tensor, gate_logits: torch.Tensor | None,
                logits: torch.Tensor | None, aux: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-item scores [N] after a core step, and the new per-item criterion memory `aux`
    (kl: previous log-probs [N, V]; entropy_diff: previous entropy [N]; ouro_gate: the survival
    prod_j (1 - lambda_j) [N]; else None). `aux=None` at step 1 means: compare against the
    criterion's initial value.
    The gate criteria's scores are probabilities, computed here on the device for the whole batch
    (learned: sigmoid(gate logit); ouro_gate: the exit CDF 1 - prod_j (1 - lambda_j), lambda_j =
    sigmoid(gate logit of step j)), so that the host's exit decision is one comparison per item
    (policy.py): Python float arithmetic per item per core step cost ~0.3 us, the largest host cost
    of a core step at batch 256. The reference decoder calls this same function (batch of one)."""
    if criterion == "learned":
        return torch.sigmoid(gate_logits.double()), None
    if criterion == "ouro_gate":
        surv = (1.0 - torch.sigmoid(gate_logits.double())) * (aux if aux is not None else 1.0)
        return 1.0 - surv, surv
    n = state.shape[0]
    if criterion == "latent_diff":
        diff = (prev_state - state).double().norm(dim=-1) / state.double().norm(dim=-1)
        return diff, None
    if criterion == "kl":
        logp = F.log_softmax(logits.double(), dim=-1)
        prev = aux if aux is not None else torch.full_like(logp, -math.log(logp.shape[-1]))
        kl = (prev.exp() * (prev - logp)).sum(-1)  # KL(prev || current)
        return kl, logp
    if criterion == "entropy_diff":
        logp = F.log_softmax(logits.double(), dim=-1)
        ent = -(logp.exp() * logp).sum(-1)
        prev = aux if aux is not None else torch.full_like(ent, 100.0)
        return (ent - prev).abs(), ent
    return torch.zeros(n, dtype=torch.float64, device=state.device), None

"""Pieces shared by pretrain.py, shared_kv.py and evaluate.py: token windows, per-step logits,
vectorised exit decisions (the semantics of looplm/exits.py), held-out evaluation, wandb setup."""
from __future__ import annotations

import hashlib
import json
import math
import os
import uuid
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
import torch.utils.checkpoint

from looplm.exits import step_scores
from looplm.policy import ExitPolicy
from looplm.model import AttendFor, LoopedLM, plain_attend_for
from train.packing import doc_attend_for, doc_positions

REPO = Path(__file__).resolve().parents[1]
CACHE = REPO / ".cache"
CORPUS = CACHE / "corpus"
TOKENIZER = CACHE / "tokenizer"


def load_tokens(name: str, tokenizer_dir: Path = TOKENIZER, corpus: Path = CORPUS) -> np.ndarray:
    from train.tokenizer import encode_corpus
    return encode_corpus(tokenizer_dir, corpus / f"{name}.txt")


def random_windows(tokens: np.ndarray, batch: int, ctx: int, seed: list[int]) -> torch.Tensor:
    """`batch` random windows of ctx+1 tokens; the seed (e.g. [seed, step, rank]) makes a resumed
    run draw exactly the batches it would have drawn."""
    rng = np.random.default_rng(seed)
    starts = rng.integers(0, len(tokens) - ctx - 1, size=batch)
    return torch.from_numpy(np.stack([tokens[s:s + ctx + 1] for s in starts])).long()


def eval_windows(tokens: np.ndarray, ctx: int, max_windows: int | None = None) -> torch.Tensor:
    """Consecutive non-overlapping windows of ctx+1 tokens (teacher-forced held-out text)."""
    n = (len(tokens) - 1) // ctx
    if max_windows is not None:
        n = min(n, max_windows)
    return torch.from_numpy(np.stack([tokens[i * ctx:i * ctx + ctx + 1] for i in range(n)])).long()


def wandb_env(run_dir: Path) -> None:
    """Offline by default; the run's files under `run_dir/wandb` (unless WANDB_DIR is set), wandb's
    caches under the repo's .cache/wandb, nothing under $HOME."""
    base = CACHE / "wandb"
    os.environ.setdefault("WANDB_MODE", "offline")
    os.environ.setdefault("WANDB_DIR", str(Path(run_dir).resolve()))
    for k, sub in (("WANDB_CACHE_DIR", "cache"), ("WANDB_DATA_DIR", "data"), ("WANDB_CONFIG_DIR", "config")):
        os.environ.setdefault(k, str(base / sub))
    for k in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_CONFIG_DIR"):
        Path(os.environ[k]).mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("WANDB_SILENT", "true")


def init_wandb(run_dir: Path, project: str, config: dict, enabled: bool = True):
    """A wandb run that resumes with the training run (its id is kept in run_dir)."""
    if not enabled:
        return None
    wandb_env(run_dir)
    try:
        import wandb
    except ImportError:
        return None
    id_file = run_dir / "wandb_id"
    if not id_file.exists():
        id_file.write_text(uuid.uuid4().hex[:8])
    return wandb.init(project=project, id=id_file.read_text().strip(), resume="allow", config=config,
                      name=run_dir.name)


class History:
    """Append-only JSON list of logged records, rewritten atomically (survives kills)."""

    def __init__(self, path: Path):
        self.path = path
        self.records: list[dict] = json.loads(path.read_text()) if path.exists() else []

    def truncate(self, step: int) -> None:
        # a resumed run replays the steps after its checkpoint: drop their stale records
        self.records = [r for r in self.records if r.get("step", 0) <= step]

    def log(self, rec: dict) -> None:
        self.records.append(rec)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.records) + "\n")
        tmp.replace(self.path)


# ----------------------------------------------------------------------------- model passes
@contextmanager
def layer_checkpointing(model: LoopedLM, enabled: bool = True):
    """Activation checkpointing per core layer and loop step (LoopedLM.block) inside the block:
    a loop step keeps one [B, T, D] input per layer for the backward pass instead of its layers'
    activations (attention, MLP, norms); each layer is recomputed once in the backward pass."""
    old = model.checkpoint_layers
    model.checkpoint_layers = enabled
    try:
        yield
    finally:
        model.checkpoint_layers = old


def checkpointed_step(model: LoopedLM, state: torch.Tensor, inj, rope, attend_for: AttendFor,
                      enabled: bool = True) -> torch.Tensor:
    """model.core_step under activation checkpointing (non-reentrant): the step's activations are
    recomputed in the backward pass instead of kept (attend_for must not depend on state that changes
    meanwhile: kv_emulation's recorder fixes the loop step in it)."""
    def fn(st, ij):
        return model.core_step(st, ij, rope, attend_for)
    if not enabled or not torch.is_grad_enabled():
        return fn(state, inj)
    return torch.utils.checkpoint.checkpoint(fn, state, inj, use_reentrant=False)


def run_loop(model: LoopedLM, ids: torch.Tensor, steps: int, attend_for: AttendFor = plain_attend_for,
             grad_steps: int | None = None, init_scale: float = 0.0, checkpoint: bool = False,
             docs: torch.Tensor | None = None):
    """Prelude + `steps` core steps. Returns (states [s_1..s_steps], inj, rope, s_0). With
    `grad_steps`, only the last `grad_steps` core steps keep a graph (truncated backprop, Huginn-style).
    `checkpoint`: activation checkpointing per core step (`--gradient-checkpointing`). `docs` [B, T]:
    documents packed into each row (train/packing.py): positions restart per document and the
    attention stays inside it (then `attend_for` must be the plain one: the returned rope and the
    caller's coda must use `docs_attend_for(docs, attend_for)` too)."""
    T = ids.shape[1]
    attend_for = docs_attend_for(docs, attend_for)
    rope = model.rope(doc_positions(docs) if docs is not None else torch.arange(T, device=ids.device))
    state, inj = model.prelude(ids, rope, attend_for, init_scale)
    s0 = state
    states = []
    first_grad = 0 if grad_steps is None else max(0, steps - grad_steps)
    for s in range(steps):
        if s < first_grad:
            with torch.no_grad():
                state = model.core_step(state, inj, rope, attend_for)
            state = state.detach()
        else:
            state = checkpointed_step(model, state, inj, rope, attend_for, checkpoint)
        states.append(state)
    return states, inj, rope, s0


def docs_attend_for(docs: torch.Tensor | None, attend_for: AttendFor = plain_attend_for) -> AttendFor:
    """`attend_for` itself without packed documents, the document-bounded attention with them."""
    if docs is None:
        return attend_for
    if attend_for is not plain_attend_for:
        raise ValueError("packed documents (docs) take the plain attention only, not another attend_for")
    return doc_attend_for(docs)


def logits_of(model: LoopedLM, state: torch.Tensor, rope, attend_for: AttendFor = plain_attend_for) -> torch.Tensor:
    return model.head(model.coda(state, rope, attend_for))


def token_ce(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per-token cross-entropy [B, T] (float32)."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="none").view(targets.shape)


@torch.no_grad()
def per_step_outputs(model: LoopedLM, ids: torch.Tensor, targets: torch.Tensor, steps: int,
                     attend_for: AttendFor = plain_attend_for, need_kl: bool = True,
                     docs: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Per-step CE, gate logits, KL(prev||cur) and latent diff for every token: each [S, B, T].
    Step s uses its own logits, so picking step d's CE per token equals running the full forward
    with d loops (the depth-indexed layout with last-exited filling)."""
    states, inj, rope, prev_state = run_loop(model, ids, steps, attend_for, docs=docs)  # s_0: zeros for Huginn
    attend_for = docs_attend_for(docs, attend_for)
    ce, gate, kl, lat = [], [], [], []
    prev_logp = None
    for st in states:
        lg = logits_of(model, st, rope, attend_for).double()
        ce.append(F.cross_entropy(lg.flatten(0, 1), targets.flatten(), reduction="none").view(targets.shape))
        g = model.gate_logits(st)
        if g is not None:
            gate.append(g.double())
        if need_kl:
            logp = F.log_softmax(lg, -1)
            prev = prev_logp if prev_logp is not None else torch.full_like(logp, -math.log(logp.shape[-1]))
            kl.append((prev.exp() * (prev - logp)).sum(-1))
            prev_logp = logp
        lat.append((prev_state - st).double().norm(dim=-1) / st.double().norm(dim=-1))
        prev_state = st
    out = {"ce": torch.stack(ce), "latent_diff": torch.stack(lat)}
    if gate:
        out["gate"] = torch.stack(gate)
    if kl:
        out["kl"] = torch.stack(kl)
    return out


def exit_depths(scores: torch.Tensor, policy: ExitPolicy) -> torch.Tensor:
    """Exit depth (1-based) per token from per-step scores [S, ...] (S = r_max steps), with the
    semantics of looplm.exits.ExitTracker (standard or lookahead, r_min honoured)."""
    S = scores.shape[0]
    r_max = min(policy.r_max, S)
    if not policy.adaptive:
        return torch.full(scores.shape[1:], r_max, dtype=torch.long)
    q = policy.threshold
    if policy.criterion in ("ouro_gate", "learned"):  # the engine's exit probabilities, step by step
        probs, aux = [], None
        for g in scores:
            p, aux = step_scores(policy.criterion, None, None, g, None, aux)
            probs.append(p)
        sig = torch.stack(probs) >= q
    else:
        sig = scores < q
    step = torch.arange(1, S + 1).view(S, *([1] * (scores.dim() - 1)))
    if policy.lookahead:
        ok = sig & (step + 1 >= policy.r_min) & (step < r_max)  # a signal at r_max is moot
        depth_if = step + 1
    else:
        ok = sig & (step >= policy.r_min) & (step <= r_max)
        depth_if = step
    big = torch.full_like(depth_if.expand_as(ok), 10 ** 6)
    d = torch.where(ok, depth_if.expand_as(ok), big).min(dim=0).values
    return d.clamp(max=r_max)


def score_key(criterion: str) -> str:
    return {"ouro_gate": "gate", "learned": "gate"}.get(criterion, criterion)


def summarize_exit(out: dict[str, torch.Tensor], policy: ExitPolicy) -> dict:
    """Perplexity, mean depth and depth histogram of exiting by `policy` (teacher-forced)."""
    S = out["ce"].shape[0]
    if policy.adaptive:
        d = exit_depths(out[score_key(policy.criterion)], policy)
    else:
        d = torch.full(out["ce"].shape[1:], policy.r_max, dtype=torch.long)
    ce = out["ce"].gather(0, (d - 1)[None]).squeeze(0)
    if "mask" in out:  # the counted targets only (collect_outputs' masks)
        ce, d = ce[out["mask"]], d[out["mask"]]
    hist = torch.bincount(d.flatten(), minlength=S + 1)[1:].double()
    hist = hist / hist.sum()
    return {"criterion": policy.criterion, "threshold": policy.threshold, "r_min": policy.r_min,
            "lookahead": policy.lookahead, "ppl": math.exp(ce.mean().item()), "mean_depth": d.double().mean().item(),
            "depth_hist": [round(x, 4) for x in hist.tolist()]}


def collect_outputs(model: LoopedLM, windows: torch.Tensor, steps: int, batch: int = 16,
                    attend_for_fn=None, need_kl: bool = True, masks: torch.Tensor | None = None,
                    docs: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """per_step_outputs over many windows, concatenated on the batch axis.
    `attend_for_fn(ids) -> attend_for` lets a caller swap the attention (e.g. the shared layout).
    `masks` / `docs` [N, T+1] (a packed --dataset): the counted targets, kept as out["mask"] [N, T]
    for the summaries, and the documents kept apart."""
    parts: dict[str, list[torch.Tensor]] = {}
    for i in range(0, len(windows), batch):
        w = windows[i:i + batch].to(model.device)
        af = attend_for_fn(model, w[:, :-1]) if attend_for_fn is not None else plain_attend_for
        d = None if docs is None else docs[i:i + batch, :-1].to(model.device)
        o = per_step_outputs(model, w[:, :-1], w[:, 1:], steps, af, need_kl, docs=d)
        for k, v in o.items():
            parts.setdefault(k, []).append(v.cpu())
    out = {k: torch.cat(v, dim=1) for k, v in parts.items()}
    if masks is not None:
        out["mask"] = masks[:, 1:].bool().cpu()
    return out


def ppl_per_depth(out: dict[str, torch.Tensor]) -> list[float]:
    if "mask" in out:
        return [round(math.exp(x), 3) for x in (out["ce"] * out["mask"]).flatten(1).sum(1).div(out["mask"].sum()).tolist()]
    return [round(math.exp(x), 3) for x in out["ce"].flatten(1).mean(1).tolist()]


def fingerprint(model) -> str:
    """sha256 of a model's weights (names and float32 values, sorted): equal on every rank that holds the
    same weights (the runs' summary.json)."""
    h = hashlib.sha256()
    for k, v in sorted(model.state_dict().items()):
        h.update(k.encode())
        h.update(v.detach().float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()

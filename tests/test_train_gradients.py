"""train.shared_kv.training_loss (issue 58, deliverable 3): what reaches every parameter is the
derivative of the loss the run reports. Tiny float64 models, central finite differences along
random unit directions per parameter group (k/v projections, q, MLP, norms, exit gate, the rest).

Exit depths and gate labels are discrete (piecewise constant in the weights): every difference is
taken at +-eps small enough that none flips, and the test checks it (fixed seeds, printed), rather
than forcing the exits. CPU, a few seconds each."""
import pytest
import torch

from looplm import ExitPolicy
from tests.helpers import fresh_model
from train.shared_kv import SharedKVObjective, fixed_point_loss, parse, policy_for, training_loss

GROUPS = ("kv", "q", "mlp", "norm", "gate", "other")
EPS = 1e-5


def group_masks(model) -> dict[str, dict[str, torch.Tensor]]:
    """Per group, {parameter name: 0/1 mask of its entries in the group}. Ouro names its
    projections; Huginn fuses them (Wqkv: the q rows first, then k and v)."""
    cfg = model.cfg
    out = {g: {} for g in GROUPS}
    for n, p in model.named_parameters():
        one = torch.ones_like(p)
        if "Wqkv" in n:
            q = torch.zeros_like(p)
            q[:cfg.num_heads * cfg.head_dim] = 1
            out["q"][n], out["kv"][n] = q, 1 - q
        elif "k_proj" in n or "v_proj" in n:
            out["kv"][n] = one
        elif "q_proj" in n:
            out["q"][n] = one
        elif "exit_gate" in n:
            out["gate"][n] = one
        elif "mlp" in n:
            out["mlp"][n] = one
        elif "norm" in n or "ln_f" in n:
            out["norm"][n] = one
        else:
            out["other"][n] = one
    return {g: m for g, m in out.items() if m}


def directions(masks: dict[str, torch.Tensor], n: int, seed: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    dirs = []
    for _ in range(n):
        d = {k: torch.randn(m.shape, generator=g, dtype=torch.float64) * m for k, m in masks.items()}
        norm = sum(float((x * x).sum()) for x in d.values()) ** 0.5
        dirs.append({k: x / norm for k, x in d.items()})
    return dirs


def grad_of(model, fn) -> tuple[dict[str, torch.Tensor], dict]:
    parts: dict = {}
    model.zero_grad(set_to_none=True)
    fn(parts).backward()
    return {n: (p.grad.clone() if p.grad is not None else torch.zeros_like(p)) for n, p in model.named_parameters()}, parts


def central(model, fn, d: dict[str, torch.Tensor]) -> float:
    """(f(w + eps d) - f(w - eps d)) / 2 eps, asserting that no exit depth nor gate label flips."""
    params = dict(model.named_parameters())
    vals, ref = [], {}
    with torch.no_grad():
        fn(ref)
        for sgn in (1.0, -1.0):
            for n, x in d.items():
                params[n].add_(sgn * EPS * x)
            parts: dict = {}
            vals.append(float(fn(parts)))
            for n, x in d.items():
                params[n].sub_(sgn * EPS * x)
            for k in ("_depths", "_gate_labels"):
                if k in ref and k in parts:
                    assert torch.equal(parts[k], ref[k]), f"{k} flipped at eps {EPS}: pick another seed"
    return (vals[0] - vals[1]) / (2 * EPS)


def cosine(a: list[float], b: list[float]) -> float:
    """Cosine of two vectors of directional derivatives; 1.0 when both vanish (a group the loss does
    not reach, e.g. the gate under train="lm": gradient and differences both exactly 0)."""
    x, y = torch.tensor(a), torch.tensor(b)
    if x.norm() < 1e-12 and y.norm() < 1e-12:
        return 1.0
    return float(x @ y / (x.norm() * y.norm()).clamp(min=1e-30))


def group_cosines(model, fn, fd_fns, n_dirs=3, seed=0) -> dict[str, list[float]]:
    """Per group: cosine of (fn's gradient . d) with the central differences of each of fd_fns."""
    grads, _ = grad_of(model, fn)
    out = {}
    for gi, (grp, masks) in enumerate(group_masks(model).items()):
        dirs = directions(masks, n_dirs, seed * 100 + gi)
        an = [sum(float((grads[n] * x).sum()) for n, x in d.items()) for d in dirs]
        out[grp] = [cosine(an, [central(model, f, d) for d in dirs]) for f in fd_fns]
    return out


def setup(arch="ouro-tiny", T=8, B=2, seed=0):
    m = fresh_model(arch)
    for p in m.parameters():
        p.requires_grad_(True)
    pol = ExitPolicy.from_config(m.cfg, threshold=0.55)
    ids = torch.randint(0, 256, (B, T + 1), generator=torch.Generator().manual_seed(seed))
    print(f"{arch}: ids seed {seed}, B {B}, T {T}")
    return m, pol, ids


@pytest.mark.parametrize("arch", ["ouro-tiny", "huginn-tiny"])
def test_training_loss_gradient_is_its_derivative(arch):
    """training_loss's gradient against central differences of training_loss itself (its sweeps
    recomputed at the shifted weights): cosine >= 0.95 in every group, k/v included. Defaults
    (context_grad all, gate_grad head): every LM group against the LM part (train="lm") and the gate
    head against the whole loss; with gate_grad="all": every group against the whole loss."""
    m, pol, ids = setup(arch)
    full = lambda **o: (lambda parts: training_loss(m, ids, pol, parts=parts, **o))  # noqa: E731
    default = group_cosines(m, full(), [full(), full(train="lm")])
    print("default, cos vs FD of [training_loss, its lm part]:", {g: [round(c, 4) for c in v] for g, v in default.items()})
    for g, (whole, lm) in default.items():
        assert (whole if g == "gate" else lm) >= 0.95, (g, whole, lm)
    every = group_cosines(m, full(gate_grad="all"), [full(gate_grad="all")])
    print("gate_grad=all, cos vs FD of training_loss:", {g: round(v[0], 4) for g, v in every.items()})
    assert all(v[0] >= 0.95 for v in every.values()), every


def test_detached_context_is_what_was_wrong():
    """context_grad=0 (the context K/V detached, the behaviour before issue 58) misses the path
    through the other tokens' K/V: its k/v gradient disagrees with the derivative of its own loss."""
    m, pol, ids = setup()
    f = lambda parts: training_loss(m, ids, pol, parts=parts, context_grad=0, train="lm")  # noqa: E731
    cos = group_cosines(m, f, [f], n_dirs=4)
    print("context_grad=0, cos vs FD of its own loss:", {g: round(v[0], 4) for g, v in cos.items()})
    assert cos["kv"][0] < 0.9


def test_gradient_against_the_exact_fixed_point_loss():
    """The exact fixed-point loss (T context sweeps: the sequential semantics exactly, by causality)
    has training_loss's form, so its own gradient matches its central differences; the default
    training gradient (2 context sweeps) is compared with it and the gap printed (a tiny random
    model is far from its fixed point after 2 sweeps; train/README.md has ouro-demo's figures)."""
    m, pol, ids = setup()
    exact = lambda parts: fixed_point_loss(m, ids, pol, parts=parts, train="lm")  # noqa: E731
    train = lambda parts: training_loss(m, ids, pol, parts=parts, train="lm")  # noqa: E731
    with torch.no_grad():
        gap = float(train({})) - float(exact({}))
    cos_exact = group_cosines(m, exact, [exact], n_dirs=2)
    cos_train = group_cosines(m, train, [exact], n_dirs=2)
    print(f"loss gap (training - fixed point) {gap:+.4f}")
    print("fixed point's own gradient:", {g: round(v[0], 4) for g, v in cos_exact.items()})
    print("training gradient vs FD of the fixed-point loss:", {g: round(v[0], 4) for g, v in cos_train.items()})
    assert all(v[0] >= 0.99 for v in cos_exact.values()), cos_exact


def test_objective_step_equals_training_loss_and_logs_staleness():
    """The script's forward (mode "step", the training loop's one call) reports training_loss's
    value and gradient; the pass1/pass2 split is the same computation; the staleness is measured
    against the fixed point when asked (its sweeps settle the depths: 0 mismatch with many sweeps)."""
    m, _, ids = setup()
    a = parse(["--model", "x", "--output", "o", "--layout", "shared"])
    pol = policy_for(m.cfg, a, 0.55)
    obj = SharedKVObjective(m, a, pol)
    out = obj(ids, measure_staleness=True)
    ref = training_loss(m, ids, pol, "shared", 1, gate_margin=a.gate_margin, step_loss=a.step_loss)
    assert torch.equal(out["loss"].detach(), ref.detach())
    split = obj(ids, obj(ids, mode="pass1"), mode="pass2")
    assert torch.equal(split["loss"].detach(), ref.detach())
    for k in ("stale_depth_frac", "stale_logit_gap", "stale_ce_gap", "fixed_point_sweeps", "staleness_s"):
        assert k in out, k
    print({k: v for k, v in out.items() if k.startswith("stale") or k == "fixed_point_sweeps"})
    parts: dict = {}
    training_loss(m, ids, pol, pass1_sweeps=ids.shape[1], measure_staleness=True, parts=parts)
    assert parts["stale_depth_frac"] == 0.0 and parts["stale_logit_gap"] < 1e-4


def test_script_logs_staleness_and_bounds_it_with_sweeps(tmp_path):
    """train/shared_kv.py: the staleness is logged (stale_* in history.json) and --max-stale-depth
    grows --pass1-sweeps when a measurement exceeds it (kept in the checkpoint's meta.json)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    import numpy as np

    from looplm import save_pretrained, tiny_model
    repo = Path(__file__).resolve().parents[1]
    save_pretrained(tiny_model("ouro-tiny", std=0.05, exit_criterion="learned", exit_threshold=0.6), tmp_path / "model")
    np.save(tmp_path / "tok.npy", np.random.default_rng(0).integers(0, 256, 5000).astype(np.uint16))
    out = tmp_path / "out"
    cmd = [sys.executable, "train/shared_kv.py", "--model", str(tmp_path / "model"), "--output", str(out), "--tokens",
           str(tmp_path / "tok.npy"), "--steps", "2", "--batch", "2", "--ctx", "16", "--log-every", "1",
           "--eval-every", "0", "--eval-windows", "2", "--threads", "1", "--warmup", "1", "--no-wandb",
           "--staleness-every", "1", "--max-stale-depth", "0.0", "--max-pass1-sweeps", "3"]
    env = dict(os.environ, PYTHONPATH=str(repo), OMP_NUM_THREADS="1", WANDB_MODE="offline")
    r = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    hist = [h for h in json.loads((out / "history.json").read_text()) if "loss" in h]  # the training records
    assert [h["step"] for h in hist] == [1, 2]
    print(hist)
    assert all("stale_depth_frac" in h and "stale_logit_gap" in h for h in hist)
    assert hist[0]["stale_depth_frac"] > 0 and hist[0]["pass1_sweeps"] == 2 and hist[1]["pass1_sweeps"] == 3
    meta = json.loads(next((out / "checkpoints").glob("step_*/meta.json")).read_text())
    assert meta["pass1_sweeps"] == 3
    assert json.loads((out / "summary.json").read_text())["pass1_sweeps_final"] == 3

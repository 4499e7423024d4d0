"""train/: exit decisions, the training-time KV-layout attention, shared_kv.py (2 ranks, resume), pretrain.py.
Tiny presets, random token ids, CPU, no network."""
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from kv_layouts import make_layout
from looplm import ExitPolicy, ExitTracker, load_pretrained, save_pretrained, tiny_model
from looplm.exits import step_scores
from infer.engine import stages
from infer.engine.reference import reference_generate
from infer.engine.stages import TokenBatch
from train.common import exit_depths
from train.kv_emulation import Sweep, converge, sweep

REPO = Path(__file__).resolve().parents[1]
ARCHS = ["ouro-tiny", "huginn-tiny"]


@pytest.mark.parametrize("criterion", ["learned", "ouro_gate", "kl", "latent_diff"])
@pytest.mark.parametrize("lookahead", [False, True])
@pytest.mark.parametrize("r_min", [1, 2, 3])
def test_exit_depths_match_tracker(criterion, lookahead, r_min):
    rng = torch.Generator().manual_seed(r_min)
    S, N = 5, 300
    gate = criterion in ("learned", "ouro_gate")
    scores = torch.randn(S, N, generator=rng, dtype=torch.float64) * (2.0 if gate else 0.1)
    if not gate:
        scores = scores.abs()
    pol = ExitPolicy(criterion, 0.6 if gate else 0.08, r_min, S, lookahead)
    got = exit_depths(scores, pol)
    # the engine's scores: the gate criteria's probabilities come from the device (looplm/exits.py)
    dev, aux = [], None
    for s in range(S):
        sc, aux = step_scores(criterion, None, None, scores[s], None, aux) if gate else (scores[s], None)
        dev.append(sc)
    for i in range(N):
        tr = ExitTracker(pol)
        d = next(s for s in range(1, S + 1) if tr.after_step(s, float(dev[s - 1][i])))
        assert got[i] == d


def _forced(seed, n):
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("name,criterion", [("ouro-tiny", None), ("huginn-tiny", None), ("huginn-tiny", "kl")])
@pytest.mark.parametrize("layout", ["shared", "last_exited"])
@pytest.mark.parametrize("lookahead", [False, True])
def test_emulation_fixed_point_equals_reference_decoder(name, criterion, layout, lookahead):
    """Parallel sweeps to the fixed point = the sequential reference decoder (float64)."""
    m = tiny_model(name, dtype=torch.float64, std=0.15, seed=3)
    pol = ExitPolicy.from_config(m.cfg, criterion=criterion, threshold=2e-2 if criterion else 0.55, lookahead=lookahead)
    prompt, forced = [3, 14, 15, 92], _forced(1, 14)
    g = reference_generate(m, prompt, len(forced), pol, kv_layout=layout, forced_tokens=forced)
    ids = torch.tensor([prompt + forced[:-1]])
    sw, n, _ = converge(m, ids, pol, layout, prompt_len=len(prompt), max_sweeps=40, tol=0.0)
    lp = torch.log_softmax(sw.exit_logits[0, len(prompt) - 1:], -1).gather(-1, torch.tensor(forced)[:, None])[:, 0]
    assert (lp - torch.tensor(g.logprobs, dtype=torch.float64)).abs().max() < 1e-10
    assert sw.depths[0, len(prompt) - 1:].tolist() == g.exit_depths
    assert len(set(g.exit_depths[1:])) >= 2 or criterion == "kl"


@torch.no_grad()
def _decode_shared(m, prompt, forced, pol):
    """Sequential decode with looplm.stages over a shared layout; returns logits, depths, layout."""
    L, n = len(prompt), len(prompt) + len(forced)
    lay = make_layout("shared", m.cfg, n, torch.float64)
    t = lambda x: torch.as_tensor(x, dtype=torch.long)  # noqa: E731
    pb = TokenBatch(ids=t(prompt), positions=torch.arange(L), rows=torch.arange(L), steps=torch.ones(L, dtype=torch.long),
                    seq_ids=torch.zeros(L, dtype=torch.long))
    logits = [stages.prefill(m, lay, pb, t([L - 1]))[0]]
    depths = [m.cfg.r_max] * L
    for i, tok in enumerate(forced[:-1]):
        pos = L + i
        b = TokenBatch(ids=t([tok]), positions=t([pos]), rows=t([pos]), steps=t([1]),
                       ctx_rows=torch.arange(pos + 1)[None], ctx_len=t([pos + 1]))
        state, inj = stages.prelude(m, lay, b)
        tr, aux, s = ExitTracker(pol), None, 0
        while True:
            s += 1
            b.steps.fill_(s)
            state, sc, aux = stages.core_step(m, lay, b, state, inj, pol.criterion, aux)
            if tr.after_step(s, float(sc[0])):
                break
        lay.on_exit(b.rows, t([s]))
        logits.append(stages.coda(m, lay, b, state)[0])
        depths.append(s)
    return torch.stack(logits), depths, lay


@pytest.mark.parametrize("name", ARCHS)
@pytest.mark.parametrize("lookahead", [False, True])
def test_training_attention_with_known_exit_kv_equals_shared_layout(name, lookahead):
    """Pass 2 of shared_kv.py, given the exit-depth K/V that the shared layout holds after a
    sequential decode, reproduces that decode's logits and exit depths (with grad enabled)."""
    m = tiny_model(name, dtype=torch.float64, std=0.15, seed=5)
    pol = ExitPolicy.from_config(m.cfg, threshold=0.55, lookahead=lookahead)
    prompt, forced = [5, 6, 7], _forced(2, 12)
    logits, depths, lay = _decode_shared(m, prompt, forced, pol)
    assert len(set(depths[len(prompt):])) >= 2, "the case needs a spread of exit depths"
    T, S = len(prompt) + len(forced) - 1, m.cfg.r_max
    # the layout's one slot per core layer and row = that position's exit-depth K/V
    core = [(lay.k_core[l, :T][None, None].expand(S, 1, -1, -1, -1), lay.v_core[l, :T][None, None].expand(S, 1, -1, -1, -1))
            for l in range(m.cfg.n_core)]
    coda = [(lay.k_plain[m.cfg.n_prelude + l, :T][None], lay.v_plain[m.cfg.n_prelude + l, :T][None])
            for l in range(m.cfg.n_coda)]
    known = Sweep([], None, torch.tensor([depths[:T]]), core, coda, torch.empty(0), None)
    for p in m.parameters():
        p.requires_grad_(True)
    sw = sweep(m, torch.tensor([prompt + forced[:-1]]), pol, "shared", known, prompt_len=len(prompt))
    assert sw.exit_logits.requires_grad
    got = sw.exit_logits[0, len(prompt) - 1:].detach()
    assert (got - logits).abs().max() < 1e-10
    assert sw.depths[0, len(prompt) - 1:].tolist() == depths[len(prompt) - 1:T]


# ------------------------------------------------------------------------------------ scripts
def _env():
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", WANDB_MODE="offline")
    return env


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    d = tmp_path_factory.mktemp("skv")
    save_pretrained(tiny_model("ouro-tiny", std=0.05, exit_criterion="learned", exit_threshold=0.6), d / "model")
    np.save(d / "tok.npy", np.random.default_rng(0).integers(0, 256, 20000).astype(np.uint16))
    return d


def _skv_args(folder, out, steps, extra=()):
    return ["train/shared_kv.py", "--model", str(folder / "model"), "--output", str(out), "--tokens",
            str(folder / "tok.npy"), "--steps", str(steps), "--batch", "4", "--ctx", "32", "--save-every", "1",
            "--log-every", "1", "--eval-every", "0", "--eval-windows", "2", "--threads", "1", "--warmup", "1",
            "--lookahead", "--r-min", "2", *extra]


@pytest.mark.slow
def test_shared_kv_two_cpu_ranks(tiny_folder, tmp_path):
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(REPO / "train/configs/cpu_2ranks.yaml"), "--main_process_port", str(29600 + random.randrange(300)),
           *_skv_args(tiny_folder, out, 2)]
    r = subprocess.run(cmd, cwd=REPO, env=_env() | {"ACCELERATE_USE_CPU": "true"}, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    prints = summary["rank_fingerprints"]
    assert len(prints) == 2 and prints[0] == prints[1]
    m = load_pretrained(out)
    cfg_key = lambda k: getattr(m.cfg, k, None) if getattr(m.cfg, k, None) is not None else m.cfg.extra.get(k)  # noqa: E731
    assert cfg_key("exit_lookahead") is True and m.cfg.r_min == 2 and cfg_key("kv_layout") == "shared"
    assert "world_size=2 backend=gloo distributed_type=MULTI_CPU" in r.stdout, r.stdout[-2000:]
    before = load_pretrained(tiny_folder / "model")
    assert any((p - q).abs().max() > 0 for p, q in zip(m.parameters(), before.parameters())), "nothing trained"


@pytest.mark.slow
def test_shared_kv_resume_after_interruption(tiny_folder, tmp_path):
    run = lambda out, extra=(): subprocess.run([sys.executable, *_skv_args(tiny_folder, out, 4, extra), "--no-wandb"],  # noqa: E731
                                               cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300)
    r1 = run(tmp_path / "a", ["--max-steps-this-run", "2"])
    assert r1.returncode == 0, r1.stderr[-3000:]
    assert "stopped at step 2" in r1.stdout and not (tmp_path / "a" / "model.safetensors").exists()
    r2 = run(tmp_path / "a")
    assert r2.returncode == 0, r2.stderr[-3000:]
    assert "at step 2" in r2.stdout and "resumed" in r2.stdout
    steps = [rec["step"] for rec in json.loads((tmp_path / "a" / "history.json").read_text())]
    assert steps == [0, 1, 2, 3, 4]
    r3 = run(tmp_path / "b")  # uninterrupted: the same weights
    assert r3.returncode == 0, r3.stderr[-3000:]
    ma, mb = load_pretrained(tmp_path / "a"), load_pretrained(tmp_path / "b")
    for (k, p), q in zip(ma.state_dict().items(), mb.state_dict().values()):
        assert torch.equal(p, q), k


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["ouro", "huginn"])
def test_pretrain_smoke_and_resume(tmp_path, arch):
    tok = tmp_path / "tok.npy"
    np.save(tok, np.random.default_rng(0).integers(0, 64, 8000).astype(np.uint16))
    args = [sys.executable, "train/pretrain.py", "--arch", arch, "--run-dir", str(tmp_path / "run"), "--save-to",
            str(tmp_path / "ck"), "--tokens", str(tok), "--vocab", "64", "--hidden", "32", "--heads", "2", "--ffn", "64",
            "--core", "1", "--prelude", "1", "--coda", "1", "--r-max", "3", "--step-weights", "0.2", "0.3", "0.5",
            "--ctx", "16", "--batch", "4", "--warmup", "2", "--eval-every", "2", "--log-every", "1", "--eval-windows",
            "2", "--gate-steps", "4", "--threads", "1", "--no-wandb", "--tokenizer", str(tmp_path / "none")]
    r = subprocess.run(args + ["--steps", "2"], cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    r = subprocess.run(args + ["--steps", "3"], cwd=REPO, env=_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed" in r.stdout and "step 2" in r.stdout
    m = load_pretrained(tmp_path / "ck")
    assert m.cfg.exit_criterion == "learned" and 0 < m.cfg.exit_threshold < 1 and m.cfg.r_max == 3
    hist = json.loads((tmp_path / "run" / "history.json").read_text())
    assert [h["step"] for h in hist if h["stage"] == 1] == [1, 2, 3]


def test_sample_depth_respects_bounds_and_mean():
    from train.pretrain import sample_depth
    rng = np.random.default_rng(0)
    draws = [sample_depth(rng, 6.0, 0.5, 8, r_min=4) for _ in range(4000)]
    assert min(draws) == 4 and max(draws) == 8  # clipped to [min_depth, r_max], both ends reached
    plain = [sample_depth(rng, 3.0, 0.5, 32) for _ in range(4000)]
    assert min(plain) == 1 and abs(np.mean(plain) - 3.0) < 0.2  # Poisson-lognormal keeps its mean when unclipped


def test_shared_kv_loss_mask_counts_only_masked_targets(tmp_path):
    """--loss-mask: the mask windows are drawn with the batch's own starts, and the LM loss and gate
    labels ignore the targets outside the mask (changing them changes nothing); an all-ones mask is
    the unmasked loss."""
    from train import shared_kv
    from train.datasource import from_npy

    rng = np.random.default_rng(0)
    ids = rng.integers(0, 256, 4000)
    mask = (np.arange(4000) % 3 == 0).astype(np.uint8)
    np.save(tmp_path / "t.npy", ids)
    np.save(tmp_path / "m.npy", mask)
    data = from_npy(tmp_path / "t.npy", mask=tmp_path / "m.npy")
    b, bm = data.batch(4, 32, [0, 1]), data.batch_mask(4, 32, [0, 1])
    # each mask window sits where its token window starts
    for row, mrow in zip(b.tolist(), bm.tolist()):
        hits = [s for s in range(len(ids) - 32) if ids[s:s + 33].tolist() == row]
        assert hits and all(mrow == (mask[s:s + 33] != 0).tolist() for s in hits)
    a = shared_kv.parse(["--model", "x", "--output", str(tmp_path / "o"), "--layout", "shared"])
    m = tiny_model("ouro-tiny", std=0.05, exit_criterion="learned", exit_threshold=0.6, dtype=torch.float64)
    obj = shared_kv.SharedKVObjective(m, a, shared_kv.policy_for(m.cfg, a))
    loss = lambda batch, mk: obj(batch, obj(batch, mode="pass1"), mode="pass2", mask=mk)  # noqa: E731
    base = loss(b, bm)
    # a target outside the mask does not count: change only the last token (a target, never an input)
    last = b.clone()
    mk = torch.zeros_like(bm)
    mk[:, :-1] = True  # every target but the last counts
    last2 = last.clone()
    last2[:, -1] = (last2[:, -1] + 7) % 256
    assert torch.allclose(loss(last, mk)["lm"], loss(last2, mk)["lm"])
    assert not torch.allclose(loss(last, None)["lm"], loss(last2, None)["lm"])
    assert torch.allclose(loss(b, torch.ones_like(bm))["lm"], loss(b, None)["lm"])
    assert torch.isfinite(base["lm"]) and base["lm"] != loss(b, None)["lm"]


# ------------------------------------------------------------------------------------ rows (--rows)
def _rows(prompt_len, completion_lens, seed=0):
    from train.shared_kv import Rows
    g = torch.Generator().manual_seed(seed)
    return Rows.from_lists([(torch.randint(3, 256, (prompt_len,), generator=g).tolist(),
                             torch.randint(3, 256, (n,), generator=g).tolist()) for n in completion_lens])


@pytest.mark.parametrize("name", ARCHS)
@pytest.mark.parametrize("layout", ["shared", "last_exited"])
def test_rows_bucket_with_end_padding_equals_each_row_alone(name, layout):
    """A bucket of rows (one prompt length, completions of 2 / 6 / 11 tokens, padded at the end) gives
    every row the exit depths and logits it has alone, at the fixed point and in a training sweep
    (pass 1 + pass 2), and alone it is the engine's semantics: the reference decoder with the prompt
    prefilled at full depth and the completion forced (float64)."""
    m = tiny_model(name, dtype=torch.float64, std=0.15, seed=3)
    pol = ExitPolicy.from_config(m.cfg, threshold=0.55)
    rows = _rows(5, [2, 6, 11])
    tok, mask, pl = rows.pack([0, 1, 2])
    assert pl == 5 and tok.shape == (3, 16) and mask.sum(1).tolist() == [2, 6, 11] and not mask[:, :5].any()
    assert (tok[0, 7:] == rows.pad_id).all() and (tok[2] == torch.from_numpy(rows.row(2).astype(np.int64))).all()
    ids = tok[:, :-1]
    big, _, _ = converge(m, ids, pol, layout, prompt_len=pl, max_sweeps=40, tol=0.0)
    with torch.no_grad():
        p1 = sweep(m, ids, pol, layout, sweep(m, ids, pol, layout, None, pl), pl)
        p2 = sweep(m, ids, pol, layout, p1, pl)
    spread = set()
    for b in range(3):
        r = torch.from_numpy(rows.row(b).astype(np.int64))[None]
        T = r.shape[1] - 1  # the row's own positions; the rest of the batch row is padding
        alone, _, _ = converge(m, r[:, :-1], pol, layout, prompt_len=pl, max_sweeps=40, tol=0.0)
        assert torch.equal(big.depths[b, :T], alone.depths[0])
        assert (big.exit_logits[b, :T] - alone.exit_logits[0]).abs().max() < 1e-10
        with torch.no_grad():
            a1 = sweep(m, r[:, :-1], pol, layout, sweep(m, r[:, :-1], pol, layout, None, pl), pl)
            a2 = sweep(m, r[:, :-1], pol, layout, a1, pl)
        assert torch.equal(p2.depths[b, :T], a2.depths[0])
        assert (p2.exit_logits[b, :T] - a2.exit_logits[0]).abs().max() < 1e-10
        prompt, forced = r[0, :pl].tolist(), r[0, pl:].tolist()
        g = reference_generate(m, prompt, len(forced), pol, kv_layout=layout, forced_tokens=forced)
        lp = torch.log_softmax(alone.exit_logits[0, pl - 1:], -1).gather(-1, torch.tensor(forced)[:, None])[:, 0]
        assert (lp - torch.tensor(g.logprobs, dtype=torch.float64)).abs().max() < 1e-10
        assert alone.depths[0, pl - 1:].tolist() == g.exit_depths
        spread |= set(g.exit_depths[1:])
    assert len(spread) >= 2, "the case needs a spread of exit depths"


def test_rows_objective_ignores_padding_and_prompt_targets():
    """SharedKVObjective on a padded bucket: the loss counts completion targets only (changing a
    prompt token's target role or the padding changes nothing but through the inputs), and a bucket
    of one row has that row's loss."""
    from train import shared_kv
    a = shared_kv.parse(["--model", "x", "--output", "o", "--layout", "shared"])
    m = tiny_model("ouro-tiny", std=0.05, exit_criterion="learned", exit_threshold=0.6, dtype=torch.float64)
    obj = shared_kv.SharedKVObjective(m, a, shared_kv.policy_for(m.cfg, a))
    rows = _rows(4, [3, 3, 9], seed=1)
    run = lambda tok, mk, pl: obj(tok, obj(tok, mode="pass1", prompt_len=pl), mode="pass2", mask=mk, prompt_len=pl)  # noqa: E731
    tok, mk, pl = rows.pack([0, 1, 2])
    base = run(tok, mk, pl)
    other = tok.clone()
    other[0, 7:] = (other[0, 7:] + 11) % 256  # row 0's padding
    assert torch.allclose(run(other, mk, pl)["loss"], base["loss"])
    t1, m1, _ = rows.pack([2])
    t2, m2, _ = rows.pack([2, 2])
    assert torch.allclose(run(t1, m1, pl)["lm"], run(t2, m2, pl)["lm"])
    assert torch.isfinite(base["gate"]) and base["gate"] > 0


def test_rows_batches_are_one_bucket_and_deterministic(tmp_path):
    from train.shared_kv import Rows
    rows = Rows.from_lists([([1] * (3 + i % 4), [2] * (1 + i % 3)) for i in range(40)], meta={"seed": 1})
    rows.save(tmp_path / "r.npz")
    back = Rows.load(tmp_path / "r.npz")
    assert back.meta == {"seed": 1} and all(np.array_equal(back.row(i), rows.row(i)) for i in range(40))
    assert np.array_equal(back.prompt_len, rows.prompt_len)
    for s in range(20):
        tok, mask, pl = back.batch(8, [0, s, 0])
        assert tok.shape[0] == 8 and mask[:, :pl].sum() == 0 and (mask.sum(1) >= 1).all()
        t2, m2, p2 = back.batch(8, [0, s, 0])
        assert p2 == pl and torch.equal(t2, tok) and torch.equal(m2, mask)
    assert {pl for _, _, pl in back.buckets(8)} == {3, 4, 5, 6}
    assert sum(len(t) for t, _, _ in back.buckets(8)) == 40 and sum(len(t) for t, _, _ in back.buckets(8, 10)) == 10
    with pytest.raises(ValueError):
        back.pack([0, 1])  # two prompt lengths
    from looplm.cli import UserError
    with pytest.raises(UserError):
        Rows(np.zeros(4, np.int32), np.array([0, 4]), np.array([4], np.int32))  # no completion token


@pytest.mark.slow
def test_shared_kv_rows_run(tiny_folder, tmp_path):
    """--rows / --heldout-rows: a 2-step run on rows of mixed prompt lengths writes a loadable folder,
    logs the rows' held-out exact match, and records the rows source."""
    from train.shared_kv import Rows
    g = torch.Generator().manual_seed(0)
    make = lambda n: Rows.from_lists([(torch.randint(3, 256, (4 + i % 3,), generator=g).tolist(),  # noqa: E731
                                       torch.randint(3, 256, (3 + i % 2,), generator=g).tolist()) for i in range(n)])
    make(40).save(tmp_path / "rows.npz")
    make(8).save(tmp_path / "held.npz")
    args = [a for a in _skv_args(tiny_folder, tmp_path / "out", 2) if a not in ("--tokens", str(tiny_folder / "tok.npy"))]
    r = subprocess.run([sys.executable, *args, "--rows", str(tmp_path / "rows.npz"), "--heldout-rows",
                        str(tmp_path / "held.npz"), "--no-wandb"], cwd=REPO, env=_env(), capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["data"]["source"] == "rows" and summary["data"]["n_rows"] == 40
    hist = json.loads((tmp_path / "out" / "history.json").read_text())
    assert "shared_em" in hist[0] and "last_exited_em" in hist[0]
    load_pretrained(tmp_path / "out")


@pytest.mark.parametrize("name", ARCHS)
@pytest.mark.parametrize("layout", ["shared", "last_exited"])
def test_prompt_grad_gives_the_exact_gradient_of_a_decode_token_after_a_prompt(name, layout):
    """--prompt-grad: a row whose completion is one decode token after the prefilled one reads only
    the prompt's K/V, so pass 2's loss is then exact in value AND gradient: its directional
    derivative equals the finite difference of the sequential (fixed-point) loss, float64. Without
    it (the prompt's K/V detached) the gradient misses the path through the prompt's K/V."""
    from train import shared_kv
    m = tiny_model(name, dtype=torch.float64, std=0.15, seed=4)
    for p in m.parameters():
        p.requires_grad_(True)
    rows = _rows(6, [2], seed=2)
    tok, mask, pl = rows.pack([0])
    ids, tgt, tm = tok[:, :-1], tok[:, 1:], mask[:, 1:]
    a = shared_kv.parse(["--model", "x", "--output", "o", "--layout", layout, "--step-loss", "0", "--train", "lm",
                         "--pass1-sweeps", "3"])
    pol = ExitPolicy.from_config(m.cfg, threshold=0.55)
    names = [n for n, p in m.named_parameters() if "exit_gate" not in n]
    params = dict(m.named_parameters())
    g = torch.Generator().manual_seed(0)
    direction = {n: torch.randn(params[n].shape, generator=g, dtype=torch.float64) for n in names}

    def exact_loss() -> float:
        sw, _, _ = converge(m, ids, pol, layout, prompt_len=pl, max_sweeps=40, tol=0.0)
        ce = torch.nn.functional.cross_entropy(sw.exit_logits[0], tgt[0], reduction="none")
        return float(ce[tm[0]].mean())

    def move(eps: float) -> None:
        with torch.no_grad():
            for n in names:
                params[n].add_(eps * direction[n])

    eps = 1e-6
    move(eps)
    up = exact_loss()
    move(-2 * eps)
    down = exact_loss()
    move(eps)
    fd = (up - down) / (2 * eps)
    derivs = {}
    for on in (True, False):
        prev, _, _ = converge(m, ids, pol, layout, prompt_len=pl, max_sweeps=40, tol=0.0)
        sw = sweep(m, ids, pol, layout, prev, pl, prompt_grad=on)
        loss = torch.nn.functional.cross_entropy(sw.exit_logits[0], tgt[0], reduction="none")[tm[0]].mean()
        assert abs(float(loss.detach()) - exact_loss()) < 1e-12  # the same value either way
        m.zero_grad(set_to_none=True)
        loss.backward()
        derivs["on" if on else "off"] = sum(float((params[n].grad * direction[n]).sum()) for n in names
                                            if params[n].grad is not None)
    # train/shared_kv.py's pass 2 takes it from --prompt-grad (auto: on with --rows); its CE is float32
    a.prompt_grad, a.rows = "auto", Path("rows.npz")
    obj = shared_kv.SharedKVObjective(m, a, pol)
    out = obj(tok, obj(tok, mode="pass1", prompt_len=pl), mode="pass2", mask=mask, prompt_len=pl)
    m.zero_grad(set_to_none=True)
    out["lm"].backward()
    d_obj = sum(float((params[n].grad * direction[n]).sum()) for n in names if params[n].grad is not None)
    assert abs(d_obj - fd) < 1e-4 * max(1.0, abs(fd)), (d_obj, fd)
    assert abs(derivs["on"] - fd) < 1e-5 * max(1.0, abs(fd)), (derivs, fd)
    assert abs(derivs["off"] - fd) > 1e-4 * max(1.0, abs(fd)), (derivs, fd)

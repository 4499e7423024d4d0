"""train/distill_gate.py --add-gate (issue 59): a Huginn checkpoint without an exit gate gets a new
per-step gate trained against a teacher on the frozen model. The teachers' targets against
train/common.py's independent per-step outputs, the loss's gradient against central differences,
the refusals, the saved folder (single file and sharded), and the served `learned` criterion equal
to the reference decoder in float64 for every KV layout x lookahead."""
import functools
import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from infer import LLM, EngineConfig, LLMEngine, SamplingParams
from infer.engine.reference import reference_generate
from looplm import ExitPolicy, tiny_model
from looplm.cli import UserError
from looplm.io import load_pretrained, save_pretrained
from train.common import exit_depths, logits_of, per_step_outputs, run_loop
from train.distill_gate import (added_gate_batch, added_gate_loss, choose_exit_threshold, first_exit,
                                init_added_gate, main, teacher_policy, write_exit_gate)

from helpers import MODES_KBIG, random_requests, run_staggered, runs, stable_seed

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "checkpoints" / "huginn-demo"
OURO = REPO / "checkpoints" / "ouro-demo"


def strip_gate(src: Path, dst: Path) -> Path:
    """A copy of a gated Huginn folder without its gate: exit_gate tensors dropped, exit_gate false,
    exit_criterion kl (what Huginn-3.5B looks like to the loader)."""
    shutil.copytree(src, dst)
    with safe_open(str(dst / "model.safetensors"), framework="pt") as fh:
        meta = fh.metadata()
        state = {k: fh.get_tensor(k) for k in fh.keys() if not k.startswith("exit_gate.")}
    save_file(state, str(dst / "model.safetensors"), metadata=meta)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(exit_gate=False, exit_criterion="kl")
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return dst


def digest(folder: Path) -> dict:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    d = tmp_path_factory.mktemp("add_gate")
    strip_gate(DEMO, d / "stripped")
    vocab = json.loads((DEMO / "config.json").read_text())["vocab_size"]
    rng = np.random.default_rng(0)
    np.save(d / "train.npy", rng.integers(1, vocab, 4000).astype(np.int32))
    np.save(d / "held.npy", rng.integers(1, vocab, 800).astype(np.int32))
    return d


def args(work, out, *extra, model=None, steps=20):
    return ["--model", str(model or work / "stripped"), *(["--output", str(work / out)] if out else []),
            "--steps", str(steps), "--batch", "4", "--ctx", "32", "--warmup", "2", "--lr", "1e-2",
            "--log-every", "5", "--eval-windows", "8", "--tokens", str(work / "train.npy"),
            "--heldout-tokens", str(work / "held.npy"), *extra]


@pytest.fixture(scope="module")
def kl_run(work):
    before = digest(work / "stripped")
    main(args(work, "kl", "--add-gate", "--teacher", "kl"))
    assert digest(work / "stripped") == before  # --model is never written
    return work / "kl"


# ---------------------------------------------------------------- targets, loss, init
@functools.lru_cache(maxsize=None)
def stripped64():
    import tempfile
    d = Path(tempfile.mkdtemp())
    return load_pretrained(strip_gate(DEMO, d / "m"), dtype="float64")


@pytest.mark.parametrize("teacher,threshold", [("loss", None), ("kl", 1e-3), ("latent_diff", 0.2),
                                               ("entropy_diff", 0.05), ("kl", 0.3)])
def test_targets_follow_the_teacher(teacher, threshold):
    """Targets from one pass against train.common.per_step_outputs (its own kl / latent_diff / CE
    arithmetic) and a hand-written entropy difference: 1 at step s iff the criterion exited at or
    before s (the ExitTracker's depth), or iff the loss at s is within the margin of the loss at r_max."""
    m = stripped64()
    R = m.cfg.r_max
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, m.cfg.vocab_size, (2, 13), generator=g)
    pol = teacher_policy(m.cfg, teacher, threshold)
    feats, target, ce = added_gate_batch(m, ids[:, :-1], ids[:, 1:], teacher, pol, 0.1)
    assert feats.shape == (R, 2, 12, m.cfg.hidden_size) and target.shape == (R, 2, 12)
    out = per_step_outputs(m, ids[:, :-1], ids[:, 1:], R)
    step = torch.arange(1, R + 1).view(R, 1, 1)
    if teacher == "loss":
        assert torch.allclose(ce.double(), out["ce"], atol=1e-5)
        want = out["ce"] - out["ce"][-1:] < 0.1
    else:
        if teacher == "entropy_diff":
            states, _, rope, _ = run_loop(m, ids[:, :-1], R)
            ent = [torch.full((2, 12), 100.0, dtype=torch.float64)]
            for st in states:
                logp = torch.log_softmax(logits_of(m, st, rope).double(), -1)
                ent.append(-(logp.exp() * logp).sum(-1))
            scores = torch.stack([(ent[s] - ent[s - 1]).abs() for s in range(1, R + 1)])
        else:
            scores = out[teacher]
        depth = exit_depths(scores, ExitPolicy(teacher, threshold, 1, R))
        want = step >= depth
        assert torch.equal(first_exit(target, 1), depth)
    assert torch.equal(target.bool(), want)
    assert 0 < target[:-1].mean() < 1 or teacher == "loss"  # the criterion cases exit at several depths


def test_teacher_threshold_default():
    m = stripped64()  # its config: kl at 0.001
    assert teacher_policy(m.cfg, "kl", None).threshold == 1e-3
    assert teacher_policy(m.cfg, "latent_diff", None).threshold == 0.03  # not kl's 1e-3: the criterion's default
    assert teacher_policy(m.cfg, "kl", 0.5).threshold == 0.5 and teacher_policy(m.cfg, "loss", None) is None


def test_loss_gradient_is_its_derivative():
    """The gate's autograd gradient against central differences of the reported loss (float64), with
    a mask and r_min 2 (the steps the engine reads)."""
    g = torch.Generator().manual_seed(0)
    R, B, T, d = 5, 2, 3, 4
    feats = torch.randn(R, B, T, d, generator=g, dtype=torch.float64)
    target = (torch.rand(R, B, T, generator=g) < 0.5).double()
    mask = torch.tensor([[True, False, True], [True, True, True]])
    gate = torch.nn.Linear(d, 1).double()
    with torch.no_grad():
        gate.weight.normal_(generator=g)
    loss = added_gate_loss(gate, feats, target, mask, r_min=2)["loss"]
    loss.backward()
    h = 1e-6
    for p, idx in ((gate.weight, (0, 1)), (gate.weight, (0, 3)), (gate.bias, (0,))):
        with torch.no_grad():
            p[idx] += h
            up = float(added_gate_loss(gate, feats, target, mask, r_min=2)["loss"])
            p[idx] -= 2 * h
            down = float(added_gate_loss(gate, feats, target, mask, r_min=2)["loss"])
            p[idx] += h
        assert abs((up - down) / (2 * h) - float(p.grad[idx])) < 1e-8
    # the masked token (batch 0, position 1) and the steps outside r_min..R-1 do not count
    out = added_gate_loss(gate, feats, target.index_put((torch.tensor([0]), torch.tensor([0]), torch.tensor([1])),
                                                        torch.tensor([1.0 - target[0, 0, 1].item()], dtype=torch.float64)),
                          mask, r_min=2)
    assert float(out["loss"].detach()) == pytest.approx(float(loss.detach()), abs=1e-15)


def test_init_and_threshold_choice():
    gate = init_added_gate(6, 0.25)
    assert torch.equal(gate.weight, torch.zeros(1, 6))
    assert float(torch.sigmoid(gate(torch.randn(3, 6))).std().detach()) == 0
    assert float(torch.sigmoid(gate.bias).detach()) == pytest.approx(0.25)
    # logits [R=4, N=3] (sigmoids: 0.88 0.62 0.5 | 0.27 0.73 0.5 | 0.5 0.12 0.5): mean depths 1, 4/3,
    # 7/3, 3 and 4 are reachable; the chosen threshold reaches the wanted one, else the nearest
    z = torch.tensor([[2.0, -1.0, 0.0], [0.5, 1.0, -2.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]], dtype=torch.float64)
    for want, reach in ((1.0, 1.0), (4 / 3, 4 / 3), (7 / 3, 7 / 3), (3.0, 3.0), (4.0, 4.0), (2.0, 7 / 3)):
        q, got = choose_exit_threshold(z, want, 1, 4)
        assert got == pytest.approx(reach) and 0 <= q <= 1
        assert exit_depths(z, ExitPolicy("learned", q, 1, 4)).double().mean().item() == pytest.approx(reach)


# ---------------------------------------------------------------- the script
def test_add_gate_kl_run(work, kl_run):
    cfg = json.loads((kl_run / "config.json").read_text())
    summary = json.loads((kl_run / "distill_gate.json").read_text())["add_gate"]
    assert cfg["exit_gate"] is True and cfg["exit_criterion"] == "learned"
    assert cfg["exit_threshold"] == summary["heldout"]["exit_threshold"]
    assert summary["teacher"] == "kl" and summary["teacher_threshold"] == 1e-3  # the config's kl threshold
    held = summary["heldout"]
    assert abs(held["gate_mean_depth"] - held["teacher_mean_depth"]) < 0.5
    assert summary["history"][-1]["exit_gate_loss"] < summary["history"][0]["exit_gate_loss"] + 1e-3
    with safe_open(str(kl_run / "model.safetensors"), framework="pt") as fh:  # where huginn-demo keeps its gate
        assert fh.get_tensor("exit_gate.weight").shape == (1, 192) and fh.get_tensor("exit_gate.bias").shape == (1,)
    m = load_pretrained(kl_run)
    assert m.cfg.exit_gate and m.cfg.exit_criterion == "learned" and not m.cfg.lookahead_gate
    ref = load_pretrained(work / "stripped")
    for k, v in ref.state_dict().items():  # the model itself is unchanged
        assert torch.equal(m.state_dict()[k], v), k
    llm = LLM(str(kl_run), exit_criterion="learned", kv_cache_tokens=256)
    out = llm.generate([[3, 4, 5], [7, 8]], SamplingParams(max_tokens=6, ignore_eos=True))
    assert all(len(o.token_ids) == 6 for o in out)


def test_add_gate_loss_teacher_with_lookahead(work):
    """--teacher loss, then a lookahead head distilled from the new gate (its teacher: learned)."""
    main(args(work, "loss", "--add-gate", "--margin", "0.05", "--gates", "lookahead", "--thresholds", "0.5"))
    rep = json.loads((work / "loss" / "distill_gate.json").read_text())
    assert rep["add_gate"]["teacher"] == "loss" and rep["add_gate"]["margin"] == 0.05
    assert rep["teacher"] == "learned" and rep["gates"] == ["lookahead"]
    assert {"gate_nll", "teacher_nll", "full_depth_nll"} <= set(rep["add_gate"]["heldout"])
    m = load_pretrained(work / "loss")
    assert m.cfg.exit_gate and m.cfg.exit_criterion == "learned" and m.cfg.lookahead_gate
    assert m.cfg.gate_teacher == "learned" and m.cfg.exit_threshold == rep["add_gate"]["heldout"]["exit_threshold"]
    for crit in ("learned", "lookahead_gate"):
        llm = LLM(str(work / "loss"), exit_criterion=crit, kv_cache_tokens=256)
        out = llm.generate([[3, 4, 5]], SamplingParams(max_tokens=5, ignore_eos=True))[0]
        assert len(out.token_ids) == 5


def test_refusals(work):
    cases = [
        (args(work, "r1", "--add-gate", model=OURO), "Ouro"),
        (args(work, "r2", "--add-gate", model=DEMO), "already has an exit gate"),
        (args(work, None, "--add-gate"), "needs --output"),
        (args(work, None, "--add-gate", "--output", str(work / "stripped")), "another folder"),
        (args(work, "r3"), "--add-gate to train one"),
        (args(work, "r4", "--teacher", "kl"), "need --add-gate"),
        (args(work, "r5", "--add-gate", "--teacher-threshold", "0.1"), "--teacher loss uses --margin"),
        (args(work, "r6", "--add-gate", "--teacher", "kl", "--teacher-threshold", "-1"), "distance >= 0"),
    ]
    for argv, msg in cases:
        with pytest.raises(UserError, match=msg) as e:
            main(argv)
        assert "\n" not in str(e.value)
    assert not any((work / f"r{i}").exists() for i in range(1, 7))


def test_sharded_checkpoint_gets_a_gate_file(tmp_path):
    """A sharded checkpoint (Huginn-3.5B's form): the gate goes to a file of its own in the index."""
    m = tiny_model("huginn-tiny", seed=2)
    save_pretrained(m, tmp_path, max_shard_bytes=20_000)
    shards = digest(tmp_path)
    gate = init_added_gate(m.cfg.hidden_size, 0.3)
    with torch.no_grad():
        gate.weight.normal_()
    path = write_exit_gate(gate, tmp_path)
    assert path.name == "model-exit-gate.safetensors"
    assert all(digest(tmp_path)[k] == v for k, v in shards.items() if k.startswith("model-0"))  # no shard rewritten
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg.update(exit_gate=True, exit_criterion="learned", exit_threshold=0.5)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    back = load_pretrained(tmp_path)
    assert torch.equal(back.exit_gate.weight, gate.weight) and torch.equal(back.exit_gate.bias, gate.bias)


# ---------------------------------------------------------------- served: engine == reference (float64)
LAYOUTS = ["last_exited", "shared", "first_then_shared", "full_depth"]
MODES = ["norefill", "refill_k1", "refill_k4"]
CASES = [(MODES[i % 3], lay, la, (1, 3, 8)[i // 3 % 3]) for i, (lay, la) in enumerate(
    (lay, la) for lay in LAYOUTS for la in (False, True) if runs("norefill", lay, la))]


@functools.lru_cache(maxsize=None)
def served(folder: str):
    return load_pretrained(folder, dtype="float64")


@functools.lru_cache(maxsize=None)
def served_refs(folder: str, layout: str, lookahead: bool, seed: int):
    m = served(folder)
    pol = ExitPolicy.from_config(m.cfg, lookahead=lookahead)
    return [reference_generate(m, p, n, pol, kv_layout=layout) for p, n in random_requests(seed)]


@pytest.mark.parametrize("mode,layout,lookahead,max_batch", CASES)
def test_added_gate_engine_equals_reference(kl_run, mode, layout, lookahead, max_batch):
    seed = stable_seed("add_gate", mode, layout, lookahead, max_batch)
    want = served_refs(str(kl_run), layout, lookahead, seed % 2)
    m = served(str(kl_run))
    eng = LLMEngine(m, EngineConfig(max_batch_size=max_batch, max_num_batched_tokens=16, kv_cache_tokens=512,
                                    kv_layout=layout, lookahead=lookahead, pipeline=lookahead and max_batch != 3,
                                    async_scheduling=True, **MODES_KBIG[mode]))
    assert eng.config.exit_criterion == "learned" and eng.config.exit_threshold == m.cfg.exit_threshold
    seqs = run_staggered(eng, random_requests(seed % 2), seed, join=0.3)
    for i, (s, r) in enumerate(zip(seqs, want)):
        assert s.output_ids == r.token_ids and s.exit_depths == r.exit_depths, f"seed {seed}, request {i}"
        assert max(abs(a - b) for a, b in zip(s.logprobs, r.logprobs)) < 1e-10
    assert eng.blocks.all_free


def test_served_gate_exits_vary(kl_run):
    """The equality above means something only if the added gate's exits spread over depths."""
    depths = {d for seed in range(2) for r in served_refs(str(kl_run), "last_exited", False, seed)
              for d in r.exit_depths[1:]}
    assert len(depths) >= 2, depths

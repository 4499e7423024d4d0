"""train/distill_gate.py at real scale (issue 59): packed documents kept apart (a packed batch's
distillation loss and gradient are the documents' one by one, weighted by their counted targets), the
held-out evaluation streamed window by window equal to the unstreamed one, and the run folder
(--output required, checkpoints, resume, another config refused). Tiny float64 models, CPU, seconds."""
import json

import numpy as np
import pytest
import torch

from looplm.cli import UserError
from looplm.io import save_pretrained
from tests.helpers import fresh_model
from train.distill_gate import (added_gate_eval, added_gate_step_loss, agreement, agreement_sums, heads_loss,
                                init_added_gate, main, teacher_policy)

TOL = 1e-10
REPO = __import__("pathlib").Path(__file__).resolve().parents[1]


def packed(lengths, seed, vocab=256):
    """Documents of `lengths` tokens packed into one window [1, sum], their documents and a loss mask
    whose first position of every document is 0 (the prediction across a boundary never counts)."""
    g = torch.Generator().manual_seed(seed)
    print(f"ids seed {seed}, documents of {lengths} tokens")
    pieces = [torch.randint(1, vocab, (n,), generator=g) for n in lengths]
    masks = [torch.rand(n, generator=g) < 0.7 for n in lengths]
    for m in masks:
        m[0] = False
        m[1] = True  # every document counts at least one target
    docs = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])
    return pieces, masks, torch.cat(pieces)[None], torch.cat(masks)[None], docs[None]


def heads_for(m, names):
    torch.manual_seed(0)
    heads = torch.nn.ModuleDict()
    if "lookahead" in names:
        heads["lookahead"] = torch.nn.Linear(m.cfg.hidden_size, 1)
    if "preloop" in names:
        heads["preloop"] = torch.nn.Linear(m.cfg.hidden_size, m.cfg.r_max)
    return heads.double()


def check_weighted(packed_fn, one_fn, module, pieces, masks):
    """packed_fn() / one_fn(piece, mask) -> loss parts; every part of the packed batch equals the
    documents' parts weighted by their counted targets, and so does the gradient of the loss."""
    module.zero_grad()
    big = packed_fn()
    big["loss"].backward()
    g_big = [p.grad.clone() for p in module.parameters()]
    n = [int(m[1:].sum()) for m in masks]
    want, g_want = {}, [torch.zeros_like(g) for g in g_big]
    for piece, mask, k in zip(pieces, masks, n):
        module.zero_grad()
        one = one_fn(piece[None], mask[None])
        one["loss"].backward()
        for key, v in one.items():
            want[key] = want.get(key, 0) + float(v.detach()) * k / sum(n)
        for acc, p in zip(g_want, module.parameters()):
            acc += p.grad * k / sum(n)
    for key, v in want.items():
        assert abs(float(big[key].detach()) - v) < TOL, key
    for a, b in zip(g_big, g_want):
        assert (a - b).abs().max() < TOL


def flat(parts):
    return {"loss": parts["loss"], **{f"{g}_{k}": v for g, p in parts.items() if g != "loss" for k, v in p.items()}}


@pytest.mark.parametrize("arch", ["ouro-tiny", "huginn-tiny"])
@pytest.mark.parametrize("objective", ["teacher", "oracle"])
def test_packed_heads_loss_equals_the_documents_one_by_one(arch, objective):
    m = fresh_model(arch, **({"exit_gate": True} if arch == "huginn-tiny" else {}))
    names = ("lookahead", "preloop")
    heads = heads_for(m, names)
    pieces, masks, ids, mask, docs = packed([7, 5, 9], seed=11)
    run = lambda w, mk, d: flat(heads_loss(m, heads, names, w, mk, d, objective, 0.1))  # noqa: E731
    check_weighted(lambda: run(ids, mask, docs), lambda w, mk: run(w, mk, None), heads, pieces, masks)
    plain = run(ids, mask, None)  # without the documents the later ones see the earlier ones
    assert abs(float(plain["loss"].detach()) - float(run(ids, mask, docs)["loss"].detach())) > 1e-8


@pytest.mark.parametrize("teacher", ["loss", "kl", "latent_diff"])
def test_packed_added_gate_loss_equals_the_documents_one_by_one(teacher):
    m = fresh_model("huginn-tiny")
    policy = teacher_policy(m.cfg, teacher, None)
    gate = init_added_gate(m.cfg.hidden_size, 0.3).double()
    with torch.no_grad():
        gate.weight.normal_(0, 0.3, generator=torch.Generator().manual_seed(1))
    pieces, masks, ids, mask, docs = packed([6, 8, 5], seed=13)
    run = lambda w, mk, d: added_gate_step_loss(m, gate, w, mk, d, teacher, policy, 0.1, m.cfg.r_min)  # noqa: E731
    check_weighted(lambda: run(ids, mask, docs), lambda w, mk: run(w, mk, None), gate, pieces, masks)


@pytest.mark.parametrize("arch", ["ouro-tiny", "huginn-tiny"])
def test_streamed_agreement_equals_unstreamed(arch):
    m = fresh_model(arch, **({"exit_gate": True} if arch == "huginn-tiny" else {}))
    teacher = "ouro_gate" if arch == "ouro-tiny" else "learned"
    heads = heads_for(m, ("lookahead", "preloop"))
    g = torch.Generator().manual_seed(17)
    windows = torch.randint(1, 256, (5, 13), generator=g)
    mask = torch.rand(5, 13, generator=g) < 0.8
    docs = torch.cat([torch.zeros(5, 6, dtype=torch.long), torch.ones(5, 7, dtype=torch.long)], 1)
    q = [0.3, 0.5, 0.7]
    for mk, d in ((None, None), (mask, docs)):
        whole = agreement_sums(m, teacher, dict(heads.items()), windows, mk, d, q)  # every window in one pass
        for batch in (1, 2, 5):
            got = agreement(m, teacher, dict(heads.items()), windows, mk, q, d, batch=batch)
            assert got["tokens"] == whole["tokens"]
            for row, sums in zip(got["thresholds"], whole["rows"]):
                assert abs(row["teacher_mean_depth"] - sums["teacher_depth"] / whole["tokens"]) < 1e-12
                for name in ("stock_late", "lookahead_head", "preloop"):
                    for k, v in row[name].items():
                        assert abs(v - sums[name][k] / whole["tokens"]) < 1e-12, (batch, name, k)


def test_streamed_added_gate_eval_equals_unstreamed():
    m = fresh_model("huginn-tiny")
    policy = teacher_policy(m.cfg, "kl", None)
    gate = init_added_gate(m.cfg.hidden_size, 0.3).double()
    g = torch.Generator().manual_seed(19)
    windows = torch.randint(1, 256, (4, 11), generator=g)
    mask = torch.rand(4, 11, generator=g) < 0.8
    docs = torch.cat([torch.zeros(4, 4, dtype=torch.long), torch.ones(4, 7, dtype=torch.long)], 1)
    whole = added_gate_eval(m, gate, windows, mask, "kl", policy, 0.1, 4, docs)
    one = added_gate_eval(m, gate, windows, mask, "kl", policy, 0.1, 1, docs)
    for k in ("target", "ce", "logits"):
        assert (whole[k] - one[k]).abs().max() < 1e-12, k


# ---------------------------------------------------------------- the run folder
@pytest.fixture(scope="module")
def work(tmp_path_factory):
    d = tmp_path_factory.mktemp("distill_scale")
    m = fresh_model("ouro-tiny", seed=1, dtype=torch.float32, exit_criterion="ouro_gate", exit_threshold=0.5)
    save_pretrained(m, d / "ck")
    rng = np.random.default_rng(0)
    np.save(d / "train.npy", rng.integers(1, m.cfg.vocab_size, 4000).astype(np.int32))
    np.save(d / "held.npy", rng.integers(1, m.cfg.vocab_size, 800).astype(np.int32))
    return d


def args(work, out, steps, *extra):
    # warm-up longer than the run: the schedule does not depend on --steps (a grown run equals a straight one)
    return ["--model", str(work / "ck"), "--output", str(work / out), "--steps", str(steps), "--batch", "2",
            "--ctx", "16", "--warmup", "50", "--lr", "1e-2", "--log-every", "1", "--save-every", "2",
            "--eval-windows", "3", "--tokens", str(work / "train.npy"), "--heldout-tokens", str(work / "held.npy"),
            "--thresholds", "0.5", "--no-wandb", *extra]


def heads_of(folder):
    from safetensors.torch import load_file
    return load_file(str(folder / "exit_gates.safetensors"))


def test_output_required_and_never_inside_model(work):
    for argv, msg in ((args(work, "x", 2)[:2] + args(work, "x", 2)[4:], "needs --output"),
                      (args(work, "ck/sub", 2), "inside --model"),
                      (args(work, "ck", 2), "another folder")):
        with pytest.raises(UserError, match=msg) as e:
            main(argv)
        assert "\n" not in str(e.value)
    assert not (work / "ck" / "sub").exists()


def test_resume_equals_a_straight_run(work, capsys):
    main(args(work, "straight", 5))
    main(args(work, "grown", 3))
    ck = sorted(p.name for p in (work / "grown" / "checkpoints").glob("step_*"))
    assert ck == ["step_000002", "step_000003"]  # every --save-every steps and the last; 2 kept
    capsys.readouterr()
    main(args(work, "grown", 5))  # the same command with a larger --steps: resumes at 3
    assert "resumed from" in capsys.readouterr().out
    a, b = heads_of(work / "straight"), heads_of(work / "grown")
    for k in a:
        assert torch.equal(a[k], b[k]), k
    hist = json.loads((work / "grown" / "distill_gate.json").read_text())["history"]
    assert [r["step"] for r in hist] == [1, 2, 3, 4, 5]
    straight = json.loads((work / "straight" / "distill_gate.json").read_text())["history"]
    assert [r["preloop_loss"] for r in hist] == [r["preloop_loss"] for r in straight]
    main(args(work, "grown", 5))
    assert "already finished" in capsys.readouterr().out
    with pytest.raises(UserError, match="another model or config") as e:
        main(args(work, "grown", 5, "--lr", "2e-2"))
    assert "\n" not in str(e.value)
    run = json.loads((work / "grown" / "run.json").read_text())["identity"]
    assert run["precision"] == "no" and run["ctx"] == 16


def test_non_empty_output_without_a_run_is_refused(work):
    (work / "busy").mkdir()
    (work / "busy" / "file").write_text("x")
    with pytest.raises(UserError, match="not empty"):
        main(args(work, "busy", 2))


@pytest.mark.parametrize("teacher", ["kl", "loss"])
def test_frozen_batch_gives_the_same_loss(teacher):
    """--frozen-batch: the frozen passes k windows at a time give the loss and gradient of one pass."""
    m = fresh_model("huginn-tiny", exit_gate=True)
    g = torch.Generator().manual_seed(23)
    windows = torch.randint(1, 256, (5, 12), generator=g)
    mask = torch.rand(5, 12, generator=g) < 0.8
    heads = heads_for(m, ("lookahead", "preloop"))
    gate = init_added_gate(m.cfg.hidden_size, 0.3).double()
    policy = teacher_policy(m.cfg, teacher, None)
    for module, run in ((heads, lambda k: flat(heads_loss(m, heads, ("lookahead", "preloop"), windows, mask, None,
                                                          "oracle", 0.1, frozen_batch=k))),
                        (gate, lambda k: added_gate_step_loss(m, gate, windows, mask, None, teacher, policy, 0.1,
                                                              m.cfg.r_min, frozen_batch=k))):
        got = {}
        for k in (None, 1, 2):
            module.zero_grad()
            out = run(k)
            out["loss"].backward()
            got[k] = ({n: float(v.detach()) for n, v in out.items()}, [p.grad.clone() for p in module.parameters()])
        for k in (1, 2):
            for n, v in got[None][0].items():
                assert abs(got[k][0][n] - v) < TOL, (k, n)
            for a, b in zip(got[k][1], got[None][1]):
                assert (a - b).abs().max() < TOL


def test_add_gate_phase_resumes_and_the_heads_follow_the_longer_gate(tmp_path):
    """--add-gate --gates lookahead run to 2 steps, then the same command at 4: the gate's phase resumes
    from its checkpoint, the heads distilled from the 2-step gate start anew; the result equals a
    straight 4-step run. wandb (offline) runs unless --no-wandb."""
    from safetensors.torch import load_file
    m = fresh_model("huginn-tiny", seed=2, dtype=torch.float32, exit_gate=False, exit_criterion="kl", exit_threshold=1e-3)
    save_pretrained(m, tmp_path / "ck")
    rng = np.random.default_rng(1)
    np.save(tmp_path / "train.npy", rng.integers(1, m.cfg.vocab_size, 3000).astype(np.int32))
    np.save(tmp_path / "held.npy", rng.integers(1, m.cfg.vocab_size, 600).astype(np.int32))

    def run(out, steps, *extra):
        main(["--model", str(tmp_path / "ck"), "--output", str(tmp_path / out), "--steps", str(steps), "--batch", "2",
              "--ctx", "16", "--warmup", "50", "--lr", "1e-2", "--log-every", "1", "--save-every", "1",
              "--eval-windows", "3", "--tokens", str(tmp_path / "train.npy"), "--heldout-tokens",
              str(tmp_path / "held.npy"), "--thresholds", "0.5", "--add-gate", "--teacher", "kl",
              "--gates", "lookahead", *extra])
    run("straight", 4, "--no-wandb")
    run("grown", 2)
    assert json.loads((tmp_path / "grown" / "checkpoints" / "add_gate" / "done.json").read_text())["steps"] == 2
    run("grown", 4)
    # init_wandb ran (its run id kept in OUTPUT; tests/conftest.py puts wandb's files elsewhere); not with --no-wandb
    assert (tmp_path / "grown" / "wandb_id").exists() and not (tmp_path / "straight" / "wandb_id").exists()
    a = load_file(str(tmp_path / "straight" / "model.safetensors"))
    b = load_file(str(tmp_path / "grown" / "model.safetensors"))
    assert torch.equal(a["exit_gate.weight"], b["exit_gate.weight"])
    for k, v in heads_of(tmp_path / "straight").items():
        assert torch.equal(v, heads_of(tmp_path / "grown")[k]), k
    rep = json.loads((tmp_path / "grown" / "distill_gate.json").read_text())
    assert [r["step"] for r in rep["history"]] == [1, 2, 3, 4]
    assert [r["step"] for r in rep["add_gate"]["history"]] == [1, 2, 3, 4]
    metas = [json.loads((c / "meta.json").read_text()) for c in (tmp_path / "grown" / "checkpoints").glob("step_*")]
    assert sorted(x["step"] for x in metas) == [3, 4] and {x["gate_steps"] for x in metas} == {4}


@pytest.mark.skipif(not (REPO / "checkpoints" / "ouro-demo" / "tokenizer.json").exists(), reason="no ouro-demo")
def test_chat_dataset_run(tmp_path, monkeypatch):
    """--dataset (train/datasource.py's options): a chat JSONL, packed, assistant-only, distilled on ouro-demo."""
    monkeypatch.setenv("LOOPLM_DATASETS_CACHE", str(tmp_path / "dscache"))  # not the repo's cache
    rows = [{"messages": [{"role": "user", "content": f"question {i}?"},
                          {"role": "assistant", "content": f"answer {i} " * (1 + i % 4)}]} for i in range(40)]
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    main(["--model", str(REPO / "checkpoints" / "ouro-demo"), "--output", str(tmp_path / "out"), "--dataset",
          str(tmp_path / "chat.jsonl"), "--heldout-frac", "0.2", "--steps", "2", "--batch", "2", "--ctx", "64",
          "--eval-windows", "2", "--thresholds", "0.5", "--log-every", "1", "--no-wandb"])
    rep = json.loads((tmp_path / "out" / "distill_gate.json").read_text())
    assert rep["ctx"] == 64 and rep["after"]["tokens"] > 0 and len(rep["history"]) == 2
    ident = json.loads((tmp_path / "out" / "run.json").read_text())["identity"]
    assert ident["data"]["assistant_only_loss"] is True and ident["data"]["packing"] is True

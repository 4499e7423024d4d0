"""The distilled gates (issue 25): the lookahead head and the preloop gate as engine criteria, exact
against the reference decoder in float64 for every policy x layout x batch size; the preloop run
reads no exit score during the loop; checkpoint IO of the heads; train/distill_gate.py."""
import functools
import math

import numpy as np
import pytest
import torch

from infer import EngineConfig, LLMEngine
from infer.engine.reference import reference_generate
from looplm import ExitPolicy, tiny_model
from looplm.errors import ParamError
from looplm.io import GATES_FILE, load_pretrained, save_pretrained
from looplm.policy import ExitTracker

from helpers import ARCHS, MODES_KBIG, random_requests, run_staggered, stable_seed

THRESHOLDS = {"lookahead_gate": 0.55, "preloop": 0.5}
LAYOUTS = ["last_exited", "shared", "first_then_shared"]


@functools.lru_cache(maxsize=None)
def gated(arch):
    """A tiny float64 model with both distilled heads (random, like the rest of it)."""
    extra = {"exit_gate": True} if arch == "huginn-tiny" else {}
    teacher = "ouro_gate" if arch == "ouro-tiny" else "learned"  # both score rules of the lookahead head
    return tiny_model(arch, dtype=torch.float64, std=0.15, seed=3, lookahead_gate=True, preloop_gate=True,
                      gate_teacher=teacher, **extra)


@functools.lru_cache(maxsize=None)
def refs(arch, criterion, layout, seed):
    m = gated(arch)
    pol = ExitPolicy.from_config(m.cfg, criterion=criterion, threshold=THRESHOLDS[criterion])
    return [reference_generate(m, p, n, pol, kv_layout=layout) for p, n in random_requests(seed)]


# every arch x criterion x CDB mode x layout, each at one of three batch sizes in turn (CB runs at full depth)
CASES = [(a, c, mode, lay, (1, 3, 8)[i % 3]) for i, (a, c, mode, lay) in enumerate(
    (a, c, mode, lay) for a in ARCHS for c in THRESHOLDS for mode in MODES_KBIG if mode != "cb" for lay in LAYOUTS)]


@pytest.mark.parametrize("arch,criterion,mode,layout,max_batch", CASES)
def test_engine_equals_reference(arch, criterion, mode, layout, max_batch):
    seed = stable_seed("gates", arch, criterion, mode, layout, max_batch)
    want = refs(arch, criterion, layout, seed % 3)
    pipeline = criterion == "lookahead_gate" and max_batch != 3  # the lookahead head pipelines like lookahead
    eng = LLMEngine(gated(arch), EngineConfig(
        max_batch_size=max_batch, max_num_batched_tokens=16, kv_cache_tokens=512, kv_layout=layout, exit_criterion=criterion,
        exit_threshold=THRESHOLDS[criterion], pipeline=pipeline, **MODES_KBIG[mode]))
    seqs = run_staggered(eng, random_requests(seed % 3), seed, join=0.3)
    for i, (s, r) in enumerate(zip(seqs, want)):
        assert s.output_ids == r.token_ids and s.exit_depths == r.exit_depths, f"seed {seed}, request {i}"
        assert max(abs(a - b) for a, b in zip(s.logprobs, r.logprobs)) < 1e-10
    assert eng.blocks.all_free
    m = eng.metrics()
    if criterion == "preloop":
        assert m["core_score_reads"] == 0 and m["prelude_score_reads"] == m["stage_calls"]["prelude"]
    else:
        assert m["prelude_score_reads"] == 0 and m["core_score_reads"] == m["stage_calls"]["core"]


@pytest.mark.parametrize("arch", ARCHS)
def test_cases_have_exit_spread(arch):
    for crit in THRESHOLDS:
        depths = {d for seed in range(3) for r in refs(arch, crit, "last_exited", seed) for d in r.exit_depths[1:]}
        assert len(depths) >= 2, (crit, depths)
        if crit == "lookahead_gate":
            assert min(depths) >= 2  # a lookahead signal after step s exits after s+1


@pytest.mark.parametrize("arch", ARCHS)
def test_preloop_depth_is_the_first_cdf_crossing(arch):
    """The reference decoder's depths against an independent computation from the preloop head's
    weights: softmax over depths of Linear(prelude output), first d with CDF >= q, clamped."""
    m = gated(arch)
    prompt, q, r_min = [5, 9, 2, 33], 0.5, 2
    pol = ExitPolicy.from_config(m.cfg, criterion="preloop", threshold=q, r_min=r_min)
    g = reference_generate(m, prompt, 10, pol)
    ids = torch.tensor(prompt + g.token_ids[:-1])
    with torch.no_grad():
        e = m.transformer.wte(ids) * m.cfg.embed_scale if arch == "huginn-tiny" else m.model.embed_tokens(ids)
        if arch == "huginn-tiny":  # its prelude layers attend causally over the sequence
            rope = m.rope(torch.arange(len(ids)))
            from looplm.model import plain_attend_for
            _, e = m.prelude(ids[None], rope, plain_attend_for)
            e = e[0]
        W, b = m.preloop_exit_gate.weight, m.preloop_exit_gate.bias
        cdf = torch.softmax(e @ W.T + b, -1).cumsum(-1)[len(prompt):]
    want = [min(max(int((c < q).sum()) + 1, r_min), m.cfg.r_max) for c in cdf]
    assert g.exit_depths[1:] == want


def test_tracker_at_prelude():
    pol = ExitPolicy("preloop", 0.6, 2, 4)
    for cdf, d in (([0.7, 0.9, 1.0, 1.0], 2), ([0.1, 0.2, 0.6, 1.0], 3), ([0.1, 0.2, 0.3, 0.5], 4)):
        t = ExitTracker(pol)
        t.at_prelude(cdf)
        assert t.stop_at == d and not t.open
    t = ExitTracker(ExitPolicy("none", None, 4, 4))
    t.at_prelude([1.0, 1.0, 1.0, 1.0])  # full depth stays full depth
    assert t.stop_at == 4


def test_refusals():
    plain = tiny_model("ouro-tiny", dtype=torch.float64)
    for crit in ("lookahead_gate", "preloop"):
        with pytest.raises(ParamError, match="distils one") as e:
            LLMEngine(plain, EngineConfig(exit_criterion=crit, kv_cache_tokens=64))
        assert "\n" not in str(e.value)
    m = gated("ouro-tiny")
    with pytest.raises(ParamError, match="lookahead"):
        LLMEngine(m, EngineConfig(exit_criterion="lookahead_gate", lookahead=False, kv_cache_tokens=64))
    with pytest.raises(ParamError, match="lookahead"):
        LLMEngine(m, EngineConfig(exit_criterion="preloop", lookahead=True, kv_cache_tokens=64))
    assert ExitPolicy("lookahead_gate", 0.5, 1, 4).lookahead and not ExitPolicy("preloop", 0.5, 1, 4, True).lookahead


def test_heads_round_trip(tmp_path):
    m = gated("huginn-tiny")
    save_pretrained(m, tmp_path / "ck")
    assert (tmp_path / "ck" / GATES_FILE).exists()
    from safetensors import safe_open
    with safe_open(str(tmp_path / "ck" / "model.safetensors"), framework="pt") as fh:
        assert not [k for k in fh.keys() if "lookahead" in k or "preloop" in k]  # the model's own file is untouched
    back = load_pretrained(tmp_path / "ck", dtype="float64")
    assert back.cfg.lookahead_gate and back.cfg.preloop_gate and back.cfg.gate_teacher == "learned"
    for k, v in m.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k
    (tmp_path / "ck" / GATES_FILE).unlink()
    with pytest.raises(FileNotFoundError, match=GATES_FILE):
        load_pretrained(tmp_path / "ck")


def test_distill_losses():
    from train.distill_gate import fold, lookahead_loss, pdf_from_hazards, preloop_loss
    g = torch.Generator().manual_seed(0)
    h = torch.rand(2, 5, 4, generator=g)
    assert torch.allclose(pdf_from_hazards(h).sum(-1), torch.ones(2, 5))
    assert torch.allclose(fold(pdf_from_hazards(h), 2).sum(-1), torch.ones(2, 5))
    # a student whose hazard at step s is exactly the teacher's at s+1, teacher exiting never at depth 1:
    # the exit CDFs coincide (MAE 0) and the BCE is the targets' entropy
    h[..., 0] = 0.0
    feats = torch.randn(4, 2, 5, 3, generator=g)
    head = torch.nn.Linear(3, 1)
    with torch.no_grad():  # make head(feats[s]) = logit(h[..., s+1]) through a 1-d feature
        feats[..., 0] = torch.logit(torch.cat([h[..., 1:], h[..., :1]], -1)).permute(2, 0, 1)
        head.weight.zero_()
        head.weight[0, 0] = 1.0
        head.bias.zero_()
    out = lookahead_loss(head, feats, h, None)
    assert out["cdf_mae"] < 1e-6
    t = h[..., 1:3]
    entropy = -(t * t.log() + (1 - t) * (1 - t).log()).mean()
    assert abs(float(out["bce"].detach()) - float(entropy)) < 1e-5
    pre = torch.randn(2, 5, 3, generator=g)
    lin = torch.nn.Linear(3, 4)
    assert float(preloop_loss(lin, pre, h, None)["kl"].detach()) >= 0


def test_distill_oracle_loss():
    """--objective oracle: target 1 at step s iff the next-token loss at depth s+1 is within epsilon of
    the loss at depth R; the loss is the masked BCE of the head's logit at step s against it."""
    from train.distill_gate import oracle_loss, oracle_targets
    # per-step losses [B=1, T=3, R=4]: regrets (depth s+1 vs 4) at s=1,2: token 0 (0.5, 0.05),
    # token 1 (0.05, -0.2: deeper is worse), token 2 (0.25, exactly epsilon, and 0.5)
    nll = torch.tensor([[[3.0, 2.5, 2.05, 2.0], [1.0, 1.05, 0.8, 1.0], [4.0, 3.25, 3.5, 3.0]]], dtype=torch.float64)
    want = torch.tensor([[[0.0, 1.0], [1.0, 1.0], [1.0, 0.0]]], dtype=torch.float64)
    assert torch.equal(oracle_targets(nll, 0.25), want)
    assert torch.equal(oracle_targets(nll, 0.0), torch.tensor([[[0.0, 0.0], [0.0, 1.0], [0.0, 0.0]]], dtype=torch.float64))
    # a head whose logit at step s is a known number through a 1-d feature: z = +-2 (agreeing with the
    # target where feature 0 says so), BCE = log(1 + e^-2) where it agrees, log(1 + e^2) where it does not
    feats = torch.zeros(4, 1, 3, 2, dtype=torch.float64)
    agree = torch.tensor([[True, True], [True, False], [False, True]])  # [T, s]
    feats[:2, 0, :, 0] = (torch.where(agree, 2.0, -2.0) * (2 * want[0] - 1)).T.to(torch.float64)
    head = torch.nn.Linear(2, 1).double()
    with torch.no_grad():
        head.weight.copy_(torch.tensor([[1.0, 0.0]]))
        head.bias.zero_()
    good, bad = math.log1p(math.exp(-2)), math.log1p(math.exp(2))
    out = oracle_loss(head, feats, nll, None, 0.25)
    assert abs(float(out["bce"].detach()) - (4 * good + 2 * bad) / 6) < 1e-12 and out["loss"] is out["bce"]
    assert abs(float(out["exit_frac"].detach()) - 4 / 6) < 1e-12
    mask = torch.tensor([[True, False, True]])  # token 1 does not count
    out = oracle_loss(head, feats, nll, mask, 0.25)
    assert abs(float(out["bce"].detach()) - (3 * good + bad) / 4) < 1e-12 and abs(float(out["exit_frac"].detach()) - 0.5) < 1e-12
    out["loss"].backward()  # only the head trains: the gradient reaches it
    assert head.weight.grad is not None and float(head.weight.grad.abs().sum()) > 0


def test_distill_gate_script(tmp_path):
    """train/distill_gate.py on a tiny checkpoint (random tokens): writes the heads, the engine serves
    both criteria from the folder, and the distillation lowers the losses."""
    import json
    from train.distill_gate import main
    m = tiny_model("ouro-tiny", seed=1, std=0.15, exit_criterion="ouro_gate", exit_threshold=0.5)
    save_pretrained(m, tmp_path / "ck")
    rng = np.random.default_rng(0)
    np.save(tmp_path / "train.npy", rng.integers(1, m.cfg.vocab_size, 4000).astype(np.int32))
    np.save(tmp_path / "held.npy", rng.integers(1, m.cfg.vocab_size, 800).astype(np.int32))
    main(["--model", str(tmp_path / "ck"), "--output", str(tmp_path / "out"), "--steps", "60", "--batch", "4",
          "--ctx", "32", "--warmup", "5", "--lr", "1e-2", "--log-every", "10", "--eval-windows", "8",
          "--tokens", str(tmp_path / "train.npy"), "--heldout-tokens", str(tmp_path / "held.npy"),
          "--thresholds", "0.5"])
    rep = json.loads((tmp_path / "out" / "distill_gate.json").read_text())
    hist = rep["history"]
    assert hist[-1]["preloop_loss"] < hist[0]["preloop_loss"]
    assert hist[-1]["lookahead_loss"] <= hist[0]["lookahead_loss"] + 1e-3  # starts at the stock gate: already close
    row = rep["after"]["thresholds"][0]
    assert {"stock_late", "lookahead_head", "preloop"} <= set(row)
    served = load_pretrained(tmp_path / "out")
    assert served.cfg.gate_teacher == "ouro_gate"
    assert not (tmp_path / "ck" / GATES_FILE).exists()  # --output: the source folder is left alone
    from infer import LLM, SamplingParams
    for crit in ("lookahead_gate", "preloop"):
        llm = LLM(str(tmp_path / "out"), exit_criterion=crit, exit_threshold=0.5, kv_cache_tokens=256)
        out = llm.generate([[3, 4, 5]], SamplingParams(max_tokens=6, ignore_eos=True))[0]
        assert len(out.token_ids) == 6 and min(out.exit_depths[1:]) >= (2 if crit == "lookahead_gate" else 1)
    # --objective oracle: the head alone, trained on the coda's per-step losses, lowers its loss
    main(["--model", str(tmp_path / "ck"), "--output", str(tmp_path / "oracle"), "--gates", "lookahead",
          "--objective", "oracle", "--epsilon", "0.05", "--steps", "30", "--batch", "4", "--ctx", "32", "--warmup", "5",
          "--lr", "1e-2", "--log-every", "10", "--eval-windows", "8", "--tokens", str(tmp_path / "train.npy"),
          "--heldout-tokens", str(tmp_path / "held.npy"), "--thresholds", "0.5"])
    rep = json.loads((tmp_path / "oracle" / "distill_gate.json").read_text())
    assert rep["objective"] == "oracle" and rep["epsilon"] == 0.05
    hist = rep["history"]
    assert hist[-1]["lookahead_loss"] < hist[0]["lookahead_loss"] and 0 <= hist[0]["lookahead_exit_frac"] <= 1
    assert "mean_nll" in rep["after"]["thresholds"][0]["lookahead_head"]
    served = load_pretrained(tmp_path / "oracle")
    assert served.cfg.lookahead_gate and not served.cfg.preloop_gate


def test_matched_depth_interpolation():
    from eval.gates import at_depth
    pts = [{"mean_exit_depth": 2.0, "acc": 0.8}, {"mean_exit_depth": 3.0, "acc": 1.0}, {"mean_exit_depth": 1.5, "acc": 0.5}]
    assert abs(at_depth(pts, 2.5) - 0.9) < 1e-12 and abs(at_depth(pts, 1.75) - 0.65) < 1e-12
    assert at_depth(pts, 1.0) is None and at_depth(pts, 3.5) is None  # never extrapolated


def _sweep(correct_by_q, depth_by_q):
    """Sweep points with per-record items: records i correct per `correct_by_q[q]`, two answer tokens
    each at depth `depth_by_q[q][i]`."""
    from eval.gates import _scores
    pts = []
    for q, c in correct_by_q.items():
        items = {"correct": list(c), "depth_sum": [2.0 * d for d in depth_by_q[q]], "depth_n": [2] * len(c)}
        acc, depth = _scores(items, np.arange(len(c))[None])
        pts.append({"threshold": q, "acc": float(acc[0]), "mean_exit_depth": float(depth[0]), "items": items})
    return pts


def test_paired_bootstrap_of_matched_depth_differences():
    """Identical gates differ by exactly 0 in every resample; a gate that is wrong on a record the
    other gets right differs by 1/n at every depth, inside its interval; layouts pair gate by gate."""
    from eval.gates import bootstrap
    rng = np.random.default_rng(5)
    n = 50
    c = {q: (rng.random(n) < 0.5 + q / 2).astype(float) for q in (0.1, 0.5, 0.9)}
    d = {q: 1 + 2 * q + 0.1 * rng.random(n) for q in c}
    worse = {q: np.where(np.arange(n) == int(np.argmax(v)), 0.0, v) for q, v in c.items()}  # one record flipped
    runs = {"last_exited": {"stock": _sweep(c, d), "stock_late": _sweep(c, d), "lookahead_head": _sweep(worse, d)},
            "shared": {"stock": _sweep(c, d)}}
    out = bootstrap(runs, [1.5, 2.0, 5.0], iters=200, seed=0)
    by = {(r["a"], r["b"], r["depth"]): r for r in out}
    same = by[("last_exited/stock_late", "last_exited/stock", 1.5)]
    assert same["diff"] == 0 and same["ci95"] == [0.0, 0.0] and same["resamples"] == 200
    flip = by[("last_exited/lookahead_head", "last_exited/stock_late", 2.0)]
    assert abs(flip["diff"] + 1 / n) < 1e-12 and flip["ci95"][0] <= flip["diff"] <= flip["ci95"][1] <= 0
    assert ("shared/stock", "last_exited/stock", 2.0) in by
    assert not any(r["depth"] == 5.0 for r in out)  # beyond every sweep: not reported


def test_gates_config_file(tmp_path):
    from eval.gates import main
    (tmp_path / "bad.yaml").write_text("model: x\nthreshold: [0.5]\n")
    with pytest.raises(SystemExit):
        main(["--config", str(tmp_path / "bad.yaml")])

"""KV-layout and exit semantics (BLUEPRINT sections 2-3), against independent recomputations."""
import random

import pytest
import torch
import torch.nn.functional as F

from kv_layouts import make_layout
from looplm import ExitPolicy, ExitTracker, tiny_model
from looplm.exits import step_scores
from infer.engine.reference import reference_generate

from helpers import ARCHS, model


def explicit_logits(model, ids, depths):
    """Logits of every position, recomputed from scratch in one parallel pass where position j
    leaves the loop after depths[j] steps and, at deeper steps, shows the K/V of its exit depth
    (what last_exited fill promises). Independent of kv_layouts and looplm.stages."""
    T = len(ids)
    d = torch.tensor(depths)
    rope = model.rope(torch.arange(T))
    store, cur = {}, {"step": 0}

    def attend_for(stage, layer):
        def attend(q, k, v):  # [T, heads, D]
            if stage == "core":
                s = cur["step"]
                k, v = k.clone(), v.clone()
                for j in torch.nonzero(d < s).flatten().tolist():
                    k[j], v[j] = store[(layer, int(d[j]))][0][j], store[(layer, int(d[j]))][1][j]
                store[(layer, s)] = (k, v)
            y = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                               v.transpose(0, 1)[None], is_causal=True,
                                               enable_gqa=q.shape[1] != k.shape[1])
            return y[0].transpose(0, 1)
        return attend

    with torch.no_grad():
        state, inj = model.prelude(torch.tensor(ids), rope, attend_for)
        for s in range(1, int(d.max()) + 1):
            cur["step"] = s
            new = model.core_step(state, inj, rope, attend_for)
            state = torch.where((d >= s)[:, None], new, state)
        return model.head(model.coda(state, rope, attend_for))


@pytest.mark.parametrize("name", ARCHS)
@pytest.mark.parametrize("lookahead", [False, True])
def test_last_exited_equals_explicit_recomputation(name, lookahead):
    m = model(name)
    policy = ExitPolicy.from_config(m.cfg, threshold=0.55, lookahead=lookahead)
    prompt = [3, 14, 15, 92, 65, 35]
    g = reference_generate(m, prompt, 16, policy, kv_layout="last_exited")
    assert len(set(g.exit_depths[1:])) >= 2, "the test needs a spread of exit depths"
    depths = [m.cfg.r_max] * len(prompt) + g.exit_depths[1:]
    logits = explicit_logits(m, prompt + g.token_ids[:-1], depths)[len(prompt) - 1:]
    lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(g.token_ids)[:, None])[:, 0]
    assert (lp - torch.tensor(g.logprobs, dtype=torch.float64)).abs().max() < 1e-10
    assert g.token_ids == logits.argmax(-1).tolist()


@pytest.mark.parametrize("name", ARCHS)
def test_no_exits_last_exited_equals_full_depth_shared_differs(name):
    m = tiny_model(name, dtype=torch.float64, std=0.15, seed=1)
    full = ExitPolicy.from_config(m.cfg, full_depth=True)
    runs = {lay: reference_generate(m, [7, 8, 9, 10], 12, full, kv_layout=lay) for lay in
            ("last_exited", "full_depth", "shared")}
    assert runs["last_exited"].token_ids == runs["full_depth"].token_ids
    assert runs["last_exited"].logprobs == runs["full_depth"].logprobs
    assert runs["shared"].logprobs[0] == runs["full_depth"].logprobs[0]  # prefill is depth-major in both
    assert runs["shared"].logprobs[1:] != runs["full_depth"].logprobs[1:]


def test_last_exited_fill_copies_exit_depth_slots():
    m = tiny_model("ouro-tiny")
    lay = make_layout("last_exited", m.cfg, 4, torch.float32)
    R = lay.num_rows + 1
    for s in range(m.cfg.r_max):
        lay.k_core[:, s * R:(s + 1) * R] = float(s + 1)
    lay.on_exit(torch.tensor([1, 2]), torch.tensor([2, 4]))
    k = lay.k_core[0, :, 0, 0].view(m.cfg.r_max, R)
    assert k[:, 1].tolist() == [1, 2, 2, 2]  # exited at 2: slots 3, 4 hold depth 2
    assert k[:, 2].tolist() == [1, 2, 3, 4]  # full depth: untouched
    assert k[:, 0].tolist() == [1, 2, 3, 4]


def test_shared_layout_uses_one_core_slot():
    m = tiny_model("huginn-tiny")
    a = make_layout("last_exited", m.cfg, 10, torch.float32)
    b = make_layout("shared", m.cfg, 10, torch.float32)
    assert b.k_core.numel() * m.cfg.r_max == a.k_core.numel()
    with pytest.raises(ValueError, match="unknown kv_layout 'paged'"):
        make_layout("paged", m.cfg, 10)


def _run(policy, scores):
    t = ExitTracker(policy)
    for s, sc in enumerate(scores, start=1):
        if t.after_step(s, sc):
            return s
    raise AssertionError("never exited")


@pytest.mark.parametrize("seed", range(20))
def test_exit_tracker_rules(seed):
    """Standard: exit at the first signalled step >= r_min. Lookahead: exactly one step after the
    first signal at s with s + 1 >= r_min (so never below 2). r_max always stops."""
    rng = random.Random(seed)
    r_max = rng.randint(2, 8)
    r_min = rng.randint(1, r_max)
    scores = [rng.choice([0.0, 1.0]) for _ in range(r_max)]  # latent_diff: 0.0 < q signals
    sig = [s for s in range(1, r_max + 1) if scores[s - 1] < 0.5]
    std = ExitPolicy("latent_diff", 0.5, r_min, r_max)
    assert _run(std, scores) == min([s for s in sig if s >= r_min] + [r_max])
    la = ExitPolicy("latent_diff", 0.5, r_min, r_max, lookahead=True)
    got = _run(la, scores)
    assert got == min([s + 1 for s in sig if s + 1 >= r_min and s < r_max] + [r_max])
    assert got >= 2 and r_min <= got <= r_max


def test_ouro_gate_cdf():
    p = ExitPolicy("ouro_gate", 0.7, 1, 4)
    t = ExitTracker(p)
    # gate logit 0 (lambda = 0.5) at each step: CDF 0.5, 0.75 -> exits after step 2
    g = torch.zeros(1, dtype=torch.float64)
    c1, surv = step_scores("ouro_gate", None, None, g, None, None)
    c2, _ = step_scores("ouro_gate", None, None, g, None, surv)
    assert c1.tolist() == [0.5] and c2.tolist() == [0.75]
    assert not t.after_step(1, c1.item()) and t.after_step(2, c2.item())


@pytest.mark.parametrize("name", ARCHS)
@pytest.mark.parametrize("r_min,lookahead", [(1, False), (3, False), (1, True), (3, True)])
def test_reference_depths_within_bounds(name, r_min, lookahead):
    m = tiny_model(name, dtype=torch.float64, std=0.15, seed=2)
    policy = ExitPolicy.from_config(m.cfg, threshold=0.5, r_min=r_min, r_max=m.cfg.r_max - 1, lookahead=lookahead)
    g = reference_generate(m, [1, 2, 3], 12, policy)
    lo = max(r_min, 2 if lookahead else 1)
    assert g.exit_depths[0] == m.cfg.r_max  # prefill: full depth
    assert all(lo <= d <= m.cfg.r_max - 1 for d in g.exit_depths[1:])


@pytest.mark.parametrize("criterion", ["kl", "latent_diff", "entropy_diff"])
def test_huginn_output_criteria_run(criterion):
    m = tiny_model("huginn-tiny", dtype=torch.float64, std=0.15)
    thr = {"kl": 0.05, "latent_diff": 0.5, "entropy_diff": 0.05}[criterion]
    g = reference_generate(m, [1, 2, 3], 8, ExitPolicy.from_config(m.cfg, criterion=criterion, threshold=thr))
    assert len(g.token_ids) == 8 and all(1 <= d <= m.cfg.r_max for d in g.exit_depths)

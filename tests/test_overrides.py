"""r_max overrides a checkpoint's heads must serve or refuse (issue 37, deliverable 10): a preloop
gate distilled at r_max R answers for any r_max <= R (its depth clamped at r_max: the deeper mass
is the forced exit there, as under a request's lower r_max) and refuses above R in one line naming
r_max and the head; the per-step heads (stock gate, lookahead head) answer at any r_max. Each case:
the engine equals the reference decoder (float64) at the overridden r_max."""
import functools
from pathlib import Path

import pytest
import torch

from infer import LLM, EngineConfig, LLMEngine, SamplingParams
from infer.engine.reference import reference_generate
from looplm import ExitPolicy, tiny_model
from looplm.config import LoopConfig
from looplm.errors import ParamError
from looplm.io import load_pretrained, save_pretrained

from helpers import ARCHS, random_requests, run_staggered, stable_seed

LAB = Path(__file__).resolve().parents[1] / "checkpoints" / "lab-hops"
THRESHOLDS = {"lookahead_gate": 0.55, "preloop": 0.5}


def gated(arch):
    """A tiny float64 model with both distilled heads (r_max 4 for Ouro, 6 for Huginn)."""
    extra = {"exit_gate": True} if arch == "huginn-tiny" else {}
    return tiny_model(arch, dtype=torch.float64, std=0.15, seed=3, lookahead_gate=True, preloop_gate=True,
                      gate_teacher="ouro_gate" if arch == "ouro-tiny" else "learned", **extra)


@functools.lru_cache(maxsize=None)
def checkpoint(arch, root):
    """The gated model saved as a checkpoint folder (the path `LLM("folder", r_max=...)` loads)."""
    return save_pretrained(gated(arch), Path(root) / arch)


def engine_equals_reference(m, criterion, threshold, seed, r_max_req=None, n=4):
    """Staggered requests through an engine on `m` against the reference decoder; returns the
    non-prefill exit depths seen (so a caller can check they vary)."""
    eng = LLMEngine(m, EngineConfig(max_batch_size=3, max_num_batched_tokens=16, kv_cache_tokens=512,
                                    exit_criterion=criterion, exit_threshold=threshold))
    pol = ExitPolicy.from_config(m.cfg, criterion=criterion, threshold=threshold).override(r_max=r_max_req)
    reqs = random_requests(seed, n=n)
    seqs = run_staggered(eng, reqs, seed, join=0.3, r_max=r_max_req)
    depths = set()
    for i, (s, (p, n)) in enumerate(zip(seqs, reqs)):
        r = reference_generate(m, p, n, pol)
        assert s.output_ids == r.token_ids and s.exit_depths == r.exit_depths, f"seed {seed}, request {i}"
        assert max(abs(a - b) for a, b in zip(s.logprobs, r.logprobs)) < 1e-10
        assert max(s.exit_depths[1:], default=1) <= pol.r_max  # [0]: the prefill's, at the model's r_max
        depths |= set(s.exit_depths[1:])
    assert eng.blocks.all_free
    return depths


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("criterion", sorted(THRESHOLDS))
def test_lower_r_max_serves_the_distilled_heads(arch, criterion, tmp_path_factory):
    """Failed before: the preloop head was rebuilt with r_max rows and the checkpoint's did not fit."""
    folder = checkpoint(arch, str(tmp_path_factory.getbasetemp()))
    low = 3
    llm = LLM(folder, r_max=low, dtype="float64", exit_criterion=criterion, kv_cache_tokens=64)
    m = llm.model
    assert m.cfg.r_max == low and m.cfg.preloop_depths == gated(arch).cfg.r_max
    depths = engine_equals_reference(m, criterion, THRESHOLDS[criterion], stable_seed("overrides", arch, criterion))
    assert len(depths) >= 2, depths  # exits really vary at the lower r_max
    # a request's lower r_max on the lowered engine too
    engine_equals_reference(m, criterion, THRESHOLDS[criterion], 7, r_max_req=2, n=2)


@pytest.mark.parametrize("low", [1, 2, 3])
def test_preloop_depth_at_a_lower_r_max_is_the_clamped_crossing(low):
    """Independent of the engine: the depth at r_max=low is the first d whose CDF over all the
    head's depths (not renormalised over 1..low) reaches q, clamped to [r_min, low]."""
    full = gated("ouro-tiny")
    m = LLM(full, r_max=low, kv_cache_tokens=64, dtype="float64").model
    prompt, q = [5, 9, 2, 33], 0.5
    g = reference_generate(m, prompt, 10, ExitPolicy.from_config(m.cfg, criterion="preloop", threshold=q))
    with torch.no_grad():
        e = m.model.embed_tokens(torch.tensor(prompt + g.token_ids[:-1]))
        W, b = full.preloop_exit_gate.weight, full.preloop_exit_gate.bias
        cdf = torch.softmax(e @ W.T + b, -1).cumsum(-1)[len(prompt):]
    assert W.shape[0] == 4 and m.preloop_exit_gate.weight.shape[0] == 4
    assert g.exit_depths[1:] == [min(int((c < q).sum()) + 1, low) for c in cdf]


@pytest.mark.parametrize("arch", ARCHS)
def test_higher_r_max(arch, tmp_path_factory):
    """Above the head's depths the preloop gate refuses in one line naming r_max and the head; the
    per-step lookahead head answers, the engine equal to the reference there."""
    folder = checkpoint(arch, str(tmp_path_factory.getbasetemp()))
    high = gated(arch).cfg.r_max + 2
    with pytest.raises(ParamError, match=r"r_max=\d+ exceeds .*preloop_gate head") as e:
        LLM(folder, r_max=high, dtype="float64", exit_criterion="preloop", kv_cache_tokens=64)
    assert e.value.param == "r_max" and "\n" not in str(e.value)
    m = LLM(folder, r_max=high, dtype="float64", kv_cache_tokens=64).model  # the preloop head loads, unused
    assert m.cfg.r_max == high
    # the lookahead head (per step, like the stock gate, whose r_max above the checkpoint's others test)
    assert len(engine_equals_reference(m, "lookahead_gate", 0.55, stable_seed("overrides-high", arch), n=3)) >= 2


def test_model_object_r_max_is_applied_not_ignored():
    m = gated("ouro-tiny")
    llm = LLM(m, r_max=2, kv_cache_tokens=64, dtype="float64")
    assert llm.model.cfg.r_max == 2 and m.cfg.r_max == 4  # a copy; the caller's model is untouched
    for k, v in m.state_dict().items():
        assert torch.equal(llm.model.state_dict()[k], v), k


def test_overridden_config_round_trips(tmp_path):
    m = LLM(gated("huginn-tiny"), r_max=3, kv_cache_tokens=64, dtype="float64").model
    save_pretrained(m, tmp_path / "ck")
    cfg = LoopConfig.from_json(tmp_path / "ck" / "config.json")
    assert (cfg.r_max, cfg.preloop_depths) == (3, 6)
    back = load_pretrained(tmp_path / "ck", dtype="float64")
    for k, v in m.state_dict().items():
        assert torch.equal(back.state_dict()[k], v), k
    plain = tiny_model("ouro-tiny", preloop_gate=True).cfg.to_dict()
    assert "preloop_depths" not in plain  # written only where it differs from r_max


@pytest.mark.skipif(not LAB.is_dir(), reason="checkpoints/lab-hops not present")
def test_lab_hops_r_max_sweep():
    """The issue's command: LLM("checkpoints/lab-hops", r_max=1) failed on the preloop gate's shape."""
    assert LLM(LAB, r_max=1, kv_cache_tokens=64).model.cfg.r_max == 1
    m = LLM(LAB, r_max=2, dtype="float64", exit_criterion="preloop", kv_cache_tokens=128).model
    eng = LLMEngine(m, EngineConfig(max_batch_size=4, kv_cache_tokens=256, exit_criterion="preloop"))
    pol = ExitPolicy.from_config(m.cfg, criterion="preloop")
    prompts = [[int(t) % m.cfg.vocab_size for t in p] for p, _ in random_requests(11, n=4)]
    seqs = [eng.add_request(p, SamplingParams(max_tokens=8, ignore_eos=True, logprobs=True)) for p in prompts]
    while eng.has_unfinished():
        eng.step()
    depths = set()
    for s, p in zip(seqs, prompts):
        r = reference_generate(m, p, 8, pol)
        assert s.output_ids == r.token_ids and s.exit_depths == r.exit_depths
        assert max(abs(a - b) for a, b in zip(s.logprobs, r.logprobs)) < 1e-10
        depths |= set(s.exit_depths[1:])
    assert depths == {1, 2}, depths  # the head's depths 3 and 4 became forced exits at 2
    with pytest.raises(ParamError, match="r_max=6 exceeds the 4 depths .*preloop_gate head"):
        LLM(LAB, r_max=6, exit_criterion="preloop", kv_cache_tokens=64)

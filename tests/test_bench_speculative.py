"""infer/bench/speculative.py on a tiny model (seconds): the JSON blocks hold the engine's
speculative_metrics per setting (what `python -m infer.sim --acceptance FILE` reads), the exactness
check passes on a real run and catches a changed token or exit depth, and the latency blocks carry
an interval and work counts."""
import json

import pytest
import torch

from infer.bench import speculative as S
from infer.sim.simulate import load_acceptance

from helpers import THRESHOLD, model

SPEC_KEYS = {"stages", "verifications", "drafted", "accepted", "rejected", "emitted", "verified_tokens",
             "draft_launches", "verify_launches", "acceptance_rate", "draft_accept_prob", "tokens_per_verification"}


@pytest.fixture(scope="module")
def result():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the script's --threads default (and fast on a shared machine)
    m = model("ouro-tiny")
    reqs = S.random_requests(m.cfg.vocab_size, n=6, prompt_len=5, max_tokens=10)
    yield S.bench_checkpoint("ouro-tiny", m, None, reqs, "random token ids", {"exit_threshold": THRESHOLD},
                             ks=(2, 4), drafts=(1, 2), latency_prompts=2, latency_settings=["4:1"], repeats=2)
    torch.set_num_threads(threads)


def test_acceptance_blocks_are_exact_and_complete(result, tmp_path):
    assert result["exact"] and result["wave"] == 8 and result["overrides"] == {}
    assert [(b["k"], b["draft_depth"]) for b in result["acceptance"]] == [(2, 1), (4, 1), (2, 2), (4, 2)]
    for b in result["acceptance"]:
        sp = b["speculative"]
        assert SPEC_KEYS <= set(sp) and b["exact"] and not b["mismatches"]
        assert sp["verifications"] > 0 and sp["drafted"] > 0  # speculation really ran
        assert sp["accepted"] + sp["rejected"] <= sp["drafted"]
    assert sum(b["speculative"]["rejected"] for b in result["acceptance"]) > 0  # not a trivial exactness check
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(result))
    rate = load_acceptance(str(path))  # the simulator pools every speculative dict in the file
    assert 0 <= rate <= 1


def test_latency_block(result):
    (b,) = result["latency"]
    assert (b["k"], b["draft_depth"], b["repeats"]) == (4, 1, 2)
    assert len(b["seconds_off"]) == len(b["seconds_on"]) == 2
    r = b["ratio_off_over_on"]
    assert r["lo"] <= r["median"] <= r["hi"] and r["rounds"] == 2
    assert b["launches_off"] > 0 and b["launches_on"] > 0 and b["work_on"]["weight_bytes"] > 0
    assert SPEC_KEYS <= set(b["speculative"]) and b["speculative"]["verifications"] > 0
    assert "\n" in "\n".join(S.tables({"ouro-tiny": result}))


def test_mismatches_name_the_first_difference():
    want = [([5, 6, 7], [4, 2, 3]), ([1, 2], [4, 1])]
    assert S.mismatches(want, want) == []
    bad = S.mismatches(want, [([5, 6, 8], [4, 2, 3]), ([1, 2], [4, 2])])
    assert [(d["request"], d["position"]) for d in bad] == [(0, 2), (1, 1)]


def test_shared_layout_and_output_criterion_are_overridden():
    cfg = model("ouro-tiny").cfg
    base, over = S.speculation_settings(cfg, {"kv_layout": "shared", "exit_criterion": "kl"})
    assert over == {"kv_layout": "last_exited", **S.SPEC_CRITERION} and base["kv_layout"] == "last_exited"

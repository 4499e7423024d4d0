"""Parity with the public reference implementations (Ouro: LoopedLMs/ouro_rl modeling_ouro.py;
Huginn: seal-rg/recurrent-pretraining raven_modeling_minimal.py; the retrofitted-recurrence Llama /
OLMo-2 models and Nanbeige4.2, below), on tiny random checkpoints whose
outputs were computed by running that code (tests/fixtures/parity/README.md says how)."""
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from looplm import ExitPolicy, load_pretrained
from looplm.layers import causal_attend
from infer.engine.reference import reference_generate

FIX = Path(__file__).parent / "fixtures" / "parity"
OURO, HUGINN = ["ouro_a", "ouro_b"], ["huginn_a", "huginn_b"]
TOL = 1e-4  # fp32


def _load(name, **kw):
    return load_pretrained(FIX / name, dtype="float32", **kw), load_file(FIX / name / "expected.safetensors")


@pytest.mark.parametrize("name", OURO)
def test_ouro_step_logits_and_gate(name):
    m, exp = _load(name)
    ids = exp["input_ids"]
    T = exp["step_logits"].shape[0]
    with torch.no_grad():
        for t in range(1, T + 1):
            out = m(ids, num_steps=t)
            assert (out.logits - exp["step_logits"][t - 1]).abs().max() < TOL, f"step {t}"
        assert (out.gate_logits - exp["gate_logits"]).abs().max() < TOL


@pytest.mark.parametrize("name", HUGINN)
def test_huginn_logits_per_num_steps(name):
    m, exp = _load(name)
    ids = exp["input_ids"]
    with torch.no_grad():
        for r in range(1, exp["logits"].shape[0] + 1):
            assert (m(ids, num_steps=r).logits - exp["logits"][r - 1]).abs().max() < TOL, f"num_steps={r}"


CASES = [("ouro_a", "gen_greedy", "last_exited"), ("ouro_b", "gen_greedy", "last_exited")] + [
    (h, key, lay) for h in HUGINN for key, lay in (("gen_latest_m4", "last_exited"), ("gen_compress_s4", "shared"))]


@pytest.mark.parametrize("name,key,layout", CASES)
def test_fixed_depth_generation(name, key, layout):
    """Greedy generation at fixed depth; Huginn's `compress-s4` cache is our `shared` layout and
    `latest-m4` our `last_exited`."""
    m, exp = load_pretrained(FIX / name, dtype="float64"), load_file(FIX / name / "expected.safetensors")
    prompt, gen = exp["input_ids"][0].tolist(), exp[key][0].tolist()
    g = reference_generate(m, prompt, len(gen) - len(prompt), ExitPolicy.from_config(m.cfg, full_depth=True),
                           kv_layout=layout)
    assert prompt + g.token_ids == gen


@pytest.mark.parametrize("cache,layout", [("latest_m4", "last_exited"), ("compress_s4", "shared")])
def test_huginn_adaptive_kl_generation(cache, layout):
    """Huginn's generate_with_adaptive_compute(criterion='kl', exit_threshold=0.1, num_steps=8):
    same tokens and the same per-token step counts (its prefill ran all 8 steps, as ours does)."""
    m = load_pretrained(FIX / "huginn_b", dtype="float64", r_max=8)
    exp = load_file(FIX / "huginn_b" / "expected.safetensors")
    prompt, gen = exp["input_ids"][0].tolist(), exp[f"gen_adaptive_kl_{cache}"][0].tolist()
    g = reference_generate(m, prompt, len(gen) - len(prompt),
                           ExitPolicy.from_config(m.cfg, criterion="kl", threshold=0.1), kv_layout=layout)
    assert prompt + g.token_ids == gen
    assert g.exit_depths == exp[f"steps_adaptive_kl_{cache}"].tolist()


# ---------------------------------------------------------------- the newer families
# Retrofitted recurrence (LoopedLMs/retrofitting-recurrence raven_modeling_minimal_{llama,olmo}.py) and
# Nanbeige4.2 (its HF remote code modeling_nanbeige.py); tests/fixtures/parity/README.md says how.
RETRO, NANBEIGE = ["retro_llama_a", "retro_llama_b", "retro_olmo_a"], ["nanbeige_a", "nanbeige_b"]


@pytest.mark.parametrize("name", RETRO + NANBEIGE)
def test_family_read_from_its_folder(name):
    m, _ = _load(name)
    want = {"retro_llama": "raven_llama", "retro_olmo": "raven_olmo", "nanbeige": "nanbeige"}[name[:-2]]
    assert m.cfg.family == want and not m.cfg.tie_embeddings and m.stock_gate() is None


@pytest.mark.parametrize("name", RETRO + NANBEIGE)
def test_logits_and_states_per_depth(name):
    """Every depth's logits and loop state: the retrofits' un-normed latents (the coda's input, zero
    initial state), Nanbeige's normed state after each pass of its layers."""
    m, exp = _load(name)
    ids, states = exp["input_ids"], exp["latents" if name in RETRO else "states"]
    R = exp["logits"].shape[0]
    assert R == m.cfg.r_max
    with torch.no_grad():
        out = m(ids, num_steps=R, return_states=True)
        for r in range(1, R + 1):
            assert (m(ids, num_steps=r).logits - exp["logits"][r - 1]).abs().max() < TOL, f"depth {r}"
            assert (out.states[r - 1] - states[r - 1]).abs().max() < TOL, f"state after step {r}"


@pytest.mark.parametrize("name,layout", [(n, lay) for n in RETRO + NANBEIGE for lay in ("last_exited", "full_depth")])
def test_new_family_fixed_depth_generation(name, layout):
    """Greedy tokens at full depth through the reference's KV cache, which keeps every (step, layer)'s
    K/V (Nanbeige: one slot per loop and layer; the retrofits: HuginnDynamicCache 'full'): our
    depth-indexed layouts, equal to a cache-free recomputation."""
    m, exp = load_pretrained(FIX / name, dtype="float64"), load_file(FIX / name / "expected.safetensors")
    assert torch.equal(exp["gen_greedy"], exp["gen_nocache"])
    prompt, gen = exp["input_ids"][0].tolist(), exp["gen_greedy"][0].tolist()
    g = reference_generate(m, prompt, len(gen) - len(prompt), ExitPolicy.from_config(m.cfg, full_depth=True),
                           kv_layout=layout)
    assert prompt + g.token_ids == gen


@pytest.mark.parametrize("name", NANBEIGE)
def test_nanbeige_kv_slots_are_the_depth_indexed_layout(name):
    """The reference's cache slot loop * L + layer holds the K (after RoPE) and V that our core step
    loop + 1 writes at that layer: its per-loop KV is the depth-indexed layout."""
    m, exp = _load(name)
    ids = exp["input_ids"][:1]
    L, R = m.cfg.n_core, m.cfg.r_max
    seen, cur = {}, {"step": 0}

    def attend_for(stage, layer):
        def attend(q, k, v):
            seen[(cur["step"], layer)] = (k[0].transpose(0, 1), v[0].transpose(0, 1))  # [KVH, T, D]
            return causal_attend(q, k, v)
        return attend

    with torch.no_grad():
        rope = m.rope(torch.arange(ids.shape[1]))
        state, inj = m.prelude(ids, rope, attend_for)
        for s in range(R):
            cur["step"] = s
            state = m.core_step(state, inj, rope, attend_for)
    for s in range(R):
        for layer in range(L):
            k, v = seen[(s, layer)]
            assert (k - exp["prefill_keys"][s * L + layer]).abs().max() < TOL, (s, layer)
            assert (v - exp["prefill_values"][s * L + layer]).abs().max() < TOL, (s, layer)


def test_retro_olmo_is_told_apart_by_its_qk_norms(tmp_path):
    """The OLMo-2 retrofit's config.json is the Llama retrofit's; its q/k-norm tensors name it. Without
    them the folder reads as the Llama layout and its q/k norms are refused by name."""
    import shutil
    from safetensors.torch import save_file
    shutil.copy(FIX / "retro_olmo_a" / "config.json", tmp_path / "config.json")
    state = {k: v for k, v in load_file(FIX / "retro_olmo_a" / "model.safetensors").items() if "k_norm" not in k}
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="missing .* tensor"):
        load_pretrained(tmp_path)  # q_norm present -> raven_olmo, whose k_norm tensors are then missing
    state = {k: v for k, v in state.items() if "q_norm" not in k}
    save_file(state, str(tmp_path / "model.safetensors"))
    assert load_pretrained(tmp_path).cfg.family == "raven_llama"


@pytest.mark.parametrize("key,value", [("enable_hyper_connection", True), ("loop_share_kv", True),
                                       ("enable_depth_attention", True), ("skip_loop_final_norm", True),
                                       ("qk_layernorm", True), ("emb_neighbor_num", 2), ("rope_scaling", {"type": "linear", "factor": 2.0})])
def test_nanbeige_features_off_in_the_release_are_refused(tmp_path, key, value):
    import json
    import shutil
    for f in ("config.json", "model.safetensors"):
        shutil.copy(FIX / "nanbeige_b" / f, tmp_path / f)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg[key] = value
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=f"only {key}="):
        load_pretrained(tmp_path)

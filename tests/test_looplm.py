"""looplm: configs, checkpoint IO and its errors, and the full forward vs the stage functions."""
import json

import pytest
import torch

from looplm import ExitPolicy, LoopConfig, load_pretrained, preset_config, save_pretrained, tiny_model
from infer.engine.reference import reference_generate

ARCHS = ["ouro-tiny", "huginn-tiny"]


@pytest.mark.parametrize("name", ARCHS)
def test_config_roundtrip(name, tmp_path):
    cfg = preset_config(name)
    cfg.save(tmp_path / "config.json")
    assert LoopConfig.from_json(tmp_path / "config.json") == cfg


def test_real_config_formats():
    ouro = {"model_type": "ouro", "vocab_size": 49152, "hidden_size": 2048, "intermediate_size": 5632,
            "num_hidden_layers": 24, "num_attention_heads": 16, "num_key_value_heads": 16, "head_dim": 128,
            "hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": 1e6, "max_position_embeddings": 65536,
            "tie_word_embeddings": False, "total_ut_steps": 4, "early_exit_threshold": 1.0, "bos_token_id": 0,
            "eos_token_id": 0, "layer_types": ["full_attention"] * 24}
    c = LoopConfig.from_dict(ouro)
    assert (c.arch, c.n_core, c.r_max, c.exit_criterion, c.exit_threshold) == ("ouro", 24, 4, "ouro_gate", 1.0)
    assert c.to_dict()["layer_types"] == ouro["layer_types"]  # unknown keys survive a round trip
    huginn = {"model_type": "huginn_raven", "n_embd": 5280, "n_heads": 55, "num_key_value_heads": 55,
              "head_dim": 96, "intermediate_size": 17920, "vocab_size": 65536, "padded_vocab_size": 65536,
              "n_layers_in_prelude": 2, "n_layers_in_recurrent_block": 4, "n_layers_in_coda": 2,
              "injection_type": "linear", "mean_recurrence": 32, "norm_eps": 1e-6, "qk_bias": True, "bias": False,
              "tie_embeddings": True, "rope_base": 50000, "block_size": 4096,
              "init_values": {"embed_scale": 72.6636, "std": 0.0087039}}
    c = LoopConfig.from_dict(huginn)
    assert (c.head_dim, c.n_prelude, c.n_core, c.n_coda, c.r_max, c.embed_scale) == (96, 2, 4, 2, 32, 72.6636)


def test_config_errors(tmp_path):
    with pytest.raises(ValueError, match="unsupported model_type 'llama'.*huginn_raven.*ouro"):
        LoopConfig.from_dict({"model_type": "llama"})
    with pytest.raises(ValueError, match="missing required key 'num_attention_heads'"):
        LoopConfig.from_dict({"model_type": "ouro", "vocab_size": 8})
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="malformed JSON"):
        LoopConfig.from_json(tmp_path / "config.json")
    with pytest.raises(ValueError, match="num_kv_heads"):
        preset_config("ouro-tiny", num_kv_heads=3)


@pytest.mark.parametrize("name", ARCHS)
@pytest.mark.parametrize("shard", [None, 60_000])
def test_save_load_roundtrip(name, shard, tmp_path):
    m = tiny_model(name)
    save_pretrained(m, tmp_path, max_shard_bytes=shard)
    if shard:
        assert (tmp_path / "model.safetensors.index.json").exists()
    m2 = load_pretrained(tmp_path)
    ids = torch.randint(0, 256, (2, 7))
    assert torch.equal(m(ids).logits, m2(ids).logits)
    if m.cfg.tie_embeddings:
        assert m2.lm_head.weight is m2.transformer.wte.weight
    b = load_pretrained(tmp_path, dtype="bfloat16")
    assert b.lm_head.weight.dtype == torch.bfloat16


def _corrupt(tmp_path, edit):
    from safetensors.torch import load_file, save_file
    m = tiny_model("huginn-tiny")
    save_pretrained(m, tmp_path)
    sd = load_file(tmp_path / "model.safetensors")
    edit(sd)
    save_file(sd, tmp_path / "model.safetensors")


def test_missing_key_named(tmp_path):
    _corrupt(tmp_path, lambda sd: sd.pop("transformer.core_block.1.attn.qk_bias"))
    with pytest.raises(ValueError, match=r"missing .*transformer\.core_block\.1\.attn\.qk_bias"):
        load_pretrained(tmp_path)


def test_wrong_shape_named(tmp_path):
    def edit(sd):
        sd["transformer.adapter.weight"] = torch.zeros(64, 64)
    _corrupt(tmp_path, edit)
    with pytest.raises(ValueError, match=r"transformer\.adapter\.weight.*\(64, 64\).*\(64, 128\)"):
        load_pretrained(tmp_path)


def test_unknown_model_type_and_missing_folder(tmp_path):
    m = tiny_model("ouro-tiny")
    save_pretrained(m, tmp_path)
    d = json.loads((tmp_path / "config.json").read_text())
    d["model_type"] = "gpt2"
    (tmp_path / "config.json").write_text(json.dumps(d))
    with pytest.raises(ValueError, match="unsupported model_type 'gpt2'"):
        load_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError, match="not found"):
        load_pretrained(tmp_path / "nope")


@pytest.mark.parametrize("name", ARCHS)
@pytest.mark.parametrize("layout", ["full_depth", "last_exited", "shared"])
def test_full_depth_decode_matches_forward(name, layout):
    """Without exits, decoding through a depth-indexed layout reproduces the full causal forward.
    The shared layout does not (it reads earlier positions' final-depth K/V at every step)."""
    m = tiny_model(name, dtype=torch.float64, std=0.1)
    prompt = [5, 6, 7, 8, 9]
    g = reference_generate(m, prompt, 10, ExitPolicy.from_config(m.cfg, full_depth=True), kv_layout=layout)
    assert g.exit_depths == [m.cfg.r_max] * 10
    with torch.no_grad():
        logits = m(torch.tensor([prompt + g.token_ids[:-1]])).logits[0, len(prompt) - 1:]
    lp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(g.token_ids)[:, None])[:, 0]
    diff = (lp - torch.tensor(g.logprobs, dtype=torch.float64)).abs()
    if layout == "shared":
        assert diff[0] < 1e-10 and diff[1:].max() > 1e-6  # the first token is from the shared-free prefill
    else:
        assert diff.max() < 1e-10
        assert g.token_ids == logits.argmax(-1).tolist()


@pytest.mark.parametrize("name", ARCHS)
def test_forward_num_steps_and_gate(name):
    m = tiny_model(name)
    ids = torch.randint(0, 256, (2, 5))
    out = m(ids, num_steps=3, return_states=True)
    assert out.logits.shape == (2, 5, 256) and out.gate_logits.shape == (3, 2, 5) and len(out.states) == 3
    with pytest.raises(ValueError, match="num_steps"):
        m(ids, num_steps=0)

"""Huginn's layer-split override (`--layer-split P-C-Q`, looplm/layer_split.py): the first P prelude,
C core and Q coda layers of a checkpoint survive, renumbered in order, the rest are dropped; through
load_pretrained, the engine's loader (LLM, dummy weights, presets), infer.bench, infer.sim and infer.serve."""
import json

import pytest
import torch

from infer import LLM, SamplingParams
from infer.engine.llm import load_model
from infer.engine.reference import reference_generate
from looplm import ExitPolicy, ParamError, load_pretrained, paper_config, preset_config, save_pretrained, tiny_model
from looplm.layer_split import apply_layer_split, parse_layer_split, split_config

STACKS = ("prelude", "core_block", "coda")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A 2-2-2 Huginn checkpoint (huginn-tiny, random weights) and its state dict."""
    m = tiny_model("huginn-tiny", seed=3)
    out = save_pretrained(m, tmp_path_factory.mktemp("split") / "huginn")
    return out, {k: v.clone() for k, v in m.state_dict().items()}


def surviving(orig: dict, p: int, c: int, q: int) -> dict:
    keep = {"prelude": p, "core_block": c, "coda": q}
    out = {}
    for k, v in orig.items():
        parts = k.split(".")
        if parts[0] == "transformer" and parts[1] in keep and int(parts[2]) >= keep[parts[1]]:
            continue
        out[k] = v
    return out


@pytest.mark.parametrize("bad", ["0-4", "0-4-0-1", "a-4-0", "1-0-1", "-1-4-0", "1--4-1", "1.5-4-1", "", None, 2,
                                 (0, 0, 0), (True, 1, 1)])
def test_malformed_splits_fail_in_one_line_naming_the_parameter(bad):
    with pytest.raises(ParamError) as e:
        parse_layer_split(bad)
    assert e.value.param == "layer_split" and "\n" not in str(e.value) and "layer_split" in str(e.value)


def test_good_splits_parse():
    assert parse_layer_split("0-4-0") == (0, 4, 0)
    assert parse_layer_split(" 1-4-1 ") == (1, 4, 1)
    assert parse_layer_split((2, 4, 2)) == (2, 4, 2)


def test_ouro_and_counts_above_the_checkpoints_are_refused():
    with pytest.raises(ParamError, match="Huginn-only"):
        split_config(preset_config("ouro-tiny"), "0-2-0")
    cfg = preset_config("huginn-tiny")  # 2-2-2
    for bad, what in (("3-2-2", "prelude 3 > 2"), ("2-3-2", "core 3 > 2"), ("0-2-5", "coda 5 > 2")):
        with pytest.raises(ParamError, match="exceeds") as e:
            split_config(cfg, bad)
        assert what in str(e.value)
    assert split_config(cfg, "2-2-2") == cfg  # the checkpoint's own split changes nothing


@pytest.mark.parametrize("split", ["0-2-0", "1-2-1", "2-1-2", "0-1-1"])
def test_checkpoint_loads_with_exactly_the_surviving_weights(ckpt, split):
    folder, orig = ckpt
    p, c, q = parse_layer_split(split)
    m = load_pretrained(folder, layer_split=split)
    assert (m.cfg.n_prelude, m.cfg.n_core, m.cfg.n_coda) == (p, c, q)
    assert m.cfg.name == f"huginn {split} r_max=6"
    assert (len(m.transformer.prelude), len(m.transformer.core_block), len(m.transformer.coda)) == (p, c, q)
    want = surviving(orig, p, c, q)
    got = m.state_dict()
    assert set(got) == set(want)
    for k, v in want.items():
        assert torch.equal(got[k], v), k
    # the selection is the first layers of each stack: 1-2-1 runs prelude.0 and coda.0
    if split == "1-2-1":
        assert torch.equal(got["transformer.coda.0.attn.Wqkv.weight"], orig["transformer.coda.0.attn.Wqkv.weight"])
        assert not any(k.startswith(("transformer.coda.1.", "transformer.prelude.1.")) for k in got)
    # the unsplit load is unchanged
    assert load_pretrained(folder).cfg == preset_config("huginn-tiny")


def test_apply_layer_split_leaves_the_input_state_alone(ckpt):
    _, orig = ckpt
    state = dict(orig)
    cfg, out = apply_layer_split(preset_config("huginn-tiny"), state, "0-1-0")
    assert set(state) == set(orig) and (cfg.n_prelude, cfg.n_core, cfg.n_coda) == (0, 1, 0)
    assert not any(k.startswith(("transformer.prelude.", "transformer.coda.", "transformer.core_block.1."))
                   for k in out)
    assert out["transformer.adapter.weight"] is orig["transformer.adapter.weight"]


@pytest.mark.parametrize("split", ["0-2-0", "1-2-1"])
def test_engine_on_a_split_checkpoint_equals_the_reference(ckpt, split):
    folder, _ = ckpt
    llm = LLM(str(folder), dtype="float64", layer_split=split, policy="cdb", max_batch_size=4, kv_cache_tokens=256)
    assert llm.model.cfg.name.startswith(f"huginn {split} ")
    prompts = [[5, 6, 7], [9, 10, 11, 12, 13], [3]]
    outs = llm.generate(prompts, SamplingParams(max_tokens=6, ignore_eos=True))
    pol = ExitPolicy.from_config(llm.model.cfg)
    for o, pr in zip(outs, prompts):
        ref = reference_generate(llm.model, pr, 6, pol)
        assert o.token_ids == ref.token_ids and o.exit_depths == ref.exit_depths
    assert llm.engine.blocks.all_free


def test_dummy_paths_take_the_split_into_the_config(ckpt, tmp_path):
    # a paper shape (built on the meta device: the shapes without the memory)
    m, _ = load_model("huginn-3.5b", device="meta", layer_split="0-4-0")
    assert m.cfg == split_config(paper_config("huginn-3.5b"), "0-4-0") and len(m.transformer.prelude) == 0
    assert m.cfg.name == "huginn 0-4-0 r_max=16"
    with pytest.raises(ParamError, match="Huginn-only"):
        load_model("ouro-1.4b", device="meta", layer_split="0-24-0")
    # a config-only folder
    folder, _ = ckpt
    shape = tmp_path / "shape"
    shape.mkdir()
    (shape / "config.json").write_text((folder / "config.json").read_text())
    llm = LLM(str(shape), load_format="dummy", layer_split="1-1-1", kv_cache_tokens=256)
    assert (llm.model.cfg.n_prelude, llm.model.cfg.n_core, llm.model.cfg.n_coda) == (1, 1, 1)
    out = llm.generate([[4, 5, 6]], SamplingParams(max_tokens=3, ignore_eos=True))[0]
    assert len(out.token_ids) == 3


def test_presets_and_model_objects_split_their_weights():
    full = tiny_model("huginn-tiny")
    m, _ = load_model("huginn-tiny", layer_split="1-2-0")
    assert (m.cfg.n_prelude, m.cfg.n_core, m.cfg.n_coda) == (1, 2, 0)
    want = surviving(full.state_dict(), 1, 2, 0)
    assert set(m.state_dict()) == set(want)
    assert all(torch.equal(m.state_dict()[k], v) for k, v in want.items())
    m2, _ = load_model(tiny_model("huginn-tiny"), layer_split="1-2-0")
    assert all(torch.equal(m2.state_dict()[k], v) for k, v in want.items())
    with pytest.raises(ParamError, match="Huginn-only"):
        load_model("ouro-tiny", layer_split="0-1-0")


def test_sim_cli_accepts_the_split_and_its_json_shows_it(tmp_path):
    from infer.sim.__main__ import main
    main(["--model", "huginn-3.5b", "--layer-split", "0-4-0", "--workloads", "alpaca", "--num-requests", "8",
          "--ks", "1", "--host-json", "none", "--out", str(tmp_path)])
    (path,) = tmp_path.glob("sim_*.json")
    assert "split0-4-0" in path.name
    d = json.loads(path.read_text())
    assert d["config"] == "huginn 0-4-0 r_max=16" and d["layer_split"] == "0-4-0"
    assert d["workloads"][0]["results"]
    with pytest.raises(ParamError, match="Huginn-only"):
        main(["--model", "ouro-1.4b", "--layer-split", "0-4-0", "--workloads", "alpaca", "--num-requests", "8",
              "--out", str(tmp_path)])


def test_bench_cli_runs_the_split_model_and_names_it(ckpt, tmp_path):
    from infer.bench.offline import main
    folder, _ = ckpt
    main(["--model", str(folder), "--layer-split", "0-2-0", "--workloads", "alpaca", "--num-requests", "3",
          "--repeats", "1", "--ks", "1", "--no-norefill", "--no-full-depth", "--scale", "0.05",
          "--kv-cache-tokens", "512", "--out", str(tmp_path), "--save-trace"])
    (path,) = tmp_path.glob("bench_*.json")
    assert path.name == "bench_huginn_split0-2-0.json"
    d = json.loads(path.read_text())
    assert d["config"] == "huginn 0-2-0 r_max=6" and d["layers"] == [0, 2, 0] and d["layer_split"] == "0-2-0"
    assert json.loads((tmp_path / "trace_huginn_split0-2-0.json").read_text())["layer_split"] == "0-2-0"


def test_serve_loads_the_split_model(ckpt):
    from infer.serving.cli import make_server, parser
    folder, _ = ckpt
    server, sock = make_server(parser().parse_args(["--model", str(folder), "--port", "0", "--layer-split", "1-2-1",
                                                    "--kv-cache-tokens", "256"]))
    sock.close()
    cfg = server.config.app.state.aeng.engine.model.cfg
    assert (cfg.n_prelude, cfg.n_core, cfg.n_coda) == (1, 2, 1)
    from fastapi.testclient import TestClient
    (m,) = TestClient(server.config.app).get("/v1/models").json()["data"]
    assert m["layers"] == [1, 2, 1]  # /v1/models shows the split it serves

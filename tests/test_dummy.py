"""load_format="dummy" (vLLM's name): a checkpoint folder's shape, or a paper preset, with random
weights and no weights file read, through LLM and the bench, the server and the lm-eval model's
loaders (one `load_model`)."""
import json
from pathlib import Path

import pytest

from infer import LLM, SamplingParams
from infer.engine.llm import load_model
from looplm import PAPER_MODELS, ParamError, load_tokenizer, paper_config, save_pretrained, tiny_model

DEMO = Path(__file__).resolve().parents[1] / "checkpoints" / "ouro-demo"
VOCAB = json.loads((DEMO / "config.json").read_text())["vocab_size"]


@pytest.fixture(scope="module")
def shape_only(tmp_path_factory):
    """A checkpoint folder with config.json and a tokenizer but no weights file."""
    out = tmp_path_factory.mktemp("dummy") / "shape"
    save_pretrained(tiny_model("ouro-tiny", vocab_size=VOCAB, hidden_size=48), out, tokenizer=load_tokenizer(DEMO))
    for f in out.glob("*.safetensors*"):
        f.unlink()
    return out


def test_dummy_builds_a_folder_shape_without_its_weights(shape_only):
    with pytest.raises(Exception):
        load_model(str(shape_only))  # the real loader needs the weights
    llm = LLM(str(shape_only), load_format="dummy")
    assert llm.model.cfg.vocab_size == VOCAB and llm.model.cfg.hidden_size == 48 and llm.tokenizer is not None
    out = llm.generate("The history of", SamplingParams(max_tokens=4, ignore_eos=True))[0]
    assert len(out.token_ids) == 4 and len(out.exit_depths) == 4


def test_bad_load_format_names_itself(shape_only):
    with pytest.raises(ParamError) as e:
        LLM(str(shape_only), load_format="pt")
    assert e.value.param == "load_format"


def test_fewer_layer_presets_keep_the_structure():
    for name, base in (("ouro-1.4b-4l", "ouro-1.4b"), ("huginn-3.5b-1-1-1", "huginn-3.5b")):
        a, b = paper_config(name), paper_config(base)
        assert (a.hidden_size, a.num_heads, a.vocab_size, a.r_max, a.exit_criterion) == \
            (b.hidden_size, b.num_heads, b.vocab_size, b.r_max, b.exit_criterion)
        assert a.n_core < b.n_core or a.n_prelude < b.n_prelude
    assert set(PAPER_MODELS) >= {"ouro-1.4b", "huginn-3.5b", "ouro-1.4b-4l", "huginn-3.5b-1-1-1"}


@pytest.mark.slow
def test_ouro_1_4b_dummy_bf16_generates_on_a_cpu_with_defaults():
    llm = LLM("ouro-1.4b", load_format="dummy", dtype="bfloat16")
    c = llm.config
    assert c.max_model_len <= c.kv_cache_tokens < 4096  # the CPU pool, not the checkpoint's context
    out = llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=3, ignore_eos=True))[0]
    assert len(out.token_ids) == 3

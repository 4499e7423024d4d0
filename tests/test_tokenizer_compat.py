"""Checkpoints' tokenizers load in transformers 4.x (4.51 is what vLLM 0.8.5 pins) as well as 5.x
(issue 41). CI has transformers 5 only, so the 4.x reading is checked the way 4.51 reads the
folder: AutoTokenizer takes `tokenizer_class` by name (a class 4.x has), passes the config's keys as
keyword arguments (4.51 calls `.keys()` on `extra_special_tokens`: a list fails), and reads the
chat template inline; that tokenizer must give the ids the engine's tokenizer gives. (Checked once
in a real transformers 4.51.3 environment too: docs/results/serving.md.)"""
import json
from pathlib import Path

import pytest

from looplm import load_pretrained, load_tokenizer, save_pretrained

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = sorted(p.parent for p in (ROOT / "checkpoints").glob("*/tokenizer_config.json"))
TEXTS = ["The history of the city is long and the river", "hello world, the quick brown fox .",
         "<|im_start|>user\nHi<|im_end|>", "  spaces   and\ttabs\n\nnewlines", "ünïcödé — 数字 123", ""]
CLASSES_IN_4X = {"PreTrainedTokenizerFast", "GPT2TokenizerFast", "Qwen2TokenizerFast", "LlamaTokenizerFast"}


def as_transformers_4(folder: Path):
    """The tokenizer transformers 4.51's AutoTokenizer would build from `folder` (see module doc)."""
    from transformers import PreTrainedTokenizerFast

    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    assert cfg.get("tokenizer_class") in CLASSES_IN_4X, f"{folder.name}: class {cfg.get('tokenizer_class')!r}"
    extra = cfg.get("extra_special_tokens")
    assert extra is None or isinstance(extra, dict), f"{folder.name}: extra_special_tokens is a {type(extra).__name__}"
    template = folder / "chat_template.jinja"
    if template.exists():
        assert cfg.get("chat_template") == template.read_text(), f"{folder.name}: chat template not inline"
    keys = ("bos_token", "eos_token", "pad_token", "unk_token", "additional_special_tokens",
            "clean_up_tokenization_spaces", "chat_template")
    return PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"), **{k: cfg[k] for k in keys if k in cfg})


def same_tokenizer(a, b) -> None:
    assert [a.encode(t) for t in TEXTS] == [b.encode(t) for t in TEXTS]
    assert (a.eos_token, a.bos_token, a.pad_token) == (b.eos_token, b.bos_token, b.pad_token)
    assert sorted(a.all_special_tokens) == sorted(b.all_special_tokens)
    if b.chat_template:
        chat = [{"role": "user", "content": "Hi"}]
        assert a.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == \
            b.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)


@pytest.mark.parametrize("folder", SHIPPED, ids=[p.name for p in SHIPPED])
def test_shipped_tokenizers_load_as_transformers_4_reads_them(folder):
    same_tokenizer(as_transformers_4(folder), load_tokenizer(folder))


def test_save_pretrained_writes_a_tokenizer_both_versions_load(tmp_path):
    src = ROOT / "checkpoints" / "ouro-demo"
    tok = load_tokenizer(src)
    save_pretrained(load_pretrained(src), tmp_path / "out", tokenizer=tok)
    same_tokenizer(as_transformers_4(tmp_path / "out"), tok)
    same_tokenizer(load_tokenizer(tmp_path / "out"), tok)

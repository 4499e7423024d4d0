"""Byte-level BPE tokenizer trained on the corpus, saved as a transformers-loadable folder.

    python -m train.tokenizer --corpus .cache/corpus --out .cache/tokenizer --vocab-size 2048

Ids 0, 1, 2 are <|endoftext|> (bos = eos = pad), <|im_start|>, <|im_end|>.
"""
from __future__ import annotations

import argparse
import hashlib
import json
from collections.abc import Iterable
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from looplm.io import portable_tokenizer_config
from train.data import read_documents

EOS = "<|endoftext|>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [EOS, IM_START, IM_END]  # order fixes ids 0, 1, 2
MAX_VOCAB = 4096
# ChatML: <|im_start|>role\ncontent<|im_end|>\n per message.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def train_bpe(texts: Iterable[str], vocab_size: int = 2048) -> Tokenizer:
    """Byte-level BPE (GPT-2 style pre-tokenisation, so decode(encode(x)) == x for any text)."""
    if not len(SPECIAL_TOKENS) + 256 < vocab_size <= MAX_VOCAB:
        raise ValueError(f"vocab_size must be in ({len(SPECIAL_TOKENS) + 256}, {MAX_VOCAB}]")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=2, special_tokens=SPECIAL_TOKENS,
        # all 256 bytes up front, so unseen characters still encode (no <unk> needed)
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    return tok


def save_tokenizer(tok: Tokenizer, out: Path) -> None:
    """Write tokenizer.json + tokenizer_config.json + special_tokens_map.json (+ chat template)."""
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=EOS, eos_token=EOS, pad_token=EOS, unk_token=None,
        additional_special_tokens=[IM_START, IM_END],
        # transformers' default clean-up would turn " ." into "." and break round trips
        clean_up_tokenization_spaces=False)
    fast.chat_template = CHAT_TEMPLATE
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out))
    portable_tokenizer_config(out)  # (transformers 5's own spelling does not load in 4.x)
    (out / "special_tokens_map.json").write_text(json.dumps({
        "bos_token": EOS, "eos_token": EOS, "pad_token": EOS,
        "additional_special_tokens": [IM_START, IM_END]}, indent=2) + "\n")


def encode_corpus(tokenizer_dir: Path, text_file: Path) -> np.ndarray:
    """Token ids of every document in `text_file`, each followed by <|endoftext|>, as int64.

    Cached as `<stem>.tok-<hash>.npy` (uint16) next to the text file; the hash covers both the
    tokenizer and the text, so a retrained tokenizer or rebuilt corpus is never served stale.
    """
    tokenizer_dir, text_file = Path(tokenizer_dir), Path(text_file)
    tok_bytes = (tokenizer_dir / "tokenizer.json").read_bytes()
    key = hashlib.sha256(tok_bytes + text_file.read_bytes()).hexdigest()[:12]
    cache = text_file.with_name(f"{text_file.stem}.tok-{key}.npy")
    if cache.exists():
        return np.load(cache).astype(np.int64)
    tok = Tokenizer.from_str(tok_bytes.decode("utf-8"))
    eos = tok.token_to_id(EOS)
    ids: list[int] = []
    for enc in tok.encode_batch(read_documents(text_file), add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(eos)
    for stale in text_file.parent.glob(f"{text_file.stem}.tok-*.npy"):
        stale.unlink()
    arr = np.asarray(ids, dtype=np.uint16)  # vocab <= 4096 fits; halves the file vs int32
    np.save(cache, arr)
    return arr.astype(np.int64)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--corpus", type=Path, required=True, help="directory with train.txt")
    p.add_argument("--out", type=Path, required=True, help="output tokenizer directory")
    p.add_argument("--vocab-size", type=int, default=2048, help=f"at most {MAX_VOCAB}")
    a = p.parse_args(argv)
    tok = train_bpe(read_documents(a.corpus / "train.txt"), a.vocab_size)
    save_tokenizer(tok, a.out)
    print(f"saved {a.out} (vocab {tok.get_vocab_size()})")
    # Encoding here also fills the .npy caches that training and evaluation read.
    for name in ("train.txt", "heldout.txt", "heldout_synthetic.txt"):
        if (a.corpus / name).exists():
            print(f"{name}: {len(encode_corpus(a.out, a.corpus / name))} tokens")


if __name__ == "__main__":
    from train.cli import run
    run(main)

"""The ids a checkpoint's tokenizer gives on a fixed text set, as JSON, to compare transformers
versions (issue 41): run it under each and diff the outputs (docs/results/serving.md). Only
transformers is imported, so it runs in a bare venv with transformers 4.x and jinja2:

    python -m scripts.tokenizer_ids checkpoints/*  >  ids-5.json
    /path/to/venv-4.51/bin/python scripts/tokenizer_ids.py checkpoints/*  >  ids-4.json
"""
import json
import sys

TEXTS = ["The history of the city is long and the river", "hello world, the quick brown fox .",
         "<|im_start|>user\nHi<|im_end|>", "  spaces   and\ttabs\n\nnewlines", "ünïcödé — 数字 123", ""]


def describe(folder: str) -> dict | str:
    from transformers import AutoTokenizer

    try:
        t = AutoTokenizer.from_pretrained(folder)
    except Exception as e:  # noqa: BLE001 - what a user of that version would see is the result
        return f"{type(e).__name__}: {str(e).splitlines()[0]}"
    chat = [{"role": "user", "content": "Hi"}]
    return {"ids": [t.encode(x) for x in TEXTS], "special": [t.eos_token, t.bos_token, t.pad_token,
                                                             sorted(t.all_special_tokens)],
            "chat": t.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) if t.chat_template else None}


def main() -> None:
    import transformers

    print(json.dumps({"transformers": transformers.__version__, **{f: describe(f) for f in sys.argv[1:]}}))


if __name__ == "__main__":
    main()

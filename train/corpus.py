"""Build the default corpus and tokenizer in one command (what the train scripts read by default):

    python -m train.corpus          # = python -m train.data --out .cache/corpus
                                    #   + python -m train.tokenizer --corpus .cache/corpus --out .cache/tokenizer
"""
from __future__ import annotations

import argparse
from pathlib import Path

from train.common import CORPUS, TOKENIZER


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--corpus", type=Path, default=CORPUS)
    p.add_argument("--tokenizer", type=Path, default=TOKENIZER)
    p.add_argument("--debug", action="store_true")
    a = p.parse_args(argv)
    from train import data, tokenizer
    if not (a.corpus / "train.txt").exists():
        data.main(["--out", str(a.corpus)])
    tokenizer.main(["--corpus", str(a.corpus), "--out", str(a.tokenizer)])


if __name__ == "__main__":
    from train.cli import run
    run(main)

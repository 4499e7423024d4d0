"""Build the local lm-eval tasks' data (eval/tasks/data/*.jsonl) from held-out text.

    python -m scripts.build_eval_tasks [--corpus .cache/corpus] [--out eval/tasks/data]

Inputs are the corpus builder's held-out files (`python -m train.data --out .cache/corpus`):
heldout.txt (documents the demo models never trained on, one paragraph per line) and
heldout_synthetic.jsonl (held-out reasoning problems). Output is small, deterministic and
committed, so CI and users need neither the corpus nor a network.

Lengths are capped in words/characters, not tokens, so the files do not depend on a tokenizer:
the demo tokenizer spends ~2.1 tokens per English word (~1.2 characters per token on the
synthetic problems) and the demo models have a 128-token context.
"""
from __future__ import annotations

import argparse
import json
import random
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC_SEP = "\n\n"  # train/data.py's document separator
SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z\"'(])")
WORD = re.compile(r"^[A-Za-z][a-z]+$")


def read_paragraphs(path: Path) -> list[tuple[int, str]]:
    """(document index, paragraph) for every paragraph of >= 12 words (headings are shorter)."""
    docs = [d for d in path.read_text(encoding="utf-8").strip("\n").split(DOC_SEP) if d]
    return [(i, p.strip()) for i, d in enumerate(docs) for p in d.split("\n") if len(p.split()) >= 12]


def sentences(paragraph: str) -> list[str]:
    return [s for s in SENTENCE_END.split(paragraph) if s]


def chunk(paragraph: str, max_words: int) -> list[str]:
    """Consecutive sentences packed into pieces of at most max_words words (a longer sentence
    is its own piece)."""
    out, cur = [], []
    for s in sentences(paragraph):
        if cur and len(" ".join(cur + [s]).split()) > max_words:
            out.append(" ".join(cur))
            cur = []
        cur.append(s)
    if cur:
        out.append(" ".join(cur))
    return out


def ppl_items(paras, rng, n: int, min_words: int = 20, max_words: int = 55) -> list[dict]:
    """Rolling perplexity: whole paragraph pieces (most fit one 128-token window)."""
    pieces = [p for _, para in paras for p in chunk(para, max_words) if min_words <= len(p.split()) <= max_words]
    rng.shuffle(pieces)
    return [{"text": p} for p in pieces[:n]]


def cloze_items(paras, rng, n: int, ctx_words: int = 30, cont_words: int = 5, n_choices: int = 4) -> list[dict]:
    """Multiple choice: a paragraph's first words, then the true next `cont_words` words among
    distractors of the same length taken from other documents (continuations are several tokens,
    so all but the first are decoded with the adaptive exit policy)."""
    cands = [(d, p.split()) for d, p in paras if len(p.split()) >= ctx_words + cont_words]
    items = []
    for d, words in rng.sample(cands, min(n, len(cands))):
        cut = rng.randint(ctx_words // 2, ctx_words)
        others = [w for dd, w in cands if dd != d]
        choices = [" ".join(words[cut:cut + cont_words])]
        while len(choices) < n_choices:
            w = rng.choice(others)
            s = rng.randint(cont_words, len(w) - cont_words)
            c = " ".join(w[s:s + cont_words])
            if c not in choices:
                choices.append(c)
        gold = rng.randrange(n_choices)
        choices[0], choices[gold] = choices[gold], choices[0]
        items.append({"context": " ".join(words[:cut]), "choices": choices, "gold": gold})
    return items


def lastword_items(paras, rng, n: int, max_ctx_words: int = 45) -> list[dict]:
    """Generation, exact match (LAMBADA-like): the sentence-final word, which also occurs earlier
    in the context. Prefers words of >= 6 letters (several tokens for a small BPE)."""
    items = []
    for _, para in paras:
        words = para.split()
        for end in range(len(words)):
            target = words[end].rstrip(".!?\"')")
            if not (words[end][-1:] in ".!?" and WORD.match(target) and len(target) >= 6):
                continue
            context = words[max(0, end - max_ctx_words):end]
            if len(context) >= 12 and target in {w.strip(".,;:!?\"'()") for w in context}:
                items.append({"context": " ".join(context), "target": target})
    rng.shuffle(items)
    return items[:n]


def reasoning_items(problems: list[dict], rng, n: int, shots: int = 2, max_chars: int = 150) -> list[dict]:
    """Generation, exact match: held-out synthetic problems, with up to `shots` solved held-out
    problems before them (one per line, as in training), within `max_chars`."""
    def line(p):
        return p["prompt"] + ("" if p["prompt"].endswith("=") else " ") + p["answer"]
    items = []
    for i in rng.sample(range(len(problems)), min(n, len(problems))):
        p = problems[i]
        ctx = []
        for j in rng.sample([j for j in range(len(problems)) if j != i], shots):
            if len("\n".join(ctx + [line(problems[j]), p["prompt"]])) <= max_chars:
                ctx.append(line(problems[j]))
        items.append({"prompt": "\n".join(ctx + [p["prompt"]]), "answer": p["answer"], "kind": p["kind"],
                      "sep": "" if p["prompt"].endswith("=") else " "})
    return items


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")


def build(corpus: Path, out: Path, seed: int = 0, n: int = 200) -> dict[str, int]:
    heldout, synthetic = corpus / "heldout.txt", corpus / "heldout_synthetic.jsonl"
    for f in (heldout, synthetic):
        if not f.exists():
            raise FileNotFoundError(f"{f} is missing: build the corpus first (python -m train.data --out {corpus})")
    paras = read_paragraphs(heldout)
    problems = [json.loads(ln) for ln in synthetic.read_text(encoding="utf-8").splitlines() if ln.strip()]
    out.mkdir(parents=True, exist_ok=True)
    tasks = {"ppl": ppl_items(paras, random.Random(f"{seed}:ppl"), n),
             "cloze": cloze_items(paras, random.Random(f"{seed}:cloze"), n),
             "lastword": lastword_items(paras, random.Random(f"{seed}:lastword"), n),
             "reasoning": reasoning_items(problems, random.Random(f"{seed}:reasoning"), n)}
    for name, rows in tasks.items():
        write_jsonl(out / f"{name}.jsonl", rows)
    return {k: len(v) for k, v in tasks.items()}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--corpus", type=Path, default=ROOT / ".cache" / "corpus", help="held-out corpus folder")
    p.add_argument("--out", type=Path, default=ROOT / "eval" / "tasks" / "data")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--n", type=int, default=200, help="items per task (at most)")
    a = p.parse_args(argv)
    print(json.dumps(build(a.corpus, a.out, a.seed, a.n)))


if __name__ == "__main__":
    main()

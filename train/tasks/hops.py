"""Variable chasing: k-hop pointer chains whose answer mixes easy (copied) and hard (k-hop) tokens.

    python -m train.tasks.hops --seed 7 --n 512 --out .cache/lab/heldout.jsonl [--min-hops 1 --max-hops 4]

A record of difficulty k holds `--chains` (3) chains of assignments, one of exactly k hops and the
others of 1..k hops. A chain of h hops is `v1=D; v2=v1; ...; vh=v(h-1)` (D a digit, v* distinct
letters); all statements of all chains are shuffled into the prompt, which ends with a query of
the chains' last variables in random order:

    prompt  "k=n;n=4;w=7;p=2;e=p;?k,w,e:"
    answer  "k=4,w=7,e=2."

The answer copies each queried name and writes `=`, `,` and `.` (difficulty 0: a copy or fixed
format, depth 1 suffices), and each value, whose difficulty is its hop count h: reading it needs
h dependent look-ups (find the statement that defines the current name, read its right-hand side).

Why looping is necessary: a look-up is one attention step (the position predicting a value
attends to the statement defining the current name and reads its right-hand side, bound to that
statement's left-hand side by an earlier layer), and look-up i+1 needs the result of look-up i,
so a causal transformer resolves at most a bounded number of hops per layer; with the statements
shuffled no positional shortcut exists, and the distractor chains make a guess right with
probability ~1/3. A depth-1 pass of the lab model's 2-layer core has room for about one hop;
k hops need about k layers, i.e. ceil(k / 2)+ loops of the 2-layer block.

`difficulty` is the record's hardest value (k); `hops` the hop count of each queried value in
answer order; `token_difficulty` one int per answer character (0 easy, h for a value).
"""
from __future__ import annotations

import argparse
import json
import string
from pathlib import Path

import numpy as np

NAMES = string.ascii_lowercase
DIGITS = string.digits
ALPHABET = NAMES + DIGITS + "=;,?:."  # every character a prompt or answer can hold


def make_record(rng: np.random.Generator, k: int, chains: int = 3) -> dict:
    """One record of difficulty k (its hardest value needs exactly k hops)."""
    lengths = [k] + [int(rng.integers(1, k + 1)) for _ in range(chains - 1)]
    names = [NAMES[i] for i in rng.permutation(len(NAMES))[: sum(lengths)]]
    roots = [DIGITS[i] for i in rng.permutation(len(DIGITS))[:chains]]
    stmts, ends = [], []
    pos = 0
    for c, h in enumerate(lengths):
        vs = names[pos:pos + h]
        pos += h
        stmts.append(f"{vs[0]}={roots[c]}")
        stmts += [f"{vs[j]}={vs[j - 1]}" for j in range(1, h)]
        ends.append((vs[-1], roots[c], h))
    stmts = [stmts[i] for i in rng.permutation(len(stmts))]
    ends = [ends[i] for i in rng.permutation(chains)]
    prompt = ";".join(stmts) + ";?" + ",".join(e[0] for e in ends) + ":"
    answer, tok_diff = "", []
    for i, (name, val, h) in enumerate(ends):
        answer += f"{name}={val}" + ("," if i < chains - 1 else ".")
        tok_diff += [0, 0, h, 0]
    return {"prompt": prompt, "answer": answer, "difficulty": k, "hops": [e[2] for e in ends],
            "token_difficulty": tok_diff}


def generate(seed: int | list[int], n: int, min_hops: int = 1, max_hops: int = 4, chains: int = 3) -> list[dict]:
    """n records, difficulty cycling min_hops..max_hops (balanced levels), all drawn from `seed`."""
    if not 1 <= min_hops <= max_hops or max_hops * chains > len(NAMES):
        raise ValueError(f"need 1 <= min_hops <= max_hops and max_hops * chains <= {len(NAMES)}")
    rng = np.random.default_rng(seed)
    levels = list(range(min_hops, max_hops + 1))
    return [make_record(rng, levels[i % len(levels)], chains) for i in range(n)]


def add_generator_args(p: argparse.ArgumentParser) -> None:
    """The generator's flags (--seed, --n, --out, --min-hops, --max-hops, --chains), shared by the
    commands that write its records (this one, train.lab tokens / rows)."""
    p.add_argument("--seed", type=int, required=True)
    p.add_argument("--n", type=int, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--min-hops", type=int, default=1)
    p.add_argument("--max-hops", type=int, default=4)
    p.add_argument("--chains", type=int, default=3)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_generator_args(p)
    a = p.parse_args(argv)
    recs = generate(a.seed, a.n, a.min_hops, a.max_hops, a.chains)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text("".join(json.dumps(r) + "\n" for r in recs))
    print(f"wrote {a.out}: {len(recs)} records, difficulty {a.min_hops}..{a.max_hops}")


if __name__ == "__main__":
    main()

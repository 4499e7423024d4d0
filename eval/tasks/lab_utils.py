"""Loaders for the lab's k-hop variable-chasing tasks (`lab_hops*.yaml`): held-out records of
`python -m train.tasks.hops --seed 7 --n 400 --out eval/tasks/data/lab_hops.jsonl` (a seed the lab
checkpoint's training never used), all of them or one difficulty level."""
from __future__ import annotations

import json
from pathlib import Path

DATA = Path(__file__).resolve().parent / "data" / "lab_hops.jsonl"


def _load(level: int | None = None) -> dict:
    import datasets

    rows = [json.loads(ln) for ln in DATA.read_text(encoding="utf-8").splitlines() if ln]
    rows = [r for r in rows if level is None or r["difficulty"] == level]
    return {"test": datasets.Dataset.from_list(rows)}


def hops(**_) -> dict:
    return _load()


def hops_1(**_) -> dict:
    return _load(1)


def hops_2(**_) -> dict:
    return _load(2)


def hops_3(**_) -> dict:
    return _load(3)


def hops_4(**_) -> dict:
    return _load(4)

"""Loaders for the local tasks (YAML `custom_dataset: !function utils.<name>`): the data files sit
next to this module, so the tasks load from any working directory, offline."""
from __future__ import annotations

import json
from pathlib import Path

DATA = Path(__file__).resolve().parent / "data"


def _load(name: str) -> dict:
    import datasets

    rows = [json.loads(ln) for ln in (DATA / f"{name}.jsonl").read_text(encoding="utf-8").splitlines() if ln]
    return {"test": datasets.Dataset.from_list(rows)}


def ppl(**_) -> dict:
    return _load("ppl")


def cloze(**_) -> dict:
    return _load("cloze")


def lastword(**_) -> dict:
    return _load("lastword")


def reasoning(**_) -> dict:
    return _load("reasoning")

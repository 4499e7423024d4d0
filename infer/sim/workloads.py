"""Benchmark workloads: Alpaca, ShareGPT and arXiv-summarization request lists from real length
traces (infer/sim/data, see its SOURCES.md). Pure Python (no torch).

A request is (prompt token ids, output length). Rows are sampled from the trace by seed; `scale`
shrinks both lengths proportionally (CPU runs), and a request that still does not fit the model's
context is shrunk proportionally until prompt + output <= context. Prompt ids are real text of the
right length in the model's own tokens when a tokenizer is given (windows of a pool of Alpaca or
ShareGPT prompt texts), else random ids.
"""
from __future__ import annotations

import csv
import json
import random
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

DATA = Path(__file__).resolve().parent / "data"
TRACES = {"alpaca": "alpaca.csv", "sharegpt": "sharegpt.csv", "arxiv": "arxiv_summarization.csv"}
TEXTS = {"alpaca": "alpaca_text.jsonl", "sharegpt": "sharegpt_text.jsonl", "arxiv": "sharegpt_text.jsonl"}
WORKLOADS = tuple(TRACES)
FIRST_ID = 3  # random prompts avoid the low ids (special tokens of our tokenizer: 0, 1, 2)


@dataclass(frozen=True)
class Request:
    prompt_ids: list[int]
    output_len: int
    trace_prompt_len: int  # the trace's lengths, before scaling and clamping
    trace_output_len: int

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)


@lru_cache(maxsize=None)
def load_trace(workload: str) -> tuple[tuple[int, int], ...]:
    """(prompt_tokens, output_tokens) rows of a workload's trace (or of a CSV file with those
    columns), in file order."""
    if workload in TRACES:
        path = DATA / TRACES[workload]
    elif Path(workload).is_file():
        path = Path(workload)
    else:
        raise ValueError(f"unknown workload {workload!r}; available: {WORKLOADS} or a CSV path")
    with open(path, newline="") as f:
        rows = csv.DictReader(f)
        if not {"prompt_tokens", "output_tokens"} <= set(rows.fieldnames or ()):
            raise ValueError(f"{path}: a length trace needs the columns prompt_tokens and output_tokens, found "
                             f"{rows.fieldnames}")
        return tuple((int(r["prompt_tokens"]), int(r["output_tokens"])) for r in rows)


def fit_scale(workload: str, max_model_len: int, quantile: float = 0.9) -> float:
    """The largest scale <= 1 at which the trace's `quantile` request (by prompt + output) fits the
    context: what `scale="auto"` uses."""
    tot = sorted(p + o for p, o in load_trace(workload))
    q = tot[min(len(tot) - 1, int(quantile * len(tot)))]
    return min(1.0, max_model_len / q)


def scaled_lengths(p: int, o: int, scale: float, max_model_len: int) -> tuple[int, int, bool]:
    """Scale a (prompt, output) pair, clamp to >= 1 each, then shrink proportionally to fit the
    context (prompt + output <= max_model_len). Returns (prompt, output, clamped)."""
    p2, o2 = max(1, round(p * scale)), max(1, round(o * scale))
    if p2 + o2 <= max_model_len:
        return p2, o2, False
    f = max_model_len / (p2 + o2)
    p3, o3 = max(1, int(p2 * f)), max(1, int(o2 * f))
    while p3 + o3 > max_model_len:  # rounding of tiny contexts
        if p3 >= o3:
            p3 -= 1
        else:
            o3 -= 1
    return p3, o3, True


@lru_cache(maxsize=8)
def _text_pool(workload: str, tokenizer) -> tuple[list[int], list[int]]:
    """The workload's texts encoded back to back: (token ids, start offset of every text)."""
    ids: list[int] = []
    starts: list[int] = []
    sep = tokenizer.encode("\n\n")
    for line in open(DATA / TEXTS[workload]):
        d = json.loads(line)
        text = d["prompt"] + ("\n" + d["output"] if d.get("output") else "")
        starts.append(len(ids))
        ids += tokenizer.encode(text) + sep
    return ids, starts


def make_requests(workload: str, num_requests: int, *, seed: int = 0, scale: float | str = 1.0,
                  max_model_len: int = 2048, vocab_size: int = 256, tokenizer=None) -> list[Request]:
    """`num_requests` requests drawn (without replacement, by seed) from the workload's trace.
    `scale="auto"` picks `fit_scale(workload, max_model_len)`."""
    rows = load_trace(workload)
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    s = fit_scale(workload, max_model_len) if scale == "auto" else float(scale)
    if not 0 < s <= 1:
        raise ValueError(f"scale must be in (0, 1] or 'auto', got {scale!r}")
    rng = random.Random(f"{workload}:{seed}")
    idx = rng.sample(range(len(rows)), num_requests) if num_requests <= len(rows) else \
        [rng.randrange(len(rows)) for _ in range(num_requests)]
    # real text for the named workloads; a CSV of lengths has no texts: random ids
    pool, starts = _text_pool(workload, tokenizer) if tokenizer is not None and workload in TEXTS else (None, None)
    out = []
    for i in idx:
        p, o = rows[i]
        pl, ol, _ = scaled_lengths(p, o, s, max_model_len)
        if pool is not None:
            at = starts[rng.randrange(len(starts))]  # a window starting at a text's beginning
            ids = (pool[at:] + pool)[:pl] if at + pl > len(pool) else pool[at:at + pl]
            ids = (ids * (pl // max(1, len(ids)) + 1))[:pl]  # a pool shorter than the prompt repeats
        else:
            ids = [rng.randrange(FIRST_ID, vocab_size) for _ in range(pl)]
        out.append(Request(ids, ol, p, o))
    return out


def describe(requests: list[Request], workload: str, scale: float | str, max_model_len: int) -> dict:
    """Summary of a request list (goes into the benchmark JSON)."""
    n = len(requests)
    s = fit_scale(workload, max_model_len) if scale == "auto" else float(scale)
    clamped = sum(scaled_lengths(r.trace_prompt_len, r.trace_output_len, s, max_model_len)[2] for r in requests)
    return {"workload": workload, "num_requests": n, "scale": round(s, 6), "scale_arg": scale,
            "max_model_len": max_model_len, "clamped_to_context": clamped,
            "mean_prompt_len": sum(r.prompt_len for r in requests) / n,
            "mean_output_len": sum(r.output_len for r in requests) / n,
            "trace_mean_prompt_len": sum(r.trace_prompt_len for r in requests) / n,
            "trace_mean_output_len": sum(r.trace_output_len for r in requests) / n,
            "prompt_tokens": sum(r.prompt_len for r in requests),
            "output_tokens": sum(r.output_len for r in requests)}


def mean_decode_context(requests: list[Request]) -> float:
    """Mean context length (tokens attended) over the decode tokens of a request list: token k of
    a request (k >= 2; the first comes from the prefill) attends prompt + k - 1 positions."""
    num = den = 0
    for r in requests:
        n = r.output_len - 1
        if n > 0:
            num += n * r.prompt_len + n * (n + 1) / 2  # sum over k = 2..o of (p + k - 1)
            den += n
    return num / den if den else float(requests[0].prompt_len if requests else 0)

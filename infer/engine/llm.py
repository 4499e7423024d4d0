"""`LLM`: the offline entry point (vLLM-style)."""
from __future__ import annotations

from pathlib import Path
from typing import Sequence as Seq

import torch

from looplm import PRESETS, load_pretrained, load_tokenizer, tiny_model
from looplm.io import resolve_dtype
from looplm.model import LoopedLM

from .engine import EngineConfig, LLMEngine, RequestOutput
from .sampling import SamplingParams


def load_model(model: str | Path | LoopedLM, dtype="float32", device="cpu", r_max: int | None = None):
    """A checkpoint folder / hub id, a preset name (random weights: tests and demos), or a model."""
    if isinstance(model, LoopedLM):
        return model.to(device=device, dtype=resolve_dtype(dtype)).eval(), None
    if isinstance(model, str) and model in PRESETS:
        kw = {} if r_max is None else {"r_max": r_max}
        return tiny_model(model, dtype=resolve_dtype(dtype), **kw).to(device), None
    kw = {} if r_max is None else {"r_max": r_max}
    m = load_pretrained(model, dtype=dtype, device=device, **kw)
    return m, load_tokenizer(Path(model)) if Path(model).is_dir() else None


class LLM:
    def __init__(self, model: str | Path | LoopedLM, policy: str = "cdb", refill: bool = True,
                 min_coda_batch: int = 1, kv_layout: str = "last_exited", max_batch_size: int = 64,
                 exit_threshold: float | None = None, r_min: int | None = None, lookahead: bool = False,
                 dtype: str = "float32", device: str = "cpu", r_max: int | None = None,
                 exit_criterion: str | None = None, full_depth: bool = False, tokenizer=None, **engine_kw):
        m, tok = load_model(model, dtype, device, r_max)
        self.model, self.tokenizer = m, tokenizer if tokenizer is not None else tok
        cfg = EngineConfig(policy=policy, refill=refill, min_coda_batch=min_coda_batch, kv_layout=kv_layout,
                           max_batch_size=max_batch_size, exit_threshold=exit_threshold, r_min=r_min,
                           lookahead=lookahead, exit_criterion=exit_criterion, full_depth=full_depth, **engine_kw)
        self.engine = LLMEngine(m, cfg, self.tokenizer)

    def generate(self, prompts: str | list[int] | Seq[str | list[int]],
                 params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool | None = None) -> list[RequestOutput]:
        """Generate for every prompt (a string or a list of token ids); outputs in input order.
        Every request is validated before any runs: a bad one raises ValueError naming its index."""
        single = isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int))
        plist = [prompts] if single else list(prompts)
        ps = list(params) if isinstance(params, (list, tuple)) else [params or SamplingParams()] * len(plist)
        if len(ps) != len(plist):
            raise ValueError(f"{len(ps)} SamplingParams for {len(plist)} prompts")
        eng = self.engine
        seqs = []
        try:
            for i, (p, sp) in enumerate(zip(plist, ps)):
                try:
                    seqs.append(eng.add_request(p, sp))
                except ValueError as e:
                    raise ValueError(f"prompt {i}: {e}") from None
        except ValueError:
            for s in seqs:  # nothing is left half-queued
                eng.abort(s.request_id)
                eng.release(s.request_id)
            raise
        show = use_tqdm if use_tqdm is not None else len(plist) >= 32
        bar = None
        if show:
            from tqdm.auto import tqdm
            bar = tqdm(total=len(seqs), desc="generate", unit="req")
        done = 0
        with torch.inference_mode():
            while any(not s.finished for s in seqs):
                eng.step()
                if bar is not None:
                    n = sum(s.finished for s in seqs)
                    bar.update(n - done)
                    done = n
        if bar is not None:
            bar.close()
        outs = [eng.output(s) for s in seqs]
        for s in seqs:
            eng.release(s.request_id)
        return outs

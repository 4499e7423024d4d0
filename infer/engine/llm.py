"""`LLM`: the offline entry point (vLLM-style), and `load_model` for every way to name a model."""
from __future__ import annotations

from pathlib import Path
from typing import Sequence as Seq

import torch

from looplm import PAPER_MODELS, PRESETS, LoopConfig, dummy_model, load_pretrained, load_tokenizer, paper_config, \
    tiny_model
from looplm.config import replace
from looplm.errors import ParamError
from looplm.io import model_from_state, read_config, resolve_dtype, resolve_path
from looplm.layer_split import apply_layer_split, split_config
from looplm.model import LoopedLM

from .config import EngineConfig
from .llm_engine import LLMEngine, RequestOutput
from .progress import progress
from .sampling_params import SamplingParams


LOAD_FORMATS = ("auto", "dummy")


def add_load_args(parser, group=None) -> None:
    """`load_model`'s --load-format and --layer-split on a command line (the bench's, the server's):
    one help text for both."""
    g = group or parser
    g.add_argument("--load-format", choices=LOAD_FORMATS, default="auto",
                   help="dummy: the folder's config.json (or a paper preset) with random weights, no weights file "
                        "read (vLLM's --load-format dummy)")
    g.add_argument("--layer-split", default=None, metavar="P-C-Q",
                   help="Huginn only: keep the first P prelude, C core and Q coda layers (e.g. 0-4-0 or 1-4-1 of "
                        "Huginn-3.5B's 2-4-2, the paper's layer-split ablation): the text is meaningless, the cost "
                        "structure is what changes")


def load_model(model: str | Path | LoopedLM, dtype="float32", device="cpu", r_max: int | None = None,
               load_format: str = "auto", layer_split: str | None = None):
    """`_load`, with the weights frozen (vLLM's loaders do the same): the engine never trains, and a
    weight that requires grad makes every op on it record autograd (graphs.py; a LoopedLM handed in
    is frozen in place: the engine owns it from then on)."""
    m, tok = _load(model, dtype, device, r_max, load_format, layer_split)
    return m.requires_grad_(False), tok


def _load(model: str | Path | LoopedLM, dtype, device, r_max: int | None, load_format: str, layer_split: str | None):
    """(model, tokenizer or None) from a checkpoint folder / hub id, a tiny preset name (random
    weights: tests and demos), one of the paper's model shapes ("ouro-1.4b", "huginn-3.5b" and their
    fewer-layer variants: random weights), or a LoopedLM. `load_format="dummy"` (vLLM's name): a
    folder's config.json (and tokenizer) with random weights; its weights file is never read.
    `layer_split="P-C-Q"` (Huginn only, looplm/layer_split.py): keep the first P prelude, C core and
    Q coda layers of the checkpoint (of a tiny preset's or a LoopedLM's weights likewise); the
    random-weight paper shapes and dummy folders take the split into their config alone."""
    if load_format not in LOAD_FORMATS:
        raise ParamError("load_format", f"unknown load_format {load_format!r}; supported: {LOAD_FORMATS}")
    kw = {} if r_max is None else {"r_max": r_max}
    if isinstance(model, LoopedLM):
        m = model.to(device=device, dtype=resolve_dtype(dtype)).eval()
        if r_max is not None and r_max != m.cfg.r_max:  # the same weights at another depth (a copy: the caller's stays)
            m = model_from_state(replace(m.cfg, r_max=r_max), dict(m.state_dict()), m.dtype, m.device)
        return (_split_weights(m, layer_split) if layer_split is not None else m), None
    if isinstance(model, str) and model in PRESETS:
        m = tiny_model(model, dtype=resolve_dtype(dtype), **kw).to(device)
        return (_split_weights(m, layer_split) if layer_split is not None else m), None
    if isinstance(model, str) and model in PAPER_MODELS:
        return dummy_model(_split_cfg(paper_config(model, **kw), layer_split), resolve_dtype(dtype), device), None
    if load_format == "dummy":
        folder = resolve_path(model)
        if not (folder / "config.json").exists():
            raise ParamError("model", f"{folder}: no config.json (load_format='dummy' builds the model it describes)")
        cfg = read_config(folder)
        cfg = replace(cfg, **kw) if kw else cfg
        return dummy_model(_split_cfg(cfg, layer_split), resolve_dtype(dtype), device), load_tokenizer(folder)
    m = load_pretrained(model, dtype=dtype, device=device, layer_split=layer_split, **kw)
    return m, load_tokenizer(Path(model)) if Path(model).is_dir() else None


def _split_cfg(cfg: LoopConfig, layer_split: str | None) -> LoopConfig:
    return cfg if layer_split is None else split_config(cfg, layer_split)


def _split_weights(m: LoopedLM, layer_split: str) -> LoopedLM:
    """An in-memory model's surviving layers (the same selection as a checkpoint's)."""
    p = next(m.parameters())
    cfg, state = apply_layer_split(m.cfg, dict(m.state_dict()), layer_split)
    return model_from_state(cfg, state, p.dtype, p.device)


class LLM:
    """`LLM(model, **settings)`: `settings` are `EngineConfig` fields (policy, refill,
    min_coda_batch, kv_layout, max_batch_size, exit_threshold, r_min, lookahead, ...); the ones
    left out come from the checkpoint's config.json, then from EngineConfig's defaults. The
    resolved settings are `llm.config`."""

    def __init__(self, model: str | Path | LoopedLM, *, dtype: str = "float32", device: str = "cpu",
                 r_max: int | None = None, tokenizer=None, load_format: str = "auto", layer_split: str | None = None,
                 **settings):
        config = EngineConfig.from_kwargs(settings)  # unknown names fail before the model loads
        m, tok = load_model(model, dtype, device, r_max, load_format, layer_split)
        self.model, self.tokenizer = m, tokenizer if tokenizer is not None else tok
        self.engine = LLMEngine(m, config, self.tokenizer)

    @property
    def config(self) -> EngineConfig:
        return self.engine.config

    def generate(self, prompts: str | list[int] | Seq[str | list[int]],
                 params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool | None = None, priority: int | Seq[int] | None = None) -> list[RequestOutput]:
        """Generate for every prompt (a string or a list of token ids); outputs in input order.
        Every request is validated before any runs: a bad one raises ParamError naming its index.
        `priority` (scheduling_policy "priority", vLLM's): one per prompt, or one for all."""
        single = isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int))
        plist = [prompts] if single else list(prompts)
        ps = list(params) if isinstance(params, (list, tuple)) else [params or SamplingParams()] * len(plist)
        if len(ps) != len(plist):
            raise ParamError("params", f"{len(ps)} SamplingParams for {len(plist)} prompts")
        prio = list(priority) if isinstance(priority, (list, tuple)) else [priority or 0] * len(plist)
        if len(prio) != len(plist):
            raise ParamError("priority", f"{len(prio)} priorities for {len(plist)} prompts")
        eng = self.engine
        seqs = []
        try:
            for i, (p, sp, pr) in enumerate(zip(plist, ps, prio)):
                try:
                    seqs.append(eng.add_request(p, sp, priority=pr))
                except ValueError as e:
                    raise ParamError(getattr(e, "param", "prompt"), f"prompt {i}: {e}") from None
        except ValueError:
            for s in seqs:  # nothing is left half-queued
                eng.abort(s.request_id)
                eng.release(s.request_id)
            raise
        show = use_tqdm if use_tqdm is not None else len(plist) >= 32
        bar = None
        if show:
            bar = progress(len(seqs), "generate", "req")
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

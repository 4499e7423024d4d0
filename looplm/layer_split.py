"""Huginn layer-split override (`--layer-split P-C-Q`): load a checkpoint with fewer prelude, core
or coda layers, the CDB paper's layer-split ablation (Huginn-3.5B is 2-4-2; the paper also runs it
as 0-4-0 and 1-4-1).

Which layers survive follows the authors' loader (looped_cdb/eval/model_loading.py
`load_huginn_model(layer_split=...)`, which builds the model at the new counts and lets
`from_pretrained` match the checkpoint's tensors by name): a P-C-Q split keeps the FIRST P prelude
layers (`transformer.prelude.0 .. P-1`), the FIRST C core layers (`transformer.core_block.0 .. C-1`)
and the FIRST Q coda layers (`transformer.coda.0 .. Q-1`); every other layer's tensors are dropped,
the embedding, adapter, final norm, LM head and exit gate are kept. So 1-4-1 on the 2-4-2 release
runs prelude.0 and coda.0 (not the layer nearest the head), and the surviving layers keep their
indices. The core count may change too (C >= 1), as in the authors' code. Unlike their loader,
which leaves any layer the checkpoint lacks at random init, a count above the checkpoint's raises.

The split is Huginn-only, as in the authors' code (their Ouro loader takes none): Ouro is 0-L-0
by architecture. A model whose layers were dropped no longer computes anything meaningful (its
text is noise); it is for measuring throughput, whose cost structure is what the split changes.
"""
from __future__ import annotations

import re

import torch

from .config import LoopConfig, replace
from .errors import ParamError

_STAGE_KEY = re.compile(r"^transformer\.(prelude|core_block|coda)\.(\d+)\.(.+)$")


def parse_layer_split(split: str | tuple[int, int, int] | list[int]) -> tuple[int, int, int]:
    """'P-C-Q' (or a 3-tuple) -> (P, C, Q): non-negative integers with C >= 1."""
    if isinstance(split, (tuple, list)):
        parts = list(split)
    elif isinstance(split, str):
        parts = split.strip().split("-")
    else:
        raise ParamError("layer_split", f"layer_split must be a 'P-C-Q' string such as '0-4-0', got {split!r}")
    if len(parts) != 3 or not all(
            (isinstance(p, int) and not isinstance(p, bool)) or (isinstance(p, str) and p.isdigit()) for p in parts):
        raise ParamError("layer_split", f"layer_split must be three dash-separated non-negative integers "
                                        f"'prelude-core-coda' such as '0-4-0', got {split!r}")
    p, c, q = (int(x) for x in parts)
    if p < 0 or q < 0 or c < 1:
        raise ParamError("layer_split", f"layer_split needs prelude, coda >= 0 and core >= 1, got {split!r}")
    return p, c, q


def split_of(cfg: LoopConfig) -> str:
    """A config's layer counts as 'P-C-Q' (what output names show for a split model)."""
    return f"{cfg.n_prelude}-{cfg.n_core}-{cfg.n_coda}"


def split_config(cfg: LoopConfig, split) -> LoopConfig:
    """`cfg` at the new layer counts (dummy weights need no more); checks the split against it."""
    p, c, q = parse_layer_split(split)
    if cfg.arch != "huginn":
        raise ParamError("layer_split", f"layer_split is Huginn-only (the authors' loader splits Huginn alone); "
                                        f"{cfg.name} is 0-L-0 by architecture")
    have = (cfg.n_prelude, cfg.n_core, cfg.n_coda)
    over = [f"{name} {want} > {n}" for name, want, n in zip(("prelude", "core", "coda"), (p, c, q), have) if want > n]
    if over:
        raise ParamError("layer_split", f"layer_split {p}-{c}-{q} exceeds the checkpoint's "
                                        f"{have[0]}-{have[1]}-{have[2]} layers ({', '.join(over)}): a split can "
                                        f"only drop layers")
    return replace(cfg, n_prelude=p, n_core=c, n_coda=q)


def apply_layer_split(cfg: LoopConfig, state: dict[str, torch.Tensor], split
                      ) -> tuple[LoopConfig, dict[str, torch.Tensor]]:
    """(the config at the new counts, a new state dict with only the surviving layers): the first
    P / C / Q layers of prelude / core_block / coda (module docstring), renumbered 0.. in order
    (which keeps their indices). Tensors outside the three stacks pass through unchanged."""
    new = split_config(cfg, split)
    keep = {"prelude": new.n_prelude, "core_block": new.n_core, "coda": new.n_coda}
    # old index -> new index, in order: the first `keep` layers of each stack
    renumber = {stage: {i: i for i in range(n)} for stage, n in keep.items()}
    out: dict[str, torch.Tensor] = {}
    for k, v in state.items():
        m = _STAGE_KEY.match(k)
        if m is None:
            out[k] = v
            continue
        stage, i, rest = m.group(1), int(m.group(2)), m.group(3)
        if i in renumber[stage]:
            out[f"transformer.{stage}.{renumber[stage][i]}.{rest}"] = v
    return new, out

"""How big the KV pool is: a byte budget from the device, turned into blocks.

- `kv_cache_tokens` / `kv_cache_bytes` given: that, exactly.
- CUDA: vLLM's `gpu_memory_utilization`. With the weights loaded, one worst-case dummy prefill
  (`EngineConfig.max_launch_tokens`: the largest launch admission can build) and one dummy fused
  decode stage (`max_batch_size` tokens at r_max loop steps) run on a one-block layout; the pool gets
  `total x utilization - (memory in use: weights, CUDA context, other processes) - peak activations`.
- CPU: `kv_cache_memory` bytes (EngineConfig.resolve sets its default, `CPU_KV_MEMORY`).
The per-slot state buffers (loop state, injection, exit-criterion memory) come out of the same
budget. Neither `max_batch_size` nor the context length multiplies into the pool: the pool is
what the budget holds, and `max_model_len` is lowered to it when the context would not fit.
`size_pool` decides the three pool-dependent settings of a resolved config (kv_cache_tokens,
max_model_len, swap_space), once, and returns the final config the engine runs with.
"""
from __future__ import annotations

import dataclasses
import logging

import torch

from kv_layouts import layout_class, make_layout
from looplm.errors import ParamError
from looplm.model import LoopedLM

from . import stages
from .config import EngineConfig
from .stages import TokenBatch

log = logging.getLogger("infer.engine")


def state_slot_bytes(model: LoopedLM, criterion: str) -> int:
    """Bytes of one state slot: loop state (+ injection for Huginn) + exit-criterion memory."""
    cfg, elt = model.cfg, torch.empty((), dtype=model.dtype).element_size()
    aux = {"kl": cfg.vocab_size * 8, "entropy_diff": 8, "ouro_gate": 8}.get(criterion, 0)  # float64, see looplm/exits.py
    return cfg.hidden_size * elt * (2 if cfg.arch == "huginn" else 1) + aux


@torch.inference_mode()
def cuda_budget(model: LoopedLM, c: EngineConfig) -> int:
    """Bytes left for the pool on the model's CUDA device after weights and a worst-case stage."""
    cfg, dev = model.cfg, model.device
    torch.cuda.synchronize(dev)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(dev)
    base = torch.cuda.memory_allocated(dev)
    layout = make_layout(c.kv_layout, cfg, c.block_size, model.dtype, dev)  # one block: rows wrap around it
    n = c.max_launch_tokens()
    pos = torch.arange(n, device=dev)
    rows = pos % c.block_size
    batch = TokenBatch(ids=torch.zeros(n, dtype=torch.long, device=dev), positions=pos, rows=rows,
                       steps=torch.ones(n, dtype=torch.long, device=dev), seq_ids=torch.zeros_like(pos))
    stages.prefill(model, layout, batch, pos[-1:])
    b = c.max_batch_size
    ctx = torch.arange(c.block_size, device=dev).expand(b, -1)
    dec = TokenBatch(ids=torch.zeros(b, dtype=torch.long, device=dev), positions=torch.zeros(b, dtype=torch.long,
                     device=dev), rows=ctx[:, 0], steps=torch.ones(b, dtype=torch.long, device=dev), ctx_rows=ctx,
                     ctx_len=torch.ones(b, dtype=torch.long, device=dev))
    stages.fused(model, layout, dec, cfg.r_max)
    torch.cuda.synchronize(dev)
    peak = torch.cuda.max_memory_allocated(dev) - base
    del layout, batch, dec
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(dev)
    return int(total * c.gpu_memory_utilization) - (total - free) - peak


def kv_bytes_per_token(model: LoopedLM, kv_layout: str) -> int:
    return layout_class(kv_layout).bytes_per_row(model.cfg, model.dtype)


def pool_blocks(model: LoopedLM, c: EngineConfig) -> tuple[int, str]:
    """(number of KV blocks, the setting that sized them) of a resolved config. Raises ParamError
    naming the numbers when the budget cannot hold one block."""
    bpt = kv_bytes_per_token(model, c.kv_layout)
    slots = (c.max_batch_size + 1) * state_slot_bytes(model, c.exit_criterion)
    if c.kv_cache_tokens is not None:
        tokens, knob, budget = c.kv_cache_tokens, "kv_cache_tokens", None
    else:
        if c.kv_cache_bytes is not None:
            knob, budget = "kv_cache_bytes", c.kv_cache_bytes
        elif model.device.type == "cuda":
            knob, budget = "gpu_memory_utilization", cuda_budget(model, c) - slots
        else:
            knob, budget = "kv_cache_memory", c.kv_cache_memory - slots
        tokens = max(0, budget) // bpt
    n = tokens // c.block_size
    if n < 1:
        got = f"{tokens} tokens" if budget is None else f"{budget} bytes after {slots} bytes of state slots"
        raise ParamError(knob, f"the KV pool budget ({knob}) holds {got}, less than one block of {c.block_size} "
                               f"tokens x {bpt} bytes per token ({c.kv_layout}) = {c.block_size * bpt} bytes; "
                               f"raise {knob} or lower block_size")
    return n, knob


def size_pool(model: LoopedLM, c: EngineConfig) -> EngineConfig:
    """The final config of a resolved one: the pool in whole blocks (kv_cache_tokens),
    max_model_len lowered (with one warning line) to what the pool holds, and the swap space
    (default: the pool's bytes)."""
    n, knob = pool_blocks(model, c)
    pool_tokens = n * c.block_size
    model_len = c.max_model_len
    if model_len > pool_tokens:
        more = knob if knob == "kv_cache_tokens" else f"{knob} or kv_cache_tokens"
        log.warning("max_model_len lowered from %d to %d: the KV pool (%s) holds %d tokens; raise %s, or set "
                    "max_model_len", model_len, pool_tokens, knob, pool_tokens, more)
        model_len = pool_tokens
    swap = c.swap_space if c.swap_space is not None else pool_tokens * kv_bytes_per_token(model, c.kv_layout)
    return dataclasses.replace(c, kv_cache_tokens=pool_tokens, max_model_len=model_len, swap_space=swap)

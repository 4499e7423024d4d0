"""How big the KV pool is: a byte budget from the device, turned into blocks.

- `kv_cache_tokens` / `kv_cache_bytes` given: that, exactly.
- CUDA: vLLM's `gpu_memory_utilization`. With the weights loaded, the largest launch of each kind
  runs once on a one-block layout (`launch_peaks`: a prefill of `EngineConfig.max_launch_tokens`,
  the same with every position's log-probs, a fused decode of the padded max_batch_size at the
  longest context the SDPA gather reads); the pool gets `total x utilization - (memory in use:
  weights, CUDA context, other processes) - activation_reserve` (the decode peak plus the largest
  eager launch: a mixed launch holds both, and the CUDA graphs' pool keeps the decode's for good).
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
import weakref
from typing import Callable

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from kv_layouts import layout_class, make_layout
from looplm.errors import ParamError
from looplm.exits import initial_aux, score_rule
from looplm.model import LoopedLM

from . import stages
from .batch_state import context_blocks, launch_sizes, next_pow2, padded_batch, table_width
from .config import EngineConfig
from .stages import TokenBatch

log = logging.getLogger("infer.engine")


def _loop_state_bytes(model: LoopedLM) -> int:
    """One row of the runner's loop-state buffers: the state (+ injection for Huginn)."""
    cfg, elt = model.cfg, torch.empty((), dtype=model.dtype).element_size()
    return cfg.hidden_size * elt * (2 if cfg.arch == "huginn" else 1)


def state_slot_bytes(model: LoopedLM, criterion: str) -> int:
    """Bytes of one state slot: loop state (+ injection for Huginn) + exit-criterion memory."""
    cfg = model.cfg
    aux = {"kl": cfg.vocab_size * 8, "entropy_diff": 8, "ouro_gate": 8}.get(criterion, 0)  # float64, see looplm/exits.py
    return _loop_state_bytes(model) + aux


def token_slot_bytes(model: LoopedLM) -> int:
    """Bytes of one token slot (a prompt position in flight, mixed.py): its loop state and its
    batch-state row (position, loop step, owner, re-entry token: four int64)."""
    return _loop_state_bytes(model) + 4 * 8


class LiveBytes(TorchDispatchMode):
    """The peak bytes of the tensors alive during a run, counted from the ops (on the meta device at
    real shapes, where no allocator keeps statistics): each op's fresh outputs count from their
    creation until their storage is freed; views and in-place results (outputs that alias an input)
    add nothing."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0

    def _free(self, n: int) -> None:
        self.live -= n

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not any(r.alias_info is not None for r in func._schema.returns):
            for t in pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor):  # (a storage lives as long as any view of it)
                    st = t.untyped_storage()
                    self.live += st.nbytes()
                    weakref.finalize(st, self._free, st.nbytes())
        self.peak = max(self.peak, self.live)
        return out


def _peak(fn: Callable[[], object], dev: torch.device) -> int:
    """Bytes `fn` allocates at its peak beyond what was allocated before it (CUDA: the allocator's
    statistics; meta: LiveBytes)."""
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        base = torch.cuda.memory_allocated(dev)
        fn()
        torch.cuda.synchronize(dev)
        return torch.cuda.max_memory_allocated(dev) - base
    with LiveBytes() as m:
        fn()
    return m.peak


def decode_context(c: EngineConfig, cfg) -> int:
    """The longest context, in KV rows, that a decode launch's SDPA gather can read: every item padded
    to the bucketed longest context (BatchState.ctx_blocks), up to max_model_len."""
    B = c.block_size
    widest = table_width(cfg.max_position, B, cfg.max_position)  # (the table's width with any pool that holds it)
    return context_blocks(-(-c.max_model_len // B), widest, True) * B


@torch.inference_mode()
def launch_peaks(model: LoopedLM, c: EngineConfig) -> dict[str, int]:
    """The activation bytes of the largest launch of each kind a resolved config can build, run once
    each on a one-block layout (rows wrap around it, so the pool itself costs nothing):
    - `prefill`: `max_launch_tokens` prompt positions (a prefill or mixed launch, eager);
    - `logprobs`: the same with every position through the head and the output processor's float64
      log-softmax (prompt log-probs / echo);
    - `decode`: CB's fused iteration (prelude, r_max core steps, coda, head) and a CDB core step with
      the exit criterion, over the padded max_batch_size, every item attending the longest context
      the SDPA gather can read (`decode_context`): N x context K/V rows per layer, 2 GiB for
      Ouro-1.4B at N=64 and 4k, 32 GiB at 64k (tests/test_memory.py measures the runner's bodies)."""
    cfg, dev, B = model.cfg, model.device, c.block_size
    layout = make_layout(c.kv_layout, cfg, B, model.dtype, dev)
    long = dict(dtype=torch.long, device=dev)
    n = c.max_launch_tokens()
    pos = torch.arange(n, **long)
    prompt = TokenBatch(ids=torch.zeros(n, **long), positions=pos, rows=pos % B, steps=torch.ones(n, **long),
                        seq_ids=torch.zeros(n, **long))
    b, L = next_pow2(c.max_batch_size), decode_context(c, cfg)
    criterion = "none" if c.full_depth else c.exit_criterion

    def decode() -> TokenBatch:  # built inside the measured call, as BatchState.gather builds it in the body
        j = torch.arange(L, **long)
        ctx = torch.zeros(b, -(-L // B), **long)[:, j // B] * B + j % B  # (every block is the layout's one)
        # ids and rows are tensors of their own, as the gather's are (the re-entry select; the rows computed)
        return TokenBatch(ids=torch.zeros(b, **long), positions=torch.full((b,), L - 1, **long), rows=ctx[:, 0].clone(),
                          steps=torch.ones(b, **long), ctx_rows=ctx, ctx_len=torch.full((b,), L, **long))

    def core() -> None:  # one CDB core step with the engine's exit criterion (kl / entropy: coda + head too)
        state = torch.zeros(b, cfg.hidden_size, dtype=model.dtype, device=dev)
        aux = initial_aux(score_rule(criterion, cfg), b, cfg.vocab_size, dev)
        stages.core_step(model, layout, decode(), state, state if cfg.arch == "huginn" else None, criterion, aux)

    return {"prefill": _peak(lambda: stages.prefill(model, layout, prompt, pos[-1:]), dev),
            "logprobs": _peak(lambda: torch.log_softmax(stages.prefill(model, layout, prompt, pos).double(), -1), dev),
            "decode": max(_peak(lambda: stages.fused(model, layout, decode(), cfg.r_max), dev), _peak(core, dev)),
            "graph_outputs": graph_output_bytes(c, cfg, model.dtype) if c.cuda_graphs else 0}


def graph_output_bytes(c: EngineConfig, cfg, dtype: torch.dtype) -> int:
    """Bytes of the logits that the CUDA graphs keep as their static outputs, one [rows, V] buffer per
    emitting key for good (CB's fused iteration, CDB's coda; the scores of core keys are [N], noise):
    each padded batch size times the context buckets of a stage with attention layers (the keys of
    ModelRunner.graph_keys, at the widest table a pool can give). On the paged path launches with
    prompt chunks have keys too, up to max_launch_tokens more items, each with the head on the first
    padded(max_batch_size) rows (mixed.py); under separate prefill those are the prefill launches'
    (fused, at the model's r_max)."""
    B, elt = c.block_size, torch.empty((), dtype=dtype).element_size()
    width = table_width(cfg.max_position, B, cfg.max_position)
    cap = padded_batch(c.max_batch_size, c.max_batch_size, c.pad_pow2)
    ladder = c.attention_backend == "paged"
    sizes = launch_sizes(c.max_batch_size, c.pad_pow2, c.max_batch_size + (c.max_launch_tokens() if ladder else 0),
                         ladder)  # (ModelRunner.launch_sizes')
    every = len({context_blocks(nb, width, True) for nb in range(1, width + 1)})
    rows = sum(min(x, cap) for x in sizes)  # (the head's rows of a key: at most the first cap)
    if c.policy == "cb":  # the fused iteration (separate prefill's launches are such keys too)
        keys = rows * every
    elif c.prefill == "mixed":  # the coda, carrying prompt chunks up to the ladder's top
        keys = rows * (every if cfg.n_coda > 0 else 1)
    else:  # the coda of decode items only, and separate prefill's fused launches on the ladder
        keys = sum(x for x in sizes if x <= cap) * (every if cfg.n_coda > 0 else 1) + (rows * every if ladder else 0)
    return keys * cfg.vocab_size * elt


def activation_reserve(peaks: dict[str, int]) -> int:
    """Bytes the budget keeps for activations: the largest decode plus the largest eager launch, which
    can hold memory at once (a mixed launch carries decode items at the longest context beside prompt
    chunks), plus the CUDA graphs' static outputs. The graphs' pool: captured largest key first
    (graphs.py), every smaller key reuses the segments of the first, so the pool is about the largest
    decode body's peak, which `decode` measures through the SDPA gather (the paged path gathers
    nothing, so this bounds it too); gpu_check compares the pool it finds (torch.cuda.memory_snapshot
    of the pool's segments) with `decode` + `graph_outputs`."""
    return peaks["decode"] + max(peaks["prefill"], peaks["logprobs"]) + peaks.get("graph_outputs", 0)


def cuda_budget(model: LoopedLM, c: EngineConfig) -> int:
    """Bytes left for the pool on the model's CUDA device after weights and the largest launches."""
    dev = model.device
    torch.cuda.synchronize(dev)
    torch.cuda.empty_cache()
    reserve = activation_reserve(launch_peaks(model, c))
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(dev)
    return int(total * c.gpu_memory_utilization) - (total - free) - reserve


def kv_bytes_per_token(model: LoopedLM, kv_layout: str) -> int:
    return layout_class(kv_layout).bytes_per_row(model.cfg, model.dtype)


def pool_blocks(model: LoopedLM, c: EngineConfig) -> tuple[int, str]:
    """(number of KV blocks, the setting that sized them) of a resolved config. Raises ParamError
    naming the numbers when the budget cannot hold one block."""
    bpt = kv_bytes_per_token(model, c.kv_layout)
    slots = (c.max_batch_size + 1) * state_slot_bytes(model, c.exit_criterion) + \
        c.max_launch_tokens() * token_slot_bytes(model)
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

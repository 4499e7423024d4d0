"""Peak memory per GPU and time per step of train/shared_kv.py's training step, estimated on this CPU.

    python -m train.estimate --model ouro-1.4b --ctx 16384 --batch 1 --gpus 1 [--fsdp] [--lora]
        [--backprop-depth K] [--context-grad N] [--pass1-sweeps N] [--dtype bf16] [--json]
    python -m train.estimate --check      (the estimate against a real run's measured peak, here)
    python -m train.estimate --table      (the docs' table: docs/results/train-estimate.md)
    python -m train.estimate --script distill --model ouro-1.4b --ctx 4096 --batch 8 [--gates both]
        [--objective teacher|oracle] [--add-gate --teacher loss|kl|latent_diff|entropy_diff]
                                          (train/distill_gate.py's step: the frozen model's no-grad
                                           feature pass under bf16 autocast + the heads' loss,
                                           backward and AdamW on the heads; --add-gate: the new
                                           gate's phase, and the heads' phase after it with --gates)

Not formulas: the REAL step (`train.shared_kv.training_loss` + backward + gradient clipping + a
foreach AdamW step, as the trainer runs it) at the REAL shape, on fake tensors (torch's
FakeTensorMode: shapes, dtypes and storages, no data, no memory). MemTracker (torch's
torch.distributed._tools) follows every storage alive and gives the peak by category. Where the step
asks for data (`.item()`, `bool(t)`, a boolean index), `_DataFree` answers: True / 1, every
element selected (an upper bound; these are [B, T] bookkeeping tensors). Time: every op's FLOPs
(FlopCounterMode's per-op formulas) and bytes read + written give a roofline time per op
(max(FLOPs / peak, bytes / HBM bandwidth)), summed and divided by `--mfu`.

Precision, as the trainer on CUDA: fp32 master weights, gradients and AdamW state, bf16 autocast
(whose cast cache keeps a bf16 copy of each weight during the forward). `--lora`: peft's LoRA
modelled here (peft is not a dependency): the base weights frozen in bf16, rank-`--lora-rank` fp32
adapters on the attention and MLP projections, only those trained. `--fsdp`: FSDP2 as
train/configs/gpu_fsdp.yaml sets it up, by rule not by a fake process group: every block stays
gathered in bf16 from its first forward to the optimizer step (train/shared_kv.py: fsdp2_units), so
the run is measured with the weights in bf16 and no optimizer, then the sharded fp32 weights,
gradients and AdamW state (/ GPUs) and one block's bf16 gradient before its reduce-scatter are added.
Not modelled: the CUDA caching allocator's fragmentation, CUDA kernels choosing other saved tensors
than the CPU ones (SDPA's backends), NCCL buffers, the CUDA context (~0.5-1 GB).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import time
import warnings
from collections import Counter
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker, _MemRefType
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map_only
from torch.utils.flop_counter import flop_registry

from looplm.cli import UserError
from looplm.config import LoopConfig, replace
from looplm.io import build_model, read_config
from looplm.presets import PAPER_MODELS, PRESETS
from train import cli
from train.lora import TARGETS as LORA_TARGETS
from train.shared_kv import policy_for, training_loss

aten = torch.ops.aten
GB = 1e9
BLOCKS = ("OuroLayer", "SandwichBlock", "RavenBlock")  # FSDP2's units (train/shared_kv.py: _no_split_modules)
CATEGORIES = {"parameters": _MemRefType.PARAM, "gradients": _MemRefType.GRAD, "optimizer_state": _MemRefType.OPT,
              "activations": _MemRefType.ACT, "temporaries": _MemRefType.TEMP}


# ----------------------------------------------------------------------------- the model
def model_config(name: str, r_max: int | None = None) -> LoopConfig:
    """A preset (looplm/presets.py) or an HF folder's config.json; `r_max` overrides the loop depth."""
    if name in PAPER_MODELS or name in PRESETS:
        cfg = LoopConfig(**(PAPER_MODELS.get(name) or PRESETS[name]))
    elif (Path(name) / "config.json").exists():
        cfg = read_config(Path(name))
    else:
        raise UserError(f"--model {name}: neither a preset ({', '.join(sorted(PAPER_MODELS | PRESETS))}) "
                        "nor a folder with config.json")
    return cfg if r_max is None else replace(cfg, r_max=r_max)


class LoRALinear(nn.Module):
    """base(x) + B(A(x)): peft's LoRA (B starts at zero), the base frozen."""

    def __init__(self, base: nn.Linear, rank: int):
        super().__init__()
        self.base = base
        self.lora_A = nn.Parameter(torch.randn(rank, base.in_features, dtype=torch.float32) / rank)
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, rank, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + F.linear(F.linear(x, self.lora_A), self.lora_B)


def build(cfg: LoopConfig, lora_rank: int = 0, weights: torch.dtype = torch.float32) -> nn.Module:
    """The model as the step holds it: trainable weights in `weights`, or (lora_rank > 0) frozen bf16
    weights with fp32 LoRA adapters on every attention / MLP projection (train/lora.py's TARGETS;
    peft itself cannot run here: its .to() cannot swap fake parameters)."""
    torch.manual_seed(0)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16 if lora_rank else weights)  # built in place: no .to() (fake tensors)
    try:
        model = build_model(cfg)
    finally:
        torch.set_default_dtype(old)
    if lora_rank:  # as train/shared_kv.py --lora-rank: adapters and the gate heads trained, the rest frozen
        for n, p in model.named_parameters():
            p.requires_grad_("exit_gate" in n)
        for mod in list(model.modules()):
            for name, child in list(mod.named_children()):
                if name in LORA_TARGETS and isinstance(child, nn.Linear):
                    setattr(mod, name, LoRALinear(child, lora_rank))
    return model.train()


class Step(nn.Module):
    """The trainer's objective (SharedKVObjective): one module around training_loss, so that the
    tracker sees the looped blocks called inside one root call."""

    def __init__(self, model: nn.Module, policy, options: dict):
        super().__init__()
        self.model, self.policy, self.options = model, policy, options

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return training_loss(self.model, ids, self.policy, "shared", 1, **self.options)


# ----------------------------------------------------------------------------- the instruments
class _DataFree(TorchDispatchMode):
    """Answers the step's data-dependent questions on fake tensors: a scalar read is True / 1, a
    boolean index selects every element (the largest result: an upper bound on its memory)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is aten._local_scalar_dense.default:
            return True if args[0].dtype == torch.bool else 1
        if func is aten.index.Tensor and any(i is not None and i.dtype == torch.bool for i in args[1]):
            idx = []
            for i in args[1]:
                if i is not None and i.dtype == torch.bool:  # a k-dim mask stands for k index tensors
                    idx += [torch.zeros(i.numel(), dtype=torch.long, device=i.device)] * i.dim()
                else:
                    idx.append(i)
            return func(args[0], idx)
        if func is aten.nonzero.default:
            x = args[0]
            return torch.zeros(x.numel(), x.dim(), dtype=torch.long, device=x.device)
        return func(*args, **kwargs)


class _NoHook:
    def remove(self) -> None:
        pass


class _Peak(MemTracker):
    """MemTracker with the global peak only (its per-module peaks cost a pass over every module per
    op: minutes for a looped model) and, beside it, the peak of what is not weights, gradients or
    optimizer state (FSDP's sharded categories are added to that one)."""

    def __init__(self, model: nn.Module, top: bool = False):
        super().__init__()
        self.dynamic_peak = 0
        # `top`: remember the op that made each storage, and what is alive near the peak (a snapshot
        # whenever the peak grows by 1%; a diagnostic, it costs a pass over the live storages)
        self.top, self.op_of, self.at_peak, self._snap_at = top, {}, Counter(), 0
        # MemTracker hooks every parameter's gradient, which a frozen one (LoRA's base) refuses: mark
        # those as hooked already (a handle whose remove() does nothing)
        for p in model.parameters():
            if not p.requires_grad:
                self._param_to_grad_hook_handles[p] = (_NoHook(), _NoHook())

    def _update_peak_stats(self, peak_state) -> None:
        for dev, snap in self._curr_mem_snap.items():
            if self._peak_mem.get(dev, 0) < snap[_TOTAL_KEY]:
                self._peak_mem[dev] = snap[_TOTAL_KEY]
                self._peak_mem_snap[dev] = dict(snap)
                if self.top and snap[_TOTAL_KEY] > 1.01 * self._snap_at:
                    self._snap_at = snap[_TOTAL_KEY]
                    self.at_peak = Counter()
                    for st, (w, _) in list(self._WINFO.items()):
                        self.at_peak[(w.reftype.value, self.op_of.get(id(w), "?"), w.mem_consumed)] += 1
            dyn = snap[_TOTAL_KEY] - snap[_MemRefType.GRAD] - snap[_MemRefType.OPT]
            self.dynamic_peak = max(self.dynamic_peak, dyn)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # MemTracker's own, less its DTensor and nested-fake-mode cases (neither occurs here): a third
        # of the run's time went to them
        res = func(*args, **(kwargs or {}))
        if func.namespace == "prim":  # prim.device & co: no tensor out (the backward engine asks often)
            return res
        reftype = (_MemRefType.OPT if self._in_opt else
                   _MemRefType.TEMP if self._mod_tracker.is_bw and not self._in_ac else _MemRefType.ACT)
        tree_map_only(torch.Tensor, partial(self._track, reftype), res)
        if self.top:
            for t in tree_leaves(res):
                if isinstance(t, torch.Tensor):
                    w = self._WINFO.get(t.untyped_storage(), (None, None))[0]
                    if w is not None:
                        self.op_of.setdefault(id(w), func.__name__)
        self._update_peak_stats(None)
        return res


class _Roofline(TorchDispatchMode):
    """Per op: FLOPs (FlopCounterMode's formulas) and bytes of the tensors read and written (views
    move nothing); time max(FLOPs / peak, bytes / bandwidth), fp32 matmuls at half the bf16 peak (TF32)."""

    def __init__(self, peak_flops: float, hbm_bw: float):
        super().__init__()
        self.peak, self.bw = peak_flops, hbm_bw
        self.flops = self.bytes = self.seconds = 0.0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func.is_view or func is aten._local_scalar_dense.default or func.namespace == "prim":
            return out
        tensors = [t for t in tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)]
        nbytes = sum(min(t.numel() * t.element_size(), t.untyped_storage().nbytes()) for t in tensors)
        flops = 0
        if func._overloadpacket in flop_registry:
            flops = flop_registry[func._overloadpacket](*args, **kwargs, out_val=out)
        half = any(t.dtype in (torch.bfloat16, torch.float16) for t in tensors)
        self.flops += flops
        self.bytes += nbytes
        self.seconds += max(flops / (self.peak if half else self.peak / 2), nbytes / self.bw)
        return out


# ----------------------------------------------------------------------------- one step
def _adamw_with_state(params: list, **kw) -> torch.optim.AdamW:
    """The trainers' foreach AdamW with its state already there (it exists from the first step on):
    created by one step with zero gradients, then the gradients dropped."""
    opt = torch.optim.AdamW(params, foreach=True, **kw)
    for p in params:
        p.grad = torch.zeros_like(p)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return opt


def run_step(cfg: LoopConfig, ctx: int, batch: int, options: dict, *, lora_rank: int = 0, autocast: bool = True,
             fsdp: bool = False, fake: bool = True, top: int = 0, peak_flops: float = 989e12, hbm_bw: float = 3.35e12,
             seed: int = 0) -> dict:
    """One training step of train/shared_kv.py under the tracker: bytes at the peak by category, the
    peak of the rest (no gradients / optimizer state), FLOPs, bytes moved, roofline seconds. `fake`:
    on fake tensors (no memory, no data); else real ones (the check). `fsdp`: weights in bf16 (as
    FSDP2 gathers them) and no optimizer step (its state is sharded: estimate() adds it)."""
    policy = policy_for(cfg, argparse.Namespace(criterion="learned" if cfg.exit_criterion == "ouro_gate" else None,
                                                threshold=None, r_min=1, lookahead=False))
    weights = torch.bfloat16 if fsdp and autocast else torch.float32
    with FakeTensorMode() if fake else contextlib.nullcontext():
        model = build(cfg, lora_rank, weights)
        params = [p for p in model.parameters() if p.requires_grad]
        opt = None
        if not fsdp:
            opt = _adamw_with_state(params, lr=1e-4, betas=(0.9, 0.95))
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(cfg.vocab_size, (batch, ctx + 1), generator=None if fake else g)
        step = Step(model, policy, options)
        tracker, roof = _Peak(model, top > 0), _Roofline(peak_flops, hbm_bw)
        tracker.track_external(model, ids, *([opt] if opt else []))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # MemTracker: "Module is None. Skipping PRE_BW hook." per block
            with tracker, _DataFree() if fake else contextlib.nullcontext(), roof:
                with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
                    loss = step(ids)
                loss.backward()
                if opt is not None:
                    nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
                    opt.step()
        snap = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]
        units = [m for m in model.modules() if type(m).__name__ in BLOCKS]
        unit = max((sum(p.numel() for p in m.parameters()) for m in units), default=0)
        return {"peak": snap[_TOTAL_KEY], **{k: snap.get(v, 0) for k, v in CATEGORIES.items()},
                "dynamic_peak": tracker.dynamic_peak, "flops": roof.flops, "bytes_moved": roof.bytes,
                "roofline_s": roof.seconds, "trainable_params": sum(p.numel() for p in params),
                "params": sum(p.numel() for p in model.parameters()), "unit_params": unit,
                "loss_finite": None if fake else bool(torch.isfinite(loss)),
                "top": [{"category": c, "op": op, "bytes": b, "count": n}
                        for (c, op, b), n in sorted(tracker.at_peak.items(), key=lambda x: -x[0][2] * x[1])[:top]]}


# ----------------------------------------------------------------------------- distill_gate.py's step
def run_distill_step(cfg: LoopConfig, ctx: int, batch: int, phase: str = "heads", gates: str = "both",
                     objective: str = "teacher", teacher: str = "loss", frozen_batch: int | None = 1,
                     autocast: bool = True, fake: bool = True,
                     top: int = 0, peak_flops: float = 989e12, hbm_bw: float = 3.35e12, seed: int = 0) -> dict:
    """One optimizer step of train/distill_gate.py under the tracker, its own functions: `phase`
    "heads" (heads_loss: the lookahead / preloop heads of `gates` distilled with `objective` from the
    stock gate) or "add_gate" (added_gate_step_loss: a new exit gate against `teacher`; cfg without a
    gate). The frozen model (float32 weights, no grad) runs under bf16 autocast with `autocast`, the
    heads and their AdamW in float32; + clip_grad_norm_ + the AdamW step. The same keys as run_step."""
    from train.distill_gate import GATES, added_gate_step_loss, heads_loss, init_added_gate, teacher_policy
    precision = "bf16" if autocast else "no"
    with FakeTensorMode() if fake else contextlib.nullcontext():
        torch.manual_seed(seed)
        model = build(cfg).eval()
        for p in model.parameters():
            p.requires_grad_(False)
        if phase == "add_gate":
            heads = init_added_gate(cfg.hidden_size, 0.3)
            policy = teacher_policy(cfg, teacher, None)

            def loss_fn(ids):
                return added_gate_step_loss(model, heads, ids, None, None, teacher, policy, 0.1, cfg.r_min, precision,
                                            frozen_batch)
        else:
            names = GATES[gates]
            heads = nn.ModuleDict()
            if "lookahead" in names:
                heads["lookahead"] = nn.Linear(cfg.hidden_size, 1)
            if "preloop" in names:
                heads["preloop"] = nn.Linear(cfg.hidden_size, cfg.r_max)

            def loss_fn(ids):
                return heads_loss(model, heads, names, ids, None, None, objective, 0.1, precision, frozen_batch)
        params = list(heads.parameters())
        opt = _adamw_with_state(params, lr=1e-3, weight_decay=0.0)
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(cfg.vocab_size, (batch, ctx + 1), generator=None if fake else g)
        step = _Root(loss_fn, model, heads)
        tracker, roof = _Peak(model, top > 0), _Roofline(peak_flops, hbm_bw)
        tracker.track_external(step, ids, opt)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with tracker, _DataFree() if fake else contextlib.nullcontext(), roof:
                loss = step(ids)["loss"]
                loss.backward()
                nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
                opt.step()
        snap = tracker.get_tracker_snapshot("peak")[torch.device("cpu")]
        return {"peak": snap[_TOTAL_KEY], **{k: snap.get(v, 0) for k, v in CATEGORIES.items()},
                "dynamic_peak": tracker.dynamic_peak, "flops": roof.flops, "bytes_moved": roof.bytes,
                "roofline_s": roof.seconds, "trainable_params": sum(p.numel() for p in params),
                "params": sum(p.numel() for p in model.parameters()) + sum(p.numel() for p in params),
                "loss_finite": None if fake else bool(torch.isfinite(loss)),
                "top": [{"category": c, "op": op, "bytes": b, "count": n}
                        for (c, op, b), n in sorted(tracker.at_peak.items(), key=lambda x: -x[0][2] * x[1])[:top]]}


class _Root(nn.Module):
    """One root module around a step function (as Step): the tracker sees the looped blocks called
    inside one root call, not a block's second iteration."""

    def __init__(self, fn, model: nn.Module, heads: nn.Module):
        super().__init__()
        self.fn, self.model, self.heads = fn, model, heads

    def forward(self, ids: torch.Tensor) -> dict:
        return self.fn(ids)


def estimate_distill(a: argparse.Namespace) -> dict:
    """--script distill: one GPU, each phase of the run (--add-gate's, then the heads' with --gates)."""
    if a.ctx <= 0 or a.batch <= 0 or a.frozen_batch <= 0:
        raise UserError(f"--ctx, --batch and --frozen-batch must be positive (got {a.ctx}, {a.batch}, {a.frozen_batch})")
    if a.gpus != 1 or a.fsdp or a.lora:
        raise UserError("--script distill: one GPU, no --fsdp / --lora (only the heads train; launch more "
                        "processes for more windows per step)")
    cfg = model_config(a.model, a.r_max)
    ctx = min(a.ctx, cfg.max_position)  # as distill_gate.py clamps --ctx
    gates = a.gates or ("none" if a.add_gate else "both")
    phases = []
    if a.add_gate:
        if cfg.family == "ouro":
            raise UserError(f"--add-gate: {a.model} is an Ouro model, whose gate is part of the architecture")
        cfg = replace(cfg, exit_gate=False, exit_criterion=a.teacher if a.teacher != "loss" else "kl")
        phases.append(("add_gate", cfg))
        cfg = replace(cfg, exit_gate=True, exit_criterion="learned")  # the heads' phase: the new gate is the teacher
    if gates != "none":
        if not cfg.exit_gate:
            raise UserError(f"{a.model} has no exit gate to distil from: --add-gate")
        phases.append(("heads", cfg))
    if not phases:
        raise UserError("--gates none trains nothing without --add-gate")
    t0, out = time.perf_counter(), []
    for phase, c in phases:
        m = run_distill_step(c, ctx, a.batch, phase, gates, a.objective, a.teacher, a.frozen_batch,
                             autocast=a.dtype == "bf16",
                             top=a.top, peak_flops=a.peak_flops, hbm_bw=a.hbm_bw)
        step_s = m["roofline_s"] / a.mfu
        out.append({"phase": phase, **({"teacher": a.teacher} if phase == "add_gate" else
                                       {"gates": gates, "objective": a.objective}),
                    "peak_bytes": int(m["peak"]), "bytes": {k: int(m[k]) for k in CATEGORIES},
                    "fits": m["peak"] <= a.gpu_gb * GB, "trainable_params": m["trainable_params"],
                    "flops_per_token": m["flops"] / (a.batch * ctx), "step_s": step_s,
                    "tokens_per_s": a.batch * ctx / step_s, "top_at_peak": m["top"]})
    worst = max(out, key=lambda x: x["peak_bytes"])
    return {"script": "distill", "model": a.model, "ctx": ctx, "batch": a.batch, "frozen_batch": a.frozen_batch,
            "gpus": 1, "r_max": cfg.r_max,
            "dtype": a.dtype, "peak_bytes": worst["peak_bytes"], "fits_gb": a.gpu_gb, "fits": worst["fits"],
            "phases": out, "params": cfg_params(cfg),
            "method": f"fake-tensor run of train/distill_gate.py's step (frozen model no-grad "
                      f"{'under bf16 autocast' if a.dtype == 'bf16' else 'in fp32'}, float32 heads + backward + "
                      f"clip + AdamW) under MemTracker; per-op roofline ({a.peak_flops:.3g} FLOP/s bf16, "
                      f"{a.hbm_bw:.3g} B/s) / mfu {a.mfu}",
            "not_modelled": "packed documents' [B, 1, T, T] bool attention mask (B*T*T bytes), the held-out "
                            "evaluation (streamed, --eval-batch windows), CUDA allocator fragmentation and context",
            "estimate_s": round(time.perf_counter() - t0, 1)}


def cfg_params(cfg: LoopConfig) -> int:
    with FakeTensorMode():
        return sum(p.numel() for p in build(cfg).parameters())


# ----------------------------------------------------------------------------- the estimate
def estimate(a: argparse.Namespace) -> dict:
    """The estimate for one setting (the parsed arguments): the JSON object --json prints."""
    if a.ctx <= 0 or a.batch <= 0 or a.gpus <= 0:
        raise UserError(f"--ctx, --batch and --gpus must be positive (got {a.ctx}, {a.batch}, {a.gpus})")
    cfg = model_config(a.model, a.r_max)
    options = {"checkpoint": {"layer": True, "step": "step", "off": False}[a.checkpoint],
               "pass1_sweeps": a.pass1_sweeps, "context_grad": a.context_grad,
               "backprop_depth": a.backprop_depth, "ce_chunk": a.ce_chunk}
    t0 = time.perf_counter()
    m = run_step(cfg, a.ctx, a.batch, options, lora_rank=a.lora_rank if a.lora else 0, autocast=a.dtype == "bf16",
                 fsdp=a.fsdp, top=a.top, peak_flops=a.peak_flops, hbm_bw=a.hbm_bw)
    cats = {k: m[k] for k in CATEGORIES}
    P, Pt, N = m["params"], m["trainable_params"], a.gpus
    comm = 0.0
    if a.fsdp:
        # every block gathered in bf16 for the whole step (measured: the run's weights), plus the shards
        frozen = P - Pt
        cats["parameters"] += (4 * Pt + 2 * frozen) // N  # sharded master weights (fp32; LoRA's base bf16)
        cats["gradients"] = 4 * Pt // N + 2 * m["unit_params"]  # sharded fp32 + one block's bf16 before its reduce-scatter
        cats["optimizer_state"] = 8 * Pt // N
        peak = m["dynamic_peak"] + (4 * Pt + 2 * frozen) // N + cats["gradients"] + cats["optimizer_state"]
        comm = (N - 1) / N * (2 * P + 2 * Pt) / a.link_bw  # one all-gather (bf16), one reduce-scatter (bf16)
        sharding = f"FSDP2 over {N} GPUs, modelled: blocks gathered in bf16 through the step (reshard_after_forward false), fp32 weights, gradients, AdamW state sharded / {N}"
    elif N > 1:
        cats["ddp_buckets"] = 4 * Pt  # DDP's flat gradient buckets (gradient_as_bucket_view off): a second copy
        peak = m["peak"] + cats["ddp_buckets"]
        comm = 2 * (N - 1) / N * 4 * Pt / a.link_bw  # ring all-reduce of fp32 gradients
        sharding = f"DDP over {N} GPUs: a full replica per GPU"
    else:
        peak, sharding = m["peak"], "one GPU"
    step_s = m["roofline_s"] / a.mfu + comm
    tokens = a.batch * a.ctx
    return {"model": a.model, "ctx": a.ctx, "batch": a.batch, "gpus": N, "fsdp": a.fsdp, "lora": a.lora,
            "r_max": cfg.r_max, "dtype": a.dtype, **options, "peak_bytes": int(peak),
            "bytes": {k: int(v) for k, v in cats.items()}, "fits_gb": a.gpu_gb, "fits": peak <= a.gpu_gb * GB,
            "params": P, "trainable_params": Pt, "flops_per_token": m["flops"] / tokens,
            "step_s": step_s, "tokens_per_s": tokens * N / step_s, "comm_s": comm,
            "method": f"fake-tensor run of training_loss + backward{'' if a.fsdp else ' + AdamW'} under MemTracker; "
                      f"per-op roofline ({a.peak_flops:.3g} FLOP/s bf16, {a.hbm_bw:.3g} B/s) / mfu {a.mfu}"
                      f"{', communication added unoverlapped at %.3g B/s' % a.link_bw if N > 1 else ''}",
            "sharding": sharding, "lora_note": f"LoRA modelled: base frozen bf16, rank-{a.lora_rank} fp32 adapters "
                                               f"on {'/'.join(LORA_TARGETS)}" if a.lora else None,
            "top_at_peak": m["top"], "estimate_s": round(time.perf_counter() - t0, 1)}


def check(ctx: int = 2048, hidden: int = 128, vocab: int = 2048, seed: int = 0) -> dict:
    """The estimate against reality: a narrow model with Ouro-1.4B's structure (24 layers, r_max 4,
    gate) at `ctx` tokens, one step on fake tensors and the same step on real ones, both under the
    tracker (which follows the real run's live storages): their peaks and the ratio."""
    cfg = replace(LoopConfig(**PAPER_MODELS["ouro-1.4b"]), hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                  num_heads=hidden // 64, num_kv_heads=hidden // 64, head_dim=64, vocab_size=vocab)
    options = {"checkpoint": True, "pass1_sweeps": 2, "context_grad": None, "backprop_depth": None, "ce_chunk": 1024}
    torch.manual_seed(seed)
    fake = run_step(cfg, ctx, 1, options, autocast=False, fake=True)
    t0 = time.perf_counter()
    real = run_step(cfg, ctx, 1, options, autocast=False, fake=False, seed=seed)
    return {"ctx": ctx, "hidden": hidden, "vocab": vocab, "layers": cfg.n_core, "r_max": cfg.r_max, "seed": seed,
            "estimated_peak": fake["peak"], "measured_peak": real["peak"], "ratio": fake["peak"] / real["peak"],
            "real_step_s": round(time.perf_counter() - t0, 1),
            "categories": {k: [fake[k], real[k]] for k in CATEGORIES}}


# ----------------------------------------------------------------------------- the command line
TABLE_CTX = (2048, 4096, 8192, 16384, 32768)
# (model, extra arguments, what the row is): Huginn trains the release's r_max (mean_recurrence 32)
# through its last 8 steps (its recipe, --backprop-depth 8)
TABLE_ROWS = (("ouro-full-1", "ouro-1.4b", [], "full"), ("ouro-lora-1", "ouro-1.4b", ["--lora"], "LoRA"),
              ("ouro-full-8", "ouro-1.4b", ["--gpus", "8", "--fsdp"], "full"),
              ("huginn-full-8", "huginn-3.5b", ["--r-max", "32", "--backprop-depth", "8", "--gpus", "8", "--fsdp"],
               "full, backprop 8"),
              ("huginn-lora-1", "huginn-3.5b", ["--r-max", "32", "--backprop-depth", "8", "--lora"], "LoRA, backprop 8"),
              ("huginn-full-1", "huginn-3.5b", ["--r-max", "32", "--backprop-depth", "8"], "full, backprop 8"))


def table(argv_common: list[str], rows: list[str] | None = None, ctxs: tuple[int, ...] = TABLE_CTX) -> str:
    """The docs' table: every TABLE_ROWS setting (1 GPU, or 8 with FSDP2) at every TABLE_CTX; only
    the rows whose key starts with one of `rows` when given (e.g. "ouro", "huginn-lora": processes
    can share the work)."""
    lines = ["| model | training | GPUs | " + " | ".join(f"{c // 1024}k tokens" for c in ctxs) + " |",
             "|---|---|---|" + "---|" * len(ctxs)]
    for key, model, extra, what in TABLE_ROWS:
        if rows and not any(key.startswith(r) for r in rows):
            continue
        cells = []
        for c in ctxs:
            r = estimate(parse(["--model", model, "--ctx", str(c), *extra, *argv_common]))
            cells.append(f"{r['peak_bytes'] / GB:.1f} GB {'fits' if r['fits'] else 'OOM'}, {r['tokens_per_s']:,.0f} tok/s")
            parts = ", ".join(f"{k} {v / GB:.1f}" for k, v in r["bytes"].items())
            print(f"{key} ctx {c}: {cells[-1]}; GB: {parts}; {r['flops_per_token']:.3g} FLOPs/token "
                  f"({r['estimate_s']} s here)", flush=True)
        lines.append(f"| {model} (r_max {r['r_max']}) | {what} | {r['gpus']}{' FSDP2' if r['fsdp'] else ''} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines)


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--script", choices=("shared_kv", "distill"), default="shared_kv",
                   help="the step estimated: train/shared_kv.py's training step, or train/distill_gate.py's")
    p.add_argument("--model", default="ouro-1.4b", help="a preset (looplm/presets.py) or an HF folder with config.json")
    p.add_argument("--ctx", type=int, default=None, help="tokens per sequence (default 16384; distill: 4096, "
                   "clamped to the model's max_position as distill_gate.py does)")
    p.add_argument("--batch", type=int, default=None, help="sequences per GPU (default 1; distill: 8, its default)")
    p.add_argument("--gates", choices=("both", "lookahead", "preloop", "none"), default=None,
                   help="distill: the heads (distill_gate.py --gates; default both, none with --add-gate)")
    p.add_argument("--objective", choices=("teacher", "oracle"), default="teacher", help="distill: --objective")
    p.add_argument("--add-gate", action="store_true", help="distill: the new exit gate's phase (distill_gate.py --add-gate)")
    p.add_argument("--frozen-batch", type=int, default=1, help="distill: --frozen-batch (windows per frozen pass)")
    p.add_argument("--teacher", choices=("loss", "kl", "latent_diff", "entropy_diff"), default="loss",
                   help="distill --add-gate: --teacher")
    p.add_argument("--gpus", type=int, default=1)
    p.add_argument("--fsdp", action="store_true", help="FSDP2 full sharding (train/configs/gpu_fsdp.yaml)")
    p.add_argument("--lora", action="store_true", help="LoRA: base frozen in bf16, fp32 adapters trained")
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument("--r-max", type=int, default=None, help="loop steps (default: the model's)")
    p.add_argument("--backprop-depth", type=int, default=None, help="train/shared_kv.py --backprop-depth")
    p.add_argument("--context-grad", type=int, default=None, help="train/shared_kv.py --context-grad (default: all)")
    p.add_argument("--pass1-sweeps", type=int, default=2, help="train/shared_kv.py --pass1-sweeps")
    p.add_argument("--ce-chunk", type=int, default=1024, help="train/shared_kv.py --ce-chunk")
    p.add_argument("--checkpoint", choices=["layer", "step", "off"], default="layer",
                   help="activation checkpointing (train/shared_kv.py --gradient-checkpointing: per layer)")
    p.add_argument("--layout", choices=["shared"], default="shared")
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16",
                   help="bf16: autocast over fp32 master weights (the trainer on CUDA); fp32: no autocast")
    p.add_argument("--gpu-gb", type=float, default=80.0, help="GPU memory, for the fits / OOM verdict")
    p.add_argument("--peak-flops", type=float, default=989e12, help="bf16 dense FLOP/s (H100 SXM); fp32 at half (TF32)")
    p.add_argument("--hbm-bw", type=float, default=3.35e12, help="memory bandwidth, B/s (H100 SXM)")
    p.add_argument("--link-bw", type=float, default=450e9, help="GPU-GPU bandwidth per direction, B/s (NVLink 4)")
    p.add_argument("--mfu", type=float, default=0.4, help="the share of the per-op roofline the kernels reach")
    p.add_argument("--top", type=int, default=0, help="list the N largest groups of tensors alive at the peak "
                   "(category, the op that made them, size, count): a diagnostic, slower")
    p.add_argument("--json", action="store_true", help="one JSON object")
    p.add_argument("--table-ctx", type=int, nargs="+", default=list(TABLE_CTX), help="the table's columns")
    p.add_argument("--check", action="store_true", help="estimate vs a real run's measured peak (narrow Ouro structure)")
    p.add_argument("--check-ctx", type=int, default=2048)
    p.add_argument("--table", nargs="*", default=None, metavar="ROW",
                   help="print the docs' table (TABLE_ROWS x TABLE_CTX; only the rows whose key starts with a ROW "
                        "given: ouro, huginn, ouro-full-1, ouro-lora-1, ouro-full-8, huginn-full-8, huginn-lora-1, huginn-full-1)")
    a = p.parse_args(argv)
    distill = a.script == "distill"
    a.ctx = a.ctx if a.ctx is not None else 4096 if distill else 16384
    a.batch = a.batch if a.batch is not None else 8 if distill else 1
    return a


def main(argv=None) -> None:
    a = parse(argv)
    if a.script == "distill":
        r = estimate_distill(a)
        if a.json:
            print(json.dumps(r))
            return
        print(f"train/distill_gate.py step: {r['model']} r_max {r['r_max']}, {r['ctx']} tokens x batch {r['batch']}, "
              f"frozen model {r['dtype']} ({r['frozen_batch']} window(s) per frozen pass), one GPU")
        for ph in r["phases"]:
            what = f"teacher {ph['teacher']}" if ph["phase"] == "add_gate" else f"gates {ph['gates']} ({ph['objective']})"
            print(f"  {ph['phase']} ({what}): peak {ph['peak_bytes'] / GB:.2f} GB "
                  f"({'fits' if ph['fits'] else 'does NOT fit'} in {r['fits_gb']:g} GB); "
                  + ", ".join(f"{k} {v / GB:.2f}" for k, v in ph["bytes"].items())
                  + f"; {ph['flops_per_token']:.3g} FLOPs/token, step {ph['step_s']:.3f} s, {ph['tokens_per_s']:,.0f} tokens/s")
            for t in ph["top_at_peak"]:
                print(f"    at the peak: {t['count']:4d} x {t['bytes'] / 2**20:9.1f} MiB {t['category']:10s} made by {t['op']}")
        print(f"method: {r['method']} ({r['estimate_s']} s here); not modelled: {r['not_modelled']}")
        return
    if a.check:
        r = check(a.check_ctx)
        print(json.dumps(r) if a.json else
              f"narrow Ouro structure ({r['layers']} layers, hidden {r['hidden']}, vocab {r['vocab']}, r_max {r['r_max']}), "
              f"{r['ctx']} tokens, fp32, seed {r['seed']}: estimated peak {r['estimated_peak'] / 2**20:.1f} MiB, measured "
              f"{r['measured_peak'] / 2**20:.1f} MiB, ratio {r['ratio']:.4f} (real step {r['real_step_s']} s)")
        return
    if a.table is not None:
        common = ["--dtype", a.dtype, "--mfu", str(a.mfu), "--gpu-gb", str(a.gpu_gb), "--ce-chunk", str(a.ce_chunk),
                  "--checkpoint", a.checkpoint, "--pass1-sweeps", str(a.pass1_sweeps)]
        print(table(common, a.table, tuple(a.table_ctx)))
        return
    r = estimate(a)
    if a.json:
        print(json.dumps(r))
        return
    print(f"{r['model']} r_max {r['r_max']}, {r['ctx']} tokens x batch {r['batch']} per GPU, {r['sharding']}"
          f"{'; ' + r['lora_note'] if r['lora'] else ''}; {r['dtype']}, checkpoint {r['checkpoint']}, "
          f"backprop_depth {r['backprop_depth']}, ce_chunk {r['ce_chunk']}, pass1_sweeps {r['pass1_sweeps']}, "
          f"context_grad {r['context_grad'] if r['context_grad'] is not None else 'all'}")
    print(f"peak per GPU: {r['peak_bytes'] / GB:.2f} GB ({'fits' if r['fits'] else 'does NOT fit'} in {r['fits_gb']:g} GB)")
    for k, v in r["bytes"].items():
        print(f"  {k:16s} {v / GB:8.2f} GB")
    print(f"FLOPs per trained token {r['flops_per_token']:.3g}; step {r['step_s']:.3f} s; {r['tokens_per_s']:,.0f} tokens/s "
          f"over {r['gpus']} GPU(s)")
    for t in r["top_at_peak"]:
        print(f"  at the peak: {t['count']:4d} x {t['bytes'] / 2**20:9.1f} MiB {t['category']:10s} made by {t['op']}")
    print(f"method: {r['method']} ({r['estimate_s']} s here)")


if __name__ == "__main__":
    cli.run(main)

"""Pretrain a looped LM from scratch (Ouro-style `0-L-0` or Huginn-style `P-C-Q`), then its exit gate.

    python train/pretrain.py --arch ouro --run-dir .cache/runs/ouro --save-to checkpoints/ouro-demo
    accelerate launch train/pretrain.py --arch huginn ...      (same arguments)

Stage I trains the LM. Ouro: LM loss at every loop step, weighted (`--step-weights`), no gate.
Huginn: a loop count drawn per batch (Poisson-lognormal around `--mean-depth`, clipped to
[1, r_max]), zero initial state, LM loss at the last step, backprop through the last `--bptt`
steps only. Stage II freezes the LM and trains the exit gate with BCE on the label
"CE at this step - CE at the last step < `--gate-margin`" (continuing no longer helps); the
default threshold is then chosen on the first half of the held-out text (smallest mean depth
whose perplexity is within `--ppl-tol` of full depth). Re-launching the same command resumes from
the latest checkpoint in --run-dir (saved every `--save-every-s` seconds).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from looplm.config import LoopConfig, replace
from looplm.policy import ExitPolicy
from looplm.io import build_model, load_tokenizer, save_pretrained
from looplm.presets import init_weights
from train import cli
from looplm.cli import UserError
from train.common import (CORPUS, TOKENIZER, History, collect_outputs, docs_attend_for, eval_windows, fingerprint,
                          init_wandb, logits_of, ppl_per_depth, run_loop, summarize_exit, token_ce)
from train.datasource import Tokens, add_dataset_args, dataset_kwargs, from_corpus, from_dataset, from_npy, summary


def model_config(a: argparse.Namespace) -> LoopConfig:
    d, heads = a.hidden, a.heads
    common = dict(vocab_size=a.vocab, hidden_size=d, intermediate_size=a.ffn, num_heads=heads,
                  num_kv_heads=heads, head_dim=d // heads, r_max=a.r_max, max_position=max(a.ctx, 128),
                  eos_token_id=0, bos_token_id=0, pad_token_id=0, exit_criterion="none")
    if a.arch == "ouro":
        return LoopConfig(arch="ouro", n_prelude=0, n_core=a.core, n_coda=0, rope_theta=10000.0, **common)
    return LoopConfig(arch="huginn", n_prelude=a.prelude, n_core=a.core, n_coda=a.coda, rope_theta=50000.0,
                      qk_bias=True, tie_embeddings=True, embed_scale=math.sqrt(d), exit_gate=True, **common)


def gate_params(model) -> list[str]:
    return [n for n, _ in model.named_parameters() if "exit_gate" in n]


def gate_optimizer(model, lr: float) -> torch.optim.Optimizer:
    """Stage II's set-up: the LM frozen (eval mode), Adam over the exit gate's parameters only."""
    for p in model.parameters():
        p.requires_grad_(False)
    names = gate_params(model)
    params = [p for n, p in model.named_parameters() if n in names]
    for p in params:
        p.requires_grad_(True)
    model.eval()
    return torch.optim.Adam(params, lr=lr)


def sample_depth(rng: np.random.Generator, mean: float, sigma: float, r_max: int, r_min: int = 1) -> int:
    """Huginn's Poisson-lognormal loop count, clipped to [r_min, r_max]."""
    tau = rng.lognormal(math.log(mean) - 0.5 * sigma ** 2, sigma)
    return int(np.clip(rng.poisson(tau), r_min, r_max))


def lm_loss(model, batch: torch.Tensor, a: argparse.Namespace, step: int, mask: torch.Tensor | None = None,
            docs: torch.Tensor | None = None) -> tuple[torch.Tensor, int]:
    """The LM loss of windows batch [B, T+1]; `mask` [B, T+1]: the tokens that count as targets (None:
    all), `docs` [B, T+1]: the documents packed into each window (kept apart, train/packing.py)."""
    ids, tgt = batch[:, :-1], batch[:, 1:]
    tm, xd = (None if mask is None else mask[:, 1:]), (None if docs is None else docs[:, :-1])
    attend_for = docs_attend_for(xd)

    def ce(state, rope):
        return masked_mean(token_ce(logits_of(model, state, rope, attend_for), tgt), tm)
    if a.arch == "ouro":
        states, _, rope, _ = run_loop(model, ids, a.r_max, checkpoint=a.gradient_checkpointing, docs=xd)
        w = a.step_weights
        loss = sum(wi * ce(s, rope) for wi, s in zip(w, states)) / sum(w)
        return loss, a.r_max
    r = sample_depth(np.random.default_rng([a.seed, step, 7]), a.mean_depth, a.depth_sigma, a.r_max, a.min_depth)
    states, _, rope, _ = run_loop(model, ids, r, grad_steps=a.bptt, checkpoint=a.gradient_checkpointing, docs=xd)
    if not a.window_loss:
        return ce(states[-1], rope), r
    # loss at every step inside the backprop window, heavier towards the last (Ouro-like supervision)
    k = min(r, a.bptt)
    w = torch.arange(1, k + 1, dtype=torch.float32)
    w = w / w.sum()
    return sum(wi * ce(s, rope) for wi, s in zip(w, states[-k:])), r


def masked_mean(x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Mean of x over the counted positions (all without a mask; 0 when none counts)."""
    if mask is None:
        return x.mean()
    m = mask.to(x.dtype)
    return (x * m).sum() / m.sum().clamp(min=1)


class PretrainObjective(nn.Module):
    """The model behind one forward (batch -> loss), so DDP syncs gradients and autocast applies."""

    def __init__(self, model, a: argparse.Namespace):
        super().__init__()
        self.model, self.a = model, a

    def forward(self, batch: torch.Tensor, step: int, mask: torch.Tensor | None = None, docs: torch.Tensor | None = None):
        return lm_loss(self.model, batch, self.a, step, mask, docs)


def lr_lambda(a: argparse.Namespace):
    def f(step: int) -> float:
        if step < a.warmup:
            return (step + 1) / a.warmup
        return max(a.min_lr_frac, 1.0 - (step - a.warmup) / max(1, a.steps - a.warmup))
    return f


def evaluate_depths(model, windows: dict[str, tuple], r_max: int) -> dict:
    """Per-depth held-out perplexity of each named (windows, masks, docs) set."""
    model.eval()
    out = {f"ppl_{k}": ppl_per_depth(collect_outputs(model, w, r_max, need_kl=False, masks=m, docs=d))
           for k, (w, m, d) in windows.items()}
    model.train()
    return out


def latest_ckpt(run_dir: Path) -> Path | None:
    cks = sorted(run_dir.glob("ckpt/step_*"), key=lambda p: int(p.name.split("_")[1]))
    cks = [c for c in cks if (c / "meta.json").exists()]  # complete saves only
    return cks[-1] if cks else None


def save_ckpt(accelerator, run_dir: Path, step: int, meta: dict, keep: int = 2) -> None:
    d = run_dir / "ckpt" / f"step_{step:06d}"
    accelerator.save_state(str(d))
    if accelerator.is_main_process:
        (d / "meta.json").write_text(json.dumps(meta))  # written last: marks the save complete
        for old in sorted(run_dir.glob("ckpt/step_*"), key=lambda p: int(p.name.split("_")[1]))[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()


def stage1(a, accelerator, model, data: Tokens, windows, hist: History, wb) -> None:
    decay = [p for n, p in model.named_parameters() if p.requires_grad and p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.requires_grad and p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": a.wd}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=a.lr, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(a))
    pmodel, opt, sched = accelerator.prepare(PretrainObjective(model, a), opt, sched)
    step, elapsed = 0, 0.0
    ck = latest_ckpt(a.run_dir)
    if ck is not None:
        try:
            accelerator.load_state(str(ck))
        except Exception as e:  # noqa: BLE001 - e.g. a state_dict from another model
            raise UserError(f"cannot resume from {ck}: it holds another model or an older format "
                            f"({str(e).splitlines()[0][:200]}); pass a new --run-dir") from e
        meta = json.loads((ck / "meta.json").read_text())
        step, elapsed = meta["step"], meta["elapsed_s"]
        hist.truncate(step)
        accelerator.print(f"resumed from {ck} (step {step}, {elapsed / 60:.1f} min trained)")
    pmodel.train()
    t0, last_save, tokens = time.time() - elapsed, time.time(), 0
    losses = []
    while step < a.steps:
        seed = [a.seed, step, accelerator.process_index]
        mask, docs = data.batch_mask(a.batch, a.ctx, seed), data.batch_doc(a.batch, a.ctx, seed)
        loss, r = pmodel(data.batch(a.batch, a.ctx, seed).to(accelerator.device), step,
                         *(None if x is None else x.to(accelerator.device) for x in (mask, docs)))
        opt.zero_grad(set_to_none=True)
        accelerator.backward(loss)
        gnorm = accelerator.clip_grad_norm_(pmodel.parameters(), a.clip)
        opt.step()
        sched.step()
        step += 1
        losses.append(loss.item())
        if step % a.log_every == 0 or step == a.steps:
            rec = {"step": step, "stage": 1, "loss": float(np.mean(losses)), "lr": sched.get_last_lr()[0],
                   "grad_norm": float(gnorm), "depth": r, "time_s": round(time.time() - t0, 1)}
            losses = []
            if (step % a.eval_every == 0 or step == a.steps) and accelerator.is_main_process:
                rec.update(evaluate_depths(model, windows, a.r_max))
            if accelerator.is_main_process:
                hist.log(rec)
                if wb is not None:
                    wb.log({k: v for k, v in rec.items() if not isinstance(v, list)} |
                           {f"{k}/d{i + 1}": x for k, v in rec.items() if isinstance(v, list) for i, x in enumerate(v)},
                           step=step)
                accelerator.print(json.dumps(rec))
        if time.time() - last_save > a.save_every_s or step == a.steps:
            save_ckpt(accelerator, a.run_dir, step, {"step": step, "elapsed_s": time.time() - t0, "stage": 1})
            last_save = time.time()


def stage2(a, model, data: Tokens, windows: dict, hist: History, wb) -> dict:
    """LM frozen; the gate learns 'stop now' = continuing improves CE by less than the margin."""
    opt = gate_optimizer(model, a.gate_lr)
    t0 = time.time()
    for it in range(a.gate_steps):
        seed = [a.seed, 10 ** 6 + it, 0]
        batch, mask, docs = data.batch(a.batch, a.ctx, seed), data.batch_mask(a.batch, a.ctx, seed), data.batch_doc(a.batch, a.ctx, seed)
        ids, tgt = batch[:, :-1], batch[:, 1:]
        xd = None if docs is None else docs[:, :-1]
        with torch.no_grad():
            states, _, rope, _ = run_loop(model, ids, a.r_max, docs=xd)
            ce = torch.stack([token_ce(logits_of(model, s, rope, docs_attend_for(xd)), tgt) for s in states])  # [S, B, T]
            labels = (ce - ce[-1:] < a.gate_margin).float()[:-1]  # the last step always stops
        logits = torch.stack([model.gate_logits(s.detach()) for s in states[:-1]])
        bce = F.binary_cross_entropy_with_logits(logits, labels, reduction="none")
        loss = masked_mean(bce, None if mask is None else mask[None, :, 1:].expand_as(bce))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if (it + 1) % 50 == 0:
            rec = {"step": a.steps + it + 1, "stage": 2, "gate_bce": loss.item(),
                   "stop_label_frac": labels.mean().item(), "time_s": round(time.time() - t0, 1)}
            hist.log(rec)
            if wb is not None:
                wb.log({k: v for k, v in rec.items()}, step=rec["step"])
            print(json.dumps(rec))
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return choose_threshold(a, model, windows["val"])


def choose_threshold(a, model, val: tuple) -> dict:
    """The threshold of the learned gate, from the held-out (windows, masks, docs)."""
    w, m, d = val
    out = collect_outputs(model, w, a.r_max, need_kl=False, masks=m, docs=d)
    full = summarize_exit(out, ExitPolicy("none", None, a.r_max, a.r_max))
    grid = []
    for q in [round(x, 2) for x in np.arange(0.3, 0.99, 0.05)]:
        r = summarize_exit(out, ExitPolicy("learned", q, 1, a.r_max))
        r["rel_ppl"] = r["ppl"] / full["ppl"] - 1
        grid.append(r)
    ok = [r for r in grid if r["rel_ppl"] <= a.ppl_tol]
    best = min(ok, key=lambda r: r["mean_depth"]) if ok else max(grid, key=lambda r: r["threshold"])
    return {"full_depth_ppl": full["ppl"], "chosen": best, "grid": grid}


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--arch", choices=["ouro", "huginn"], required=True)
    p.add_argument("--run-dir", type=Path, required=True, help="checkpoints, history.json, logs")
    p.add_argument("--save-to", type=Path, help="final HF-format folder")
    p.add_argument("--tokenizer", type=Path, default=TOKENIZER)
    p.add_argument("--tokens", type=Path, default=None,
                   help="train on these .npy token ids instead of the built corpus (tests); held-out = last 10%%")
    add_dataset_args(p)  # --dataset and its format, loss and packing options (train/datasource.py)
    p.add_argument("--corpus", type=Path, default=CORPUS, help="the built corpus (default data)")
    p.add_argument("--hidden", type=int, default=192)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--ffn", type=int, default=512)
    p.add_argument("--prelude", type=int, default=2)
    p.add_argument("--core", type=int, default=3)
    p.add_argument("--coda", type=int, default=2)
    p.add_argument("--r-max", type=int, default=4)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--ctx", type=int, default=128)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=1500, help="stage I optimizer steps")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--min-lr-frac", type=float, default=0.0)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--wd", type=float, default=0.1)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--step-weights", type=float, nargs="+", default=[0.15, 0.15, 0.2, 0.5], help="ouro")
    p.add_argument("--mean-depth", type=float, default=4.5, help="huginn: mean sampled loop count")
    p.add_argument("--depth-sigma", type=float, default=0.5, help="huginn: lognormal sigma")
    p.add_argument("--min-depth", type=int, default=1, help="huginn: smallest sampled loop count")
    p.add_argument("--bptt", type=int, default=3, help="huginn: backprop through the last N steps")
    p.add_argument("--window-loss", action="store_true",
                   help="huginn: LM loss at every step of the backprop window (weights 1..k), not only the last")
    p.add_argument("--gate-steps", type=int, default=400)
    p.add_argument("--gate-lr", type=float, default=3e-3)
    p.add_argument("--gate-margin", type=float, default=0.1)
    p.add_argument("--ppl-tol", type=float, default=0.02, help="threshold choice: max ppl increase vs full depth")
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--eval-windows", type=int, default=48)
    p.add_argument("--save-every-s", type=float, default=240)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: leave the default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--embed-std", type=float, default=None, help="embedding init std (default: 0.02 like the rest)")
    p.add_argument("--save-dtype", default="float32")
    p.add_argument("--mixed-precision", choices=["no", "bf16", "fp16"], default=None,
                   help="autocast (default: the launcher's / accelerate config's, else no)")
    p.add_argument("--gradient-checkpointing", action="store_true",
                   help="recompute each core step's activations in the backward pass")
    p.add_argument("--no-wandb", action="store_true")
    p.add_argument("--debug", action="store_true", help="tracebacks instead of one-line errors")
    a = p.parse_args(argv)
    if a.arch == "ouro" and len(a.step_weights) != a.r_max:
        p.error(f"--step-weights needs r_max={a.r_max} values")
    return a


def load_data(a, accelerator) -> tuple[Tokens, dict]:
    if a.dataset is not None:
        data = from_dataset(a.dataset, a.text_column, a.tokenizer, a.ctx, a.heldout_frac,
                            is_main=accelerator.is_main_process, wait=accelerator.wait_for_everyone, **dataset_kwargs(a))
        accelerator.print(summary(data.meta))
        return data, {"heldout": held_windows(data, a.ctx, a.eval_windows)}
    if a.tokens is not None:
        data = from_npy(a.tokens)
        return data, {"heldout": held_windows(data, a.ctx, a.eval_windows)}
    train, held, synth = from_corpus(("train", "heldout", "heldout_synthetic"), a.tokenizer, a.corpus)
    data = Tokens(train, held, meta={"source": str(a.corpus), "train_tokens": int(len(train))})
    return data, {"heldout": held_windows(data, a.ctx, a.eval_windows),
                  "synthetic": (eval_windows(synth, a.ctx, a.eval_windows), None, None)}


def held_windows(data: Tokens, ctx: int, n: int | None) -> tuple:
    """(windows, masks, docs) of the held-out tokens (masks / docs None where the data has none)."""
    return data.eval(ctx, n), data.eval_mask(ctx, n), data.eval_doc(ctx, n)


def identity(a, world_size: int) -> dict:
    """What makes two launches the same run (a resume must match; --steps may grow)."""
    keys = ("arch", "hidden", "heads", "ffn", "prelude", "core", "coda", "r_max", "vocab", "ctx", "batch", "lr",
            "min_lr_frac", "warmup", "wd", "clip", "step_weights", "mean_depth", "depth_sigma", "min_depth", "bptt",
            "window_loss", "seed", "embed_std")
    data = ({"dataset": a.dataset, "text_column": a.text_column, "heldout_frac": a.heldout_frac, **dataset_kwargs(a)}
            if a.dataset else
            {"tokens": str(a.tokens)} if a.tokens else {"corpus": str(a.corpus)})
    return {**{k: getattr(a, k) for k in keys}, "data": data, "world_size": world_size}


def main(argv=None) -> None:
    a = parse(argv)
    cli.die_with_launcher()
    if a.threads:
        torch.set_num_threads(a.threads)
    from accelerate import Accelerator
    from accelerate.utils import DistributedType
    accelerator = Accelerator(cpu=not torch.cuda.is_available(), mixed_precision=a.mixed_precision)
    cli.check_launch(accelerator, "train/pretrain.py")
    if accelerator.distributed_type == DistributedType.FSDP or os.environ.get("ACCELERATE_USE_FSDP") == "true":
        raise UserError("train/pretrain.py runs DDP (these models are small); FSDP is for train/shared_kv.py: "
                        "launch with --config_file train/configs/gpu_ddp.yaml or cpu_2ranks.yaml")
    cli.banner(accelerator, "train/pretrain.py", f"gradient_checkpointing={a.gradient_checkpointing}")
    ident = identity(a, accelerator.num_processes)
    summary_file = a.run_dir / "summary.json"
    if (a.run_dir / "run.json").exists():
        cli.claim_output(a.run_dir, ident, False, what="--run-dir")  # raises on another config
        done = json.loads(summary_file.read_text()) if summary_file.exists() else {}
        if done.get("steps", 0) >= a.steps and done.get("gate_steps", 0) >= a.gate_steps and \
                (a.save_to is None or (a.save_to / "config.json").exists()):
            accelerator.print(f"already finished: {a.run_dir} holds the finished run ({done['steps']} steps, "
                              "summary.json); pass a new --run-dir (or a larger --steps to continue it)")
            return
    created = not a.run_dir.exists()
    accelerator.wait_for_everyone()
    try:
        cli.claim_output(a.run_dir, ident, accelerator.is_main_process, what="--run-dir")
        accelerator.wait_for_everyone()
        pretrain(a, accelerator)
    except BaseException:
        if accelerator.is_main_process:
            cli.remove_if_unused(a.run_dir, created)
        raise


def pretrain(a, accelerator) -> None:
    torch.manual_seed(a.seed)
    cfg = model_config(a)
    data, windows = load_data(a, accelerator)
    if int(data.train.max()) >= cfg.vocab_size:
        raise UserError(f"the training tokens reach id {int(data.train.max())} but --vocab is {cfg.vocab_size}")
    model = init_weights(build_model(cfg), seed=a.seed, std=0.02).to(accelerator.device)
    if a.embed_std is not None:
        # Ouro adds each sandwich-normed branch (unit RMS) to the residual stream: an embedding of
        # std 0.02 is drowned after the first layer, and training spends hundreds of steps growing it
        emb = model.input_embedding()
        with torch.no_grad():
            emb.weight.normal_(0.0, a.embed_std, generator=torch.Generator().manual_seed(a.seed + 1))
    for n, p in model.named_parameters():
        p.requires_grad_("exit_gate" not in n)  # the gate is stage II's
    hist = History(a.run_dir / "history.json")
    wb = init_wandb(a.run_dir, "looplm-pretrain", vars(a) | {"params": sum(p.numel() for p in model.parameters())},
                    enabled=not a.no_wandb and accelerator.is_main_process)
    accelerator.print(f"{cfg.name}: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M params, "
                      f"{data.train.size} train tokens")
    stage1(a, accelerator, model, data, windows, hist, wb)
    prints = accelerator.gather_for_metrics([fingerprint(model)], use_gather_object=True)
    if not accelerator.is_main_process:
        return
    model = accelerator.unwrap_model(model)
    s1 = save_pretrained(model, a.run_dir / "stage1", dtype=a.save_dtype)
    if data.packed:  # whole documents: every held-out window
        val = held_windows(data, a.ctx, None)
    else:
        held = data.heldout
        val = (eval_windows(held[: len(held) // 2], a.ctx) if len(held) // 2 > a.ctx else eval_windows(held, a.ctx),
               None, None)
    choice = stage2(a, model, data, {"val": val}, hist, wb)
    q = choice["chosen"]["threshold"]
    print(json.dumps({"threshold_choice": choice["chosen"], "full_depth_ppl": choice["full_depth_ppl"]}))
    (a.run_dir / "threshold_choice.json").write_text(json.dumps(choice, indent=2))
    model.cfg = replace(model.cfg, exit_criterion="learned", exit_threshold=q)
    if a.save_to is not None:
        tok = load_tokenizer(a.tokenizer)
        save_pretrained(model, a.save_to, dtype=a.save_dtype, tokenizer=tok)
        shutil.copy(a.run_dir / "history.json", a.save_to / "history.json")
        print(f"saved {a.save_to} (stage I folder: {s1})")
    summary = {"steps": a.steps, "gate_steps": a.gate_steps, "stage1_rank_fingerprints": prints,
               "world_size": accelerator.num_processes, "distributed_type": accelerator.distributed_type.value,
               "mixed_precision": accelerator.mixed_precision, "gradient_checkpointing": a.gradient_checkpointing,
               "threshold": q, "data": {k: v for k, v in data.meta.items() if k != "key"}}
    (a.run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    if wb is not None:
        wb.summary.update({"threshold": q, **{k: v for k, v in choice["chosen"].items() if not isinstance(v, list)}})
        wb.finish()

if __name__ == "__main__":
    cli.run(main)

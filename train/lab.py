"""The looped-LM lab: train an Ouro-style looped model from scratch on k-hop variable chasing
(`train/tasks/hops.py`), so that accuracy needs loops and easy tokens can leave early.

    python -m train.lab --run-dir .cache/runs/lab-hops --save-to checkpoints/lab-hops --threads 1
    python -m train.lab tokens --seed 11 --n 4000 --out .cache/lab/train.npy --mask-out .cache/lab/train_mask.npy
        (token windows and the answer-only loss mask for shared_kv.py; records cut at window edges)
    python -m train.lab rows --seed 11 --n 4000 --out .cache/lab/rows.npz
        (one record per row, prompt + answer + EOS, for shared_kv.py --rows: the engine's view)
    python -m train.lab lengths --seed 7 --n 400 --out eval/tasks/data/lab_hops_lengths.csv   (a bench trace)

Tokenizer: ids 0-2 the project's special tokens, then `a=`..`z=` (a name being defined, or
answered, is one token), single characters and `|` (recall records); 73 ids. With `x=` one token, one look-up is the
textbook induction pattern (the token after the earlier `x=`), so the model's work is the hops.
Stage I: every batch is freshly generated (seed [--train-seed, step]); cross-entropy on the answer
tokens (and the closing EOS) only, at EVERY loop step, weighted by --step-weights (Ouro's
recipe, as train/pretrain.py), so each depth learns what it can and accuracy grows with depth.
Stage II: LM frozen; the exit gate (Ouro's `early_exit_gate`) learns "stop now" = the answer
token's CE at this step is within --gate-margin of its CE at the last step (pretrain.py's label,
here on answer tokens only). The default threshold is then chosen on a validation split
(--val-seed): the smallest teacher-forced mean depth whose exact match is within --em-tol of
full depth. Held-out evaluation through the engine: `python -m eval.lab`.
"""
from __future__ import annotations

import argparse
import json
import re
import string
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from looplm.config import replace
from looplm.io import build_model, save_pretrained
from looplm.policy import ExitPolicy
from looplm.presets import init_weights
from train.common import History, exit_depths, logits_of, run_loop, token_ce
from train.pretrain import gate_optimizer, model_config
from train.tasks.hops import ALPHABET, add_generator_args, generate
from train.tokenizer import SPECIAL_TOKENS, save_tokenizer

UNK = "<unk>"
NAMES_EQ = [f"{c}=" for c in string.ascii_lowercase]
# ids: 0 <|endoftext|>, 1-2 chat, 3 <unk>, then `a=`..`z=` (a name being defined or answered: one token),
# then single characters
VOCAB = SPECIAL_TOKENS + [UNK] + NAMES_EQ + list(ALPHABET) + ["|"]  # "|": recall records (training only)
PIECE = r"[a-z]=|[\s\S]"  # a name followed by '=' is one token, anything else one character


def char_tokenizer():
    """A `tokenizers` word-level tokenizer: `x=` one token, every other character one token
    (decode concatenates)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(VOCAB)}, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(PIECE), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(SPECIAL_TOKENS)
    return tok


CHAR_ID = {c: i for i, c in enumerate(VOCAB)}


def encode(text: str) -> list[int]:
    return [CHAR_ID.get(c, CHAR_ID[UNK]) for c in re.findall(PIECE, text)]


def recall_record(rec: dict, rng: np.random.Generator, sep: str = ";") -> dict:
    """An auxiliary training record (--recall-frac): the prompt's statements, `|`, then the same
    statements in another order, each right-hand side to be predicted: the pure one-hop look-up
    (the token after the earlier `x=`), several per record. Held-out prompts never contain `|`."""
    stmts = rec["prompt"].split("?")[0].rstrip(";").split(";")
    again = [stmts[i] for i in rng.permutation(len(stmts))]
    end = ";" if sep == ";" else "."  # sep ",": the answers' own punctuation (`x=v,y=w.`)
    return {"prompt": ";".join(stmts) + ";|", "answer": sep.join(again) + end, "recall": True}


def make_batch(records: list[dict]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids [B, T], targets [B, T], answer mask [B, T]): prompt + answer + EOS, right-padded with EOS;
    the mask marks the positions whose target is an answer token or the closing EOS (recall
    records: the right-hand sides and `;`, not the unpredictable `x=`)."""
    seqs = []
    for r in records:
        p, a = encode(r["prompt"]), encode(r["answer"]) + [0]
        m = [not (r.get("recall") and VOCAB[t] in NAMES_EQ) for t in a]
        seqs.append((p, a, m))
    T = max(len(p) + len(a) for p, a, _ in seqs)
    full = torch.zeros(len(seqs), T, dtype=torch.long)
    mask = torch.zeros(len(seqs), T - 1, dtype=torch.bool)
    for i, (p, a, m) in enumerate(seqs):
        full[i, :len(p) + len(a)] = torch.tensor(p + a)
        mask[i, len(p) - 1:len(p) + len(a) - 1] = torch.tensor(m)
    return full[:, :-1], full[:, 1:], mask


@torch.no_grad()
def teacher_forced(model, records: list[dict], r_max: int, batch: int = 128) -> dict:
    """Per-step argmax correctness and CE on answer tokens, gate logits: lists of [S, n_tok] per record."""
    out = []
    for i in range(0, len(records), batch):
        recs = records[i:i + batch]
        ids, tgt, mask = make_batch(recs)
        states, _, rope, _ = run_loop(model, ids, r_max)
        ok = torch.stack([logits_of(model, s, rope).argmax(-1) == tgt for s in states])  # [S, B, T]
        gate = torch.stack([model.gate_logits(s) for s in states]).double()
        for b in range(len(recs)):
            m = mask[b]
            out.append({"ok": ok[:, b, m], "gate": gate[:, b, m]})
    return out


def em_at(tf: list[dict], records: list[dict], depth_fn) -> dict:
    """Teacher-forced exact match (every answer token + EOS right at its depth) per difficulty, mean depth."""
    by, depths = {}, []
    for r, t in zip(records, tf):
        d = depth_fn(t)  # [n_tok] 1-based
        right = bool(t["ok"].gather(0, (d - 1)[None]).all())
        by.setdefault(r["difficulty"], []).append(right)
        depths.append(d.double().mean().item())
    acc = {k: float(np.mean(v)) for k, v in sorted(by.items())}
    return {"em": float(np.mean([x for v in by.values() for x in v])), "em_by_difficulty": acc,
            "mean_depth": float(np.mean(depths))}


def depth_table(model, records, r_max) -> list[dict]:
    model.eval()
    tf = teacher_forced(model, records, r_max)
    model.train()
    return [em_at(tf, records, lambda t, d=d: torch.full((t["ok"].shape[1],), d)) for d in range(1, r_max + 1)]


def stage1(a, model, val, hist: History) -> float:
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": a.wd}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=a.lr, betas=(0.9, 0.95))
    w = a.step_weights
    t0, losses = time.time(), []
    budget = 60 * a.time_limit_min if a.time_limit_min else None
    model.train()
    step = 0
    cap = a.min_hops if a.curriculum_em else a.max_hops  # the hardest level trained so far
    while True:
        # linear decay over the run's progress: the larger of step / --steps and elapsed / --time-limit-min,
        # so a run on a loaded machine still finishes its schedule (lr down to --min-lr-frac) in time
        progress = max(step / a.steps, (time.time() - t0) / budget if budget else 0.0)
        if progress >= 1.0:
            break
        f = (step + 1) / a.warmup if step < a.warmup else max(a.min_lr_frac, 1.0 - progress)
        for g in opt.param_groups:
            g["lr"] = a.lr * f
        if a.curriculum:  # the hardest trained level grows from min_hops to max_hops over this share of the run
            cap = min(a.max_hops, a.min_hops + int(progress / a.curriculum * (a.max_hops - a.min_hops + 1)))
        recs = generate([a.train_seed, step], a.batch, a.min_hops, cap, a.chains)
        if a.recall_frac:
            rrng = np.random.default_rng([a.train_seed, step, 1])
            recs = [recall_record(r, rrng, a.recall_sep) if rrng.random() < a.recall_frac else r for r in recs]
        ids, tgt, mask = make_batch(recs)
        states, _, rope, _ = run_loop(model, ids, a.r_max)
        loss = sum(wi * token_ce(logits_of(model, s, rope), tgt)[mask].mean() for wi, s in zip(w, states)) / sum(w)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), a.clip)
        opt.step()
        step += 1
        losses.append(loss.item())
        last = max(step / a.steps, (time.time() - t0) / budget if budget else 0.0) >= 1.0
        if step % a.log_every == 0 or last:
            rec = {"step": step, "stage": 1, "loss": float(np.mean(losses)), "lr": a.lr * f,
                   "grad_norm": float(gnorm), "progress": round(progress, 4), "max_level": cap, "time_s": round(time.time() - t0, 1)}
            losses = []
            if step % a.eval_every == 0 or last:
                tab = depth_table(model, val, a.r_max)
                rec["val_em_per_depth"] = [round(x["em"], 4) for x in tab]
                rec["val_em_hardest_per_depth"] = [round(x["em_by_difficulty"][a.max_hops], 4) for x in tab]
                # mastery curriculum: the next level joins once the hardest trained one is solved at full depth
                if a.curriculum_em and cap < a.max_hops and tab[-1]["em_by_difficulty"][cap] >= a.curriculum_em:
                    cap += 1
            hist.log(rec)
            print(json.dumps(rec), flush=True)
    a.steps_done = step
    return time.time() - t0


def stage2(a, model, val, hist: History) -> dict:
    """Gate training (LM frozen) on answer tokens, then the default threshold on the validation split."""
    opt = gate_optimizer(model, a.gate_lr)
    t0 = time.time()
    for it in range(a.gate_steps):
        recs = generate([a.train_seed, 10 ** 6 + it], a.batch, a.min_hops, a.max_hops, a.chains)
        ids, tgt, mask = make_batch(recs)
        with torch.no_grad():
            states, _, rope, _ = run_loop(model, ids, a.r_max)
            ce = torch.stack([token_ce(logits_of(model, s, rope), tgt) for s in states])  # [S, B, T]
            labels = (ce - ce[-1:] < a.gate_margin).float()[:-1]  # the last step always stops
        logits = torch.stack([model.gate_logits(s.detach()) for s in states[:-1]])
        m = mask[None].expand_as(labels)
        loss = F.binary_cross_entropy_with_logits(logits[m], labels[m])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if (it + 1) % 25 == 0:
            rec = {"step": a.steps_done + it + 1, "stage": 2, "gate_bce": loss.item(),
                   "stop_label_frac": labels[m].mean().item(), "time_s": round(time.time() - t0, 1)}
            hist.log(rec)
            print(json.dumps(rec), flush=True)
    for p in model.parameters():
        p.requires_grad_(False)
    tf = teacher_forced(model, val, a.r_max)
    full = em_at(tf, val, lambda t: torch.full((t["ok"].shape[1],), a.r_max))
    grid = []
    for q in [round(x, 2) for x in np.arange(0.3, 0.99, 0.05)]:
        pol = ExitPolicy("learned", q, 1, a.r_max)
        r = em_at(tf, val, lambda t: exit_depths(t["gate"], pol)) | {"threshold": q}
        grid.append(r)
    ok = [r for r in grid if r["em"] >= full["em"] - a.em_tol]
    best = min(ok, key=lambda r: r["mean_depth"]) if ok else max(grid, key=lambda r: r["em"])
    return {"full_depth": full, "chosen": best, "grid": grid, "gate_time_s": time.time() - t0}


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--run-dir", type=Path, required=True)
    p.add_argument("--save-to", type=Path)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--ffn", type=int, default=256)
    p.add_argument("--core", type=int, default=2)
    p.add_argument("--r-max", type=int, default=4)
    p.add_argument("--ctx", type=int, default=128)
    p.add_argument("--min-hops", type=int, default=1)
    p.add_argument("--max-hops", type=int, default=4)
    p.add_argument("--chains", type=int, default=3)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--time-limit-min", type=float, default=0,
                   help="stage I ends after this many minutes or --steps, whichever comes first; the lr decay follows")
    p.add_argument("--curriculum", type=float, default=0.0,
                   help="share of the run over which the trained levels grow from --min-hops to --max-hops (0: off)")
    p.add_argument("--curriculum-em", type=float, default=0.0,
                   help="mastery curriculum: start at --min-hops and add the next level when the validation exact "
                        "match of the hardest trained level at full depth reaches this (0: off; checked every --eval-every)")
    p.add_argument("--recall-frac", type=float, default=0.0,
                   help="share of training records turned into recall records (see recall_record)")
    p.add_argument("--recall-sep", choices=[";", ","], default=";",
                   help="recall records' separator: ';' (statements) or ',' (the answers' format, '.' at the end)")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--min-lr-frac", type=float, default=0.05)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--wd", type=float, default=0.1)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--embed-std", type=float, default=1.0)
    p.add_argument("--step-weights", type=float, nargs="+", default=None, help="default: 1 per step")
    p.add_argument("--gate-steps", type=int, default=200)
    p.add_argument("--gate-lr", type=float, default=3e-3)
    p.add_argument("--gate-margin", type=float, default=0.1)
    p.add_argument("--em-tol", type=float, default=0.01)
    p.add_argument("--train-seed", type=int, default=0, help="batches are drawn with seed [train_seed, step]")
    p.add_argument("--val-seed", type=int, default=5, help="validation split (threshold choice, curves)")
    p.add_argument("--val-n", type=int, default=256)
    p.add_argument("--seed", type=int, default=0, help="weight init")
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--log-every", type=int, default=20)
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args(argv)
    a.step_weights = a.step_weights or [1.0] * a.r_max
    if len(a.step_weights) != a.r_max:
        p.error(f"--step-weights needs r_max={a.r_max} values")
    a.arch, a.vocab, a.prelude, a.coda = "ouro", len(VOCAB), 0, 0
    return a


def write_tokens(argv: list[str]) -> None:
    """`python -m train.lab tokens --seed S --n N --out FILE.npy`: records of the task encoded back
    to back (prompt, answer, EOS), int32: token windows for train/shared_kv.py --tokens."""
    p = argparse.ArgumentParser(prog="python -m train.lab tokens", description=write_tokens.__doc__.split("\n")[0])
    add_generator_args(p)
    p.add_argument("--mask-out", type=Path, help="also write the loss mask (1: an answer token or its EOS), for "
                   "shared_kv.py --loss-mask")
    a = p.parse_args(argv)
    ids, mask = [], []
    for r in generate(a.seed, a.n, a.min_hops, a.max_hops, a.chains):
        prompt, answer = encode(r["prompt"]), encode(r["answer"]) + [0]
        ids += prompt + answer
        mask += [0] * len(prompt) + [1] * len(answer)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    np.save(a.out, np.asarray(ids, dtype=np.int32))
    if a.mask_out:
        np.save(a.mask_out, np.asarray(mask, dtype=np.uint8))
    print(f"wrote {a.out}: {len(ids)} tokens of {a.n} records (seed {a.seed})" + (f", mask {a.mask_out}" if a.mask_out else ""))


def record_rows(records: list[dict]):
    """train.shared_kv.Rows of records: each row the prompt's ids (what the engine prefills: the
    checkpoint's tokenizer gives the same ids, no BOS) then the answer's ids and EOS (the completion)."""
    from train.shared_kv import Rows
    return Rows.from_lists([(encode(r["prompt"]), encode(r["answer"]) + [0]) for r in records])


def write_rows(argv: list[str]) -> None:
    """`python -m train.lab rows --seed S --n N --out FILE.npz`: one record per row (prompt, answer,
    EOS; the prompt's length per row) for train/shared_kv.py --rows / --heldout-rows."""
    p = argparse.ArgumentParser(prog="python -m train.lab rows", description=write_rows.__doc__.split("\n")[0])
    add_generator_args(p)
    a = p.parse_args(argv)
    rows = record_rows(generate(a.seed, a.n, a.min_hops, a.max_hops, a.chains))
    rows.meta = {"generator": "train.tasks.hops", "seed": a.seed, "n": a.n, "min_hops": a.min_hops,
                 "max_hops": a.max_hops, "chains": a.chains}
    rows.save(a.out)
    print(f"wrote {a.out}: {len(rows)} rows, {len(rows.ids)} tokens, {len(set(rows.prompt_len.tolist()))} prompt "
          f"lengths (seed {a.seed})")


def write_lengths(argv: list[str]) -> None:
    """`python -m train.lab lengths --seed S --n N --out FILE.csv`: each record's prompt and answer
    (+ EOS) token counts, a length trace for the benchmarks (`--workloads FILE.csv`, a sweep's
    bench_workload), so throughput is measured on the task's own shapes."""
    p = argparse.ArgumentParser(prog="python -m train.lab lengths", description=write_lengths.__doc__.split("\n")[0])
    p.add_argument("--seed", type=int, required=True)
    p.add_argument("--n", type=int, required=True)
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args(argv)
    rows = [(len(encode(r["prompt"])), len(encode(r["answer"])) + 1) for r in generate(a.seed, a.n)]
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text("prompt_tokens,output_tokens\n" + "".join(f"{p},{o}\n" for p, o in rows))
    print(f"wrote {a.out}: {len(rows)} rows (seed {a.seed})")


def main(argv=None) -> None:
    import sys
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["tokens"]:
        return write_tokens(argv[1:])
    if argv[:1] == ["lengths"]:
        return write_lengths(argv[1:])
    if argv[:1] == ["rows"]:
        return write_rows(argv[1:])
    a = parse(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    a.run_dir.mkdir(parents=True, exist_ok=True)
    (a.run_dir / "args.json").write_text(json.dumps({k: str(v) if isinstance(v, Path) else v
                                                     for k, v in vars(a).items()}, indent=2))
    cfg = model_config(a)
    model = init_weights(build_model(cfg), seed=a.seed, std=0.02)
    with torch.no_grad():  # see train/pretrain.py --embed-std: Ouro's sandwich norms drown a 0.02 embedding
        model.model.embed_tokens.weight.normal_(0.0, a.embed_std, generator=torch.Generator().manual_seed(a.seed + 1))
    for n, p in model.named_parameters():
        p.requires_grad_("exit_gate" not in n)
    val = generate(a.val_seed, a.val_n, a.min_hops, a.max_hops, a.chains)
    hist = History(a.run_dir / "history.json")
    hist.records = []
    print(f"{cfg.name}: {sum(p.numel() for p in model.parameters()) / 1e6:.3f}M params, vocab {len(VOCAB)}",
          flush=True)
    t1 = stage1(a, model, val, hist)
    choice = stage2(a, model, val, hist)
    q = choice["chosen"]["threshold"]
    print(json.dumps({"threshold_choice": choice["chosen"], "full_depth": choice["full_depth"]}), flush=True)
    summary = {"stage1_s": t1, "stage1_steps": a.steps_done, "gate_s": choice["gate_time_s"], "threshold": q,
               "threshold_choice": choice}
    (a.run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    model.cfg = replace(model.cfg, exit_criterion="learned", exit_threshold=q, r_min=1)
    if a.save_to is not None:
        save_pretrained(model, a.save_to, dtype="float32")
        save_tokenizer(char_tokenizer(), a.save_to)
        (a.save_to / "history.json").write_text(json.dumps(hist.records) + "\n")
        (a.save_to / "train_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        print(f"saved {a.save_to}", flush=True)


if __name__ == "__main__":
    main()

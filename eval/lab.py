"""Held-out evaluation of a lab checkpoint THROUGH THE ENGINE (infer.LLM, policy cdb), and its model card.

    python -m eval.lab --model checkpoints/lab-hops --seed 7 --n 512 --out checkpoints/lab-hops/eval.json \
        [--card --run-dir .cache/runs/lab-hops --command "..."]

Greedy generation of every held-out prompt (`train.tasks.hops`, a seed the training never used),
exact match of the generated text against the answer, per difficulty (the record's hardest hop count):
- at each fixed depth d = 1..r_max (per-request r_min = r_max = d: every decoded token runs d loops);
- with the learned gate at the checkpoint's threshold (r_min 1), and over a grid of thresholds and
  r_min values: accuracy against mean exit depth.
Exit depths come from the engine (`RequestOutput.exit_depths`), grouped by the answer character's
difficulty (0: a copied name or `=`/`,`/`.`; h: a value needing h hops). The first answer token
comes from the prompt's prefill (always full depth), so it is left out of the depth statistics.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from train.tasks.hops import generate


def run(llm, records: list[dict], per_record: bool = False, **overrides) -> dict:
    """Exact match and exit depths of `records` through `llm` (greedy). `per_record`: also each
    record's correctness and answer-token depth sum / count (`items`, for a paired bootstrap)."""
    from infer.engine.sampling_params import SamplingParams
    sp = SamplingParams(max_tokens=max(len(r["answer"]) for r in records) + 2, temperature=0.0, **overrides)
    t0 = time.time()
    outs = llm.generate([r["prompt"] for r in records], sp, use_tqdm=False)
    by, depth_by, all_depths = {}, {}, []
    items = {"correct": [], "depth_sum": [], "depth_n": []}
    for r, o in zip(records, outs):
        by.setdefault(r["difficulty"], []).append(o.text.strip() == r["answer"])
        n0 = len(all_depths)
        # each answer token's difficulty: that of its first character (`x=` tokens are copies)
        starts = [a for a, _ in llm.tokenizer(r["answer"], return_offsets_mapping=True)["offset_mapping"]]
        for j, d in enumerate(o.exit_depths[1:len(starts)], start=1):  # [0]: the prefill's token
            depth_by.setdefault(r["token_difficulty"][starts[j]], []).append(d)
            all_depths.append(d)
        items["correct"].append(float(by[r["difficulty"]][-1]))
        items["depth_sum"].append(float(sum(all_depths[n0:])))
        items["depth_n"].append(len(all_depths) - n0)
    easy = depth_by.get(0, [])
    hard = [d for k, v in depth_by.items() if k > 0 for d in v]
    res = {"overrides": overrides, "acc": float(np.mean([x for v in by.values() for x in v])),
           "acc_by_difficulty": {str(k): float(np.mean(v)) for k, v in sorted(by.items())},
           "mean_exit_depth": float(np.mean(all_depths)),
           "mean_exit_depth_by_token_difficulty": {str(k): float(np.mean(v)) for k, v in sorted(depth_by.items())},
           "easy_mean_depth": float(np.mean(easy)), "hard_mean_depth": float(np.mean(hard)),
           "hard_over_easy": float(np.mean(hard) / np.mean(easy)), "wall_s": round(time.time() - t0, 1),
           "seconds": time.time() - t0, "output_tokens": sum(len(o.token_ids) for o in outs)}
    if per_record:
        res["items"] = items
    return res


def evaluate(model: str | Path, seed: int, n: int, min_hops: int = 1, max_hops: int = 4, chains: int = 3,
             thresholds=(0.5, 0.7, 0.9), r_mins=(1, 2), full: bool = True, kv_layout: str | None = None) -> dict:
    from infer.engine.llm import LLM
    records = generate(seed, n, min_hops, max_hops, chains)
    llm = LLM(str(model), policy="cdb", max_batch_size=128, dtype="float32", device="cpu", kv_layout=kv_layout)
    cfg = llm.model.cfg
    out = {"model": str(model), "heldout": {"generator": "train.tasks.hops", "seed": seed, "n": n,
                                            "min_hops": min_hops, "max_hops": max_hops, "chains": chains},
           "r_max": cfg.r_max, "threshold": cfg.exit_threshold, "kv_layout": llm.engine.config.kv_layout}
    out["fixed_depth"] = [run(llm, records, r_min=d, r_max=d) | {"depth": d} for d in range(1, cfg.r_max + 1)]
    out["gate"] = run(llm, records) | {"threshold": cfg.exit_threshold, "r_min": cfg.r_min}
    if full:
        out["sweep"] = [run(llm, records, exit_threshold=q, r_min=rm) | {"threshold": q, "r_min": rm}
                        for rm in r_mins for q in thresholds]
    return out


def pct(x: float) -> str:
    return f"{100 * x:.1f}"


def tables(ev: dict) -> list[str]:
    levels = list(ev["fixed_depth"][0]["acc_by_difficulty"])
    L = ["| loops (fixed) | all | " + " | ".join(f"{k} hops" for k in levels) + " |",
         "|---|---|" + "---|" * len(levels)]
    for r in ev["fixed_depth"]:
        L.append(f"| {r['depth']} | {pct(r['acc'])} | " + " | ".join(pct(r["acc_by_difficulty"][k]) for k in levels) + " |")
    g = ev["gate"]
    L.append(f"| learned gate (q={g['threshold']}, r_min={g['r_min']}) | {pct(g['acc'])} | " +
             " | ".join(pct(g["acc_by_difficulty"][k]) for k in levels) + " |")
    kd = list(g["mean_exit_depth_by_token_difficulty"])
    L += ["", "Mean exit depth per answer token, learned gate at the default threshold (engine `exit_depths`, "
          "first answer token excluded: it comes from the full-depth prefill):", "",
          "| token difficulty | " + " | ".join("0 (copy/format)" if k == "0" else f"{k} hops" for k in kd) + " |",
          "|---|" + "---|" * len(kd),
          "| mean exit depth | " + " | ".join(f"{g['mean_exit_depth_by_token_difficulty'][k]:.2f}" for k in kd) + " |",
          "", f"Hard (value) tokens {g['hard_mean_depth']:.2f} vs easy tokens {g['easy_mean_depth']:.2f}: "
          f"{g['hard_over_easy']:.2f}x."]
    if ev.get("sweep"):
        L += ["", "Exit threshold and r_min sweep (learned gate):", "",
              "| r_min | q | acc | " + " | ".join(f"{k} hops" for k in levels) + " | mean depth | easy depth | hard depth |",
              "|---|---|---|" + "---|" * len(levels) + "---|---|---|"]
        for r in ev["sweep"]:
            L.append(f"| {r['r_min']} | {r['threshold']} | {pct(r['acc'])} | " +
                     " | ".join(pct(r["acc_by_difficulty"][k]) for k in levels) +
                     f" | {r['mean_exit_depth']:.2f} | {r['easy_mean_depth']:.2f} | {r['hard_mean_depth']:.2f} |")
    return L


def card(ev: dict, run_dir: Path, command: str, model: Path, note: Path | None = None) -> str:
    from looplm.config import LoopConfig
    cfg = LoopConfig.from_json(model / "config.json")
    args = json.loads((run_dir / "args.json").read_text())
    summ = json.loads((run_dir / "summary.json").read_text())
    hist = json.loads((run_dir / "history.json").read_text())
    s1 = [h for h in hist if h.get("stage") == 1 and "val_em_per_depth" in h]
    size = (model / "model.safetensors").stat().st_size
    L = [f"# {model.name}: k-hop variable chasing, an Ouro-style looped model trained from scratch", "",
         f"An Ouro-style `0-{cfg.n_core}-0` looped LM (hidden {cfg.hidden_size}, {cfg.num_heads} heads, FFN "
         f"{cfg.intermediate_size}, r_max {cfg.r_max}, learned exit gate; {size / 1e6:.2f} MB float32, "
         f"tokenizer of {cfg.vocab_size} ids: `x=` one token, any other character one) trained from scratch on `train/tasks/hops.py`: "
         "shuffled chains of assignments `b=a;a=4;...;?b,...:` answered `b=4,...`. A value needing h hops "
         "needs h dependent look-ups, about one per layer, so a single pass of the 2-layer block cannot "
         "answer the deep chains while names, `=`, `,` and `.` (copies and format) are easy at depth 1.", "",
         "## Training", f"Command: `{command}` (one CPU thread, on a 2-core machine shared with other jobs).", "",
         f"- Stage I: {summ['stage1_steps']} steps of {args['batch']} freshly generated records (difficulty "
         f"{args['min_hops']}..{args['max_hops']} hops, {args['chains']} chains), {summ['stage1_s'] / 60:.1f} min; "
         f"cross-entropy on the answer tokens at every loop step (weights {args['step_weights']}), AdamW lr "
         f"{args['lr']}, warmup {args['warmup']}, linear decay over max(step / {args['steps']}, elapsed / "
         f"{args['time_limit_min']} min); embedding std {args['embed_std']}; "
         f"{100 * args.get('recall_frac', 0):.0f}% of the records replaced by recall records (the statements, `|`, "
         "the statements again with every right-hand side predicted: one-hop look-ups, training only)"
         + (f"; curriculum over the first {100 * args['curriculum']:.0f}%" if args.get("curriculum") else "")
         + (f"; mastery curriculum: training starts on {args['min_hops']}-hop records and the next level joins "
            f"when the hardest trained one reaches {100 * args['curriculum_em']:.0f}% validation exact match at "
            "full depth (checked every " + str(args["eval_every"]) + " steps)" if args.get("curriculum_em") else "")
         + ".",
         f"- Stage II: exit gate (LM frozen), {args['gate_steps']} steps, {summ['gate_s'] / 60:.1f} min, label "
         f"'CE now within {args['gate_margin']} of CE at r_max'; default threshold q = {summ['threshold']} chosen "
         f"on the validation split (seed {args['val_seed']}) as the smallest mean depth within "
         f"{args['em_tol']} exact match of full depth.",
         f"- Seeds: training batches `[train_seed={args['train_seed']}, step]`, gate batches "
         f"`[{args['train_seed']}, 10**6 + i]`, validation {args['val_seed']}, held-out {ev['heldout']['seed']} "
         "(never used by training), init seed " + str(args["seed"]) + ".", "",
         "![loss curve](loss_curve.png)", "",
         "Validation exact match during training (teacher-forced, per fixed depth 1..r_max; hardest level):", "",
         "| step | all, depth 1..r_max | hardest, depth 1..r_max |", "|---|---|---|"]
    for h in s1[:: max(1, len(s1) // 12)] + ([s1[-1]] if s1 and len(s1) % max(1, len(s1) // 12) != 1 else []):
        L.append(f"| {h['step']} | {' / '.join(pct(x) for x in h['val_em_per_depth'])} | "
                 f"{' / '.join(pct(x) for x in h['val_em_hardest_per_depth'])} |")
    H = ev["heldout"]
    L += ["", f"## Held-out results (engine, policy cdb, greedy; {H['n']} records of `python -m train.tasks.hops "
          f"--seed {H['seed']} --n {H['n']}`, difficulty {H['min_hops']}..{H['max_hops']})", "",
          f"Exact match (%) of the whole answer by the record's difficulty (its hardest value's hops). "
          f"Command: `python -m eval.lab --model {model} --seed {H['seed']} --n {H['n']}`.", ""]
    L += tables(ev)
    if note is not None:
        L += ["", note.read_text().rstrip()]
    L += ["", "## Files", "`config.json`, `model.safetensors` (float32), tokenizer files, "
          "`history.json` (training log), `train_summary.json` (threshold choice), `eval.json` (the tables above), "
          "`loss_curve.png`.", ""]
    return "\n".join(L)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--n", type=int, default=512)
    p.add_argument("--min-hops", type=int, default=1)
    p.add_argument("--max-hops", type=int, default=4)
    p.add_argument("--chains", type=int, default=3)
    p.add_argument("--out", type=Path)
    p.add_argument("--kv-layout", default=None, help="default: the checkpoint's")
    p.add_argument("--thresholds", type=float, nargs="+", default=[0.5, 0.7, 0.9], help="the sweep's exit thresholds")
    p.add_argument("--r-mins", type=int, nargs="+", default=[1, 2], help="the sweep's r_min values")
    p.add_argument("--no-sweep", action="store_true")
    p.add_argument("--card", action="store_true", help="also write MODEL/README.md and loss_curve.png")
    p.add_argument("--run-dir", type=Path)
    p.add_argument("--command", default="")
    p.add_argument("--note", type=Path, default=None, help="markdown added to the card before the file list")
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args(argv)
    import torch
    if a.threads:
        torch.set_num_threads(a.threads)
    ev = evaluate(a.model, a.seed, a.n, a.min_hops, a.max_hops, a.chains, a.thresholds, a.r_mins,
                  full=not a.no_sweep, kv_layout=a.kv_layout)
    txt = json.dumps(ev, indent=2)
    if a.out:
        a.out.write_text(txt + "\n")
    print("\n".join(tables(ev)))
    if a.card:
        from train.model_card import plot
        plot(json.loads((a.run_dir / "history.json").read_text()), a.model / "loss_curve.png", a.model.name)
        (a.model / "README.md").write_text(card(ev, a.run_dir, a.command, a.model, a.note))
        print(f"wrote {a.model / 'README.md'}")


if __name__ == "__main__":
    main()

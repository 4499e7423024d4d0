"""Write a checkpoint's loss-curve PNG and model-card README from its training history and the
JSON that train/evaluate.py printed.

    python train/model_card.py --model checkpoints/ouro-demo --eval checkpoints/ouro-demo/eval.json \
        --run-dir .cache/runs/ouro-demo --command "train/demo_runs.sh ouro"
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from looplm.config import LoopConfig


def plot(history: list[dict], out: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    s1 = [h for h in history if h.get("stage") == 1]
    ev = [h for h in s1 if "ppl_heldout" in h]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    ax1.plot([h["step"] for h in s1], [h["loss"] for h in s1], lw=1)
    ax1.set(xlabel="step", ylabel="train loss (stage I)", title=title)
    ax1.grid(alpha=0.3)
    if ev:
        n = len(ev[0]["ppl_heldout"])
        for d in range(n):
            ax2.plot([h["step"] for h in ev], [h["ppl_heldout"][d] for h in ev], label=f"depth {d + 1}", lw=1)
        ax2.set(xlabel="step", ylabel="held-out perplexity", yscale="log", title="held-out ppl per loop depth")
        ax2.legend(fontsize=7)
        ax2.grid(alpha=0.3, which="both")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def fmt_hist(h: list[float]) -> str:
    return " / ".join(f"{100 * x:.1f}%" for x in h)


def card(cfg: LoopConfig, ev: dict, history: list[dict], choice: dict | None, a) -> str:
    s1 = [h for h in history if h.get("stage") == 1]
    s2 = [h for h in history if h.get("stage") == 2]
    params = a.params
    d = ev.get("default", {})
    lines = [
        f"# {a.model.name}: {cfg.name} looped LM trained from scratch (demo)",
        "",
        f"A {params / 1e6:.2f}M-parameter {cfg.arch.capitalize()}-style looped LM for the looplm toolkit's tests, "
        "demos and benchmarks. Too small for any real use; it exists so that depth adaptation has "
        "something real to adapt to.",
        "",
        "## Data",
        "Byte-level BPE (2,048 tokens) over the Wikipedia excerpt and Lee news corpus shipped inside the "
        "`gensim==4.4.0` wheel (markup stripped; CC BY-SA / Lee corpus terms) plus a ~10% synthetic "
        "reasoning component (chained assignments, multi-digit additions, word problems) "
        "(`train/data.py`, `train/tokenizer.py`). ~1.15M training tokens; held-out: ~115k tokens of "
        "held-out documents (no synthetic text), plus a separate synthetic held-out file.",
        "",
        "## Training",
        f"Command: `{a.command}` (`train/pretrain.py`; resumable, one CPU thread).",
        "",
        a.recipe,
        "",
        f"- Stage I: {s1[-1]['step']} steps, {s1[-1]['time_s'] / 60:.0f} min on one CPU core "
        f"(shared with a second run), final train loss {s1[-1]['loss']:.3f}.",
    ]
    if s2:
        lines.append(f"- Stage II (gate, LM frozen): {s2[-1]['step'] - s1[-1]['step']} steps, "
                     f"{s2[-1]['time_s'] / 60:.1f} min, final BCE {s2[-1]['gate_bce']:.3f}.")
    if choice:
        c = choice["chosen"]
        lines.append(f"- Default threshold q = {c['threshold']} chosen on the first half of the held-out text: the "
                     f"smallest mean depth whose perplexity is within 2% of full depth "
                     f"(there: mean depth {c['mean_depth']:.2f}, {100 * c['rel_ppl']:+.2f}%).")
    lines += ["", "![loss curve](loss_curve.png)", "",
              f"## Held-out results (`train/evaluate.py`, {ev['tokens']:,} tokens, windows of {ev['ctx']})", "",
              "| depth | " + " | ".join(str(i + 1) for i in range(len(ev["ppl_per_depth"]))) + " |",
              "|---|" + "---|" * len(ev["ppl_per_depth"]),
              "| held-out ppl | " + " | ".join(f"{x:.2f}" for x in ev["ppl_per_depth"]) + " |"]
    if "synthetic_ppl_per_depth" in ev:
        lines.append("| synthetic held-out ppl | " + " | ".join(f"{x:.3f}" for x in ev["synthetic_ppl_per_depth"]) + " |")
    lines += ["", f"Full depth vs depth 1: {100 * ev['looping_gain']:.1f}% lower perplexity."]
    if d:
        lines += ["", f"**Default exit** ({d['criterion']}, q = {d['threshold']}, r_min = {d['r_min']}): perplexity "
                  f"{d['ppl']:.2f} ({100 * d['rel_ppl_vs_full']:+.2f}% vs full depth {ev['full_depth_ppl']:.2f}), "
                  f"mean depth {d['mean_depth']:.2f} of {cfg.r_max} ({d['mean_depth_over_r_max']:.2f} r_max).",
                  "", "Exit-depth histogram at the default threshold (depth 1 ... r_max): " + fmt_hist(d["depth_hist"])]
    if ev.get("criteria"):
        lines += ["", "| criterion | threshold | ppl | vs full | mean depth | histogram |", "|---|---|---|---|---|---|"]
        for c, r in ev["criteria"].items():
            lines.append(f"| {c} | {r['threshold']:.3g} | {r['ppl']:.2f} | {100 * r['rel_ppl_vs_full']:+.2f}% | "
                         f"{r['mean_depth']:.2f} | {fmt_hist(r['depth_hist'])} |")
    if ev.get("threshold_sweep"):
        lines += ["", "Gate threshold sweep (standard: exit after step s when the gate fires at s; lookahead: the "
                  "same gate read one step early, exit after s+1):", "",
                  "| q | standard ppl | standard depth | lookahead ppl | lookahead depth |", "|---|---|---|---|---|"]
        for r in ev["threshold_sweep"]:
            lines.append(f"| {r['threshold']} | {r['standard']['ppl']:.2f} | {r['standard']['mean_depth']:.2f} | "
                         f"{r['lookahead']['ppl']:.2f} | {r['lookahead']['mean_depth']:.2f} |")
    if ev.get("layouts"):
        L = ev["layouts"]
        lines += ["", f"KV layouts at the default exit policy (exact emulation of the engine, first {L['windows']} "
                  "windows, first token of each window as the prompt):", "",
                  "| layout | ppl | mean depth |", "|---|---|---|"]
        for lay in ("full_depth", "last_exited", "shared"):
            lines.append(f"| {lay} | {L[lay]['ppl']:.2f} | {L[lay]['mean_depth']:.2f} |")
        lines.append(f"\nshared vs last_exited: {100 * L['shared_vs_last_exited']:+.2f}%.")
    if a.append is not None:
        lines += ["", a.append.read_text().rstrip()]
    lines += ["", "## Files", "`config.json` (real " + ("Ouro" if cfg.arch == "ouro" else "Huginn") +
              " format plus `exit_criterion`, `exit_threshold`, `r_min`, `exit_gate`), `model.safetensors` "
              f"({a.dtype}), tokenizer files, `history.json` (training log), `eval.json` (the figures above), "
              "`loss_curve.png`.", ""]
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--eval", type=Path, required=True)
    p.add_argument("--run-dir", type=Path, required=True)
    p.add_argument("--command", default="")
    p.add_argument("--recipe", default="")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--append", type=Path, default=None, help="markdown appended before the file list")
    a = p.parse_args(argv)
    cfg = LoopConfig.from_json(a.model / "config.json")
    from looplm.io import load_pretrained
    a.params = sum(x.numel() for x in load_pretrained(a.model).parameters())
    history = json.loads((a.run_dir / "history.json").read_text())
    ev = json.loads(a.eval.read_text())
    choice_f = a.run_dir / "threshold_choice.json"
    choice = json.loads(choice_f.read_text()) if choice_f.exists() else None
    plot(history, a.model / "loss_curve.png", a.model.name)
    (a.model / "README.md").write_text(card(cfg, ev, history, choice, a))
    print(f"wrote {a.model / 'README.md'} and loss_curve.png")


if __name__ == "__main__":
    from train.cli import run
    run(main)

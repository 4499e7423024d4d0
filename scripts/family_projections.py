"""H100 projections of the looped families beyond the paper's two (docs/results/families.md): the
simulator (`python -m infer.sim`, the real scheduler and engine on the roofline cost model with the
dispatch charge) at each family's real shape on the three workloads, and one table of them.

    python -m scripts.family_projections --run     # the sims (~5 min on one core), JSON in --out
    python -m scripts.family_projections           # the table from the JSON already there
    python -m scripts.family_projections --dummy   # LLM(folder, load_format="dummy") at each real shape

The mean exit depths are assumptions, not measurements: no released checkpoint of these families has
an exit gate, and the retrofits' kl / latent_diff exits were not measured at these shapes here. Each
row says which depth it assumed; the bounds S_dec / S_e2e are the seed paper's at that depth.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

# (preset, assumed mean exit depth): Ouro-1.4B's projection depth for Ouro-2.6B; a quarter and a half of
# r_max 32 for the retrofits; one token in two leaving Nanbeige's 2 loops after the first
RUNS = [("ouro-2.6b", 2.5), ("retro-llama-3.2-1b", 8), ("retro-llama-3.2-1b", 16), ("retro-tinyllama-1.1b", 8),
        ("retro-tinyllama-1.1b", 16), ("retro-olmo2-1b", 8), ("retro-olmo2-1b", 16), ("nanbeige4.2-3b", 1.5)]


def run(out: Path) -> None:
    for model, depth in RUNS:
        cmd = [sys.executable, "-m", "infer.sim", "--model", model, "--mean-depth", str(depth), "--num-requests",
               "256", "--ks", "1", "4", "16", "--out", str(out)]
        print(" ".join(cmd[1:]), flush=True)
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)


def dummy_load(names: list[str]) -> list[dict]:
    """`LLM(folder, load_format="dummy")` on a folder holding only each real shape's config.json (bf16,
    on this CPU; ~8 GB of memory for Nanbeige4.2-3B): its parameters, build time and two tokens."""
    import tempfile
    import time

    from infer import LLM, SamplingParams
    from looplm.presets import paper_config
    out = []
    for name in names:
        with tempfile.TemporaryDirectory() as d:
            paper_config(name).save(Path(d) / "config.json")
            t = time.perf_counter()
            llm = LLM(d, load_format="dummy", dtype="bfloat16", kv_cache_tokens=64, max_batch_size=1)
            built = time.perf_counter() - t
            o = llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=2, ignore_eos=True))[0]
            m = llm.engine.model
            out.append({"preset": name, "structure": m.cfg.name, "params": sum(p.numel() for p in m.parameters()),
                        "build_s": round(built, 1), "tokens": o.token_ids, "exit_depths": o.exit_depths})
            print(json.dumps(out[-1]), flush=True)
            del llm, m
    return out


def rows(out: Path) -> list[dict]:
    table = []
    for model, depth in RUNS:
        f = out / f"sim_{model}_d{depth:g}.json"
        if not f.exists():
            raise SystemExit(f"error: {f} is missing: run with --run first")
        d = json.loads(f.read_text())
        for w in d["workloads"]:
            res = {r["mode"]: r for r in w["results"]}
            best = max((r for r in w["results"] if r["mode"].startswith("cdb_refill")),
                       key=lambda r: r["output_tokens_per_s"])
            table.append({"model": model, "structure": d["config"], "mean_depth": depth,
                          "workload": w["workload"]["workload"], "alpha": res["cb"]["alpha"],
                          "s_dec": best["s_dec"], "s_e2e": best["s_e2e"],
                          "cb_tok_s": res["cb"]["output_tokens_per_s"],
                          "norefill_vs_cb": res["cdb_norefill"]["speedup_vs_cb"],
                          "best_refill": best["mode"], "best_refill_vs_cb": best["speedup_vs_cb"],
                          "full_depth_vs_cb": w["full_depth_vs_cb"], "command": d["command"]})
    return table


def markdown(table: list[dict]) -> str:
    lines = ["| model | structure | mean depth (assumed) | workload | CB alpha | S_dec | S_e2e | CB tok/s | "
             "no-refill / CB | best refill / CB | CDB full depth / CB |", "|" + "---|" * 11]
    for r in table:
        lines.append(f"| {r['model']} | {r['structure']} | {r['mean_depth']:g} | {r['workload']} | {r['alpha']:.3f} | "
                     f"{r['s_dec']:.2f} | {r['s_e2e']:.2f} | {r['cb_tok_s']:.0f} | {r['norefill_vs_cb']:.3f} | "
                     f"{r['best_refill_vs_cb']:.3f} ({r['best_refill'].removeprefix('cdb_')}) | "
                     f"{r['full_depth_vs_cb']:.3f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=Path("outputs/families"))
    p.add_argument("--run", action="store_true", help="run the simulations first")
    p.add_argument("--dummy", action="store_true", help="only build each real shape with dummy weights")
    a = p.parse_args(argv)
    if a.dummy:
        a.out.mkdir(parents=True, exist_ok=True)
        rows_ = dummy_load(list(dict.fromkeys(m for m, _ in RUNS)))
        (a.out / "dummy_load.json").write_text(json.dumps(rows_, indent=1) + "\n")
        return
    if a.run:
        run(a.out)
    table = rows(a.out)
    (a.out / "projections.json").write_text(json.dumps(table, indent=1) + "\n")
    print(markdown(table))


if __name__ == "__main__":
    main()

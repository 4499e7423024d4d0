"""Exact work counts of a run, from the engine's step trace (the bench, the online bench and the
simulator all keep one): what a run did, independent of how fast the machine did it.

- `launches`: stage calls per stage kind (prefill, prelude, core, coda, fused).
- `layer_token_passes`: token rows x the layers each launch runs them through, per stage of the
  model: `prelude` / `core` / `coda` layers (a fused or prefill launch counts its prelude, r_max
  core steps and coda there), and `lm_head_rows` (rows through the LM head). Prompt chunks that
  ride in a launch count with its rows; padding rows are not counted (they are `padded` in the
  trace).
- `weight_bytes`: per launch, the weights of the stages it runs (B.stage_params, core once per
  loop step), times the dtype's bytes: what a memory-bound GPU streams.
- `kv_rows_read`: KV rows attention reads, summed over attention layers: each decode item its
  context, each prompt position its prefix (causal), at every layer its launch runs.
- `flops`: the matmul FLOPs of those passes (2 x rows x the weights they meet, the LM head only for
  head rows) plus attention's 4 x heads x head_dim per KV row read.

These depend only on the requests, the policy and the exit depths (offline: the schedule is a
function of them), so the same command gives the same counts on any machine. `ratios` divides a
mode's compute (`flops`) and weight traffic (`weight_bytes`) by CB's.
"""
from __future__ import annotations

from infer.engine.trace import TraceRow
from looplm.config import LoopConfig

from . import bounds as B

STAGES = ("prefill", "prelude", "core", "coda", "fused")


def work_counts(trace: list[TraceRow], cfg: LoopConfig, dtype_bytes: int) -> dict:
    """The `work` block of one run's trace (rows of LLMEngine._record or the simulator's)."""
    P = B.stage_params(cfg)
    head = cfg.hidden_size * cfg.vocab_size  # (inside P["coda"]; only head rows meet it)
    layers = {"prelude": cfg.n_prelude, "core": cfg.n_core, "coda": cfg.n_coda}
    launches = dict.fromkeys(STAGES, 0)
    passes = {"prelude": 0, "core": 0, "coda": 0, "lm_head_rows": 0}
    weights = kv = flops = 0
    for r in trace:
        st = r["stage"]
        launches[st] += 1
        if st == "prefill":  # whole prompts at full depth: rows = prompt tokens, one head row each
            rows, heads, ctx = r["tokens"], r["batch"], r.get("context_pairs", 0)
        else:  # decode items (+ prompt chunks riding along)
            rows = r["batch"] + r.get("prompt_tokens", 0)
            heads = r["batch"] + r.get("finals", 0)
            ctx = r["context"] + r.get("prompt_pairs", 0)
        if st in ("prefill", "fused"):
            steps = r.get("r_max", cfg.r_max)
            runs = {"prelude": 1, "core": steps, "coda": 1}
        else:
            runs = {st: 1}
        for part, k in runs.items():
            passes[part] += rows * layers[part] * k
            weights += P[part] * k
            kv += ctx * layers[part] * k
            flops += 2 * rows * (P[part] - (head if part == "coda" else 0)) * k
        if "coda" in runs:
            passes["lm_head_rows"] += heads
            flops += 2 * heads * head
    flops += 4 * cfg.num_heads * cfg.head_dim * kv
    return {"launches": launches, "layer_token_passes": passes, "weight_bytes": weights * dtype_bytes,
            "kv_rows_read": kv, "flops": flops}


def ratios(work: dict, cb: dict | None) -> dict:
    """`compute_ratio` and `weight_traffic_ratio` of a mode to CB (None without a CB run)."""
    if cb is None:
        return {"compute_ratio": None, "weight_traffic_ratio": None}
    return {"compute_ratio": work["flops"] / max(1, cb["flops"]),
            "weight_traffic_ratio": work["weight_bytes"] / max(1, cb["weight_bytes"])}

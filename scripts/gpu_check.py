"""GPU check for the engine's CUDA path (one prepared run; prints and writes JSON).

1. float64 parity on the tiny presets: the engine with CUDA graphs + the lookahead pipeline, and
   eagerly, with the gather + SDPA decode attention and with paged FlexAttention (eager), against
   the sequential reference decoder on the same GPU (tokens and exit depths).
2. An Ouro-1.4B-sized random model in bf16 (0-24-0, d=2048, r_max=4, learned-gate criterion):
   eager+synchronous vs graphs+pipelined: token agreement, throughput, and the GPU idle fraction
   between consecutive core steps (CUDA events around every core launch); CB vs CDB throughput;
   the same with compiled paged FlexAttention (tokens vs the SDPA path, tok/s).

    python -m scripts.gpu_check --out OUT_DIR [--small]
"""
from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch

from infer import EngineConfig, LLMEngine, SamplingParams
from looplm import ExitPolicy, build_model, preset_config, tiny_model
from infer.engine.reference import reference_generate


def run_engine(model, cfg: EngineConfig, reqs, instrument: bool = False, paged: str | None = None):
    """`paged`: None (gather + SDPA), "eager" or "compiled" FlexAttention over the block tables."""
    eng = LLMEngine(model, cfg)
    if paged is not None:
        eng.runner.enable_paged(compile=paged == "compiled")
    events = []
    if instrument:
        def timed(work, seconds):  # an on_launch instrument: an event before and after each core launch
            if work.stage.value != "core":
                return
            if seconds is None:
                events.append((step_no[0], torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)))
                events[-1][1].record(torch.cuda.current_stream(model.device))
            else:
                events[-1][2].record(torch.cuda.current_stream(model.device))
        eng.on_launch.append(timed)
    step_no = [0]  # engine steps so far: tells whether two core launches were consecutive
    seqs = [eng.add_request(p, SamplingParams(max_tokens=n, ignore_eos=True)) for p, n in reqs]
    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)
    t0 = time.perf_counter()
    while eng.has_unfinished():
        step_no[0] += 1
        eng.step()
    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)
    secs = time.perf_counter() - t0
    out = {"seconds": secs, "tokens": sum(len(s.output_ids) for s in seqs),
           "tok_per_s": sum(len(s.output_ids) for s in seqs) / secs, "mean_depth": eng.mean_exit_depth,
           "stage_calls": eng.stats["stage_calls"]}
    if instrument and events:
        busy = gaps = 0.0
        n_gaps = 0
        for (i, s0, e0), (j, s1, e1) in zip(events, events[1:]):
            busy += s0.elapsed_time(e0)
            if j == i + 1:  # consecutive engine steps were both core steps
                gaps += e0.elapsed_time(s1)
                n_gaps += 1
        busy += events[-1][1].elapsed_time(events[-1][2])
        out.update(core_steps=len(events), core_busy_ms=busy, idle_between_core_ms=gaps,
                   idle_fraction=gaps / (gaps + busy), mean_core_ms=busy / len(events),
                   mean_gap_ms=gaps / max(1, n_gaps))
    return out, [(s.output_ids, s.exit_depths) for s in seqs]


def parity_f64(device: str) -> dict:
    res = {}
    for name in ("ouro-tiny", "huginn-tiny"):
        m = tiny_model(name, dtype=torch.float64, std=0.15, seed=3).to(device)
        rng = random.Random(0)
        reqs = [([rng.randrange(1, 256) for _ in range(rng.randint(1, 12))], rng.randint(2, 10)) for _ in range(8)]
        for layout in ("last_exited", "shared"):
            pol = ExitPolicy.from_config(m.cfg, threshold=0.55, lookahead=True)
            ref = [reference_generate(m, p, n, pol, kv_layout=layout) for p, n in reqs]
            ref = [(r.token_ids, r.exit_depths) for r in ref]
            for mode, kw in {"eager_sync": dict(cuda_graphs=False, pipeline=False),
                             "graphs_pipeline": dict(cuda_graphs=True, pipeline=True),
                             "paged_eager_sync": dict(cuda_graphs=False, pipeline=False, paged="eager"),
                             "paged_graphs_pipeline": dict(cuda_graphs=True, pipeline=True, paged="eager")}.items():
                paged = kw.pop("paged", None)
                cfg = EngineConfig(kv_layout=layout, max_batch_size=4, exit_threshold=0.55, lookahead=True,
                                   kv_cache_tokens=512, **kw)
                try:
                    _, got = run_engine(m, cfg, reqs, paged=paged)
                except Exception as e:  # noqa: BLE001 -- a GPU check reports what failed and goes on
                    res[f"{name}/{layout}/{mode}"] = f"error: {type(e).__name__}: {e}"[:300]
                    continue
                res[f"{name}/{layout}/{mode}"] = got == ref
    return res


def big_model(device: str, small: bool):
    kw = dict(hidden_size=256, intermediate_size=704, num_heads=4, num_kv_heads=4, head_dim=64, n_core=4,
              vocab_size=4096, max_position=1024) if small else \
        dict(hidden_size=2048, intermediate_size=5632, num_heads=16, num_kv_heads=16, head_dim=128, n_core=24,
             vocab_size=49152, max_position=4096)
    cfg = preset_config("ouro-tiny", exit_criterion="learned", exit_threshold=0.5, **kw)
    torch.manual_seed(0)
    with torch.device(device):
        m = build_model(cfg)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    with torch.no_grad():
        for name, p in m.named_parameters():
            if p.ndim == 1:
                p.fill_(1.0) if "norm" in name else p.zero_()
            else:
                p.normal_(0.0, 0.02)
        m.model.early_exit_gate.weight.normal_(0.0, 1.0)  # random gate: a spread of exit depths
    return m.to(dtype).eval()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="gpu_check_out")
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    dev = args.device
    cuda = dev == "cuda"
    result = {"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__}
    t0 = time.perf_counter()
    result["parity_float64"] = parity_f64(dev) if cuda else "skipped (no CUDA)"
    print(json.dumps(result, indent=1), flush=True)
    m = big_model(dev, args.small)
    rng = random.Random(1)
    n_req, out_len = (16, 16) if args.small else (64, 64)
    reqs = [([rng.randrange(3, m.cfg.vocab_size) for _ in range(rng.randint(64, 256))], out_len)
            for _ in range(n_req)]
    common = dict(max_batch_size=64, kv_cache_tokens=64 * 512, lookahead=True)
    modes = {"cdb_eager_sync": dict(policy="cdb", cuda_graphs=False, pipeline=False),
             "cdb_graphs_sync": dict(policy="cdb", cuda_graphs=cuda, pipeline=False),
             "cdb_graphs_pipeline": dict(policy="cdb", cuda_graphs=cuda, pipeline=True),
             "cdb_graphs_pipeline_paged": dict(policy="cdb", cuda_graphs=cuda, pipeline=True, paged="compiled"),
             "cb_graphs": dict(policy="cb", cuda_graphs=cuda),
             "cdb_full_depth_graphs": dict(policy="cdb", cuda_graphs=cuda, full_depth=True, lookahead=False)}
    runs, toks = {}, {}
    for rep in range(2):  # the first pass also captures graphs: report the second
        for name, kw in modes.items():
            kw = dict(kw)
            paged = kw.pop("paged", None)
            cfg = EngineConfig(**{**common, **kw})
            try:
                runs[name], toks[name] = run_engine(m, cfg, reqs, instrument=cuda, paged=paged)
            except Exception as e:  # noqa: BLE001 -- the paged path is unmeasured: report, go on
                runs[name], toks[name] = {"error": f"{type(e).__name__}: {e}"[:300], "tok_per_s": float("nan")}, []
            if rep:
                print(name, json.dumps(runs[name]), flush=True)
    base = toks["cdb_eager_sync"]
    result["bf16_ouro_1p4b_random" if not args.small else "small_random"] = runs
    result["token_agreement_vs_eager_sync"] = {
        k: sum(a == b for a, b in zip(v, base)) / len(base) for k, v in toks.items() if k.startswith("cdb_") and
        "full" not in k}
    result["cdb_pipeline_over_cb"] = runs["cdb_graphs_pipeline"]["tok_per_s"] / runs["cb_graphs"]["tok_per_s"]
    result["cdb_full_depth_over_cb"] = runs["cdb_full_depth_graphs"]["tok_per_s"] / runs["cb_graphs"]["tok_per_s"]
    result["wall_s"] = time.perf_counter() - t0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.json").write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "bf16_ouro_1p4b_random"}, indent=1))


if __name__ == "__main__":
    main()

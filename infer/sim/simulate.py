"""The simulator: the real engine and scheduler (infer/engine/) on SimRunner's virtual clock
(runner.py), one mode or every mode of a workload, priced by a cost model (cost.py); its raw
records and summaries are the offline benchmark's (stats.py), with virtual seconds. Also the
speculation projection and the replay of a bench's trace with the latency model fitted on it.
The command line is __main__.py (`python -m infer.sim`)."""
from __future__ import annotations

import json
from functools import partial
from pathlib import Path

from infer.engine.config import EngineConfig
from infer.engine.llm import load_model
from infer.engine.llm_engine import LLMEngine
from infer.engine.sampling_params import SamplingParams
from looplm.config import LoopConfig
from looplm.layer_split import split_config
from looplm.presets import PAPER_MODELS, paper_config

from .cost import FittedCost, cost_bytes
from .latency import fit_trace
from .runner import SIM_EXITS, SimModel, SimRunner
from .stats import bounds_block, headline, modes_for, prefix_cache, raw_from, summarize
from .work import work_counts
from .workloads import WORKLOADS, Request, describe, make_requests



def gpu_settings(kw: dict) -> dict:
    """EngineConfig fields with what the engine decides on a CUDA device where `kw` leaves them
    open (EngineConfig.resolve decides on the device; SimModel's is the CPU): the lookahead
    pipeline with lookahead, on-device token re-entry without speculation."""
    return {**kw, **EngineConfig(**kw).overlap(on_cuda=True, lookahead=bool(kw.get("lookahead")))}


def simulate_mode(cfg: LoopConfig, requests: list[Request], mode: dict, cost, depths: list[list[int]],
                  overlap: bool = True, **engine) -> dict:
    """One mode through the real engine on the virtual clock; the bench's raw record. `engine`:
    EngineConfig fields (the same for every mode; a mode's own fields win, the exit criterion is
    the simulator's, SIM_EXITS, and fields left open are decided as on a GPU, `gpu_settings`).
    `overlap`: the host's work runs beside the device's (SimRunner's two clocks); False: in series.
    `cuda_graphs` (an engine field here): False prices every launch's dispatch as eager; default
    (None, True) decode-only launches replay graphs, as on CUDA (the cost model's `dispatch`
    charges either; SimRunner). The raw record gains `dispatch` (SimRunner.dispatch_stats)."""
    kw = gpu_settings({**engine, **{k: v for k, v in mode.items() if k != "name"}, **SIM_EXITS})
    graphs = kw.pop("cuda_graphs", None) is not False  # (the SimModel is a CPU: the engine keeps it off)
    kw["r_min"] = 2 if kw.get("lookahead") else 1
    ecfg = EngineConfig(**kw)
    eng = LLMEngine(SimModel(cfg), ecfg, runner_cls=partial(SimRunner, cost=cost, depths=depths, overlap=overlap,
                                                            reentry=kw["async_scheduling"], graphs=graphs))
    seqs = [eng.add_request(r.prompt_ids, SamplingParams(max_tokens=r.output_len, ignore_eos=True), request_id=str(i))
            for i, r in enumerate(requests)]
    while eng.has_unfinished():
        eng.step()
    run = eng.runner
    raw = raw_from(mode, run.trace, run.clock, [eng.output(s) for s in seqs], eng.config,
                   prefix_cache=prefix_cache(eng.metrics()), work=work_counts(run.trace, cfg, cost_bytes(cost)),
                   speculative=eng.speculative_metrics(), auto_coda=eng.auto_coda_metrics())
    raw["dispatch"] = run.dispatch_stats()
    return raw


def speculation_projection(cfg: LoopConfig, requests: list[Request], cost, depths: list[list[int]],
                           batches: list[int], acceptance: float, engine: dict, seed: int = 0) -> list[dict]:
    """Self-speculation at each batch size (max_batch_size = B, and speculative_max_batch = B unless
    the engine fields set it: speculate at that batch), against the same engine without it: output
    tokens/s, the mean time per output token after the first (virtual clock), and their ratios."""
    rows = []
    for b in batches:
        out = {}
        for name, k in (("off", 0), ("on", engine["speculative_tokens"])):
            kw = {**engine, **SIM_EXITS, "max_batch_size": b, "speculative_tokens": k}
            kw.setdefault("speculative_max_batch", b)
            kw["r_min"] = 2 if kw.get("lookahead") else 1
            graphs = kw.pop("cuda_graphs", None) is not False  # (as simulate_mode)
            eng = LLMEngine(SimModel(cfg), EngineConfig(**kw), runner_cls=partial(
                SimRunner, cost=cost, depths=depths, acceptance=acceptance, acceptance_seed=seed, graphs=graphs))
            seqs = [eng.add_request(r.prompt_ids, SamplingParams(max_tokens=r.output_len, ignore_eos=True),
                                    request_id=str(i)) for i, r in enumerate(requests)]
            while eng.has_unfinished():
                eng.step()
            run = eng.runner
            tpot = [(run.last_at[s.seq_id] - run.first_at[s.seq_id]) / (len(s.output_ids) - 1)
                    for s in seqs if len(s.output_ids) > 1]
            ntok = sum(len(s.output_ids) for s in seqs)
            out[name] = {"seconds": run.clock, "output_tokens_per_s": ntok / run.clock,
                         "mean_tpot_s": sum(tpot) / len(tpot), "speculative": eng.speculative_metrics(),
                         "dispatch": run.dispatch_stats(),
                         "work": work_counts(run.trace, cfg, cost_bytes(cost))}
        rows.append({"batch": b, **out, "throughput_ratio": out["on"]["output_tokens_per_s"] /
                     out["off"]["output_tokens_per_s"], "tpot_speedup": out["off"]["mean_tpot_s"] / out["on"]["mean_tpot_s"]})
    return rows


def load_acceptance(arg: str) -> float:
    """--acceptance: the probability that a draft whose predecessors were accepted is accepted too
    (LLMEngine.speculative_metrics' `draft_accept_prob`), in [0, 1], or a JSON file that measured
    it: its top-level `draft_accept_prob`, else that of every `speculative` block in it with drafts
    pooled (accepted / (accepted + rejected): a bench JSON, or python -m infer.bench.speculative's)."""
    try:
        rate = float(arg)
    except ValueError:
        path = Path(arg)
        if not path.exists():
            raise SystemExit(f"--acceptance: {arg!r} is neither a rate in [0, 1] nor a file")
        data = json.loads(path.read_text())
        if isinstance(data, dict) and "draft_accept_prob" in data:
            rate = float(data["draft_accept_prob"])
        else:
            found = []

            def walk(x):
                if isinstance(x, dict):
                    if "draft_accept_prob" in x and x.get("drafted"):
                        found.append((x["accepted"], x["accepted"] + x["rejected"]))
                    for v in x.values():
                        walk(v)
                elif isinstance(x, list):
                    for v in x:
                        walk(v)
            walk(data)
            if not found:
                raise SystemExit(f"--acceptance: {arg} holds no draft_accept_prob with drafted tokens")
            rate = sum(a for a, _ in found) / sum(d for _, d in found)
    if not 0 <= rate <= 1:
        raise SystemExit(f"--acceptance: the rate must be in [0, 1], got {rate}")
    return rate


def served_context(cfg: LoopConfig, engine: dict) -> int:
    """The max_model_len an engine with these EngineConfig fields serves on `cfg` (the simulated
    device's pool decides it, as on a real one): the longest request a workload may hold."""
    kw = {k: v for k, v in {**engine, **SIM_EXITS}.items() if k != "cuda_graphs"}  # (as simulate_mode)
    eng = LLMEngine(SimModel(cfg), EngineConfig(**kw), runner_cls=partial(SimRunner, cost=None, depths=[]))
    return eng.max_model_len


def simulate(cfg: LoopConfig, requests: list[Request], cost, depths: list[list[int]], modes: list[dict] | None = None,
             workload: str = "custom", scale: float | str = 1.0, overlap: bool = True, **kw) -> dict:
    """Every mode on one request list: the bench's workload block (virtual seconds)."""
    modes = modes or modes_for()
    raws = {m["name"]: simulate_mode(cfg, requests, m, cost, depths, overlap, **kw) for m in modes}
    results = summarize(raws, cfg, requests, {"simulated": True, "host_overlap": overlap, **kw})
    ctx = next(iter(raws.values()))["engine_config"]["max_model_len"]  # the context the engines served
    # (a recorded evaluation's task is a workload too: its lengths are described at their own scale)
    out = {"workload": describe(requests, workload, scale, ctx) if workload in WORKLOADS or scale != "auto" else
           {"workload": workload, "num_requests": len(requests)},
           "bounds": bounds_block(cfg, requests), "results": results,
           "traces": {n: r["trace"] for n, r in raws.items()}, **headline(results)}
    return out




# (attention_backend: the simulator prices decode attention with its own --attention. cuda_graphs stays a
# flag: --no-cuda-graphs prices every launch's dispatch as eager, simulate_mode)
SIM_SKIPPED = ("policy", "refill", "min_coda_batch", "full_depth", "trace", "seed", "exit_criterion", "exit_threshold",
               "r_min", "pipeline", "gpu_memory_utilization", "kv_cache_bytes", "kv_cache_memory",
               "attention_backend")
# the engine flags a bench trace's settings can hold ("seed" there is the workload's, not EngineConfig's)
ENGINE_FIELDS = frozenset(EngineConfig.field_names()) - {"policy", "refill", "min_coda_batch", "full_depth", "trace",
                                                         "seed"}


def replay_fitted(trace_file: Path, model: str | None = None, layer_split: str | None = None) -> list[dict]:
    """Re-run a bench's workloads (python -m infer.bench --save-trace) on the simulator with the
    latency model fitted on that bench's own step traces, pooled over every mode of a workload,
    and the recorded exit depths. Returns one block per workload with `measured_tokens_per_s`.
    `layer_split` (default: the bench's own, in the trace file) splits the model's config."""
    data = json.loads(Path(trace_file).read_text())
    src = model or data.get("model")
    cfg = paper_config(src) if src in PAPER_MODELS else load_model(src)[0].cfg
    split = layer_split or data.get("layer_split")
    cfg = split_config(cfg, split) if split else cfg
    blocks = []
    for w, run in data["runs"].items():
        wl = run["workload"]
        reqs = make_requests(w, wl["num_requests"], seed=run["seed"], scale=wl["scale_arg"],
                             max_model_len=wl.get("max_model_len", cfg.max_position), vocab_size=cfg.vocab_size)
        trace = [r for k, t in data["trace"].items() if k.startswith(w + "/") for r in t]
        per_step = sum(run["untraced_seconds_per_step"].values()) / len(run["untraced_seconds_per_step"])
        cost = FittedCost(fit_trace(trace), per_step)
        modes = [{"name": n, **m} for n, m in run["modes"].items()]
        # the engine flags the bench ran with (the rest: the checkpoint's and EngineConfig's defaults)
        engine = {k: v for k, v in run["settings"].items() if k in ENGINE_FIELDS}
        engine.setdefault("async_scheduling", False)  # (a bench that recorded no such setting ran without it)
        # the fitted costs hold the host's time per step as the bench measured it, in series
        blk = simulate(cfg, reqs, cost, data["exit_depths"][w], modes, workload=w, scale=wl["scale_arg"],
                       overlap=False, **engine)
        blk["measured_tokens_per_s"] = run["measured_tokens_per_s"]
        for r in blk["results"]:
            m = run["measured_tokens_per_s"].get(r["mode"])
            r["measured_tokens_per_s"] = m
            r["sim_error"] = r["output_tokens_per_s"] / m - 1 if m else None
        blocks.append(blk)
    return blocks

"""Memory benchmark: declared vs actual length. Clients declare `max_tokens` 1024 while the real
ShareGPT output lengths end them early (each request ends after its trace's output length, as a
stop token there would: the bench aborts it right after that token, which frees its memory at
the same point). The same pool is run with up-front reservation (`reserve_kv`: prompt + max_tokens
at admission) and with blocks on demand (+ preemption by swapping). Prints JSON: mean running
batch (over engine steps, weighted by stage time), output tok/s, preemptions, swap bytes.

    python -m infer.bench.memory --model ouro-tiny --num-requests 64          # CPU, the demo model
    python -m infer.bench.memory --model ouro-1.4b --sim --num-requests 400   # simulator, H100 shapes

On the simulator a swap costs its bytes (KV blocks + the state slot, each way) at
`--pcie-bandwidth` on the virtual clock, in series with the stages (`swap_seconds` in the JSON).
"""
from __future__ import annotations

import argparse
import time
from functools import partial

from infer.engine.config import EngineConfig, add_engine_args, engine_kwargs_from_args
from infer.engine.llm import load_model
from infer.engine.llm_engine import LLMEngine
from infer.engine.sampling_params import SamplingParams
from infer.sim.report import ratio_json
from infer.sim.workloads import make_requests
from looplm.presets import PAPER_MODELS, paper_config


def run_one(eng: LLMEngine, reqs, max_tokens: int, clock) -> dict:
    seqs = [eng.add_request(r.prompt_ids, SamplingParams(max_tokens=max_tokens, ignore_eos=True), request_id=str(i))
            for i, r in enumerate(reqs)]
    ends = {s.request_id: r.output_len for s, r in zip(seqs, reqs)}
    t0, busy, tw = clock(), 0.0, 0.0
    while eng.has_unfinished():
        running = eng.scheduler.num_running
        a = clock()
        out = eng.step()
        dt = clock() - a
        busy += running * dt
        tw += dt
        for s in out:
            if not s.finished and len(s.output_ids) >= ends[s.request_id]:
                eng.abort(s.request_id)  # the trace's stop token
    secs = clock() - t0
    toks = sum(len(s.output_ids) for s in seqs)
    m = eng.metrics()
    return {"mean_running_batch": busy / max(tw, 1e-12), "output_tokens": toks, "seconds": secs,
            "output_tok_per_s": toks / secs, **{k: m[k] for k in ("preemptions", "swapped_out_blocks", "swap_bytes",
                                                                  "swap_overcommits", "kv_pool_tokens",
                                                                  "prefix_cache_hit_rate")}}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="ouro-tiny")
    ap.add_argument("--sim", action="store_true", help="the simulator's H100 roofline cost model (paper shapes)")
    ap.add_argument("--workload", default="sharegpt")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=1024)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--pcie-bandwidth", type=float, default=25e9, help="sim: host <-> device bytes/s of a swap")
    # the engine's flags; reserve_kv is what the bench varies; kv_cache_tokens: default 4096 on
    # CPU, what an 80 GB H100 holds in the simulator
    add_engine_args(ap, skip=("reserve_kv", "trace", "seed"))  # --seed: the workload's
    ap.set_defaults(max_batch_size=256, exit_threshold=0.5)
    a = ap.parse_args(argv)
    base = engine_kwargs_from_args(a)
    if a.sim:
        from infer.sim.cost import RooflineCost, h100_kv_tokens
        from infer.sim.dispatch import Dispatch
        from infer.sim.runner import ASSUMED_MEAN_DEPTH, SIM_EXITS, SimModel, SimRunner, binomial_depths, depths_from_distribution
        from infer.sim.simulate import served_context
        cfg = paper_config(a.model) if a.model in PAPER_MODELS else load_model(a.model)[0].cfg
        layout = EngineConfig(**base).resolve(cfg).kv_layout
        base.setdefault("kv_cache_tokens", h100_kv_tokens(cfg, layout))
        base.update(SIM_EXITS)
        reqs = make_requests(a.workload, a.num_requests, seed=a.seed, max_model_len=served_context(cfg, base))
        depths = depths_from_distribution(binomial_depths(cfg.r_max, ASSUMED_MEAN_DEPTH.get(a.model, cfg.r_max / 2)),
                                          reqs, a.seed)

        def engine(reserve):
            runner = partial(SimRunner, cost=RooflineCost(cfg, kv_layout=layout, attention="paged", dispatch=Dispatch()),
                             depths=depths,
                             pcie_bandwidth=a.pcie_bandwidth)
            return LLMEngine(SimModel(cfg), EngineConfig(**base, reserve_kv=reserve), runner_cls=runner)

        def clock_of(eng):
            return lambda: eng.runner.clock
    else:
        model, _ = load_model(a.model)
        cfg = model.cfg
        base.setdefault("kv_cache_tokens", 4096)
        ctx = LLMEngine(model, EngineConfig(**base)).max_model_len
        reqs = make_requests(a.workload, a.num_requests, seed=a.seed, scale="auto", max_model_len=ctx,
                             vocab_size=cfg.vocab_size)

        def engine(reserve):
            return LLMEngine(model, EngineConfig(**base, reserve_kv=reserve))

        def clock_of(eng):
            return time.perf_counter
    out = {"bench": "memory: declared vs actual length", "model": a.model, "simulated": a.sim,
           "workload": a.workload, "num_requests": a.num_requests, "max_tokens": a.max_tokens, "settings": base,
           "mean_trace_output_len": sum(r.output_len for r in reqs) / len(reqs)}
    for name, reserve in (("reserve", True), ("on_demand", False)):
        eng = engine(reserve)
        out[name] = run_one(eng, reqs, a.max_tokens, clock_of(eng))
        if a.sim:
            out[name]["swap_seconds"] = eng.runner.swap_seconds
    on, res = out["on_demand"], out["reserve"]
    return ratio_json(out, {"batch_ratio": (on, res, "mean_running_batch"),
                            "throughput_ratio": (on, res, "output_tok_per_s")})


if __name__ == "__main__":
    main()

"""Prefix caching with a shared system prompt: every request is one fixed prefix (default 512
tokens) + a short suffix of its own; requests arrive as a Poisson stream. Caching on vs off, side
by side in one run, same requests and arrival times: prefix-cache hit rate, prompt tokens actually
prefilled, TTFT (mean / p50 / p99, from arrival to the first token) and output tok/s. Two engines:
the CPU engine on a random Ouro-style model whose context holds the prompt (`--engine cpu`, wall
clock, one torch thread), or the simulator at Ouro-1.4B shapes on the H100 roofline (`--engine sim`,
virtual clock; a launch is charged for the prompt tokens it computes, so a suffix-only chunk costs
less).

    python -m infer.bench.prefix --engine sim --model ouro-1.4b
    python -m infer.bench.prefix --engine cpu
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from functools import partial

import torch

from infer.engine.config import EngineConfig
from infer.engine.llm_engine import LLMEngine
from infer.engine.sampling_params import SamplingParams
from infer.sim.report import ratio_json
from infer.sim.workloads import Request
from looplm.presets import paper_config

from .itl import cpu_model, percentile


def workload(n: int, prefix: int, suffix: tuple[int, int], output: int, vocab: int, rate: float, seed: int):
    """Requests (one shared prefix + own suffix) and their Poisson arrival times (seconds)."""
    rng = random.Random(seed)
    head = [rng.randrange(3, vocab) for _ in range(prefix)]
    reqs, t, arrivals = [], 0.0, []
    for _ in range(n):
        ids = head + [rng.randrange(3, vocab) for _ in range(rng.randint(*suffix))]
        reqs.append(Request(ids, output, len(ids), output))
        arrivals.append(t)
        t += rng.expovariate(rate)
    return reqs, arrivals


def serve(eng: LLMEngine, reqs: list[Request], arrivals: list[float], clock, wait) -> dict:
    """Add each request at its arrival time, step until all finish; TTFT on `clock`'s time base.
    `wait(t)`: idle until time t (sleep, or move the virtual clock)."""
    seqs, first, i = {}, {}, 0
    while i < len(reqs) or eng.has_unfinished():
        while i < len(reqs) and arrivals[i] <= clock():
            r = reqs[i]
            seqs[i] = eng.add_request(r.prompt_ids, SamplingParams(max_tokens=r.output_len, ignore_eos=True),
                                      request_id=str(i))
            i += 1
        if not eng.has_unfinished():
            wait(arrivals[i])
            continue
        for s in eng.step():
            if s.output_ids and s.request_id not in first:
                first[s.request_id] = clock()
    end = clock()
    ttft = [first[str(i)] - arrivals[i] for i in range(len(reqs))]
    m = eng.metrics()
    toks = sum(len(s.output_ids) for s in seqs.values())
    return {"ttft_mean_s": sum(ttft) / len(ttft), "ttft_p50_s": percentile(ttft, 50), "ttft_p99_s": percentile(ttft, 99),
            "output_tok_per_s": toks / end, "seconds": end, "prefix_cache_hit_rate": m["prefix_cache_hit_rate"],
            "prefix_cache_hits": m["prefix_cache_hits"], "prefix_cache_queries": m["prefix_cache_queries"],
            "prompt_tokens_prefilled": sum(len(r.prompt_ids) for r in reqs) - m["prefix_cache_hits"]}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m infer.bench.prefix", description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", choices=["cpu", "sim"], default="sim")
    p.add_argument("--model", default="ouro-1.4b", help="sim: a paper model")
    p.add_argument("--num-requests", type=int, default=None, help="default: 32 (cpu), 1000 (sim)")
    p.add_argument("--prefix-len", type=int, default=512)
    p.add_argument("--suffix-len", type=int, nargs=2, default=[8, 32], metavar=("MIN", "MAX"))
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--rate", type=float, default=None, help="requests/s; default: 1 (cpu), 100 (sim)")
    p.add_argument("--policy", default="cdb")
    p.add_argument("--max-batch-size", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    sim = a.engine == "sim"
    n = a.num_requests or (1000 if sim else 32)
    rate = a.rate or (100.0 if sim else 1.0)
    ctx = a.prefix_len + a.suffix_len[1] + a.output_len
    out = {"bench": "prefix caching: shared system prompt", "engine": a.engine, "num_requests": n,
           "prefix_len": a.prefix_len, "suffix_len": a.suffix_len, "output_len": a.output_len, "rate": rate,
           "policy": a.policy, "seed": a.seed, "results": {},
           "command": "python -m infer.bench.prefix " + " ".join(argv if argv is not None else sys.argv[1:])}
    if sim:
        from infer.sim.cost import RooflineCost, h100_kv_tokens
        from infer.sim.dispatch import Dispatch
        from infer.sim.runner import ASSUMED_MEAN_DEPTH, SimModel, SimRunner, binomial_depths, depths_from_distribution
        cfg = paper_config(a.model, max_position=max(ctx, 2048))
        vocab = cfg.vocab_size
    else:
        torch.set_num_threads(1)
        model = cpu_model(ctx + 64, a.seed)
        vocab = model.cfg.vocab_size
    reqs, arrivals = workload(n, a.prefix_len, tuple(a.suffix_len), a.output_len, vocab, rate, a.seed)
    for name, on in (("off", False), ("on", True)):
        kw = dict(policy=a.policy, max_batch_size=a.max_batch_size, kv_layout="last_exited", enable_prefix_caching=on,
                  exit_threshold=0.5)
        if sim:
            depths = depths_from_distribution(binomial_depths(cfg.r_max, ASSUMED_MEAN_DEPTH.get(a.model, cfg.r_max / 2)),
                                              reqs, a.seed)
            eng = LLMEngine(SimModel(cfg), EngineConfig(**kw, kv_cache_tokens=h100_kv_tokens(cfg), exit_criterion="learned"),
                            runner_cls=partial(SimRunner, cost=RooflineCost(cfg, attention="paged", dispatch=Dispatch()),
                                               depths=depths))
            clock = (lambda e=eng: e.runner.clock)
            wait = (lambda t, e=eng: setattr(e.runner, "clock", max(e.runner.clock, t)))
        else:
            eng = LLMEngine(model, EngineConfig(**kw, kv_cache_tokens=a.max_batch_size * (ctx + 16)))
            t0 = time.perf_counter()
            clock = (lambda t0=t0: time.perf_counter() - t0)
            wait = (lambda t, c=clock: time.sleep(max(0.0, t - c())))
        out["results"][name] = res = serve(eng, reqs, arrivals, clock, wait)
        print(name, json.dumps(res), file=sys.stderr)
    off, on = out["results"]["off"], out["results"]["on"]
    return ratio_json(out, {"ttft_mean_ratio_off_over_on": (off, on, "ttft_mean_s"),
                            "ttft_p99_ratio_off_over_on": (off, on, "ttft_p99_s")})


if __name__ == "__main__":
    main()

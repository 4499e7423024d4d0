"""Inter-token latency of running requests when a long prompt arrives: chunked vs whole prefill.

32 requests decode; a 4,096-token prompt arrives; we record when every running request gets each
token until the long prompt has its first token (and a few steps more) and report the p99 (and
max, median) gap between consecutive tokens of the running requests in that window, per prefill
setting, side by side in one run. Two engines: the CPU engine on a random Ouro-style model whose
context holds the prompt (`--engine cpu`), or the simulator's H100 roofline at Ouro-1.4B shapes
(`--engine sim`), where the clock is the cost model's.

    python -m infer.bench.itl --engine sim --model ouro-1.4b
    python -m infer.bench.itl --engine cpu
"""
from __future__ import annotations

import argparse
import json
import random
import time
from functools import partial

import torch

from infer.engine.config import EngineConfig
from infer.engine.llm_engine import LLMEngine
from infer.engine.sampling_params import SamplingParams
from looplm.presets import paper_config, tiny_model

# prefill settings compared: the old separate stage, a whole prompt riding in the decode launches,
# and chunks of at most the budget
SETTINGS = {"separate": dict(prefill="separate", max_num_batched_tokens=8192),
            "mixed_whole": dict(prefill="mixed", chunked_prefill=False, max_num_batched_tokens=8192),
            "mixed_chunked": dict(prefill="mixed", chunked_prefill=True)}


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))] if xs else float("nan")


def cpu_model(max_position: int, seed: int = 0):
    """The CPU benches' random Ouro-style model: big enough that prefill costs something, with a
    context for long prompts (the demo checkpoints stop at 512)."""
    return tiny_model("ouro-tiny", seed=seed, hidden_size=256, intermediate_size=768, num_heads=8, num_kv_heads=4,
                      head_dim=32, n_core=4, max_position=max_position)


def itl_run(eng: LLMEngine, clock, running: int, prompt_len: int, vocab: int, seed: int, after_steps: int = 64) -> dict:
    """The scenario on one engine; `clock()` is the time source (wall or virtual seconds)."""
    rng = random.Random(seed)
    reqs = [eng.add_request([rng.randrange(1, vocab) for _ in range(64)], SamplingParams(max_tokens=600, ignore_eos=True))
            for _ in range(running)]
    times: dict[int, list[float]] = {s.seq_id: [] for s in reqs}
    while min(len(s.output_ids) for s in reqs) < 4:  # every running request is decoding
        for s in eng.step():
            if s.seq_id in times:
                times[s.seq_id].append(clock())
    t_arrive = clock()
    long = eng.add_request([rng.randrange(1, vocab) for _ in range(prompt_len)], SamplingParams(max_tokens=2,
                                                                                                 ignore_eos=True))
    steps_after, t_first = 0, None
    while t_first is None or steps_after < after_steps:
        for s in eng.step():
            if s.seq_id in times:
                times[s.seq_id].append(clock())
        if long.output_ids:
            t_first = t_first or clock()
            steps_after += 1
    gaps = []
    for ts in times.values():
        gaps += [b - a for a, b in zip(ts, ts[1:]) if b > t_arrive]
    for s in reqs + [long]:
        eng.abort(s.request_id)
    return {"p99_itl_s": percentile(gaps, 99), "max_itl_s": max(gaps), "p50_itl_s": percentile(gaps, 50),
            "gaps": len(gaps), "ttft_long_s": t_first - t_arrive}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m infer.bench.itl", description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", choices=["cpu", "sim"], default="sim")
    p.add_argument("--model", default="ouro-1.4b", help="sim: a paper model")
    p.add_argument("--running", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=4096)
    p.add_argument("--budget", type=int, default=512, help="max_num_batched_tokens of the chunked setting")
    p.add_argument("--policy", default="cdb")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    out = {"engine": a.engine, "running": a.running, "prompt_len": a.prompt_len, "budget": a.budget,
           "policy": a.policy, "seed": a.seed, "results": {},
           "command": "python -m infer.bench.itl " + " ".join(argv if argv is not None else __import__("sys").argv[1:])}
    for name, st in SETTINGS.items():
        kw = dict(policy=a.policy, max_batch_size=a.running + 1, kv_layout="last_exited", trace=False, **st)
        if name == "mixed_chunked":
            kw["max_num_batched_tokens"] = a.budget
        if a.engine == "sim":
            from infer.sim.cost import RooflineCost, h100_kv_tokens
            from infer.sim.dispatch import Dispatch
            from infer.sim.runner import SimModel, SimRunner, binomial_depths
            cfg = paper_config(a.model, max_position=a.prompt_len + 1024)
            probs = binomial_depths(cfg.r_max, 2.5 if cfg.r_max == 4 else cfg.r_max / 2)
            drng = random.Random(a.seed)
            ds, ws = zip(*sorted(probs.items()))
            depths = [[cfg.r_max] + drng.choices(ds, ws, k=4000) for _ in range(a.running + 1)]
            cost = RooflineCost(cfg, attention="paged", dispatch=Dispatch())  # (the engine's CUDA defaults)
            eng = LLMEngine(SimModel(cfg), EngineConfig(**kw, kv_cache_tokens=h100_kv_tokens(cfg), exit_criterion="learned",
                                                        exit_threshold=0.5),
                            runner_cls=partial(SimRunner, cost=cost, depths=depths))
            clock = (lambda e=eng: e.runner.clock)
            vocab = cfg.vocab_size
        else:
            m = cpu_model(a.prompt_len + 1024, a.seed)
            torch.set_num_threads(1)
            eng = LLMEngine(m, EngineConfig(**kw, kv_cache_tokens=(a.running + 1) * 700 + a.prompt_len + 64,
                                            exit_threshold=0.5))
            clock, vocab = time.perf_counter, m.cfg.vocab_size
        res = itl_run(eng, clock, a.running, a.prompt_len, vocab, a.seed)
        out["results"][name] = res
        print(name, json.dumps(res))
    r = out["results"]
    out["p99_ratio_separate_over_chunked"] = r["separate"]["p99_itl_s"] / r["mixed_chunked"]["p99_itl_s"]
    out["p99_ratio_whole_over_chunked"] = r["mixed_whole"]["p99_itl_s"] / r["mixed_chunked"]["p99_itl_s"]
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()

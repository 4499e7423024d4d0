"""Host benchmark: the CPU time the engine spends per stage when the model math costs nothing.

`NoopRunner` is the real `ModelRunner` (metadata, persistent batch state, block tables, scheduler
and engine bookkeeping, sampling, stop checks) with its kernels replaced by no-ops: the decode
`body` returns preallocated zeros and the prefill math is skipped. What remains is the host work
that a GPU would wait on between stages. Batches of 16 / 64 / 256 requests with contexts drawn
from the ShareGPT trace (each request is resumed at a random point of its output: prompt + that
many tokens are prefilled, the rest is decoded) run the CDB refill policy (prelude, core, coda)
and CB (fused); every engine step is timed, split into the runner's part and the rest (scheduler
+ engine bookkeeping + sampling). The serving row (`serving_host_us`) runs the same CDB stages with
a tokenizer attached, as a server does: every output token is detokenized and checked against
stop strings.

    python -m infer.bench.host --out docs/figures/bench_host.json

Also reported per decode stage: the attention rows the engine reads (`attention_rows`) against
the real context sum, i.e. the memory traffic of decode attention relative to the ideal.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from infer.engine.config import EngineConfig
from infer.engine.llm_engine import LLMEngine
from infer.engine.runner import ModelRunner
from infer.engine.sampling_params import SamplingParams
from infer.engine.sequence import Stage
from infer.sim.stats import ratio_interval
from infer.sim.workloads import DATA, load_trace
from looplm.presets import preset_config

BATCHES = (16, 64, 256)
MAX_POSITION = 4096


class BenchModel:
    """What the engine and the runner read from a model when no math runs: config, dtype, device.
    The KV storage is real (tiny heads) so that the layout's indexing stays the engine's."""

    def __init__(self, device: str = "cpu"):
        # ouro-tiny's loop (0-2-0, r_max 4) with one 8-wide KV head: a KV row costs 128 bytes
        self.cfg = preset_config("ouro-tiny", max_position=MAX_POSITION, num_kv_heads=1, head_dim=8)
        self.dtype, self.device = torch.bfloat16, torch.device(device)


class NoopRunner(ModelRunner):
    """ModelRunner with no-op kernels over the real metadata path. The layout's on-exit KV fill
    (last_exited) is device work inside the coda's body, so it is skipped with the body (prompts run
    in separate prefill launches here, whose eager fused body is a no-op too)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        N = self.padded(self.max_batch_size)
        # exit probability 1 after every step, with r_min 2 (CDB below): every token exits at depth 2
        # and its exit tracker takes a score at both steps, as with Ouro's gate near 0.5 at q 0.6
        self._scores = torch.ones(N, dtype=torch.float64, device=self.device)
        # logits one column wide: the sampler's argmax (or draw) over the vocabulary is a kernel,
        # one launch on a GPU whatever the vocabulary; over [N, V] on this CPU it would be compute
        # (~80 us at N 256, V 256) charged as host time. What stays: its calls and the ids' copy.
        self._logits = torch.zeros(N, 1, dtype=torch.float32, device=self.device)

    def body(self, stage, inp, nb, r_max=0):
        n = inp.shape[0] // 2 if stage.reads_tokens else inp.shape[0]
        if stage is Stage.CORE:
            return self._scores[:n]
        return self._logits[:n] if stage in (Stage.CODA, Stage.FUSED) else None

    def _fused_body(self, slots, batch, r_max, head=None):  # (eager: a separate prefill's launch, its first tokens)
        n = batch.scored if head is None else head if isinstance(head, int) else head.shape[0]
        return self._logits[:n]


CDB = dict(policy="cdb", refill=True, r_min=2, min_coda_batch=1)  # CDB refill K=1; r_min: see NoopRunner._scores
AUTO = {**CDB, "min_coda_batch": "auto"}


def contexts(batch: int, seed: int, room: int) -> list[int]:
    """Per request, the context already there: a ShareGPT prompt plus a random part of its output
    (capped so that `room` more tokens fit the context)."""
    rng = random.Random(f"host:{seed}:{batch}")
    trace = [(p, o) for p, o in load_trace("sharegpt") if o >= 1]
    return [min(p + rng.randrange(0, o), MAX_POSITION - room) for p, o in rng.sample(trace, batch)]


def _pct(xs: list[float]) -> dict:
    xs = sorted(xs)
    return {"median": statistics.median(xs), "p90": xs[min(len(xs) - 1, int(0.9 * len(xs)))], "n": len(xs)}


# the serving path's stop strings (never found in the output: every request runs to the end)
SERVING_STOPS = ["\n\nUser:", "</s>", "###"]


def measure(batch: int, policy: dict, steps: int, seed: int = 0, temperature: float = 0.0,
            count_attention: bool = False, tokenizer=None, async_scheduling: bool = False) -> dict:
    """Time `steps` engine steps of one policy at one batch size (or, with `count_attention`, count
    the decode attention rows instead: that pass is not timed). With a `tokenizer` (the serving
    path), the engine detokenizes every output token and checks stop strings. With
    `async_scheduling` (on-device token re-entry), the reading of an emitting stage's ids, one
    launch later (`LLMEngine._resolve`), is timed on its own (`resolve_us`) and taken out of the
    step that ran it: the simulator charges it where the host reads the ids."""
    ctx = contexts(batch, seed, steps + 2)  # every request outlives the timed steps: full batches
    # prompts in prefill launches of their own: the no-op model has no math for a mixed launch, and
    # the timed steps are pure decode stages either way (every request is admitted before timing)
    cfg = EngineConfig(max_batch_size=batch, max_num_batched_tokens=8192, kv_cache_tokens=sum(ctx) + (steps + 17) * batch,
                       prefill="separate", async_scheduling=async_scheduling, **policy)
    eng = LLMEngine(BenchModel(), cfg, tokenizer=tokenizer, runner_cls=NoopRunner)
    if count_attention:
        eng.runner.attention_stats = {}
    rng = random.Random(seed)
    for c in ctx:
        eng.add_request([rng.randrange(3, 256) for _ in range(c)],
                        SamplingParams(max_tokens=steps + 1, ignore_eos=True, temperature=temperature,
                                       seed=rng.randrange(1 << 30) if temperature else None,
                                       stop=SERVING_STOPS if tokenizer is not None else []))
    total: dict[str, list[float]] = {}
    runner: dict[str, list[float]] = {}
    pre: dict[str, list[float]] = {}  # the step's host time up to its launch (schedule, swaps, upload, launch)
    resolve: list[float] = []
    # the runner's share of the last step, when its launch returned, and the ids' read's share
    launch = {"seconds": 0.0, "launched": 0.0, "resolve": 0.0}

    def timed_run(work, seconds):
        if seconds is not None:
            launch["seconds"], launch["launched"] = seconds, time.perf_counter()
    eng.on_launch.append(timed_run)
    if async_scheduling:
        inner = eng._resolve

        def timed_resolve(work, out):
            t = time.perf_counter()
            got = inner(work, out)
            launch["resolve"] = dt = time.perf_counter() - t
            resolve.append(dt * 1e6)
            return got
        eng._resolve = timed_resolve  # (an instance attribute: this engine only)
    n_steps = 0
    while n_steps < steps:
        launch["resolve"] = 0.0
        t0 = time.perf_counter()
        eng.step()
        dt = time.perf_counter() - t0 - launch["resolve"]
        k = eng.scheduler.last_stage.value
        total.setdefault(k, []).append(dt * 1e6)
        runner.setdefault(k, []).append(launch["seconds"] * 1e6)
        pre.setdefault(k, []).append((launch["launched"] - t0) * 1e6)
        n_steps += 1
    attn = eng.runner.attention_stats or {}
    if attn:
        attn = {**attn, "sdpa_over_context": attn["rows_read"] / attn["context"],
                "paged_over_context": attn["rows_paged"] / attn["context"]}
    assert not any(s.finished for s in eng.seqs.values())
    return {"host_us": {k: _pct(v) for k, v in total.items()},
            "runner_us": {k: _pct(v) for k, v in runner.items()},
            "rest_us": {k: _pct([a - b for a, b in zip(total[k], runner[k])]) for k in total},
            "pre_us": {k: _pct(v) for k, v in pre.items()},
            "resolve_us": _pct(resolve) if resolve else None, "attention": attn, "context_mean": sum(ctx) / batch}


def bench_tokenizer():
    """A byte-level BPE (2048 tokens) trained on the ShareGPT texts, and those texts."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    texts = [json.loads(line)["prompt"] for line in (DATA / "sharegpt_text.jsonl").read_text().splitlines()[:400]]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=2048, show_progress=False,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=tok, clean_up_tokenization_spaces=False), texts


def detok_bench(n: int = 4000, tokenizer=None) -> dict:
    """Seconds to detokenize one n-token output token by token: decoding the whole output at each
    token (the engine before) vs incrementally (infer/engine/detokenizer.py), with a byte-level
    BPE trained on the ShareGPT texts, and whether both give the same text."""
    from infer.engine.detokenizer import IncrementalDetokenizer
    fast, texts = tokenizer or bench_tokenizer()
    ids = fast.encode(" ".join(texts))[:n]
    t0 = time.perf_counter()
    for i in range(1, n + 1):
        full = fast.decode(ids[:i], skip_special_tokens=True)
    t_full = time.perf_counter() - t0
    d, grown = IncrementalDetokenizer(fast), []
    t0 = time.perf_counter()
    for t in ids:  # the engine passes the sequence's growing output list
        grown.append(t)
        d.update(grown)
    inc = d.finish(grown)
    t_inc = time.perf_counter() - t0
    return {"tokens": len(ids), "full_decode_s": t_full, "incremental_s": t_inc, "same_text": inc == full,
            "incremental_us_per_token": t_inc / len(ids) * 1e6, "full_decode_us_per_token": t_full / len(ids) * 1e6}


def onto(base: dict, run: dict, name: str) -> dict:
    """`base` (a host table) with `run`'s re-entry table scaled onto its synchronous one (--onto);
    the run itself is kept under `reentry_run`."""
    scaled: dict[str, dict] = {key: {} for key in ("host_async_us", "pre_us", "pre_async_us")}
    for key in scaled:
        for b, row in run[key].items():
            for k, v in row.items():
                stage = k.removeprefix("resolve_")
                if b in base["host_us"] and stage in base["host_us"][b]:
                    f = base["host_us"][b][stage]["median"] / run["host_us"][b][stage]["median"]
                    scaled[key].setdefault(b, {})[k] = {**{q: v[q] * f for q in ("median", "p90")}, "n": v["n"],
                                                        "scale": f}
    note = (f"host_async_us (re-entry), pre_us and pre_async_us (each step's part up to its launch) measured beside "
            f"a synchronous table in one run ({run['command']}) and scaled onto {name}'s synchronous medians, stage "
            f"by stage (`scale`); the run: reentry_run")
    return {**base, **scaled, "host_async_note": note,
            "reentry_run": {k: run[k] for k in ("host_us", "host_async_us", "pre_us", "pre_async_us", "command")}}


def vs_auto(batches: list[int], steps: int, rounds: int, seed: int = 0) -> dict:
    """min_coda_batch="auto"'s host cost: the CDB stages under K=1 and under auto, passes
    interleaved (K=1, auto, auto, K=1, ...); per batch and stage, the median over passes of each
    pass's median microseconds per step (`host_us`: the whole step; `pre_us`: up to its launch) and
    auto / K=1, with the median of the per-round ratios (each round's two passes paired) and its 95%
    bootstrap interval (`ratio_interval`). The no-op model's tokens all exit at depth 2, so auto's
    coda decision is never asked (no core step is left when exits wait); what it adds is its
    per-launch bookkeeping (timing, the queued launch and its learning: `AutoCoda.catch_up`) and the
    core step's split check (`core_batch`)."""
    out: dict = {}
    for b in batches:
        got: dict[str, dict[str, dict[str, list[float]]]] = {"k1": {}, "auto": {}}
        for r in range(rounds):
            for name in ("k1", "auto") if r % 2 == 0 else ("auto", "k1"):
                m = measure(b, CDB if name == "k1" else AUTO, steps, seed)
                for key in ("host_us", "pre_us"):
                    for stage, v in m[key].items():
                        got[name].setdefault(key, {}).setdefault(stage, []).append(v["median"])
        row = out[str(b)] = {}
        for stage in got["k1"]["host_us"]:
            if stage == "prefill":  # (prompts' prefill launches: not what auto decides, and ms each)
                continue
            e = row[stage] = {}
            for key in ("host_us", "pre_us"):
                k1, auto = (statistics.median(got[n][key][stage]) for n in ("k1", "auto"))
                iv = ratio_interval(got["auto"][key][stage], got["k1"][key][stage])  # (auto / K=1, per round)
                e[key] = {"k1": k1, "auto": auto, "ratio": auto / k1,
                          "paired": {q: iv[q] for q in ("median", "lo", "hi", "rounds")}}
    return out


def onto_auto(base: dict, ratios: dict, name: str) -> dict:
    """`base` (a host table) with every CDB stage's entries x auto / K=1 as `ratios` (vs_auto)
    measured them (the median of the paired per-round ratios), the step's pre-launch tables by its
    pre-launch ratio: the host table a simulation of min_coda_batch="auto" charges. The re-entry tables take the synchronous ratios
    (the bookkeeping is the same code on both paths)."""
    out = {**base, "vs_auto": ratios}
    for key, part in (("host_us", "host_us"), ("host_async_us", "host_us"), ("pre_us", "pre_us"),
                      ("pre_async_us", "pre_us")):
        table = {b: dict(row) for b, row in base.get(key, {}).items()}
        for b, row in table.items():
            near = min(ratios, key=lambda x: abs(int(x) - int(b)))  # (the measured batch nearest)
            for stage, r in ratios[near].items():
                if stage in row:
                    f = r[part]["paired"]["median"]  # (robust to the machine's drift between rounds)
                    row[stage] = {**row[stage], **{q: row[stage][q] * f for q in ("median", "p90")}}
        if table:
            out[key] = table
    out["vs_auto_note"] = (f"{name}'s tables with each CDB stage x auto / K=1 (vs_auto, measured side by side in "
                           f"one run: vs_auto_command); the table a simulation of min_coda_batch=auto charges")
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m infer.bench.host", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=None, help="write the JSON here (it is printed either way)")
    p.add_argument("--batches", type=int, nargs="+", default=list(BATCHES))
    p.add_argument("--steps", type=int, default=120, help="engine steps timed per batch size and policy")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0: greedy)")
    p.add_argument("--seed", type=int, default=0)
    # each stage kind reports the pass with the lowest median (the machine's noise only adds time)
    p.add_argument("--repeats", type=int, default=3, help="passes per batch size (the lowest median is reported)")
    p.add_argument("--onto", type=Path, default=None, metavar="FILE",
                   help="keep FILE's synchronous tables (a committed host table that simulator figures were made "
                        "with) and put this run's re-entry table onto it: each entry x FILE's / this run's "
                        "synchronous median of its stage (resolve_<stage>: of <stage>), the ratio this run measured "
                        "side by side carried over to FILE's machine phase")
    p.add_argument("--vs-auto", action="store_true",
                   help="only min_coda_batch=auto's host cost: the CDB stages under K=1 and auto, --repeats "
                        "interleaved passes each (vs_auto); with --onto FILE, FILE's tables scaled by it")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    command = "python -m infer.bench.host " + " ".join(argv if argv is not None else sys.argv[1:])
    if a.vs_auto:
        with torch.inference_mode():
            measure(a.batches[0], CDB, a.steps, a.seed)  # warm-up, discarded
            ratios = vs_auto(a.batches, a.steps, a.repeats, a.seed)
        if a.onto is None:
            return _emit({"vs_auto": ratios, "command": command}, a.out)
        return _emit({**onto_auto(json.loads(a.onto.read_text()), ratios, str(a.onto)), "vs_auto_command": command},
                     a.out)
    out: dict = {"host_us": {}, "runner_us": {}, "rest_us": {}, "pre_us": {}, "host_async_us": {},
                 "pre_async_us": {}, "serving_host_us": {}, "attention": {}, "context_mean": {},
                 "command": command,
                 "note": "model math and KV kernels removed (NoopRunner); CDB refill K=1 for prefill/prelude/core/coda, CB for "
                         "fused; microseconds of CPU per engine step; per stage kind the pass (of --repeats) with the "
                         "lowest median; serving_host_us: the same CDB stages with a tokenizer attached (every token "
                         "detokenized, three stop strings checked); host_async_us: the same stages with on-device "
                         "token re-entry (async_scheduling), each step without the reading of the previous emitting "
                         "stage's ids, which is its own entry, resolve_<stage that emitted them>; pre_us / "
                         "pre_async_us: the part of a step up to its launch (schedule, swaps, upload, the launch), "
                         "the rest comes after it"}
    tok = bench_tokenizer()
    with torch.inference_mode():
        measure(a.batches[0], CDB, a.steps, a.seed, a.temperature)  # warm-up, discarded
        for b in a.batches:
            for rep in range(a.repeats):  # the quietest pass per stage kind (shared, noisy machines)
                cdb = measure(b, CDB, a.steps, a.seed, a.temperature)
                cb = measure(b, dict(policy="cb"), max(8, a.steps // 6), a.seed, a.temperature)
                got = {key: {**cdb[key], **{k: v for k, v in cb[key].items() if k == "fused"}}
                       for key in ("host_us", "runner_us", "rest_us", "pre_us")}
                best = out["host_us"].setdefault(str(b), {})
                for k, v in got["host_us"].items():
                    if k not in best or v["median"] < best[k]["median"]:  # the split comes from the same pass
                        for key in ("host_us", "runner_us", "rest_us", "pre_us"):
                            out[key].setdefault(str(b), {})[k] = got[key][k]
                # re-entry: the same stages, and the ids' read as its own entry
                cdb_a = measure(b, CDB, a.steps, a.seed, a.temperature, async_scheduling=True)
                cb_a = measure(b, dict(policy="cb"), max(8, a.steps // 6), a.seed, a.temperature, async_scheduling=True)
                got = {**cdb_a["host_us"], "fused": cb_a["host_us"]["fused"], "resolve_coda": cdb_a["resolve_us"],
                       "resolve_fused": cb_a["resolve_us"]}
                got_pre = {**cdb_a["pre_us"], "fused": cb_a["pre_us"]["fused"]}
                best = out["host_async_us"].setdefault(str(b), {})
                for k, v in got.items():
                    if k not in best or v["median"] < best[k]["median"]:
                        best[k] = v
                        if k in got_pre:
                            out["pre_async_us"].setdefault(str(b), {})[k] = got_pre[k]
                served = measure(b, CDB, a.steps, a.seed, a.temperature, tokenizer=tok[0])["host_us"]
                best = out["serving_host_us"].setdefault(str(b), {})
                for k, v in served.items():
                    if k not in best or v["median"] < best[k]["median"]:
                        best[k] = v
            out["attention"][str(b)] = measure(b, CDB, a.steps, a.seed,
                                               count_attention=True)["attention"]
            out["context_mean"][str(b)] = cdb["context_mean"]
    out["detokenize_4000"] = detok_bench(4000, tok)
    if a.onto is not None:
        out = onto(json.loads(a.onto.read_text()), out, str(a.onto))
    _emit(out, a.out)


def _emit(out: dict, path: Path | None) -> None:
    text = json.dumps(out, indent=1)
    print(text)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")


if __name__ == "__main__":
    main()

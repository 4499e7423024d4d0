"""The first run on a GPU (issues 38, 62): one command, one JSON, within about 8 minutes on one H100.

    python -m scripts.gpu_check --out gpu_check_out              # CUDA (default when torch sees one)
    python -m scripts.gpu_check --device cpu --small --out DIR   # the dry run that `make test` runs

Sections, in this order (`--sections` picks some), each guarded: it starts only when its estimate
fits what is left of `--budget-s`, else it is skipped, and `skipped` says why, with the estimate:

1. `dispatch`: the host cost of one eager aten op (a loop of small ops on a tiny device tensor,
   and an eager launch of an engine's decode body divided by its aten op count) and of one CUDA
   graph replay (`CUDAGraph.replay()` of one of the engine's captured graphs, host wall time of the
   call). The top-level `dispatch.op_us` / `dispatch.replay_us` are what the simulator reads
   (`python -m infer.sim --dispatch-json FILE`); the Ouro section measures them again at its shape.
2. `parity_float64`: the tiny presets (both archs, two KV layouts) in float64, staggered arrivals
   and chunked prompts, against the sequential reference decoder on the same device: exact tokens
   and exit depths. SDPA attention eagerly (async scheduling off and on), paged FlexAttention run
   eagerly (the only way it is float64-exact: inductor's flex templates accumulate in fp32), and
   graphs captured at start-up with the lookahead pipeline (async on and off) and CB's fused graphs:
   CUDA graphs, or on a CPU the stand-in (`infer.engine.graphs.use_stand_in`).
3. `parity_paged`: paged FlexAttention as served (compiled inside CUDA graphs on CUDA; eager inside
   the stand-in on a CPU) against SDPA attention on the same engine settings, in float32 and
   bfloat16, within stated tolerances (`TOLERANCE`): exit depths forced to the same seeded values,
   log-probs compared token by token under teacher forcing, greedy tokens compared up to the first
   divergence, which is allowed only where the top-2 margin is within twice the tolerance.
4. `ouro_1p4b`: Ouro-1.4B's shape, bf16, random weights; the exit depths of a recording
   (RECORDING, replayed as `--device emulated:h100 --replay-exits` replays it) on Alpaca lengths:
   MODES (CB, CDB refill with the lookahead pipeline as served, with min_coda_batch="auto", without
   the pipeline, without async scheduling, no-refill, full depth; and CB and CDB refill with SDPA
   attention beside the default paged one). Per mode one engine (its graphs captured at start-up,
   count and seconds kept), one traced untimed pass (stage statistics, exact work counts), one
   instrumented pass (a CUDA event before and after every launch: the device's time between any
   two consecutive launches; the allocator's peak per launch kind beside what memory.py reserves
   for it), then the timed passes, untraced. Speedups over CB with 95% bootstrap intervals
   (infer/sim/stats.py), and the paired ratios of RATIOS (pipeline, async, auto, paged vs SDPA).
5. `huginn_3p5b`: the same for Huginn-3.5B's shape (depths drawn around the simulator's assumed
   mean: no recording at r_max 16 exists); skipped when no Ouro mode ran.

Guards: before every section and mode, its estimate (PRIORS until something was measured, then the
longest mode so far x 1.2) against what is left of `--budget-s`; timed passes past MIN_REPEATS only
while the budget allows. The JSON is written atomically (a temporary file, then os.replace) when
anything starts or ends: each mode's result or error as soon as the mode ends. SIGTERM, SIGINT and
the `--deadline-s` alarm save it and exit (128 + the signal's number): `terminated` says which
signal, `in_flight` what was running, `ran` what had finished. Every engine's runner is checked for
autograd state after start-up and after its passes (`autograd_check`); a failure exits 1.
CUDA-only numbers are null on a CPU, with the reason in `nulls`.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import gc
import json
import os
import random
import signal
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

from infer import EngineConfig, LLMEngine, SamplingParams
from infer.bench.drive import run_staggered
from infer.bench.offline import make_engine, pick_raw, run_engine, untraced_timing
from infer.engine import graphs as graph_cache
from infer.engine.memory import activation_reserve, launch_peaks
from infer.engine.reference import reference_generate
from infer.engine.sequence import Stage
from infer.sim import bounds as B
from infer.sim import replay as RP
from infer.sim.dispatch import OpCounter
from infer.sim.emulated import ReplayedDepths
from infer.sim.report import model_meta
from infer.sim.runner import ASSUMED_MEAN_DEPTH, binomial_depths, depths_from_distribution
from infer.sim.stats import bounds_block, headline, mode_kwargs, ratio_interval, summarize
from infer.sim.workloads import describe, make_requests
from looplm import ExitPolicy, dummy_model, paper_config, tiny_model
from looplm.errors import ParamError

ROOT = Path(__file__).resolve().parents[1]
RECORDING = ROOT / "docs" / "figures" / "ouro-demo-alpaca8.exits.json"  # ouro-demo's exit scores, every step
MIN_REPEATS = 3  # timed passes every mode runs once it starts (an interval needs a few rounds)
THRESHOLD = 0.55  # the parity's exit threshold (tests/helpers.py's): exits really vary on the tiny models
BUDGET_S = 450.0  # --budget-s: sections and modes start only while their estimate fits it
DEADLINE_PAST_BUDGET_S = 60.0  # --deadline-s defaults to the budget plus this: then SIGALRM saves and exits
SECTIONS = ("dispatch", "parity_float64", "parity_paged", "ouro_1p4b", "huginn_3p5b")

# the lookahead pipeline as a user serves it on CUDA (lookahead on: `pipeline` resolves on there; set
# here so that the CPU dry run takes the same path)
PIPELINE = {"lookahead": True, "pipeline": True}
REFILL_K1 = {"policy": "cdb", "refill": True, "min_coda_batch": 1, "async_scheduling": True}
# the modes of sections 4 and 5 (infer/sim/stats.py's mode dicts), most wanted first (the budget skips
# from the end). attention_backend left unset resolves to the CUDA default, paged; the `_sdpa` modes
# measure SDPA's gather beside it. Every adaptive mode but `_no_pipeline` runs the lookahead pipeline;
# all of them replay the same depths (DEPTH_RULE), so their times compare
MODES = [{"name": "cb", "policy": "cb"},
         {"name": "cdb_refill_k1", **REFILL_K1, **PIPELINE},
         {"name": "cdb_refill_auto", **REFILL_K1, "min_coda_batch": "auto", **PIPELINE},
         {"name": "cdb_refill_k1_no_pipeline", **REFILL_K1, "lookahead": True, "pipeline": False},
         {"name": "cb_sdpa", "policy": "cb", "attention_backend": "sdpa"},
         {"name": "cdb_refill_k1_sdpa", **REFILL_K1, **PIPELINE, "attention_backend": "sdpa"},
         {"name": "cdb_norefill", "policy": "cdb", "refill": False, "async_scheduling": True, **PIPELINE},
         {"name": "cdb_refill_k1_no_async", **REFILL_K1, **PIPELINE, "async_scheduling": False},
         {"name": "cdb_full_depth", **REFILL_K1, "full_depth": True}]
# Huginn's: CB and CDB refill first (the comparison), auto, full depth, no-refill
HUGINN_MODES = [m for n in ("cb", "cdb_refill_k1", "cdb_refill_auto", "cdb_full_depth", "cdb_norefill")
                for m in MODES if m["name"] == n]
# paired ratios of two modes' timed passes, round by round: time of the first / time of the second
# (above 1: the second is faster)
RATIOS = {"pipeline_speedup": ("cdb_refill_k1_no_pipeline", "cdb_refill_k1"),
          "async_speedup": ("cdb_refill_k1_no_async", "cdb_refill_k1"),
          "auto_vs_k1": ("cdb_refill_k1", "cdb_refill_auto"),
          "paged_vs_sdpa_cb": ("cb_sdpa", "cb"),
          "paged_vs_sdpa_cdb_refill_k1": ("cdb_refill_k1_sdpa", "cdb_refill_k1")}

# --small: the paper shapes' structure (r_max, heads' layout, gate) at a CPU's size; a 64-token context in
# 32-token blocks (two context buckets) and batches up to 4 keep the stand-in's start-up capture (every key,
# 0.1 s for a stage, up to 1 s for Huginn's 16-step fused iteration) short
SMALL = dict(hidden_size=128, intermediate_size=256, num_heads=4, num_kv_heads=4, head_dim=32, vocab_size=1024,
             max_position=64)
SMALL_SHAPES = {"ouro-1.4b": dict(SMALL, n_core=2), "huginn-3.5b": dict(SMALL, n_prelude=1, n_core=1, n_coda=1)}
SMALL_BASE = dict(max_batch_size=4, max_num_batched_tokens=64, block_size=32, kv_cache_tokens=1024)

# seconds a section or a mode is estimated to take before anything of it was measured: H100 guesses
# (the paper shapes; a paged engine compiles its FlexAttention kernels at start-up) and --small's on 2
# shared CPU cores. After a mode, the section's longest mode so far (x 1.2) replaces the guess
PRIORS = {"cuda": {"dispatch": 20.0, "parity_float64": 60.0, "parity_paged": 90.0, "ouro_1p4b": 45.0},
          "small": {"dispatch": 3.0, "parity_float64": 40.0, "parity_paged": 20.0, "ouro_1p4b": 8.0}}
# a parity section stops starting cases past this many seconds of its own (the timings matter too)
PARITY_CAP_S = {"cuda": 90.0, "small": 300.0}


# ---------------------------------------------------------------------------------- the run's record
class Terminated(BaseException):
    """Raised once the JSON is saved, by the handler of SIGTERM, SIGINT or the --deadline-s alarm
    (a BaseException: no `except Exception` of a section or a mode holds it up)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class Run:
    """The JSON being built, its file, the clock and the budget. `save` rewrites the file atomically
    (whenever anything starts or ends); `say` prints one progress line with the seconds since the
    start; `guard` is the budget check before a section, a mode or a parity case."""

    def __init__(self, out: Path, budget_s: float, doc: dict, priors: dict):
        self.path = out / "gpu_check.json"
        self.t0, self.budget_s, self.doc, self.priors = time.perf_counter(), budget_s, doc, priors
        self._saving, self._pending, self._saves = False, None, 0
        self._stack: list[dict] = []  # what is in flight, outermost first
        self.dispatch_ranks = {"op": -1, "replay": -1}  # (record_dispatch: which measurement `dispatch` holds)
        doc.update(ran=[], in_flight=None, terminated=None)
        out.mkdir(parents=True, exist_ok=True)

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def why_not(self, seconds: float, until: float | None = None) -> str | None:
        """Why something estimated to take `seconds` may not start now: it would end past the budget
        (or past `until`, seconds since the start, when given); None: it may."""
        end = self.elapsed() + seconds
        if end > self.budget_s:
            return f"over --budget-s {self.budget_s:g}: {self.elapsed():.0f} s + ~{seconds:.0f} s"
        if until is not None and end > until:
            return f"over the section's cap (PARITY_CAP_S): it ends at {until:.0f} s"
        return None

    def allows(self, seconds: float, until: float | None = None) -> bool:
        return self.why_not(seconds, until) is None

    def guard(self, what: str, need_s: float, until: float | None = None) -> bool:
        """`allows`, and when not, `what` is skipped with its estimate and the reason."""
        why = self.why_not(need_s, until)
        if why is None:
            return True
        self.skip(what, need_s, why)
        return False

    def skip(self, what: str, need_s: float | None, why: str) -> None:
        self.doc["skipped"].append({"what": what, "at_s": round(self.elapsed(), 1),
                                    "estimated_s": None if need_s is None else round(need_s, 1), "why": why})
        est = "" if need_s is None else f" (~{need_s:.0f} s)"
        self.say(f"skipped {what}{est}: {why}")
        self.save()

    def begin(self, what: str, estimate_s: float | None = None) -> None:
        """`what` starts: it is `in_flight` (innermost first, with `phase` details; `within`: the
        section around a mode) until `end`."""
        self._stack.append({"what": what, "since_s": round(self.elapsed(), 1),
                            "estimated_s": None if estimate_s is None else round(estimate_s, 1), "phase": "starting"})
        self._show()
        self.say(f"{what}: start" + ("" if estimate_s is None else f" (estimate {estimate_s:.0f} s)"))
        self.save()

    def phase(self, **info) -> None:
        """What the unit in flight is doing now (kept in memory; a signal's save writes it)."""
        if self._stack:
            self._stack[-1].update(info)
            self._show()

    def end(self, what: str, seconds: float, status: str = "ok") -> None:
        self.doc["ran"].append({"what": what, "seconds": round(seconds, 2), "status": status})
        if self._stack and self._stack[-1]["what"] == what:
            self._stack.pop()
        self._show()
        self.save()

    def _show(self) -> None:
        st = self._stack
        self.doc["in_flight"] = {**st[-1], "within": [e["what"] for e in st[:-1]]} if st else None

    def say(self, msg: str) -> None:
        print(f"[{self.elapsed():6.1f} s] {msg}", flush=True)

    def save(self) -> None:
        """Write the JSON to a temporary file, then os.replace it over the last one: a reader (or a
        kill) never sees half a file. A signal that arrives meanwhile is handled once it is done."""
        self._saving = True
        try:
            self.doc["wall_s"] = round(self.elapsed(), 2)
            self._saves += 1
            tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.{self._saves}.tmp")
            tmp.write_text(json.dumps(self.doc, indent=1, default=str))
            os.replace(tmp, self.path)
        finally:
            self._saving = False
        if self._pending is not None:
            signum, self._pending = self._pending, None
            self.terminate(signum)

    def on_signal(self, signum: int, frame=None) -> None:
        if self._saving:  # (the handler runs between two bytecodes of save: let it finish first)
            self._pending = signum
            return
        self.terminate(signum)

    def terminate(self, signum: int) -> None:
        """Record the signal and what was in flight, save, and raise Terminated."""
        name = signal.Signals(signum).name
        self.doc["terminated"] = {"signal": name, "at_s": round(self.elapsed(), 1),
                                  "in_flight": copy.deepcopy(self.doc["in_flight"]),
                                  "why": "--deadline-s passed" if signum == signal.SIGALRM else f"{name} received"}
        self.doc["complete"] = False
        self.doc["exit_code"] = 128 + signum
        self.say(f"terminated by {name} while {(self.doc['in_flight'] or {}).get('what')} ran; saving {self.path}")
        self.save()
        raise Terminated(signum)


@contextlib.contextmanager
def signals_saved(run: Run, deadline_s: float | None):
    """SIGTERM / SIGINT (and SIGALRM after `deadline_s` seconds) save the JSON and end the run
    (`Run.terminate`); the previous handlers come back after. Off outside the main thread."""
    sigs = [signal.SIGTERM, signal.SIGINT] + ([signal.SIGALRM] if deadline_s else [])
    old = {}
    try:
        for s in sigs:
            old[s] = signal.signal(s, run.on_signal)
    except ValueError:  # (not the main thread: no handlers)
        pass
    alarm = bool(deadline_s) and signal.SIGALRM in old
    if alarm:
        signal.setitimer(signal.ITIMER_REAL, max(1e-3, deadline_s - run.elapsed()))
    try:
        yield
    finally:
        if alarm:
            signal.setitimer(signal.ITIMER_REAL, 0)
        for s, h in old.items():
            signal.signal(s, h)


def error_text(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"[:400]


def guarded(fn, *args):
    """An extra measurement that must not cost the mode its timings: its error is its value."""
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001
        return {"error": error_text(e)}


def free_device(dev: torch.device) -> None:
    """Give a dropped engine's memory back (engines have no reference cycles; gc for anything else)."""
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def stand_in(dev: torch.device, graphs: bool = True):
    """Where engines are built: on a CPU (with `graphs`) inside graphs.use_stand_in, so that each
    ModelRunner gets the CUDA graph stand-in and captures every key at start-up, the start-up path of
    a CUDA engine; on CUDA the engine's own CUDA graphs (nothing to install)."""
    return graph_cache.use_stand_in() if graphs and dev.type != "cuda" else contextlib.nullcontext()


# ---------------------------------------------------------------------------------- autograd check
def autograd_problems(eng) -> list[str]:
    """What of an engine holds or makes autograd state (empty: nothing): a model parameter that
    requires grad (loaders freeze them), and what graphs.autograd_leaks finds in its runner."""
    out = [f"parameter {n} requires grad" for n, p in eng.model.named_parameters() if p.requires_grad]
    if len(out) > 5:
        out = out[:5] + [f"... {len(out) - 5} more parameters require grad"]
    return out + graph_cache.autograd_leaks(eng.runner)


def check_autograd(run: Run, eng, where: str, when: str) -> bool:
    """autograd_problems into the JSON's `autograd_check` (a failure is printed loudly and makes the
    run exit 1)."""
    block = run.doc["autograd_check"]
    try:
        problems = autograd_problems(eng)
    except Exception as e:  # noqa: BLE001 -- a check that cannot run is a failure too
        problems = [f"the check itself failed: {error_text(e)}"]
    block["checks"] += 1
    if problems:
        block["ok"] = False
        block["failures"].append({"engine": where, "when": when, "problems": problems[:20]})
        run.say(f"AUTOGRAD CHECK FAILED: {where} after {when}: {problems[:3]}")
    return not problems


# ---------------------------------------------------------------------------------- dispatch cost
def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def micro_op_us(dev: torch.device, n: int = 2000, rounds: int = 5) -> dict:
    """Host microseconds per eager aten op: `n` calls in a row of one small op on a tiny device
    tensor (in place: add_; allocating: mul), the median of `rounds` rounds, the device synchronized
    between rounds only (on CUDA the host returns once a kernel is queued: this is the host's cost)."""
    x = torch.zeros(8, device=dev)
    out = {}
    with torch.inference_mode():
        for name, op in (("add_", lambda: x.add_(1.0)), ("mul", lambda: torch.mul(x, 2.0))):
            for _ in range(200):
                op()
            _sync(dev)
            per = []
            for _ in range(rounds):
                t0 = time.perf_counter()
                for _ in range(n):
                    op()
                per.append(1e6 * (time.perf_counter() - t0) / n)
                _sync(dev)
            out[name] = statistics.median(per)
    return {"op_us": statistics.mean(out.values()), "per_op_us": out, "calls": n, "rounds": rounds,
            "how": "host wall time of n back-to-back calls of one small op on an 8-element device tensor / n, "
                   "median of the rounds (the device synchronized between rounds only)"}


def _decode_key(eng) -> tuple:
    """The smallest decode launch of the engine: CB's fused iteration or CDB's core step, batch 1,
    the narrowest context bucket (GraphCache's key)."""
    r = eng.runner
    cb = eng.config.policy == "cb"
    keys = [k for k in r.graph_keys(cb, eng.model.cfg.r_max) if k[0] is (Stage.FUSED if cb else Stage.CORE)]
    return min(keys, key=lambda k: (k[1], k[2]))


def _scratch(r, stage: Stage, size: int) -> torch.Tensor:
    """A graph's input at capture: the scratch slot only (its padding items' tokens 0)."""
    slots = torch.full((size,), r.scratch_slot, dtype=torch.long, device=r.device)
    if stage.reads_tokens:
        slots[size // 2:] = 0
    return slots


def engine_dispatch(eng, eager: bool, reps: int = 20, replays: int = 50) -> dict:
    """On one engine, for its smallest decode key: `eager` (an engine whose attention runs eagerly:
    SDPA; a compiled FlexAttention is not run under a dispatch mode) the aten ops of one eager run
    of the launch's body (`ModelRunner.body`, on the scratch slot, as a capture's warm-up runs it)
    and the host time of one run, so host us per op; and on CUDA the host time of
    `CUDAGraph.replay()` of the key's captured graph (its static input set to the scratch slot
    first, so the replays touch no sequence's state). Medians; the device synchronized between
    calls, never inside one."""
    r, dev = eng.runner, eng.model.device
    stage, size, nb, r_max = key = _decode_key(eng)
    out = {"stage": stage.value, "padded_batch": size, "context_blocks": nb, "r_max": r_max,
           "attention_backend": eng.config.attention_backend}
    with torch.inference_mode():
        slots = _scratch(r, stage, size)
        if eager:
            for _ in range(2):
                r.body(stage, slots, nb, r_max)
            _sync(dev)
            with OpCounter() as c:
                r.body(stage, slots, nb, r_max)
            _sync(dev)
            host = []
            for _ in range(reps):
                t0 = time.perf_counter()
                r.body(stage, slots, nb, r_max)
                host.append(time.perf_counter() - t0)
                _sync(dev)
            out.update(ops=c.n, launch_host_us=1e6 * statistics.median(host), eager_reps=reps)
            out["op_us"] = out["launch_host_us"] / c.n if c.n else None
        g = getattr(r, "graphs", None)
        entry = (getattr(g, "graphs", None) or {}).get(key)
        if dev.type == "cuda" and entry is not None and isinstance(entry[0], torch.cuda.CUDAGraph):
            graph, static = entry[0], entry[1]
            static.copy_(slots)
            graph.replay()
            _sync(dev)
            host = []
            for _ in range(replays):
                t0 = time.perf_counter()
                graph.replay()
                host.append(time.perf_counter() - t0)
                _sync(dev)
            srt = sorted(host)
            out.update(replay_us=1e6 * statistics.median(host), replay_reps=replays,
                       replay_us_p10_p90=[1e6 * srt[len(srt) // 10], 1e6 * srt[(9 * len(srt)) // 10]])
    return out


def record_dispatch(run: Run, where: str, m: dict, rank: int) -> None:
    """One engine's dispatch measurement into `dispatch`; the top-level op_us / replay_us are the
    best-ranked ones measured (2: the paper shape's engine, 1: the tiny engine, 0: the micro loop)."""
    d, ranks = run.doc["dispatch"], run.dispatch_ranks
    d["engines"].append({"where": where, **m})
    if m.get("op_us") is not None and rank >= ranks["op"]:
        ranks["op"] = rank
        d.update(op_us=m["op_us"], op_us_source=f"{where}: {m['ops']} aten ops of an eager {m['stage']} body "
                                                f"(batch {m['padded_batch']}), {m['launch_host_us']:.0f} us host")
        run.doc["nulls"].pop("dispatch.op_us", None)
    if m.get("replay_us") is not None and rank >= ranks["replay"]:
        ranks["replay"] = rank
        d.update(replay_us=m["replay_us"], replay_us_source=f"{where}: CUDAGraph.replay() of the {m['stage']} graph "
                                                            f"(batch {m['padded_batch']})")
        run.doc["nulls"].pop("dispatch.replay_us", None)


def dispatch_section(run: Run, dev: torch.device) -> dict:
    """Section 1: the micro loop, then a tiny Ouro engine (float32, SDPA, graphs captured at start-up)
    for an eager body's op count and host time and a graph replay's host time."""
    d = run.doc["dispatch"]
    d["micro"] = micro_op_us(dev)
    if run.dispatch_ranks["op"] < 0:
        run.dispatch_ranks["op"] = 0
        d.update(op_us=d["micro"]["op_us"], op_us_source="micro loop (dispatch.micro)")
        run.doc["nulls"].pop("dispatch.op_us", None)
    run.save()
    m = tiny_model("ouro-tiny", dtype=torch.float32, std=0.15, seed=3, max_position=64).requires_grad_(False).to(dev)
    cfg = EngineConfig(max_batch_size=2, kv_cache_tokens=256, max_num_batched_tokens=16, attention_backend="sdpa",
                       cuda_graphs=dev.type == "cuda")
    with stand_in(dev):
        eng = LLMEngine(m, cfg)
    check_autograd(run, eng, "dispatch/ouro-tiny", "start-up")
    record_dispatch(run, "ouro-tiny float32 engine", engine_dispatch(eng, eager=True), rank=1)
    check_autograd(run, eng, "dispatch/ouro-tiny", "its eager launches")
    del eng, m
    free_device(dev)
    return d


# ---------------------------------------------------------------------------------- 2. float64 parity
# the parity engines: a batch of 4 at most, a 16-token launch budget (prompts of up to 40 ids are chunked)
PARITY_ENGINE = dict(max_batch_size=4, exit_threshold=THRESHOLD, lookahead=True, kv_cache_tokens=512,
                     max_num_batched_tokens=16)
PARITY_ARCHS, PARITY_LAYOUTS = ("ouro-tiny", "huginn-tiny"), ("last_exited", "shared")


def parity_variants() -> dict[str, dict]:
    """name -> EngineConfig keywords, plus "graphs": captured at engine start-up (CUDA graphs; on a
    CPU the stand-in, `stand_in`) and "paged": paged FlexAttention, run eagerly. Every other variant
    names SDPA: paged is the CUDA default, and compiled it is not float64-exact (parity_paged)."""
    sdpa = dict(attention_backend="sdpa")
    eager = dict(sdpa, cuda_graphs=False, pipeline=False)
    graphs = dict(sdpa, graphs=True, pipeline=True)
    return {"eager": dict(eager, async_scheduling=False), "eager_async": dict(eager, async_scheduling=True),
            "paged": dict(eager, async_scheduling=False, paged=True),
            "graphs": dict(graphs, async_scheduling=True), "graphs_no_async": dict(graphs, async_scheduling=False),
            "cb_graphs": dict(sdpa, policy="cb", lookahead=False, graphs=True)}


def build_engine(m, kw: dict, dev: torch.device) -> LLMEngine:
    """The engine of a parity variant (parity_variants' keywords)."""
    kw = dict(kw)
    graphs, paged, cuda = kw.pop("graphs", False), kw.pop("paged", False), dev.type == "cuda"
    if graphs:
        kw["cuda_graphs"] = cuda  # (a CPU: the stand-in)
    if paged and not cuda:
        kw["attention_backend"] = "paged"  # eager FlexAttention on a CPU
    with stand_in(dev, graphs):
        eng = LLMEngine(m, EngineConfig(**kw))
    if paged and cuda:  # eager FlexAttention on CUDA (attention_backend="paged" compiles it there)
        eng.runner.enable_paged(compile=False)
    return eng


def parity_model(arch: str, dev: torch.device):
    """The float64 tiny model of `arch` (frozen, as loaders leave a model); a 64-token context holds
    every parity request (<= 50 tokens) and keeps the graphs' context buckets to three."""
    return tiny_model(arch, dtype=torch.float64, std=0.15, seed=3, max_position=64).requires_grad_(False).to(dev)


def parity_requests(arch: str) -> list[tuple[list[int], int]]:
    """8 requests: prompts up to 40 ids (longer than the 16-token launch budget, so depth-indexed
    layouts chunk them), 2-10 output tokens."""
    rng = random.Random(arch)
    return [([rng.randrange(1, 256) for _ in range(rng.randint(1, 40))], rng.randint(2, 10)) for _ in range(8)]


def run_cases(run: Run, dev: torch.device, section: str, block: dict, keys: list[str], case_fn, prior_s: float,
              until: float, cache: dict) -> None:
    """Each case of a parity section in order (`case_fn(key)` -> its value), in inference mode, then the
    section's verdict in `block` (failed, ok, all_cases_ran) and `cache` (the case's models) emptied."""
    with torch.inference_mode():
        _run_cases(run, dev, section, block, keys, case_fn, prior_s, until)
    cache.clear()
    block["failed"] = [k for k, v in block["cases"].items() if case_failed(v)]
    block["ok"] = not block["failed"]
    block["all_cases_ran"] = "not_run" not in block


def _run_cases(run: Run, dev: torch.device, section: str, block: dict, keys: list[str], case_fn, prior_s: float,
               until: float) -> None:
    """The cases, guarded: a case starts only while the mean case so far (before any: `prior_s` / the
    count) fits the budget and the section's cap (`until`); else it and the rest are skipped, with one
    entry (the estimate: theirs)."""
    took: list[float] = []
    for i, key in enumerate(keys):
        need = statistics.mean(took) if took else prior_s / len(keys)
        why = run.why_not(need, until)
        if why is not None:
            run.skip(f"{section}: {len(keys) - i} cases from {key}", need * (len(keys) - i), why)
            block["not_run"] = keys[i:]
            return
        t0 = time.perf_counter()
        run.phase(case=key)
        try:
            block["cases"][key] = case_fn(key)
        except ParamError as e:  # a setting the engine does not offer on this device: not a failure
            block["cases"][key] = f"refused: {e}"[:400]
        except Exception as e:  # noqa: BLE001 -- the check reports what failed and goes on
            block["cases"][key] = f"error: {error_text(e)}"
        free_device(dev)  # (out of the except clause: its traceback would keep the engine alive)
        took.append(time.perf_counter() - t0)
        v = block["cases"][key]
        run.say(f"{section} {key}: " + (str(v) if not isinstance(v, dict) else
                                        f"ok {v['ok']}, " + ", ".join(f"{k} {v[k]:.3g}" for k in
                                                                     ("logprob_max_abs_diff", "token_agreement"))))
        run.save()


def case_failed(v) -> bool:
    if isinstance(v, dict):
        return not v.get("ok")
    return v is not True and not str(v).startswith("refused")


def parity_float64(run: Run, dev: torch.device, prior_s: float, until: float) -> dict:
    """Section 2: {"ok", "cases": {"arch/layout/variant": True | False | "error: ..." | "refused: ..."}}.
    A refusal (ParamError: a setting the engine does not offer on this device) is not a failure."""
    variants = parity_variants()
    block = run.doc["parity_float64"] = {
        "ok": None, "failed": [], "cases": {}, "variants": variants,
        "what": "tokens and exit depths equal the reference decoder's (float64, same device); graphs: CUDA graphs, "
                "on a CPU the stand-in (graphs.use_stand_in), captured at engine start-up"}
    # paged runs FlexAttention eagerly on purpose (exactness, not speed): its "use torch.compile" warning is noise
    warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
    # (a CPU runs the graph variants on the first arch and layout only: each stand-in engine traces every
    # key at start-up, seconds; the engine's tests run the stand-in's parity grid)
    keys = [f"{a}/{lay}/{n}" for a in PARITY_ARCHS for lay in PARITY_LAYOUTS for n in variants
            if dev.type == "cuda" or (a, lay) == (PARITY_ARCHS[0], PARITY_LAYOUTS[0]) or not variants[n].get("graphs")]
    cache: dict = {}

    def case(key: str):
        arch, layout, name = key.split("/")
        if cache.get("arch") != arch:
            cache.clear()
            cache.update(arch=arch, m=parity_model(arch, dev), reqs=parity_requests(arch))
        m, reqs = cache["m"], cache["reqs"]
        if (layout, "refs") not in cache:
            refs = {}
            for full in (False, True):  # CDB's adaptive policy, CB's full depth
                pol = ExitPolicy.from_config(m.cfg, threshold=THRESHOLD, lookahead=not full, full_depth=full)
                refs[full] = [(g.token_ids, g.exit_depths) for g in
                              (reference_generate(m, p, n, pol, kv_layout=layout) for p, n in reqs)]
            cache[(layout, "refs")] = refs
        eng = build_engine(m, {"kv_layout": layout, **PARITY_ENGINE, **variants[name]}, dev)
        where = f"parity_float64/{key}"
        check_autograd(run, eng, where, "start-up")
        seqs = run_staggered(eng, [dict(prompt=p, params=SamplingParams(max_tokens=n, ignore_eos=True))
                                     for p, n in reqs], seed=key)
        outs = [eng.output(s) for s in seqs]  # (what the host has read: with async scheduling, every token once idle)
        check_autograd(run, eng, where, "its passes")
        return [(o.token_ids, o.exit_depths) for o in outs] == cache[(layout, "refs")][eng.config.policy == "cb"]

    run_cases(run, dev, "parity_float64", block, keys, case, prior_s, until, cache)
    return block


# ---------------------------------------------------------------------------------- 3. paged vs SDPA
# parity_paged's tolerances per dtype. logprob_abs: the largest |log-prob(paged) - log-prob(SDPA)|
# (nats) allowed at any output token, teacher-forced; token_margin: a greedy token may differ only
# where SDPA's top-2 log-prob margin is within it (each path may be off by logprob_abs); reference_floor:
# paged's largest error against float64 may be at most 2 x SDPA's + this (paged no less accurate than SDPA).
# Measured on a CPU (eager FlexAttention in the stand-in): float32 differences of 1e-6..6e-5, bfloat16 0.03
# on ouro-tiny (SDPA's own error against float64 there: 0.064)
TOLERANCE = {"float32": {"logprob_abs": 1e-3, "token_margin": 2e-3, "reference_floor": 1e-4},
             "bfloat16": {"logprob_abs": 0.15, "token_margin": 0.3, "reference_floor": 0.05}}
# (dtype, arch, layout), most wanted first (the section's cap skips from the end); a CPU runs the first two
# (eager FlexAttention inside the stand-in costs ~5-30 s a case there). No bfloat16 Huginn: huginn-tiny in
# bfloat16 is ~3.6 nats from float64 on either path (its 6-step loop of 2-2-2 layers, embed scale 8), too
# far for any attention tolerance to mean something
PAGED_CASES = [("float32", "ouro-tiny", "last_exited"), ("bfloat16", "ouro-tiny", "last_exited"),
               ("float32", "huginn-tiny", "last_exited"), ("float32", "ouro-tiny", "shared")]
PAGED_CASES_CPU = 2


def forced_depths(arch: str, reqs, r_max: int) -> list[list[int]]:
    """Seeded exit depths, one per decode token (1..r_max): both attention paths run the same
    batches at the same mixed depths, whatever their scores."""
    rng = random.Random(f"{arch}/depths")
    return [[rng.randint(1, r_max) for _ in range(n)] for _, n in reqs]


def _margin(top: dict) -> float:
    v = sorted(top.values(), reverse=True)
    return v[0] - v[1] if len(v) > 1 else float("inf")


def paged_case(run: Run, key: str, m64, dtype: torch.dtype, layout: str, reqs, depths, dev: torch.device) -> dict:
    """One parity_paged case: the float64 model's weights rounded to `dtype`, one engine with SDPA
    and one with paged FlexAttention (compiled on CUDA, both inside graphs captured at start-up),
    same settings, same forced depths, staggered arrivals. Each engine's greedy pass (top-2
    log-probs); the paged engine again teacher-forced on SDPA's tokens; the float64 model (eager
    SDPA, exact by section 2) teacher-forced on them too."""
    m = copy.deepcopy(m64).to(dtype)
    # (K = 1: min_coda_batch="auto" decides from measured launch times, so the two engines could batch
    # differently; with K fixed and the depths forced they run the very same launches)
    settings = {"kv_layout": layout, **PARITY_ENGINE, "min_coda_batch": 1, "pipeline": True, "async_scheduling": False,
                "cuda_graphs": dev.type == "cuda"}

    def adds(eng, forced=None) -> list[dict]:
        return [dict(prompt=p, params=SamplingParams(max_tokens=n, ignore_eos=True, logprobs=True,
                                                     top_logprobs=2 if forced is None else 0),
                     forced_output=None if forced is None else forced[i],
                     tracker=RP.ForcedTracker(eng.policy, depths[i])) for i, (p, n) in enumerate(reqs)]

    got: dict = {}
    for backend in ("sdpa", "paged"):
        with stand_in(dev):
            eng = LLMEngine(m, EngineConfig(**settings, attention_backend=backend))
        where = f"parity_paged/{key}/{backend}"
        check_autograd(run, eng, where, "start-up")
        seqs = run_staggered(eng, adds(eng), seed=key)
        got[backend] = {"tokens": [list(s.output_ids) for s in seqs], "logprobs": [list(s.logprobs) for s in seqs],
                        "top": [list(s.top_logprobs) for s in seqs], "depths": [list(s.exit_depths) for s in seqs],
                        "graph_capture": eng.graph_capture}
        if backend == "paged":
            got["paged_forced"] = [list(s.logprobs) for s in
                                   run_staggered(eng, adds(eng, got["sdpa"]["tokens"]), seed=key)]
        check_autograd(run, eng, where, "its passes")
        eng = seqs = None
        free_device(dev)
    eng = LLMEngine(m64, EngineConfig(**{**settings, "cuda_graphs": False}, attention_backend="sdpa"))
    lp64 = [list(s.logprobs) for s in run_staggered(eng, adds(eng, got["sdpa"]["tokens"]), seed=key)]
    eng = None
    name = str(dtype).removeprefix("torch.")
    tol = TOLERANCE[name]
    sd, pf = got["sdpa"]["logprobs"], got["paged_forced"]
    diff = max(abs(a - b) for x, y in zip(sd, pf) for a, b in zip(x, y))
    err = {k: max(abs(a - b) for x, y in zip(v, lp64) for a, b in zip(x, y)) for k, v in (("sdpa", sd), ("paged", pf))}
    divergences, agree, total = [], 0, 0
    for i, (ts, tp, top) in enumerate(zip(got["sdpa"]["tokens"], got["paged"]["tokens"], got["sdpa"]["top"])):
        total += len(ts)
        j = next((j for j, (a, b) in enumerate(zip(ts, tp)) if a != b), None)
        agree += len(ts) if j is None else j
        if j is not None:
            divergences.append({"request": i, "position": j, "sdpa_top2_margin": _margin(top[j]),
                                "within_margin": _margin(top[j]) <= tol["token_margin"]})
    depths_equal = got["sdpa"]["depths"] == got["paged"]["depths"]
    as_accurate = err["paged"] <= 2 * err["sdpa"] + tol["reference_floor"]
    ok = diff <= tol["logprob_abs"] and all(d["within_margin"] for d in divergences) and depths_equal and as_accurate
    return {"ok": ok, "dtype": name, "logprob_max_abs_diff": diff, "tolerance": tol,
            "token_agreement": agree / total, "tokens": total, "divergences": divergences,
            "depths_equal": depths_equal, "reference_error": err, "as_accurate_as_sdpa": as_accurate,
            "graph_capture": {b: got[b]["graph_capture"] for b in ("sdpa", "paged")}}


def parity_paged(run: Run, dev: torch.device, prior_s: float, until: float) -> dict:
    """Section 3: {"ok", "cases": {"dtype/arch/layout": {...} | "error: ..."}} (paged_case)."""
    cuda = dev.type == "cuda"
    block = run.doc["parity_paged"] = {
        "ok": None, "failed": [], "cases": {}, "tolerance": TOLERANCE,
        "paged": "compiled FlexAttention inside CUDA graphs (attention_backend='paged', the CUDA default)" if cuda
        else "eager FlexAttention inside the graph stand-in (attention_backend='paged'; compiled only on CUDA)",
        "what": "paged FlexAttention vs SDPA attention, same engine settings (lookahead pipeline, graphs captured at "
                "start-up, staggered arrivals, chunked prompts), the same seeded exit depths forced on both",
        "rules": "ok: (1) teacher-forced on SDPA's greedy tokens, every output token's |log-prob(paged) - "
                 "log-prob(SDPA)| <= tolerance.logprob_abs; (2) greedy tokens equal up to each request's first "
                 "divergence (later tokens are not compared: their contexts differ), and a divergence only where "
                 "SDPA's top-2 log-prob margin there is <= tolerance.token_margin (2 x logprob_abs); (3) exit depths "
                 "equal (forced); (4) as_accurate_as_sdpa: reference_error.paged <= 2 x reference_error.sdpa + "
                 "tolerance.reference_floor, reference_error being each path's largest |log-prob - float64's| on the "
                 "same tokens and depths (the float64 model, eager SDPA, exact by parity_float64)"}
    cases = PAGED_CASES if cuda else PAGED_CASES[:PAGED_CASES_CPU]
    if not cuda:
        block["cases_not_on_cpu"] = ["/".join(c) for c in PAGED_CASES[PAGED_CASES_CPU:]]
    keys = [f"{dt}/{arch}/{layout}" for dt, arch, layout in cases]
    cache: dict = {}

    def case(key: str):
        dt, arch, layout = key.split("/")
        if cache.get("arch") != arch:
            cache.clear()
            m = parity_model(arch, dev)
            reqs = parity_requests(arch)
            cache.update(arch=arch, m=m, reqs=reqs, depths=forced_depths(arch, reqs, m.cfg.r_max))
        return paged_case(run, key, cache["m"], getattr(torch, dt), layout, cache["reqs"], cache["depths"], dev)

    run_cases(run, dev, "parity_paged", block, keys, case, prior_s, until, cache)
    return block


# ---------------------------------------------------------------------------------- launch instrument
def launch_kind(work) -> str:
    """prefill (a separate prefill launch), mixed (prompt chunks ride along; eager on the SDPA path),
    else the stage."""
    return "prefill" if work.stage is Stage.PREFILL else "mixed" if work.chunks else work.stage.value


class LaunchProbe:
    """An `LLMEngine.on_launch` instrument for one pass. Per launch: its kind and host seconds; on
    CUDA a timing event recorded on the device's current stream before and after it (reading them
    waits for nothing until the pass's final synchronize) and the allocator's peak during it (the
    allocator's statistics are kept on the host as kernels are enqueued: exact without a sync)."""

    def __init__(self, dev: torch.device):
        self.dev, self.cuda = dev, dev.type == "cuda"
        self.kinds: list[str] = []
        self.host: list[float] = []
        self.events: list[list] = []
        self.mem: dict[str, dict] = {}
        self.pass_peak = 0
        self._base = 0

    def __call__(self, work, seconds: float | None) -> None:
        if seconds is None:
            self.kinds.append(launch_kind(work))
            if self.cuda:
                # the peak since the previous launch began (that launch, and what ran between) counts for the pass
                self.pass_peak = max(self.pass_peak, torch.cuda.max_memory_allocated(self.dev))
                torch.cuda.reset_peak_memory_stats(self.dev)
                self._base = torch.cuda.memory_allocated(self.dev)
                ev = torch.cuda.Event(enable_timing=True)
                ev.record(torch.cuda.current_stream(self.dev))
                self.events.append([ev, None])
            return
        self.host.append(seconds)
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record(torch.cuda.current_stream(self.dev))
            self.events[-1][1] = ev
            top = torch.cuda.max_memory_allocated(self.dev)
            m = self.mem.setdefault(self.kinds[-1], {"launches": 0, "peak_over_base_bytes": 0,
                                                     "peak_allocated_bytes": 0})
            m["launches"] += 1
            m["peak_over_base_bytes"] = max(m["peak_over_base_bytes"], top - self._base)
            m["peak_allocated_bytes"] = max(m["peak_allocated_bytes"], top)

    def host_summary(self) -> dict:
        """Launches and host milliseconds per launch (runner.run's wall time) by kind."""
        out: dict[str, dict] = {}
        for k, s in zip(self.kinds, self.host):
            d = out.setdefault(k, {"launches": 0, "host_ms": 0.0})
            d["launches"] += 1
            d["host_ms"] += 1e3 * s
        for d in out.values():
            d["mean_host_ms"] = d["host_ms"] / d["launches"]
        return out

    def idle(self) -> dict | None:
        """The device's time between consecutive launches (after the pass's synchronize): the span
        from the first launch's start to the last one's end, the share of it between launches (any
        two consecutive ones), and where it falls, by the pair of kinds. Device work the engine
        enqueues between launches (the sampler's argmax) counts as between; the device idling
        inside an eager launch whose kernels the host enqueues slower than they run counts as in."""
        if not self.cuda or not self.events:
            return None
        torch.cuda.synchronize(self.dev)
        ev = self.events
        span = ev[0][0].elapsed_time(ev[-1][1])
        busy = [s.elapsed_time(e) for s, e in ev]
        gaps = [e0.elapsed_time(s1) for (_, e0), (s1, _) in zip(ev, ev[1:])]
        pairs: dict[str, dict] = {}
        for a, b, g in zip(self.kinds, self.kinds[1:], gaps):
            p = pairs.setdefault(f"{a}>{b}", {"count": 0, "total_ms": 0.0})
            p["count"] += 1
            p["total_ms"] += g
        for p in pairs.values():
            p["mean_ms"] = p["total_ms"] / p["count"]
        device: dict[str, dict] = {}
        for k, t in zip(self.kinds, busy):
            d = device.setdefault(k, {"launches": 0, "total_ms": 0.0})
            d["launches"] += 1
            d["total_ms"] += t
        for d in device.values():
            d["mean_ms"] = d["total_ms"] / d["launches"]
        srt = sorted(gaps) or [0.0]
        return {"launches": len(ev), "span_ms": span, "between_launches_ms": sum(gaps),
                "idle_fraction": sum(gaps) / span if span > 0 else None,
                "gap_ms": {"mean": sum(gaps) / max(1, len(gaps)), "p50": srt[len(srt) // 2],
                           "p90": srt[int(0.9 * (len(srt) - 1))], "max": srt[-1]},
                "by_pair": dict(sorted(pairs.items(), key=lambda kv: -kv[1]["total_ms"])),
                "device_ms_by_kind": device}


# what graph_pool_bytes should come to (memory_report; the JSON states it beside the number)
GRAPH_POOL_EXPECTATION = (
    "the engine captures its graphs largest key first (infer.engine.graphs.key_order), all into one shared pool, "
    "so every smaller key reuses the segments of the largest one: graph_pool_bytes should be about the largest "
    "decode body plus the graphs' static outputs, i.e. decode_reserve_bytes = reserve_bytes.decode + "
    "reserve_bytes.graph_outputs (checks.decode_over_reserve near 1 or below), not twice the body (what "
    "smallest-first capture grew it to)")


def graph_pool_bytes(eng: LLMEngine) -> int | None:
    """Bytes of the segments of the engine's CUDA graph pool (None without graphs)."""
    g = getattr(eng.runner, "graphs", None)
    if g is None or g.pool is None:
        return None
    segs = torch.cuda.memory_snapshot(mempool_id=g.pool, include_traces=False)
    return sum(s["total_size"] for s in segs if s.get("device") == eng.model.device.index
               and tuple(s.get("segment_pool_id", g.pool)) == tuple(g.pool))


def reserve_for(model, config: EngineConfig, reserves: dict) -> dict:
    """What memory.py reserves for activations under `config` (resolved, before the pool is sized:
    what LLMEngine's cuda_budget measures; the engine keeps no record of it, so it is measured again
    here, before the engine takes the memory), per distinct config: launch_peaks' largest prefill,
    log-probs and decode launch, and their sum that the pool leaves free (activation_reserve)."""
    c = config.resolve(model.cfg, model.device)
    key = (c.max_launch_tokens(), c.max_batch_size, c.kv_layout, c.full_depth, c.exit_criterion, c.max_model_len,
           c.block_size, c.attention_backend, c.policy, c.cuda_graphs)
    if key not in reserves:
        peaks = launch_peaks(model, c)
        reserves[key] = {**peaks, "activation_reserve": activation_reserve(peaks)}
        free_device(model.device)
    return reserves[key]


def memory_report(eng: LLMEngine, probe: LaunchProbe, reserve: dict) -> dict:
    """The reserve per launch kind beside what the instrumented pass allocated per launch kind, and
    the CUDA graphs' pool (captured at start-up, the largest context bucket included) beside the
    decode reserve it is meant to fit."""
    c, dev = eng.config, eng.model.device
    out = {"reserve_bytes": reserve, "kv_pool_tokens": c.kv_cache_tokens,
           "kv_pool_bytes": c.kv_cache_tokens * eng.kv_bytes_per_token,
           "graph_pool_bytes": None, "graph_pool_expectation": GRAPH_POOL_EXPECTATION, "measured": None, "checks": None}
    if dev.type != "cuda":
        return out
    pool = guarded(graph_pool_bytes, eng)
    if isinstance(pool, dict):  # (the snapshot API failed: the rest of the report still stands)
        out["graph_pool_error"], pool = pool["error"], None
    free, total = torch.cuda.mem_get_info(dev)
    out.update(graph_pool_bytes=pool, measured={
        # (the peak since the last launch began: no reset since)
        "per_kind": probe.mem, "pass_peak_allocated_bytes": max(probe.pass_peak, torch.cuda.max_memory_allocated(dev)),
        "memory_reserved_bytes": torch.cuda.memory_reserved(dev), "device_total_bytes": total,
        "device_free_bytes": free})
    eager = [v["peak_over_base_bytes"] for k, v in probe.mem.items() if k in ("mixed", "prefill")]
    decode = [v["peak_over_base_bytes"] for k, v in probe.mem.items() if k not in ("mixed", "prefill")]
    eager_reserve = max(reserve["prefill"], reserve["logprobs"])
    # with graphs a decode launch allocates next to nothing: its memory is the graph pool's, which also
    # keeps the graphs' static outputs (memory.graph_output_bytes: launch_peaks' `graph_outputs`)
    graphs = getattr(eng.runner, "graphs", None) is not None
    used = pool if graphs else max(decode) if decode else None
    out["decode_reserve_bytes"] = dec = reserve["decode"] + (reserve.get("graph_outputs", 0) if graphs else 0)
    out["checks"] = {
        "eager_within_reserve": max(eager) <= eager_reserve if eager else None,
        "eager_over_reserve": max(eager) / eager_reserve if eager and eager_reserve else None,
        "decode_within_reserve": used <= dec if used is not None else None,
        "decode_over_reserve": used / dec if used is not None and dec else None}
    return out


# ---------------------------------------------------------------------------------- exit depths
DEPTH_RULE = ("every adaptive mode replays the depths the recorded rule decides (lookahead as recorded: off), the "
              "lookahead-pipeline modes included, so all of them run the same per-token depths and their times "
              "compare. "
              "A lookahead head distilled from the gate (lookahead_gate, as the demo checkpoints carry) decides such "
              "depths one step ahead, which the pipeline needs; the gate itself read one step late would exit one "
              "step deeper")


class RecordedExits:
    """Ouro: the depths ouro-demo's recorded scores decide under each engine's exit policy
    (replay.replay_depths), given to the workload's requests as the emulated device's replay gives
    them (emulated.ReplayedDepths, by index): request i gets record i mod the file's count, and a
    token past its record's length repeats the record's decode depths. The recorded rule decides
    (lookahead as recorded: off) for every mode, the lookahead pipeline's included, so that every
    adaptive mode runs the same depths and their times compare (DEPTH_RULE)."""

    def __init__(self, path: Path, workload: str = "alpaca"):
        self.doc, self.workload, self.path = RP.load(path), workload, path

    def settings(self) -> dict:
        return RP.engine_settings(self.doc, {})  # the recorded criterion, threshold and r_min

    def depths(self, policy: ExitPolicy, reqs) -> list[list[int]]:
        if policy.adaptive:
            policy = dataclasses.replace(policy, lookahead=bool(self.doc["lookahead"]))
        rd = ReplayedDepths(RP.replay_depths(self.doc, self.workload, policy), by_index=True)
        return [[rd(str(i), k) for k in range(1, r.output_len + 1)] for i, r in enumerate(reqs)]

    def describe(self) -> dict:
        d = self.doc
        return {"source": str(self.path.relative_to(ROOT) if self.path.is_relative_to(ROOT) else self.path),
                "recorded_on": d["model"], "criterion": d["criterion"], "threshold": d["threshold"],
                "r_min": d["replay_r_min"], "records": len(RP.requests_of(d, self.workload)),
                "how": "request i replays record i mod records (emulated.ReplayedDepths), cycling its decode depths",
                "depth_rule": DEPTH_RULE}


class DrawnExits:
    """Huginn: no recording at r_max 16, so depths 1 + Binomial(r_max - 1, p) around the simulator's
    assumed mean (infer/sim/runner.py), drawn per request by seed."""

    def __init__(self, mean: float, seed: int = 0):
        self.mean, self.seed = mean, seed

    def settings(self) -> dict:
        return {}

    def depths(self, policy: ExitPolicy, reqs) -> list[list[int]]:
        return [d[1:] + [d[-1]] for d in depths_from_distribution(binomial_depths(policy.r_max, self.mean), reqs,
                                                                  self.seed)]

    def describe(self) -> dict:
        return {"source": "binomial", "mean_depth": self.mean, "seed": self.seed,
                "how": "1 + Binomial(r_max - 1, p) per token (infer.sim.runner.binomial_depths)"}


def trackers_for(exits, policy: ExitPolicy, reqs):
    """run_engine's `trackers`: request i's ForcedTracker (fresh per pass), or None at full depth."""
    if not policy.adaptive:
        return None
    depths = exits.depths(policy, reqs)
    return lambda i: RP.ForcedTracker(policy, depths[i])


# ---------------------------------------------------------------------------------- 4-5. a model shape
def shape_model(name: str, small: bool, dev: torch.device):
    """A paper shape with random weights (bf16 on CUDA; --small: fp32 at SMALL_SHAPES' size)."""
    cfg = paper_config(name, **(SMALL_SHAPES[name] if small else {}))
    return dummy_model(cfg, torch.float32 if small or dev.type != "cuda" else torch.bfloat16, dev)


def run_mode(run: Run, key: str, model, mode: dict, base: dict, exits, reqs_for, repeats: int,
             reserves: dict, keep_s: float = 0.0) -> tuple:
    """One mode: its engine (graphs captured at construction: CUDA graphs, on a CPU the stand-in),
    a traced untimed pass, an instrumented pass, then up to `repeats` timed untraced passes (past
    MIN_REPEATS only while the budget allows them and still `keep_s`, the estimate of the modes
    after this one: more modes before more rounds); the autograd check after start-up and after the
    passes; in the Ouro section, the dispatch costs at its shape (dispatch_at_shape). Returns
    (raw record for summarize, extras for the JSON)."""
    dev, where = model.device, f"{key}/{mode['name']}"
    run.phase(phase="memory reserve (launch_peaks)")
    reserve = guarded(reserve_for, model, EngineConfig(**{**base, **mode_kwargs(mode)}), reserves)
    run.phase(phase="engine start-up")
    t0 = time.perf_counter()
    with stand_in(dev):
        eng = make_engine(model, None, mode, base)
    build_s = time.perf_counter() - t0
    check_autograd(run, eng, where, "start-up")
    reqs = reqs_for(eng)
    trackers = trackers_for(exits, eng.policy, reqs)
    run.phase(phase="traced pass")
    traced = run_engine(eng, mode, reqs, keep_trace=False, trackers=trackers)
    probe = LaunchProbe(dev)
    eng.on_launch.append(probe)
    run.phase(phase="instrumented pass")
    instrumented = run_engine(eng, mode, reqs, keep_trace=False, trackers=trackers, traced=False)
    eng.on_launch.remove(probe)
    c = eng.config
    extras = {"build_seconds": build_s, "instrumented_seconds": instrumented["seconds"],
              "graph_capture": eng.graph_capture and {**eng.graph_capture, "stand_in": dev.type != "cuda"},
              "attention_backend": c.attention_backend, "pipeline": c.pipeline, "async_scheduling": c.async_scheduling,
              "min_coda_batch": c.min_coda_batch, "launches": probe.host_summary(), "idle": guarded(probe.idle),
              "memory": guarded(memory_report, eng, probe, reserve) if "error" not in reserve else reserve}
    reps: list[dict] = []
    for k in range(repeats):
        need = reps[-1]["seconds"] if reps else instrumented["seconds"]
        if k >= MIN_REPEATS and not run.allows(need + keep_s):
            why = run.why_not(need) or f"the section's later modes need ~{keep_s:.0f} s of the budget"
            run.skip(f"{where} timed passes {k + 1}-{repeats}", need * (repeats - k), why)
            break
        run.phase(phase=f"timed pass {k + 1} of {repeats}", timed_seconds=[r["seconds"] for r in reps])
        reps.append(untraced_timing(traced, run_engine(eng, mode, reqs, keep_trace=False, trackers=trackers,
                                                       traced=False)))
    check_autograd(run, eng, where, "its passes")
    if key == "ouro_1p4b":
        extras["dispatch"] = dispatch_at_shape(run, eng, where)
    return pick_raw(reps, "median"), extras


def dispatch_at_shape(run: Run, eng, where: str) -> dict | None:
    """The dispatch costs on a paper-shape engine, while the JSON has none from one yet: the eager
    op cost on the first engine whose attention runs eagerly (SDPA), a replay's on the first with
    CUDA graphs."""
    cuda = eng.model.device.type == "cuda"
    eager = eng.config.attention_backend == "sdpa" and run.dispatch_ranks["op"] < 2
    replay = cuda and getattr(eng.runner, "graphs", None) is not None and run.dispatch_ranks["replay"] < 2
    if not (eager or replay):
        return None
    run.phase(phase="dispatch costs")
    m = guarded(engine_dispatch, eng, eager)
    if "error" not in m:
        record_dispatch(run, where, m, rank=2)
    return m


def idle_fraction(result: dict) -> float | None:
    return (result.get("idle") or {}).get("idle_fraction")


def fmt_interval(iv: dict | None) -> str | None:
    return None if not iv else f"{iv['median']:.3f} [{iv['lo']:.3f}, {iv['hi']:.3f}] {iv['verdict']}"


def shape_section(run: Run, key: str, name: str, small: bool, dev: torch.device, exits, modes: list[dict],
                  num_requests: int, scale: float, repeats: int, base: dict, first_estimate_s: float) -> dict:
    """Sections 4 and 5: every mode of `modes` on one model shape, each guarded (its estimate: the
    longest mode of the section so far x 1.2, before any `first_estimate_s`), its result or error
    saved as soon as it ends."""
    t0 = time.perf_counter()
    model = shape_model(name, small, dev)
    cfg = model.cfg
    base = {**base, **exits.settings()}
    block = run.doc[key] = {"model": {**model_meta(model, name, None), "dtype": str(model.dtype).removeprefix("torch."),
                                      "weights": "random (load_format dummy)", "small": small},
                            "exits": exits.describe(), "engine_settings": base, "modes": {m["name"]: mode_kwargs(m)
                                                                                          for m in modes},
                            "modes_run": [], "modes_skipped": [], "errors": {}}
    run.say(f"{key}: {name} {'(small) ' if small else ''}built in {time.perf_counter() - t0:.1f} s")
    made: list = []

    def reqs_for(eng: LLMEngine):  # once, at the context the first engine serves (max_model_len)
        if not made:
            made.append(make_requests("alpaca", num_requests, seed=0, scale=scale, max_model_len=eng.max_model_len,
                                      vocab_size=cfg.vocab_size))
            block["workload"] = describe(made[0], "alpaca", scale, eng.max_model_len)
            block["bounds"] = bounds_block(cfg, made[0])
        return made[0]

    raws, extras, reserves, longest = {}, {}, {}, 0.0
    for i, mode in enumerate(modes):
        what = f"{key}/{mode['name']}"
        need = 1.2 * longest if longest else first_estimate_s
        keep = (len(modes) - 1 - i) * need  # (the later modes' estimate: run_mode's extra rounds leave it)
        if not run.guard(what, need):
            block["modes_skipped"].append(mode["name"])
            continue
        run.begin(what, need)
        m0, failed = time.perf_counter(), None
        try:
            raws[mode["name"]], extras[mode["name"]] = run_mode(run, key, model, mode, base, exits, reqs_for, repeats,
                                                                reserves, keep)
        except Exception as e:  # noqa: BLE001 -- one mode's failure is reported, the others still run
            failed = {"error": error_text(e), "refused": isinstance(e, ParamError)}
        free_device(dev)  # (out of the except clause: its traceback would keep the engine alive)
        took = time.perf_counter() - m0
        longest = max(longest, took)  # (a failed mode's time counts too: the next one's estimate)
        if failed:
            block["errors"][mode["name"]] = {**failed, "seconds": round(took, 2)}
            run.say(f"{what}: {failed['error']}")
            run.end(what, took, "refused" if failed["refused"] else "error")  # (saved now, not when the section ends)
            continue
        extras[mode["name"]]["mode_seconds"] = took
        block["modes_run"].append(mode["name"])
        r, x = raws[mode["name"]], extras[mode["name"]]
        gc_, idle = x["graph_capture"], idle_fraction(x)
        run.say(f"{what}: {len(r['seconds_all'])} timed passes, median {r['seconds']:.3f} s "
                f"({r['output_tokens'] / r['seconds']:.0f} tok/s), mean depth {r['mean_exit_depth']:.2f}"
                + (f", idle {idle:.1%}" if idle is not None else "")
                + (f", {gc_['captured']} graphs in {gc_['seconds']:.1f} s" if gc_ else "")
                + f"; mode took {took:.1f} s")
        summarize_into(block, raws, extras, cfg, made[0], base, repeats)
        run.end(what, took)
    block["seconds"] = time.perf_counter() - t0
    del model
    free_device(dev)
    return block


def summarize_into(block: dict, raws: dict, extras: dict, cfg, reqs, base: dict, repeats: int) -> None:
    """The section's results so far: infer/sim/stats.summarize per mode (speedup over CB with its
    interval, bounds, work counts) with this check's extras, the paired RATIOS, and the headline."""
    settings = {**base, "repeats": repeats, "stat": "median", "workload": "alpaca"}
    results = {r["mode"]: {**r, **extras[r["mode"]]} for r in summarize(raws, cfg, reqs, settings)}
    block["results"] = results
    block["speedup_vs_cb"] = {n: r.get("speedup_interval") for n, r in results.items() if n != "cb"}
    # time of a / time of b, round by round (both modes' k-th timed pass): above 1, b is faster
    block["ratios"] = {n: {**ratio_interval(raws[a]["seconds_all"], raws[b]["seconds_all"]), "time_of": a, "over": b}
                       for n, (a, b) in RATIOS.items() if a in raws and b in raws}
    block["headline"] = headline(list(results.values()))


def huginn_estimate(ouro: dict, small: bool, huginn_requests: int) -> float:
    """Seconds Huginn's first mode may take: Ouro's longest mode scaled by the full-depth FLOPs per
    token (infer/sim/bounds.py) and the request counts (a rough gate, not a prediction)."""
    longest = max([r["mode_seconds"] for r in (ouro.get("results") or {}).values()] or [0.0])
    if not longest:
        return 0.0
    n_o = ouro["workload"]["num_requests"]

    def full(name: str) -> float:
        c = paper_config(name, **(SMALL_SHAPES[name] if small else {}))
        f0, fr = B.f0_fr(c, 256.0)
        return f0 + c.r_max * fr

    return longest * full("huginn-3.5b") / full("ouro-1.4b") * huginn_requests / n_o


# ---------------------------------------------------------------------------------- the summary
def summary(doc: dict) -> dict:
    """What the run printed last: parity, dispatch, the autograd check, and per shape the speedups,
    ratios, idle fractions, captures and the memory checks (the full record is the JSON file)."""
    pp = doc.get("parity_paged") or {}
    d = doc.get("dispatch") or {}
    out = {"parity_float64_ok": (doc.get("parity_float64") or {}).get("ok"), "parity_paged_ok": pp.get("ok"),
           "parity_paged": {k: (v if not isinstance(v, dict) else
                                {"ok": v["ok"], "logprob_max_abs_diff": v["logprob_max_abs_diff"],
                                 "tolerance": v["tolerance"]["logprob_abs"], "token_agreement": v["token_agreement"]})
                            for k, v in (pp.get("cases") or {}).items()},
           "dispatch": {"op_us": d.get("op_us"), "replay_us": d.get("replay_us")},
           "autograd_check_ok": (doc.get("autograd_check") or {}).get("ok")}
    for key in ("ouro_1p4b", "huginn_3p5b"):
        b = doc.get(key)
        if not b or "results" not in b:
            out[key] = b and (b.get("skipped") or b.get("error") or b.get("errors"))
            continue
        res = b["results"]
        out[key] = {"tok_per_s": {n: round(r["output_tokens_per_s"], 1) for n, r in res.items()},
                    "speedup_vs_cb": {n: fmt_interval(iv) for n, iv in b["speedup_vs_cb"].items()},
                    "ratios": {n: fmt_interval(iv) for n, iv in b.get("ratios", {}).items()},
                    "idle_fraction": {n: idle_fraction(r) for n, r in res.items()},
                    "graphs": {n: r["graph_capture"] for n, r in res.items()},
                    "memory_checks": {n: r["memory"].get("checks", r["memory"].get("error")) for n, r in res.items()},
                    "errors": b["errors"], "modes_skipped": b.get("modes_skipped")}
    out["skipped"] = [s["what"] for s in doc["skipped"]]
    out["terminated"] = doc.get("terminated")
    out["wall_s"] = doc.get("wall_s")
    return out


def new_doc(a, argv, dev: torch.device, sections: list[str], deadline_s: float | None, repeats: int) -> dict:
    cuda = dev.type == "cuda"
    nulls = {"dispatch.op_us": "the dispatch section has not run", "dispatch.replay_us":
             "no engine with CUDA graphs has run yet" if cuda else
             "a CUDA graph replay needs a CUDA device (the CPU stand-in replays a traced FX graph: not a CUDA graph's "
             "host cost)"}
    if not cuda:
        nulls.update({"idle": "CUDA events need a CUDA device",
                      "memory.graph_pool_bytes / measured / checks": "the allocator's statistics need a CUDA device"})
    return {
        "check": "scripts/gpu_check.py", "command": "python -m scripts.gpu_check " + " ".join(
            argv if argv is not None else sys.argv[1:]), "device": torch.cuda.get_device_name(dev) if cuda else "cpu",
        "device_type": dev.type, "torch": torch.__version__, "cuda_version": torch.version.cuda, "small": a.small,
        "tf32_matmul": torch.backends.cuda.matmul.allow_tf32, "budget_s": a.budget_s, "deadline_s": deadline_s,
        "sections": sections, "min_repeats": MIN_REPEATS, "repeats": repeats, "complete": False, "exit_code": None,
        "sections_done": [], "skipped": [],
        "dispatch": {"op_us": None, "replay_us": None, "device": dev.type,
                     "how": {"op_us": "host microseconds per eager aten op: an eager run of an engine's decode body "
                                      "(ModelRunner.body on the scratch slot, SDPA attention) over its aten op count "
                                      "(a TorchDispatchMode; FlexAttention would count as one), the median of 20 runs; "
                                      "the paper shape's engine where it ran, else the tiny engine's, else the micro "
                                      "loop's (dispatch.micro)" + ("" if cuda else "; measured on this CPU"),
                             "replay_us": "host microseconds of one CUDAGraph.replay() call of one of the engine's "
                                          "captured graphs (its smallest decode key, input on the scratch slot), "
                                          "wall time of the call, not device time; median of 50, synchronized between"},
                     "micro": None, "engines": []},
        "autograd_check": {"ok": True, "checks": 0, "failures": [],
                           "what": "every engine after start-up and after its passes: no model parameter requires "
                                   "grad; no tensor of the runner, its KV layout, batch state or graph outputs has a "
                                   "grad_fn or requires grad (autograd_problems)"},
        "nulls": nulls}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m scripts.gpu_check", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("gpu_check_out"), help="folder of gpu_check.json")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--small", action="store_true", help="tiny shapes, few requests (the CPU dry run)")
    ap.add_argument("--budget-s", type=float, default=BUDGET_S,
                    help="a section, mode, parity case or timed pass past %d starts only if its estimate ends "
                         "within this many seconds" % MIN_REPEATS)
    ap.add_argument("--deadline-s", type=float, default=None,
                    help="seconds after which the run saves its JSON and exits (SIGALRM, as SIGTERM; default: "
                         "--budget-s + %g; 0: none)" % DEADLINE_PAST_BUDGET_S)
    ap.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated subset of " + ",".join(SECTIONS))
    ap.add_argument("--repeats", type=int, default=None, help="timed passes per mode (default 5; Huginn 3)")
    ap.add_argument("--num-requests", type=int, default=None,
                    help="Ouro's Alpaca requests (default 256; --small 12); Huginn runs a quarter of them")
    a = ap.parse_args(argv)
    sections = [s for s in a.sections.split(",") if s]
    unknown = sorted(set(sections) - set(SECTIONS))
    if unknown:
        ap.error(f"unknown --sections {unknown}; known: {SECTIONS}")
    dev = torch.device(a.device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    cuda = dev.type == "cuda"
    if not cuda:
        torch.set_num_threads(1)  # (the bench's default: one thread, steady on a shared CPU)
    repeats = a.repeats or 5
    n_ouro = a.num_requests or (12 if a.small else 256)
    n_huginn = max(4, n_ouro // 4)  # one wave of 64 on a GPU: a Huginn-3.5B CB pass takes ~4 s on an H100
    scale = 0.25 if a.small else 1.0
    # --small: SMALL_BASE; else the engine's CUDA defaults. (Attention left to the device's default: paged
    # on CUDA; on a CPU SDPA, the `_sdpa` modes then equal the default ones: eager FlexAttention on a CPU
    # costs seconds per engine, parity_paged runs it there)
    base = dict(SMALL_BASE) if a.small else {}
    deadline = a.budget_s + DEADLINE_PAST_BUDGET_S if a.deadline_s is None else a.deadline_s or None
    kind = "small" if a.small else "cuda"
    priors = PRIORS[kind]
    doc = new_doc(a, argv, dev, sections, deadline, repeats)
    run = Run(a.out, a.budget_s, doc, priors)
    run.say(f"gpu_check on {doc['device']} (torch {torch.__version__}), budget {a.budget_s:g} s, deadline "
            f"{deadline or 'none'} -> {run.path}")
    try:
        with signals_saved(run, deadline):
            run_sections(run, a, dev, sections, priors, kind, base, repeats, n_ouro, n_huginn, scale)
    except Terminated:
        print(json.dumps(summary(doc), indent=1, default=str), flush=True)
        return doc
    doc["complete"] = True
    doc["exit_code"] = 0 if doc["autograd_check"]["ok"] else 1
    run.save()
    print(json.dumps(summary(doc), indent=1, default=str), flush=True)
    if not doc["autograd_check"]["ok"]:
        run.say(f"AUTOGRAD CHECK FAILED ({len(doc['autograd_check']['failures'])} engines): exit 1")
    run.say(f"wrote {run.path}")
    return doc


def run_sections(run: Run, a, dev: torch.device, sections: list[str], priors: dict, kind: str, base: dict,
                 repeats: int, n_ouro: int, n_huginn: int, scale: float) -> None:
    doc = run.doc

    def section(key: str, fn, need_s: float) -> None:
        """One section, guarded by its estimate; its result (or error) saved as it ends."""
        if key not in sections:
            return
        if not run.guard(key, need_s):
            doc[key] = {**(doc.get(key) or {}), "skipped": doc["skipped"][-1]}
            return
        run.begin(key, need_s)
        t0, status = time.perf_counter(), "ok"
        try:
            doc[key] = fn()
        except Exception as e:  # noqa: BLE001 -- a section's failure is recorded; the next one still runs
            doc[key] = {**(doc.get(key) or {}), "error": error_text(e)}
            status = "error"
        doc[key]["seconds"] = time.perf_counter() - t0
        doc["sections_done"].append(key)
        run.end(key, doc[key]["seconds"], status)
        run.say(f"{key} done in {doc[key]['seconds']:.1f} s:\n" + json.dumps(summary(doc), indent=1, default=str))

    def cap(key: str) -> float:
        return run.elapsed() + PARITY_CAP_S[kind]

    section("dispatch", lambda: dispatch_section(run, dev), priors["dispatch"])
    section("parity_float64", lambda: parity_float64(run, dev, priors["parity_float64"], cap("parity_float64")),
            priors["parity_float64"])
    section("parity_paged", lambda: parity_paged(run, dev, priors["parity_paged"], cap("parity_paged")),
            priors["parity_paged"])
    section("ouro_1p4b", lambda: shape_section(run, "ouro_1p4b", "ouro-1.4b", a.small, dev, RecordedExits(RECORDING),
                                               MODES, n_ouro, scale, repeats, base, priors["ouro_1p4b"]),
            priors["ouro_1p4b"])
    if "huginn_3p5b" not in sections:
        return
    ouro = doc.get("ouro_1p4b") or {}
    if "ouro_1p4b" in sections and not ouro.get("modes_run"):
        # (huginn_estimate has nothing to scale; whatever failed there would fail here too)
        why = ("every ouro_1p4b mode failed" + (f" ({len(ouro['modes_skipped'])} skipped)" if ouro.get("modes_skipped")
                                                 else "") if ouro.get("errors") else
               "no ouro_1p4b mode ran" + (f" ({ouro['skipped']['why']})" if "skipped" in ouro else ""))
        run.skip("huginn_3p5b", None, why)
        doc["huginn_3p5b"] = {"skipped": doc["skipped"][-1]}
        return
    est = huginn_estimate(ouro, a.small, n_huginn) if ouro.get("modes_run") else 2 * priors["ouro_1p4b"]
    doc["estimate"] = {"huginn_3p5b": est}
    mean = ASSUMED_MEAN_DEPTH["huginn-3.5b"]
    section("huginn_3p5b", lambda: shape_section(run, "huginn_3p5b", "huginn-3.5b", a.small, dev, DrawnExits(mean),
                                                 HUGINN_MODES, n_huginn, scale, min(repeats, MIN_REPEATS), base, est),
            est)


if __name__ == "__main__":
    sys.exit(main()["exit_code"])

"""The first run on a GPU (issue 38): one command, one JSON, within 8 minutes on one H100.

    python -m scripts.gpu_check --out gpu_check_out              # CUDA (default when torch sees one)
    python -m scripts.gpu_check --device cpu --small --out DIR   # the dry run that `make test` runs

Sections, each written to DIR/gpu_check.json as soon as it ends (and after every mode), so a run
cut short still leaves what it measured:

1. `parity_float64`: the tiny presets (both archs, two KV layouts) in float64, staggered arrivals
   and chunked prompts, against the sequential reference decoder on the same device: exact tokens
   and exit depths. Eager with async scheduling off and on, paged FlexAttention (eager), CB; on
   CUDA also CUDA graphs + the lookahead pipeline with async scheduling on and off, compiled paged
   FlexAttention inside CUDA graphs (ouro-tiny), and CB's fused graphs.
2. `ouro_1p4b`: Ouro-1.4B's shape, bf16, random weights; the exit depths of a recording
   (RECORDING, replayed as `--device emulated:h100 --replay-exits` replays it) on Alpaca lengths:
   CB vs CDB no-refill vs CDB refill (async scheduling on, and off) vs CDB at full depth. Per mode
   one engine (its CUDA graphs captured at start-up, count and seconds kept), one traced untimed
   pass (stage statistics, exact work counts), one instrumented pass (a CUDA event before and after
   every launch: the device's time between any two consecutive launches; the allocator's peak per
   launch kind beside what memory.py reserves for it), then the timed passes, untraced. Speedups
   over CB with 95% bootstrap intervals (infer/sim/stats.py).
3. `huginn_3p5b`: the same for Huginn-3.5B's shape (depths drawn around the simulator's assumed
   mean: no recording at r_max 16 exists), only while `--budget-s` allows.

After `--budget-s` seconds the optional parts (the Huginn shape, repeats past `MIN_REPEATS`) are
skipped, and the JSON's `skipped` says which and why. CUDA-only numbers are null on a CPU, with
the reason in `nulls`.
"""
from __future__ import annotations

import argparse
import gc
import json
import random
import sys
import time
import warnings
from pathlib import Path

import torch

from infer import EngineConfig, LLMEngine, SamplingParams
from infer.bench.offline import make_engine, pick_raw, run_engine, untraced_timing
from infer.engine.memory import activation_reserve, launch_peaks
from infer.engine.reference import reference_generate
from infer.engine.sequence import Stage
from infer.sim import bounds as B
from infer.sim import replay as RP
from infer.sim.emulated import ReplayedDepths
from infer.sim.report import model_meta
from infer.sim.runner import ASSUMED_MEAN_DEPTH, binomial_depths, depths_from_distribution
from infer.sim.stats import bounds_block, headline, mode_kwargs, ratio_interval, summarize
from infer.sim.workloads import describe, make_requests
from looplm import ExitPolicy, dummy_model, paper_config, tiny_model
from looplm.errors import ParamError

ROOT = Path(__file__).resolve().parents[1]
RECORDING = ROOT / "docs" / "figures" / "ouro-demo-alpaca8.exits.json"  # ouro-demo's exit scores, every step
MIN_REPEATS = 3  # timed passes every mode runs whatever the budget (an interval needs a few rounds)
THRESHOLD = 0.55  # the parity's exit threshold (tests/helpers.py's): exits really vary on the tiny models

# the modes of sections 2 and 3 (infer/sim/stats.py's mode dicts); refill twice, to measure async scheduling
# (in this order: a run cut short keeps the comparisons that matter most)
MODES = [{"name": "cb", "policy": "cb"},
         {"name": "cdb_refill_k1", "policy": "cdb", "refill": True, "min_coda_batch": 1, "async_scheduling": True},
         {"name": "cdb_refill_k1_no_async", "policy": "cdb", "refill": True, "min_coda_batch": 1,
          "async_scheduling": False},
         {"name": "cdb_norefill", "policy": "cdb", "refill": False},
         {"name": "cdb_full_depth", "policy": "cdb", "refill": True, "min_coda_batch": 1, "full_depth": True}]
# Huginn's, while the budget lasts: CB and CDB refill first (the comparison), full depth, the rest
HUGINN_MODES = [MODES[i] for i in (0, 1, 4, 3, 2)]

# --small: the paper shapes' structure (r_max, heads' layout, gate) at a CPU's size
SMALL = dict(hidden_size=128, intermediate_size=256, num_heads=4, num_kv_heads=4, head_dim=32, vocab_size=1024,
             max_position=512)
SMALL_SHAPES = {"ouro-1.4b": dict(SMALL, n_core=2), "huginn-3.5b": dict(SMALL, n_prelude=1, n_core=1, n_coda=1)}


# ---------------------------------------------------------------------------------- the run's record
class Run:
    """The JSON being built, its file, the clock and the budget. `save` rewrites the file (after
    every section and mode); `say` prints one progress line with the seconds since the start."""

    def __init__(self, out: Path, budget_s: float, doc: dict):
        self.path = out / "gpu_check.json"
        self.t0, self.budget_s, self.doc = time.perf_counter(), budget_s, doc
        out.mkdir(parents=True, exist_ok=True)

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def allows(self, seconds: float) -> bool:
        """Whether something estimated to take `seconds` ends within the budget."""
        return self.elapsed() + seconds <= self.budget_s

    def skip(self, what: str, need_s: float) -> None:
        self.doc["skipped"].append({"what": what, "at_s": round(self.elapsed(), 1), "estimated_s": round(need_s, 1),
                                    "why": f"over --budget-s {self.budget_s:g}"})
        self.say(f"skipped {what}: {self.elapsed():.0f} s + ~{need_s:.0f} s > budget {self.budget_s:g} s")

    def say(self, msg: str) -> None:
        print(f"[{self.elapsed():6.1f} s] {msg}", flush=True)

    def save(self) -> None:
        self.doc["wall_s"] = round(self.elapsed(), 2)
        self.path.write_text(json.dumps(self.doc, indent=1, default=str))


def error_text(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"[:400]


def free_device(dev: torch.device) -> None:
    """Give a dropped engine's memory back (engines have no reference cycles; gc for anything else)."""
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------- 1. parity
def parity_variants(cuda: bool) -> dict[str, dict]:
    """name -> EngineConfig keywords (+ "paged": switch to paged FlexAttention after construction,
    True: eager, "compiled": torch.compile'd, the way a GPU serves it; enable_paged captures the
    engine's CUDA graphs again through it)."""
    eager = dict(cuda_graphs=False, pipeline=False)
    v = {"eager": dict(eager, async_scheduling=False), "eager_async": dict(eager, async_scheduling=True),
         "paged": dict(eager, paged=True)}
    if cuda:
        v.update(graphs=dict(cuda_graphs=True, pipeline=True, async_scheduling=True),
                 graphs_no_async=dict(cuda_graphs=True, pipeline=True, async_scheduling=False),
                 paged_graphs=dict(cuda_graphs=True, pipeline=True, async_scheduling=True, paged="compiled"))
    v["cb_graphs" if cuda else "cb"] = dict(policy="cb", lookahead=False, cuda_graphs=cuda)
    return v


def drive_staggered(eng: LLMEngine, reqs: list[tuple[list[int], int]], seed: str) -> list[tuple[list, list]]:
    """Requests join a running engine 1-3 at a time at seeded steps (admissions mid-decode, mixed
    launches beside graph replays); returns each one's (tokens, exit depths)."""
    rng, pending, seqs, steps = random.Random(seed), list(reqs), [], 0
    while pending or eng.has_unfinished():
        steps += 1
        if steps > 20000:  # a hang would spend the GPU's one run
            raise RuntimeError("the engine made no progress in 20000 steps")
        if pending and (not eng.has_unfinished() or rng.random() < 0.4):
            for _ in range(rng.randint(1, 3)):
                if pending:
                    p, n = pending.pop(0)
                    seqs.append(eng.add_request(p, SamplingParams(max_tokens=n, ignore_eos=True)))
        eng.step()
    outs = [eng.output(s) for s in seqs]  # (what the host has read: with async scheduling, every token once idle)
    return [(o.token_ids, o.exit_depths) for o in outs]


def parity_float64(run: Run, dev: torch.device) -> dict:
    """Section 1: {"ok", "cases": {"arch/layout/variant": True | False | "error: ..." | "refused: ..."}}.
    A refusal (ParamError: a setting the engine does not offer on this device) is not a failure."""
    cases, cuda = {}, dev.type == "cuda"
    variants = parity_variants(cuda)
    # paged runs FlexAttention eagerly on purpose (exactness, not speed): its "use torch.compile" warning is noise
    warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
    with torch.inference_mode():
        for arch in ("ouro-tiny", "huginn-tiny"):
            m = tiny_model(arch, dtype=torch.float64, std=0.15, seed=3).to(dev)
            rng = random.Random(arch)
            # prompts up to 40 ids: longer than the 16-token launch budget, so depth-indexed layouts chunk them
            reqs = [([rng.randrange(1, 256) for _ in range(rng.randint(1, 40))], rng.randint(2, 10)) for _ in range(8)]
            for layout in ("last_exited", "shared"):
                refs = {}
                for full in (False, True):  # CDB's adaptive policy, CB's full depth
                    pol = ExitPolicy.from_config(m.cfg, threshold=THRESHOLD, lookahead=not full, full_depth=full)
                    refs[full] = [(g.token_ids, g.exit_depths) for g in
                                  (reference_generate(m, p, n, pol, kv_layout=layout) for p, n in reqs)]
                for name, kw in variants.items():
                    kw = dict(kw)
                    paged = kw.pop("paged", False)
                    if paged == "compiled" and arch != "ouro-tiny":
                        continue  # each engine compiles its own kernels: one arch keeps the section short
                    key = f"{arch}/{layout}/{name}"
                    try:
                        cfg = EngineConfig(**{"kv_layout": layout, "max_batch_size": 4, "exit_threshold": THRESHOLD,
                                              "lookahead": True, "kv_cache_tokens": 512, "max_prefill_tokens": 16,
                                              **kw})
                        eng = LLMEngine(m, cfg)
                        if paged:
                            eng.runner.enable_paged(compile=paged == "compiled")
                        got = drive_staggered(eng, reqs, seed=key)
                        cases[key] = got == refs[cfg.policy == "cb"]
                    except ParamError as e:
                        cases[key] = f"refused: {e}"[:400]
                    except Exception as e:  # noqa: BLE001 -- the check reports what failed and goes on
                        cases[key] = f"error: {error_text(e)}"
                    eng = None
                    run.say(f"parity {key}: {cases[key]}")
            del m
            free_device(dev)
    failed = [k for k, v in cases.items() if v is not True and not str(v).startswith("refused")]
    return {"ok": not failed, "failed": failed, "cases": cases,
            "what": "tokens and exit depths equal the reference decoder's (float64, same device)"}


# ---------------------------------------------------------------------------------- launch instrument
def launch_kind(work) -> str:
    """prefill (a separate prefill launch), mixed (prompt chunks ride along: eager), else the stage."""
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
           c.block_size)
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
           "graph_pool_bytes": None, "measured": None, "checks": None}
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
    # with graphs a decode launch allocates next to nothing: its memory is the graph pool's
    graphs = getattr(eng.runner, "graphs", None) is not None
    used = pool if graphs else max(decode) if decode else None
    out["checks"] = {
        "eager_within_reserve": max(eager) <= eager_reserve if eager else None,
        "eager_over_reserve": max(eager) / eager_reserve if eager and eager_reserve else None,
        "decode_within_reserve": used <= reserve["decode"] if used is not None else None,
        "decode_over_reserve": used / reserve["decode"] if used is not None and reserve["decode"] else None}
    return out


def guarded(fn, *args):
    """An extra measurement that must not cost the mode its timings: its error is its value."""
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001
        return {"error": error_text(e)}


# ---------------------------------------------------------------------------------- exit depths
class RecordedExits:
    """Ouro: the depths ouro-demo's recorded scores decide under each engine's exit policy
    (replay.replay_depths), given to the workload's requests as the emulated device's replay gives
    them (emulated.ReplayedDepths, by index): request i gets record i mod the file's count, and a
    token past its record's length repeats the record's decode depths."""

    def __init__(self, path: Path, workload: str = "alpaca"):
        self.doc, self.workload, self.path = RP.load(path), workload, path

    def settings(self) -> dict:
        return RP.engine_settings(self.doc, {})  # the recorded criterion, threshold and r_min

    def depths(self, policy: ExitPolicy, reqs) -> list[list[int]]:
        rd = ReplayedDepths(RP.replay_depths(self.doc, self.workload, policy), by_index=True)
        return [[rd(str(i), k) for k in range(1, r.output_len + 1)] for i, r in enumerate(reqs)]

    def describe(self) -> dict:
        d = self.doc
        return {"source": str(self.path.relative_to(ROOT) if self.path.is_relative_to(ROOT) else self.path),
                "recorded_on": d["model"], "criterion": d["criterion"], "threshold": d["threshold"],
                "r_min": d["replay_r_min"], "records": len(RP.requests_of(d, self.workload)),
                "how": "request i replays record i mod records (emulated.ReplayedDepths), cycling its decode depths"}


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


# ---------------------------------------------------------------------------------- 2-3. a model shape
def shape_model(name: str, small: bool, dev: torch.device):
    """A paper shape with random weights (bf16 on CUDA; --small: fp32 at SMALL_SHAPES' size)."""
    cfg = paper_config(name, **(SMALL_SHAPES[name] if small else {}))
    return dummy_model(cfg, torch.float32 if small or dev.type != "cuda" else torch.bfloat16, dev)


def run_mode(run: Run, model, mode: dict, base: dict, exits, reqs_for, repeats: int, reserves: dict) -> tuple:
    """One mode: its engine (graphs captured at construction), a traced untimed pass, an
    instrumented pass, then up to `repeats` timed untraced passes (past MIN_REPEATS only while
    the budget allows). Returns (raw record for summarize, extras for the JSON)."""
    reserve = guarded(reserve_for, model, EngineConfig(**{**base, **mode_kwargs(mode)}), reserves)
    t0 = time.perf_counter()
    eng = make_engine(model, None, mode, base)
    build_s = time.perf_counter() - t0
    reqs = reqs_for(eng)
    trackers = trackers_for(exits, eng.policy, reqs)
    traced = run_engine(eng, mode, reqs, keep_trace=False, trackers=trackers)
    probe = LaunchProbe(model.device)
    eng.on_launch.append(probe)
    instrumented = run_engine(eng, mode, reqs, keep_trace=False, trackers=trackers, traced=False)
    eng.on_launch.remove(probe)
    extras = {"build_seconds": build_s, "graph_capture": eng.graph_capture, "instrumented_seconds":
              instrumented["seconds"], "launches": probe.host_summary(), "idle": guarded(probe.idle),
              "memory": guarded(memory_report, eng, probe, reserve) if "error" not in reserve else reserve}
    reps = []
    for k in range(repeats):
        need = reps[-1]["seconds"] if reps else instrumented["seconds"]
        if k >= MIN_REPEATS and not run.allows(need):
            run.skip(f"{mode['name']} timed passes {k + 1}-{repeats}", need * (repeats - k))
            break
        reps.append(untraced_timing(traced, run_engine(eng, mode, reqs, keep_trace=False, trackers=trackers,
                                                       traced=False)))
    return pick_raw(reps, "median"), extras


def idle_fraction(result: dict) -> float | None:
    return (result.get("idle") or {}).get("idle_fraction")


def fmt_interval(iv: dict | None) -> str | None:
    return None if not iv else f"{iv['median']:.3f} [{iv['lo']:.3f}, {iv['hi']:.3f}] {iv['verdict']}"


def shape_section(run: Run, key: str, name: str, small: bool, dev: torch.device, exits, modes: list[dict],
                  num_requests: int, scale: float, repeats: int, base: dict, optional: bool) -> dict:
    """Sections 2 and 3: every mode of `modes` on one model shape (`optional`: each mode only while
    the budget allows, estimated from the previous mode's seconds, or `run.doc["estimate"]`)."""
    t0 = time.perf_counter()
    model = shape_model(name, small, dev)
    cfg = model.cfg
    base = {**base, **exits.settings()}
    block = run.doc[key] = {"model": {**model_meta(model, name, None), "dtype": str(model.dtype).removeprefix("torch."),
                                      "weights": "random (load_format dummy)", "small": small},
                            "exits": exits.describe(), "engine_settings": base, "modes_run": [], "errors": {}}
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
    for mode in modes:
        if optional:
            need = 1.2 * longest if longest else run.doc.get("estimate", {}).get(key, 0.0)
            if not run.allows(need):
                run.skip(f"{key} {mode['name']}", need)
                continue
        m0, failed = time.perf_counter(), None
        try:
            raws[mode["name"]], extras[mode["name"]] = run_mode(run, model, mode, base, exits, reqs_for, repeats,
                                                                reserves)
        except Exception as e:  # noqa: BLE001 -- one mode's failure is reported, the others still run
            failed = {"error": error_text(e), "refused": isinstance(e, ParamError)}
        free_device(dev)  # (out of the except clause: its traceback would keep the engine alive)
        if failed:
            block["errors"][mode["name"]] = failed
            run.say(f"{key} {mode['name']}: {failed['error']}")
            continue
        extras[mode["name"]]["mode_seconds"] = took = time.perf_counter() - m0
        longest = max(longest, took)
        block["modes_run"].append(mode["name"])
        r, x = raws[mode["name"]], extras[mode["name"]]
        gc_, idle = x["graph_capture"], idle_fraction(x)
        run.say(f"{key} {mode['name']}: {len(r['seconds_all'])} timed passes, median {r['seconds']:.3f} s "
                f"({r['output_tokens'] / r['seconds']:.0f} tok/s), mean depth {r['mean_exit_depth']:.2f}"
                + (f", idle {idle:.1%}" if idle is not None else "")
                + (f", {gc_['captured']} graphs in {gc_['seconds']:.1f} s" if gc_ else "")
                + f"; mode took {took:.1f} s")
        summarize_into(block, raws, extras, cfg, made[0], base, repeats)
        run.save()
    block["seconds"] = time.perf_counter() - t0
    del model
    free_device(dev)
    return block


def summarize_into(block: dict, raws: dict, extras: dict, cfg, reqs, base: dict, repeats: int) -> None:
    """The section's results so far: infer/sim/stats.summarize per mode (speedup over CB with its
    interval, bounds, work counts) with this check's extras, and the headline ratios."""
    settings = {**base, "repeats": repeats, "stat": "median", "workload": "alpaca"}
    results = {r["mode"]: {**r, **extras[r["mode"]]} for r in summarize(raws, cfg, reqs, settings)}
    block["results"] = results
    block["speedup_vs_cb"] = {n: r.get("speedup_interval") for n, r in results.items() if n != "cb"}
    if "cdb_refill_k1" in raws and "cdb_refill_k1_no_async" in raws:
        # no-async time / async time, round by round: > 1 means async scheduling is faster
        block["async_speedup"] = ratio_interval(raws["cdb_refill_k1_no_async"]["seconds_all"],
                                                raws["cdb_refill_k1"]["seconds_all"])
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
    """What the run printed last: parity, and per shape the speedups, idle fractions, captures and
    the memory checks (the full record is the JSON file)."""
    out = {"parity_float64_ok": (doc.get("parity_float64") or {}).get("ok")}
    for key in ("ouro_1p4b", "huginn_3p5b"):
        b = doc.get(key)
        if not b or "results" not in b:
            out[key] = b and (b.get("skipped") or b.get("error"))
            continue
        res = b["results"]
        out[key] = {"tok_per_s": {n: round(r["output_tokens_per_s"], 1) for n, r in res.items()},
                    "speedup_vs_cb": {n: fmt_interval(iv) for n, iv in b["speedup_vs_cb"].items()},
                    "async_speedup": fmt_interval(b.get("async_speedup")),
                    "idle_fraction": {n: idle_fraction(r) for n, r in res.items()},
                    "graphs": {n: r["graph_capture"] for n, r in res.items()},
                    "memory_checks": {n: r["memory"].get("checks", r["memory"].get("error")) for n, r in res.items()},
                    "errors": b["errors"]}
    out["skipped"] = [s["what"] for s in doc["skipped"]]
    out["wall_s"] = doc.get("wall_s")
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m scripts.gpu_check", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("gpu_check_out"), help="folder of gpu_check.json")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--small", action="store_true", help="tiny shapes, few requests (the CPU dry run)")
    ap.add_argument("--budget-s", type=float, default=420.0,
                    help="seconds after which the optional parts (Huginn, repeats past %d) are skipped" % MIN_REPEATS)
    ap.add_argument("--repeats", type=int, default=None, help="timed passes per mode (default 5; Huginn 3)")
    ap.add_argument("--num-requests", type=int, default=None,
                    help="Ouro's Alpaca requests (default 256; --small 12); Huginn runs a quarter of them")
    a = ap.parse_args(argv)
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
    base = dict(max_batch_size=8, max_prefill_tokens=256) if a.small else {}  # else the engine's CUDA defaults
    doc = {"check": "scripts/gpu_check.py", "command": "python -m scripts.gpu_check " + " ".join(
        argv if argv is not None else sys.argv[1:]), "device": torch.cuda.get_device_name(dev) if cuda else "cpu",
        "device_type": dev.type, "torch": torch.__version__, "cuda_version": torch.version.cuda, "small": a.small,
        "budget_s": a.budget_s, "min_repeats": MIN_REPEATS, "repeats": repeats, "complete": False,
        "sections_done": [], "skipped": [],
        "nulls": {} if cuda else {
            "idle": "CUDA events need a CUDA device", "graph_capture": "CUDA graphs need a CUDA device",
            "memory.graph_pool_bytes / measured / checks": "the allocator's statistics need a CUDA device"}}
    run = Run(a.out, a.budget_s, doc)
    run.say(f"gpu_check on {doc['device']} (torch {torch.__version__}), budget {a.budget_s:g} s -> {run.path}")

    def section(key: str, fn) -> None:
        t0 = time.perf_counter()
        try:
            doc[key] = fn()
        except Exception as e:  # noqa: BLE001 -- a section's failure is recorded; the next one still runs
            doc[key] = {**(doc.get(key) or {}), "error": error_text(e)}
        doc[key]["seconds"] = time.perf_counter() - t0
        doc["sections_done"].append(key)
        run.save()
        run.say(f"{key} done in {doc[key]['seconds']:.1f} s:\n" + json.dumps(summary(doc), indent=1, default=str))

    section("parity_float64", lambda: parity_float64(run, dev))
    section("ouro_1p4b", lambda: shape_section(run, "ouro_1p4b", "ouro-1.4b", a.small, dev, RecordedExits(RECORDING),
                                               MODES, n_ouro, scale, repeats, base, optional=False))
    doc["estimate"] = {"huginn_3p5b": huginn_estimate(doc["ouro_1p4b"], a.small, n_huginn)}
    if run.allows(doc["estimate"]["huginn_3p5b"]):
        mean = ASSUMED_MEAN_DEPTH["huginn-3.5b"]
        section("huginn_3p5b", lambda: shape_section(
            run, "huginn_3p5b", "huginn-3.5b", a.small, dev, DrawnExits(mean), HUGINN_MODES, n_huginn, scale,
            min(repeats, MIN_REPEATS), base, optional=True))
    else:
        run.skip("huginn_3p5b", doc["estimate"]["huginn_3p5b"])
        doc["huginn_3p5b"] = {"skipped": doc["skipped"][-1]}
    doc["complete"] = True
    run.save()
    print(json.dumps(summary(doc), indent=1, default=str), flush=True)
    run.say(f"wrote {run.path}")
    return doc


if __name__ == "__main__":
    main()

"""The emulated device: the real engine and scheduler on a device that is only a clock.

`EmulatedRunner` is the simulator's `SimRunner` (runner.py) on the wall clock: each launch is priced
by the same cost model (the GPU roofline of `RooflineCost`, with the measured host table), and
the runner *waits* in real time (a sleep, no CPU burnt) for that prediction minus the host time
this step already spent. The host's share of the prediction (`RooflineCost.host_seconds`) is
paid by the real host where it is slower (the wait never drops below the device's share), so a
step takes max(predicted, real host + device share): the server, the HTTP side and the client run
for real at the token rates the emulated GPU would produce. Exit decisions come from a binomial
depth distribution around a mean (as infer.sim) or a recorded-exits file (replay.py); the tokens
are arbitrary ids (one id that is never EOS, so every request runs to its max_tokens); no weights
exist (the engine's model is the simulator's `SimModel`: a config, no parameters).

    python -m infer.serve --model ouro-1.4b --device emulated:h100 --port 8000
    python -m infer.bench --model huginn-3.5b --device emulated:h100 --workloads alpaca --num-requests 32
    python -m infer.bench.online --model ouro-1.4b --device emulated:h100 --rates 2,4,8

Settings: the KV pool is what the emulated GPU holds beside the bf16 weights (`h100_kv_tokens`);
the engine runs its CPU path (no lookahead pipeline, no on-device token re-entry). Lookahead exits
start at depth 2, so r_min defaults to 2 with --lookahead, else 1. Dispatch (issue 62,
dispatch.py) is priced as on the GPU: each launch is charged the host's cost of issuing it, as in
the simulator (SimRunner), with decode-only launches replaying CUDA graphs unless `cuda_graphs` is
False (the CUDA default; the engine itself, on the CPU, runs none: `emulated_settings` takes the
setting out of its config).
"""
from __future__ import annotations

import random
import time
from collections import OrderedDict
from functools import partial
from pathlib import Path

import torch

from infer.engine.config import EngineConfig, engine_kwargs_from_args
from infer.engine.llm_engine import LLMEngine
from infer.engine.runner import Emitted
from infer.engine.scheduler import Work
from infer.engine.sequence import Sequence, Stage
from looplm.io import read_config
from looplm import PAPER_MODELS, PRESETS, LoopConfig, load_tokenizer, paper_config, preset_config
from looplm.errors import ParamError
from looplm.layer_split import split_config
from looplm.policy import ExitPolicy

from . import replay as RP
from .cost import DEVICES, HOST_JSON, HostCost, RooflineCost, h100_kv_tokens
from .dispatch import Dispatch
from .runner import ASSUMED_MEAN_DEPTH, SIM_EXITS, SimModel, SimRunner, binomial_depths
from .workloads import FIRST_ID

PREFIX = "emulated:"


def is_emulated(device: str | None) -> bool:
    return isinstance(device, str) and device.startswith(PREFIX)


def device_spec(device: str) -> tuple[str, dict]:
    """("h100", its numbers) of "emulated:h100"; ParamError naming the choices otherwise."""
    name = device[len(PREFIX):] if is_emulated(device) else None
    if name not in DEVICES:
        raise ParamError("device", f"unknown emulated device {device!r}; choose from "
                                   f"{[PREFIX + k for k in DEVICES]}")
    return name, DEVICES[name]


# ---------------------------------------------------------------------------------- text
class TrivialTokenizer:
    """For a model without a tokenizer (a preset): text in as its UTF-8 bytes, ids out as " <id>".
    Enough for the OpenAI routes (chat, text prompts, stop strings) to run; the text means nothing."""
    eos_token = bos_token = pad_token = eos_token_id = chat_template = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(f" {int(t)}" for t in ids)

    def get_vocab(self) -> dict[str, int]:
        return {}


# ---------------------------------------------------------------------------------- exit depths
class DrawnDepths:
    """Depths drawn per request from a distribution, lazily, by request id: for request id "i" the
    same depths as sim.depths_from_distribution gives request i (same seeded generator)."""

    def __init__(self, probs: dict[int, float], seed: int = 0, keep: int = 65536):
        self.ds, self.ws = zip(*sorted(probs.items()))
        self.seed, self.keep = seed, keep
        self._rows: OrderedDict[str, tuple] = OrderedDict()  # request id -> (generator, depths so far)

    def __call__(self, request_id: str, i: int) -> int:
        row = self._rows.get(request_id)
        if row is None:
            row = self._rows[request_id] = (random.Random(f"depths:{self.seed}:{request_id}"), [max(self.ds)])
            if len(self._rows) > self.keep:  # finished requests are never asked again
                self._rows.popitem(last=False)
        rng, depths = row
        while len(depths) <= i:
            depths += rng.choices(self.ds, self.ws)
        return depths[i]


class ReplayedDepths:
    """Depths of a recorded-exits file (replay.replay_depths rows: index 0 the prefill's). Request
    "i" gets record i when `by_index` (the benches number their requests); otherwise records go to
    requests in the order they first loop, cycling through the file. A token past its record's
    length repeats the record's decode depths."""

    def __init__(self, rows: list[list[int]], by_index: bool = False, keep: int = 65536):
        self.rows, self.by_index, self.keep = rows, by_index, keep
        self._given: OrderedDict[str, int] = OrderedDict()
        self._next = 0

    def record_of(self, request_id: str) -> int:
        if self.by_index:
            return int(request_id) % len(self.rows)
        k = self._given.get(request_id)
        if k is None:
            k = self._given[request_id] = self._next % len(self.rows)
            self._next += 1
            if len(self._given) > self.keep:
                self._given.popitem(last=False)
        return k

    def __call__(self, request_id: str, i: int) -> int:
        row = self.rows[self.record_of(request_id)]
        return row[i] if i < len(row) else row[1 + (i - 1) % (len(row) - 1)] if len(row) > 1 else row[0]


# ---------------------------------------------------------------------------------- the runner
class EmulatedRunner(SimRunner):
    """A `Runner` that waits, in real time, for what the cost model predicts (module docstring).
    `depths(request_id, token index) -> exit depth`; `token_id`: the id every emitting row gives."""

    def __init__(self, model, kv_layout, blocks, criterion, pad_pow2=True, max_batch_size=64, *, cost, depths,
                 token_id: int = FIRST_ID, info: dict | None = None, slowdown: float = 1.0, **kw):
        super().__init__(model, kv_layout, blocks, criterion, pad_pow2, max_batch_size, cost=cost, depths=[], **kw)
        self.source, self.token_id = depths, token_id
        # the wall clock runs `slowdown` times slower than the emulated GPU's (the virtual clock, `clock`,
        # does not): a small host then keeps up with a device whose token rate it could not serve
        self.slowdown = slowdown
        self.device_info = {"emulated": True, **(info or {})}
        self.trace = _Last()  # the server runs for hours: keep no history (the engine's trace has it)
        self.waited = 0.0  # seconds slept
        self._returned: float | None = None  # when the previous launch returned
        self._late = 0.0  # how much the previous sleep overshot (taken off the next wait)
        self._row = torch.full((1, token_id + 1), -30.0)
        self._row[0, token_id] = 0.0
        self.spec_token = token_id

    def depths_at(self, s: Sequence, i: int) -> int:
        return self.source(s.request_id, i)

    def _rows(self, n: int) -> torch.Tensor:  # (speculative stages: every position gives the emulated token)
        return self._row.expand(n, -1)

    def run(self, work: Work):
        now = time.perf_counter()
        host = now - self._returned if self._returned is not None else 0.0
        before = self.clock
        out = super().run(work)
        predicted = (self.clock - before) * self.slowdown
        last = self.trace[-1]  # (a speculative stage: its last launch's host share)
        share = self.cost.host_seconds(Stage(last["stage"]), last["padded"]) * self.slowdown
        deadline = now + predicted - min(host, share) - self._late
        left = deadline - time.perf_counter()
        if left > 0:
            time.sleep(left)
            self.waited += left
            end = time.perf_counter()
            self._late = max(0.0, end - deadline)
        else:  # an overshoot this wait could not absorb carries on; a host overrun does not (the device idled)
            end = time.perf_counter()
            self._late = min(self._late, -left)
        self._returned = end
        if not isinstance(out, Emitted):
            return out
        rows = len(work.emitting)
        firsts = work.finals  # the prompts completed here (a separate prefill's: every one)
        prompt = {s.seq_id: self._wide(len(s.prompt_ids)) for s in firsts if s.params.prompt_logprobs is not None}
        # teacher forcing reads the forced token's log-prob: then every id needs a logit
        wide = any(s.forced is not None for s in work.emitting)
        return Emitted(self._wide(rows) if wide else self._row.expand(rows, -1), prompt or None)

    def _wide(self, rows: int) -> torch.Tensor:
        """Logits over the whole vocabulary, the emulated token far ahead (prompt log-probs, forcing)."""
        x = torch.zeros(rows, self.cfg.vocab_size)
        x[:, self.token_id] = 30.0
        return x

    def swap(self, ops) -> None:
        """A preemption's copies (SimRunner prices them at PCIe bandwidth), waited for as well."""
        before = self.clock
        super().swap(ops)
        if self.clock > before:
            time.sleep((self.clock - before) * self.slowdown)
            self.waited += (self.clock - before) * self.slowdown

    def describe(self) -> dict:
        """What the emulated device did so far: predicted (the GPU's, not slowed) and slept seconds."""
        return {**self.device_info, "predicted_seconds": self.clock, "slept_seconds": self.waited,
                "dispatched": self.dispatch_stats()}


class _Last(list):
    """A trace that keeps only its last row."""

    def append(self, row) -> None:
        self[:] = [row]


# ---------------------------------------------------------------------------------- the engine
def emulated_config(model: str | Path, layer_split: str | None = None):
    """(LoopConfig, tokenizer) of what to emulate: a paper shape or a tiny preset (the trivial
    tokenizer), or a folder's config.json (its tokenizer, else the trivial one; no weights read)."""
    name = str(model)
    if name in PAPER_MODELS:
        cfg, tok = paper_config(name), TrivialTokenizer()
    elif name in PRESETS:
        cfg, tok = preset_config(name), TrivialTokenizer()
    else:
        folder = Path(model)
        if not (folder / "config.json").exists():
            raise ParamError("model", f"{model}: neither a paper model {sorted(PAPER_MODELS)}, a preset "
                                      f"{sorted(PRESETS)} nor a folder with a config.json (the emulated device "
                                      "needs only the config)")
        cfg = read_config(folder)
        tok = load_tokenizer(folder) or TrivialTokenizer()
    return (split_config(cfg, layer_split) if layer_split else cfg), tok


def emulated_settings(cfg: LoopConfig, engine: dict, memory: float) -> dict:
    """EngineConfig fields for an emulated engine: the simulator's exit criterion (the runner's
    scores decide the depths), r_min 1 (2 with lookahead) unless given, and the KV pool of a GPU
    with `memory` bytes. An exit criterion or threshold on the command line is refused by name."""
    for k in ("exit_criterion", "exit_threshold"):
        if engine.get(k) is not None:
            raise ParamError(k, f"the emulated device decides exits from --mean-depth or --replay-exits; drop "
                                f"--{k.replace('_', '-')}")
    kw = {k: v for k, v in {**engine, **SIM_EXITS}.items() if k != "cuda_graphs"}  # (the runner's: emulated_engine)
    if kw.get("r_min") is None:
        kw["r_min"] = 2 if kw.get("lookahead") else 1
    layout = EngineConfig(**kw).resolve(cfg).kv_layout
    if kw.get("kv_cache_tokens") is None and kw.get("kv_cache_bytes") is None:
        kw["kv_cache_tokens"] = h100_kv_tokens(cfg, layout, memory=memory)
    return kw


def depth_source(cfg: LoopConfig, *, mean_depth: float | None = None, replay_exits: Path | None = None,
                 workload: str | None = None, lookahead: bool = False, seed: int = 0, by_index: bool = False,
                 name: str = "") -> tuple[object, dict]:
    """(depths callable, its description) from a mean depth (binomial, default the simulator's
    assumption for a paper model, else the middle of [1, r_max]) or a recorded-exits file."""
    if replay_exits is not None:
        if mean_depth is not None:
            raise ParamError("mean_depth", "--mean-depth and --replay-exits: the depths come from one of them")
        doc = RP.load(replay_exits)
        w = workload or next(iter(doc["workloads"]))
        if w == RP.POOLED and w not in doc["workloads"]:  # (infer.bench --pool)
            doc = RP.pooled(doc)
        rs = RP.engine_settings(doc, {})
        pol = ExitPolicy(rs["exit_criterion"], rs["exit_threshold"], rs["r_min"], cfg.r_max, lookahead)
        rows = RP.replay_depths(doc, w, pol)
        return ReplayedDepths(rows, by_index), {"replay_exits": str(replay_exits), "workload": w,
                                                "recorded_model": doc["model"], "criterion": pol.criterion,
                                                "threshold": pol.threshold, "r_min": pol.r_min}
    mean = mean_depth if mean_depth is not None else ASSUMED_MEAN_DEPTH.get(name, (1 + cfg.r_max) / 2)
    try:
        probs = binomial_depths(cfg.r_max, mean)
    except ValueError as e:
        raise ParamError("mean_depth", str(e)) from None
    return DrawnDepths(probs, seed), {"distribution": "binomial", "mean_depth": mean}


def emulated_engine(model: str | Path, device: str, engine: dict | None = None, *, mean_depth: float | None = None,
                    replay_exits: Path | None = None, replay_workload: str | None = None, seed: int = 0,
                    layer_split: str | None = None, host_json: Path | None = HOST_JSON, attention: str | None = None,
                    by_index: bool = False, trace: bool = False, slowdown: float | None = None,
                    dispatch: Dispatch | bool = True) -> LLMEngine:
    """An LLMEngine on the emulated `device` ("emulated:h100") for `model` (module docstring);
    `engine`: EngineConfig fields (`cuda_graphs` False: every launch's dispatch eager); `attention`:
    what decode attention reads (infer.sim's --attention; None: the engine's attention_backend as it
    resolves on CUDA, paged unless the engine fields say sdpa); `slowdown`:
    the wall clock runs that many times slower than the device's; `dispatch`: what issuing a launch
    costs the host (True: dispatch.py's defaults, False: not charged). Its runner's `device_info`
    says what is emulated."""
    name, spec = device_spec(device)
    slowdown = 1.0 if slowdown is None else float(slowdown)
    if not slowdown > 0:
        raise ParamError("emulated_slowdown", f"must be > 0 (1: the device's own speed), got {slowdown:g}")
    cfg, tok = emulated_config(model, layer_split)
    kw = emulated_settings(cfg, dict(engine or {}), spec["memory"])
    if trace:
        kw["trace"] = True
    ecfg = EngineConfig(**kw)
    layout = ecfg.resolve(cfg).kv_layout
    attention = attention or ecfg.resolve(cfg, "cuda").attention_backend  # the device it stands for decides
    host = HostCost.from_json(host_json) if host_json is not None and Path(host_json).exists() else None
    dispatch = Dispatch() if dispatch is True else dispatch or None
    graphs = (engine or {}).get("cuda_graphs") is not False
    cost = RooflineCost(cfg, bandwidth=spec["bandwidth"], peak_flops=spec["peak_flops"], kv_layout=layout,
                        host=host, attention=attention, dispatch=dispatch)
    depths, exits = depth_source(cfg, mean_depth=mean_depth, replay_exits=replay_exits, workload=replay_workload,
                                 lookahead=bool(ecfg.lookahead), seed=seed, by_index=by_index, name=str(model))
    eos = {cfg.eos_token_id, *cfg.stop_token_ids, getattr(tok, "eos_token_id", None)}
    token = next(t for t in range(FIRST_ID, cfg.vocab_size) if t not in eos)
    info = {"device": PREFIX + name, "model": str(model), "cost_model": "roofline", **spec,
            "host_json": str(host_json) if host else None, "attention": attention, "exits": exits,
            "token_id": token, "slowdown": slowdown, "dispatch": dispatch.describe() if dispatch else None,
            "cuda_graphs": graphs}
    runner = partial(EmulatedRunner, cost=cost, depths=depths, token_id=token, info=info, slowdown=slowdown,
                     graphs=graphs)
    eng = LLMEngine(SimModel(cfg), ecfg, tok, runner_cls=runner)
    if eng.runner.ops is not None:  # the launches' op counts now, not in the first requests' time (dispatch.py)
        eng.runner.ops.prime(eng.config, eng.runner.op_criterion)
    return eng


def engine_from_args(a) -> LLMEngine:
    """`python -m infer.serve --device emulated:...`: the engine of its parsed arguments."""
    engine = engine_kwargs_from_args(a)
    return emulated_engine(a.model, a.device, engine, mean_depth=a.mean_depth, replay_exits=a.replay_exits,
                           replay_workload=a.replay_workload, seed=engine.get("seed") or 0, layer_split=a.layer_split,
                           attention=a.emulated_attention, slowdown=a.emulated_slowdown)


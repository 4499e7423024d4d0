"""Simulator: the real scheduler and the real engine (infer/engine.py) driven by a cost model
instead of the model. `SimRunner` has ModelRunner's methods; each call advances a virtual clock by
the cost model's time for that stage and batch, and returns tiny tensors: core steps return exit
scores that make every token leave at a depth drawn from a recorded trace or a distribution (the
engine runs the "learned" criterion at threshold 0.5, the runner answers exit probability 1 / 0).

Two cost models: `FittedCost` (the latency model of infer/latency.py fitted on this machine's
engine trace) and `RooflineCost` (per stage max(bytes / bandwidth, FLOPs / peak) + a launch
overhead, for a GPU such as the H100, on the real Ouro-1.4B / Huginn-3.5B shapes).

    python -m infer.sim --model ouro-1.4b --workloads alpaca sharegpt arxiv --ks 1 4 16 --out outputs/sim

The output is the benchmark's JSON (infer/bench.py), with virtual seconds.
"""
from __future__ import annotations

import argparse
import json
import random
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch

from infer.engine.config import EngineConfig, add_engine_args, engine_kwargs_from_args
from infer.engine.llm import load_model
from infer.engine.llm_engine import LLMEngine
from infer.engine.memory import state_slot_bytes
from infer.engine.runner import Emitted, next_pow2
from infer.engine.sampling import SamplingParams
from infer.engine.scheduler import SwapOp, Work
from infer.engine.sequence import Sequence, Stage
from infer.engine.speculative import SpecOut
from kv_layouts import DEFAULT_LAYOUT, layout_class
from looplm.config import LoopConfig
from looplm.layer_split import split_config, split_of
from looplm.policy import ExitPolicy
from looplm.presets import PAPER_MODELS, paper_config

from . import bounds as B
from . import replay as RP
from .latency import StageFit, fit_trace
from .offline import bounds_block, headline, modes_for, prefix_cache, raw_from, summarize
from .report import format_table, plot
from .work import work_counts
from .workloads import WORKLOADS, Request, describe, make_requests

# The host benchmark's JSON (python -m infer.bench_host --out ...): the default per-stage overhead.
HOST_JSON = Path(__file__).resolve().parents[2] / "docs" / "figures" / "bench_host.json"
# Assumed mean exit depths for the GPU predictions (the seed gives none; see docs/results.md).
ASSUMED_MEAN_DEPTH = {"ouro-1.4b": 2.5, "huginn-3.5b": 9.0}


# ---------------------------------------------------------------------------------- cost models
@dataclass
class Call:
    stage: Stage
    batch: int
    padded: int
    tokens: int
    context: int  # tokens read (decode: sum of the items' contexts; prefill: prompt tokens)
    context_sq: int = 0  # prefill: sum of squared prompt lengths (causal attention)
    r_max: int = 0  # fused: loop steps
    filled: int = 0  # coda: depth slots filled on exit (sum of the layout's fill_slots over the tokens)
    rows_sdpa: int = 0  # decode: padded batch x bucketed longest context (the SDPA path's gather)
    rows_paged: int = 0  # decode: whole blocks of each item's context (a paged kernel)
    # mixed launches (prompt chunks riding along): their tokens, the context rows they read (once per
    # chunk), their causal (query, key) pairs, and the chunks that end their prompt (head rows)
    prompt_tokens: int = 0
    prompt_rows: int = 0
    prompt_pairs: int = 0
    finals: int = 0

    def without_prompts(self) -> Call:
        return Call(self.stage, self.batch, self.padded, self.tokens, self.context, self.context_sq, self.r_max,
                    self.filled, self.rows_sdpa, self.rows_paged)


class HostCost:
    """Measured host time per stage call (`python -m infer.bench_host` JSON: median microseconds at
    a few batch sizes), linear in the batch size between the measured points, flat outside them."""

    def __init__(self, table: dict[str, dict[str, dict]]):
        stages = {k for v in table.values() for k in v}
        self.points = {k: sorted((int(b), v[k]["median"] * 1e-6) for b, v in table.items() if k in v) for k in stages}

    @classmethod
    def from_json(cls, path: Path) -> HostCost:
        return cls(json.loads(Path(path).read_text())["host_us"])

    def __call__(self, stage: Stage, batch: int) -> float:
        pts = self.points[stage.value]
        if batch <= pts[0][0]:
            return pts[0][1]
        for (b0, t0), (b1, t1) in zip(pts, pts[1:]):
            if batch <= b1:
                return t0 + (t1 - t0) * (batch - b0) / (b1 - b0)
        return pts[-1][1]


class FittedCost:
    """t = delta + gamma N_b + alpha N_c per stage (infer/latency.py), plus the host time between
    steps that the engine trace does not see (`per_step`). A stage without a fit (CB's fused
    iteration when only CDB was traced) is prelude + r_max core + coda."""

    def __init__(self, fits: dict[str, StageFit], per_step: float = 0.0):
        self.fits, self.per_step = fits, per_step

    def _stage(self, stage: Stage, c: Call) -> float:
        f = self.fits[stage.value]
        return f.predict(c.padded if f.batch_key == "padded" else c.batch, c.context)

    def __call__(self, c: Call) -> float:
        if c.stage is Stage.FUSED and "fused" not in self.fits:
            return (self._stage(Stage.PRELUDE, c) + c.r_max * self._stage(Stage.CORE, c) +
                    self._stage(Stage.CODA, c) + self.per_step)
        return self._stage(c.stage, c) + self.per_step


@dataclass
class RooflineCost:
    """Each stage call costs max(bytes / bandwidth, FLOPs / peak) + an overhead: `host` (the
    measured host time per stage and batch, HostCost) when given, else the constant `overhead`
    (graph launch and scheduling; CB's fused iteration is one launch). Bytes: the stage's weights
    once per call (core weights once per loop step), the KV it reads and writes. The KV read is
    what the engine's decode attention reads (`attention`): "context" the ideal (each item's real
    context), "paged" whole blocks of each context (a paged kernel over the block tables), "sdpa"
    the gather to the batch's longest (bucketed) context, written once and read twice (gather,
    then attention over the copy). FLOPs: infer/bounds.py counts x the padded batch. Defaults:
    H100 SXM, bf16."""
    cfg: LoopConfig
    bandwidth: float = 3.35e12  # bytes/s
    peak_flops: float = 989e12  # dense bf16
    overhead: float = 20e-6  # seconds per stage call
    dtype_bytes: int = 2
    kv_layout: str = DEFAULT_LAYOUT
    host: HostCost | None = None
    attention: str = "context"
    params: dict = field(init=False)

    def __post_init__(self):
        self.params = B.stage_params(self.cfg)

    def _roof(self, nbytes: float, flops: float) -> float:
        return max(nbytes / self.bandwidth, flops / self.peak_flops)

    def _decode(self, stage: Stage, c: Call) -> float:
        """One stage's launch: its weights once for every item (decode items and prompt tokens), the
        KV each reads and writes; prompt chunks attend causally over their own context."""
        cfg, db = self.cfg, self.dtype_bytes
        layers = {Stage.PRELUDE: cfg.n_prelude, Stage.CORE: cfg.n_core, Stage.CODA: cfg.n_coda}[stage]
        kv = B.kv_bytes_per_token(cfg, layers, db)
        items = c.padded + c.prompt_tokens
        rows = {"context": c.context, "paged": c.rows_paged or c.context, "sdpa": 3 * c.rows_sdpa or c.context}
        nbytes = self.params[stage.value] * db + (rows[self.attention] + c.prompt_rows) * kv + items * kv
        if stage is Stage.PRELUDE:
            nbytes += items * cfg.hidden_size * db  # embedding rows
        per_tok = B.stage_flops(cfg, 0)[stage.value]
        head = 2 * cfg.hidden_size * cfg.vocab_size if stage is Stage.CODA else 0
        flops = (c.padded * per_tok + c.prompt_tokens * (per_tok - head) + c.finals * head +
                 4 * cfg.num_heads * cfg.head_dim * (c.context + c.prompt_pairs) * layers)
        return self._roof(nbytes, flops)

    def _overhead(self, c: Call) -> float:
        return self.host_seconds(c.stage, c.padded)

    def host_seconds(self, stage: Stage, padded: int) -> float:
        """The host's share of a stage call (the measured table, else the constant overhead)."""
        return self.host(stage, padded) if self.host is not None else self.overhead

    def __call__(self, c: Call) -> float:
        cfg, db = self.cfg, self.dtype_bytes
        if c.stage is Stage.PREFILL:
            f = B.stage_flops(cfg, 0)
            apps = cfg.n_prelude + cfg.n_coda + cfg.r_max * cfg.n_core  # attention-layer applications
            flops = c.tokens * (f["prelude"] + cfg.r_max * f["core"] + f["coda"] - 2 * cfg.hidden_size * cfg.vocab_size)
            flops += c.batch * 2 * cfg.hidden_size * cfg.vocab_size  # the head on the last position only
            flops += 2 * cfg.num_heads * cfg.head_dim * c.context_sq * apps  # causal QK^T + AV
            nbytes = (self.params["prelude"] + cfg.r_max * self.params["core"] + self.params["coda"]) * db
            nbytes += c.tokens * B.kv_bytes_per_token(cfg, layout_class(self.kv_layout).slots_per_row(cfg), db)
            return self._roof(nbytes, flops) + self._overhead(c)
        if c.stage is Stage.FUSED:
            t = self._decode(Stage.PRELUDE, c) + c.r_max * self._decode(Stage.CORE, c) + self._decode(Stage.CODA, c)
            return t + self._overhead(c)
        t = self._decode(c.stage, c) + self._overhead(c)
        if c.filled and layout_class(self.kv_layout).depth_slots(cfg) > 1:
            # last_exited / first_then_shared: on exit, each token's exit-depth K/V is copied into its
            # skipped slots
            t += c.filled * B.kv_bytes_per_token(cfg, cfg.n_core, db) / self.bandwidth
        return t


# ---------------------------------------------------------------------------------- exit depths
def binomial_depths(r_max: int, mean: float) -> dict[int, float]:
    """d = 1 + Binomial(r_max - 1, p) with mean `mean`: a unimodal spread over 1..r_max."""
    from math import comb
    if not 1 <= mean <= r_max:
        raise ValueError(f"mean depth {mean} outside [1, {r_max}]")
    n = r_max - 1
    p = (mean - 1) / n if n else 0.0
    return {1 + k: comb(n, k) * p ** k * (1 - p) ** (n - k) for k in range(n + 1)}


def depths_from_distribution(probs: dict[int, float], requests: list[Request], seed: int = 0) -> list[list[int]]:
    """Per request, the exit depth of every output token (index 0, the prefill's, unused)."""
    ds, ws = zip(*sorted(probs.items()))
    out = []
    for i, r in enumerate(requests):
        rng = random.Random(f"depths:{seed}:{i}")
        out.append([max(ds)] + rng.choices(ds, ws, k=max(0, r.output_len - 1)))
    return out


# ---------------------------------------------------------------------------------- the runner
class SimModel:
    """What LLMEngine reads from a model: its config, dtype and device."""

    def __init__(self, cfg: LoopConfig, dtype: torch.dtype = torch.bfloat16):
        self.cfg, self.dtype, self.device = cfg, dtype, torch.device("cpu")


class _Scores:
    def __init__(self, scores: list[float]):
        self.scores = scores

    def get(self) -> list[float]:
        return self.scores


class SimRunner:
    """A `Runner` on a virtual clock (see the module docstring): ModelRunner's constructor, each
    `run` charges the cost model's time for the stage and batch, each `swap` the bytes a
    preemption moves (KV blocks + the state slot, each way) at `pcie_bandwidth` bytes/s. Swaps are
    charged in series with the stages: ModelRunner queues its copies on the compute stream."""

    def __init__(self, model, kv_layout, blocks, criterion, pad_pow2=True, max_batch_size=64, *,
                 cost, depths: list[list[int]], pcie_bandwidth: float = 25e9, acceptance: float = 1.0,
                 acceptance_seed: int = 0, **_):
        self.model, self.cfg, self.blocks = model, model.cfg, blocks
        # speculation: each drafted token is accepted with probability `acceptance` (seeded draws)
        self.acceptance, self._accept_rng = acceptance, random.Random(f"accept:{acceptance_seed}")
        self.spec_token = 1  # the token every emitting row gives (`_rows`)
        self.pad_pow2, self.max_batch_size = pad_pow2, max_batch_size
        self.cost, self.depths = cost, depths
        self.block_bytes = blocks.block_size * layout_class(kv_layout).bytes_per_row(model.cfg, model.dtype)
        self.fill_slots = layout_class(kv_layout).fill_slots  # (cfg, exit depth) -> slots its on_exit copies
        self.slot_bytes = state_slot_bytes(model, criterion)
        self.pcie_bandwidth = pcie_bandwidth
        self.clock = 0.0
        self.swap_seconds = 0.0
        self._out: dict[int, int] = {}  # seq_id -> blocks swapped out (a swap-in copies those back)
        self.trace: list[dict] = []
        self.first_at: dict[int, float] = {}  # seq_id -> virtual time of its first / latest token
        self.last_at: dict[int, float] = {}

    def swap(self, ops: list[SwapOp]) -> None:
        for op in ops:
            sid = op.seq.seq_id
            if op.kind == "out":
                self._out[sid] = n = len(op.blocks)
            else:
                n = self._out.pop(sid, 0)
            if op.kind != "drop":
                t = (n * self.block_bytes + self.slot_bytes) / self.pcie_bandwidth
                self.clock += t
                self.swap_seconds += t

    def padded(self, n: int) -> int:
        return min(next_pow2(n), max(next_pow2(self.max_batch_size), n)) if self.pad_pow2 else n

    def run(self, work: Work) -> Emitted | _Scores | SpecOut | None:
        seqs, n = work.seqs, len(work.seqs)
        if work.stage is Stage.SPEC:
            return self._spec(work)
        if work.stage is Stage.PREFILL:
            lens = [len(s.prompt_ids) for s in seqs]
            c = Call(work.stage, n, n, sum(lens), sum(lens), sum(x * x for x in lens))
        else:
            filled = sum(self.fill_slots(self.cfg, s.step) for s in seqs) if work.stage is Stage.CODA else 0
            ctx = [s.num_tokens for s in seqs]
            bs = self.blocks.block_size
            width = min(-(-self.cfg.max_position // bs), self.blocks.num_blocks) * bs  # the runner's table width
            L = min(max(bs, next_pow2(-(-max(ctx) // bs) * bs)), width) if ctx else 0
            N = self.padded(n) if n else 0
            spans = [s.chunk for s in work.chunks]
            c = Call(work.stage, n, N, n, sum(ctx), r_max=work.r_max, filled=filled, rows_sdpa=N * L,
                     rows_paged=sum(-(-x // bs) * bs for x in ctx), prompt_tokens=sum(e - a for a, e in spans),
                     prompt_rows=sum(e for _, e in spans),
                     prompt_pairs=sum((e - a) * a + (e - a) * (e - a + 1) // 2 for a, e in spans),
                     finals=len(work.finals))
        t = self.cost(c)
        self.clock += t
        row = {"stage": work.stage.value, "batch": n, "padded": c.padded, "tokens": c.tokens, "context": c.context,
               "seconds": t, "prompt_tokens": c.prompt_tokens if work.stage is not Stage.PREFILL else c.tokens,
               # what work.py counts: causal prefix rows of the prompt positions, head rows of final chunks
               "context_pairs": (c.context_sq + c.tokens) // 2 if work.stage is Stage.PREFILL else 0,
               "prompt_pairs": c.prompt_pairs, "finals": c.finals, "r_max": work.r_max or self.cfg.r_max}
        if work.chunks:  # the launch's cost that the prompts add (weights are paid by the decode items anyway)
            row["prompt_seconds"] = t - self.cost(c.without_prompts()) if n else t
        self.trace.append(row)
        if work.stage.emits:
            self._stamp(seqs + work.finals if work.finals else seqs)
        if work.stage is Stage.PRELUDE:
            return None
        if work.stage is Stage.CORE:
            # the "learned" criterion's score is an exit probability (looplm/exits.py)
            return _Scores([1.0 if self._fires(s) else 0.0 for s in seqs])
        return Emitted(self._rows(n + len(work.finals)))

    def _stamp(self, seqs: list[Sequence]) -> None:
        """The virtual time of each sequence's first and latest token (the engine stamps wall time)."""
        for s in seqs:
            self.first_at.setdefault(s.seq_id, self.clock)
            self.last_at[s.seq_id] = self.clock

    def _rows(self, n: int) -> torch.Tensor:
        """Logits of n emitting rows: every token is id `spec_token` (1)."""
        return torch.tensor([[0.0, 1.0]]).expand(n, 2)

    def _spec(self, work: Work) -> SpecOut:
        """A speculative stage (infer/engine/speculative.py) on the clock: the launches it runs, each
        priced as a decode launch of its items (unpadded, the eager path's SDPA gather to the
        longest context), and the outcome: every chunk position exits at its recorded depth, and
        a draft whose predecessors were accepted is accepted with probability `acceptance`
        (LLMEngine.speculative_metrics' draft_accept_prob), independently of its depth (in the
        engine the draft of a position that exits within the draft depth is always right; the
        rate here is an overall one, as measured on a checkpoint)."""
        bs, fill, dd = self.blocks.block_size, self.fill_slots, work.draft_depth
        items = []  # (seq index, chunk index, context length, exit depth)
        for b, (s, k) in enumerate(zip(work.seqs, work.spec)):
            p = s.policy
            for j in range(k):
                d = max(p.r_min, min(p.r_max, self.depths_at(s, len(s.output_ids) + j)))
                items.append((b, j, s.num_tokens + j, d))
        rows: list[dict] = []

        def launch(stage: Stage, its: list, phase: str, filled: int = 0) -> None:
            if not its:
                return
            ctx = [c for _, _, c, _ in its]
            n = len(its)
            c = Call(stage, n, n, n, sum(ctx), filled=filled, rows_sdpa=n * max(ctx),
                     rows_paged=sum(-(-x // bs) * bs for x in ctx))
            t = self.cost(c)
            self.clock += t
            rows.append({"stage": stage.value, "batch": n, "padded": n, "tokens": n, "context": c.context,
                         "seconds": t, "prompt_tokens": 0, "context_pairs": 0, "prompt_pairs": 0, "finals": 0,
                         "r_max": self.cfg.r_max, "phase": phase, "score_reads": int(stage is Stage.CORE)})

        for j in range(max(work.spec)):  # draft rounds: prelude, core steps up to the draft depth, coda
            rnd = [it for it in items if it[1] == j]
            launch(Stage.PRELUDE, rnd, "draft")
            for st in range(1, dd + 1):
                launch(Stage.CORE, [it for it in rnd if it[3] >= st], "draft")
            launch(Stage.CODA, [it for it in rnd if j < work.spec[it[0]] - 1], "draft")
        for st in range(dd + 1, max(it[3] for it in items) + 1):  # verify: each live position to its exit
            launch(Stage.CORE, [it for it in items if it[3] >= st], "verify")
        launch(Stage.CODA, items, "verify", filled=sum(fill(self.cfg, d) for *_, d in items))
        for r in rows:
            self.trace.append(r)
        self._stamp(work.seqs)
        drafts, tok = [], self.spec_token
        for k in work.spec:  # a rejected draft is any other id: acceptance stops there (later draws unused)
            drafts.append([tok if self._accept_rng.random() < self.acceptance else tok + 1 for _ in range(k - 1)])
        depths = [[d for b2, _, _, d in items if b2 == b] for b in range(len(work.seqs))]
        launches = {ph: sum(r["phase"] == ph for r in rows) for ph in ("draft", "verify")}
        return SpecOut(self._rows(len(items)), list(work.spec), drafts, depths, launches, rows)

    def depths_at(self, s: Sequence, i: int) -> int:
        """The recorded exit depth of the sequence's output token i."""
        return self.depths[int(s.request_id)][i]

    def depth_of(self, s: Sequence) -> int:
        """The recorded exit depth of the token the sequence is looping on (requests are numbered)."""
        return self.depths_at(s, len(s.output_ids))

    def _fires(self, s: Sequence) -> bool:
        """The exit signal after this step, for a token whose recorded exit depth is d (lookahead:
        the signal comes a step early)."""
        p = s.policy
        d = max(p.r_min, min(p.r_max, self.depth_of(s)))
        step = s.step + 1
        return step == d - 1 if p.lookahead else step == d


# ---------------------------------------------------------------------------------- running
# How the simulated runner makes a token exit at its recorded depth: the "learned" criterion reads
# its exit probability, which SimRunner answers 1 or 0 (`_fires`); lookahead depths start at 2.
SIM_EXITS = dict(exit_criterion="learned", exit_threshold=0.5)


def simulate_mode(cfg: LoopConfig, requests: list[Request], mode: dict, cost, depths: list[list[int]],
                  **engine) -> dict:
    """One mode through the real engine on the virtual clock; the bench's raw record. `engine`:
    EngineConfig fields (the same for every mode; a mode's own fields win, and the exit criterion
    is the simulator's, SIM_EXITS)."""
    kw = {**engine, **{k: v for k, v in mode.items() if k != "name"}, **SIM_EXITS}
    kw["r_min"] = 2 if kw.get("lookahead") else 1
    ecfg = EngineConfig(**kw)
    eng = LLMEngine(SimModel(cfg), ecfg, runner_cls=partial(SimRunner, cost=cost, depths=depths))
    seqs = [eng.add_request(r.prompt_ids, SamplingParams(max_tokens=r.output_len, ignore_eos=True), request_id=str(i))
            for i, r in enumerate(requests)]
    while eng.has_unfinished():
        eng.step()
    run = eng.runner
    return raw_from(mode, run.trace, run.clock, [eng.output(s) for s in seqs], eng.config,
                    prefix_cache=prefix_cache(eng.metrics()), work=work_counts(run.trace, cfg, cost_bytes(cost)),
                    speculative=eng.speculative_metrics())


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
            eng = LLMEngine(SimModel(cfg), EngineConfig(**kw), runner_cls=partial(
                SimRunner, cost=cost, depths=depths, acceptance=acceptance, acceptance_seed=seed))
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


def cost_bytes(cost) -> int:
    """Bytes per weight element of the simulated device (the roofline's dtype; bf16 otherwise)."""
    return getattr(cost, "dtype_bytes", 2)


def served_context(cfg: LoopConfig, engine: dict) -> int:
    """The max_model_len an engine with these EngineConfig fields serves on `cfg` (the simulated
    device's pool decides it, as on a real one): the longest request a workload may hold."""
    eng = LLMEngine(SimModel(cfg), EngineConfig(**{**engine, **SIM_EXITS}),
                    runner_cls=partial(SimRunner, cost=None, depths=[]))
    return eng.max_model_len


def simulate(cfg: LoopConfig, requests: list[Request], cost, depths: list[list[int]], modes: list[dict] | None = None,
             workload: str = "custom", scale: float | str = 1.0, **kw) -> dict:
    """Every mode on one request list: the bench's workload block (virtual seconds)."""
    modes = modes or modes_for()
    raws = {m["name"]: simulate_mode(cfg, requests, m, cost, depths, **kw) for m in modes}
    results = summarize(raws, cfg, requests, {"simulated": True, **{k: v for k, v in kw.items()}})
    ctx = next(iter(raws.values()))["engine_config"]["max_model_len"]  # the context the engines served
    out = {"workload": describe(requests, workload, scale, ctx) if workload in WORKLOADS else
           {"workload": workload, "num_requests": len(requests)},
           "bounds": bounds_block(cfg, requests), "results": results,
           "traces": {n: r["trace"] for n, r in raws.items()}, **headline(results)}
    return out


def h100_kv_tokens(cfg: LoopConfig, kv_layout: str = DEFAULT_LAYOUT, memory: float = 80e9, util: float = 0.9,
                   dtype_bytes: int = 2) -> int:
    """KV rows that fit next to the bf16 weights in `util` of the GPU's memory."""
    slots = layout_class(kv_layout).slots_per_row(cfg)
    p = B.stage_params(cfg)
    weights = (p["prelude"] + p["core"] + p["coda"] + cfg.vocab_size * cfg.hidden_size) * dtype_bytes
    return int((memory * util - weights) // B.kv_bytes_per_token(cfg, slots, dtype_bytes))


SIM_SKIPPED = ("policy", "refill", "min_coda_batch", "full_depth", "trace", "seed", "exit_criterion", "exit_threshold",
               "r_min", "cuda_graphs", "pipeline", "gpu_memory_utilization", "kv_cache_bytes", "kv_cache_memory")
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
        blk = simulate(cfg, reqs, cost, data["exit_depths"][w], modes, workload=w, scale=wl["scale_arg"], **engine)
        blk["measured_tokens_per_s"] = run["measured_tokens_per_s"]
        for r in blk["results"]:
            m = run["measured_tokens_per_s"].get(r["mode"])
            r["measured_tokens_per_s"] = m
            r["sim_error"] = r["output_tokens_per_s"] / m - 1 if m else None
        blocks.append(blk)
    return blocks


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m infer.sim", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="ouro-1.4b", help=f"{sorted(PAPER_MODELS)} (roofline), or with --fitted the "
                   "benchmarked model (default: the one in the trace file)")
    p.add_argument("--fitted", type=Path, default=None, help="replay a bench trace file (infer.bench --save-trace) "
                   "with the latency model fitted on it, and compare with the measured throughput")
    p.add_argument("--layer-split", default=None, metavar="P-C-Q",
                   help="Huginn only: the model with its first P prelude, C core and Q coda layers (e.g. 0-4-0 or "
                        "1-4-1 of huginn-3.5b's 2-4-2; with --fitted default the bench's)")
    p.add_argument("--workloads", nargs="+", default=None, choices=WORKLOADS,
                   help="default: all three (with --replay-exits: the file's)")
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--mean-depth", type=float, default=None, help="mean exit depth (binomial spread); default: assumed")
    p.add_argument("--ks", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--bandwidth", type=float, default=3.35e12, help="bytes/s (H100 SXM; H200: 4.8e12)")
    p.add_argument("--peak-flops", type=float, default=989e12, help="dense bf16 FLOP/s")
    p.add_argument("--overhead-us", type=float, default=20.0, help="launch/scheduling overhead per stage call "
                   "(used without a host benchmark JSON)")
    p.add_argument("--host-json", type=Path, default=HOST_JSON if HOST_JSON.exists() else None,
                   help="per-stage host time measured by python -m infer.bench_host (default: "
                        f"{HOST_JSON} when it exists); 'none' for the constant --overhead-us")
    p.add_argument("--attention", default="sdpa", choices=("context", "paged", "sdpa"),
                   help="decode attention's KV reads: the engine's SDPA gather (CUDA path today), a paged "
                        "kernel, or the ideal real context")
    p.add_argument("--replay-exits", type=Path, metavar="FILE",
                   help="a recorded-exits file (infer.bench --record-exits): its requests' lengths and the depths "
                        "its scores decide, instead of --mean-depth's binomial and the trace")
    p.add_argument("--replay-threshold", type=float, default=None, help="with --replay-exits: default the recorded")
    p.add_argument("--replay-r-min", type=int, default=None, help="with --replay-exits: default the recorded")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--acceptance", metavar="FILE_OR_RATE", default=None,
                   help="with --speculative-tokens: the draft acceptance rate, or a JSON file that measured it "
                        "(python -m infer.bench.speculative, or a bench JSON with speculation)")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64],
                   help="with --speculative-tokens: the batch sizes of the speculation projection")
    p.add_argument("--out", type=Path, default=Path("outputs/sim"))
    # the engine's own flags (a mode's policy / refill / K / full depth and the simulator's exit
    # criterion are set per mode); kv_cache_tokens: default what an 80 GB H100 holds beside the weights
    add_engine_args(p, skip=SIM_SKIPPED)
    p.set_defaults(max_batch_size=64)
    a = p.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    if a.fitted is not None:
        blocks = replay_fitted(a.fitted, None if a.model == "ouro-1.4b" else a.model, a.layer_split)
        for b in blocks:
            print(format_table(b))
            print(f"{'mode':16s} {'measured':>10s} {'simulated':>10s} {'error':>7s}   (output tokens/s; fitted cost model)")
            for r in b["results"]:
                print(f"{r['mode']:16s} {r['measured_tokens_per_s']:10.1f} {r['output_tokens_per_s']:10.1f} "
                      f"{100 * r['sim_error']:+6.1f}%")
        path = a.out / f"replay_{a.fitted.stem}.json"
        path.write_text(json.dumps({"trace_file": str(a.fitted), "cost_model": "fitted (infer/latency.py)",
                                    "workloads": [{k: v for k, v in b.items() if k != "traces"} for b in blocks]},
                                   indent=1, default=float))
        print(f"json: {path}")
        return
    if a.model not in PAPER_MODELS:
        p.error(f"--model must be one of {sorted(PAPER_MODELS)} without --fitted")
    cfg = paper_config(a.model)
    cfg = split_config(cfg, a.layer_split) if a.layer_split else cfg
    label = f"{a.model} split {split_of(cfg)}" if a.layer_split else a.model  # how outputs name the model
    engine = engine_kwargs_from_args(a)
    layout = EngineConfig(**engine).resolve(cfg).kv_layout  # the cost model prices the layout the engine runs
    engine.setdefault("kv_cache_tokens", h100_kv_tokens(cfg, layout))
    ctx = served_context(cfg, engine)
    replay = RP.load(a.replay_exits) if a.replay_exits else None
    if replay is not None:
        rs = RP.engine_settings(replay, {"exit_threshold": a.replay_threshold, "r_min": a.replay_r_min})
        pol = ExitPolicy(rs["exit_criterion"], rs["exit_threshold"], rs["r_min"], cfg.r_max, bool(a.lookahead))
    workloads = a.workloads or (list(replay["workloads"]) if replay is not None else list(WORKLOADS))
    mean = a.mean_depth or ASSUMED_MEAN_DEPTH[a.model]
    probs = binomial_depths(cfg.r_max, mean)
    host = HostCost.from_json(a.host_json) if a.host_json is not None and str(a.host_json) != "none" else None
    cost = RooflineCost(cfg, bandwidth=a.bandwidth, peak_flops=a.peak_flops, overhead=a.overhead_us * 1e-6,
                        kv_layout=layout, host=host, attention=a.attention)
    if a.speculative_tokens:
        if a.acceptance is None:
            p.error("--speculative-tokens needs --acceptance FILE_OR_RATE (the drafts' acceptance rate)")
        rate = load_acceptance(a.acceptance)
        out = []
        for w in workloads:
            reqs = make_requests(w, a.num_requests, seed=a.seed, scale=1.0, max_model_len=ctx, vocab_size=cfg.vocab_size)
            rows = speculation_projection(cfg, reqs, cost, depths_from_distribution(probs, reqs, a.seed), a.batches,
                                          rate, engine, a.seed)
            out.append({"workload": w, "rows": rows})
            for r in rows:
                print(f"{label} {w:9s} batch {r['batch']:3d}: tokens/s {r['off']['output_tokens_per_s']:9.1f} -> "
                      f"{r['on']['output_tokens_per_s']:9.1f} ({r['throughput_ratio']:.2f}x), TPOT "
                      f"{1e3 * r['off']['mean_tpot_s']:.2f} -> {1e3 * r['on']['mean_tpot_s']:.2f} ms "
                      f"({r['tpot_speedup']:.2f}x), acceptance {r['on']['speculative']['acceptance_rate']:.2f}, "
                      f"tokens/verification {r['on']['speculative']['tokens_per_verification']:.2f}")
        path = a.out / f"sim_spec_{a.model}_k{a.speculative_tokens}_a{rate:.2f}.json"
        path.write_text(json.dumps({"model": a.model, "acceptance": rate, "acceptance_arg": a.acceptance,
                                    "engine": engine, "mean_exit_depth_assumed": mean, "num_requests": a.num_requests,
                                    "simulated": True, "workloads": out,
                                    "command": "python -m infer.sim " + " ".join(argv if argv is not None else
                                                                                 __import__("sys").argv[1:])},
                                   indent=1, default=float))
        print(f"json: {path}")
        return
    blocks = []
    for w in workloads:
        if replay is not None:
            reqs = RP.make_replay_requests(replay, w, cfg.vocab_size, ctx, a.seed)
            depths = RP.replay_depths(replay, w, pol)
        else:
            reqs = make_requests(w, a.num_requests, seed=a.seed, scale=1.0, max_model_len=ctx,
                                 vocab_size=cfg.vocab_size)
            depths = depths_from_distribution(probs, reqs, a.seed)
        blk = simulate(cfg, reqs, cost, depths, modes_for(a.ks), workload=w, **engine)
        if replay is not None:
            blk["replayed_exits"] = {"file": str(a.replay_exits), "model": replay["model"], "policy": {
                "criterion": pol.criterion, "threshold": pol.threshold, "r_min": pol.r_min, "lookahead": pol.lookahead}}
        print(format_table(blk))
        blocks.append(blk)
    meta = {"model": a.model, "config": cfg.name, "layer_split": a.layer_split and split_of(cfg),
            "cost_model": "roofline", "bandwidth": cost.bandwidth,
            "peak_flops": cost.peak_flops, "overhead_s": None if host else cost.overhead,
            "host_json": str(a.host_json) if host else None, "attention": a.attention, "engine": engine, "num_requests": a.num_requests,
            "exit_depth_distribution": None if replay else probs, "mean_exit_depth_assumed": None if replay else mean,
            "replay_exits": str(a.replay_exits) if replay else None, "simulated": True,
            "command": "python -m infer.sim " + " ".join(argv if argv is not None else __import__("sys").argv[1:])}
    stem = a.model + (f"_split{split_of(cfg)}" if a.layer_split else "")
    tag = f"{stem}_replay_{a.replay_exits.stem}" if replay else f"{stem}_d{mean:g}"
    path = a.out / f"sim_{tag}.json"
    path.write_text(json.dumps({**meta, "workloads": [{k: v for k, v in b.items() if k != "traces"} for b in blocks]},
                               indent=1, default=float))
    png = plot(blocks, a.out / f"sim_{tag}.png", f"{label}, simulated GPU roofline, " +
               (f"exits replayed from {replay['model']}" if replay else f"mean exit depth {mean:g}"))
    print(f"json: {path}\nplot: {png}")


if __name__ == "__main__":
    main()

"""The device's cost models: what one stage launch (`Call`) costs on the simulated device.

`RooflineCost`: per stage max(bytes / bandwidth, FLOPs / peak) + a host overhead (the measured
host table `HostCost`, else a constant), for a GPU such as the H100 on the real Ouro-1.4B /
Huginn-3.5B shapes. `FittedCost`: the latency model of latency.py fitted on this machine's engine
trace. `h100_kv_tokens`: the KV pool such a GPU holds beside the weights."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from infer.engine.sequence import Stage
from kv_layouts import DEFAULT_LAYOUT, layout_class
from looplm.config import LoopConfig

from . import bounds as B
from .dispatch import Dispatch
from .latency import StageFit

# The host benchmark's JSON (python -m infer.bench.host --out ...): the default per-stage overhead.
HOST_JSON = Path(__file__).resolve().parents[2] / "docs" / "figures" / "bench_host.json"


@dataclass
class Call:
    stage: Stage
    batch: int
    padded: int
    tokens: int
    context: int  # tokens read (decode: sum of the items' contexts; prefill: prompt tokens)
    context_sq: int = 0  # prefill: sum of squared prompt lengths (causal attention)
    r_max: int = 0  # fused: loop steps
    filled: int = 0  # coda: depth slots filled on exit (sum of the layout's fill_depth_slots over the tokens)
    rows_sdpa: int = 0  # decode: padded batch x bucketed longest context (the SDPA path's gather)
    rows_paged: int = 0  # decode: whole blocks of each item's context (a paged kernel)
    # mixed launches (prompt chunks riding along): their tokens, the context rows they read (once per
    # chunk), their causal (query, key) pairs, and the chunks that end their prompt (head rows)
    prompt_tokens: int = 0
    prompt_rows: int = 0
    prompt_pairs: int = 0
    finals: int = 0
    # a mixed launch pads its items together (mixed.py; on the paged path on the ladder of padded_batch):
    # rows it runs beyond padded + prompt_tokens (negative: the decode items are not padded on their own)
    extra_rows: int = 0

    def without_prompts(self) -> Call:
        return Call(self.stage, self.batch, self.padded, self.tokens, self.context, self.context_sq, self.r_max,
                    self.filled, self.rows_sdpa, self.rows_paged)


class HostCost:
    """Measured host time per stage call (`python -m infer.bench.host` JSON: median microseconds at
    a few batch sizes), linear in the batch size between the measured points, flat outside them.
    `reentry`: the same with on-device token re-entry (its `host_async_us`), where an emitting
    stage's ids are read one launch later: those reads are their own entries, `resolve_<stage>`
    (None: not measured; re-entry is then charged the synchronous table and no read). `pre` /
    `pre_reentry`: the part of each step up to its launch (`pre_us`, `pre_async_us`; None: all of
    it, the host then does nothing after a launch)."""

    def __init__(self, table: dict[str, dict[str, dict]], reentry: dict[str, dict[str, dict]] | None = None,
                 pre: dict[str, dict[str, dict]] | None = None, pre_reentry: dict[str, dict[str, dict]] | None = None):
        self.points = self._points(table)
        self.reentry = self._points(reentry) if reentry else None
        self.pre_points = self._points(pre) if pre else None
        self.pre_reentry = self._points(pre_reentry) if pre_reentry else None

    @staticmethod
    def _points(table: dict[str, dict[str, dict]]) -> dict[str, list[tuple[int, float]]]:
        stages = {k for v in table.values() for k in v}
        return {k: sorted((int(b), v[k]["median"] * 1e-6) for b, v in table.items() if k in v) for k in stages}

    @classmethod
    def from_json(cls, path: Path) -> HostCost:
        data = json.loads(Path(path).read_text())
        return cls(data["host_us"], data.get("host_async_us"), data.get("pre_us"), data.get("pre_async_us"))

    def __call__(self, stage: Stage, batch: int, reentry: bool = False) -> float:
        table = self.reentry if reentry and self.reentry is not None else self.points
        return self._at(table[stage.value], batch)

    def pre(self, stage: Stage, batch: int, reentry: bool = False) -> float:
        """The host's work for a stage call before its launch (at most all of it)."""
        whole = self(stage, batch, reentry)
        table = self.pre_reentry if reentry and self.reentry is not None else self.pre_points
        pts = table.get(stage.value) if table else None
        return min(whole, self._at(pts, batch)) if pts else whole

    def resolve(self, stage: Stage, batch: int) -> float:
        """Re-entry: the host's read of the ids `stage` emitted (stop rules, output processing)."""
        pts = self.reentry and self.reentry.get("resolve_" + stage.value)
        return self._at(pts, batch) if pts else 0.0

    @staticmethod
    def _at(pts: list[tuple[int, float]], batch: int) -> float:
        if batch <= pts[0][0]:
            return pts[0][1]
        for (b0, t0), (b1, t1) in zip(pts, pts[1:]):
            if batch <= b1:
                return t0 + (t1 - t0) * (batch - b0) / (b1 - b0)
        return pts[-1][1]


class FittedCost:
    """t = delta + gamma N_b + alpha N_c per stage (infer/sim/latency.py), plus the host time between
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
    then attention over the copy). FLOPs: infer/sim/bounds.py counts x the padded batch. Defaults:
    H100 SXM, bf16. `dispatch`: the host's cost of issuing each launch (eager ops or a graph
    replay), which SimRunner charges beside these seconds (None: not charged)."""
    cfg: LoopConfig
    bandwidth: float = 3.35e12  # bytes/s
    peak_flops: float = 989e12  # dense bf16
    overhead: float = 20e-6  # seconds per stage call
    dtype_bytes: int = 2
    kv_layout: str = DEFAULT_LAYOUT
    host: HostCost | None = None
    attention: str = "context"
    # what issuing a launch costs the host (dispatch.py; SimRunner charges it); None: not charged
    dispatch: Dispatch | None = None
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
        rows_run = c.padded + c.extra_rows  # (decode items and padding)
        items = rows_run + c.prompt_tokens
        rows = {"context": c.context, "paged": c.rows_paged or c.context, "sdpa": 3 * c.rows_sdpa or c.context}
        nbytes = self.params[stage.value] * db + (rows[self.attention] + c.prompt_rows) * kv + items * kv
        if stage is Stage.PRELUDE:
            nbytes += items * cfg.hidden_size * db  # embedding rows
        per_tok = B.stage_flops(cfg, 0)[stage.value]
        head = 2 * cfg.hidden_size * cfg.vocab_size if stage is Stage.CODA else 0
        flops = (rows_run * per_tok + c.prompt_tokens * (per_tok - head) + c.finals * head +
                 4 * cfg.num_heads * cfg.head_dim * (c.context + c.prompt_pairs) * layers)
        return self._roof(nbytes, flops)

    def _overhead(self, c: Call) -> float:
        return self.host_seconds(c.stage, c.padded)

    def host_seconds(self, stage: Stage, padded: int, reentry: bool = False) -> float:
        """The host's share of a stage call (the measured table, else the constant overhead); with
        `reentry`, the host's work for it under on-device token re-entry (HostCost)."""
        return self.host(stage, padded, reentry) if self.host is not None else self.overhead

    def host_pre_seconds(self, stage: Stage, padded: int, reentry: bool = False) -> float:
        """The part of `host_seconds` before the launch (scheduling, upload, the launch itself); the
        rest (reading results, output processing, bookkeeping) comes after it. Without a measured
        split, all of it."""
        return self.host.pre(stage, padded, reentry) if self.host is not None else self.overhead

    def resolve_seconds(self, stage: Stage, padded: int) -> float:
        """Re-entry: the host's read, one launch later, of the ids a `stage` call emitted (0 without
        a measured table: the constant overhead has no such part)."""
        return self.host.resolve(stage, padded) if self.host is not None else 0.0

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


def cost_bytes(cost) -> int:
    """Bytes per weight element of the simulated device (the roofline's dtype; bf16 otherwise)."""
    return getattr(cost, "dtype_bytes", 2)


# the GPUs the simulator and the emulated device price: bytes/s, dense bf16 FLOP/s, memory bytes (SXM parts)
DEVICES = {"h100": {"bandwidth": 3.35e12, "peak_flops": 989e12, "memory": 80e9},
           "h200": {"bandwidth": 4.8e12, "peak_flops": 989e12, "memory": 141e9},
           "a100": {"bandwidth": 2.039e12, "peak_flops": 312e12, "memory": 80e9}}


def h100_kv_tokens(cfg: LoopConfig, kv_layout: str = DEFAULT_LAYOUT, memory: float = 80e9, util: float = 0.9,
                   dtype_bytes: int = 2) -> int:
    """KV rows that fit next to the bf16 weights in `util` of the GPU's memory."""
    slots = layout_class(kv_layout).slots_per_row(cfg)
    p = B.stage_params(cfg)
    weights = (p["prelude"] + p["core"] + p["coda"] + cfg.vocab_size * cfg.hidden_size) * dtype_bytes
    return int((memory * util - weights) // B.kv_bytes_per_token(cfg, slots, dtype_bytes))

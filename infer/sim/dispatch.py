"""Host dispatch per launch: what issuing a launch's kernels costs the host (issue 62).

An eager launch dispatches every aten op of the engine's code for it one by one, each a few
microseconds of host time on a GPU host; a launch that replays a CUDA graph costs one replay. The
committed host table (`HostCost`, docs/figures/bench_host.json) is measured with the model's math
removed (infer/bench/host.py's NoopRunner), so it charges none of this: `Dispatch` does.

Which launches are eager (infer/engine/runner.py, as on CUDA): every launch of a speculative stage
(Stage.SPEC: speculative.py), and a launch that carries prompt chunks (`work.chunks`: mixed.py; a
separate prefill launch's prompts are such chunks, run as a fused iteration) on the SDPA attention
path or for a request that asks for prompt log-probs; a prelude / core step / coda / CB fused
iteration / separate prefill launch replays a CUDA graph when graphs are on (the CUDA default; on the
paged path, the CUDA default too, also with prompt chunks), else it runs its body eagerly too. `graphed_dispatches` counts what a graphed launch still
dispatches (`--graphed`).

The op counts come from the engine itself (`count_ops`): a real `LLMEngine` with its `ModelRunner`
runs a small fixed set of requests on the CPU, at the model's structure (architecture, prelude /
core / coda layer counts, r_max, heads' layout, gates) with every width made tiny, under a
TorchDispatchMode that counts the aten ops of each launch. Not on the meta device at the real
width: the engine reads values back (sampling, exit scores), which meta tensors do not have. The
count does not depend on the width (tests/test_sim_dispatch.py checks it at two widths). What is
counted is what the host table leaves out: the ops inside a decode launch's `body` (the metadata
upload, `BatchState.upload`, and the rest of the launch are in the table), every op of a mixed
launch but its upload (the table has no mixed launch), a prefill launch's likewise, and a
speculative stage whole, split per launch of its plan. Ops
per launch kind are then a line fitted by least squares on the launches seen: a decode-only
launch is one number per stage; a launch with chunks is `base + per_chunk * chunks + decode`
(`decode`: what its decode items add, 0 when it has none); a prefill launch `base + per_prompt *
prompts`; a speculative launch `base + per_item * items` per (phase, stage). The residuals are kept
(`max_residual`: a few ops, from uploads of changed block tables and the chunks' own lengths).

Costs: `op_us` per eager op (default 5, the issue's figure for a GPU host; 0 turns the charge
off), `replay_us` per graph replay (default 10: an assumption until scripts/gpu_check.py measures
it, which writes `{"dispatch": {"op_us": ..., "replay_us": ...}}` into its JSON: `from_json`).

    python -m infer.sim.dispatch --model ouro-1.4b      # the op counts per launch kind
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import random
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.attention.flex_attention as fa
from torch.utils._python_dispatch import TorchDispatchMode

from infer.engine.sequence import Stage
from looplm.io import read_config
from looplm.errors import ParamError

OP_US = 5.0  # host microseconds per eager aten op (the figure for a GPU host)
REPLAY_US = 10.0  # host microseconds per CUDA graph replay (an assumption until gpu_check measures it)
DECODE_STAGES = (Stage.PRELUDE, Stage.CORE, Stage.CODA, Stage.FUSED)


# ---------------------------------------------------------------------------------- counting
class OpCounter(TorchDispatchMode):
    """Counts the aten ops dispatched while `active` (`n`). A higher-order op (FlexAttention) counts
    as one: it is one fused kernel on CUDA."""
    supports_higher_order_operators = True

    def __init__(self):
        super().__init__()
        self.n, self.active = 0, True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.active:
            self.n += 1
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        # eager FlexAttention wraps its op in torch.compile, which a mode would disturb: call the op
        # directly (its debug switch; host_syncs.py does the same)
        self._flex = fa._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG
        fa._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG = True
        return super().__enter__()

    def __exit__(self, *exc):
        fa._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG = self._flex
        return super().__exit__(*exc)


def _switched(counter: OpCounter, fn, on: bool):
    """`fn` with the counter on (`on`) or paused while it runs, as it was after."""
    def wrapper(*a, **k):
        was, counter.active = counter.active, on
        try:
            return fn(*a, **k)
        finally:
            counter.active = was
    return wrapper


def paused(counter: OpCounter, fn):
    """`fn` with the counter paused while it runs (work the host table already charges)."""
    return _switched(counter, fn, False)


def counted(counter: OpCounter, fn):
    """`fn` with the counter on while it runs."""
    return _switched(counter, fn, True)


# ---------------------------------------------------------------------------------- lines
@dataclass(frozen=True)
class Line:
    """ops = base + per * x (+ decode where the launch has decode items), fitted on `samples`
    launches; `max_residual`: the largest |fit - count| among them."""
    base: float
    per: float = 0.0
    decode: float = 0.0
    samples: int = 0
    max_residual: float = 0.0

    def __call__(self, x: int, has_decode: bool = True) -> float:
        return self.base + self.per * x + (self.decode if has_decode else 0.0)

    @classmethod
    def fit(cls, rows: list[tuple[int, bool, int]]) -> Line:
        """Least squares over (x, has decode items, ops) rows; a term the rows cannot tell apart
        (one x only, or decode items always or never there) is left out."""
        xs = {x for x, _, _ in rows}
        ds = {d for _, d, _ in rows}
        cols = [lambda x, d: 1.0]
        if len(xs) > 1:
            cols.append(lambda x, d: float(x))
        if len(ds) > 1:
            cols.append(lambda x, d: float(d))
        A = torch.tensor([[c(x, d) for c in cols] for x, d, _ in rows], dtype=torch.float64)
        y = torch.tensor([[float(o)] for _, _, o in rows], dtype=torch.float64)
        coef = torch.linalg.lstsq(A, y, driver="gelsd").solution[:, 0].tolist()
        base = coef.pop(0)
        per = coef.pop(0) if len(xs) > 1 else 0.0
        dec = coef.pop(0) if len(ds) > 1 else 0.0
        line = cls(base, per, dec, len(rows))
        res = max(abs(line(x, d) - o) for x, d, o in rows)
        return dataclasses.replace(line, max_residual=res)

    def describe(self) -> dict:
        return {k: round(v, 1) if isinstance(v, float) else v for k, v in dataclasses.asdict(self).items()}


@dataclass
class OpCounts:
    """The eager ops of each launch kind of one engine structure (module docstring). `decode`:
    decode-only launches (run eagerly when graphs are off), by stage; `mixed`: launches carrying
    prompt chunks, by stage (x: chunks); `prefill` (x: prompts); `spec`: by (phase, stage) (x: items).
    A kind not counted is missing (`ops` then raises KeyError)."""
    decode: dict[Stage, float] = field(default_factory=dict)
    mixed: dict[Stage, Line] = field(default_factory=dict)
    prefill: Line | None = None
    spec: dict[tuple[str, Stage], Line] = field(default_factory=dict)
    how: dict = field(default_factory=dict)

    def describe(self) -> dict:
        return {"decode": {s.value: v for s, v in self.decode.items()},
                "mixed": {s.value: l.describe() for s, l in self.mixed.items()},
                "prefill": self.prefill.describe() if self.prefill else None,
                "spec": {f"{p}_{s.value}": l.describe() for (p, s), l in self.spec.items()}, **self.how}


def count_config(cfg):
    """`cfg` with every width tiny and its structure kept (layers, r_max, heads' layout, gates,
    architecture): what `count_ops` runs. The heads keep GQA or not; the context is 512."""
    gqa = cfg.num_kv_heads < cfg.num_heads
    return dataclasses.replace(cfg, vocab_size=256, hidden_size=32, intermediate_size=64, num_heads=2,
                               num_kv_heads=1 if gqa else 2, head_dim=16, max_position=512, extra=dict(cfg.extra))


def structure_key(cfg) -> tuple:
    """What the op counts depend on in a config: everything but its widths and token ids."""
    skip = {"vocab_size", "hidden_size", "intermediate_size", "num_heads", "num_kv_heads", "head_dim",
            "max_position", "bos_token_id", "eos_token_id", "pad_token_id", "stop_token_ids", "extra",
            "rope_theta", "rope_scaling", "norm_eps", "init_std", "embed_scale", "exit_threshold"}
    return tuple((f.name, getattr(cfg, f.name)) for f in dataclasses.fields(cfg) if f.name not in skip) + (
        ("gqa", cfg.num_kv_heads < cfg.num_heads),)


# the requests the counting engine runs: prompt lengths and output lengths; with a launch budget of 32
# tokens and 16-token blocks they make launches with 0 to 3 chunks, with and without decode items
COUNT_PROMPTS = ((40, 3), (20, 2), (50, 3), (8, 2), (30, 2), (70, 2))


def _engine(cfg, settings: dict):
    from infer.engine.config import EngineConfig
    from infer.engine.llm_engine import LLMEngine
    from looplm.presets import dummy_model
    model = dummy_model(count_config(cfg), torch.float32, "cpu")
    base = dict(max_batch_size=4, max_num_batched_tokens=32, kv_cache_tokens=4096, seed=0)
    return LLMEngine(model, EngineConfig(**{**base, **settings}))


def _run(eng, prompts=COUNT_PROMPTS, max_tokens: int | None = None) -> None:
    from infer.engine.sampling_params import SamplingParams
    rng = random.Random(0)
    for i, (p, o) in enumerate(prompts):
        eng.add_request([rng.randrange(3, 250) for _ in range(p)],
                        SamplingParams(max_tokens=max_tokens or o, ignore_eos=True, temperature=0.0),
                        request_id=str(i))
    while eng.has_unfinished():
        eng.step()


def _count_launches(eng, counter: OpCounter) -> list:
    """Instrument `eng` so that each launch's ops (what the host table leaves out) are recorded:
    returns the list the rows go to, (work kind, decode items, chunks, ops)."""
    rows: list = []
    runner = eng.runner
    runner.batch_state.upload = paused(counter, runner.batch_state.upload)  # (the host table's)
    runner.body = counted(counter, runner.body)

    def inst(work, dt):
        if dt is None:
            counter.n = 0
            # a decode-only launch counts its body only (the rest is in the host table); a launch with
            # prompt chunks (a separate prefill's too) or a speculative stage all of it but the upload
            counter.active = bool(work.chunks) or work.stage is Stage.SPEC
        else:
            rows.append((work.stage, len(work.seqs), len(work.chunks), counter.n))
    eng.on_launch.append(inst)
    return rows


def _settings(kind: str, kv_layout: str, criterion: str) -> dict:
    """The counting engine's settings for CDB's stages ("cdb": refill at K=1, full depth under criterion
    "none") or CB's fused iteration ("cb"); other kinds start from the layout alone."""
    settings = {"kv_layout": kv_layout}
    if kind == "cdb":
        settings.update(policy="cdb", refill=True, min_coda_batch=1)
        if criterion == "none":
            settings["full_depth"] = True
        else:
            settings.update(exit_criterion=criterion, exit_threshold=0.5)
    elif kind == "cb":
        settings.update(policy="cb")
    return settings


def _count(cfg, kind: str, kv_layout: str, criterion: str, attention: str) -> OpCounts:
    """One counting engine run (`kind`: "cdb" the prelude / core / coda, "cb" the fused iteration,
    "prefill" separate prefill launches, "spec" speculative stages)."""
    settings = _settings(kind, kv_layout, criterion)
    if kind == "prefill":
        settings.update(policy="cdb", prefill="separate", full_depth=True)
    elif kind == "spec":
        settings.update(policy="cdb", refill=True, min_coda_batch=1, exit_criterion=criterion, exit_threshold=0.5,
                        speculative_tokens=3, speculative_max_batch=4)
    counter = OpCounter()
    with torch.inference_mode():
        eng = _engine(cfg, settings)
        if attention == "paged" and kind in ("cdb", "cb"):
            eng.runner.enable_paged(compile=False)
        rows = _count_launches(eng, counter)
        out = OpCounts(how={"counted_on": "cpu", "width": "tiny (count_config)", "kind": kind,
                            "kv_layout": kv_layout, "criterion": criterion if kind != "cb" else "none",
                            "attention": attention})
        with counter:
            if kind == "prefill":
                _run(eng, ((16, 1), (40, 1), (8, 1), (6, 1), (30, 1), (10, 1), (12, 1), (4, 1)), max_tokens=1)
            elif kind == "spec":
                spec_rows = _count_spec(eng, counter)
                # a few decodes at a small batch, so that speculation runs (no prompt waiting), ending
                # one by one (batches of 3, 2, 1)
                _run(eng, ((10, 6), (12, 9), (6, 12)))
            else:
                _run(eng)
    if kind == "prefill":
        out.prefill = Line.fit([(ch, True, ops) for st, _, ch, ops in rows if st is Stage.PREFILL])
        return out
    if kind == "spec":
        by: dict = {}
        for phase, st, n, ops in spec_rows:
            by.setdefault((phase, st), []).append((n, True, ops))
        out.spec = {k: Line.fit(v) for k, v in by.items()}
        return out
    for st in DECODE_STAGES:
        dec = sorted(ops for s, n, ch, ops in rows if s is st and not ch)
        if dec:
            out.decode[st] = max(set(dec), key=dec.count)  # the most common (the rest: a changed table's upload)
        mix = [(ch, n > 0, ops) for s, n, ch, ops in rows if s is st and ch]
        if mix:
            out.mixed[st] = Line.fit(mix)
    return out


def _count_spec(eng, counter: OpCounter) -> list:
    """Each launch of a speculative stage's plan: (phase, stage, items, ops), split where the
    engine writes its trace row (speculative.spec_row, after the launch)."""
    from infer.engine import speculative
    rows: list = []
    orig = speculative.spec_row
    last = [0]

    def row(launch, *a, **k):
        rows.append((launch.phase, launch.stage, len(launch.items), counter.n - last[0]))
        last[0] = counter.n
        return orig(launch, *a, **k)

    def inst(work, dt):
        if dt is None:
            last[0] = counter.n
    eng.on_launch.append(inst)  # (after _count_launches' reset of the counter)
    speculative.spec_row = row  # (restored by count_ops)
    _PATCHES.append((speculative, "spec_row", orig))
    return rows


_PATCHES: list = []
_CACHE: dict[tuple, OpCounts] = {}  # (structure, kind, layout, criterion, attention) -> counts


def count_ops(cfg, kind: str, kv_layout: str, criterion: str = "none", attention: str = "sdpa") -> OpCounts:
    """The op counts of one launch family (`_count`), counted once per structure and settings."""
    crit = criterion if kind in ("cdb", "spec") else "none"
    att = attention if kind in ("cdb", "cb") else "sdpa"
    key = (structure_key(cfg), kind, kv_layout, crit, att)
    if key in _CACHE:
        return _CACHE[key]
    try:
        _CACHE[key] = out = _count(cfg, kind, kv_layout, crit, att)
        return out
    finally:
        while _PATCHES:
            mod, name, orig = _PATCHES.pop()
            setattr(mod, name, orig)


def graphed_dispatches(cfg, kind: str, kv_layout: str, criterion: str = "none") -> dict[str, int]:
    """Host dispatches per launch with CUDA graphs on the paged path (the CUDA default): every aten op
    the host issues for a launch (the metadata upload, the graph's input copy) plus one per replay, the
    most any launch of each kind needed in the counting engine's run (`kind`: "cdb", "cb" or "prefill":
    separate prefill's launches, key `prefill`; keys `<stage>` decode-only, `<stage>_chunks` carrying
    prompt chunks). Graphs are the CPU stand-in
    (infer/engine/graphs.py), captured on first use; its replay counts as the one a CUDA graph is."""
    import weakref

    from infer.engine.graphs import GraphStandIn
    settings = {**_settings(kind, kv_layout, criterion), "attention_backend": "paged"}
    if kind == "prefill":
        settings.update(policy="cdb", prefill="separate", full_depth=True)
    counter = OpCounter()
    most: dict[str, int] = {}
    with torch.inference_mode():
        eng = _engine(cfg, settings)
        r = eng.runner
        r.graphs = graphs = GraphStandIn(weakref.proxy(r))
        r.batch_state.bucketed = True
        replay = paused(counter, graphs.run)

        def run(*a, **k):
            counter.n += 2  # its input copy and the replay (GraphCache.run; the stand-in's own ops are paused)
            return replay(*a, **k)
        graphs.run = run

        def inst(work, dt):
            if dt is None:
                counter.n, counter.active = 0, True
            elif work.stage in DECODE_STAGES or work.stage is Stage.PREFILL:
                key = work.stage.value + ("_chunks" if work.chunks and work.stage is not Stage.PREFILL else "")
                most[key] = max(most.get(key, 0), counter.n)
        eng.on_launch.append(inst)
        with counter:
            _run(eng)
    return most


# ---------------------------------------------------------------------------------- pricing
@dataclass
class Dispatch:
    """What the host pays to issue a launch: `op_us` per eager aten op, `replay_us` per CUDA graph
    replay (module docstring). `graphs`: decode-only launches replay graphs (the CUDA default)."""
    op_us: float = OP_US
    replay_us: float = REPLAY_US
    source: str = "defaults"

    def __post_init__(self):
        for name in ("op_us", "replay_us"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and v >= 0):  # (NaN fails too)
                raise ParamError(name, f"--{name.replace('_', '-')} must be >= 0 (microseconds), got {v!r}")

    @classmethod
    def from_json(cls, path: Path | str, op_us: float | None = None, replay_us: float | None = None) -> Dispatch:
        """The costs of a gpu_check JSON's top-level `dispatch` block; `op_us` / `replay_us` given
        here win. A cost the block holds as null (gpu_check did not measure it) takes the default,
        and `source` says so."""
        data = json.loads(Path(path).read_text())
        d = data.get("dispatch") if isinstance(data, dict) else None
        if not isinstance(d, dict) or "op_us" not in d or "replay_us" not in d:
            raise ParamError("dispatch_json", f"--dispatch-json: {path} has no top-level 'dispatch' block with op_us "
                                              "and replay_us")
        given, notes = {"op_us": op_us, "replay_us": replay_us}, []
        for name, default in (("op_us", OP_US), ("replay_us", REPLAY_US)):
            if given[name] is None:
                v = d[name]
                if v is None:
                    v = default
                    notes.append(f"{name} null there: default {default:g}")
                elif isinstance(v, bool) or not isinstance(v, (int, float)):
                    raise ParamError("dispatch_json", f"--dispatch-json: {path}'s dispatch.{name} must be a number, "
                                                      f"got {v!r}")
                given[name] = float(v)
        return cls(given["op_us"], given["replay_us"], str(path) + (f" ({'; '.join(notes)})" if notes else ""))

    def describe(self) -> dict:
        return {"op_us": self.op_us, "replay_us": self.replay_us, "source": self.source}


class LaunchOps:
    """The op counts one SimRunner reads: its model's structure, layout, the criterion a real
    engine would run (`real_criterion`) and the attention path of an eager decode launch. Each
    family is counted when first asked for (`count_ops`, cached per process)."""

    def __init__(self, cfg, kv_layout: str, criterion: str, attention: str = "sdpa"):
        self.cfg, self.kv_layout, self.attention = cfg, kv_layout, attention
        self.criterion = criterion

    def _get(self, kind: str, criterion: str = "none") -> OpCounts:
        return count_ops(self.cfg, kind, self.kv_layout, criterion, self.attention)

    def launch(self, stage: Stage, items: int, chunks: int, criterion: str) -> float:
        """Eager ops of a launch of `stage` with `items` decode items and `chunks` (a prefill: its prompts)."""
        if stage is Stage.PREFILL:
            return self._get("prefill").prefill(chunks)
        fam = self._get("cb") if stage is Stage.FUSED else self._get("cdb", criterion)
        if chunks:
            return fam.mixed[stage](chunks, items > 0)
        return fam.decode[stage]

    def prime(self, config, criterion: str) -> None:
        """Count now the families an engine with this resolved EngineConfig launches (instead of at
        its first launch of each): the emulated device does it at start-up, so that no request
        waits on a count."""
        if config.policy == "cb":
            self._get("cb")
        else:
            self._get("cdb", criterion)
        if config.prefill == "separate":
            self._get("prefill")
        if config.speculative_tokens:
            self._get("spec", criterion)

    def spec(self, phase: str, stage: Stage, items: int, criterion: str) -> float:
        """Eager ops of one launch of a speculative stage's plan; a (phase, stage) the counting run
        did not meet (every draft exited before verification) is charged as an eager decode launch
        of that stage."""
        line = self._get("spec", criterion).spec.get((phase, stage))
        return line(items) if line is not None else self._get("cdb", criterion).decode[stage]


def real_criterion(cfg, criterion: str) -> str:
    """The exit criterion a real engine would run where the simulator runs its stand-in (SIM_EXITS'
    "learned"): the model's own, else "learned" with a gate head; "none" stays."""
    if criterion == "none":
        return "none"
    if cfg.exit_criterion != "none":
        return cfg.exit_criterion
    return "learned" if cfg.exit_gate else "none"


# ---------------------------------------------------------------------------------- command line
def main(argv: list[str] | None = None) -> None:
    from kv_layouts import DEFAULT_LAYOUT
    from looplm.presets import PAPER_MODELS, PRESETS, paper_config, preset_config
    p = argparse.ArgumentParser(prog="python -m infer.sim.dispatch", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="ouro-1.4b", help="a paper shape, a preset or a checkpoint folder")
    p.add_argument("--kv-layout", default=None, help=f"default: the model's, else {DEFAULT_LAYOUT}")
    p.add_argument("--attention", default="sdpa", choices=("paged", "sdpa"), help="eager decode launches' attention")
    p.add_argument("--json", type=Path, default=None, help="also write the counts here")
    p.add_argument("--graphed", action="store_true",
                   help="host dispatches per launch with CUDA graphs on the paged path (graphed_dispatches) instead")
    a = p.parse_args(argv)
    cfg = (paper_config(a.model) if a.model in PAPER_MODELS else preset_config(a.model) if a.model in PRESETS
           else read_config(Path(a.model)))
    layout = a.kv_layout or cfg.kv_layout or DEFAULT_LAYOUT
    crit = real_criterion(cfg, "learned")
    out = {"model": a.model, "structure": cfg.name, "kv_layout": layout, "criterion": crit}
    if a.graphed:
        out["graphed"] = {"cdb": graphed_dispatches(cfg, "cdb", layout, crit), "cb": graphed_dispatches(cfg, "cb", layout),
                          "prefill": graphed_dispatches(cfg, "prefill", layout)}
        print(json.dumps(out, indent=1))
        if a.json:
            a.json.write_text(json.dumps(out, indent=1))
        return
    for kind in ("cdb", "cb", "prefill"):
        out[kind] = count_ops(cfg, kind, layout, crit, a.attention).describe()
    out["cdb_full_depth"] = count_ops(cfg, "cdb", layout, "none", a.attention).describe()
    print(json.dumps(out, indent=1))
    if a.json:
        a.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    from looplm.cli import run
    run(main)

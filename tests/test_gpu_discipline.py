"""The CUDA discipline, checked on CPU (issue 38): what a GPU run needs and a CPU run would not notice.

Host syncs (infer/engine/host_syncs.py sees them from the ops, on any device): none inside any body a
CUDA graph captures, for every stage x architecture x exit criterion x KV layout x SDPA / paged
attention, and two batches at one graph key run the same ops on the same shapes and buffers; per
stage kind, a core step at full depth and a mixed launch's upload make none, a stage that emits at
most one (its sampled ids). Graph replay (graph_replay.py): the engine-vs-reference grid through a
stand-in for CUDA graphs that traces each key once and poisons every output at the next replay.

Lifetime: a dropped engine frees its KV pool at once. A reference cycle anywhere in it (a bound method
kept on the object it is bound to, a child holding its parent) keeps the pool alive until the cyclic
GC's next pass, which on a GPU means out of memory at the next engine of a benchmark, and later engines
sized from what the earlier ones still hold. The tests turn the cyclic GC off, so only reference
counting can free the pool.
"""
import dataclasses
import functools
import gc
import random
import weakref
from collections import Counter, defaultdict

import pytest
import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from infer import LLM, EngineConfig, LLMEngine, SamplingParams
from infer.engine.host_syncs import HostSyncError, HostSyncs
from infer.engine.runner import ModelRunner
from infer.engine.sequence import Stage
from looplm import tiny_model

import graph_replay
from helpers import ARCHS, MODES_KBIG, engine_settings, fresh_model, grid, model, random_requests, reference, run_staggered, \
    stable_seed


def _pool_refs(eng: LLMEngine) -> list[weakref.ref]:
    """Weak references to the engine's KV pool and per-slot state tensors."""
    r = eng.runner
    held = [v for v in vars(r.layout).values() if isinstance(v, torch.Tensor)] + [r.state]
    assert held and sum(t.numel() for t in held) > 0
    return [weakref.ref(t) for t in held]


def _dropped(refs: list[weakref.ref]) -> list[int]:
    return [i for i, r in enumerate(refs) if r() is not None]


@pytest.fixture
def no_cyclic_gc():
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


SETTINGS = {
    "cdb-refill": engine_settings("refill_k1", "last_exited", False),
    "cb": engine_settings("cb", "shared", False),
    "lookahead-pipeline": engine_settings("norefill", "full_depth", True),
    "separate-prefill": dict(engine_settings("refill_k1", "last_exited", False), prefill="separate"),
    "speculation": dict(engine_settings("refill_k1", "last_exited", False, async_scheduling=False), speculative_tokens=2),
    "swap": dict(engine_settings("refill_k1", "last_exited", False), kv_cache_tokens=64),
}


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_a_dropped_engine_frees_its_pool_without_the_cyclic_gc(arch, name, no_cyclic_gc):
    """Fails on the old runner (stage tables of bound methods, BatchState holding runner.padded) and
    scheduler (its prefill step and Preemption's callbacks were bound methods kept on them)."""
    settings = {"kv_cache_tokens": 512, "max_batch_size": 4, **SETTINGS[name]}
    eng = LLMEngine(model(arch), EngineConfig(**settings))
    for p, n in random_requests(1, n=5, prompt_len=(2, 20), max_new=(2, 8)):
        eng.add_request(p, SamplingParams(max_tokens=n, ignore_eos=True))
    while eng.has_unfinished():
        eng.step()
    refs = _pool_refs(eng)
    del eng
    assert _dropped(refs) == [], f"{name}: the pool outlives its engine (a reference cycle holds it)"


def test_a_dropped_llm_frees_its_pool_without_the_cyclic_gc():
    """The case the issue confirmed: `LLM(...)`, generate, `del llm` with the cyclic GC disabled.
    (Loading leaves cycles of its own, frames of a caught exception in the checkpoint loader: they are
    collected before the GC is turned off; the engine itself must need no collection.)"""
    llm = LLM("checkpoints/ouro-demo", kv_cache_tokens=4096)
    llm.generate(["a looped model"], SamplingParams(max_tokens=4))
    refs = _pool_refs(llm.engine)
    gc.collect()
    gc.disable()
    try:
        del llm
        assert _dropped(refs) == []
    finally:
        gc.enable()


# ---------------------------------------------------------------- host syncs
DETECTED = {  # each kind of host sync the detector must see: (what, the op)
    "tolist": ("read", lambda x: x.tolist()),
    "item": ("read", lambda x: x[0].item()),
    "bool": ("read", lambda x: bool(x[0])),
    "int": ("read", lambda x: int(x[1])),
    "float": ("read", lambda x: float(x[1])),
    "equal": ("read", lambda x: torch.equal(x, x)),
    "index a list": ("read", lambda x: [1, 2, 3][x[1]]),
    "cpu": ("read", lambda x: x.cpu()),
    "nonzero": ("dynamic", lambda x: x.nonzero()),
    "where(cond)": ("dynamic", lambda x: torch.where(x > 1)),
    "boolean mask": ("dynamic", lambda x: x[x > 1]),
    "masked_select": ("dynamic", lambda x: x.masked_select(x > 1)),
    "unique": ("dynamic", lambda x: x.unique()),
    "repeat_interleave": ("dynamic", lambda x: x.repeat_interleave(x)),
    "torch.tensor": ("host_tensor", lambda x: torch.tensor([1, 2])),
    "to(device)": ("transfer", lambda x: x.to("cpu")),
}


@pytest.mark.parametrize("inference", [False, True], ids=["autograd", "inference_mode"])
@pytest.mark.parametrize("name", sorted(DETECTED))
def test_the_detector_sees_every_kind_of_host_sync(name, inference):
    """(Under inference mode, where the engine runs, bool and item dispatch other ops than with autograd.)"""
    kind, op = DETECTED[name]
    with torch.inference_mode(inference):
        _detects(kind, op)


def _detects(kind, op):
    x = torch.arange(4)
    with HostSyncs() as h:
        op(x)
    assert h.counts()[kind] >= 1, h.events
    with pytest.raises(HostSyncError, match=kind), HostSyncs(strict=True):
        op(x)
    with HostSyncs() as h:  # device-side work alone records nothing
        (x * 2 + 1).index_copy_(0, x[:2], x[2:]).sum()
        torch.where(x > 1, x, 0)
        x.repeat_interleave(2)
    assert h.events == []


def _syncs_per_stage(eng: LLMEngine, reqs, **params) -> tuple[dict, Counter]:
    """Run `reqs` and return the host syncs of each engine step by (stage, with prompt chunks), and
    how many steps of each ran. A step runs one stage: its scheduling, launch and postprocess."""
    per, calls, this = defaultdict(Counter), Counter(), []
    eng.on_launch.append(lambda w, dt: this.append((w.stage.value, bool(w.chunks))) if dt is None else None)
    for p, n in reqs:
        eng.add_request(p, SamplingParams(max_tokens=n, ignore_eos=True, **params))
    while eng.has_unfinished():
        this.clear()
        with HostSyncs() as h:
            eng.step()
        if this:
            calls[this[0]] += 1
            per[this[0]].update(h.events)
    return per, calls


SYNC_SETTINGS = {  # name: (engine settings, request params, model extras)
    "full-depth": (dict(engine_settings("refill_k1", "last_exited", False), full_depth=True), {}),
    "adaptive": (engine_settings("refill_k1", "last_exited", False), {}),
    "lookahead-pipeline": (engine_settings("norefill", "shared", True), {}),
    "cb": (engine_settings("cb", "shared", False), {}),
    "separate-prefill": (dict(engine_settings("refill_k1", "last_exited", False), prefill="separate"), {}),
    "chunked": (dict(engine_settings("refill_k1", "last_exited", False), max_num_batched_tokens=8, chunked_prefill=True),
                {}),
    "preloop": (dict(kv_layout="last_exited", exit_criterion="preloop", exit_threshold=0.5), {}),
    "sampled": (engine_settings("refill_k1", "last_exited", False), dict(temperature=0.8, top_k=20)),
}


@functools.lru_cache(maxsize=None)
def gated(arch):
    """A tiny float64 model with both distilled heads (as tests/test_gates.py's)."""
    extra = {"exit_gate": True} if arch == "huginn-tiny" else {}
    teacher = "ouro_gate" if arch == "ouro-tiny" else "learned"
    return tiny_model(arch, dtype=torch.float64, std=0.15, seed=3, lookahead_gate=True, preloop_gate=True,
                      gate_teacher=teacher, **extra)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("name", sorted(SYNC_SETTINGS))
@pytest.mark.parametrize("reentry", [False, True])
def test_host_syncs_per_stage_kind(arch, name, reentry):
    """0 per prelude (preloop: its one read of the depth CDFs), 0 per core step at full depth or under
    preloop (1 otherwise: its exit scores), at most 1 per stage that emits (its sampled ids), with or
    without prompt chunks riding along; never a data-dependent shape, a host-made tensor or a
    transfer outside the one upload. With on-device token re-entry the sampled ids of an emitting
    stage are read in the next step that launches anything but a prelude: a prelude step then reads
    nothing of them, a core or emitting step at most one more (and every emitting stage is read once
    in all). Fails on the old code: 4 x 12 reads at full depth (scores read
    and never used), a pageable torch.tensor per mixed coda, a boolean mask and host tensors per
    prefill. (Not covered: speculation, which runs eagerly and reads per step; a seeded request's own
    generator, which draws on the host row by row; log-probs, one read per row that asks.)"""
    settings, params = SYNC_SETTINGS[name]
    m = gated(arch) if name == "preloop" else model(arch)
    eng = LLMEngine(m, EngineConfig(kv_cache_tokens=512, max_batch_size=4, **{**settings, "async_scheduling": reentry}))
    per, calls = _syncs_per_stage(eng, random_requests(stable_seed("syncs", arch, name), n=5, prompt_len=(2, 20),
                                                       max_new=(2, 8)), **params)
    full = name in ("full-depth", "cb") or name == "preloop"
    budget = {"prelude": int(name == "preloop"), "core": 0 if full else 1, "coda": 1, "fused": 1, "prefill": 1}
    if reentry:  # the previous emitting stage's ids, read one launch late (never in a prelude step)
        budget["core"] += 1
    for (stage, chunked), events in per.items():
        assert set(k for k, _ in events) <= {"read"}, (stage, chunked, events)
        reads = sum(events.values())
        assert reads <= budget[stage] * calls[stage, chunked], (stage, chunked, calls[stage, chunked], events)
    if reentry:  # one read per emitting stage in all, plus the scores
        kinds = Counter()
        for (st, _), n in calls.items():
            kinds[st] += n
        emits = kinds["coda"] + kinds["fused"] + kinds["prefill"]
        scores = kinds["prelude"] if name == "preloop" else 0 if full else kinds["core"]
        assert sum(sum(e.values()) for e in per.values()) <= emits + scores
    if name == "chunked":
        assert any(chunked for _, chunked in calls), "no launch carried prompt chunks"
    if name == "full-depth":  # (with re-entry a core step may read the ids of the coda before it, nothing else)
        assert calls["core", False] >= 8 and sum(per["core", False].values()) <= reentry * calls["coda", False]


# ---------------------------------------------------------------- capture safety
class _Trace(TorchDispatchMode):
    """The ops of one body: (op, each tensor argument's shape and dtype and which persistent buffer it
    lives in, if any). Two batches at one graph key must give the same trace."""
    supports_higher_order_operators = True

    def __init__(self, buffers: dict[int, str]):
        super().__init__()
        self.buffers, self.ops = buffers, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        desc = tuple((tuple(t.shape), t.dtype, self.buffers.get(t.untyped_storage().data_ptr()))
                     for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor))
        self.ops.append((str(func), desc))
        return func(*args, **(kwargs or {}))


def _persistent(r: ModelRunner) -> dict[int, str]:
    """The storages a captured graph may read and write, by name: loop state, criterion memory,
    per-slot metadata, the inverse page table, the KV pool, the weights."""
    named = {"state": r.state, "inj": r.inj, "aux": r.aux, "slot metadata": r.batch_state._flat,
             "page index": r.batch_state.page_index,
             **{f"kv.{k}": v for k, v in vars(r.layout).items() if isinstance(v, torch.Tensor)},
             **{f"param.{k}": v for k, v in r.model.named_parameters()}}
    for k, v in vars(r.layout).items():  # layouts keep their caches in lists too
        if isinstance(v, (list, tuple)):
            named.update({f"kv.{k}.{i}": t for i, t in enumerate(v) if isinstance(t, torch.Tensor)})
    return {t.untyped_storage().data_ptr(): n for n, t in named.items() if t is not None}


CRITERIA = ["ouro_gate", "learned", "lookahead_gate", "preloop", "kl", "latent_diff", "entropy_diff", "none"]
THRESHOLDS = {"ouro_gate": 0.55, "learned": 0.55, "lookahead_gate": 0.55, "preloop": 0.5, "kl": 1e-2,
              "latent_diff": 0.3, "entropy_diff": 1e-2}
CAPTURE_LAYOUTS = ("last_exited", "shared", "first_then_shared")
# every arch x criterion x layout through the SDPA gather; paged attention (eager FlexAttention, ~4x
# slower on CPU) for every arch x criterion on one layout each, in turn
CAPTURE_CASES = [(a, c, lay, False) for a in ARCHS for c in CRITERIA for lay in CAPTURE_LAYOUTS] + \
                [(a, c, CAPTURE_LAYOUTS[i % 3], True) for a in ARCHS for i, c in enumerate(CRITERIA)] + \
                [(a, "none", "full_depth", paged) for a in ARCHS for paged in (False, True)] + \
                [(a, "cb", lay, paged) for a in ARCHS for paged in (False, True) for lay in ("last_exited", "shared")]


@pytest.mark.parametrize("arch,criterion,layout,paged", CAPTURE_CASES)
def test_captured_bodies_are_capture_safe_and_static(arch, criterion, layout, paged):
    """Every decode body a CUDA graph captures (prelude, core step, coda; CB's fused iteration) runs
    with host syncs forbidden, and every two calls at one graph key (stage, padded batch, context
    blocks, r_max) run the same ops on the same shapes, reading and writing the same persistent
    buffers: what a replay needs to be the captured run. Bodies run as captured ones do on CUDA:
    contexts bucketed, prompts in separate prefill launches (the fused body over token slots, which
    runs eagerly on the SDPA path and as a graph on the paged one); tests/test_gpu_run.py and the
    graph stand-in's tests below cover launches with prompt chunks riding along."""
    mode = dict(policy="cb") if criterion == "cb" else dict(policy="cdb", refill=True, min_coda_batch=1)
    crit = {} if criterion == "cb" else dict(full_depth=True) if criterion == "none" else \
        dict(exit_criterion=criterion, exit_threshold=THRESHOLDS[criterion])
    eng = LLMEngine(gated(arch), EngineConfig(kv_cache_tokens=512, max_batch_size=4, kv_layout=layout,
                                              prefill="separate", **mode, **crit))
    r = eng.runner
    r.batch_state.bucketed = True
    if paged:
        r.enable_paged(compile=False)
    buffers, traces, calls = _persistent(r), defaultdict(set), Counter()

    def body(stage, inp, nb, r_max=0):  # (on the paged path separate prefill's launches too: fused, at r_max)
        with HostSyncs(strict=True), _Trace(buffers) as t:
            out = ModelRunner.body(r, stage, inp, nb, r_max)
        key = stage, inp.shape[0], nb, r_max
        traces[key].add(tuple(t.ops))
        calls[key] += 1
        return out

    r.body = body
    run_staggered(eng, random_requests(stable_seed("capture", arch, criterion, layout), n=5, prompt_len=(2, 20),
                                       max_new=(2, 8)), 1)
    stages = {k[0] for k in traces}
    want = {Stage.FUSED} if criterion == "cb" else {Stage.PRELUDE, Stage.CORE, Stage.CODA} | ({Stage.FUSED} if paged else set())
    assert stages == want, stages
    assert sum(len(v) == 1 for v in traces.values()) == len(traces), \
        [k for k, v in traces.items() if len(v) > 1]
    assert max(calls.values()) >= 4  # keys met again with other batch contents: the comparison is real


def test_the_capture_check_fails_on_a_sync_in_a_body(monkeypatch):
    """The check above can fail: a core body that branches on its scores on the host raises."""
    def branching(self, slots, batch, r_max, chunks=None):
        scores = core(self, slots, batch, r_max, chunks)
        return scores * 0 if bool((scores > 2).any()) else scores  # a host read of a device value
    core = ModelRunner._core_body
    monkeypatch.setattr(ModelRunner, "_core_body", branching)
    with pytest.raises(HostSyncError, match="read"):
        test_captured_bodies_are_capture_safe_and_static("ouro-tiny", "ouro_gate", "last_exited", False)


# ---------------------------------------------------------------- graph replay
# every (mode, layout, lookahead) of the grid once, the two archs in turn (tracing a key costs ~0.1 s)
REPLAY_CASES = [(ARCHS[i % 2], *c) for i, c in enumerate(grid(MODES_KBIG))]


@pytest.mark.parametrize("arch,mode,layout,lookahead", REPLAY_CASES)
def test_engine_equals_reference_through_graph_replay(arch, mode, layout, lookahead):
    """tests/test_engine.py's grid with every decode launch a replay of a graph traced once per key
    (graph_replay.py): tokens, exit depths and log-probs equal the reference decoder's, so nothing a
    body decides on the host, and no output read after the next replay, changes the result. Batch 3
    (padded to 4) or 8 in turn; the pipelined core path with lookahead."""
    seed = stable_seed("replay", arch, mode, layout, lookahead)
    max_batch = (3, 8)[seed % 2]
    full = mode == "cb" or layout == "full_depth"
    refs = reference(arch, layout, lookahead, full, seed % 4)
    cfg = EngineConfig(max_batch_size=max_batch, max_num_batched_tokens=16, kv_cache_tokens=512,
                       **engine_settings(mode, layout, lookahead))
    eng = LLMEngine(model(arch), cfg)
    graphs = graph_replay.install(eng)
    seqs = run_staggered(eng, random_requests(seed % 4), seed, join=0.3)
    for i, (s, r) in enumerate(zip(seqs, refs)):
        assert s.output_ids == r.token_ids and s.exit_depths == r.exit_depths, f"seed {seed}, request {i}"
        assert max(abs(a - b) for a, b in zip(s.logprobs, r.logprobs)) < 1e-10, f"seed {seed}, request {i}"
    assert eng.blocks.all_free and graphs.replays > len(graphs.graphs) > 0


# launches that carry prompt chunks replay graphs on the paged path (mixed.py): every mode once, the two
# archs and two depth-indexed layouts in turn (chunked prefill needs one), lookahead on the refill modes
MIXED_REPLAY = [("ouro-tiny", "cb", "last_exited", False), ("huginn-tiny", "norefill", "full_depth", False),
                ("ouro-tiny", "refill_k1", "full_depth", True), ("huginn-tiny", "refill_k4", "last_exited", True)]


@pytest.mark.parametrize("arch,mode,layout,lookahead", MIXED_REPLAY)
def test_launches_with_prompt_chunks_replay_graphs_and_equal_reference(arch, mode, layout, lookahead):
    """On the paged path every launch replays a graph, those carrying prompt chunks too: each chunk
    position an item in a token slot, the launch padded on the graph ladder past max_batch_size.
    With a budget of 8 tokens, prompts up to 18 tokens ride in chunks beside decode items; the
    tokens, exit depths and log-probs equal the reference decoder's, no launch ran its body eagerly,
    and keys past the decode sizes were replayed. The stand-in (graph_replay.py) checks that nothing
    the bodies decide on the host, and no output read after the next replay, changes the result."""
    seed = stable_seed("mixed-replay", arch, mode, layout, lookahead)
    shape = dict(n=5, prompt_len=(1, 18), max_new=(1, 6))
    full = mode == "cb" or layout == "full_depth"
    refs = reference(arch, layout, lookahead, full, seed % 4, **shape)
    eng = LLMEngine(fresh_model(arch).requires_grad_(False),
                    EngineConfig(max_batch_size=3, max_num_batched_tokens=8, kv_cache_tokens=512, block_size=4,
                                 attention_backend="paged", **engine_settings(mode, layout, lookahead)))
    graphs = graph_replay.install(eng)
    calls = Counter()
    launch, replay = eng.runner._launch, graphs.run

    def counted_launch(work):  # (instance attributes: the runner's stage methods call self._launch)
        calls["launches"] += 1
        calls["with_chunks"] += bool(work.chunks)
        return launch(work)

    def counted_replay(*a, **k):
        calls["replays"] += 1
        return replay(*a, **k)
    eng.runner._launch, graphs.run = counted_launch, counted_replay
    seqs = run_staggered(eng, random_requests(seed % 4, **shape), seed, join=0.3)
    for i, (s, r) in enumerate(zip(seqs, refs)):
        assert s.output_ids == r.token_ids and s.exit_depths == r.exit_depths, f"seed {seed}, request {i}"
        assert max(abs(a - b) for a, b in zip(s.logprobs, r.logprobs)) < 1e-10, f"seed {seed}, request {i}"
    print(arch, mode, layout, lookahead, dict(calls))
    assert calls["with_chunks"] > 0 and calls["replays"] == calls["launches"], dict(calls)  # no launch ran eagerly
    assert eng.blocks.all_free and len(eng.runner.token_slots.free) == eng.config.max_launch_tokens()
    cap = eng.runner.padded(eng.config.max_batch_size)
    big = [k for k in graphs.graphs if (k[1] // 2 if k[0].reads_tokens else k[1]) > cap]
    assert big and graphs.replays > len(graphs.graphs), sorted(graphs.graphs, key=str)


@pytest.mark.parametrize("arch,criterion", [("ouro-tiny", "preloop"), ("huginn-tiny", "lookahead_gate")])
def test_distilled_heads_equal_reference_through_graph_replay(arch, criterion):
    """The two criteria whose scores leave the prelude (preloop) or decide a step ahead (the
    lookahead head, pipelined), through graph replay."""
    from infer.engine.reference import reference_generate
    from looplm import ExitPolicy
    m, thr = gated(arch), THRESHOLDS[criterion]
    reqs = random_requests(stable_seed("replay-gates", arch), n=6)
    pol = ExitPolicy.from_config(m.cfg, criterion=criterion, threshold=thr)
    refs = [reference_generate(m, p, n, pol, kv_layout="last_exited") for p, n in reqs]
    eng = LLMEngine(m, EngineConfig(max_batch_size=4, kv_cache_tokens=512, exit_criterion=criterion, exit_threshold=thr,
                                    pipeline=criterion == "lookahead_gate"))
    graph_replay.install(eng)
    seqs = run_staggered(eng, reqs, 2, join=0.3)
    for s, r in zip(seqs, refs):
        assert s.output_ids == r.token_ids and s.exit_depths == r.exit_depths
        assert max(abs(a - b) for a, b in zip(s.logprobs, r.logprobs)) < 1e-10


def test_graph_replay_catches_an_output_read_after_the_next_replay(monkeypatch):
    """The emulator can fail: with the pipelined core path keeping a reference to the graph's output
    instead of copying it out (PendingScores without `copy`), the scores it reads one step later are
    the poison of the next replay, and the exits differ from the reference."""
    import infer.engine.runner as runner_mod
    real = runner_mod.PendingScores
    monkeypatch.setattr(runner_mod, "PendingScores", lambda scores, n, copy=False: real(scores, n, False))
    refs = reference("ouro-tiny", "last_exited", True, False, 0)
    eng = LLMEngine(model("ouro-tiny"), EngineConfig(max_batch_size=4, kv_cache_tokens=512,
                                                     **engine_settings("refill_k1", "last_exited", True)))
    graph_replay.install(eng)
    seqs = run_staggered(eng, random_requests(0), 0, join=0.3)
    assert [s.exit_depths for s in seqs] != [r.exit_depths for r in refs]


# ---------------------------------------------------------------- memory model
MEMORY_CASES = [("ouro-1.4b", "ouro_gate", 4096), ("ouro-1.4b", "kl", 4096), ("huginn-3.5b", "learned", 4096),
                ("ouro-1.4b", "ouro_gate", 65536)]


@pytest.mark.parametrize("name,criterion,context", MEMORY_CASES)
def test_the_budget_reserves_the_largest_launch_at_real_shapes(name, criterion, context):
    """On the meta device at the paper models' real shapes, batch 64: the bytes the runner's own decode
    bodies (prelude, core step, coda, CB's fused iteration) allocate at the widest context stay inside
    what the CUDA budget reserves (memory.activation_reserve of memory.launch_peaks), measured op by
    op (memory.LiveBytes). The old profile decoded a one-block context: its reserve is shown to miss
    the SDPA gather (N x context K/V rows per layer: 2 GiB for Ouro-1.4B at 4k, 32 GiB at 64k)."""
    from infer.engine.block_manager import BlockManager
    from infer.engine.memory import _peak, activation_reserve, launch_peaks
    from looplm.io import build_model
    from looplm.presets import paper_config
    cfg = paper_config(name, max_position=context)
    with torch.device("meta"):
        m = build_model(cfg).to(torch.bfloat16).eval()
    dev, B, N = torch.device("meta"), 16, 64
    c = EngineConfig(max_batch_size=N, exit_criterion=criterion, kv_cache_tokens=1 << 20).resolve(cfg, "cpu")
    peaks = launch_peaks(m, c)
    reserve = activation_reserve(peaks)
    r = ModelRunner(m, c.kv_layout, BlockManager(N * context // B, B, N), criterion, max_batch_size=N)
    bodies = {}
    with torch.inference_mode():
        for st in (Stage.PRELUDE, Stage.CORE, Stage.CODA, Stage.FUSED):
            inp = torch.zeros(2 * N if st.reads_tokens else N, dtype=torch.long, device=dev)
            bodies[st.value] = _peak(lambda: r.body(st, inp, context // B, cfg.r_max), dev)
    print(name, criterion, context, "GiB:", {k: round(v / 2**30, 3) for k, v in bodies.items()},
          "reserve", round(reserve / 2**30, 3))
    assert max(bodies.values()) <= peaks["decode"] <= reserve  # the decode profile alone covers every body
    kv = cfg.num_kv_heads * cfg.head_dim * 2 * N * context * 2  # K and V gathered, bf16
    assert bodies["core"] >= kv
    old = launch_peaks(m, dataclasses.replace(c, max_model_len=B))  # the old profile: a one-block context
    assert activation_reserve(old) < bodies["core"]


# ---------------------------------------------------------------- device guards
DEVICE_CALLS = {"synchronize", "current_stream", "Stream", "mem_get_info", "memory_allocated", "max_memory_allocated",
                "reset_peak_memory_stats"}


def test_every_cuda_call_names_its_device():
    """Streams, events, synchronize and the memory statistics default to the *current* CUDA device,
    which is cuda:0 unless someone set it: an engine on `device="cuda:1"` would capture, wait and
    measure on the wrong one. Every such call in the engine, the instruments and gpu_check names its
    device (or its stream, for an event's record). Fails on the old code (graphs.py, runner.py,
    llm_engine.py, speculative.py, the benches, gpu_check). CUDA graph capture runs under
    `torch.cuda.device(runner.device)` (graphs.py); replay keeps the capture's device itself."""
    import ast
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    bad = []
    for path in sorted((root / "infer").rglob("*.py")) + [root / "scripts" / "gpu_check.py"]:
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)) or node.args or node.keywords:
                continue
            f = node.func
            if (f.attr in DEVICE_CALLS and ast.unparse(f.value) == "torch.cuda") or f.attr == "record":
                bad.append(f"{path.relative_to(root)}:{node.lineno} {ast.unparse(node)}")
    assert bad == []


# ---------------------------------------------------------------- capture at start-up
@pytest.mark.parametrize("arch,mode", [("ouro-tiny", "refill_k1"), ("huginn-tiny", "norefill"), ("ouro-tiny", "cb")])
def test_start_up_capture_covers_every_key_serving_meets(arch, mode):
    """The keys LLMEngine captures at start-up under CUDA graphs (ModelRunner.graph_keys) are every
    key serving then replays: after capturing them (through graph replay, on CPU), random load with
    every prompt length up to the context captures nothing more, and the outputs stay exact."""
    m = fresh_model(arch, max_position=64)
    eng = LLMEngine(m, EngineConfig(max_batch_size=3, kv_cache_tokens=512, block_size=8,
                                    **engine_settings(mode, "last_exited", mode == "norefill")))
    graphs = graph_replay.install(eng)
    keys = eng.runner.graph_keys(mode == "cb", m.cfg.r_max)
    done = graphs.capture(keys)
    assert done["captured"] == len(keys) == len(set(keys))
    print(arch, mode, "keys:", len(keys), "capture seconds:", round(done["seconds"], 2))
    rng = random.Random(stable_seed("startup", arch, mode))
    for _ in range(8):
        p = [rng.randrange(1, 256) for _ in range(rng.choice([1, 5, 20, 40, 55]))]
        eng.add_request(p, SamplingParams(max_tokens=rng.randint(1, 63 - len(p)), ignore_eos=True))
    while eng.has_unfinished():
        eng.step()
    assert set(graphs.graphs) == set(keys), sorted(set(graphs.graphs) - set(keys), key=str)


# ---------------------------------------------------------------- bench timing
def test_timed_bench_passes_run_untraced():
    """On CUDA every traced stage ends in a synchronize (LLMEngine._count), so the bench's timed
    passes run untraced and take their stage statistics from a traced pass of the same requests
    (infer.bench.offline.untraced_timing): an untraced pass records no trace row, and the merged
    record is the traced pass's with the untraced seconds."""
    from infer.bench.offline import make_engine, run_engine, untraced_timing
    from infer.sim.workloads import Request
    mode = {"name": "cdb_refill_k1", "policy": "cdb", "refill": True, "min_coda_batch": 1}
    eng = make_engine(model("ouro-tiny"), None, mode, dict(kv_cache_tokens=512, max_batch_size=4, exit_threshold=0.55))
    reqs = [Request(p, n, len(p), n) for p, n in random_requests(5, n=4)]
    traced = run_engine(eng, mode, reqs)
    timed = run_engine(eng, mode, reqs, traced=False)
    assert timed["steps"] == 0 and eng.trace == [] and traced["steps"] > 0
    merged = untraced_timing(traced, timed)
    assert merged["seconds"] == timed["seconds"] and merged["stages"] == traced["stages"]
    assert merged["work"] == traced["work"] and merged["exit_depths"] == timed["exit_depths"]

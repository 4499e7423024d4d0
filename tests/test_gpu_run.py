"""The first GPU run's defects, checked on CPU (issue 62; the gpu_check side is tests/test_gpu_check.py).

1. No autograd at start-up: every entry point (LLM, LLMEngine, the server's and the bench's
   make_engine) builds its engine, with the graph stand-in capturing every key at construction as
   CUDA graphs do, from a model whose weights still require grad; no runner buffer, KV tensor or
   graph output may then hold a grad_fn. On the old code the captures ran with autograd on, and
   each chained every saved activation to runner.state through index_copy_.
2. torch 2.11's torch.compile has neither `recompile_limit=` nor `isolate_recompiles=`.
4. Graphs are captured largest key first (one shared pool: smallest first grows it to ~2x).
7. The capture runs on a stream of the engine's own device.
8. Paged attention is the CUDA default (`attention_backend`), accepted by every entry point, and the
   float64 equality grid holds with it (eager FlexAttention on CPU).
"""
import argparse
import inspect
import weakref

import pytest
import torch

from infer import LLM, EngineConfig, LLMEngine, SamplingParams
from infer.engine import graphs as graph_mod
from infer.engine import stages
from infer.engine.graphs import GraphCache, GraphStandIn, autograd_leaks, use_stand_in
from infer.engine.sequence import Stage

from helpers import ARCHS, MODES_AUTO, engine_settings, fresh_model, grid, model, random_requests, reference, \
    run_staggered, stable_seed

SMALL = dict(kv_cache_tokens=128, max_batch_size=2, block_size=16, max_num_batched_tokens=32)


def _serve(eng_or_llm, n=3) -> None:
    """A few requests through it, so that replays (not only captures) have run."""
    eng = getattr(eng_or_llm, "engine", eng_or_llm)
    for p, k in random_requests(7, n=n, prompt_len=(2, 9), max_new=(2, 5)):
        eng.add_request(p, SamplingParams(max_tokens=k, ignore_eos=True))
    while eng.has_unfinished():
        eng.step()


def _check_clean(eng: LLMEngine) -> None:
    g = eng.runner.graphs
    assert isinstance(g, GraphStandIn) and eng.graph_capture["captured"] == len(g.graphs) > 0
    assert autograd_leaks(eng.runner) == []
    _serve(eng)
    assert g.replays > 0 and autograd_leaks(eng.runner) == []


def _trainable(arch="ouro-tiny"):
    m = fresh_model(arch)
    assert all(p.requires_grad for p in m.parameters())  # what a model fresh from training looks like
    return m


# ---------------------------------------------------------------- 1. no autograd, per entry point
@pytest.mark.parametrize("arch", ARCHS)
def test_llm_engine_captures_without_autograd(arch):
    """LLMEngine on a model whose weights require grad (LLMEngine does not freeze it: the graph cache's
    inference mode alone must keep every capture free of autograd)."""
    with use_stand_in():
        eng = LLMEngine(_trainable(arch), EngineConfig(**SMALL))
    assert all(p.requires_grad for p in eng.model.parameters())
    _check_clean(eng)


def test_llm_freezes_and_captures_without_autograd():
    with use_stand_in():
        llm = LLM(_trainable(), **SMALL)
    assert not any(p.requires_grad for p in llm.model.parameters())  # load_model freezes, as vLLM's loaders
    _check_clean(llm.engine)


def test_loaders_freeze_the_weights():
    from infer.engine.llm import load_model
    from looplm import dummy_model, paper_config
    for name in ("ouro-tiny", "checkpoints/ouro-demo"):
        m, _ = load_model(name)
        assert not any(p.requires_grad for p in m.parameters()), name
    m = dummy_model(paper_config("ouro-1.4b"), torch.bfloat16, "meta")
    assert not any(p.requires_grad for p in m.parameters())


def test_server_make_engine_captures_without_autograd(monkeypatch):
    """The server's builder (infer/serving/cli.py make_engine), its model loaded from a preset with the
    loader's freezing undone: the capture alone must keep autograd out."""
    from infer.serving import cli
    real = cli.load_model
    monkeypatch.setattr(cli, "load_model", lambda *a, **k: (lambda mt: (mt[0].requires_grad_(True), mt[1]))(real(*a, **k)))
    a = cli.parser().parse_args(["--model", "ouro-tiny", "--kv-cache-tokens", "128", "--max-batch-size", "2"])
    with use_stand_in():
        eng = cli.make_engine(a)
    assert all(p.requires_grad for p in eng.model.parameters())
    _check_clean(eng)


def test_bench_make_engine_captures_without_autograd():
    from infer.bench.offline import make_engine
    with use_stand_in():
        eng = make_engine(_trainable("huginn-tiny"), None, {"name": "cdb", "policy": "cdb", "refill": True,
                                                             "min_coda_batch": 1}, SMALL)
    _check_clean(eng)


def test_the_autograd_check_fails_on_a_capture_with_autograd(monkeypatch):
    """The old capture (no inference mode around the warm-up and the captured body) leaves the runner's
    state with a grad_fn, and the check names it."""
    monkeypatch.setattr(GraphCache, "_captured", lambda self, key: self._capture(key))
    with use_stand_in():
        eng = LLMEngine(_trainable(), EngineConfig(**SMALL))
    leaks = autograd_leaks(eng.runner)
    assert "runner.state: grad_fn IndexCopyBackward0" in leaks, leaks


# ---------------------------------------------------------------- 2. torch 2.11's torch.compile
def _compile_211(model=None, *, fullgraph=False, dynamic=None, backend="inductor", mode=None, options=None,
                 disable=False):
    """torch 2.11's torch.compile signature (torch/__init__.py), recording what it was given."""
    _compile_211.calls.append(dict(fullgraph=fullgraph, dynamic=dynamic, backend=backend))
    return model


def test_compile_paged_flex_on_torch_2_11_signature(monkeypatch):
    """2.11's torch.compile takes no recompile_limit / isolate_recompiles (the old call raised
    TypeError there): the limit goes to Dynamo's process-wide config instead, raised by this runner's
    shapes on top of what is there."""
    _compile_211.calls = []
    monkeypatch.setattr(torch, "compile", _compile_211)
    cfg = torch._dynamo.config
    with cfg.patch(recompile_limit=8, accumulated_recompile_limit=256):  # (restored on exit)
        flex = stages.compile_paged_flex(12, backend="eager")
        assert flex is not None and _compile_211.calls == [dict(fullgraph=True, dynamic=False, backend="eager")]
        assert cfg.recompile_limit == 20
        stages.compile_paged_flex(300, backend="eager")  # a second runner's shapes come on top
        assert cfg.recompile_limit == 320 and cfg.accumulated_recompile_limit == 320


def test_compile_paged_flex_uses_the_keywords_where_torch_has_them(monkeypatch):
    seen = {}

    def compile_213(model=None, *, fullgraph=False, dynamic=None, backend="inductor", mode=None, options=None,
                    disable=False, recompile_limit=None, isolate_recompiles=False):
        seen.update(recompile_limit=recompile_limit, isolate_recompiles=isolate_recompiles)
        return model
    monkeypatch.setattr(torch, "compile", compile_213)
    before = torch._dynamo.config.recompile_limit
    stages.compile_paged_flex(12, backend="eager")
    assert seen == {"recompile_limit": 12, "isolate_recompiles": True}
    assert torch._dynamo.config.recompile_limit == before  # the process-wide limit is left alone


def test_this_torch_takes_what_compile_paged_flex_passes():
    """On the installed torch, the keywords compile_paged_flex passes are in torch.compile's signature."""
    accepted = inspect.signature(torch.compile).parameters
    assert set(stages._recompile_options(4)) <= set(accepted)


# ---------------------------------------------------------------- 4, 7. capture order and stream
class _FakeCuda:
    """torch.cuda's capture API, recorded (no CUDA here): which stream each capture used, on which
    device, and whether autograd was off while the body ran."""

    def __init__(self):
        self.streams, self.captures, self.bodies = [], [], []
        fake = self

        class Stream:
            def __init__(self, device=None):
                self.device = torch.device(device) if device is not None else None
                fake.streams.append(self)

            def wait_stream(self, other):
                pass

        class CUDAGraph:
            def pool(self):
                return ("pool",)

            def replay(self):
                pass

        class graph:
            def __init__(self, g, pool=None, stream=None, **kw):
                fake.captures.append({"stream": stream, "pool": pool})

            def __enter__(self):
                return self

            def __exit__(self, *a):
                return False

        class _ctx:
            def __init__(self, *a, **k):
                pass

            def __enter__(self):
                return self

            def __exit__(self, *a):
                return False

        self.Stream, self.CUDAGraph, self.graph, self.device, self.stream = Stream, CUDAGraph, graph, _ctx, _ctx
        self.current_stream = lambda device=None: Stream(device)


class _Runner:
    device = torch.device("cuda", 1)
    scratch_slot = 3

    def __init__(self, fake):
        self.fake = fake

    def body(self, stage, slots, nb, r_max):
        self.fake.bodies.append(((stage, slots.shape[0], nb), torch.is_inference_mode_enabled()))
        return torch.zeros(slots.shape[0], requires_grad=False)


def test_capture_largest_key_first_in_inference_mode_on_the_engines_stream(monkeypatch):
    fake = _FakeCuda()
    for name in ("Stream", "CUDAGraph", "graph", "device", "stream", "current_stream"):
        monkeypatch.setattr(torch.cuda, name, getattr(fake, name))
    monkeypatch.setattr(torch, "full", lambda size, v, **kw: torch.zeros(size, dtype=torch.long))  # (no cuda:1 tensor)
    runner = _Runner(fake)
    cache = GraphCache(runner)
    keys = [(Stage.CORE, n, nb, 0) for n in (1, 2, 4) for nb in (1, 4)] + [(Stage.CODA, 4, 1, 0)]
    cache.capture(keys)
    captured = [k for k, _ in fake.bodies[2::3]]  # warm-up, warm-up, capture per key
    sizes = [(n, nb) for _, n, nb in captured]
    assert sizes == sorted(sizes, reverse=True) and sizes[0] == (4, 4)
    assert all(inference for _, inference in fake.bodies)
    streams = {id(c["stream"]) for c in fake.captures}
    assert len(streams) == 1 and fake.captures[0]["stream"].device == torch.device("cuda", 1)
    with torch.inference_mode():  # (as ModelRunner.run calls it)
        cache.run(Stage.PRELUDE, torch.zeros(8, dtype=torch.long), 1)  # a key met later: captured the same way
    assert fake.bodies[-1][1] and fake.captures[-1]["stream"] is fake.captures[0]["stream"]


def test_the_stand_in_captures_largest_first_too():
    with use_stand_in():
        eng = LLMEngine(model("ouro-tiny"), EngineConfig(**SMALL))
    sizes = [(k[1] // (2 if k[0].reads_tokens else 1), k[2]) for k in eng.runner.graphs.graphs]
    assert sizes == sorted(sizes, reverse=True)


# ---------------------------------------------------------------- 8. attention_backend
def test_attention_backend_resolves_to_paged_on_cuda():
    cfg = model("ouro-tiny").cfg
    assert EngineConfig().resolve(cfg, "cuda").attention_backend == "paged"
    assert EngineConfig().resolve(cfg, "cpu").attention_backend == "sdpa"
    assert EngineConfig(attention_backend="sdpa").resolve(cfg, "cuda").attention_backend == "sdpa"
    with pytest.raises(ValueError, match="attention_backend"):
        EngineConfig(attention_backend="flash")


def test_attention_backend_through_every_entry_point():
    from infer.bench.offline import parser as bench_parser
    from infer.serving import cli
    llm = LLM("ouro-tiny", attention_backend="paged", **SMALL)
    assert llm.config.attention_backend == "paged" and llm.engine.runner.batch_state.paged
    assert LLM("ouro-tiny", **SMALL).engine.runner.batch_state.paged is False
    a = cli.parser().parse_args(["--model", "ouro-tiny", "--attention-backend", "paged", "--kv-cache-tokens", "128"])
    assert cli.make_engine(a).runner.batch_state.paged
    b = bench_parser().parse_args(["--model", "ouro-tiny", "--attention-backend", "sdpa"])
    assert b.attention_backend == "sdpa"
    with pytest.raises(SystemExit):
        cli.parser().parse_args(["--model", "ouro-tiny", "--attention-backend", "flash"])


def test_attention_backend_in_lm_eval_model_args():
    from eval.lm import engine_settings as lm_settings
    assert lm_settings({"attention_backend": "paged"}) == {"attention_backend": "paged"}


def test_paged_graphs_are_captured_at_start_up():
    """attention_backend="paged" switches the runner before the engine captures: the graphs captured at
    start-up run paged (no recapture, no SDPA graph in the pool)."""
    with use_stand_in():  # (a budget of 8 tokens: few keys of launches with prompt chunks)
        eng = LLMEngine(model("ouro-tiny"), EngineConfig(attention_backend="paged", **{**SMALL, "max_num_batched_tokens": 8}))
    assert eng.runner.batch_state.paged and eng.graph_capture["captured"] > 0
    ops = {n.target for gm, _ in eng.runner.graphs.graphs.values() for n in gm.graph.nodes if n.op == "call_function"}
    assert not any("scaled_dot_product" in str(t) for t in ops), "an SDPA graph was captured"


# every (mode, layout, lookahead) of test_engine.py's grid once, the two archs and batch 3 (padded to
# 4) or 8 in turn (eager FlexAttention costs ~4x the SDPA path on CPU; both archs at every point, and
# batch 1 too, passed once by hand: see docs/results/engine.md, issue 62)
PAGED_CASES = [(ARCHS[i % 2], *c, (3, 8)[(i // 2) % 2]) for i, c in enumerate(grid(MODES_AUTO))]


@pytest.mark.parametrize("arch,mode,layout,lookahead,max_batch", PAGED_CASES)
def test_engine_equals_reference_with_paged_attention(arch, mode, layout, lookahead, max_batch):
    """test_engine.py's float64 equality grid with attention_backend="paged" (eager FlexAttention over
    the block tables): tokens, exit depths and log-probs equal the reference decoder's."""
    seed = stable_seed("paged", arch, mode, layout, lookahead, max_batch)
    full = mode == "cb" or layout == "full_depth"
    refs = reference(arch, layout, lookahead, full, seed % 4)
    pipeline = lookahead and mode != "cb" and max_batch != 3
    cfg = EngineConfig(max_batch_size=max_batch, max_num_batched_tokens=16, kv_cache_tokens=512, attention_backend="paged",
                       **engine_settings(mode, layout, lookahead, pipeline=pipeline))
    eng = LLMEngine(model(arch), cfg)
    assert eng.runner.batch_state.paged
    seqs = run_staggered(eng, random_requests(seed % 4), seed, join=0.3)
    for i, (s, r) in enumerate(zip(seqs, refs)):
        assert s.output_ids == r.token_ids and s.exit_depths == r.exit_depths, f"seed {seed}, request {i}"
        assert max(abs(a - b) for a, b in zip(s.logprobs, r.logprobs)) < 1e-10, f"seed {seed}, request {i}"
    assert eng.blocks.all_free


@pytest.mark.parametrize("arch,policy,attention", [("ouro-tiny", "cb", "sdpa"), ("huginn-tiny", "cdb", "sdpa"),
                                                    ("ouro-tiny", "cdb", "paged")])
def test_the_reserve_counts_the_graphs_static_outputs(arch, policy, attention):
    """memory.graph_output_bytes (in the CUDA reserve) equals the logits buffers the start-up capture
    keeps, one per emitting key (CB's fused, CDB's coda; on the paged path the keys of launches with
    prompt chunks too), with a pool that holds the whole context."""
    from infer.engine.memory import graph_output_bytes
    # (a 48-token context: few context buckets; the stand-in's trace of FlexAttention needs frozen weights)
    m = fresh_model(arch, max_position=48).requires_grad_(False)
    with use_stand_in():
        eng = LLMEngine(m, EngineConfig(policy=policy, max_batch_size=4, kv_cache_tokens=m.cfg.max_position,
                                        max_num_batched_tokens=8, block_size=8, attention_backend=attention))
    kept = sum(out.numel() * out.element_size() for key, (_, out) in eng.runner.graphs.graphs.items()
               if out is not None and key[0].emits)
    assert kept > 0 and graph_output_bytes(eng.config, m.cfg, m.dtype) == kept

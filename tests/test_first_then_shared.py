"""The `first_then_shared[:S]` KV layout (step s -> depth slot min(s, S), exit fill of the skipped
private slots): the float64 reference decoder against an independent sequential recomputation,
its two limits (S = r_max is last_exited, S = 1 is shared), the engine against the reference in
every mode (paged attention and preemption included), the settings it refuses, and its memory."""
import argparse
import functools

import pytest
import torch
import torch.nn.functional as F

from infer import EngineConfig, LLMEngine, SamplingParams
from infer.engine.config import add_engine_args, engine_config_from_args
from infer.engine.reference import reference_generate
from kv_layouts import layout_class, make_layout
from looplm.errors import ParamError

from helpers import ARCHS, MODES, assert_same, engine_settings, exits_vary, grid, model, policy, random_requests, \
    reference, run_staggered, stable_seed, triples

FTS = "first_then_shared"


def explicit_logits(m, prompt, cont, depths, S):
    """Logits before each token of `cont` (the first from the prompt's last position), recomputed
    from the layout's definition, independent of kv_layouts and infer/engine/stages.py: the prompt
    runs depth-major at full depth (at step s every prompt position attends to the prompt's step-s
    K/V); then one position at a time, position p (exit depth depths[i]) attends at core step s to
    its own step-s K/V and, for each earlier position j of exit depth d_j, to the K/V that j left
    in slot k = min(s, S): step min(d_j, k) for k < S (the exit fill when d_j < k), step d_j for
    k = S (its last write, or the fill when d_j < S). Prelude and coda: one slot per position."""
    r_max, P = m.cfg.r_max, len(prompt)
    ids = prompt + cont[:-1]
    T = len(ids)
    d = [r_max] * P + list(depths)
    rope_all = m.rope(torch.arange(T))
    kv: dict = {}  # (stage, layer, step) -> [K, V] each [T, kv_heads, head_dim] (step 0 outside the core)
    cur = {"step": 0, "pos": None}

    def visible(j: int, s: int) -> int:
        return min(d[j], s) if s < S else d[j]

    def store(stage, layer, step, at, k, v):
        key = (stage, layer, step)
        if key not in kv:
            kv[key] = [torch.zeros(T, *k.shape[1:], dtype=k.dtype), torch.zeros(T, *v.shape[1:], dtype=v.dtype)]
        kv[key][0][at], kv[key][1][at] = k, v

    def attend_for(stage, layer):
        def attend(q, k, v):
            s = cur["step"] if stage == "core" else 0
            p = cur["pos"]
            gqa = q.shape[1] != k.shape[1]
            if p is None:  # the prompt, all positions at once, causal over their fresh K/V
                store(stage, layer, s, slice(0, P), k, v)
                y = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                                   v.transpose(0, 1)[None], is_causal=True, enable_gqa=gqa)
                return y[0].transpose(0, 1)
            store(stage, layer, s, p, k[0], v[0])
            ks = [kv[(stage, layer, visible(j, s) if s else 0)][0][j] for j in range(p)] + [k[0]]
            vs = [kv[(stage, layer, visible(j, s) if s else 0)][1][j] for j in range(p)] + [v[0]]
            K, V = torch.stack(ks).transpose(0, 1)[None], torch.stack(vs).transpose(0, 1)[None]
            y = F.scaled_dot_product_attention(q.transpose(0, 1)[None], K, V, enable_gqa=gqa)
            return y[0].transpose(0, 1)
        return attend

    out = []
    with torch.no_grad():
        rope = (rope_all[0][:P], rope_all[1][:P])
        state, inj = m.prelude(torch.tensor(prompt), rope, attend_for)
        for s in range(1, r_max + 1):
            cur["step"] = s
            state = m.core_step(state, inj, rope, attend_for)
        cur["step"] = 0
        out.append(m.head(m.coda(state, rope, attend_for)[-1:])[0])
        for p in range(P, T):
            cur["pos"] = p
            rope = (rope_all[0][p:p + 1], rope_all[1][p:p + 1])
            state, inj = m.prelude(torch.tensor([ids[p]]), rope, attend_for)
            for s in range(1, d[p] + 1):
                cur["step"] = s
                state = m.core_step(state, inj, rope, attend_for)
            cur["step"] = 0
            out.append(m.head(m.coda(state, rope, attend_for))[0])
    return torch.stack(out)


@pytest.mark.parametrize("arch,S,lookahead", [("ouro-tiny", 2, False), ("ouro-tiny", 3, True),
                                               ("huginn-tiny", 2, False), ("huginn-tiny", 3, False)])
def test_reference_equals_explicit_recomputation(arch, S, lookahead):
    m = model(arch)
    prompt = [3, 14, 15, 92, 65, 35]
    g = reference_generate(m, prompt, 14, policy(arch, lookahead), kv_layout=f"{FTS}:{S}")
    dec = g.exit_depths[1:]
    # the recomputation is only a test of the layout if tokens reach the shared slot and a token that
    # exited below S is read by a later, deeper one (through the filled slots)
    assert max(dec) >= S and any(a < S and a < b for i, a in enumerate(dec) for b in dec[i + 1:]), dec
    logits = explicit_logits(m, prompt, g.token_ids, dec, S)
    lp = torch.log_softmax(logits.double(), -1).gather(-1, torch.tensor(g.token_ids)[:, None])[:, 0]
    assert (lp - torch.tensor(g.logprobs, dtype=torch.float64)).abs().max() < 1e-10
    assert g.token_ids == logits.argmax(-1).tolist()


def test_explicit_recomputation_tells_the_layouts_apart():
    """The recomputation is sensitive to S: S = 2's tokens and depths scored under S = 3 give other
    log-probs."""
    m = model("ouro-tiny")
    prompt = [3, 14, 15, 92, 65, 35]
    g = reference_generate(m, prompt, 10, policy("ouro-tiny"), kv_layout=FTS)
    dec = g.exit_depths[1:]
    want = torch.tensor(g.logprobs, dtype=torch.float64)
    lp3 = torch.log_softmax(explicit_logits(m, prompt, g.token_ids, dec, 3).double(), -1)
    assert (lp3.gather(-1, torch.tensor(g.token_ids)[:, None])[:, 0] - want).abs().max() > 1e-6


@pytest.mark.parametrize("arch,lookahead", [("ouro-tiny", False), ("huginn-tiny", True)])
def test_limits_equal_last_exited_and_shared(arch, lookahead):
    """S = r_max is last_exited and S = 1 is shared: tokens, exit depths and log-probs, exactly."""
    m, r_max, pol = model(arch), model(arch).cfg.r_max, policy(arch, lookahead)
    for p, n in random_requests(stable_seed(arch, lookahead), n=2, prompt_len=(2, 8), max_new=(8, 10)):
        runs = {lay: reference_generate(m, p, n, pol, kv_layout=lay) for lay in
                ("last_exited", f"{FTS}:{r_max}", "shared", f"{FTS}:1")}
        for a, b in (("last_exited", f"{FTS}:{r_max}"), ("shared", f"{FTS}:1")):
            assert runs[a].token_ids == runs[b].token_ids and runs[a].exit_depths == runs[b].exit_depths
            assert runs[a].logprobs == runs[b].logprobs
        assert exits_vary([(g.token_ids, g.exit_depths, g.logprobs) for g in runs.values()], 2)


def test_fill_copies_the_exit_depth_into_skipped_private_slots():
    m = model("huginn-tiny")  # r_max 6
    lay = make_layout(f"{FTS}:3", m.cfg, 5, torch.float64)
    R = lay.num_rows + 1
    for s in range(3):
        lay.k_core[:, s * R:(s + 1) * R] = float(s + 1)
    lay.on_exit(torch.tensor([0, 1, 2, 3, lay.scratch_row]), torch.tensor([1, 2, 3, 5, 0]))  # last: padding
    k = lay.k_core[0, :, 0, 0].view(3, R)
    assert k[:, 0].tolist() == [1, 1, 1]  # exited at 1: slots 2, 3 hold depth 1
    assert k[:, 1].tolist() == [1, 2, 2]  # exited at 2: slot 3 holds depth 2
    assert k[:, 2].tolist() == k[:, 3].tolist() == k[:, 4].tolist() == [1, 2, 3]  # d >= S: untouched
    steps = torch.arange(1, 7)
    assert lay.depth_slot_of(steps).tolist() == [0, 1, 2, 2, 2, 2]
    assert lay.index("core", steps, torch.full_like(steps, 4)).tolist() == [4, R + 4] + [2 * R + 4] * 4
    assert [layout_class(f"{FTS}:3").fill_depth_slots(m.cfg, d) for d in range(1, 7)] == [2, 1, 0, 0, 0, 0]
    assert [layout_class("last_exited").fill_depth_slots(m.cfg, d) for d in range(1, 7)] == [5, 4, 3, 2, 1, 0]
    assert [layout_class("shared").fill_depth_slots(m.cfg, d) for d in (1, 6)] == [0, 0]


# ------------------------------------------------------------------------------- the engine
# every (mode, lookahead) the engine runs, once; the arch, S (2 or 3) and batch size cycle so that
# each arch meets both S and each of the batch sizes
CASES = [(ARCHS[i % 2], mode, (FTS, f"{FTS}:3")[i // 2 % 2], la, (1, 3, 8)[i % 3])
         for i, (mode, _, la) in enumerate(grid(MODES, layouts=[FTS]))]
SHAPE = dict(n=5, max_new=(1, 7))  # a smaller workload than test_engine.py's


@pytest.mark.parametrize("arch,mode,layout,lookahead,max_batch", CASES)
def test_engine_equals_reference(arch, mode, layout, lookahead, max_batch):
    seed = stable_seed(arch, mode, layout, lookahead, max_batch)
    refs = reference(arch, layout, lookahead, mode == "cb", seed % 4, **SHAPE)
    pipeline = lookahead and mode != "cb" and max_batch != 3
    cfg = EngineConfig(max_batch_size=max_batch, max_num_batched_tokens=16, kv_cache_tokens=512,
                       **engine_settings(mode, layout, lookahead, pipeline=pipeline))
    eng = LLMEngine(model(arch), cfg)
    assert eng.config.chunked_prefill is False and eng.config.enable_prefix_caching is False
    got = triples(run_staggered(eng, random_requests(seed % 4, **SHAPE), seed, join=0.3))
    assert_same([(r.token_ids, r.exit_depths, r.logprobs) for r in refs], got, tol=1e-10)
    assert eng.blocks.all_free
    if mode != "cb":
        assert exits_vary(got, 2)


def test_paged_attention_equals_reference():
    """Decode attention through the block tables (eager FlexAttention) reads depth slot min(s, S)."""
    arch, layout, mode = "ouro-tiny", FTS, dict(policy="cdb", min_coda_batch=2)
    m = model(arch)
    reqs = random_requests(7, n=3, prompt_len=(1, 9), max_new=(4, 8), low=3)
    refs = [reference_generate(m, p, n, policy(arch), kv_layout=layout) for p, n in reqs]
    eng = LLMEngine(m, EngineConfig(kv_layout=layout, exit_threshold=0.55, max_batch_size=3, block_size=4,
                                    kv_cache_tokens=64, **mode))
    eng.runner.enable_paged(compile=False)
    seqs = [eng.add_request(p, SamplingParams(max_tokens=n, ignore_eos=True, logprobs=True)) for p, n in reqs]
    while eng.has_unfinished():
        eng.step()
    assert_same([(r.token_ids, r.exit_depths, r.logprobs) for r in refs], triples(seqs), tol=1e-10)
    assert len({d for s in seqs for d in s.exit_depths}) >= 2


@pytest.mark.parametrize("arch,mode,layout,lookahead", [("ouro-tiny", "refill_k1", FTS, False),
                                                        ("huginn-tiny", "norefill", f"{FTS}:3", True)])
def test_preemption_is_exact(arch, mode, layout, lookahead):
    """A pool of 5 blocks x 4 tokens: requests are swapped out (every depth slot goes to host memory
    and back); outputs equal an ample pool's."""
    seed = stable_seed(arch, mode, layout)
    reqs = random_requests(seed, n=5, prompt_len=(2, 8), max_new=(5, 10))
    base = dict(max_batch_size=8, block_size=4, prefill="separate", **engine_settings(mode, layout, lookahead))
    ample = LLMEngine(model(arch), EngineConfig(kv_cache_tokens=1024, **base))
    small = LLMEngine(model(arch), EngineConfig(kv_cache_tokens=20, watermark=0.0, **base))
    want = triples(run_staggered(ample, reqs, seed))
    got = triples(run_staggered(small, reqs, seed))
    assert small.metrics()["preemptions"] >= 2 and ample.metrics()["preemptions"] == 0
    assert_same(want, got, tol=1e-10)
    assert exits_vary(want, 2) and small.blocks.all_free


# ----------------------------------------------------------------------------- settings, memory
@pytest.mark.parametrize("layout", [FTS, f"{FTS}:3"])
@pytest.mark.parametrize("setting", ["chunked_prefill", "enable_prefix_caching"])
def test_inexact_settings_refused(layout, setting):
    with pytest.raises(ParamError, match=f"{setting}=True is not exact with kv_layout='{layout}'") as e:
        EngineConfig(kv_layout=layout, **{setting: True})
    assert e.value.param == setting and "depth slot that loop steps share" in str(e.value)
    c = EngineConfig(kv_layout=layout).resolve(model("ouro-tiny").cfg)
    assert c.chunked_prefill is False and c.enable_prefix_caching is False


@pytest.mark.parametrize("name", [f"{FTS}:x", f"{FTS}:0", f"{FTS}:", f"{FTS}:-1", f"{FTS}:2.5", f"{FTS}:٣",
                                  f"{FTS}2", "first_then"])
def test_malformed_names_refused(name):
    for call in (lambda: layout_class(name), lambda: EngineConfig(kv_layout=name)):
        with pytest.raises(ParamError) as e:
            call()
        assert e.value.param == "kv_layout" and "\n" not in str(e.value) and repr(name) in str(e.value)


def test_s_above_r_max_refused():
    m = model("ouro-tiny")  # r_max 4
    EngineConfig(kv_layout=f"{FTS}:5")  # the name is well formed; the model decides
    for call in (lambda: layout_class(f"{FTS}:5").depth_slots(m.cfg), lambda: make_layout(f"{FTS}:5", m.cfg, 4),
                 lambda: LLMEngine(m, EngineConfig(kv_layout=f"{FTS}:5", kv_cache_tokens=64))):
        with pytest.raises(ParamError, match="S=5 exceeds the model's r_max=4") as e:
            call()
        assert e.value.param == "kv_layout" and "\n" not in str(e.value)
    assert layout_class(f"{FTS}:4").depth_slots(m.cfg) == 4


def test_cli_accepts_the_suffixed_name():
    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert engine_config_from_args(p.parse_args(["--kv-layout", f"{FTS}:3"])).kv_layout == f"{FTS}:3"
    assert engine_config_from_args(p.parse_args(["--kv-layout", "shared"])).kv_layout == "shared"
    assert FTS in p.format_help() and "last_exited" in p.format_help()
    for bad in (f"{FTS}:x", "paged"):
        with pytest.raises(SystemExit):
            p.parse_args(["--kv-layout", bad])


def test_one_class_per_s():
    assert layout_class(FTS) is layout_class(f"{FTS}:2")
    assert layout_class(f"{FTS}:3") is layout_class(f"{FTS}:3") is not layout_class(FTS)
    assert layout_class(f"{FTS}:3").name == f"{FTS}:3" and layout_class(FTS).name == FTS


@functools.lru_cache(maxsize=None)
def _slot_bytes(arch):
    cfg = model(arch).cfg
    return 2 * cfg.num_kv_heads * cfg.head_dim * 8  # K and V, float64


@pytest.mark.parametrize("arch", ARCHS)
def test_memory_per_token(arch):
    m = model(arch)
    cfg, unit = m.cfg, _slot_bytes(arch)
    plain = cfg.n_prelude + cfg.n_coda
    sizes = {}
    for S in range(1, cfg.r_max + 1):
        name = f"{FTS}:{S}"
        want = (plain + cfg.n_core * S) * unit
        assert layout_class(name).slots_per_row(cfg) == plain + cfg.n_core * S
        assert layout_class(name).bytes_per_row(cfg, torch.float64) == want
        lay = make_layout(name, cfg, 7, torch.float64)
        assert lay.nbytes() == 8 * want  # 7 rows + the scratch row
        eng = LLMEngine(m, EngineConfig(kv_layout=name, kv_cache_tokens=64))
        assert eng.kv_bytes_per_token == eng.memory_metrics()["kv_bytes_per_token"] == want
        assert eng.block_bytes == eng.config.block_size * want
        sizes[S] = want
    bpr = {lay: layout_class(lay).bytes_per_row(cfg, torch.float64) for lay in ("shared", "last_exited", FTS)}
    assert bpr["shared"] == sizes[1] < bpr[FTS] == sizes[2] < bpr["last_exited"] == sizes[cfg.r_max]


def test_simulator_prices_fills_of_skipped_private_slots_only():
    """The simulator's coda calls count the slots on_exit copies: S - d for an exit at d < S, none
    at d >= S (last_exited: r_max - d)."""
    from functools import partial

    from infer.engine.sequence import Stage
    from infer.sim.runner import SimModel, SimRunner
    depths = [4, 1, 3, 2, 4, 1]
    for layout, want in ((FTS, [1, 0, 0, 0, 1]), (f"{FTS}:3", [2, 0, 1, 0, 2]), ("last_exited", [3, 1, 2, 0, 3]),
                         ("shared", [0] * 5)):
        filled = []

        def cost(c):
            if c.stage is Stage.CODA and c.batch:  # decode items (not a prompt's first token)
                filled.append(c.filled)
            return 1e-3
        eng = LLMEngine(SimModel(model("ouro-tiny").cfg), EngineConfig(kv_layout=layout, kv_cache_tokens=64),
                        runner_cls=partial(SimRunner, cost=cost, depths=[depths]))
        eng.add_request([1, 2], SamplingParams(max_tokens=len(depths), ignore_eos=True), request_id="0")
        while eng.has_unfinished():
            eng.step()
        assert eng.output(eng.seqs["0"]).exit_depths == depths
        assert filled == want, layout

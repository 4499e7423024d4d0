"""Paged FlexAttention as the compiled CUDA path needs it (issue 38, item 4), checked on CPU.

What inductor (torch 2.13) asks of the block mask and of the compiled callable, and what the eager CPU
path never notices:
- the mask's query block must suit both FlexAttention lowerings: flex-decoding (fewer than 128
  queries, power-of-two GQA group) keeps only configs whose query block is a multiple of
  BLOCK_M = max(16, next_pow2(queries x group)); the template, configs whose BLOCK_M (16..128) divides it.
  None left: NoValidChoicesError. See stages.paged_q_block for the source lines;
- a tile's block list must name each block once: the kernel reads every listed block, so a block two
  items of the tile share (a cached prefix) listed twice counts its keys twice (the eager path reads
  mask_mod only and cannot see it);
- past its recompile limit Dynamo runs flex_attention uncompiled (dense scores over the whole KV pool)
  with one log line: the runner's compiled callable must cover every shape the engine emits, and fail
  loudly beyond;
- CUDA graphs captured at engine construction hold the gather + SDPA attention: enable_paged must
  capture them again through the paged path.
The eager paged path stays exact (float64, equal to the gather + SDPA path). The last test runs only
with CUDA: the compiled kernels themselves.
"""
import random

import pytest
import torch
from torch._dynamo.exc import FailOnRecompileLimitHit
from torch._inductor.runtime.runtime_utils import next_power_of_2
from torch._inductor.template_heuristics.triton import CUDAConfigHeuristic
from torch.nn.attention.flex_attention import create_mask

from infer import EngineConfig, LLMEngine, SamplingParams
from infer.engine import stages
from infer.engine.stages import PagedContext, paged_attention, paged_mask

import graph_replay
from helpers import assert_same, engine_settings, fresh_model, model, random_requests, reference, run_staggered, \
    triples


def _heuristic_block_ms() -> set[int]:
    """Every BLOCK_M a forward flex-attention template config can have on CUDA (torch's own lists:
    template_heuristics/triton.py, the autotune and exhaustive lists and each GPU's default)."""
    h = CUDAConfigHeuristic()
    ms = {c.block_m for c in h.flex_attn_fwd_autotune_configs + h.exhaustive_flex_attn_fwd_configs}
    for d in (h.h100_default_flex_config, h.a100_default_flex_config, h.sm_100_default_flex_config,
              h.sm_120_default_flex_config):
        ms |= {c.block_m for c in d.values()}
    return ms | {32, 64, 128}  # the defaults of get_flex_attn_fwd_configs when no table entry matches


TEMPLATE_BLOCK_MS = _heuristic_block_ms()


def _decode_block_m(n: int, group: int) -> int:
    """flex-decoding's BLOCK_M for n queries (torch/_inductor/kernel/flex/flex_decoding.py:279-291:
    max(next_power_of_2(Q_LEN * GQA_SHARED_HEADS), 16) on CUDA); a config is kept only if the mask's
    query block is a multiple of it (:330)."""
    return max(next_power_of_2(n * group), 16)


def _takes_flex_decoding(n: int, group: int) -> bool:
    """Whether inductor lowers to flex-decoding (flex_decoding.py:40-96): fewer than 128 queries and a
    power-of-two group (the other conditions hold for the paged path: static batch and heads, a block
    mask broadcast over heads)."""
    return n < 128 and group & (group - 1) == 0


def _tables(n: int, nb: int = 3, B: int = 4, shared: int = 1, seed: int = 0):
    """A paged context of n items, nb blocks each, the first `shared` blocks of every even item one
    cached prefix; positions reach past the prefix. Returns (PagedContext, positions [n], R): R rows
    per depth slot, as a layout's num_blocks * B + 1 (its scratch row)."""
    rng = random.Random(seed)
    num_blocks = shared + n * nb
    free = list(range(num_blocks))
    rng.shuffle(free)
    prefix = [free.pop() for _ in range(shared)]
    page_index = [0] * (num_blocks + 1)
    bt, pos = [], []
    for i in range(n):
        blocks = (prefix if i % 2 == 0 else [free.pop() for _ in range(shared)]) + \
                 [free.pop() for _ in range(nb - shared)]
        for j, b in enumerate(blocks):
            page_index[b] = j  # a shared block sits at the same logical index in every table
        bt.append(blocks)
        pos.append(rng.randrange(shared * B, nb * B))
    return PagedContext(torch.tensor(bt), torch.tensor(page_index), B), torch.tensor(pos), num_blocks * B + 1


def test_query_block_suits_both_flex_lowerings():
    """For every batch a decode launch can run at (1..256 items: the powers of two, and any n without
    power-of-two padding) and GQA groups 1, 2, 3, 4, 8, the mask's query block is one flex-decoding
    keeps a config for (where inductor picks it) and a multiple of every template config's BLOCK_M
    (where it does not, or falls back to it); the queries are not padded."""
    for n in [*range(1, 131), 255, 256]:
        ctx, pos, R = _tables(n, nb=2)
        depth = torch.arange(n) % 2
        for g in (1, 2, 3, 4, 8):
            mask = paged_mask(ctx, pos, depth, 2, R, group=g)
            qb = mask.BLOCK_SIZE[0]
            assert mask.shape[-2] == n, (n, g, mask.shape)
            if _takes_flex_decoding(n, g):
                assert qb % _decode_block_m(n, g) == 0, (n, g, qb)
            assert all(qb % m == 0 for m in TEMPLATE_BLOCK_MS), (n, g, qb, TEMPLATE_BLOCK_MS)


@pytest.mark.parametrize("n,q_block", [(5, None), (40, None), (40, 8), (200, None)])
def test_block_lists_name_each_tiles_pages_once_and_attention_is_exact(n, q_block):
    """Per depth slot and query tile, the mask's block list is exactly the union of the pages its items
    read there, each once (even pages the tile's items share), and covers every (query, key) the
    mask_mod allows; eager paged attention equals attention over each item's own rows (float64, GQA)."""
    torch.manual_seed(n)
    S, H, KV, D = 3, 4, 2, 8
    ctx, pos, R = _tables(n, seed=n)
    ctx.q_block = q_block
    B = ctx.block_size
    depth = torch.randint(0, S, (n,))
    mask = paged_mask(ctx, pos, depth, S, R, group=H // KV)
    QB = mask.BLOCK_SIZE[0]
    num, idx = mask.kv_num_blocks[:, 0], mask.kv_indices[:, 0]  # [S, tiles], [S, tiles, nkv]
    for d in range(S):
        for t in range(num.shape[1]):
            listed = idx[d, t, :num[d, t]].tolist()
            items = [i for i in range(t * QB, min(n, (t + 1) * QB)) if depth[i] == d]
            want = {int(ctx.block_table[i, j]) for i in items for j in range(ctx.block_table.shape[1])
                    if j * B <= pos[i]}
            assert len(listed) == len(set(listed)), f"slot {d} tile {t}: a block listed twice"
            assert set(listed) == want, (d, t)
    allowed = create_mask(mask.mask_mod, S, 1, n, R, device="cpu")[:, 0]  # [S, n, R]
    dense = mask.to_dense()[:, 0].bool()  # [S, tiles, nkv] blocks listed
    listed = dense[:, torch.arange(n) // QB][:, :, torch.arange(R) // B]  # [S, n, R]
    assert not (allowed & ~listed).any(), "the mask_mod allows keys in blocks the kernel never reads"

    q = torch.randn(n, H, D, dtype=torch.float64)
    kc, vc = (torch.randn(S * R, KV, D, dtype=torch.float64) for _ in range(2))
    got = paged_attention(q, kc, vc, depth, S, mask)
    for i in range(n):
        rows = [int(depth[i]) * R + int(ctx.block_table[i, p // B]) * B + p % B for p in range(int(pos[i]) + 1)]
        K, V = kc[rows].transpose(0, 1), vc[rows].transpose(0, 1)  # [KV, L, D]
        want = torch.nn.functional.scaled_dot_product_attention(q[i][:, None], K, V, enable_gqa=True)[:, 0]
        assert torch.allclose(got[i], want, atol=1e-12), i


def _run(eng, reqs):
    seqs = [eng.add_request(p, SamplingParams(max_tokens=n, ignore_eos=True, logprobs=True)) for p, n in reqs]
    while eng.has_unfinished():
        eng.step()
    return triples(seqs)


def test_engine_masks_suit_flex_decoding_at_batch_32_with_gqa(monkeypatch):
    """An engine at up to 32 items on a GQA model (ouro-tiny: 4 query heads on 2 KV heads) builds every
    mask with a query block flex-decoding accepts (batch 16 and 32 met: a 16-item tile fails both), and
    its tokens, exit depths and log-probs equal the gather + SDPA path's (float64)."""
    met = []

    def spy(q, kc, vc, depth, depth_slots, mask, flex=None):
        met.append((q.shape[0], q.shape[1] // kc.shape[1], mask.BLOCK_SIZE[0], mask.shape[-2]))
        return paged_attention(q, kc, vc, depth, depth_slots, mask, flex)

    monkeypatch.setattr(stages, "paged_attention", spy)
    reqs = random_requests(11, n=24, prompt_len=(1, 12), max_new=(2, 5))
    cfg = EngineConfig(max_batch_size=32, kv_cache_tokens=1024, **engine_settings("refill_k1", "last_exited", False))
    want = _run(LLMEngine(model("ouro-tiny"), cfg), reqs)
    eng = LLMEngine(model("ouro-tiny"), cfg)
    eng.runner.enable_paged(compile=False)
    got = _run(eng, reqs)
    assert {n for n, *_ in met} >= {16, 32}, sorted({n for n, *_ in met})
    for n, g, qb, q_len in met:
        assert g == 2 and q_len == n
        if _takes_flex_decoding(n, g):
            assert qb % _decode_block_m(n, g) == 0, (n, g, qb)
        else:  # (a launch carrying prompt chunks: 128 items or more, the template's tiles)
            assert all(qb % m == 0 for m in TEMPLATE_BLOCK_MS), (n, g, qb)
    assert_same(want, got, tol=1e-10)


def test_compiled_flex_raises_at_its_recompile_limit_instead_of_running_eagerly():
    """compile_paged_flex's callable compiles one entry per shape up to its budget, then raises
    (fullgraph) where a plain torch.compile would run flex_attention uncompiled (the eager backend
    keeps this cheap: the limit is Dynamo's, before any backend)."""
    ctx, pos, R = _tables(4)
    flex = stages.compile_paged_flex(2, backend="eager")
    kc = vc = torch.zeros(R, 2, 16)
    for n in (1, 2):  # two shapes: within the budget
        paged_attention(torch.randn(n, 2, 16), kc, vc, torch.zeros(n, dtype=torch.long), 1,
                        paged_mask(PagedContext(ctx.block_table[:n], ctx.page_index, ctx.block_size), pos[:n],
                                   torch.zeros(n, dtype=torch.long), 1, R), flex)
    with pytest.raises(FailOnRecompileLimitHit):
        paged_attention(torch.randn(4, 2, 16), kc, vc, torch.zeros(4, dtype=torch.long), 1,
                        paged_mask(ctx, pos, torch.zeros(4, dtype=torch.long), 1, R), flex)


def test_compiled_paged_engine_stays_within_its_recompile_limit(monkeypatch):
    """A compiled paged engine (Dynamo with the eager backend in place of inductor: the shapes and the
    limit are Dynamo's) meets batches 1..8 at both depth-slot counts (huginn-tiny: prelude and coda
    read one slot, the core r_max) while contexts grow over many blocks, with Dynamo told to fail at
    any recompile limit: it never reaches one, and its tokens equal the gather + SDPA path's."""
    real = torch.compile

    def eager_compile(fn, **kw):
        return real(fn, **{**kw, "backend": "eager"})

    monkeypatch.setattr(torch, "compile", eager_compile)
    monkeypatch.setattr(torch._dynamo.config, "fail_on_recompile_limit_hit", True)
    reqs = random_requests(5, n=12, prompt_len=(1, 14), max_new=(6, 16))
    cfg = EngineConfig(max_batch_size=8, block_size=4, kv_cache_tokens=512,
                       **engine_settings("refill_k1", "last_exited", False))
    want = _run(LLMEngine(model("huginn-tiny"), cfg), reqs)
    eng = LLMEngine(model("huginn-tiny"), cfg)
    eng.runner.enable_paged(compile=True)
    assert eng.runner.batch_state.flex is not None
    assert_same(want, _run(eng, reqs), tol=1e-10)


def _has_flex(gm) -> bool:
    return any("flex_attention" in str(node.target) for node in gm.graph.nodes)


def test_enable_paged_recaptures_the_graphs_captured_before_it():
    """Graphs captured before enable_paged (the engine captures at construction) are captured again
    through the paged path: every graph of the stand-in (graph_replay.py) then holds FlexAttention,
    and the engine replaying them equals the reference decoder."""
    arch, layout, seed = "ouro-tiny", "last_exited", 7
    shape = dict(n=2, prompt_len=(1, 6), max_new=(2, 4))
    # (the stand-in traces with make_fx, which does not keep inference mode's no-grad: weights that
    # require grad would make FlexAttention refuse CPU inputs; CUDA graphs capture in inference mode)
    eng = LLMEngine(fresh_model(arch).requires_grad_(False),
                    EngineConfig(max_batch_size=2, kv_cache_tokens=256,
                                 **engine_settings("refill_k1", layout, False, pipeline=False)))
    graphs = graph_replay.install(eng)
    before = [k for k in eng.runner.graph_keys(False, model(arch).cfg.r_max) if k[0].value == "core" and k[2] == 1]
    assert graphs.capture(before)["captured"] == len(before) == 2
    assert not any(_has_flex(gm) for gm, _ in graphs.graphs.values())
    out = eng.runner.enable_paged(compile=False)
    assert out is not None and out["captured"] == len(before), out
    assert set(graphs.graphs) == set(before) and all(_has_flex(gm) for gm, _ in graphs.graphs.values())
    seqs = run_staggered(eng, random_requests(seed, **shape), seed)
    refs = reference(arch, layout, False, False, seed, **shape)
    for s, r in zip(seqs, refs):
        assert s.output_ids == r.token_ids and s.exit_depths == r.exit_depths
    core = [gm for k, (gm, _) in graphs.graphs.items() if k[0].value == "core"]
    assert len(core) >= 2 and all(_has_flex(gm) for gm in core) and graphs.replays > len(graphs.graphs)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled FlexAttention kernels need CUDA")
def test_compiled_paged_engine_on_cuda_equals_sdpa():
    """The compiled kernels (inductor's flex-decoding) at batches up to 32 with GQA, under CUDA graphs
    captured at construction and again by enable_paged: the tokens of the gather + SDPA path."""
    m = fresh_model("ouro-tiny", dtype=torch.float32).cuda()
    reqs = random_requests(13, n=24, prompt_len=(1, 40), max_new=(4, 12))
    cfg = EngineConfig(max_batch_size=32, kv_cache_tokens=4096, cuda_graphs=True,
                       **engine_settings("refill_k1", "last_exited", False))
    want = _run(LLMEngine(m, cfg), reqs)
    eng = LLMEngine(m, cfg)
    assert eng.runner.enable_paged(compile=True)["captured"] > 0
    got = _run(eng, reqs)
    assert [t for t, *_ in got] == [t for t, *_ in want]

"""The CDB engine against the sequential reference decoder: token for token and depth for depth
(greedy, float64), for every policy x KV layout x lookahead x min coda batch x batch size, with
staggered arrivals; plus invariants under random load and bad input."""
import random

import pytest

from infer import LLM, EngineConfig, LLMEngine, SamplingParams
from looplm import ExitPolicy, tiny_model
from infer.engine.reference import reference_generate

from helpers import ARCHS, MODES_AUTO, THRESHOLD, engine_settings, grid, model, random_load, random_requests, \
    reference, run_staggered, stable_seed

CASES = grid(MODES_AUTO, archs=ARCHS)


@pytest.mark.parametrize("arch,mode,layout,lookahead", CASES)
@pytest.mark.parametrize("max_batch", [1, 3, 8])
def test_engine_equals_reference(arch, mode, layout, lookahead, max_batch):
    seed = stable_seed(arch, mode, layout, lookahead, max_batch)
    full = mode == "cb" or layout == "full_depth"
    refs = reference(arch, layout, lookahead, full, seed % 4)
    # lookahead runs use the pipelined core path (as on CUDA) for two of the three batch sizes
    pipeline = lookahead and mode != "cb" and max_batch != 3
    cfg = EngineConfig(max_batch_size=max_batch, max_num_batched_tokens=16, kv_cache_tokens=512,
                       **engine_settings(mode, layout, lookahead, pipeline=pipeline))
    eng = LLMEngine(model(arch), cfg)
    split = []  # refill_auto: every core step of 2+ items runs as two launches, as auto splits one
    if mode == "refill_auto":  # where padded rows cost (AutoCoda.core_plan)
        eng.scheduler.auto.core_batch = lambda n: split.append(n) or (n + 1) // 2
    outs = [eng.output(s) for s in run_staggered(eng, random_requests(seed % 4), seed, join=0.3, logprobs=False)]
    for i, (o, r) in enumerate(zip(outs, refs)):
        assert o.token_ids == r.token_ids, f"arrival seed {seed}, workload seed {seed % 4}, request {i}"
        assert o.exit_depths == r.exit_depths, f"arrival seed {seed}, workload seed {seed % 4}, request {i}"
    assert eng.blocks.all_free
    assert bool(split) == (mode == "refill_auto" and max_batch > 1)


def test_grid_has_exit_spread():
    """The equality grid is only meaningful if tokens really exit at different depths."""
    depths = [d for r in reference("ouro-tiny", "last_exited", False, False, 0) for d in r.exit_depths[1:]]
    assert len(set(depths)) >= 3
    depths = [d for r in reference("huginn-tiny", "shared", True, False, 1) for d in r.exit_depths[1:]]
    assert len(set(depths)) >= 3


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("seed", range(3))
def test_invariants_random_load(arch, seed):
    """Every request finishes, no KV leaks, depths within [r_min, r_max], FIFO admission; with a
    pool that only fits a few requests at once (admission waits, never deadlocks)."""
    rng = random.Random(seed)
    m = model(arch)
    r_min = rng.randint(1, 2)
    cfg = EngineConfig(policy="cdb", refill=bool(seed % 2), min_coda_batch=rng.choice([1, 2, 5]),
                       kv_layout=rng.choice(["last_exited", "shared"]), max_batch_size=rng.choice([2, 4, 16]),
                       kv_cache_tokens=64, block_size=8, exit_threshold=0.5, r_min=r_min,
                       lookahead=bool(rng.random() < 0.5))
    eng = LLMEngine(m, cfg)
    seqs = random_load(eng, rng, 25, 6)
    assert eng.blocks.all_free
    lo = max(r_min, 2 if cfg.lookahead else 1)
    for s in seqs:
        assert s.exit_depths[0] == m.cfg.r_max
        assert all(lo <= d <= s.policy.r_max for d in s.exit_depths[1:])
    starts = sorted(seqs, key=lambda s: s.first_token_time)
    assert [s.seq_id for s in starts] == sorted(s.seq_id for s in seqs)  # admitted in arrival order


def test_pool_exhaustion_never_deadlocks():
    m = model("ouro-tiny")
    llm = LLM(m, dtype="float64", max_batch_size=8, kv_cache_tokens=32, block_size=4, exit_threshold=0.5)
    outs = llm.generate([[1, 2, 3, 4, 5, 6, 7, 8]] * 10, SamplingParams(max_tokens=20, ignore_eos=True))
    assert all(len(o.token_ids) == 20 for o in outs)
    assert llm.engine.blocks.all_free
    # max_tokens beyond the pool: capped by max_model_len (the pool's 32 tokens), not refused
    out = llm.generate([[1] * 20], SamplingParams(max_tokens=40, ignore_eos=True))[0]
    assert llm.engine.max_model_len == 32 and len(out.token_ids) == 12 and out.finish_reason == "length"


BAD = [
    ([], SamplingParams(), "'prompt' is empty"),
    ([1] * 600, SamplingParams(), "maximum context length is 512 tokens"),
    ([1, 2, 999], SamplingParams(), "token id 999 outside the vocabulary"),
    ([1, -1], SamplingParams(), "token id -1"),
]


@pytest.mark.parametrize("prompt,params,msg", BAD)
def test_bad_prompt_rejected_engine_keeps_serving(prompt, params, msg):
    m = model("ouro-tiny")
    eng = LLMEngine(m, EngineConfig(exit_threshold=THRESHOLD))
    good = eng.add_request([5, 6, 7], SamplingParams(max_tokens=5, ignore_eos=True))
    eng.step()
    with pytest.raises(ValueError, match=msg):
        eng.add_request(prompt, params)
    while eng.has_unfinished():
        eng.step()
    assert len(good.output_ids) == 5 and eng.blocks.all_free


@pytest.mark.parametrize("kw,field", [(dict(max_tokens=0), "max_tokens"), (dict(max_tokens=-3), "max_tokens"),
                                      (dict(temperature=-0.5), "temperature"), (dict(top_p=0.0), "top_p"),
                                      (dict(top_p=1.5), "top_p"), (dict(top_k=-1), "top_k"),
                                      (dict(r_min=3, r_max=2), "r_min")])
def test_bad_sampling_params(kw, field):
    with pytest.raises(ValueError, match=f"invalid sampling parameter {field}"):
        SamplingParams(**kw)


def test_generate_validates_all_before_running():
    llm = LLM(model("ouro-tiny"), dtype="float64")
    with pytest.raises(ValueError, match="prompt 1: .prompt. is empty"):
        llm.generate([[1, 2], []], SamplingParams(max_tokens=3))
    assert not llm.engine.has_unfinished() and llm.engine.blocks.all_free
    outs = llm.generate([[1, 2], [3]], SamplingParams(max_tokens=3, ignore_eos=True))
    assert [len(o.token_ids) for o in outs] == [3, 3]


def test_sampling_seeded_reproducible_and_matches_reference():
    m = model("huginn-tiny")
    sp = SamplingParams(max_tokens=10, temperature=0.8, top_k=50, top_p=0.9, seed=1234, ignore_eos=True)
    llm = LLM(m, dtype="float64", exit_threshold=THRESHOLD)
    a = llm.generate([[4, 5, 6], [9, 9]], sp)
    b = llm.generate([[9, 9], [4, 5, 6]], sp)
    assert a[0].token_ids == b[1].token_ids and a[1].token_ids == b[0].token_ids
    ref = reference_generate(m, [4, 5, 6], 10, ExitPolicy.from_config(m.cfg, threshold=THRESHOLD),
                             temperature=0.8, top_k=50, top_p=0.9, seed=1234)
    assert a[0].token_ids == ref.token_ids and a[0].exit_depths == ref.exit_depths


def test_stop_token_ids_and_per_request_overrides():
    m = model("ouro-tiny")
    llm = LLM(m, dtype="float64", exit_threshold=THRESHOLD)
    free = llm.generate([[4, 5, 6]], SamplingParams(max_tokens=10, ignore_eos=True))[0]
    stop = free.token_ids[3]
    o = llm.generate([[4, 5, 6]], SamplingParams(max_tokens=10, stop_token_ids=[stop], ignore_eos=True))[0]
    assert o.finish_reason == "stop" and o.token_ids == free.token_ids[:free.token_ids.index(stop) + 1]
    deep = llm.generate([[4, 5, 6]], SamplingParams(max_tokens=8, ignore_eos=True, r_min=3))[0]
    assert min(deep.exit_depths) >= 3
    shallow = llm.generate([[4, 5, 6]], SamplingParams(max_tokens=8, ignore_eos=True, r_max=2))[0]
    assert max(shallow.exit_depths[1:]) <= 2


@pytest.mark.parametrize("arch,layout", [("ouro-tiny", "last_exited"), ("huginn-tiny", "shared")])
def test_teacher_forced_logprobs_equal_reference(arch, layout):
    m = model(arch)
    eng = LLMEngine(m, EngineConfig(kv_layout=layout, exit_threshold=THRESHOLD, max_batch_size=4))
    cases = [([1, 2, 3], [9, 8, 7, 6, 5]), ([4], [44, 45]), ([10, 11, 12, 13], [1] * 7)]
    seqs = [eng.add_request(ctx, forced_output=cont) for ctx, cont in cases]
    while eng.has_unfinished():
        eng.step()
    pol = ExitPolicy.from_config(m.cfg, threshold=THRESHOLD)
    for s, (ctx, cont) in zip(seqs, cases):
        ref = reference_generate(m, ctx, len(cont), pol, kv_layout=layout, forced_tokens=cont)
        assert s.output_ids == cont and s.exit_depths == ref.exit_depths
        assert max(abs(a - b) for a, b in zip(s.logprobs, ref.logprobs)) < 1e-10


def test_text_prompts_stop_strings_and_progress(tmp_path):
    from transformers import AutoTokenizer

    from train.tokenizer import save_tokenizer, train_bpe
    text = "the cat sat on the mat and the dog ate the bone while the bird sang a song. " * 5
    save_tokenizer(train_bpe([text] * 10, vocab_size=300), tmp_path / "tok")
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "tok"))
    m = tiny_model("ouro-tiny", vocab_size=len(tok), std=0.3, seed=5)
    llm = LLM(m, tokenizer=tok, exit_threshold=THRESHOLD)
    free = llm.generate("the cat", SamplingParams(max_tokens=16, ignore_eos=True))[0]
    assert free.text == tok.decode(free.token_ids, skip_special_tokens=True) and len(free.text) > 4
    stop = free.text[2:4]
    o = llm.generate(["the cat"], SamplingParams(max_tokens=16, ignore_eos=True, stop=[stop]))[0]
    assert o.finish_reason == "stop" and stop not in o.text and free.text.startswith(o.text)
    assert o.text == free.text[: free.text.find(stop)]
    outs = llm.generate(["the dog"] * 40, SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=True)
    assert len(outs) == 40 and all(o.prompt == "the dog" for o in outs)


@pytest.mark.parametrize("call,param", [
    (lambda e: e.add_request([1, 2], SamplingParams(max_tokens=0)), "max_tokens"),
    (lambda e: e.add_request([], SamplingParams()), "prompt"),
    (lambda e: e.add_request([1], SamplingParams(r_max=9)), "r_max"),
    (lambda e: e.add_request([1], forced_output=[]), "forced_output"),
    (lambda e: EngineConfig(policy="fast"), "policy"),
    (lambda e: EngineConfig(kv_layout="paged"), "kv_layout"),
    (lambda e: EngineConfig(max_batch_size=0), "max_batch_size"),
    (lambda e: LLM(model("ouro-tiny"), dtype="float64", batch=3), "batch"),
])
def test_errors_name_their_parameter(call, param):
    """Bad input raises ParamError (a ValueError) that carries the offending parameter: the server maps
    it to the error's `param` without parsing the message."""
    from looplm.errors import ParamError
    eng = LLMEngine(model("ouro-tiny"), EngineConfig(kv_cache_tokens=64))
    with pytest.raises(ParamError) as e:
        call(eng)
    assert e.value.param == param and isinstance(e.value, ValueError)
    assert not eng.has_unfinished()


def test_cb_runs_each_requested_r_max_in_turn():
    """CB's fused iteration runs one depth; requests asking for a lower r_max form their own groups, and
    the scheduler alternates between groups so none starves (outputs equal the reference)."""
    m = model("ouro-tiny")
    eng = LLMEngine(m, EngineConfig(policy="cb", max_batch_size=4, kv_cache_tokens=256))
    seqs = [eng.add_request([3, 4, 5 + i], SamplingParams(max_tokens=6, ignore_eos=True, r_max=d))
            for i, d in enumerate([4, 2, 4, 3])]
    while eng.has_unfinished():
        eng.step()
    for s in seqs:
        d = s.policy.r_max
        ref = reference_generate(m, s.prompt_ids, 6, ExitPolicy.from_config(m.cfg, r_max=d, full_depth=True))
        assert s.output_ids == ref.token_ids and s.exit_depths == [m.cfg.r_max] + [d] * 5

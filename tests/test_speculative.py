"""Self-speculative decoding (issue 27): with speculation on, greedy outputs (tokens, exit depths,
log-probs within 1e-10) equal the sequential reference decoder's in float64 for every policy x
{last_exited, full_depth} x lookahead x k in {2, 4}, with staggered arrivals, preemption and
prefix caching; the refusals; block accounting under rollback (the scheduler alone, with a runner
that checks what every KV row holds); sampled and opted-out requests decode as without it."""
import itertools
import json
import random
import re

import pytest

from infer import EngineConfig, LLMEngine, SamplingParams
from infer.engine.block_manager import BlockManager
from infer.engine.scheduler import Scheduler
from infer.engine.sequence import Stage
from looplm import ExitPolicy, ParamError, tiny_model

from helpers import ARCHS, MODES, THRESHOLD, ContentRunner, arrive_or_abort, assert_same, check_blocks, \
    engine_settings, exits_vary, fake_postprocess, grid, model, random_load, random_requests, reference, \
    run_staggered, stable_seed, triples

# every (mode, layout, lookahead) the engine runs with a depth-indexed layout, on both models, k = 2 and 4
CASES = [(a, *c, k) for a in ARCHS for c in grid(MODES, layouts=["last_exited", "full_depth"]) for k in (2, 4)]


def spec(eng: LLMEngine) -> dict:
    return eng.speculative_metrics()


@pytest.mark.parametrize("arch,mode,layout,lookahead,k", CASES)
def test_speculation_equals_reference(arch, mode, layout, lookahead, k):
    seed = stable_seed("spec", arch, mode, layout, lookahead, k)
    print("seed", seed)
    full = mode == "cb" or layout == "full_depth"
    want = reference(arch, layout, lookahead, full, seed % 4, max_new=(4, 12))
    draft = 1 + seed % 2  # draft depth 1 or 2 (r_max is 4)
    eng = LLMEngine(model(arch), EngineConfig(max_batch_size=4, max_num_batched_tokens=16, kv_cache_tokens=512,
                                              speculative_tokens=k, draft_depth=draft,
                                              **engine_settings(mode, layout, lookahead, async_scheduling=False)))
    seqs = run_staggered(eng, random_requests(seed % 4, max_new=(4, 12)), seed, join=0.3)
    for i, (s, r) in enumerate(zip(seqs, want)):
        assert s.output_ids == r.token_ids and s.exit_depths == r.exit_depths, f"seed {seed}, request {i}"
        assert max(abs(a - b) for a, b in zip(s.logprobs, r.logprobs)) < 1e-10, f"seed {seed}, request {i}"
    m = spec(eng)
    assert m["verifications"] > 0 and m["drafted"] > 0, m  # speculation really ran
    assert eng.blocks.all_free


def test_speculation_accepts_and_rejects():
    """The grid is only meaningful if drafts are both accepted and rejected, and a chunk gives more
    than one token at times."""
    got = []
    for arch in ARCHS:
        eng = LLMEngine(model(arch), EngineConfig(kv_cache_tokens=512, speculative_tokens=4, draft_depth=2,
                                                  exit_threshold=THRESHOLD))
        run_staggered(eng, random_requests(5, n=4, max_new=(8, 16)), 5)
        got.append(spec(eng))
    assert sum(m["accepted"] for m in got) > 0 and sum(m["drafted"] - m["accepted"] for m in got) > 0, got
    assert max(m["tokens_per_verification"] for m in got) > 1.0, got


@pytest.mark.parametrize("arch,mode,lookahead", [("ouro-tiny", "refill_k1", False), ("huginn-tiny", "cb", False),
                                                 ("huginn-tiny", "norefill", True), ("ouro-tiny", "refill_k4", True)])
def test_speculation_with_preemption_is_exact(arch, mode, lookahead):
    """A pool of 7 blocks x 4 tokens with growth on demand: requests are swapped out and back
    between speculative stages; outputs equal an ample pool's without speculation."""
    seed = stable_seed("spec-swap", arch, mode)
    print("seed", seed)
    reqs = random_requests(seed, n=5, prompt_len=(2, 8), max_new=(6, 12))
    base = dict(max_batch_size=8, block_size=4, prefill="separate", **engine_settings(mode, "last_exited", lookahead, async_scheduling=False))
    want = triples(run_staggered(LLMEngine(model(arch), EngineConfig(kv_cache_tokens=1024, **base)), reqs, seed))
    eng = LLMEngine(model(arch), EngineConfig(kv_cache_tokens=28, watermark=0.0, speculative_tokens=3, **base))
    got = triples(run_staggered(eng, reqs, seed))
    m = eng.metrics()
    assert m["preemptions"] > 0 and m["spec_verifications"] > 0, m
    assert_same(want, got, tol=1e-10)
    assert eng.blocks.all_free and not eng.runner.host_swap


@pytest.mark.parametrize("arch", ARCHS)
def test_speculation_with_prefix_caching_is_exact(arch):
    """Prompts that share a head (prefix-cache hits, mixed prefill) with speculation on equal a run
    with neither."""
    rng = random.Random(11)
    head = [rng.randrange(1, 256) for _ in range(9)]
    reqs = [(head[:rng.randint(4, 9)] + [rng.randrange(1, 256) for _ in range(rng.randint(0, 3))], rng.randint(4, 9))
            for _ in range(6)]
    base = dict(block_size=4, max_num_batched_tokens=12, max_batch_size=4, exit_threshold=THRESHOLD,
                kv_cache_tokens=512)
    want = triples(run_staggered(LLMEngine(model(arch), EngineConfig(enable_prefix_caching=False, **base)), reqs, 3))
    eng = LLMEngine(model(arch), EngineConfig(speculative_tokens=4, **base))
    got = triples(run_staggered(eng, reqs, 3))
    m = eng.metrics()
    assert m["prefix_cache_hits"] > 0 and m["spec_verifications"] > 0, m
    assert_same(want, got, tol=1e-10)
    assert exits_vary(want)


def test_sampled_and_opted_out_requests_are_not_speculated():
    """Sampled rows and requests with speculate=False decode one token per stage, as without
    speculation: the same seeded samples, the same greedy tokens."""
    m = model("ouro-tiny")
    reqs = random_requests(2, n=4, max_new=(6, 10))
    params = [dict(temperature=0.8, seed=7), dict(speculate=False), dict(temperature=1.0, seed=3), dict()]

    def go(k):
        eng = LLMEngine(m, EngineConfig(kv_cache_tokens=512, speculative_tokens=k, exit_threshold=THRESHOLD))
        seqs = [eng.add_request(p, SamplingParams(max_tokens=n, ignore_eos=True, logprobs=True, **kw))
                for (p, n), kw in zip(reqs, params)]
        while eng.has_unfinished():
            eng.step()
        return eng, triples(seqs)

    off, want = go(0)
    on, got = go(4)
    assert_same(want, got, tol=1e-10)
    sp = spec(on)
    assert sp["verifications"] > 0
    # only the one greedy request that did not opt out verified chunks: its tokens, at most
    assert sp["verified_tokens"] <= len(got[3][0]) and sp["drafted"] > 0
    assert spec(off)["stages"] == 0 and off.metrics()["stage_calls"].get("spec") is None


def test_max_tokens_and_stop_tokens_inside_a_chunk():
    """A stop token or max_tokens inside an accepted chunk ends the request there, and the tokens
    after it are dropped (with their blocks)."""
    m = model("huginn-tiny")
    want = reference("huginn-tiny", "last_exited", False, False, 6, n=3, max_new=(7, 12))
    stop = want[0].token_ids[3]  # the request stops at its 4th token
    eng = LLMEngine(m, EngineConfig(kv_cache_tokens=512, speculative_tokens=4, draft_depth=3,
                                    exit_threshold=THRESHOLD))
    seqs = [eng.add_request(p, SamplingParams(max_tokens=n, ignore_eos=True, stop_token_ids=[stop] if i == 0 else []))
            for i, (p, n) in enumerate(random_requests(6, n=3, max_new=(7, 12)))]
    while eng.has_unfinished():
        eng.step()
    first = want[0].token_ids.index(stop) + 1
    assert seqs[0].output_ids == want[0].token_ids[:first] and seqs[0].finish_reason == "stop"
    for s, r in zip(seqs[1:], want[1:]):
        assert s.output_ids == r.token_ids and s.exit_depths == r.exit_depths and s.finish_reason == "length"
    assert spec(eng)["accepted"] > 0 and eng.blocks.all_free


@pytest.mark.parametrize("kw,param", [
    (dict(kv_layout="shared"), "speculative_tokens"),
    (dict(kv_layout="first_then_shared"), "speculative_tokens"),
    (dict(kv_layout="first_then_shared:3"), "speculative_tokens"),
    (dict(exit_criterion="kl"), "speculative_tokens"),
    (dict(exit_criterion="entropy_diff"), "speculative_tokens"),
    (dict(draft_depth=64), "draft_depth"),
    (dict(draft_depth=0), "draft_depth"),
])
def test_refusals(kw, param):
    with pytest.raises(ParamError) as e:
        LLMEngine(model("huginn-tiny"), EngineConfig(kv_cache_tokens=64, speculative_tokens=2, **kw))
    assert e.value.param == param, e.value
    print(e.value)


def test_setting_values_and_defaults():
    for k in (1, -1, 2.5):
        with pytest.raises(ParamError, match="speculative_tokens"):
            EngineConfig(speculative_tokens=k)
    with pytest.raises(ParamError, match="speculate"):
        SamplingParams(speculate="yes")
    m = model("ouro-tiny")
    assert LLMEngine(m, EngineConfig(kv_cache_tokens=64)).config.draft_depth == 1  # resolved even when off
    c = LLMEngine(m, EngineConfig(kv_cache_tokens=64, speculative_tokens=2, r_min=2)).config
    assert c.draft_depth == 2  # the default is r_min
    # full depth makes the criterion irrelevant: kl is refused only where exits are read
    c = LLMEngine(m, EngineConfig(kv_cache_tokens=64, speculative_tokens=2, exit_criterion="kl", policy="cb")).config
    assert c.full_depth and c.speculative_tokens == 2


def test_speculation_only_below_the_batch_threshold():
    """With more sequences decoding than speculative_max_batch no speculative stage runs. (K=1: a
    schedule whose requests finish apart, leaving stragglers; auto's gathered exits may not.)"""
    m = model("ouro-tiny")
    eng = LLMEngine(m, EngineConfig(kv_cache_tokens=512, speculative_tokens=2, speculative_max_batch=2,
                                    exit_threshold=THRESHOLD, trace=True, min_coda_batch=1))
    for p, n in random_requests(4, n=5, max_new=(2, 16)):
        eng.add_request(p, SamplingParams(max_tokens=n, ignore_eos=True))
    while eng.has_unfinished():
        running = eng.scheduler.num_running
        calls = eng.stats["stage_calls"].get("spec", 0)
        eng.step()
        if eng.stats["stage_calls"].get("spec", 0) > calls:
            assert running <= 2
    assert spec(eng)["stages"] > 0  # the stragglers speculated
    phases = {r.get("phase") for r in eng.trace}
    assert phases == {None, "draft", "verify"}
    from infer.sim.work import work_counts
    w = work_counts(eng.trace, m.cfg, 8)
    sp = spec(eng)
    assert sum(w["launches"].values()) == len([r for r in eng.trace])
    assert sp["draft_launches"] + sp["verify_launches"] == len([r for r in eng.trace if r.get("phase")])
    # every core step of the draft and the verification is a traced launch whose scores were read
    spec_core = [r for r in eng.trace if r.get("phase") and r["stage"] == "core"]
    assert {r["phase"] for r in spec_core} == {"draft", "verify"}
    assert eng.metrics()["core_score_reads"] == w["launches"]["core"] == sum(r["stage"] == "core" for r in eng.trace)
    assert sum(r["stage"] == "coda" and r.get("phase") == "verify" for r in eng.trace) == sp["stages"]


# ------------------------------------------------------------------ scheduler alone (pure Python)
@pytest.mark.parametrize("seed", range(4))
def test_scheduler_invariants_with_speculation(seed):
    """Thousands of scheduler steps with speculation (random acceptance), mixed prefill, prefix
    caching, a small pool, preemption, aborts and arrivals: after every step every block is held by
    exactly the tables that count it (no leak, no double ownership), and every KV row an item reads
    holds its own prefix (a rolled-back row is never read before it is rewritten)."""
    rng = random.Random(seed)
    policy, refill = [("cb", False), ("cdb", False), ("cdb", True), ("cdb", True)][seed]
    print("seed", seed, policy, refill)
    tiny = tiny_model("ouro-tiny").cfg
    cfg = EngineConfig(policy=policy, refill=refill, max_batch_size=6, block_size=4, watermark=0.05,
                       max_num_batched_tokens=rng.choice([6, 16]), speculative_tokens=rng.choice([2, 4, 8]),
                       speculative_max_batch=6).resolve(tiny)
    bm = BlockManager(20, 4, cfg.max_batch_size)
    sch = Scheduler(cfg, bm, 64, swap_blocks=rng.choice([6, 64]), r_full=tiny.r_max)
    runner = ContentRunner(bm, random.Random(seed + 100))
    pol = ExitPolicy.from_config(tiny, threshold=0.5)
    heads = [[rng.randrange(3, 256) for _ in range(rng.randint(4, 14))] for _ in range(3)]
    seqs, ids, steps, spec_steps = [], itertools.count(), 0, 0
    prompt = lambda r: r.choice(heads)[:r.randint(1, 14)] + [r.randrange(3, 256) for _ in range(r.randint(0, 6))]  # noqa: E731

    while len(seqs) < 200 or sch.has_work():
        n = len(seqs)
        if (steps // 200) % 2 == 0 and len(sch.waiting) < 3:  # bursts, then quiet spells for speculation
            arrive_or_abort(sch, seqs, rng, 200, prompt, (1, 25), pol, ids)
        for s in seqs[n:]:  # what OutputProcessor.add sets: the length limit
            s.max_out = min(s.params.max_tokens, 64 - len(s.prompt_ids))
        work = sch.schedule()
        runner.swap(sch.take_swaps())
        check_blocks(sch, bm)
        steps += 1
        assert steps < 100000, "deadlock"
        if work is None:
            continue
        out = runner.run(work)
        if work.stage is Stage.SPEC:
            spec_steps += 1
            assert len(work.spec) == len(work.seqs) and max(work.spec) >= 2
            for s, k in zip(work.seqs, work.spec):
                assert len(s.blocks) * bm.block_size >= s.num_tokens - 1 + k  # every chunk position has a row
        fake_postprocess(sch, work, rng, token=lambda r: r.randrange(3, 256), out=out)
        check_blocks(sch, bm)
    assert all(s.finished for s in seqs) and bm.all_free and not runner.host and not sch.swapped
    print(steps, "steps", spec_steps, "speculative", sch.counters)
    assert spec_steps > 20 and sch.counters["preemptions"] > 0


def test_engine_random_load_with_speculation():
    """Random load on the engine itself: every request finishes with max_tokens tokens, depths in
    [r_min, r_max], no KV leak; a small pool preempts between speculative stages."""
    rng = random.Random(4)
    m = model("huginn-tiny")
    eng = LLMEngine(m, EngineConfig(kv_cache_tokens=64, block_size=8, exit_threshold=0.5, r_min=2,
                                    speculative_tokens=4, speculative_max_batch=4))
    seqs = random_load(eng, rng, 20, 8)
    assert all(2 <= d <= s.policy.r_max for s in seqs for d in s.exit_depths[1:])
    assert eng.blocks.all_free and spec(eng)["verifications"] > 0


# ------------------------------------------------------------------ simulator and emulated device
def test_simulator_models_draft_and_verify_launches(tmp_path):
    """The simulator's speculative stage: with every draft accepted a chunk gives k tokens (fewer
    only at a request's end), with none it gives one; its launches are in the trace (work counts),
    and the projection's acceptance can come from a measured JSON."""
    from infer.sim.cost import RooflineCost
    from infer.sim.runner import binomial_depths, depths_from_distribution
    from infer.sim.simulate import load_acceptance, simulate, speculation_projection
    from infer.sim.workloads import make_requests
    from looplm.presets import paper_config
    cfg = paper_config("ouro-1.4b")
    reqs = make_requests("sharegpt", 6, seed=1, scale=1.0, max_model_len=2048, vocab_size=cfg.vocab_size)
    depths = depths_from_distribution(binomial_depths(cfg.r_max, 2.5), reqs, 1)
    cost = RooflineCost(cfg)
    engine = dict(speculative_tokens=4, kv_cache_tokens=200_000)
    hi, lo = (speculation_projection(cfg, reqs, cost, depths, [1, 4], a, engine) for a in (1.0, 0.0))
    for r in hi:
        sp = r["on"]["speculative"]
        assert sp["drafted"] > 0 and sp["rejected"] == 0 and sp["acceptance_rate"] > 0.9
        assert 3.5 < sp["tokens_per_verification"] <= 4 and r["tpot_speedup"] > 1.0, r
        assert r["on"]["work"]["launches"]["core"] > 0
        assert r["off"]["speculative"]["stages"] == 0
    for r in lo:
        assert r["on"]["speculative"]["accepted"] == 0 and r["on"]["speculative"]["tokens_per_verification"] == 1.0
        assert r["tpot_speedup"] < 1.0  # drafts that are never accepted cost time
    # the bench JSON's results carry each mode's speculation counters (simulated here: the same summary)
    blk = simulate(cfg, reqs[:3], cost, depths, [{"name": "cb", "policy": "cb"},
                                                     {"name": "cdb", "policy": "cdb", "refill": True}],
                       workload="sharegpt", speculative_tokens=2, kv_cache_tokens=200_000)
    assert all(r["speculative"]["stages"] > 0 and r["speculative"]["tokens_per_verification"] >= 1
               for r in blk["results"]), blk["results"]
    f = tmp_path / "m.json"
    f.write_text(json.dumps({"results": [{"speculative": {"drafted": 10, "accepted": 6, "rejected": 2,
                                                          "draft_accept_prob": 0.75}}]}))
    assert load_acceptance(str(f)) == 0.75 and load_acceptance("0.4") == 0.4
    with pytest.raises(SystemExit, match="rate"):
        load_acceptance("1.5")


def test_emulated_engine_speculates():
    from infer.sim import emulated as E
    eng = E.emulated_engine("ouro-1.4b", "emulated:h100", {"max_batch_size": 4, "speculative_tokens": 4},
                            mean_depth=2.5)
    eng.runner.acceptance = 0.7
    seqs = [eng.add_request([5, 6, 7], SamplingParams(max_tokens=n), request_id=f"r{i}") for i, n in enumerate((9, 3))]
    while eng.has_unfinished():
        eng.step()
    assert [len(s.output_ids) for s in seqs] == [9, 3] and all(s.finish_reason == "length" for s in seqs)
    sp = spec(eng)
    assert sp["verifications"] > 0 and sp["emitted"] >= 10 and eng.blocks.all_free
    assert all(1 <= d <= 4 for s in seqs for d in s.exit_depths[1:])


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("criterion,threshold", [("lookahead_gate", 0.55), ("preloop", 0.5)])
def test_distilled_gates_with_speculation_equal_reference(arch, criterion, threshold):
    """The distilled lookahead head and the preloop gate (issue 25) under speculation; the preloop
    run reads no exit score during any core step, drafted or verified."""
    import torch

    from infer.engine.reference import reference_generate
    extra = {"exit_gate": True} if arch == "huginn-tiny" else {}
    m = tiny_model(arch, dtype=torch.float64, std=0.15, seed=3, lookahead_gate=True, preloop_gate=True,
                   gate_teacher="ouro_gate" if arch == "ouro-tiny" else "learned", **extra)
    pol = ExitPolicy.from_config(m.cfg, criterion=criterion, threshold=threshold)
    reqs = random_requests(9, n=4, max_new=(4, 12))
    want = [reference_generate(m, p, n, pol, kv_layout="last_exited") for p, n in reqs]
    eng = LLMEngine(m, EngineConfig(max_batch_size=4, kv_cache_tokens=512, exit_criterion=criterion,
                                    exit_threshold=threshold, speculative_tokens=3, draft_depth=2))
    seqs = run_staggered(eng, reqs, 9, join=0.3)
    for s, r in zip(seqs, want):
        assert s.output_ids == r.token_ids and s.exit_depths == r.exit_depths
        assert max(abs(a - b) for a, b in zip(s.logprobs, r.logprobs)) < 1e-10
    assert spec(eng)["verifications"] > 0
    if criterion == "preloop":
        assert eng.metrics()["core_score_reads"] == 0


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory):
    """test_serve's tiny chat model folder (its tokenizer: the routes need text)."""
    from looplm import load_tokenizer, save_pretrained
    from test_serve import NAME, TEXT
    from train.tokenizer import save_tokenizer, train_bpe
    out = tmp_path_factory.mktemp("model") / NAME
    save_tokenizer(train_bpe([TEXT] * 20, vocab_size=300), out)
    save_pretrained(tiny_model("ouro-tiny", vocab_size=300), out, tokenizer=load_tokenizer(out))
    return out


def test_server_streams_the_same_tokens_with_speculation(chat_dir):
    """The OpenAI routes over a speculating engine (completions streamed and not, chat, echo, a
    request that opts out): the same text and tokens as a server without speculation; /metrics
    shows the counters."""
    import httpx

    from test_serve import start
    bodies = [("/v1/completions", {"prompt": "the cat", "max_tokens": 12, "temperature": 0, "ignore_eos": True}),
              ("/v1/completions", {"prompt": "a dog", "max_tokens": 9, "temperature": 0, "ignore_eos": True,
                                   "echo": True, "logprobs": 1}),
              ("/v1/completions", {"prompt": "the cat", "max_tokens": 8, "temperature": 0, "ignore_eos": True,
                                   "speculate": False}),
              ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10,
                                        "temperature": 0})]
    got = {}
    for k in (0, 4):
        srv, _ = start(chat_dir, speculative_tokens=k, kv_cache_tokens=512)
        try:
            outs = []
            for path, body in bodies:
                r = httpx.post(srv.url + path, json=body, timeout=60).json()
                c = r["choices"][0]
                outs.append((c.get("text") or c["message"]["content"], c.get("logprobs") and  # (float32 model)
                             [round(x, 4) for x in c["logprobs"]["token_logprobs"][1:]]))
                with httpx.stream("POST", srv.url + path, json={**body, "stream": True}, timeout=60) as s:
                    chunks = [line for line in s.iter_lines() if line.startswith("data: {")]
                text = "".join((json.loads(x[6:])["choices"][0].get("text") or
                                json.loads(x[6:])["choices"][0].get("delta", {}).get("content") or "") for x in chunks)
                outs.append(text if "echo" not in body else None)
            metrics = httpx.get(srv.url + "/metrics", timeout=10).text
        finally:
            srv.stop()
        got[k] = outs
        spec_count = re.search(r'^cdb_spec_verifications\{[^}]*\} (\S+)', metrics, re.M)
        assert spec_count and (float(spec_count.group(1)) > 0) == bool(k), spec_count
    assert got[0] == got[4]


def test_reserve_kv_keeps_its_blocks_under_speculation():
    """With reserve_kv (prompt + max_tokens reserved at admission, never preempted) the rollback gives
    back only blocks a chunk took beyond them: every table keeps its reservation to the end."""
    m = model("ouro-tiny")
    shape = dict(n=4, max_new=(6, 14))
    want = reference("ouro-tiny", "last_exited", False, False, 3, **shape)
    eng = LLMEngine(m, EngineConfig(kv_cache_tokens=512, block_size=4, reserve_kv=True, speculative_tokens=4,
                                    exit_threshold=THRESHOLD))
    seqs = [eng.add_request(p, SamplingParams(max_tokens=n, ignore_eos=True)) for p, n in random_requests(3, **shape)]
    while eng.has_unfinished():
        eng.step()
        for s in seqs:
            if s.blocks:
                assert len(s.blocks) >= -(-s.reserved_tokens(eng.max_model_len) // 4), s.request_id
    assert [(s.output_ids, s.exit_depths) for s in seqs] == [(r.token_ids, r.exit_depths) for r in want]
    m = eng.metrics()
    assert m["spec_verifications"] > 0 and m["preemptions"] == 0 and eng.blocks.all_free

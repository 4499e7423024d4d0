"""Priority scheduling (issue 39, deliverable 3; vLLM's `--scheduling-policy priority` and its
`priority` field, lower is served sooner): admission by priority then arrival, preemption of the
worst priority first, the same tokens as fcfs, and the refusals. Seeds are fixed in each test."""
from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from helpers import THRESHOLD, assert_same, model, random_requests, triples
from infer import LLM, EngineConfig, LLMEngine, SamplingParams
from infer.serving.async_engine import AsyncEngine
from infer.serving.server import build_app
from looplm import load_pretrained, load_tokenizer, save_pretrained, tiny_model
from looplm.errors import ParamError
from test_serve import ServerThread
from train.tokenizer import save_tokenizer, train_bpe


def drain(eng: LLMEngine) -> None:
    steps = 0
    while eng.has_unfinished():
        eng.step()
        steps += 1
        assert steps < 20000, "engine made no progress"


def test_admission_by_priority_then_arrival():
    """One slot: the requests run in the order (priority, arrival), and each one's tokens, exit
    depths and log-probs equal those of the same request under fcfs (float64)."""
    prios = [0, 2, 0, -1, 2]
    reqs = random_requests(11, n=5, prompt_len=(2, 6), max_new=(3, 6))
    out = {}
    for policy in ("fcfs", "priority"):
        eng = LLMEngine(model("ouro-tiny"), EngineConfig(max_batch_size=1, scheduling_policy=policy,
                                                         exit_threshold=THRESHOLD))
        seqs = [eng.add_request(p, SamplingParams(max_tokens=n, ignore_eos=True, logprobs=True),
                                priority=pr if policy == "priority" else 0) for (p, n), pr in zip(reqs, prios)]
        drain(eng)
        order = sorted(range(len(seqs)), key=lambda i: seqs[i].scheduled_time)
        out[policy] = (order, triples(seqs))
    assert out["fcfs"][0] == [0, 1, 2, 3, 4]
    assert out["priority"][0] == [3, 0, 2, 1, 4]
    assert_same(out["fcfs"][1], out["priority"][1])


def test_preemption_takes_the_worst_priority_first(monkeypatch):
    """A pool of 5 blocks x 4 tokens: every victim is the worst priority among the holders (then
    the most recently admitted), at least one of them is not the most recently admitted (the
    priority decided), and the outputs equal an ample pool's."""
    reqs = random_requests(5, n=5, prompt_len=(2, 8), max_new=(6, 10))
    prios = [5, 0, 3, 0, 1]
    base = dict(max_batch_size=8, block_size=4, prefill="separate", scheduling_policy="priority",
                exit_threshold=THRESHOLD)

    def run(eng):
        seqs = [eng.add_request(p, SamplingParams(max_tokens=n, ignore_eos=True, logprobs=True), priority=pr)
                for (p, n), pr in zip(reqs, prios)]
        drain(eng)
        return triples(seqs)

    small = LLMEngine(model("ouro-tiny"), EngineConfig(kv_cache_tokens=20, watermark=0.0, **base))
    pre, victims = small.scheduler.preemption, []
    swap_out = pre.swap_out

    def recorded(s, read_scores):
        victims.append((s, list(pre.holders())))
        swap_out(s, read_scores)
    monkeypatch.setattr(pre, "swap_out", recorded)
    got = run(small)
    want = run(LLMEngine(model("ouro-tiny"), EngineConfig(kv_cache_tokens=1024, **base)))
    assert victims and small.metrics()["preemptions"] == len(victims)
    for v, holders in victims:
        assert v is max(holders, key=lambda s: (s.priority, s.seq_id))
    assert any(v is not max(holders, key=lambda s: s.seq_id) for v, holders in victims)
    assert_same(want, got)


def test_bad_priority_is_refused_and_changes_nothing():
    eng = LLMEngine(model("ouro-tiny"), EngineConfig(max_batch_size=2))
    with pytest.raises(ParamError, match="scheduling_policy 'priority'") as e:
        eng.add_request([3, 4], priority=1)  # fcfs would ignore it: vLLM refuses it too
    assert e.value.param == "priority" and not eng.seqs and not eng.has_unfinished()
    eng.add_request([3, 4], priority=0)  # the default is fine under fcfs
    prio = LLMEngine(model("ouro-tiny"), EngineConfig(max_batch_size=2, scheduling_policy="priority"))
    for bad in (1.5, "1", True, None):
        with pytest.raises(ParamError, match="must be an integer"):
            prio.add_request([3, 4], priority=bad)
    assert not prio.seqs
    with pytest.raises(ParamError, match="scheduling_policy"):
        EngineConfig(scheduling_policy="lifo")


def test_llm_generate_priority():
    """LLM.generate(priority=[...]) (vLLM's argument): outputs in input order, as fcfs gives them."""
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    sp = SamplingParams(max_tokens=4, ignore_eos=True)
    fcfs = LLM(model("ouro-tiny"), max_batch_size=1).generate(prompts, sp)
    llm = LLM(model("ouro-tiny"), max_batch_size=1, scheduling_policy="priority")
    got = llm.generate(prompts, sp, priority=[2, 1, 0])
    assert [o.token_ids for o in got] == [o.token_ids for o in fcfs]
    with pytest.raises(ParamError, match="2 priorities for 3 prompts"):
        llm.generate(prompts, sp, priority=[0, 1])


# ---------------------------------------------------------------------------------- the server
TEXT = "The quick brown fox jumps over the lazy dog. Hello world, hello there! " * 3


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("model") / "tiny-prio"
    save_tokenizer(train_bpe([TEXT] * 20, vocab_size=300), out)
    save_pretrained(tiny_model("ouro-tiny", vocab_size=300), out, tokenizer=load_tokenizer(out))
    return out


def serve(model_dir, policy: str):
    # float64: the same tokens whatever the batch composition (the engine's exactness contract)
    eng = LLMEngine(load_pretrained(model_dir, dtype="float64"),
                    EngineConfig(max_batch_size=4, scheduling_policy=policy), load_tokenizer(model_dir))
    aeng = AsyncEngine(eng, max_waiting=64)
    return ServerThread(build_app(aeng, "tiny-prio", max_request_bytes=64 * 1024)), aeng


def test_server_priority_overtakes_the_waiting_queue(model_dir, monkeypatch):
    """Batch 4, 16 low-priority streams queued, then one with priority -1: it gets its first token
    before every low-priority request that was still waiting when it arrived; every request
    finishes, with the tokens an fcfs server gives (the high one sent without priority there)."""
    results = {}
    for policy in ("fcfs", "priority"):
        srv, aeng = serve(model_dir, policy)
        seqs = []
        add = aeng.engine.add_request

        def recorded(*a, **kw):
            s = add(*a, **kw)
            seqs.append(s)
            return s
        monkeypatch.setattr(aeng.engine, "add_request", recorded)

        async def one(c, i, extra):
            s = await c.completions.create(model="tiny-prio", prompt=[3 + i, 7, 11], max_tokens=24 + i, stream=True,
                                           temperature=0.0, extra_body={"ignore_eos": True, **extra})
            toks = []
            async for ch in s:
                toks += [t for c_ in ch.choices for t in (c_.token_ids or [])]
            return toks

        async def main():
            async with openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=120) as c:
                low = [asyncio.create_task(one(c, i, {})) for i in range(16)]
                for _ in range(2000):  # until the engine holds all 16, 12 of them waiting
                    if len(seqs) == 16 and aeng.engine.scheduler.queue_lengths()["waiting"] >= 8:
                        break
                    await asyncio.sleep(0.005)
                high = await one(c, 16, {"priority": -1} if policy == "priority" else {})
                return [*(await asyncio.gather(*low)), high]
        try:
            results[policy] = asyncio.run(main()), list(seqs)
        finally:
            srv.stop()
        assert aeng.engine.blocks.all_free
    (fcfs_toks, _), (toks, seqs) = results["fcfs"], results["priority"]
    assert toks == fcfs_toks and all(len(t) == 24 + i for i, t in enumerate(toks))
    high = next(s for s in seqs if s.priority == -1)
    waiting = [s for s in seqs if s.priority == 0 and s.scheduled_time > high.arrival_time]
    print("low requests still waiting when the high one arrived:", len(waiting))
    assert len(waiting) >= 4
    assert all(high.first_token_time <= s.first_token_time for s in waiting)


def test_server_refuses_bad_priority(model_dir):
    """A non-integer priority, and a priority the fcfs server would ignore: 400 naming 'priority'."""
    srv, _ = serve(model_dir, "fcfs")
    try:
        for prio, what in ((1.5, "expected an integer"), ("high", "expected an integer"), (2, "scheduling_policy")):
            r = httpx.post(srv.url + "/v1/completions", json={"model": "tiny-prio", "prompt": [3, 4], "max_tokens": 2,
                                                              "priority": prio}, timeout=30)
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["param"] == "priority" and what in err["message"], err
        ok = httpx.post(srv.url + "/v1/completions", json={"model": "tiny-prio", "prompt": [3, 4], "max_tokens": 2,
                                                           "priority": 0}, timeout=30)
        assert ok.status_code == 200, ok.text
    finally:
        srv.stop()


def test_lm_eval_model_args_priority(model_dir, monkeypatch):
    """lm-eval's `priority` model arg: every request of the evaluation gets it; refused where it
    is no integer or the engine's policy would ignore it (before the model loads)."""
    from eval.lm import LoopedEvalLM
    with pytest.raises(ParamError, match="must be an integer"):
        LoopedEvalLM.create_from_arg_string(f"pretrained={model_dir},priority=high")
    with pytest.raises(ParamError, match="scheduling_policy 'priority'"):
        LoopedEvalLM.create_from_arg_string(f"pretrained={model_dir},priority=-1")
    lm = LoopedEvalLM.create_from_arg_string(f"pretrained={model_dir},scheduling_policy=priority,priority=-1,"
                                             "batch_size=2")
    eng, seen = lm.llm.engine, []
    add = eng.add_request

    def recorded(*a, **kw):
        s = add(*a, **kw)
        seen.append(s.priority)
        return s
    monkeypatch.setattr(eng, "add_request", recorded)
    scores = lm._loglikelihood_tokens([(None, [3, 4], [5, 6]), (None, [7], [8])])
    assert len(scores) == 2 and seen == [-1, -1]


def test_online_bench_priority_classes(model_dir, monkeypatch):
    """infer.bench.online's priority classes: the high requests carry `priority` to a priority
    server, the rest none, and the summary reports each class."""
    import math

    from infer.bench.online import run_rate, summarize
    srv, aeng = serve(model_dir, "priority")
    seen = []
    add = aeng.engine.add_request

    def recorded(*a, **kw):
        s = add(*a, **kw)
        seen.append(s.priority)
        return s
    monkeypatch.setattr(aeng.engine, "add_request", recorded)
    try:
        high = [i % 4 == 0 for i in range(8)]
        res, dur = asyncio.run(run_rate(srv.url, "tiny-prio", math.inf, [(4, 6)] * 8, 300, 0, 1.0, 60,
                                        high=high, high_priority=-1))
    finally:
        srv.stop()
    assert sorted(seen) == [-1, -1] + [0] * 6
    s = summarize(res, dur)
    assert s["completed"] == 8 and s["by_class"]["high"]["completed"] == 2 and s["by_class"]["rest"]["completed"] == 6
    assert s["by_class"]["high"]["ttft_ms"]["mean"] > 0


def test_priority_ratios_pair_the_same_requests():
    """infer.bench.online.priority_ratios: per class, fcfs / priority request by request."""
    from infer.bench.online import Result, priority_ratios
    mk = lambda ttfts, highs: [Result(4, 4, ttft=t, e2e=2 * t, high=h) for t, h in zip(ttfts, highs)]  # noqa: E731
    highs = [True, False, False, True]
    rows = priority_ratios({("cdb-refill", 8.0, 0): mk([1.0, 1.0, 2.0, 4.0], highs),
                            ("cdb-refill-priority", 8.0, 0): mk([0.25, 2.0, 2.0, 1.0], highs)})
    assert len(rows) == 1 and rows[0]["policy"] == "cdb-refill-priority"
    assert rows[0]["high_ttft_fcfs_over_priority"]["median"] == 4.0
    assert rows[0]["rest_e2e_fcfs_over_priority"]["median"] == 0.75

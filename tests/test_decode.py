"""The decode path's pieces against their oracles: batched sampling (seeded rows independent of
their batch mates and equal to the reference's draw; unseeded rows vectorised with the same
filters), incremental detokenization (same text and stop handling as decoding the whole output),
and the persistent batch state (block tables that grow between stages, invalidated slots)."""
import random

import pytest
import torch

from infer import EngineConfig, LLMEngine, SamplingParams
from infer.engine.sampler import sample_batched

from helpers import fresh_model, model, policy, random_requests

SEED = 7  # printed by pytest in the test ids of failures; fixed for reproducibility


def test_seeded_request_ignores_its_batch_mates():
    m = model("huginn-tiny")
    seeded = SamplingParams(max_tokens=8, temperature=0.9, top_k=40, top_p=0.95, seed=11, ignore_eos=True)
    alone = LLMEngine(m, EngineConfig(exit_threshold=0.55))
    a = alone.add_request([5, 6, 7], seeded)
    while alone.has_unfinished():
        alone.step()
    mixed = LLMEngine(m, EngineConfig(exit_threshold=0.55, max_batch_size=8))
    rng = random.Random(SEED)
    others = [mixed.add_request([rng.randrange(3, 256) for _ in range(rng.randint(1, 9))],
                                SamplingParams(max_tokens=rng.randint(2, 10), ignore_eos=True,
                                               temperature=rng.choice([0.0, 0.7, 1.3]), top_k=rng.choice([0, 5])))
              for _ in range(5)]
    b = mixed.add_request([5, 6, 7], seeded)
    while mixed.has_unfinished():
        mixed.step()
    assert a.output_ids == b.output_ids and a.exit_depths == b.exit_depths
    assert any(o.params.temperature > 0 for o in others)


def test_sampler_knows_the_sampling_rows_after_finishes_and_aborts():
    """The engine tells the sampler when no running request samples (its fast path); a sampling
    request that arrives after others finished or were aborted is still sampled."""
    m = model("huginn-tiny")
    seeded = SamplingParams(max_tokens=8, temperature=0.9, seed=11, ignore_eos=True)
    alone = LLMEngine(m, EngineConfig(exit_threshold=0.55))
    a = alone.add_request([5, 6, 7], seeded)
    g = alone.add_request([5, 6, 7], SamplingParams(max_tokens=8, ignore_eos=True))
    while alone.has_unfinished():
        alone.step()
    assert a.output_ids != g.output_ids  # else this test could not tell sampled from greedy rows
    eng = LLMEngine(m, EngineConfig(exit_threshold=0.55, max_batch_size=8))
    greedy = [eng.add_request([9, 10 + i], SamplingParams(max_tokens=12, ignore_eos=True)) for i in range(3)]
    short = eng.add_request([4], SamplingParams(max_tokens=2, temperature=0.7, ignore_eos=True))
    gone = eng.add_request([4, 4], SamplingParams(max_tokens=9, temperature=0.7, ignore_eos=True))
    for _ in range(12):
        eng.step()
    eng.abort(gone.request_id)
    while not short.finished:
        eng.step()
    eng.processor.check(eng.seqs.values())
    assert not eng.processor.sampling and not any(s.finished for s in greedy)
    b = eng.add_request([5, 6, 7], seeded)
    while eng.has_unfinished():
        eng.step()
    eng.processor.check(eng.seqs.values())
    assert b.output_ids == a.output_ids and not eng.processor.sampling


def test_batched_sampling_filters():
    g = torch.Generator().manual_seed(SEED)
    logits = torch.randn(6, 50, generator=g, dtype=torch.float64)
    n = 6
    t = torch.full((n,), 0.8)
    # top_k 1 and a tiny top_p leave only the argmax
    one = sample_batched(logits, t, torch.ones(n, dtype=torch.long), torch.ones(n), g)
    assert one.tolist() == logits.argmax(-1).tolist()
    tiny = sample_batched(logits, t, torch.zeros(n, dtype=torch.long), torch.full((n,), 1e-6), g)
    assert tiny.tolist() == logits.argmax(-1).tolist()
    # top_k 5: every draw among the 5 largest
    top5 = logits.topk(5).indices
    for _ in range(20):
        d = sample_batched(logits, t, torch.full((n,), 5), torch.ones(n), g)
        assert all(int(d[i]) in top5[i].tolist() for i in range(n))
    # the draw follows softmax(logits / T): a 3-token row sampled many times
    row = torch.tensor([[2.0, 1.0, 0.0]]).expand(20000, 3)
    d = sample_batched(row, torch.ones(20000), torch.zeros(20000, dtype=torch.long), torch.ones(20000), g)
    freq = torch.bincount(d, minlength=3).double() / 20000
    assert torch.allclose(freq, torch.softmax(row[0].double(), -1), atol=0.015)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from looplm.io import load_tokenizer
    from train.tokenizer import save_tokenizer, train_bpe
    text = "naïve café — 東京 spaces  and\ttabs, emoji 🙂🙂 and plain words repeated words " * 4
    out = tmp_path_factory.mktemp("tok") / "tok"
    save_tokenizer(train_bpe([text] * 10, vocab_size=300), out)
    return load_tokenizer(out)


def test_incremental_detokenizer_equals_full_decode(tokenizer):
    from infer.engine.detokenizer import IncrementalDetokenizer
    rng = random.Random(SEED)
    V = len(tokenizer)
    for trial in range(30):
        ids = [rng.randrange(0, V) for _ in range(rng.randint(1, 60))]  # random ids split characters
        d = IncrementalDetokenizer(tokenizer)
        for n in range(1, len(ids) + 1):
            part = d.update(ids[:n])
            full = tokenizer.decode(ids[:n], skip_special_tokens=True)
            assert full.startswith(part) and (full == part or full.endswith("\ufffd"))  # held back: a split character
        assert d.finish(ids) == tokenizer.decode(ids, skip_special_tokens=True)


def test_engine_text_and_stop_strings_match_full_decode(tokenizer):
    m = fresh_model("ouro-tiny", vocab_size=len(tokenizer))
    eng = LLMEngine(m, EngineConfig(exit_threshold=0.55, max_batch_size=4), tokenizer=tokenizer)
    free = eng.add_request([5, 6, 7, 8], SamplingParams(max_tokens=40, ignore_eos=True))
    while eng.has_unfinished():
        eng.step()
    full = tokenizer.decode(free.output_ids, skip_special_tokens=True)
    assert eng.output(free).text == full and len(full) > 4
    stop = full[len(full) // 2: len(full) // 2 + 3]
    eng2 = LLMEngine(m, EngineConfig(exit_threshold=0.55, max_batch_size=4), tokenizer=tokenizer)
    s = eng2.add_request([5, 6, 7, 8], SamplingParams(max_tokens=40, ignore_eos=True, stop=[stop]))
    while eng2.has_unfinished():
        eng2.step()
    out = eng2.output(s)
    assert out.finish_reason == "stop" and out.text == full[:full.index(stop)]
    assert tokenizer.decode(s.output_ids, skip_special_tokens=True).startswith(out.text + stop)


@pytest.mark.parametrize("arch,layout,mode", [("ouro-tiny", "last_exited", dict(policy="cdb", min_coda_batch=2)),
                                              ("huginn-tiny", "shared", dict(policy="cdb", refill=False))])
def test_paged_attention_equals_reference(arch, layout, mode):
    """Decode attention through the block tables (eager FlexAttention on CPU) gives the reference
    decoder's tokens and depths in float64, with blocks that grow between stages."""
    from infer.engine.reference import reference_generate
    m = model(arch)
    reqs = random_requests(SEED, n=4, prompt_len=(1, 9), max_new=(2, 8), low=3)
    full = mode["policy"] == "cb"
    pol = policy(arch, full=full)
    refs = [reference_generate(m, p, n, pol, kv_layout=layout) for p, n in reqs]
    eng = LLMEngine(m, EngineConfig(kv_layout=layout, exit_threshold=0.55, max_batch_size=3, block_size=4,
                                    kv_cache_tokens=64, **mode))
    eng.runner.enable_paged(compile=False)
    seqs = [eng.add_request(p, SamplingParams(max_tokens=n, ignore_eos=True)) for p, n in reqs]
    while eng.has_unfinished():
        eng.step()
    assert [s.output_ids for s in seqs] == [r.token_ids for r in refs]
    assert [s.exit_depths for s in seqs] == [r.exit_depths for r in refs]
    assert full or len({d for s in seqs for d in s.exit_depths}) >= 2

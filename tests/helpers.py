"""What the engine tests share: the tiny float64 models, seeded request builders, the sequential
reference's outputs, the policy x KV layout x lookahead grid, and the staggered-arrival driver
(requests join a running engine a few at a time at seeded random steps, so every test sees
admissions mid-decode). Every seed is a number or a zlib.crc32 of a name, never `hash()`."""
import functools
import random
import zlib

import torch

from infer import SamplingParams
from infer.bench import drive
from infer.engine.block_manager import kv_rows
from infer.engine.sequence import Sequence, Stage, Status
from infer.engine.reference import reference_generate
from looplm import ExitPolicy, tiny_model

ARCHS = ["ouro-tiny", "huginn-tiny"]
THRESHOLD = 0.55  # the exit threshold of the equality tests: exits really vary on these models
MODES = {"cb": dict(policy="cb"), "norefill": dict(policy="cdb", refill=False),
         "refill_k1": dict(policy="cdb", refill=True, min_coda_batch=1),
         "refill_k4": dict(policy="cdb", refill=True, min_coda_batch=4)}
MODES_KBIG = {**MODES, "refill_kbig": dict(policy="cdb", refill=True, min_coda_batch=1000)}  # K above any batch
# + K decided from the launches' wall-clock cost (scheduling varies run to run; outputs may not): the
# engine's equality suite (test_engine.py) runs it
MODES_AUTO = {**MODES_KBIG, "refill_auto": dict(policy="cdb", refill=True, min_coda_batch="auto")}
LAYOUTS = ["last_exited", "shared", "full_depth"]


def fresh_model(arch="ouro-tiny", **kw):
    """A new tiny float64 model (std 0.15, seed 3): for a test that changes it (.cuda(), training)."""
    return tiny_model(arch, **{"dtype": torch.float64, "std": 0.15, "seed": 3, **kw})


@functools.lru_cache(maxsize=None)
def model(arch="ouro-tiny"):
    """The shared `fresh_model(arch)`, built once per process; tests only read it."""
    return fresh_model(arch)


def stable_seed(*parts) -> int:
    """A seed in 0..999 from a test's parameters, the same in every run (unlike `hash()`)."""
    return zlib.crc32("/".join(map(str, parts)).encode()) % 1000


def random_requests(seed, n=6, prompt_len=(1, 12), max_new=(1, 9), low=1):
    """`n` requests [(prompt ids in low..255, max_tokens)] drawn from random.Random(seed)."""
    rng = random.Random(seed)
    return [([rng.randrange(low, 256) for _ in range(rng.randint(*prompt_len))], rng.randint(*max_new))
            for _ in range(n)]


def random_load(eng, rng, n, max_gap, max_steps=20000):
    """Random load on an engine: `n` requests (prompts of 1-20 ids, 1-30 tokens, EOS ignored, some
    with r_max one below the model's), 0..max_gap steps after each, then run to the end. Returns
    the sequences, all finished with their max_tokens tokens (asserted); bounded by `max_steps`."""
    seqs, steps = [], 0
    r_max = eng.model.cfg.r_max
    for _ in range(n):
        p = [rng.randrange(256) for _ in range(rng.randint(1, 20))]
        seqs.append(eng.add_request(p, SamplingParams(max_tokens=rng.randint(1, 30), ignore_eos=True,
                                                      r_max=rng.choice([None, r_max - 1]))))
        for _ in range(rng.randint(0, max_gap)):
            eng.step()
            steps += 1
    while eng.has_unfinished():
        eng.step()
        steps += 1
        assert steps < max_steps
    assert all(s.finished and s.finish_reason == "length" and len(s.output_ids) == s.params.max_tokens
               for s in seqs)
    return seqs


def policy(arch, lookahead=False, full=False, threshold=THRESHOLD):
    return ExitPolicy.from_config(model(arch).cfg, threshold=threshold, lookahead=lookahead, full_depth=full)


@functools.lru_cache(maxsize=None)
def reference(arch, layout, lookahead, full, seed, **shape):
    """The sequential reference decoder's outputs for `random_requests(seed, **shape)` (cached)."""
    m, pol = model(arch), policy(arch, lookahead, full)
    return [reference_generate(m, p, n, pol, kv_layout=layout) for p, n in random_requests(seed, **shape)]


def runs(mode, layout, lookahead):
    """Whether the engine runs this combination: CB fuses the loop at full depth (no lookahead, no
    full_depth layout of its own); full_depth keeps every depth's KV, so exits need no lookahead."""
    return not (mode == "cb" and (lookahead or layout == "full_depth")) and not (layout == "full_depth" and lookahead)


def grid(modes=MODES, layouts=LAYOUTS, archs=None):
    """Every (mode, layout, lookahead) the engine runs, mode-major; with `archs`, (arch, mode,
    layout, lookahead) for each arch in turn."""
    cases = [(m, lay, la) for m in modes for lay in layouts for la in (False, True) if runs(m, lay, la)]
    return cases if archs is None else [(a, *c) for a in archs for c in cases]


def engine_settings(mode, layout, lookahead, pipeline=None, async_scheduling=True, **kw):
    """EngineConfig keywords for one grid point (`pipeline` defaults to lookahead outside CB). On-device
    token re-entry is on, as on CUDA (the CPU default is off), unless the test turns it off (speculation
    needs it off: EngineConfig.refuse)."""
    if pipeline is None:
        pipeline = lookahead and mode != "cb"
    return dict(kv_layout=layout, exit_threshold=THRESHOLD, lookahead=lookahead, pipeline=pipeline,
                async_scheduling=async_scheduling, **MODES_AUTO[mode], **kw)


def run_staggered(eng, reqs, seed, join=0.4, burst=3, **params):
    """Run `reqs` [(prompt, max_tokens)] with staggered arrivals (infer.bench.drive). Returns the
    Sequences in input order. `params`: more SamplingParams for every request (default: ignore_eos,
    logprobs)."""
    adds = [dict(prompt=p, params=SamplingParams(**{"ignore_eos": True, "logprobs": True, **params, "max_tokens": n}))
            for p, n in reqs]
    return drive.run_staggered(eng, adds, seed, join=join, burst=burst)


def triples(seqs):
    """(tokens, exit depths, log-probs) of each Sequence."""
    return [(s.output_ids, s.exit_depths, s.logprobs) for s in seqs]


def assert_same(want, got, tol=1e-9):
    """Two runs' triples: tokens and exit depths equal, log-probs within `tol`."""
    assert len(want) == len(got)
    for i, ((t1, d1, l1), (t2, d2, l2)) in enumerate(zip(want, got)):
        assert t1 == t2 and d1 == d2, f"request {i}"
        assert max(abs(a - b) for a, b in zip(l1, l2)) < tol, f"request {i}"


def exits_vary(results, at_least=2):
    """Whether the decode tokens of `results` (triples) left the loop at >= `at_least` depths."""
    return len({d for _, ds, _ in results for d in ds[1:]}) >= at_least


# ---------------------------------------------------------------- scheduler alone (pure Python)
class FakeScores:
    """Exit scores handed to Scheduler.postprocess in place of the runner's device tensor."""

    def __init__(self, xs):
        self.xs = xs

    def get(self):
        return self.xs


def arrive_or_abort(sch, seqs, rng, total, prompt, max_tokens, pol, ids):
    """One step of a scheduler test's random traffic: with probability 0.2 (until `total` have
    arrived) a new Sequence with `prompt(rng)` and max_tokens drawn from `max_tokens` (a range);
    with probability 0.01 a random earlier one is aborted (if not finished)."""
    if len(seqs) < total and rng.random() < 0.2:
        p = prompt(rng)
        s = Sequence(next(ids), str(len(seqs)), p, SamplingParams(max_tokens=rng.randint(*max_tokens)), pol)
        seqs.append(s)
        sch.add(s)
    if seqs and rng.random() < 0.01:
        v = rng.choice(seqs)
        if not v.finished:
            sch.finish(v, "abort")


def fake_postprocess(sch, work, rng, token, max_len=64, out=None):
    """Finish `work` as the engine would, without a model: a core step's exit scores drawn 0 / 1;
    an emitting stage appends `token(rng)` to each item that emits (Work.emitting) and
    finishes those at max_tokens or `max_len` tokens; a speculative stage appends the tokens of
    `out` (ContentRunner's plan) one at a time under the same rules."""
    if work.stage is Stage.SPEC:
        fin = {}
        for s in work.seqs:
            for tok in out[s.seq_id]:
                s.output_ids.append(tok)
                if len(s.output_ids) >= s.params.max_tokens or s.num_tokens >= max_len:
                    fin[s.seq_id] = "length"
                    break
        sch.postprocess(work, finished=fin)
    elif work.stage is Stage.CORE:
        sch.postprocess(work, scores=FakeScores([rng.choice([0.0, 1.0]) for _ in work.seqs]))
    elif work.stage.emits:
        fin = {}
        for s in work.emitting:
            s.output_ids.append(token(rng))
            if len(s.output_ids) >= s.params.max_tokens or s.num_tokens >= max_len:
                fin[s.seq_id] = "length"
        sch.postprocess(work, finished=fin)
    else:
        sch.postprocess(work)


class ContentRunner:
    """A cost-free runner that tracks what every KV row holds: the token prefix of the position
    that wrote it. Each launch writes its items' rows, then checks that every row an item reads
    (positions 0..its last) holds exactly its own prefix: a shared block that was overwritten,
    evicted while held, or registered before it was written would fail here. Swaps copy rows."""

    def __init__(self, bm, rng: random.Random | None = None):
        self.bm, self.rows, self.host, self.rng = bm, {}, {}, rng or random.Random(0)

    def _rows(self, s, end):
        return kv_rows(s.blocks, self.bm.block_size, end)

    def run(self, work):
        """A launch's writes and reads; a speculative stage (SPEC) returns its plan: per seq_id the
        tokens the engine would emit (a random number of accepted random drafts, then one more)."""
        if work.stage is Stage.SPEC:
            return self._spec(work)
        items = [(s, s.position, s.prompt_ids + s.output_ids) for s in work.seqs]
        items += [(s, s.chunk[1] - 1, s.prompt_ids) for s in work.chunks]
        for s, last, toks in items:  # writes: a decode item its own row, a chunk its positions
            first = last if s in work.seqs else s.chunk[0]
            for p in range(first, last + 1):
                self.rows[self._rows(s, p + 1)[p]] = tuple(toks[:p + 1])
        for s, last, toks in items:
            got = [self.rows.get(r) for r in self._rows(s, last + 1)]
            assert got == [tuple(toks[:p + 1]) for p in range(last + 1)], f"seq {s.seq_id} reads wrong rows"

    def _spec(self, work):
        plan = {}
        for s, k in zip(work.seqs, work.spec):
            p0 = s.position
            drafts = [self.rng.randrange(3, 256) for _ in range(k - 1)]
            toks = s.prompt_ids + s.output_ids + drafts  # the input of position p0 + j is toks[p0 + j]
            for p in range(p0, p0 + k):
                self.rows[self._rows(s, p + 1)[p]] = tuple(toks[:p + 1])
            for p in range(p0, p0 + k):  # each chunk position reads positions 0..itself
                got = [self.rows.get(r) for r in self._rows(s, p + 1)]
                assert got == [tuple(toks[:q + 1]) for q in range(p + 1)], f"seq {s.seq_id} reads wrong rows"
            plan[s.seq_id] = drafts[:self.rng.randint(0, k - 1)] + [self.rng.randrange(3, 256)]
        return plan

    def swap(self, ops):
        for op in ops:
            rows = [b * self.bm.block_size + i for b in op.blocks for i in range(self.bm.block_size)]
            if op.kind == "out":
                self.host[op.seq.seq_id] = [self.rows.get(r) for r in rows]
            elif op.kind == "in":
                for r, v in zip(rows, self.host.pop(op.seq.seq_id)):
                    self.rows[r] = v
            else:
                self.host.pop(op.seq.seq_id, None)


def check_blocks(sch, bm):
    """Every block's reference count is the number of block tables holding it; held, free and
    cached blocks partition the pool; the cache map is consistent; no slot is held twice."""
    chunks = [s for q in sch.queues.values() for s in q if s.chunk is not None]
    holders = sch.preemption.holders() + list(sch.chunker.partial) + chunks
    assert len(holders) == len(set(map(id, holders)))
    count = [0] * bm.num_blocks
    for s in holders:
        assert len(set(s.blocks)) == len(s.blocks)
        for b in s.blocks:
            count[b] += 1
    assert count == bm.ref
    held = {b for b in range(bm.num_blocks) if count[b]}
    free, cached = set(bm.free_blocks), set(bm.cached)
    assert len(free) == len(bm.free_blocks) and not (held & free or held & cached or free & cached)
    assert len(held) + len(free) + len(cached) == bm.num_blocks
    assert all(bm.hash_of.get(b) == h for h, b in bm.by_hash.items()) and len(bm.by_hash) == len(bm.hash_of)
    assert cached <= set(bm.hash_of) and not free & set(bm.hash_of)
    assert sorted(s.slot for s in holders) == sorted(set(s.slot for s in holders))
    for s in sch.preemption.holders():
        assert len(s.blocks) * bm.block_size >= s.position + 1 - (s.status is Status.STALLED)
    for s in holders:  # Sequence.room follows every table change (the BlockManager keeps it)
        assert s.room == len(s.blocks) * bm.block_size - len(s.prompt_ids)


def wait_for_server(p, timeout: float = 60.0) -> tuple[str, str]:
    """(URL, banner line) of a `python -m infer.serve --port 0` subprocess `p` (stdout piped, text),
    once its /health answers 200: the banner names the port (after any library warnings)."""
    import re
    import time
    import httpx
    for _ in range(50):
        line = p.stdout.readline()
        m = re.search(r"http://127\.0\.0\.1:(\d+)", line)
        if m or not line:
            break
    assert m, line
    url = f"http://127.0.0.1:{m.group(1)}"
    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return url, line
        except httpx.TransportError:
            pass
        assert time.monotonic() < deadline and p.poll() is None
        time.sleep(0.1)

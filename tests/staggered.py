"""The staggered-arrival driver the exactness tests share: requests join a running engine a few
at a time at seeded random steps, so every test sees admissions mid-decode."""
import random

from infer import SamplingParams


def run_staggered(eng, reqs, seed, join=0.4, burst=3, **params):
    """Run `reqs` [(prompt, max_tokens)]: at each step, with probability `join` (always when the
    engine is idle), 1..`burst` more arrive. Returns (tokens, depths, logprobs) per request, in
    input order. `params`: more SamplingParams for every request."""
    rng = random.Random(seed)
    pending, seqs, steps = list(enumerate(reqs)), {}, 0
    while pending or eng.has_unfinished():
        if pending and (not eng.has_unfinished() or rng.random() < join):
            for _ in range(rng.randint(1, burst)):
                if pending:
                    i, (p, n) = pending.pop(0)
                    seqs[i] = eng.add_request(p, SamplingParams(max_tokens=n, ignore_eos=True, logprobs=True,
                                                                **params))
        eng.step()
        steps += 1
        assert steps < 20000, "no progress"
    return [(seqs[i].output_ids, seqs[i].exit_depths, seqs[i].logprobs) for i in range(len(reqs))]

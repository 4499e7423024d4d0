"""The output processor: a stage's logits -> each sequence's next token, its exit depth, log-probs,
text, and whether it stops (vLLM V1's OutputProcessor, with the sampler call).

One loop over the rows of a stage that emits (decode items first, then prompts whose first token
it samples, at full depth), one set of stop rules: a stop token (the request's stop ids, with the
EOS ids unless `ignore_eos`), the length (`max_tokens`, capped by the context), and, with a
tokenizer attached, the stop strings in the incrementally decoded text. The loop runs once per
item per coda: what every row pays is a few attribute reads; rows with anything more
(teacher-forced tokens, log-probs: `Sequence.extras`) get a pass of their own first, and with a
tokenizer each row calls out for its text.
"""
from __future__ import annotations

import time
from operator import attrgetter
from typing import TYPE_CHECKING, Iterable, NamedTuple

import torch

from .detokenizer import IncrementalDetokenizer
from .sampler import Sampler
from .sampling_params import find_stop
from .scheduler import Scores, Work
from .sequence import Sequence, Stage

if TYPE_CHECKING:
    from .runner import Emitted
    from .speculative import SpecOut

_step = attrgetter("step")


def top_logprobs(logp: torch.Tensor, k: int, tok: int) -> dict[int, float]:
    """The k most likely tokens of one position's log-probs [V], plus the chosen token (vLLM's rule)."""
    vals, ids = logp.topk(min(k, logp.shape[-1])) if k else (logp[:0], logp[:0].long())
    out = dict(zip(ids.tolist(), vals.tolist()))
    out.setdefault(tok, float(logp[tok]))
    return out


def prompt_logprobs(s: Sequence, logits: torch.Tensor) -> None:
    """The prompt's log-probs from the prefill's logits [L, V] at every position (vLLM's
    prompt_logprobs): token j > 0 is scored by position j-1's logits; the first token has none."""
    logp = torch.log_softmax(logits.double(), -1)
    ids, k = s.prompt_ids, s.params.prompt_logprobs
    s.prompt_logprobs = [None] + logp[torch.arange(len(ids) - 1), torch.tensor(ids[1:], dtype=torch.long)].tolist()
    s.prompt_top_logprobs = [None] + [top_logprobs(logp[j], k, ids[j + 1]) for j in range(len(ids) - 1)]


class UnreadSample(NamedTuple):
    """A stage's sampled ids left on the device, not read by the host yet (OutputProcessor.defer):
    its rows' sequences, the host copies in flight of their ids and (None: no row asked) of the
    chosen tokens' log-probs."""
    seqs: list[Sequence]
    ids: Scores
    logprobs: Scores | None


class OutputProcessor:
    def __init__(self, sampler: Sampler, tokenizer, r_full: int, seed: int):
        """`r_full`: the depth of a prompt's first token."""
        self.sampler, self.tokenizer = sampler, tokenizer
        self.r_full, self.seed = r_full, seed
        # the counters of what it emitted, which the engine's metrics read: `tokens` and `depth_sum` (decode
        # tokens only), speculative stages' counters and the score reads of their core launches
        self.stats = {"tokens": 0, "depth_sum": 0, "spec_core_reads": 0,
                      "speculative": dict.fromkeys(("stages", "verifications", "drafted", "accepted", "rejected",
                                                    "emitted", "verified_tokens", "draft_launches",
                                                    "verify_launches"), 0)}
        self.sampling: set[int] = set()  # seq_ids of the unfinished requests that sample (Sequence.sampled)
        self.extras: set[int] = set()  # seq_ids of the unfinished requests with extras (Sequence.extras)
        # seq_ids of the unfinished requests whose token only the host can choose or score: teacher
        # forcing, a seeded draw (the request's own host generator), top log-probs; a stage with one
        # of them does not re-enter its ids on the device (can_defer)
        self.host_rows: set[int] = set()
        self._detok: dict[int, IncrementalDetokenizer] = {}  # by seq_id, while a request decodes

    def add(self, s: Sequence) -> None:
        """A new request: its generator, and the sets of requests that sample / need extras."""
        p = s.params
        s.generator = torch.Generator().manual_seed(p.seed if p.seed is not None
                                                    else self.seed * 1_000_003 + s.seq_id)
        if s.sampled:
            self.sampling.add(s.seq_id)
        if s.extras:
            self.extras.add(s.seq_id)
        if s.forced is not None or (s.sampled and p.seed is not None) or p.top_logprobs:
            self.host_rows.add(s.seq_id)

    def process(self, work: Work, out: Emitted | SpecOut) -> dict[int, str]:
        """Sample the next token of each row of a stage that emits and apply it to its sequence;
        returns the finish reason of each sequence (by seq_id) that stops. A speculative stage's
        rows are each sequence's verified positions, taken up to its first rejected draft."""
        if work.stage is Stage.SPEC:
            return self._accept(work.seqs, out)
        seqs = work.emitting  # (with the final prompt chunks: their first tokens)
        logits, prompt = out
        chosen = self.sampler(logits, seqs, bool(self.sampling))  # one batched call, one device-to-host copy
        now = time.perf_counter()
        depths = self._depths(work, seqs, now, prompt)
        return self._apply(seqs, chosen, depths, logits, now)

    def _depths(self, work: Work, seqs: list[Sequence], now: float, prompt: dict | None = None) -> list[int]:
        """The exit depth of each row of a stage that emits, counted into `stats`: a
        decode item's loop steps (fused: the iteration's); a prompt's first token is at full depth
        (a prefill's prompt has no loop steps, a final chunk has r_full). Stamps the prompts' first
        token time (`now`; None: when its id is read) and their prompt log-probs."""
        n = len(work.seqs)  # decode rows; the rest: first tokens (a separate prefill: all)
        fused = work.r_max if work.stage is Stage.FUSED else 0
        if fused:
            depths = [fused] * n
            self.stats["depth_sum"] += fused * n
        else:
            depths = list(map(_step, work.seqs)) if n else []  # (in C, not in a Python loop)
            self.stats["depth_sum"] += sum(depths)
        if n < len(seqs):  # prompts' first tokens
            r_full = self.r_full
            for s in seqs[n:]:
                if now is not None:
                    s.first_token_time = now
                if prompt is not None and s.seq_id in prompt:
                    prompt_logprobs(s, prompt[s.seq_id])
                depths.append(fused or s.step or r_full)
        self.stats["tokens"] += n  # the prompts' full-depth tokens stay out of the mean exit depth
        return depths

    # ------------------------------------------------------------------ on-device token re-entry
    def can_defer(self, work: Work, out: Emitted) -> bool:
        """Whether a stage's ids can stay on the device for now (EngineConfig.async_scheduling): no
        row whose token only the host can choose or score (`host_rows`), no prompt log-probs."""
        if out.prompt_logits is not None or work.stage is Stage.SPEC:
            return False
        if self.host_rows:
            rows = self.host_rows
            return not any(s.seq_id in rows for s in work.emitting)
        return True

    def defer(self, work: Work, out: Emitted, runner) -> tuple[UnreadSample, dict[int, None]]:
        """A stage's ids sampled on the device and left there: `runner.reenter` makes them the next
        prelude's tokens, `runner.to_host` starts their copy to the host (and the log-probs' of rows
        that ask). Each row gets a placeholder token (-1, `Sequence.unread_ids`) and its exit depth now;
        `resolve` fills in the id, its time and log-prob, and applies the stop rules. Returns the
        unread sample and the sequences that reach their length limit with this token (by seq_id):
        they stop whatever the id is, so the scheduler frees them now and no launch runs them again
        (their finish reason comes with the id)."""
        seqs = work.emitting
        logits = out.logits
        ids = self.sampler.device_ids(logits, seqs, bool(self.sampling))
        runner.reenter(seqs, ids)
        n = len(seqs)
        lps = None
        if self.extras:  # rows that ask for the chosen token's log-prob (forced / top rows are host rows)
            lps = runner.to_host(torch.log_softmax(logits.double(), -1).gather(1, ids[:, None])[:, 0], n)
        unread = UnreadSample(seqs, runner.to_host(ids, n), lps)
        depths = self._depths(work, seqs, None)
        done: dict[int, None] = {}
        for s, d in zip(seqs, depths):
            out_ids = s.output_ids
            out_ids.append(-1)
            s.unread_ids = 1
            s.exit_depths.append(d)
            if len(out_ids) >= s.max_out:
                done[s.seq_id] = None
        return unread, done

    def resolve(self, p: UnreadSample) -> dict[int, str]:
        """Read a deferred stage's ids (waiting for that launch only) and apply them: each row's
        placeholder becomes its id, with its time and log-prob, and the stop rules run. Returns the
        finish reason of each sequence that stops (by seq_id). A sequence aborted meanwhile gets its
        id and nothing else."""
        toks = p.ids.get()
        lps = p.logprobs.get() if p.logprobs is not None else None
        now = time.perf_counter()
        live, chosen = [], []
        for i, (s, tok) in enumerate(zip(p.seqs, toks)):
            s.output_ids[-1] = tok
            s.unread_ids = 0
            if s.finish_reason is not None:  # aborted
                continue
            s.token_times.append(now)
            if s.first_token_time is None:
                s.first_token_time = now
            if lps is not None and s.params.logprobs:
                s.logprobs.append(lps[i])
            live.append(s)
            chosen.append(tok)
        return self._rules(live, chosen, now)

    def _apply(self, seqs: list[Sequence], chosen: list[int], depths: list[int], logits: torch.Tensor,
               now: float) -> dict[int, str]:
        """Each row's token (`chosen`, at exit depth `depths`) to its sequence, and the stop rules."""
        if self.extras:  # a running request wants forced tokens or log-probs: those rows first
            self._extras(seqs, chosen, logits)
        for s, tok, d in zip(seqs, chosen, depths):
            s.output_ids.append(tok)
            s.exit_depths.append(d)
            s.token_times.append(now)
        return self._rules(seqs, chosen, now)

    def _rules(self, seqs: list[Sequence], chosen: list[int], now: float) -> dict[int, str]:
        """The stop rules, after each row's token joined its sequence: a stop token, the length, the
        stop strings (with a tokenizer, which also brings the text up to date)."""
        finished: dict[int, str] = {}
        text = self.tokenizer is not None
        for s, tok in zip(seqs, chosen):
            out_ids = s.output_ids
            if tok in s.stop_ids:
                reason = "stop"
            elif len(out_ids) >= s.max_out:
                reason = "length"
            elif text:
                reason = None
            else:
                continue
            if text:
                reason = self._text(s, reason)
            if reason is not None:
                finished[s.seq_id] = reason
                self.finish(s, now)
        return finished

    def _accept(self, seqs: list[Sequence], out: SpecOut) -> dict[int, str]:
        """A speculative stage's outcome (speculative.py): each sequence's verified tokens in order,
        window position by window position, as coda rows (sampling, stop rules, log-probs), stopping
        a sequence at its first rejected draft: position i+1's row counts only if its drafted
        input equals the token just emitted from position i. Counts the stage into the
        speculation counters (`stats["speculative"]`: drafted and accepted tokens, drafts rejected
        (the windows that ended at one), emitted tokens, verified windows (of more than one
        position) and the tokens they gave, its draft and verify launches) and its core launches'
        score reads."""
        start = [0]
        for k in out.ks:
            start.append(start[-1] + k)
        finished: dict[int, str] = {}
        sp, stats = self.stats["speculative"], self.stats
        sp["drafted"] += sum(k - 1 for k in out.ks)
        sp["verifications"] += sum(1 for k in out.ks if k > 1)
        alive = list(range(len(seqs)))
        for i in range(max(out.ks)):
            if not alive:
                break
            rows = out.logits[[start[b] + i for b in alive]]
            its = [seqs[b] for b in alive]
            depths = [out.depths[b][i] for b in alive]
            chosen = self.sampler(rows, its, bool(self.sampling))
            finished.update(self._apply(its, chosen, depths, rows, time.perf_counter()))
            stats["tokens"] += len(its)
            stats["depth_sum"] += sum(depths)
            sp["emitted"] += len(alive)
            sp["verified_tokens"] += sum(1 for b in alive if out.ks[b] > 1)
            nxt = []
            for b in alive:
                s = seqs[b]
                if i + 1 < out.ks[b] and s.seq_id not in finished:
                    if s.output_ids[-1] == out.drafts[b][i]:
                        sp["accepted"] += 1
                        nxt.append(b)
                    else:
                        sp["rejected"] += 1  # the window ends at this draft
            alive = nxt
        for phase, n in out.launches.items():
            sp[phase + "_launches"] += n
        sp["stages"] += 1
        stats["spec_core_reads"] += sum(r["score_reads"] for r in out.rows)
        return finished

    def _extras(self, seqs: list[Sequence], chosen: list[int], logits: torch.Tensor) -> None:
        """Teacher forcing (the row's token becomes the forced one) and log-probs of the rows whose
        request asks for them (`Sequence.extras`)."""
        logp = None  # the stage's log-probs, computed for the first row that asks for them
        for i, s in enumerate(seqs):
            if not s.extras:
                continue
            p, tok = s.params, chosen[i]
            if s.forced is not None:  # the sampler gave the argmax: was the forced token the greedy one?
                forced = s.forced[len(s.output_ids)]
                s.forced_greedy = s.forced_greedy and tok == forced
                chosen[i] = tok = forced
            if p.logprobs:
                if logp is None:
                    logp = torch.log_softmax(logits.double(), -1)
                s.logprobs.append(float(logp[i, tok]))
                if p.top_logprobs:
                    s.top_logprobs.append(top_logprobs(logp[i], p.top_logprobs, tok))

    def _text(self, s: Sequence, reason: str | None) -> str | None:
        """The text after the new token, and the stop-string rule: a stop string ends the text
        before it; a stop token is not part of the text."""
        detok = self._detok.get(s.seq_id)
        if detok is None:
            detok = self._detok[s.seq_id] = IncrementalDetokenizer(self.tokenizer)
        out = s.output_ids
        if reason == "stop":  # a stop token: the text ends before it
            s.text = detok.finish(out[:-1])
            return reason
        s.text = detok.update(out)
        stops = s.params.stop
        if stops:  # only the new tail can complete a stop string (find_stop starts near stop_checked)
            j = find_stop(s.text, stops, s.stop_checked)
            s.stop_checked = len(s.text)
            if j != -1:
                s.text = s.text[:j]
                return "stop"
        if reason == "length":
            s.text = detok.finish(out)
        return reason

    def finish(self, s: Sequence, now: float | None = None) -> None:
        """The output side of a sequence that stops or is aborted (the scheduler frees its memory)."""
        s.finish_time = time.perf_counter() if now is None else now
        self._detok.pop(s.seq_id, None)
        self.sampling.discard(s.seq_id)
        self.extras.discard(s.seq_id)
        self.host_rows.discard(s.seq_id)

    def check(self, seqs: Iterable[Sequence]) -> None:
        """The oracle of the incremental bookkeeping: the set of sampling requests and the
        detokenizers held, rebuilt from the sequences (an AssertionError on a mismatch)."""
        seqs = list(seqs)
        want = {s.seq_id for s in seqs if s.sampled and not s.finished}
        assert self.sampling == want, f"sampling requests {sorted(self.sampling)}, the sequences say {sorted(want)}"
        want = {s.seq_id for s in seqs if s.extras and not s.finished}
        assert self.extras == want, f"requests with extras {sorted(self.extras)}, the sequences say {sorted(want)}"
        live = {s.seq_id for s in seqs if not s.finished}
        assert set(self._detok) <= live, f"detokenizers of finished requests {sorted(set(self._detok) - live)}"

"""Sampling parameters (validated at the boundary) and stop-string handling. Pure Python."""
from __future__ import annotations

from dataclasses import dataclass, field

from looplm.config import check_depths
from looplm.errors import ParamError


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    seed: int | None = None  # per-request generator; None draws from the engine's seed
    stop: list[str] = field(default_factory=list)  # stop strings (not included in the text)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: bool = False  # return the log-prob of each chosen token
    top_logprobs: int = 0  # with logprobs: also the k most likely tokens at each output position
    # prompt log-probs (vLLM's name): None = off; k >= 0 = each prompt token's log-prob (from the
    # full-depth prefill) plus the k most likely tokens at each prompt position
    prompt_logprobs: int | None = None
    # per-request exit policy overrides (None: the engine's setting)
    exit_threshold: float | None = None
    r_min: int | None = None
    r_max: int | None = None
    # self-speculative decoding (EngineConfig.speculative_tokens): False opts this request out
    speculate: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.validate()

    def validate(self) -> None:
        def bad(field_name: str, why: str) -> ParamError:
            return ParamError(field_name, f"invalid sampling parameter {field_name}: {why}")
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens <= 0:
            raise bad("max_tokens", f"must be a positive integer, got {self.max_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or not self.temperature >= 0:
            raise bad("temperature", f"must be >= 0, got {self.temperature!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad("top_k", f"must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise bad("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0):
            raise bad("seed", f"must be a non-negative integer, got {self.seed!r}")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise bad("stop", "must be non-empty strings")
        if not all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be non-negative integers")
        if not isinstance(self.top_logprobs, int) or self.top_logprobs < 0:
            raise bad("top_logprobs", f"must be an integer >= 0, got {self.top_logprobs!r}")
        if self.prompt_logprobs is not None and (not isinstance(self.prompt_logprobs, int) or self.prompt_logprobs < 0):
            raise bad("prompt_logprobs", f"must be None or an integer >= 0, got {self.prompt_logprobs!r}")
        if self.exit_threshold is not None and not isinstance(self.exit_threshold, (int, float)):
            raise bad("exit_threshold", f"must be a number, got {self.exit_threshold!r}")
        if not isinstance(self.speculate, bool):
            raise bad("speculate", f"must be true or false, got {self.speculate!r}")
        try:
            check_depths(self.r_min, self.r_max)
        except ParamError as e:
            raise bad(e.param, str(e)) from None


# ---- the checks of a request's tokens: the engine's (LLMEngine.add_request) and the server's, which
# runs them on the tokenized prompt before it fills in max_tokens (infer/serving/async_engine.py)
def check_token_ids(ids: list, vocab_size: int, what: str) -> None:
    """Every id of `ids` (a request field: the prompt, stop_token_ids, forced tokens) is a token of
    the vocabulary."""
    for t in ids:
        if not (isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size):
            raise ParamError(what, f"'{what}' has token id {t!r} outside the vocabulary [0, {vocab_size})")


def check_priority(priority, scheduling_policy: str) -> None:
    """A request's priority is an integer, and not other than 0 where the policy would ignore it
    (vLLM refuses a non-default priority under fcfs)."""
    if not isinstance(priority, int) or isinstance(priority, bool):
        raise ParamError("priority", f"'priority' must be an integer (lower is served sooner), got {priority!r}")
    if priority != 0 and scheduling_policy != "priority":
        raise ParamError("priority", f"'priority' {priority} needs scheduling_policy 'priority' (the engine runs "
                                     f"{scheduling_policy!r}, which would ignore it)")


def check_prompt(ids: list, vocab_size: int, max_model_len: int, what: str = "prompt") -> None:
    """A prompt has tokens, all in the vocabulary, and leaves at least one position of the context
    for the output."""
    if not ids:
        raise ParamError(what, f"'{what}' is empty (zero tokens)")
    check_token_ids(ids, vocab_size, what)
    if len(ids) >= max_model_len:
        raise context_exceeded(max_model_len, len(ids), what)


def context_exceeded(max_model_len: int, n: int, what: str = "prompt", max_tokens: int | None = None) -> ParamError:
    """vLLM's error for a request that does not fit the context: a prompt of `n` tokens that leaves
    no room for the output, or with `max_tokens` output tokens that together exceed it."""
    head = f"This model's maximum context length is {max_model_len} tokens (max_model_len). However, "
    if max_tokens is None:
        return ParamError(what, head + f"your request has {n} input tokens, which leaves no room for the output. "
                                       f"Please reduce the length of the input {what}.", "context_length_exceeded")
    return ParamError("max_tokens", head + f"you requested {max_tokens} output tokens and your prompt contains {n} "
                                           f"input tokens, for a total of {n + max_tokens} tokens. Please reduce the "
                                           f"length of the input {what} or the number of requested output tokens.",
                      "context_length_exceeded")


def find_stop(text: str, stops: list[str], start: int) -> int:
    """Index in `text` where the earliest stop string begins, searching from `start`; -1 if none."""
    best = -1
    for s in stops:
        i = text.find(s, max(0, start - len(s) + 1))
        if i != -1 and (best == -1 or i < best):
            best = i
    return best

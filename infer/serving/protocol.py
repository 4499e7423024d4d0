"""OpenAI request parsing for the server: JSON bodies in, validated `GenRequest`s out.

Every rejection is an `APIError` shaped like OpenAI's (`{"error": {"message", "type", "param",
"code"}}`) that names the offending field. Pure Python: no torch, no FastAPI.
"""
from __future__ import annotations

import json
import math
from http import HTTPStatus
from dataclasses import dataclass, field
from typing import Any

from infer.engine.sampling_params import check_token_ids
from looplm.errors import ParamError

MAX_STOP = 16  # stop strings per request
MAX_STOP_LEN = 256  # characters per stop string
MAX_MESSAGES = 1024
MAX_LOGPROBS = 20  # alternatives per position (vLLM's default max_logprobs)
MAX_CHOICES = 64  # prompts x n per request
ECHO_DEPTHS = ("full", "policy")  # what a prompt token's log-prob means (see parse_completion)
ROLES = ("system", "developer", "user", "assistant", "tool")
SUPPORTED_RESPONSE_FORMATS = (None, "text")


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 type_: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type_, code

    def body(self) -> dict:
        """OpenAI's shape; `code` is always a string (the HTTP status's name when none is given)."""
        code = self.code if self.code is not None else HTTPStatus(self.status).phrase.lower().replace(" ", "_")
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": code}}


def bad(param: str | None, message: str, code: str | None = None) -> APIError:
    return APIError(400, message, param, code=code)


@dataclass
class GenRequest:
    """A validated completion or chat request."""
    kind: str  # "completion" | "chat"
    prompt: str | list[int] | None  # completions: the first (or only) prompt
    messages: list[dict] | None  # chat (rendered with the chat template in the engine thread)
    sampling: dict  # SamplingParams keyword arguments (max_tokens may be None: the rest of max_model_len)
    max_tokens_given: bool  # False: max_tokens is the rest of max_model_len (capped at sampling's, if any)
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False
    model: str | None = None
    extra: dict = field(default_factory=dict)
    prompts: list = field(default_factory=list)  # completions: every prompt (a list per request is allowed)
    n: int = 1  # choices per prompt
    echo: bool = False  # completions: the prompt (text and log-probs) before the output
    top_logprobs: int = 0  # alternatives per position (completions: logprobs=k; chat: top_logprobs=k)
    echo_depth: str = "full"  # echo log-probs: "full" = full-depth prefill, "policy" = teacher-forced
    continuous_usage: bool = False  # stream_options.continuous_usage_stats: usage so far on every chunk

    @property
    def num_choices(self) -> int:
        return max(1, len(self.prompts)) * self.n


def parse_json(raw: bytes) -> dict:
    def no_constants(name: str):  # NaN and Infinity are not JSON (Python's parser accepts them)
        raise ValueError(f"{name} is not valid JSON")
    try:
        body = json.loads(raw, parse_constant=no_constants)
    except (ValueError, UnicodeDecodeError) as e:
        raise bad(None, f"the request body is not valid JSON: {e}", code="invalid_json") from None
    except RecursionError:
        raise bad(None, "the request body is nested too deeply", code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad(None, f"the request body must be a JSON object, got {_tname(body)}", code="invalid_json")
    try:  # JSON allows escaped lone surrogates ("\ud800"), which no tokenizer can encode
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as e:
        raise bad(None, f"the request body holds malformed Unicode (a lone surrogate): {e.reason}",
                  code="invalid_unicode") from None
    except RecursionError:
        raise bad(None, "the request body is nested too deeply", code="invalid_json") from None
    return body


def _tname(v: Any) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "an array",
            dict: "an object", type(None): "null"}.get(type(v), type(v).__name__)


_KINDS = {
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v),
    "boolean": lambda v: isinstance(v, bool),
    "string": lambda v: isinstance(v, str),
    "object": lambda v: isinstance(v, dict),
}


def get(body: dict, name: str, kind: str, default=None):
    """body[name] checked against a JSON type; null or absent gives `default`."""
    v = body.get(name)
    if v is None:
        return default
    if not _KINDS[kind](v):
        article = "an" if kind[0] in "aeiou" else "a"
        raise bad(name, f"invalid type for '{name}': expected {article} {kind}, got {_tname(v)}")
    return v


def token_ids(v: Any, name: str, vocab_size: int) -> list[int]:
    if not isinstance(v, list) or not all(_KINDS["integer"](t) for t in v):
        raise bad(name, f"'{name}' must be an array of integer token ids")
    try:
        check_token_ids(v, vocab_size, name)  # the engine's rule
    except ParamError as e:
        raise bad(name, str(e)) from None
    return v


def _sampling(body: dict, vocab_size: int, r_max: int) -> tuple[dict, bool]:
    """The shared sampling fields (OpenAI's, vLLM's top_k / stop_token_ids / ignore_eos, and ours)."""
    max_tokens = get(body, "max_tokens", "integer")
    if max_tokens is not None and max_tokens < (0 if body.get("echo") is True else 1):
        raise bad("max_tokens", f"'max_tokens' must be at least 1 (0 only with echo), got {max_tokens}")
    completion = get(body, "max_completion_tokens", "integer")
    if completion is not None:  # OpenAI's newer name wins when both are sent, as in vLLM
        if completion < 1:
            raise bad("max_completion_tokens", f"'max_completion_tokens' must be at least 1, got {completion}")
        max_tokens = completion
    temperature = get(body, "temperature", "number", 1.0)
    if temperature < 0:
        raise bad("temperature", f"'temperature' must be >= 0, got {temperature}")
    top_p = get(body, "top_p", "number", 1.0)
    if not 0 < top_p <= 1:
        raise bad("top_p", f"'top_p' must be in (0, 1], got {top_p}")
    top_k = get(body, "top_k", "integer", 0)
    if top_k < -1:
        raise bad("top_k", f"'top_k' must be -1 or 0 (off) or a positive integer, got {top_k}")
    seed = get(body, "seed", "integer")
    if seed is not None and not 0 <= seed < 2**63:
        raise bad("seed", f"'seed' must be a non-negative 64-bit integer, got {seed}")
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    elif not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise bad("stop", f"invalid type for 'stop': expected a string or an array of strings, got {_tname(stop)}")
    if len(stop) > MAX_STOP or any(not s or len(s) > MAX_STOP_LEN for s in stop):
        raise bad("stop", f"'stop' takes at most {MAX_STOP} non-empty strings of at most {MAX_STOP_LEN} characters")
    stop_ids = token_ids(body.get("stop_token_ids") or [], "stop_token_ids", vocab_size)
    for name in ("presence_penalty", "frequency_penalty"):
        if get(body, name, "number", 0.0) != 0:
            raise bad(name, f"'{name}' is not supported by this server (use 0)")
    if body.get("logit_bias"):
        raise bad("logit_bias", "'logit_bias' is not supported by this server")
    ignore_eos = get(body, "ignore_eos", "boolean", False)
    # extensions: the per-request exit policy
    thr = get(body, "exit_threshold", "number")
    r_lo, r_hi = get(body, "r_min", "integer"), get(body, "r_max", "integer")
    for name, v in (("r_min", r_lo), ("r_max", r_hi)):
        if v is not None and not 1 <= v <= r_max:
            raise bad(name, f"'{name}' must be in [1, {r_max}] (the model's r_max), got {v}")
    if r_lo is not None and r_hi is not None and r_lo > r_hi:
        raise bad("r_min", f"'r_min' ({r_lo}) exceeds 'r_max' ({r_hi})")
    speculate = get(body, "speculate", "boolean", True)  # opt out of the engine's self-speculation
    # vLLM's extra field (not a sampling parameter: AsyncEngine._add hands it to add_request); a
    # non-zero one under --scheduling-policy fcfs is refused by the engine's own check
    priority = get(body, "priority", "integer", 0)
    sampling = dict(max_tokens=max_tokens, temperature=float(temperature), top_k=max(top_k, 0), top_p=float(top_p),
                    seed=seed, stop=stop, stop_token_ids=list(stop_ids), ignore_eos=ignore_eos,
                    exit_threshold=None if thr is None else float(thr), r_min=r_lo, r_max=r_hi, speculate=speculate,
                    priority=priority)
    return sampling, max_tokens is not None


def _n(body: dict, prompts: int) -> int:
    """n (choices per prompt); best_of is accepted only when it changes nothing (= n)."""
    n = get(body, "n", "integer", 1)
    if n < 1:
        raise bad("n", f"'n' must be at least 1, got {n}")
    best_of = get(body, "best_of", "integer")
    if best_of is not None and best_of != n:
        raise bad("best_of", f"'best_of' is not supported (only best_of = n, got best_of={best_of}, n={n})")
    if prompts * n > MAX_CHOICES:
        raise bad("n", f"at most {MAX_CHOICES} choices (prompts x n) per request, got {prompts * n}")
    return n


def _common(body: dict) -> tuple[str | None, bool, bool, bool]:
    """model, stream, and stream_options' include_usage and continuous_usage_stats (vLLM's: the
    running usage on every chunk; it needs include_usage, as in vLLM)."""
    model = get(body, "model", "string")
    stream = get(body, "stream", "boolean", False)
    opts = get(body, "stream_options", "object")
    include_usage = continuous = False
    if opts is not None:
        if not stream:
            raise bad("stream_options", "'stream_options' is only allowed when 'stream' is true")
        include_usage = bool(get(opts, "include_usage", "boolean", False))
        continuous = include_usage and bool(get(opts, "continuous_usage_stats", "boolean", False))
    return model, stream, include_usage, continuous


def parse_completion(body: dict, vocab_size: int, r_max: int, default_echo_depth: str = "full") -> GenRequest:
    """A completions request. With `echo`, each prompt token's log-prob (after the first) comes from
    the full-depth prefill by default (vLLM's meaning: the prompt is prefilled at full depth);
    `echo_logprobs_depth: "policy"` (or the server's --echo-logprobs-depth policy) teacher-forces
    the prompt instead: token 1 from the prefill of token 0, every later one decoded through the
    exit policy, so loglikelihood tasks sent as one prompt show the policy's effect."""
    model, stream, include_usage, continuous = _common(body)
    if "prompt" not in body or body["prompt"] is None:
        raise bad("prompt", "'prompt' is required")
    p = body["prompt"]
    # a string, an array of token ids, or an array of either (a batch: one choice per prompt and n)
    many = isinstance(p, list) and bool(p) and all(isinstance(x, (str, list)) for x in p)
    prompts = []
    for i, x in enumerate(p if many else [p]):
        where = f"prompt[{i}]" if many else "prompt"
        if isinstance(x, str):
            if not x:
                raise bad("prompt", f"'{where}' is empty")
        elif isinstance(x, list):
            if not x:
                raise bad("prompt", f"'{where}' is empty")
            x = token_ids(x, "prompt", vocab_size)
        else:
            raise bad("prompt", f"invalid type for '{where}': expected a string or an array of token ids, got "
                                f"{_tname(x)}")
        prompts.append(x)
    n = _n(body, len(prompts))
    echo = get(body, "echo", "boolean", False)
    if echo and stream:
        raise bad("echo", "'echo' is not supported with 'stream'")
    if body.get("suffix"):
        raise bad("suffix", "'suffix' is not supported by this server")
    lp = get(body, "logprobs", "integer")
    if lp is not None and not 0 <= lp <= MAX_LOGPROBS:
        raise bad("logprobs", f"'logprobs' must be in [0, {MAX_LOGPROBS}], got {lp}")
    echo_depth = get(body, "echo_logprobs_depth", "string", default_echo_depth)
    if echo_depth not in ECHO_DEPTHS:
        raise bad("echo_logprobs_depth", f"'echo_logprobs_depth' must be one of {list(ECHO_DEPTHS)}, got {echo_depth!r}")
    sampling, given = _sampling(body, vocab_size, r_max)
    if not given:  # OpenAI's default for completions, lowered to what the context leaves (AsyncEngine._add)
        sampling["max_tokens"] = 16
    sampling["logprobs"] = lp is not None
    sampling["top_logprobs"] = lp or 0
    return GenRequest("completion", prompts[0], None, sampling, given, stream, include_usage, lp is not None, model,
                      prompts=prompts, n=n, echo=echo, top_logprobs=lp or 0, echo_depth=echo_depth,
                      continuous_usage=continuous)


def _content(v: Any, where: str) -> str:
    if isinstance(v, str):
        return v
    if isinstance(v, list):  # content parts: text only
        out = []
        for part in v:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad("messages", f"{where}.content: only text content parts are supported")
            out.append(part["text"])
        return "".join(out)
    raise bad("messages", f"{where}.content must be a string or an array of text parts, got {_tname(v)}")


def parse_chat(body: dict, vocab_size: int, r_max: int) -> GenRequest:
    model, stream, include_usage, continuous = _common(body)
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad("messages", "'messages' must be a non-empty array of {role, content} objects")
    if len(msgs) > MAX_MESSAGES:
        raise bad("messages", f"at most {MAX_MESSAGES} messages per request")
    clean = []
    for i, m in enumerate(msgs):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad("messages", f"{where} must be an object, got {_tname(m)}")
        role = m.get("role")
        if role not in ROLES:
            raise bad("messages", f"{where}.role must be one of {list(ROLES)}, got {role!r}")
        content = m.get("content")
        clean.append({"role": role, "content": "" if content is None and role == "assistant"
                      else _content(content, where)})
    for name in ("tools", "functions"):
        if body.get(name):
            raise bad(name, f"'{name}' is not supported by this server")
    rf = get(body, "response_format", "object")
    if rf is not None and rf.get("type") not in SUPPORTED_RESPONSE_FORMATS:
        raise bad("response_format", "only the 'text' response format is supported")
    lp = get(body, "logprobs", "boolean", False)
    top = get(body, "top_logprobs", "integer", 0)
    if not 0 <= top <= MAX_LOGPROBS:
        raise bad("top_logprobs", f"'top_logprobs' must be in [0, {MAX_LOGPROBS}], got {top}")
    if top and not lp:
        raise bad("top_logprobs", "'top_logprobs' needs 'logprobs': true")
    n = _n(body, 1)
    sampling, given = _sampling(body, vocab_size, r_max)
    sampling["logprobs"] = lp
    sampling["top_logprobs"] = top
    return GenRequest("chat", None, clean, sampling, given, stream, include_usage, lp, model, n=n, top_logprobs=top,
                      continuous_usage=continuous)


def render_chat(messages: list[dict], tokenizer) -> str:
    """The tokenizer's chat template, or a plain `role: content` transcript when it has none."""
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"


END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<|endoftext|>")


def end_of_turn_ids(tokenizer) -> list[int]:
    """Token ids that end an assistant turn under common chat templates (stop ids for chat)."""
    vocab = tokenizer.get_vocab() if tokenizer is not None else {}
    return [vocab[t] for t in END_OF_TURN if t in vocab]

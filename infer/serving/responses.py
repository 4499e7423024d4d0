"""OpenAI response bodies from engine `Delta`s: choices, log-probs (completions' and chat's
formats), echo (the prompt before the output), usage, SSE framing. Pure Python."""
from __future__ import annotations

import json

from .async_engine import Delta


def usage(prompt_tokens: int, depths: list[int] | list[list[int]]) -> dict:
    """OpenAI usage, plus the mean exit depth of the decoded tokens (the first token of each choice
    comes from the prefill, at full depth, and is left out as in the engine's mean)."""
    per = depths if depths and isinstance(depths[0], list) else [depths]
    n = sum(len(d) for d in per)
    adaptive = [x for d in per for x in d[1:]]
    return {"prompt_tokens": prompt_tokens, "completion_tokens": n, "total_tokens": prompt_tokens + n,
            "mean_exit_depth": sum(adaptive) / len(adaptive) if adaptive else None}


def chat_top(top: dict[str, float], k: int) -> list[dict]:
    best = sorted(top.items(), key=lambda kv: -kv[1])[:k]
    return [{"token": t, "logprob": lp, "bytes": list(t.encode())} for t, lp in best]


def logprobs(kind: str, d: Delta, offset: int, k: int = 0) -> dict | None:
    if d.logprobs is None:
        return None
    if kind == "chat":
        tops = d.top or [{}] * len(d.tokens)
        return {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode()),
                             "top_logprobs": chat_top(top, k) if k else []}
                            for t, lp, top in zip(d.tokens, d.logprobs, tops)]}
    offsets = []
    for t in d.tokens:
        offsets.append(offset)
        offset += len(t)
    return {"tokens": d.tokens, "token_logprobs": d.logprobs, "top_logprobs": d.top, "text_offset": offsets}


def echo_choice(d: Delta | None, forced: Delta | None, r_max: int, drop_output: bool) -> Delta:
    """One completion choice with `echo`: the prompt's text, tokens and log-probs, then the output's
    (none with max_tokens 0). `forced` (echo_logprobs_depth "policy") is the teacher-forced scoring
    of prompt[1:]; without it the prompt's log-probs are those of the full-depth prefill."""
    if forced is not None and forced.prompt["forced"]:
        p = forced.prompt
        prompt_ids, text = p["token_ids"] + forced.token_ids, p["text"]
        tokens, lps, tops = p["tokens"] + forced.tokens, [None] + forced.logprobs, [None] + forced.top
        depths = [None] + forced.exit_depths
    else:  # (a 1-token prompt under "policy" has nothing to force: its scoring request is a plain prefill)
        p = (forced or d).prompt
        prompt_ids, text, tokens, lps, tops = p["token_ids"], p["text"], p["tokens"], p["logprobs"], p["top"]
        depths = [None] + [r_max] * (len(prompt_ids) - 1)  # the prefill runs at full depth
    out = d if d is not None and not drop_output else Delta([], [], "", [], [], d.finish_reason if d else "length",
                                                            top=[])
    e = Delta(out.token_ids, out.exit_depths, text + out.text, lps + (out.logprobs or []),
              tokens + (out.tokens or []), out.finish_reason, top=tops + (out.top or []))
    e.prompt = {"token_ids": prompt_ids, "exit_depths": depths}
    return e


def choice(kind: str, d: Delta, stream: bool, offset: int = 0, index: int = 0, k: int = 0) -> dict:
    c = {"index": index}
    if kind == "chat" and stream:
        c["delta"] = {"content": d.text} if d.text or not d.finish_reason else {}
    elif kind == "chat":
        c["message"] = {"role": "assistant", "content": d.text}
    else:
        c["text"] = d.text
    c.update(logprobs=logprobs(kind, d, offset, k), finish_reason=d.finish_reason, token_ids=d.token_ids,
             exit_depths=d.exit_depths)
    if d.prompt is not None and "exit_depths" in d.prompt:  # echo
        c.update(prompt_token_ids=d.prompt["token_ids"], prompt_exit_depths=d.prompt["exit_depths"])
    return c


def sse(obj: dict | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, separators=(',', ':'))}\n\n"

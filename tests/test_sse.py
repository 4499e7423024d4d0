"""The raw SSE streams, read line by line as vLLM's benchmark_serving.py, SGLang's bench_serving.py
and guidellm read them (they time TTFT at the first chunk and take usage from wherever it appears):
chat's role chunk goes out with the first token, `ignore_eos` holds in chat as in completions, and
usage comes once, in a final `choices: []` chunk, only with `stream_options.include_usage`.
One in-process server on checkpoints/ouro-demo (a trained chat model) with the engine's defaults."""
import json
import queue
import threading
import time
from pathlib import Path

import httpx
import pytest

from infer import EngineConfig, LLMEngine
from infer.serving.async_engine import AsyncEngine
from infer.serving.protocol import end_of_turn_ids
from infer.serving.server import build_app
from looplm import load_pretrained, load_tokenizer
from test_serve import ServerThread, model_dir, start  # noqa: F401 (model_dir: a fixture)

DEMO = Path(__file__).resolve().parents[1] / "checkpoints" / "ouro-demo"
CHAT = [{"role": "user", "content": "Tell me about the history of the city."}]
PROMPT = "The history of the city is long and the river"


@pytest.fixture(scope="module")
def served():
    engine = LLMEngine(load_pretrained(DEMO), EngineConfig(), load_tokenizer(DEMO))
    aeng = AsyncEngine(engine)
    srv = ServerThread(build_app(aeng, "ouro-demo"))
    yield srv, aeng
    srv.stop()
    assert engine.blocks.all_free


def parse(lines) -> list:
    """The `data:` payloads of an SSE body (JSON objects; the final "[DONE]" checked and dropped)."""
    out = []
    for line in lines:
        if not line:
            continue
        assert line.startswith("data: "), line
        out.append(line[6:] if line == "data: [DONE]" else json.loads(line[6:]))
    assert out and out[-1] == "[DONE]" and out.count("[DONE]") == 1, out[-3:]
    assert not any("error" in e for e in out[:-1]), out
    return out[:-1]


def events(url: str, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", url + path, json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        return parse(list(r.iter_lines()))


def token_ids(evs: list[dict], index: int = 0) -> list[int]:
    return [t for e in evs for c in e["choices"] if c["index"] == index for t in c.get("token_ids", [])]


# ---------------------------------------------------------------------------- (a) the role chunk
def test_chat_role_chunk_comes_with_the_first_token(served, monkeypatch):
    """No chunk before the engine has a token: the engine is held before its first stage, and the
    stream stays silent; once released, the role chunk leads, right before the first token's."""
    srv, aeng = served
    gate, orig = threading.Event(), aeng.engine.step

    def held():
        gate.wait(30)
        return orig()
    monkeypatch.setattr(aeng.engine, "step", held)
    got: queue.Queue = queue.Queue()

    def read():
        try:
            with httpx.stream("POST", srv.url + "/v1/chat/completions", timeout=60,
                              json={"messages": CHAT, "max_tokens": 6, "temperature": 0, "stream": True}) as r:
                got.put(r.status_code)
                for line in r.iter_lines():
                    got.put(line)
        finally:
            got.put(None)
    t = threading.Thread(target=read, daemon=True)
    t.start()
    try:
        deadline = time.monotonic() + 30
        while not aeng.engine.has_unfinished():  # the request is in the engine, held before its prefill
            assert time.monotonic() < deadline and t.is_alive()
            time.sleep(0.01)
        time.sleep(1.0)
        early = [x for x in list(got.queue) if isinstance(x, str) and x]
        assert early == [], early  # no chunk while no token exists
        tokens_before = aeng.counters["generation_tokens"]
    finally:
        gate.set()
    t.join(60)
    seen = []
    while (x := got.get(timeout=5)) is not None:
        seen.append(x)
    assert seen[0] == 200
    lines = seen[1:]
    evs = parse(lines)
    assert aeng.counters["generation_tokens"] > tokens_before
    first, second = evs[0]["choices"][0], evs[1]["choices"][0]
    assert first["delta"] == {"role": "assistant", "content": ""} and first["finish_reason"] is None
    assert second["token_ids"] and "role" not in second["delta"]  # the first token follows at once
    assert sum("role" in c["delta"] for e in evs for c in e["choices"]) == 1
    assert len(token_ids(evs)) == 6 and evs[-1]["choices"][0]["finish_reason"] in ("length", "stop")


def test_chat_role_chunk_once_per_choice(served):
    evs = events(served[0].url, "/v1/chat/completions",
                 {"messages": CHAT, "max_tokens": 5, "n": 2, "temperature": 0.9, "seed": 3})
    for i in (0, 1):
        mine = [c for e in evs for c in e["choices"] if c["index"] == i]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""}
        assert mine[1]["token_ids"] and all("role" not in c["delta"] for c in mine[1:])
        assert len(token_ids(evs, i)) <= 5 and mine[-1]["finish_reason"] in ("length", "stop")


# ---------------------------------------------------------------------------- (b) ignore_eos in chat
def test_chat_ignore_eos_runs_through_end_of_turn(model_dir):
    """Sampled chat requests with ignore_eos give max_tokens tokens even where they sample an
    end-of-turn id (the chat template's stop ids are EOS ids, which ignore_eos drops, as vLLM
    does); without it the same seed stops at that token. On test_serve's random tiny-vocab chat
    model, which samples end-of-turn ids often (the trained demo model rarely does)."""
    srv, aeng = start(model_dir)
    try:
        eot = set(end_of_turn_ids(aeng.tokenizer)) | aeng.engine.eos_ids
        n, through = 48, None
        for seed in range(16):
            body = {"messages": CHAT, "max_tokens": n, "temperature": 1.0, "seed": seed}
            evs = events(srv.url, "/v1/chat/completions", {**body, "ignore_eos": True})
            ids = token_ids(evs)
            assert len(ids) == n and evs[-1]["choices"][0]["finish_reason"] == "length", (seed, ids)
            if any(t in eot for t in ids[:-1]):
                through = body, ids
                break
        assert through, "no sample reached an end-of-turn token: the check proves nothing"
        body, ids = through
        k = next(j for j, t in enumerate(ids) if t in eot)
        evs = events(srv.url, "/v1/chat/completions", body)  # the default still stops at the end of turn
        assert token_ids(evs) == ids[:k + 1] and evs[-1]["choices"][0]["finish_reason"] == "stop"
        comp = events(srv.url, "/v1/completions", {"prompt": "hello there", "max_tokens": n, "temperature": 1.0,
                                                   "seed": body["seed"], "ignore_eos": True})
        assert len(token_ids(comp)) == n  # as completions always did
    finally:
        srv.stop()
    assert aeng.engine.blocks.all_free


# ---------------------------------------------------------------------------- (c) usage
@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 7, "temperature": 0}),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 7, "temperature": 0}),
    ("/v1/completions", {"prompt": [PROMPT, "Hello"], "n": 2, "max_tokens": 4, "temperature": 0.8, "seed": 1}),
], ids=["chat", "completions", "completions-4-choices"])
def test_usage_only_when_asked_and_once(served, path, body):
    url = served[0].url
    plain = events(url, path, body)
    assert all("usage" not in e for e in plain), [e for e in plain if "usage" in e]
    assert all(e["choices"] for e in plain)
    evs = events(url, path, {**body, "stream_options": {"include_usage": True}})
    *chunks, last = evs
    assert all(e["choices"] and "usage" in e and e["usage"] is None for e in chunks)  # OpenAI: null until the end
    assert last["choices"] == [] and last["usage"] is not None
    whole = httpx.post(url + path, json=body, timeout=60).json()
    n = len(whole["choices"])
    assert last["usage"]["completion_tokens"] == sum(len(token_ids(evs, i)) for i in range(n))
    assert last["usage"]["prompt_tokens"] == whole["usage"]["prompt_tokens"]
    assert last["usage"]["total_tokens"] == last["usage"]["prompt_tokens"] + last["usage"]["completion_tokens"]
    if "seed" not in body:  # greedy: the stream is the non-streamed response
        assert last["usage"] == whole["usage"]
        assert token_ids(evs) == token_ids(plain) == whole["choices"][0]["token_ids"]


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 7, "temperature": 0, "ignore_eos": True}),
    ("/v1/completions", {"prompt": [PROMPT, "Hello"], "n": 2, "max_tokens": 4, "temperature": 0.8, "seed": 1,
                         "ignore_eos": True}),
], ids=["chat", "completions-4-choices"])
def test_continuous_usage_stats_on_every_chunk(served, path, body):
    """vLLM's stream_options.continuous_usage_stats: every chunk carries the usage so far (the
    prompt tokens, and the tokens sent up to and including that chunk), then the final usage chunk."""
    url = served[0].url
    evs = events(url, path, {**body, "stream_options": {"include_usage": True, "continuous_usage_stats": True}})
    *chunks, last = evs
    assert last["choices"] == [] and all(e["choices"] for e in chunks)
    sent = 0
    for e in chunks:
        sent += sum(len(c.get("token_ids", [])) for c in e["choices"])
        u = e["usage"]
        assert u["prompt_tokens"] == last["usage"]["prompt_tokens"] and u["completion_tokens"] == sent
        assert u["total_tokens"] == u["prompt_tokens"] + sent
    assert sent == last["usage"]["completion_tokens"] > 0
    # without include_usage it changes nothing (vLLM needs both)
    assert all("usage" not in e for e in events(url, path, {**body, "stream_options": {"continuous_usage_stats": True}}))


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"messages": CHAT}), ("/v1/completions", {"prompt": PROMPT})], ids=["chat", "completions"])
def test_max_completion_tokens_wins_over_max_tokens(served, path, body):
    url = served[0].url
    body = {**body, "temperature": 0, "ignore_eos": True}
    r = httpx.post(url + path, json={**body, "max_tokens": 5, "max_completion_tokens": 3}, timeout=60).json()
    assert r["usage"]["completion_tokens"] == 3, r
    r = httpx.post(url + path, json={**body, "max_tokens": 5}, timeout=60).json()
    assert r["usage"]["completion_tokens"] == 5
    r = httpx.post(url + path, json={**body, "max_tokens": 2, "max_completion_tokens": 0}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_completion_tokens"

"""The OpenAI-compatible server, driven by the real `openai` client (and raw httpx for malformed
input) against servers started here on free 127.0.0.1 ports: uvicorn in a thread for in-process
checks, one `python -m infer.serve` subprocess for the command line and graceful shutdown."""
import asyncio
import os
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from infer import LLM, EngineConfig, LLMEngine, SamplingParams
from infer.serving.async_engine import AsyncEngine
from infer.serving.server import build_app
from looplm import load_pretrained, load_tokenizer, save_pretrained, tiny_model
from train.tokenizer import save_tokenizer, train_bpe

from helpers import wait_for_server

ROOT = Path(__file__).resolve().parents[1]
TEXT = "The quick brown fox jumps over the lazy dog. Hello world, hello there! " * 3
NAME = "tiny-chat"
CTX = 512  # the ouro-tiny preset's context


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("model") / NAME
    save_tokenizer(train_bpe([TEXT] * 20, vocab_size=300), out)
    save_pretrained(tiny_model("ouro-tiny", vocab_size=300), out, tokenizer=load_tokenizer(out))
    return out


class ServerThread:
    """uvicorn serving `app` from a thread, on a free loopback port."""

    def __init__(self, app):
        import socket

        import uvicorn
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="error", timeout_graceful_shutdown=2))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "server did not start"
            time.sleep(0.02)

    def stop(self):
        self.server.should_exit = True
        self.thread.join(15)
        assert not self.thread.is_alive()


def start(model_dir: Path, max_waiting: int = 256, api_key: str | None = None, stream_interval: int = 1,
          **engine_kw):
    model = load_pretrained(model_dir)
    engine = LLMEngine(model, EngineConfig(**{"max_batch_size": 16, **engine_kw}), load_tokenizer(model_dir))
    aeng = AsyncEngine(engine, max_waiting=max_waiting, stream_interval=stream_interval)
    return ServerThread(build_app(aeng, NAME, api_key=api_key, max_request_bytes=64 * 1024)), aeng


@pytest.fixture(scope="module")
def served(model_dir):
    srv, aeng = start(model_dir)
    yield srv, aeng
    srv.stop()
    assert aeng.engine.blocks.all_free


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served[0].url + "/v1", api_key="unused", max_retries=0, timeout=60)


def metrics(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=10).text
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, v = line.rsplit(" ", 1)
            out[re.sub(r'model_name="[^"]*",?', "", key).replace("{}", "")] = float(v)
    return out


def wait_idle(url: str, timeout: float = 10.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(url)
        if (m["cdb_num_requests_running"], m["cdb_num_requests_waiting"], m["cdb_kv_cache_all_free"]) == (0, 0, 1):
            return m
        assert time.monotonic() < deadline, f"server not idle: {m}"
        time.sleep(0.05)


# ---------------------------------------------------------------------------- the happy paths
def test_models_health_metrics(served, client):
    srv, _ = served
    assert [m.id for m in client.models.list().data] == [NAME]
    assert httpx.get(srv.url + "/health").json() == {"status": "ok"}
    m = metrics(srv.url)
    for key in ("cdb_num_requests_running", "cdb_num_requests_waiting", "cdb_kv_cache_usage_perc",
                'cdb_queue_length{stage="core"}', "cdb_generation_tokens_per_second", "cdb_mean_exit_depth"):
        assert key in m, key


def test_metrics_has_vllms_request_histograms(model_dir):
    """vLLM's request histograms under vLLM's names, read with prometheus_client's parser (what
    Prometheus scrapers use): one observation per request (inter-token: per interval), sums equal
    to the requests' token counts, buckets cumulative up to +Inf. One slot, so later requests queue."""
    from prometheus_client.parser import text_string_to_metric_families

    srv, aeng = start(model_dir, max_batch_size=1)
    lens, outs = [3, 5, 8, 13], [2, 4, 6, 3]
    try:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        with ThreadPoolExecutor(4) as ex:
            list(ex.map(lambda a: c.completions.create(model=NAME, prompt=list(range(1, a[0] + 1)), max_tokens=a[1],
                                                       extra_body={"ignore_eos": True}), zip(lens, outs)))
        fams = {f.name: f for f in text_string_to_metric_families(httpx.get(srv.url + "/metrics").text)}
    finally:
        srv.stop()

    def hist(name: str) -> tuple[list[tuple[float, float]], float, float]:
        f = fams[name]
        assert f.type == "histogram", (name, f.type)
        assert all(x.labels["model_name"] == NAME for x in f.samples)
        b = [(float(x.labels["le"]), x.value) for x in f.samples if x.name == name + "_bucket"]
        total = next(x.value for x in f.samples if x.name == name + "_count")
        assert [v for _, v in b] == sorted(v for _, v in b) and b[-1] == (float("inf"), total)
        return b, next(x.value for x in f.samples if x.name == name + "_sum"), total

    secs = {}
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds"):
        _, secs[name], n = hist("vllm:" + name)
        assert n == 4 and secs[name] >= 0
    assert secs["request_queue_time_seconds"] <= secs["time_to_first_token_seconds"] \
        <= secs["e2e_request_latency_seconds"]
    for name in ("time_per_output_token_seconds", "inter_token_latency_seconds"):
        assert hist("vllm:" + name)[2] == sum(o - 1 for o in outs)
    buckets, total, n = hist("vllm:request_prompt_tokens")
    assert (total, n) == (sum(lens), 4) and dict(buckets)[5.0] == 2 and dict(buckets)[10.0] == 3
    assert hist("vllm:request_generation_tokens")[1:] == (sum(outs), 4)
    assert fams["cdb_prompt_tokens"].type == "counter"  # (the parser drops _total) the cdb_ series parse too


def test_completion_matches_offline_engine(model_dir, client):
    prompt = "hello world, the quick"
    r = client.completions.create(model=NAME, prompt=prompt, max_tokens=12, temperature=0)
    c = r.choices[0]
    ref = LLM(model_dir, max_batch_size=4).generate(prompt, SamplingParams(max_tokens=12))[0]
    assert c.token_ids == ref.token_ids and c.exit_depths == ref.exit_depths and c.text == ref.text
    assert c.finish_reason == ref.finish_reason
    assert r.usage.completion_tokens == len(c.token_ids) and r.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert all(1 <= d <= 4 for d in c.exit_depths)
    # token-id prompts work too
    r2 = client.completions.create(model=NAME, prompt=ref.prompt_token_ids, max_tokens=12, temperature=0)
    assert r2.choices[0].token_ids == c.token_ids


def test_chat_uses_template_and_streams(model_dir, client):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello there"}]
    r = client.chat.completions.create(model=NAME, messages=msgs, max_tokens=10, temperature=0)
    tok = load_tokenizer(model_dir)
    n_prompt = len(tok.encode(tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True),
                              add_special_tokens=False))
    assert r.usage.prompt_tokens == n_prompt
    assert r.choices[0].message.role == "assistant" and isinstance(r.choices[0].message.content, str)
    chunks = list(client.chat.completions.create(model=NAME, messages=msgs, max_tokens=10, temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    body = [ch for ch in chunks if ch.choices]
    assert body[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in body) == r.choices[0].message.content
    assert sum(len(ch.choices[0].model_extra.get("token_ids", [])) for ch in body) == r.usage.completion_tokens
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    assert body[-1].choices[0].finish_reason == r.choices[0].finish_reason


def test_completion_streaming_equals_nonstreaming(client):
    kw = dict(model=NAME, prompt="The lazy dog", max_tokens=20, temperature=0)
    full = client.completions.create(**kw).choices[0]
    chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    body = [ch for ch in chunks if ch.choices]
    assert "".join(ch.choices[0].text for ch in body) == full.text
    assert [t for ch in body for t in ch.choices[0].token_ids] == full.token_ids
    assert [d for ch in body for d in ch.choices[0].exit_depths] == full.exit_depths
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(full.token_ids)
    assert all(ch.usage is None for ch in body)  # usage once, in the final chunk (vLLM's, OpenAI's)


def test_stream_interval_sends_fewer_chunks_same_tokens(model_dir, client, capsys):
    """--stream-interval 4: the first token at once (TTFT), then chunks of >= 4 tokens (the last may
    hold fewer); the concatenated stream equals the unstreamed answer."""
    kw = dict(model=NAME, prompt="The lazy dog", max_tokens=21, temperature=0)
    full = client.completions.create(**kw).choices[0]
    srv, aeng = start(model_dir, stream_interval=4)
    try:
        c4 = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        body = [ch for ch in c4.completions.create(**kw, stream=True) if ch.choices]
        assert [t for ch in body for t in ch.choices[0].token_ids] == full.token_ids
        assert [d for ch in body for d in ch.choices[0].exit_depths] == full.exit_depths
        assert "".join(ch.choices[0].text for ch in body) == full.text
        sizes = [len(ch.choices[0].token_ids) for ch in body]
        assert all(n >= 4 for n in sizes[1:-1]), sizes
        assert len(body) <= 1 + -(-(len(full.token_ids) - 1) // 4), sizes  # vs 21 chunks at interval 1
        assert c4.completions.create(**kw).choices[0].token_ids == full.token_ids  # unstreamed: unchanged
    finally:
        srv.stop()
    with pytest.raises(ValueError, match="stream_interval"):
        AsyncEngine(aeng.engine, stream_interval=0)
    from infer.serving.cli import main
    with pytest.raises(SystemExit):  # refused before any weights load
        main(["--model", "no-such-dir", "--stream-interval", "0"])
    assert "--stream-interval must be >= 1" in capsys.readouterr().err


def test_stop_strings_and_token_ids(client):
    kw = dict(model=NAME, prompt="hello", max_tokens=48, temperature=0)
    full = client.completions.create(**kw).choices[0]
    m = re.search(r"[ -~]{2}", full.text[1:])
    assert m, f"no ASCII pair to stop on in {full.text!r}"
    stop = m.group()
    want = full.text[:full.text.find(stop)]
    r = client.completions.create(**kw, stop=[stop, "never-there"]).choices[0]
    assert r.finish_reason == "stop" and r.text == want
    streamed = list(client.completions.create(**kw, stop=stop, stream=True))
    assert "".join(ch.choices[0].text for ch in streamed) == want
    assert streamed[-1].choices[0].finish_reason == "stop"
    tid = full.token_ids[5]
    r = client.completions.create(**kw, extra_body={"stop_token_ids": [tid]}).choices[0]
    assert r.finish_reason == "stop" and r.token_ids == full.token_ids[:full.token_ids.index(tid) + 1]


def test_seed_reproducibility(client):
    kw = dict(model=NAME, prompt="hello", max_tokens=16, temperature=1.0, top_p=0.95)
    a = client.completions.create(**kw, seed=123).choices[0].token_ids
    b = client.completions.create(**kw, seed=123).choices[0].token_ids
    c = client.completions.create(**kw, seed=124).choices[0].token_ids
    assert a == b and a != c
    k1 = client.completions.create(**kw, seed=7, extra_body={"top_k": 1}).choices[0].token_ids
    greedy = client.completions.create(model=NAME, prompt="hello", max_tokens=16, temperature=0)
    assert k1 == greedy.choices[0].token_ids


def test_exit_extensions_and_logprobs(client):
    kw = dict(model=NAME, prompt="hello world", max_tokens=8, temperature=0)

    def depths(**extra):
        return client.completions.create(**kw, extra_body=extra).choices[0].exit_depths[1:]  # [0]: prefill, full depth
    assert set(depths(exit_threshold=0.0)) == {1}
    assert set(depths(exit_threshold=0.0, r_min=3)) == {3}
    assert set(depths(exit_threshold=1.0)) == {4}
    assert set(depths(exit_threshold=1.0, r_max=2)) == {2}
    r = client.completions.create(**kw, logprobs=1).choices[0]
    assert len(r.logprobs.token_logprobs) == len(r.token_ids) and all(lp <= 0 for lp in r.logprobs.token_logprobs)
    c = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=6,
                                       temperature=0, logprobs=True).choices[0]
    assert len(c.logprobs.content) == len(c.token_ids)


# ---------------------------------------------------------------------------- failure paths
def raw(url: str, path: str, content: bytes | str, **kw) -> httpx.Response:
    return httpx.post(url + path, content=content, headers={"content-type": "application/json"}, timeout=30, **kw)


def test_malformed_json_and_wrong_types(served):
    url = served[0].url
    for body in (b"{bad json", b"[1, 2]", b'{"prompt": "x", "temperature": NaN}'):
        r = raw(url, "/v1/completions", body)
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text
    cases = [("/v1/completions", '{"prompt": 5}', "prompt"),
             ("/v1/completions", '{"prompt": "x", "max_tokens": "ten"}', "max_tokens"),
             ("/v1/completions", '{"prompt": "x", "temperature": "hot"}', "temperature"),
             ("/v1/completions", '{"prompt": "x", "stream": "yes"}', "stream"),
             ("/v1/completions", '{"prompt": "x", "stop": 3}', "stop"),
             ("/v1/completions", '{"prompt": "x", "r_max": 1.5}', "r_max"),
             ("/v1/completions", '{"prompt": "x", "r_max": 99}', "r_max"),
             ("/v1/completions", '{"prompt": "x", "top_p": 0}', "top_p"),
             ("/v1/completions", '{"prompt": [1, 2, 100000]}', "prompt"),
             ("/v1/completions", '{"prompt": ["a", 5]}', "prompt"),
             ("/v1/completions", '{"prompt": ["a", ""]}', "prompt"),
             ("/v1/completions", '{"prompt": "x", "n": 0}', "n"),
             ("/v1/completions", '{"prompt": "x", "n": 2, "best_of": 3}', "best_of"),
             ("/v1/completions", '{"prompt": "x", "echo": true, "stream": true}', "echo"),
             ("/v1/completions", '{"prompt": "x", "max_tokens": 0}', "max_tokens"),
             ("/v1/completions", '{"prompt": "x", "logprobs": 50}', "logprobs"),
             ("/v1/completions", '{"prompt": "x", "echo": true, "echo_logprobs_depth": "deep"}', "echo_logprobs_depth"),
             ("/v1/completions", '{"prompt": "x", "exit_threshold": -1}', "exit_threshold"),
             ("/v1/completions", '{"prompt": "x", "exit_threshold": 5}', "exit_threshold"),
             ("/v1/chat/completions", '{"messages": "hi"}', "messages"),
             ("/v1/chat/completions", '{"messages": [{"role": "wizard", "content": "hi"}]}', "messages"),
             ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 3}',
              "top_logprobs")]
    for path, body, param in cases:
        r = raw(url, path, body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
        assert isinstance(r.json()["error"]["code"], str), r.text  # OpenAI's shape: a string code
    # malformed Unicode (a lone surrogate) and deep nesting are 400s, not 500s
    for body in ('{"prompt": "a\\ud800b"}', '{"messages": [{"role": "user", "content": "\\udfff"}]}',
                 "[" * 60_000, '{"prompt": ' + "[" * 30_000 + "]" * 30_000 + "}"):  # under the 64 KB limit
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        r = httpx.post(url + path, content=body, headers={"content-type": "application/json"}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", (body[:40], r.text)
    assert httpx.post(url + "/v1/nowhere", content="{}").json()["error"]["code"] == "not_found"
    r = raw(url, "/v1/completions", '{"prompt": "' + "x" * 70000 + '"}')
    assert r.status_code == 413 and "limit" in r.json()["error"]["message"]


def test_bad_values_via_openai_client(served, client):
    def err(**kw) -> openai.BadRequestError:
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(**{"model": NAME, "prompt": "hello", **kw})
        return e.value
    e = err(max_tokens=-5)
    assert e.param == "max_tokens" and "at least 1" in e.message
    e = err(model="gpt-4")
    assert e.param == "model" and e.code == "model_not_found" and "gpt-4" in e.message
    e = err(prompt=[5] * 600)
    assert e.param == "prompt" and e.code == "context_length_exceeded" and "512" in e.message
    e = err(prompt="zq7" * 400)  # text over the context
    assert e.param == "prompt" and e.code == "context_length_exceeded"
    e = err(prompt=[5] * 500, max_tokens=100)
    assert e.param == "max_tokens" and e.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as ce:
        client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi " * 600}])
    assert ce.value.param == "messages"
    assert served[1].alive and httpx.get(served[0].url + "/health").status_code == 200


def test_disconnect_mid_stream_frees_kv(served):
    url = served[0].url
    body = {"model": NAME, "prompt": "hello", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=30) as h, h.stream("POST", url + "/v1/completions", json=body) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        got = 0
        for line in lines:
            got += line.startswith("data: ")
            if got == 3:
                break
        m = metrics(url)
        assert m["cdb_num_requests_running"] == 1 and m["cdb_kv_cache_all_free"] == 0
    wait_idle(url)  # the client is gone: the request was aborted, its KV freed
    before = metrics(url)["cdb_generation_tokens_total"]
    with pytest.raises(httpx.ReadTimeout):  # a non-streaming client that gives up is noticed too
        httpx.post(url + "/v1/completions", json={**body, "stream": False, "max_tokens": 500}, timeout=0.3)
    wait_idle(url)
    assert metrics(url)["cdb_generation_tokens_total"] - before < 500  # aborted before the end


def test_64_concurrent_streams(served, monkeypatch):
    """64 streams at once all complete with their own token counts, and were served concurrently:
    the engine held many of them in one batch (peak running requests, read after every step)."""
    url, aeng = served[0].url, served[1]
    peak, step = [0], aeng.engine.step

    def counted_step():
        out = step()
        peak[0] = max(peak[0], aeng.engine.metrics()["running"])
        return out
    monkeypatch.setattr(aeng.engine, "step", counted_step)

    async def one(c: openai.AsyncOpenAI, i: int) -> tuple[int, int, int]:
        n = 4 + i % 13
        s = await c.completions.create(model=NAME, prompt=[3 + i, 7, 11], max_tokens=n, temperature=0.8, seed=i,
                                       stream=True, stream_options={"include_usage": True},
                                       extra_body={"ignore_eos": True})
        got, usage = 0, None
        async for ch in s:
            got += sum(len(c.token_ids) for c in ch.choices)
            usage = ch.usage or usage
        return n, got, usage.completion_tokens

    async def main():
        async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120) as c:
            return await asyncio.gather(*(one(c, i) for i in range(64)))
    res = asyncio.run(main())
    assert all(n == got == used for n, got, used in res), res
    wait_idle(url)
    print("peak running", peak[0])
    assert peak[0] >= 8, peak  # batched (max_batch_size 16), not one stream after another


def test_one_failing_request_does_not_fail_others(served, client, monkeypatch):
    srv, aeng = served
    orig = aeng.delta

    def flaky(s, pub):
        if s.prompt_ids[0] == 299:
            raise RuntimeError("boom")
        return orig(s, pub)
    monkeypatch.setattr(aeng, "delta", flaky)
    with pytest.raises(openai.InternalServerError, match="boom"):
        client.completions.create(model=NAME, prompt=[299, 5], max_tokens=5)
    with pytest.raises(openai.APIError, match="boom"):
        list(client.completions.create(model=NAME, prompt=[299, 5], max_tokens=5, stream=True))
    assert len(client.completions.create(model=NAME, prompt=[298, 5], max_tokens=5,
                                        extra_body={"ignore_eos": True}).choices[0].token_ids) == 5
    monkeypatch.undo()
    # an exception inside a stage fails the batch that was running, then the server goes on
    calls = {"n": 0}
    orig_step = aeng.engine.step

    def step_once_broken():
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("stage exploded")
        return orig_step()
    monkeypatch.setattr(aeng.engine, "step", step_once_broken)
    with pytest.raises(openai.InternalServerError, match="stage exploded"):
        client.completions.create(model=NAME, prompt=[5, 6], max_tokens=20, extra_body={"ignore_eos": True})
    monkeypatch.undo()
    assert len(client.completions.create(model=NAME, prompt=[5, 6], max_tokens=5,
                                        extra_body={"ignore_eos": True}).choices[0].token_ids) == 5
    m = wait_idle(srv.url)
    assert m["cdb_request_failure_total"] >= 3 and m["cdb_engine_step_errors_total"] == 1


def test_full_queue_gets_503_and_api_key(model_dir):
    srv, aeng = start(model_dir, max_waiting=1, api_key="s3cret", max_batch_size=1)
    try:
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=srv.url + "/v1", api_key="wrong", max_retries=0).models.list()
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="s3cret", max_retries=0, timeout=60)
        long = dict(model=NAME, prompt=[5, 6], max_tokens=400, stream=True, extra_body={"ignore_eos": True})
        a = c.completions.create(**long)  # holds the only slot
        next(iter(a))
        b = c.completions.create(**{**long, "max_tokens": 3})  # waits for the slot
        with pytest.raises(openai.APIStatusError) as e:
            c.completions.create(model=NAME, prompt=[5, 6], max_tokens=3)
        assert e.value.status_code == 503 and "--max-waiting" in e.value.message
        a.close()  # frees the slot: b runs
        assert sum(len(ch.choices[0].token_ids) for ch in b) == 3
        assert metrics(srv.url)["cdb_request_rejected_total"] == 1
        wait_idle(srv.url)
    finally:
        srv.stop()
    assert aeng.engine.blocks.all_free


@pytest.mark.slow
def test_cli_serves_and_drains_on_sigterm():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    p = subprocess.Popen([sys.executable, "-m", "infer.serve", "--model", "ouro-tiny", "--port", "0",
                          "--drain-timeout", "20", "--max-batch-size", "4"], cwd=ROOT, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url, _ = wait_for_server(p)  # after the "serving ... on URL" line
        c = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)
        assert c.completions.create(model="ouro-tiny", prompt=[1, 2, 3], max_tokens=4).usage.completion_tokens == 4
        with pytest.raises(openai.BadRequestError, match="tokenizer"):
            c.completions.create(model="ouro-tiny", prompt="text needs a tokenizer", max_tokens=4)
        s = c.completions.create(model="ouro-tiny", prompt=[1, 2, 3], max_tokens=300, stream=True,
                                 extra_body={"ignore_eos": True})
        it = iter(s)
        got = len(next(it).choices[0].token_ids)
        p.send_signal(signal.SIGTERM)  # graceful: the in-flight stream is drained, then the process exits
        got += sum(len(ch.choices[0].token_ids) for ch in it)
        assert got == 300
        assert p.wait(timeout=30) == 0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


# ---------------------------------------------------------------------------- pieces without a server
def test_chat_plain_fallback_and_end_of_turn_ids(model_dir):
    from infer.serving.protocol import end_of_turn_ids, render_chat
    msgs = [{"role": "user", "content": "hi"}]
    assert render_chat(msgs, None) == "user: hi\nassistant:"
    tok = load_tokenizer(model_dir)
    assert render_chat(msgs, tok) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert end_of_turn_ids(tok) == [2, 0] and end_of_turn_ids(None) == []


def test_bench_online_against_server(served):
    from infer.bench.online import arrival_gaps, run_rate, summarize, sustained_rate
    gaps = arrival_gaps(4000, rate=5.0, burstiness=1.0, seed=0)
    assert abs(gaps.mean() - 0.2) < 0.02 and abs(gaps.std() / gaps.mean() - 1) < 0.1  # Poisson: CV = 1
    res, dur = asyncio.run(run_rate(served[0].url, NAME, 50.0, [(5, 6), (3, 4), (9, 2)], 300, 0, 1.0, 30))
    s = summarize(res, dur)
    assert s["completed"] == 3 and s["failed"] == 0 and [r.output_len for r in res] == [6, 4, 2]
    r = res[0]
    assert r.ttft <= r.e2e and len(r.itl) <= r.output_len - 1
    assert s["tpot_ms"]["mean"] >= 0 and s["normalized_latency_s_per_token"] > 0
    assert sustained_rate([(1, 0.1, 0), (2, 0.2, 0), (4, 0.6, 0)], 0.4) == {
        "max_rate_within_limit": 2, "interpolated_rate_at_limit": 3.0}
    assert sustained_rate([(1, 0.5, 0)], 0.4)["max_rate_within_limit"] is None
    # --max-concurrency 1: a burst goes one request at a time (each is sent after the previous ended)
    res, _ = asyncio.run(run_rate(served[0].url, NAME, float("inf"), [(5, 6), (3, 4), (9, 2)], 300, 0, 1.0, 30,
                                  max_concurrency=1))
    assert [r.error for r in res] == [None] * 3
    spans = sorted((r.send, r.send + r.e2e) for r in res)
    assert all(b[0] >= a[1] for a, b in zip(spans, spans[1:]))
    with pytest.raises(ValueError, match="max_concurrency"):
        asyncio.run(run_rate(served[0].url, NAME, 1.0, [(5, 6)], 300, 0, 1.0, 30, max_concurrency=0))


def test_record_exits_writes_the_served_requests(model_dir, tmp_path, monkeypatch):
    """--record-exits FILE (issue 40, deliverable 3): at shutdown the file holds every finished
    request's lengths and exit scores; replayed under the server's policy they give the depths the
    server's tokens took; infer.sim reads it."""
    from infer.sim import replay as RP
    path = tmp_path / "served.exits.json"
    engine = LLMEngine(load_pretrained(model_dir), EngineConfig(max_batch_size=4, exit_threshold=0.55),
                       load_tokenizer(model_dir))
    aeng = AsyncEngine(engine, record_exits=path, model_name=NAME)
    seqs, add = [], engine.add_request

    def recorded(*a, **kw):
        s = add(*a, **kw)
        seqs.append(s)
        return s
    monkeypatch.setattr(engine, "add_request", recorded)
    srv = ServerThread(build_app(aeng, NAME))
    try:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=60)
        for i in range(3):
            c.completions.create(model=NAME, prompt=[3 + i, 7, 11, 13], max_tokens=5 + 3 * i,
                                 extra_body={"ignore_eos": True})
    finally:
        srv.stop()
    doc = RP.load(path)
    rows = RP.requests_of(doc, "server")
    assert doc["model"] == NAME and len(rows) == 3
    got = sorted(zip([(r["prompt_len"], r["output_len"]) for r in rows], RP.replay_depths(doc, "server", engine.policy)))
    assert got == sorted(((len(s.prompt_ids), len(s.output_ids)), s.exit_depths) for s in seqs)
    assert min(d for s in seqs for d in s.exit_depths[1:]) < engine.model.cfg.r_max  # tokens exited early


def test_record_exits_refuses_replicas():
    from infer.serving.cli import main
    with pytest.raises(SystemExit):
        main(["--model", "ouro-tiny", "--record-exits", "x.json", "--replicas", "2"])


def test_retrofitted_model_serves_latent_diff():
    """A retrofitted-recurrence checkpoint (the Llama layout, made by the public reference code:
    tests/fixtures/parity/retro_llama_a) answers through the server with Huginn's latent_diff criterion
    at adaptive depth: the tokens and exit depths of the offline engine at the same settings."""
    folder = ROOT / "tests" / "fixtures" / "parity" / "retro_llama_a"
    kw = dict(exit_criterion="latent_diff", exit_threshold=0.8)
    model = load_pretrained(folder, r_max=8)
    srv = ServerThread(build_app(AsyncEngine(LLMEngine(model, EngineConfig(max_batch_size=4, **kw))), "retro"))
    try:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        got = [c.completions.create(model="retro", prompt=p, max_tokens=8, temperature=0).choices[0]
               for p in ([5, 6, 7, 8, 9], [20, 30, 40])]
    finally:
        srv.stop()
    want = LLM(load_pretrained(folder, r_max=8), **kw).generate(
        [[5, 6, 7, 8, 9], [20, 30, 40]], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids and g.exit_depths == w.exit_depths
    assert len({d for g in got for d in g.exit_depths[1:]}) >= 3  # adaptive: several depths below r_max 8

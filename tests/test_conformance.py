"""Real scale, defaults: a checkpoint whose config.json says 65,536 tokens of context, served on a
CPU whose KV pool holds a few hundred tokens, used as a new user would, through every layer that
has a context length: the server (`python -m infer.serve`'s own setup, in-process), the lm-eval
model and `python -m infer.bench`. Nothing is set but the pool's size (`kv_cache_tokens`), so the
one context length every layer must use is the engine's `max_model_len` (the pool's tokens here),
never the checkpoint's. The model has a tiny hidden size and the demo's tokenizer."""
import json
import math
import subprocess
import sys
import types
from pathlib import Path

import httpx
import openai
import pytest

from looplm import load_tokenizer, save_pretrained, tiny_model
from test_serve import ServerThread

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "checkpoints" / "ouro-demo"
CONTEXT = 65_536  # the checkpoint's max_position
POOL = 300  # kv_cache_tokens asked for: the engine keeps whole blocks (18 x 16 = 288)
NAME = "ouro-64k"
CHAT = [{"role": "user", "content": "Tell me about the history of the city."}]
TEXT = "The history of the city is long and the river runs through it. " * 60  # well over the pool


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("conformance") / NAME
    tok = load_tokenizer(DEMO)
    vocab = json.loads((DEMO / "config.json").read_text())["vocab_size"]
    model = tiny_model("ouro-tiny", vocab_size=vocab, hidden_size=32, intermediate_size=64, num_heads=2,
                       num_kv_heads=1, head_dim=16, max_position=CONTEXT)
    save_pretrained(model, out, tokenizer=tok)
    assert json.loads((out / "config.json").read_text())["max_position_embeddings"] == CONTEXT
    return out


@pytest.fixture(scope="module")
def served(ckpt):
    from infer.serving.cli import make_server, parser
    server, sock = make_server(parser().parse_args(["--model", str(ckpt), "--port", "0",
                                                    "--kv-cache-tokens", str(POOL)]))
    sock.close()  # ServerThread binds its own
    aeng = server.config.app.state.aeng
    srv = ServerThread(server.config.app)
    yield srv, aeng
    srv.stop()
    assert aeng.engine.blocks.all_free


@pytest.fixture(scope="module")
def mml(served) -> int:
    n = served[1].engine.max_model_len
    assert n == POOL // 16 * 16 < CONTEXT  # the pool's whole blocks, far below the checkpoint's context
    return n


def post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=120)


def sse(url: str, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", url + path, json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200, r.read()
        lines = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    evs = [json.loads(x) for x in lines[:-1]]
    assert not any("error" in e for e in evs), evs
    return evs


def ids_of(evs: list[dict]) -> list[int]:
    return [t for e in evs for c in e["choices"] for t in c.get("token_ids", [])]


def fills(usage: dict, finish: str, mml: int) -> None:
    """A request without max_tokens runs to the end of max_model_len (or stops early)."""
    total = usage["prompt_tokens"] + usage["completion_tokens"]
    assert total == mml if finish == "length" else total < mml, (usage, finish)


# ---------------------------------------------------------------------------- the server
def test_server_reports_one_context_length(served, mml):
    url = served[0].url
    (m,) = httpx.get(url + "/v1/models").json()["data"]
    assert m["max_model_len"] == mml and m["engine"]["max_model_len"] == mml
    assert post(url, "/tokenize", {"prompt": "hello"}).json()["max_model_len"] == mml
    assert httpx.get(url + "/tokenizer_info").json()["model_max_length"] == mml


def test_chat_without_max_tokens(served, mml):
    """The issue's 400 ('request needs 128 KV tokens, more than the whole pool'): now a 200 whose
    default max_tokens is the rest of max_model_len, streamed or not."""
    url = served[0].url
    c = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)
    r = c.chat.completions.create(model=NAME, messages=CHAT, temperature=0)  # no max_tokens, as users send it
    ch = r.choices[0]
    fills(r.usage.model_dump(), ch.finish_reason, mml)
    evs = sse(url, "/v1/chat/completions", {"messages": CHAT, "temperature": 0})
    assert ids_of(evs) == ch.model_extra["token_ids"] and evs[-1]["choices"][0]["finish_reason"] == ch.finish_reason
    # sampled (the default temperature) through every end-of-turn id: runs to the end of max_model_len
    evs = sse(url, "/v1/chat/completions", {"messages": CHAT, "ignore_eos": True,
                                            "stream_options": {"include_usage": True}})
    assert evs[-2]["choices"][0]["finish_reason"] == "length" and evs[-1]["choices"] == []
    fills(evs[-1]["usage"], "length", mml)
    assert len(ids_of(evs)) == evs[-1]["usage"]["completion_tokens"] == mml - r.usage.prompt_tokens
    r8 = c.chat.completions.create(model=NAME, messages=CHAT, temperature=0, max_tokens=8)
    assert r8.choices[0].model_extra["token_ids"] == ch.model_extra["token_ids"][:8]


def test_completions_with_and_without_max_tokens(served, mml):
    url = served[0].url
    r = post(url, "/v1/completions", {"prompt": TEXT[:200], "temperature": 0}).json()
    assert r["usage"]["completion_tokens"] == 16 or r["choices"][0]["finish_reason"] == "stop"  # OpenAI's default
    long = [7] * (mml - 5)  # the default 16 is lowered to what the context leaves
    r = post(url, "/v1/completions", {"prompt": long, "temperature": 0, "ignore_eos": True}).json()
    assert r["usage"]["completion_tokens"] == 5 and r["choices"][0]["finish_reason"] == "length"
    r = post(url, "/v1/completions", {"prompt": long, "temperature": 0, "max_tokens": 5, "ignore_eos": True})
    assert r.status_code == 200 and len(r.json()["choices"][0]["token_ids"]) == 5  # exactly full
    evs = sse(url, "/v1/completions", {"prompt": [7, 8, 9], "max_tokens": mml - 3, "temperature": 0,
                                       "ignore_eos": True, "stream_options": {"include_usage": True}})
    assert len(ids_of(evs)) == mml - 3 and evs[-1]["choices"] == []
    fills(evs[-1]["usage"], "length", mml)


def test_too_long_requests_get_vllms_400(served, mml):
    url = served[0].url
    r = post(url, "/v1/completions", {"prompt": [7] * 20, "max_tokens": mml})
    e = r.json()["error"]
    assert r.status_code == 400 and e["param"] == "max_tokens" and e["code"] == "context_length_exceeded"
    assert e["message"].startswith(f"This model's maximum context length is {mml} tokens")
    assert f"you requested {mml} output tokens and your prompt contains 20 input tokens, for a total of " \
           f"{mml + 20} tokens" in e["message"]
    r = post(url, "/v1/completions", {"prompt": [7] * mml})  # no room left for one output token
    e = r.json()["error"]
    assert r.status_code == 400 and e["param"] == "prompt" and e["code"] == "context_length_exceeded"
    assert f"maximum context length is {mml} tokens" in e["message"] and f"{mml} input tokens" in e["message"]
    r = post(url, "/v1/chat/completions", {"messages": [{"role": "user", "content": TEXT}]})
    e = r.json()["error"]
    assert r.status_code == 400 and e["param"] == "messages" and e["code"] == "context_length_exceeded"
    assert f"maximum context length is {mml} tokens" in e["message"]
    assert served[1].alive and httpx.get(url + "/health").status_code == 200


# ---------------------------------------------------------------------------- the lm-eval model
def test_lm_eval_model_fits_its_windows(ckpt):
    from eval.lm import LoopedEvalLM
    lm = LoopedEvalLM(str(ckpt), kv_cache_tokens=POOL)
    n = lm.llm.engine.max_model_len
    assert lm.max_length == n == POOL // 16 * 16
    req = types.SimpleNamespace
    assert len(lm.tok_encode(TEXT)) > 2 * n  # several windows, each cut to fit
    (ll, _), (ll2, _) = lm.loglikelihood([req(args=(TEXT, " the river"), task_name="t"),
                                          req(args=("The city", " is long"), task_name="t")])
    (rolling,) = lm.loglikelihood_rolling([req(args=(TEXT,), task_name="t")])
    assert all(math.isfinite(x) and x < 0 for x in (ll, ll2, rolling))
    (out,) = lm.generate_until([req(args=(TEXT, {"until": ["\n\n"]}), task_name="t")])  # default max_gen_toks
    assert isinstance(out, str)
    assert lm.llm.engine.blocks.all_free


# ---------------------------------------------------------------------------- the offline bench
@pytest.mark.slow
def test_bench_runs_with_defaults(ckpt, tmp_path):
    """`python -m infer.bench` with its defaults (every workload and mode, lengths fitted to the
    context) but the fewest requests and repeats: the workloads must fit max_model_len."""
    out = tmp_path / "bench"
    p = subprocess.run([sys.executable, "-m", "infer.bench", "--model", str(ckpt), "--kv-cache-tokens", str(POOL),
                        "--num-requests", "2", "--repeats", "1", "--out", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    (path,) = out.glob("*.json")
    res = json.loads(path.read_text())
    assert res["workloads"]
    for w in res["workloads"]:
        assert w["results"]
        for r in w["results"]:
            assert r["engine_config"]["max_model_len"] == POOL // 16 * 16, (w["workload"], r["mode"])

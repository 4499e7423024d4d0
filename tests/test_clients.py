"""The tools users already have, against our code: stock lm-eval through the server (vLLM's
completions contract), lm-eval's own CLI with our model, and one-line errors from every infer / eval
command line. These start real processes on checkpoints/ouro-demo (tens of seconds in all)."""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

pytestmark = pytest.mark.slow  # every test here starts `python -m ...`, a console script or lm-eval's CLI

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "checkpoints" / "ouro-demo"
BIN = Path(sys.executable).parent
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "WANDB_MODE": "offline",
       "TOKENIZERS_PARALLELISM": "false", "LOOPLM_DEBUG": "", "PYTHONFAULTHANDLER": "1"}
TEXT = "The history of the city is long and the river"


class Server:
    """`python -m infer.serve` on a free port (the command line a user runs)."""

    def __init__(self, *args: str, model: Path = DEMO):
        self.proc = subprocess.Popen([sys.executable, "-m", "infer.serve", "--model", str(model), "--port", "0", *args],
                                     cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + 120
        self.lines = []
        try:
            while True:
                line = self.proc.stdout.readline()
                assert line or self.proc.poll() is None, "server exited: " + "".join(self.lines)
                self.lines.append(line)
                m = re.search(r"on (http://(127\.0\.0\.1):(\d+))", line)
                if m:  # the announced socket already listens (a connection made at once is not refused)
                    self.url = m.group(1)
                    socket.create_connection((m.group(2), int(m.group(3))), timeout=60).close()
                    break
                assert time.monotonic() < deadline, "server did not start: " + "".join(self.lines)
        except BaseException:  # a fixture that fails here never reaches stop(): leave no server behind
            self.proc.kill()
            raise

    def post(self, body: dict | str, path: str = "/v1/completions") -> httpx.Response:
        content = body if isinstance(body, str) else json.dumps(body)
        return httpx.post(self.url + path, content=content, headers={"content-type": "application/json"}, timeout=60)

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:  # fail with every thread's stack (faulthandler, see ENV)
            self.proc.send_signal(signal.SIGABRT)
            out = self.proc.communicate(timeout=30)[0]
            pytest.fail(f"the server did not exit 30 s after SIGTERM:\n{out[-6000:]}")


@pytest.fixture(scope="module")
def full_server():
    s = Server("--full-depth")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def policy_server():
    """The checkpoint's own exit policy (a learned gate), float64 so it can be compared exactly."""
    s = Server("--dtype", "float64")
    yield s
    s.stop()


def _lm_eval(*args: str, out: Path) -> dict:
    r = subprocess.run([str(BIN / "lm_eval"), "run", *args, "--output_path", str(out)], cwd=ROOT, env=ENV,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return json.loads(next(out.rglob("results_*.json")).read_text())


def _samples(out: Path, task: str) -> dict[int, list]:
    f = next(out.rglob(f"samples_{task}_*.jsonl"))
    return {d["doc_id"]: d["resps"] for d in map(json.loads, f.read_text().splitlines())}


# ---------------------------------------------------------------------------- deliverable 1 + 2a
def test_stock_lm_eval_local_completions_matches_eval_lm(full_server, tmp_path):
    """Stock `lm_eval --model local-completions --batch_size 4` runs a loglikelihood, a rolling and a
    generation task against the server; at full depth its loglikelihoods are eval.lm's."""
    api = _lm_eval("--model", "local-completions", "--model_args",
                   f"model=ouro-demo,base_url={full_server.url}/v1/completions,tokenizer={DEMO},"
                   "tokenizer_backend=huggingface", "--include_path", "eval/tasks",
                   "--tasks", "looped_cloze,looped_ppl,looped_lastword", "--batch_size", "4", "--limit", "8",
                   "--log_samples", out=tmp_path / "api")
    res = api["results"]
    assert 0 <= res["looped_cloze"]["acc,none"] <= 1 and 0 <= res["looped_lastword"]["exact_match,first-word"] <= 1
    assert 1 < res["looped_ppl"]["word_perplexity,none"] < 1e6
    # the reference: `python -m eval` (context prefilled, continuation teacher-forced) with exits off
    r = subprocess.run([sys.executable, "-m", "eval", "run", "--model", "looped", "--model_args",
                        f"pretrained={DEMO},full_depth=True", "--device", "cpu", "--tasks", "looped_cloze",
                        "--limit", "4", "--log_samples", "--output_path", str(tmp_path / "ref")],
                       cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    got, want = _samples(tmp_path / "api", "looped_cloze"), _samples(tmp_path / "ref", "looped_cloze")
    assert sorted(want) == [0, 1, 2, 3]
    n = 0
    for doc, choices in want.items():
        for (ll_want, _), (ll_got, _) in zip((c[0] for c in choices), (c[0] for c in got[doc])):
            # (lm-eval logs responses as strings; float32 engine on both sides, two batchings)
            assert float(ll_got) == pytest.approx(float(ll_want), rel=1e-4, abs=1e-4), (doc, ll_got, ll_want)
            assert float(ll_want) < -0.1  # a real score (several tokens of a 2,048-token vocabulary)
            n += 1
    assert n == 16  # 4 documents x 4 choices compared


# ---------------------------------------------------------------------------- the meaning of echo log-probs
def test_echo_logprobs_meaning(policy_server):
    """Default: a prompt token's log-prob comes from the full-depth prefill (vLLM's meaning). Opt-in
    `echo_logprobs_depth: policy`: teacher-forced through the exit policy, exactly the engine's
    add_request(prompt[:1], forced_output=prompt[1:])."""
    from infer.engine.llm import load_model
    from infer.engine.llm_engine import LLMEngine
    from infer.engine.config import EngineConfig
    from infer.engine.sampling_params import SamplingParams

    model, tok = load_model(str(DEMO), "float64")
    ids = tok.encode(TEXT)
    full = LLMEngine(model, EngineConfig(full_depth=True), tok)
    f = full.add_request(ids[:1], SamplingParams(), forced_output=ids[1:])
    adaptive = LLMEngine(model, EngineConfig(), tok)
    a = adaptive.add_request(ids[:1], SamplingParams(), forced_output=ids[1:])
    for eng in (full, adaptive):
        while eng.has_unfinished():
            eng.step()
    r_max = model.cfg.r_max
    assert len(set(a.exit_depths[1:])) >= 2 and a.exit_depths != f.exit_depths  # the policy does act here

    body = {"prompt": TEXT, "echo": True, "max_tokens": 0, "logprobs": 1, "temperature": 0}
    c = policy_server.post(body).json()["choices"][0]
    assert c["text"] == TEXT and c["prompt_token_ids"] == ids and c["token_ids"] == []
    lp = c["logprobs"]["token_logprobs"]
    assert lp[0] is None and lp[1:] == pytest.approx(f.logprobs, abs=1e-9)  # full depth, whatever the policy
    assert c["prompt_exit_depths"] == [None] + [r_max] * (len(ids) - 1)

    p = policy_server.post({**body, "echo_logprobs_depth": "policy"}).json()["choices"][0]
    assert p["prompt_token_ids"] == ids and p["prompt_exit_depths"] == [None] + a.exit_depths
    assert p["logprobs"]["token_logprobs"][1:] == pytest.approx(a.logprobs, abs=1e-9)
    assert p["logprobs"]["token_logprobs"][1:] != pytest.approx(f.logprobs, abs=1e-6)
    # lm-eval's greedy check reads top_logprobs: each holds the top-1 and the prompt token itself
    for tok_lp, top in zip(lp[1:], c["logprobs"]["top_logprobs"][1:]):
        assert tok_lp in top.values() and len(top) in (1, 2) and max(top.values()) >= tok_lp


def test_completions_contract(policy_server):
    """A list of prompts (text and token ids) x n, echo with generated tokens, logprobs=k, chat top_logprobs."""
    ids = [5, 6, 7, 8]
    r = policy_server.post({"prompt": [TEXT, ids], "n": 2, "max_tokens": 3, "temperature": 0.8, "seed": 1,
                            "logprobs": 3, "echo": True}).json()
    cs = r["choices"]
    assert [c["index"] for c in cs] == [0, 1, 2, 3]
    assert cs[0]["text"].startswith(TEXT) and cs[2]["prompt_token_ids"] == ids
    for c in cs:
        lp = c["logprobs"]
        n_prompt = len(c["prompt_token_ids"])
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == n_prompt + 3
        assert all(3 <= len(t) <= 4 for t in lp["top_logprobs"][1:])  # top 3 (+ the token when outside them)
        assert len(c["token_ids"]) == 3 and len(c["exit_depths"]) == 3
    assert cs[0]["token_ids"] != cs[1]["token_ids"] or cs[2]["token_ids"] != cs[3]["token_ids"]  # n samples differ
    assert r["usage"]["prompt_tokens"] == len(cs[0]["prompt_token_ids"]) + len(ids)
    assert r["usage"]["completion_tokens"] == 12
    # streaming several choices: chunks name their index; each choice's text equals the non-streamed one
    body = {"prompt": [TEXT, ids], "n": 2, "max_tokens": 5, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    texts, usage = {}, None
    with httpx.stream("POST", policy_server.url + "/v1/completions", json=body, timeout=60) as s:
        for line in s.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                for c in chunk["choices"]:
                    texts[c["index"]] = texts.get(c["index"], "") + c["text"]
                usage = chunk.get("usage") or usage
    whole = policy_server.post({**body, "stream": False, "stream_options": None}).json()
    assert texts == {c["index"]: c["text"] for c in whole["choices"]} and len(texts) == 4
    assert usage["completion_tokens"] == whole["usage"]["completion_tokens"] == 20
    # vLLM's tokenizer endpoints (lm-eval's remote tokenizer: no local tokenizer needed)
    from looplm.io import load_tokenizer
    tok = load_tokenizer(DEMO)
    t = policy_server.post({"prompt": TEXT, "add_special_tokens": False}, "/tokenize").json()
    assert t["tokens"] == tok.encode(TEXT, add_special_tokens=False) and t["max_model_len"] == 128
    assert policy_server.post({"tokens": t["tokens"]}, "/detokenize").json()["prompt"] == TEXT
    info = httpx.get(policy_server.url + "/tokenizer_info").json()
    assert info["eos_token"] == tok.eos_token and info["chat_template"]
    assert policy_server.post({"tokens": [10**9]}, "/detokenize").json()["error"]["param"] == "tokens"
    chat = policy_server.post({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "logprobs": True,
                               "top_logprobs": 2, "n": 2}, "/v1/chat/completions").json()
    assert len(chat["choices"]) == 2
    first = chat["choices"][0]["logprobs"]["content"][0]
    assert len(first["top_logprobs"]) == 2 and first["top_logprobs"][0]["logprob"] >= first["logprob"] - 1e-12


def test_server_bad_input_battery(policy_server):
    """Malformed Unicode and 100,000 nested `[` (under the default 1 MiB body limit) are 400s;
    exit_threshold is range-checked per criterion; errors have OpenAI's shape with a string code;
    an aborted request is counted in /metrics."""
    cases = [('{"prompt": "a\\ud800b"}', None), ("[" * 100_000, None), ('{"prompt": ' + "[" * 100_000 + "}", None),
             ('{"prompt": "x", "exit_threshold": -1}', "exit_threshold"),
             ('{"prompt": "x", "exit_threshold": 5}', "exit_threshold"),
             ('{"prompt": "x", "best_of": 2}', "best_of")]
    for body, param in cases:
        r = policy_server.post(body)
        e = r.json()["error"]
        assert r.status_code == 400 and e["param"] == param and isinstance(e["code"], str), (body[:30], r.text)
        assert set(e) == {"message", "type", "param", "code"} and e["type"] == "invalid_request_error"
    # a client that leaves mid-request is counted as aborted
    # (clients that hang up mid-stream: 8 x 110 tokens outlast the first chunk by far; the context is 128)
    streams = [httpx.stream("POST", policy_server.url + "/v1/completions", timeout=60,
                            json={"prompt": TEXT, "max_tokens": 110, "ignore_eos": True, "stream": True})
               for _ in range(8)]
    for s in streams:
        assert next(s.__enter__().iter_lines()).startswith("data: {")
    for s in streams:
        s.__exit__(None, None, None)
    deadline = time.monotonic() + 20
    while True:
        m = httpx.get(policy_server.url + "/metrics").text
        n = re.search(r'^cdb_request_aborted_total\{[^}]*\} (\S+)$', m, re.M)
        if n and float(n.group(1)) >= 1:
            break
        assert time.monotonic() < deadline, m
        time.sleep(0.2)
    assert re.search(r"^cdb_preemptions\{", m, re.M) or "preemptions" not in m  # engine keys pass through


# ---------------------------------------------------------------------------- deliverable 2b
def test_lm_eval_cli_with_our_model(tmp_path):
    """`looplm-eval` (a console script: lm-eval has no model plugin discovery) is lm-eval's CLI with the
    `looped` model and the local tasks; the table and the JSON carry exit_depth."""
    # (device in model_args: it wins over lm-eval's --device default instead of a duplicate-keyword error)
    r = subprocess.run([str(BIN / "looplm-eval"), "run", "--model", "looped", "--model_args",
                        f"pretrained={DEMO},device=cpu", "--tasks", "looped_lastword", "--limit", "3", "--output_path",
                        str(tmp_path)], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert re.search(r"\|\s*exit_depth\s*\|", r.stdout), r.stdout
    res = json.loads(next(tmp_path.rglob("results_*.json")).read_text())["results"]["looped_lastword"]
    assert 1 <= res["exit_depth,none"] <= 4 and 0 < res["adaptive_frac,none"] <= 1


# ---------------------------------------------------------------------------- deliverable 5
@pytest.fixture(scope="module")
def broken(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("broken")
    trunc = d / "truncated"
    trunc.mkdir()
    for f in DEMO.iterdir():
        if f.is_file():
            (trunc / f.name).write_bytes(f.read_bytes())
    with open(trunc / "model.safetensors", "r+b") as fh:
        fh.truncate(1000)
    llama = d / "llama"
    llama.mkdir()
    (llama / "config.json").write_text('{"model_type": "llama", "hidden_size": 64}')
    return {"trunc": trunc, "llama": llama, "sweep": d / "missing.yaml"}


BAD = [  # (command, the text the one error line must contain)
    (["infer.serve", "--model", "{trunc}"], "model.safetensors"),
    (["infer.serve", "--model", "{llama}"], "model_type 'llama'"),
    (["infer.serve", "--model", "/no/such/folder"], "/no/such/folder"),
    (["infer.serve", "--model", str(DEMO), "--exit-threshold", "5"], "exit_threshold"),
    (["infer.bench", "--model", "{trunc}"], "model.safetensors"),
    (["infer.sim", "--model", "ouro-tiny", "--fitted", "/no/such/fit.json"], "/no/such/fit.json"),
    (["infer.bench.online", "--model", "/no/such/folder", "--rates", "1"], "/no/such/folder"),
    (["eval", "run", "--model", "looped", "--model_args", "pretrained={llama}", "--device", "cpu", "--tasks",
      "looped_cloze"], "model_type 'llama'"),
    (["eval.sweep", "run", "{sweep}"], "missing.yaml"),
]


@pytest.mark.parametrize("cmd,needle", BAD, ids=[" ".join(c[:2]) + f"-{i}" for i, (c, _) in enumerate(BAD)])
def test_cli_bad_input_is_one_error_line(cmd, needle, broken, tmp_path):
    argv = [a.format(**broken) for a in cmd]
    r = subprocess.run([sys.executable, "-m", *argv], cwd=ROOT, env=ENV,
                       capture_output=True, text=True, timeout=300)
    out = r.stdout + r.stderr
    errors = [ln for ln in out.splitlines() if ln.startswith("error:")]
    assert r.returncode != 0 and len(errors) == 1 and "Traceback" not in out, out[-3000:]
    assert needle in errors[0], errors


def test_missing_tokenizer_is_a_warning_at_load_and_server_start(tmp_path):
    for name in ("config.json", "model.safetensors", "exit_gates.safetensors"):  # a folder without tokenizer files
        (tmp_path / name).write_bytes((DEMO / name).read_bytes())
    s = Server(model=tmp_path)
    s.stop()
    lines = s.lines
    assert s.proc.returncode == 0, lines  # SIGTERM is a graceful shutdown
    assert any(ln.startswith("warning:") and "no tokenizer" in ln for ln in lines), lines  # at server start
    assert any(f"{tmp_path} has no tokenizer" in ln for ln in lines), lines  # at load (looplm.io), naming the folder


def test_debug_shows_the_traceback(broken):
    r = subprocess.run([sys.executable, "-m", "infer.serve", "--model", str(broken["trunc"]), "--debug"], cwd=ROOT,
                       env=ENV, capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and "Traceback" in r.stderr and r.stderr.rstrip().splitlines()[-1].startswith("error:")

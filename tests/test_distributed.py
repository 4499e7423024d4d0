"""Scale-out on a local Ray (the `distributed` extra): 2 CPU engine replicas behind one endpoint
(`python -m infer.serve --replicas 2`) against the single-process server, a replica killed by PID
mid-load, /metrics summed over replicas, and a sweep's points as Ray tasks against the sequential
runner. float64 everywhere, so batch composition cannot move a token or an exit depth. Every test
that starts Ray checks that no Ray process of its own (found by its RAY_TMPDIR) is left."""
import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
MODEL = str(ROOT / "checkpoints" / "ouro-demo")
SEED = 0  # the prompts are fixed; greedy decoding: nothing random is drawn
PROMPTS = [f"Request {i}: the history of" for i in range(32)]

try:
    import ray  # noqa: F401  (the `distributed` extra, which `make test` installs)
except ImportError:
    if os.environ.get("CI"):  # in CI a missing Ray is a broken install, not a reason to skip
        raise
    pytest.skip("needs the `distributed` extra: pip install -e '.[distributed]'", allow_module_level=True)


def ray_pids(tmpdir: str) -> list[int]:
    """Live processes of the Ray cluster whose temp dir is `tmpdir` (raylet, gcs, workers)."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if tmpdir.encode() in (d / "cmdline").read_bytes():
                    out.append(int(d.name))
            except OSError:
                pass
    return out


def replica_pids() -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if (d / "cmdline").read_bytes().startswith(b"ray::ServeReplica:looplm"):
                    out.append(int(d.name))
            except OSError:
                pass
    return sorted(out)


def assert_ray_gone(tmpdir: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while (left := ray_pids(tmpdir)) and time.monotonic() < deadline:
        time.sleep(0.5)
    for pid in left:  # clean up before failing, so one failure does not leak into the next run
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert not left, f"Ray processes left running: {left}"


@pytest.fixture()
def ray_tmp(monkeypatch):
    d = tempfile.mkdtemp(prefix="rt", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    monkeypatch.setenv("RAY_TMPDIR", d)
    yield d
    assert_ray_gone(d)
    shutil.rmtree(d, ignore_errors=True)  # Ray's session logs


# ---------------------------------------------------------------- the two servers
@pytest.fixture(scope="module")
def replicas():
    """`python -m infer.serve --replicas 2` in its own session (SIGTERM reaches the driver only)."""
    yield from serve_replicas(["--model", MODEL, "--replicas", "2", "--dtype", "float64"])


@pytest.fixture(scope="module")
def emulated_replicas():
    """Two replicas of an emulated H100 serving Ouro-1.4B (no weights; the host side is real)."""
    yield from serve_replicas(["--model", "ouro-1.4b", "--device", "emulated:h100", "--replicas", "2"])


def serve_replicas(args: list[str]):
    """Start `python -m infer.serve ARGS --port 0` with its own Ray; yield its URL; stop it, and check
    that it exited cleanly and left no Ray process."""
    tmp = tempfile.mkdtemp(prefix="rt", dir="/tmp")
    log = Path(tmp) / "serve.log"
    env = {**os.environ, "RAY_TMPDIR": tmp, "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "infer.serve", *args, "--port", "0"]
    with open(log, "w") as f:
        p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    url, deadline = None, time.monotonic() + 180
    while url is None:
        text = log.read_text()
        for line in text.splitlines():
            if line.startswith("serving ") and " on http://" in line:
                url = line.rsplit(" on ", 1)[1]
        assert p.poll() is None and time.monotonic() < deadline, f"replicas did not start:\n{text[-3000:]}"
        time.sleep(0.3)
    yield url
    p.send_signal(signal.SIGTERM)
    try:
        rc = p.wait(60)
    except subprocess.TimeoutExpired:
        p.kill()
        rc = "timeout"
    assert_ray_gone(tmp)
    text = log.read_text()
    shutil.rmtree(tmp, ignore_errors=True)  # Ray's session logs
    assert rc == 0, f"exit {rc}:\n{text[-3000:]}"


@pytest.fixture(scope="module")
def single():
    """The single-process server (no Ray) in a thread."""
    from infer.serving.cli import make_server, parser

    server, sock = make_server(parser().parse_args(["--model", MODEL, "--dtype", "float64", "--port", "0"]))
    t = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    t.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert time.monotonic() < deadline and t.is_alive(), "server did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    server.should_exit = True
    t.join(15)


async def complete(c: httpx.AsyncClient, url: str, prompt: str, max_tokens: int, stream: bool = False,
                   on_head=None) -> dict:
    """One greedy completion -> status, token ids, exit depths, headers (SSE chunks concatenated).
    `on_head(headers)` runs when the response starts: for a stream, once its first token exists."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": stream}
    async with c.stream("POST", url + "/v1/completions", json=body) as r:
        if on_head is not None:
            on_head(r.headers)
        text = (await r.aread()).decode()
    out = {"status": r.status_code, "headers": r.headers, "ids": [], "depths": [], "id": None}
    if r.status_code != 200:
        out["error"] = text
    elif stream:
        for line in text.splitlines():
            if line.startswith("data: {"):
                ch = json.loads(line[6:])
                if "error" in ch:  # the replica died mid-stream
                    out["stream_error"] = ch["error"]
                    continue
                out["id"] = ch["id"]
                out["ids"] += ch["choices"][0]["token_ids"]
                out["depths"] += ch["choices"][0]["exit_depths"]
    else:
        j = json.loads(text)
        out.update(id=j["id"], ids=j["choices"][0]["token_ids"], depths=j["choices"][0]["exit_depths"])
    return out


async def many(url: str, max_tokens: int, streams: int = 0) -> list[dict]:
    """Every PROMPT at once, the first `streams` streamed."""
    async with httpx.AsyncClient(timeout=180) as c:
        return await asyncio.gather(*(complete(c, url, p, max_tokens, stream=i < streams)
                                      for i, p in enumerate(PROMPTS)))


def metrics(url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            k, v = line.rsplit(" ", 1)
            out[k] = float(v)
    return out


# ---------------------------------------------------------------- tests
@pytest.mark.slow
def test_single_server_path_does_not_import_ray():
    code = "import sys, infer.serving.cli as c; c.parser(); assert 'ray' not in sys.modules, 'ray imported'"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


def test_aggregate_metrics_sums_counters_and_weights_depth():
    from infer.serving.replicas import aggregate_metrics

    def text(tokens, depth, usage, reason):
        return ("# HELP cdb_generation_tokens_total t\n# TYPE cdb_generation_tokens_total counter\n"
                f'cdb_generation_tokens_total{{model_name="m"}} {tokens}\n'
                f'cdb_mean_exit_depth{{model_name="m"}} {depth}\ncdb_kv_cache_usage_perc{{model_name="m"}} {usage}\n'
                f'cdb_request_success_total{{model_name="m",finished_reason="{reason}"}} 2\n')
    got = aggregate_metrics([text(30, 2.0, 0.5, "length"), text(10, 4.0, 0.1, "stop")])
    rows = dict(ln.rsplit(" ", 1) for ln in got.splitlines() if not ln.startswith("#"))
    assert rows["cdb_replicas"] == "2" and rows['cdb_generation_tokens_total{model_name="m"}'] == "40"
    assert float(rows['cdb_mean_exit_depth{model_name="m"}']) == pytest.approx(2.5)  # (30*2 + 10*4) / 40
    assert float(rows['cdb_kv_cache_usage_perc{model_name="m"}']) == pytest.approx(0.3)
    assert rows['cdb_request_success_total{model_name="m",finished_reason="stop"}'] == "2"
    assert got.count("# TYPE cdb_generation_tokens_total") == 1
    # vLLM's request histograms (histograms.py) sum bucket by bucket
    from infer.serving.histograms import RequestHistograms, render

    hs = []
    for ttft in (0.05, 0.3):
        h = RequestHistograms(64)
        h.hists["ttft"].observe(ttft)
        hs.append("\n".join(render(h.copy(), 'model_name="m"')) + "\n")
    rows = dict(ln.rsplit(" ", 1) for ln in aggregate_metrics(hs).splitlines() if not ln.startswith("#"))
    name = "vllm:time_to_first_token_seconds"
    assert rows[f'{name}_bucket{{model_name="m",le="0.06"}}'] == "1" and rows[f'{name}_count{{model_name="m"}}'] == "2"
    assert float(rows[f'{name}_sum{{model_name="m"}}']) == pytest.approx(0.35)
    assert rows[f'{name}_bucket{{model_name="m",le="+Inf"}}'] == "2"


class _Gen:
    """A stand-in for Serve's streaming response: `items` in order; an exception in it is raised there."""
    def __init__(self, items):
        self.items, self.cancelled = list(items), False

    def __aiter__(self):
        return self

    async def __anext__(self):
        if not self.items:
            raise StopAsyncIteration
        x = self.items.pop(0)
        if isinstance(x, BaseException):
            raise x
        return x

    def cancel(self):
        self.cancelled = True


class _Handle:
    def __init__(self, *attempts):
        self.attempts, self.calls = list(attempts), 0

    def options(self, **_):
        return self

    def remote(self, *_):
        self.calls += 1
        return _Gen(self.attempts.pop(0))


def test_ingress_retries_a_request_whose_replica_died_before_its_first_chunk():
    """The ingress's retry path, deterministically (the killed-replica tests below cannot force it:
    a request the frozen replica had not yet accepted is re-routed by Serve itself, unmarked): a
    death before the first chunk resends, marked x-looplm-retried; a death mid-stream ends the
    stream with a 502 error event; deaths on every attempt give one 503 naming the last error."""
    import ray.exceptions
    from fastapi.testclient import TestClient

    from infer.serving.replicas import build_ingress

    def ok():  # (fresh lists: the ingress appends its header to the replica's)
        return [(200, [("content-type", "application/json"), ("x-looplm-replica", "h:2")]), b'{"ok": 1}']
    died = ray.exceptions.RayActorError()
    h = _Handle([(200, []), died], ok())  # the status line came, the first chunk did not
    r = TestClient(build_ingress(h, None)).post("/v1/completions", json={})
    assert (r.status_code, r.json(), r.headers["x-looplm-retried"], h.calls) == (200, {"ok": 1}, "1", 2)
    h = _Handle(ok())
    r = TestClient(build_ingress(h, None)).post("/v1/completions", json={})
    assert "x-looplm-retried" not in r.headers and h.calls == 1
    h = _Handle([(200, [("content-type", "text/event-stream")]), b"data: 1\n\n", died])
    r = TestClient(build_ingress(h, None)).post("/v1/completions", json={"stream": True})
    assert r.status_code == 200 and h.calls == 1
    first, err = [line for line in r.text.split("\n\n") if line]
    assert first == "data: 1" and json.loads(err[6:])["error"]["code"] == 502
    h = _Handle([died], [died], [died])
    r = TestClient(build_ingress(h, None, retries=2)).post("/v1/completions", json={})
    assert r.status_code == 503 and "after 3 attempts" in r.json()["error"]["message"] and h.calls == 3


def test_replica_scaling_reads_cpu_per_part():
    """infer/bench/replica_scaling.py's /proc accounting: a process tree, its CPU seconds, its parts."""
    from infer.bench import replica_scaling as RS
    child = subprocess.Popen([sys.executable, "-c", "import time; t = time.time()\nwhile time.time() - t < 0.3: pass"])
    try:
        procs = RS.tree(os.getpid())
        assert os.getpid() in procs and child.pid in procs and "python" in procs[child.pid]
    finally:
        child.wait()
    assert RS.cpu_seconds(os.getpid()) > 0 and RS.cpu_seconds(2**22 + 7) == 0.0
    assert RS.part_of(5, "ray::ServeReplica:looplm:engine", 1) == "replicas"
    assert RS.part_of(1, "python -m infer.serve", 1) == "ingress" and RS.part_of(6, "raylet", 1) == "ray_other"
    parts = RS.cpu_by_part(os.getpid())
    assert set(parts) == {"ingress", "replicas", "ray_other", "client"} and parts["ingress"] > 0


def test_replica_scaling_samples_steady_state_cores():
    """The sampler sees a process that spins in steady state, the machine's busy cores include it,
    and `steady` counts the tokens streamed inside the middle half only. How much of a core the
    child gets depends on what else the machine runs (0.49 under a loaded suite on 2 cores,
    2026-12-07; far less on a busier machine): the checks ask for some of a core, not a share."""
    from infer.bench import replica_scaling as RS
    from infer.bench.online import Result
    child = subprocess.Popen([sys.executable, "-c", "import time; t = time.time()\nwhile time.time() - t < 2.0: pass"])
    try:
        time.sleep(0.2)  # the child is listed when the sampler starts
        sm = RS.Sampler(os.getpid(), 0.1)
        assert sm.label[child.pid] == "ray_other" and sm.label[os.getpid()] == "client"
        sm.start()
        time.sleep(1.2)
        sm.halt.set()
        sm.join()
    finally:
        child.wait()
    t0 = sm.t0
    # one request streaming 10 chunks of 1 token, 0.1 s apart, from t0; another that failed
    res = [Result(4, 10, send=t0, ttft=0.0, output_len=10, itl=[0.1] * 9), Result(4, 10, error="x")]
    st = RS.steady(sm.rows, res, t0)
    # the child's core-seconds over the sampled 1.2 s, and its median cores in the middle half: above 0
    starts = [0.0] + [r["t"] for r in sm.rows]
    sampled = sum(r["cores"]["ray_other"] * (r["t"] - prev) for r, prev in zip(sm.rows, starts))
    assert sampled > 0 and st["ray_other"] > 0
    assert st["machine_busy"] >= st["ray_other"] - 0.2 and st["machine_steal"] >= 0
    lo, hi = st["window_s"]
    inside = sum(lo <= 0.1 * i <= hi for i in range(10))
    assert st["output_throughput"] == pytest.approx(inside / (hi - lo))


@pytest.mark.slow
def test_two_replicas_equal_the_single_server(replicas, single):
    want = asyncio.run(many(single, 24))
    got = asyncio.run(many(replicas, 24, streams=8))  # 8 of the 32 streamed (SSE through the ingress)
    assert all(r["status"] == 200 for r in got + want), [r.get("error") for r in got if r["status"] != 200]
    assert [(r["ids"], r["depths"]) for r in got] == [(r["ids"], r["depths"]) for r in want]
    assert len({r["headers"]["x-looplm-replica"] for r in got}) == 2  # both replicas served
    assert len({d for r in got for d in r["depths"][1:]}) >= 3  # a real spread of exit depths
    assert len({r["id"] for r in got}) == 32


def settled(url: str) -> float:
    """The summed generated tokens once every replica's last push is in (two reads a push apart agree)."""
    key, last = 'cdb_generation_tokens_total{model_name="ouro-demo"}', None
    for _ in range(20):
        now = metrics(url).get(key, 0.0)
        if now == last:
            return now
        last = now
        time.sleep(1.5)
    raise AssertionError("metrics did not settle")


@pytest.mark.slow
def test_metrics_are_summed_over_replicas(replicas):
    before = settled(replicas)
    got = asyncio.run(many(replicas, 8))
    assert len({r["headers"]["x-looplm-replica"] for r in got}) == 2
    deadline = time.monotonic() + 10  # each replica pushes its metrics every second
    while (m := metrics(replicas))['cdb_generation_tokens_total{model_name="ouro-demo"}'] - before != 32 * 8:
        assert time.monotonic() < deadline, (m['cdb_generation_tokens_total{model_name="ouro-demo"}'], before)
        time.sleep(0.5)
    assert m["cdb_replicas"] == 2


async def quiet(c: httpx.AsyncClient, url: str, tasks: list) -> None:
    """Waits until the replica that is still running has finished all it holds: /metrics (whose
    stopped replica drops out once its last push is STALE_AFTER_S old) shows one replica with no
    request running or waiting, and no response has completed for two polls a second apart."""
    done, same, deadline = -1, 0, time.monotonic() + 180
    while same < 2:
        assert time.monotonic() < deadline, "the surviving replica did not go idle"
        await asyncio.sleep(1.0)
        m = {k.split("{")[0]: float(v) for k, v in (line.rsplit(" ", 1) for line in
             (await c.get(url + "/metrics")).text.splitlines() if line and not line.startswith("#"))}
        idle = m.get("cdb_replicas") == 1 and m.get("cdb_num_requests_running", 1) == 0 \
            and m.get("cdb_num_requests_waiting", 1) == 0
        now = sum(t.done() for t in tasks)
        same = same + 1 if idle and now == done else 0
        done = now


async def kill_under_load(url: str, max_tokens: int) -> tuple[list[dict], set[int], set[int], int, float]:
    """Sends every prompt (one in four streamed) and takes the replica whose stream starts first:
    SIGSTOP freezes it with what it holds, the other replica finishes its share, and every request
    still unanswered then is in flight on the frozen one or still queued in Serve's router (which
    may have picked the frozen replica and waits on it: those go to the survivor after the kill,
    unmarked, as runs under xdist showed); then SIGKILL. (A kill at a
    chosen moment could land when the victim held only streams already under way, which are cut,
    not resent: two CI runs had no retry.) Should the victim hold nothing but streams under way, it
    is resumed and the round repeated. Returns (responses, the requests unanswered at the kill that
    had sent nothing, a superset of those the killed replica held, its streams under way, its pid, the kill's monotonic time)."""
    async with httpx.AsyncClient(timeout=300) as c:
        for _ in range(3):
            heads: dict[int, int] = {}  # stream index -> pid of the replica serving it
            started = asyncio.Event()

            def on_head(i: int):
                def f(headers):
                    heads[i] = int(headers["x-looplm-replica"].rsplit(":", 1)[1])
                    started.set()
                return f

            tasks = [asyncio.create_task(complete(c, url, p, max_tokens, stream=i % 4 == 0,
                                                  on_head=on_head(i) if i % 4 == 0 else None))
                     for i, p in enumerate(PROMPTS)]
            await asyncio.wait_for(started.wait(), 120)
            victim = next(iter(heads.values()))
            os.kill(victim, signal.SIGSTOP)
            await quiet(c, url, tasks)
            under_way = {i for i, pid in heads.items() if pid == victim and not tasks[i].done()}
            held = {i for i, t in enumerate(tasks) if not t.done()} - under_way
            if held:
                os.kill(victim, signal.SIGKILL)
                t_kill = time.monotonic()
                return await asyncio.gather(*tasks), held, under_way, victim, t_kill
            os.kill(victim, signal.SIGCONT)
            await asyncio.gather(*tasks)
    raise AssertionError("in three rounds the first stream's replica never held a request that had not started")


@pytest.mark.slow
def test_killed_replica_loses_no_request_and_is_replaced(replicas, single):
    want = asyncio.run(many(single, 48))
    before = replica_pids()
    assert len(before) == 2

    got, held, under_way, dead, t_kill = asyncio.run(kill_under_load(replicas, 48))
    assert dead in before
    # nothing lost: every request answered with the single server's tokens, none duplicated; only a
    # stream already under way on the killed replica may end early, with a 502 error event
    assert [r["status"] for r in got] == [200] * 32, [r.get("error") for r in got if r["status"] != 200]
    cut = {i for i, r in enumerate(got) if "stream_error" in r}
    assert cut <= under_way, (cut, under_way)
    for i in cut:
        assert got[i]["stream_error"]["code"] == 502 and got[i]["stream_error"]["type"] == "replica_died"
        assert got[i]["headers"]["x-looplm-replica"].endswith(f":{dead}")
        assert got[i]["ids"] == want[i]["ids"][:len(got[i]["ids"])]
    assert [(r["ids"], r["depths"]) for i, r in enumerate(got) if i not in cut] == \
        [(r["ids"], r["depths"]) for i, r in enumerate(want) if i not in cut]
    assert len({r["id"] for r in got}) == 32
    # resent (marked) are only requests unanswered at the kill, and none names the dead replica. (Which
    # of them the ingress resends and which Serve re-routes itself depends on whether the frozen
    # replica had accepted them: under xdist none was; the retry path has its own test above.)
    retried = {i for i, r in enumerate(got) if "x-looplm-retried" in r["headers"]}
    assert retried <= held, (retried, held)
    assert all(not got[i]["headers"]["x-looplm-replica"].endswith(f":{dead}") for i in retried)
    # replaced: two replicas again, one of them a new process, reporting metrics and serving
    for _ in range(360):  # polled every 0.5 s; the bound only stops a hung cluster from hanging the suite
        if len(now := replica_pids()) == 2 and dead not in now and metrics(replicas)["cdb_replicas"] == 2:
            break
        time.sleep(0.5)
    else:
        pytest.fail(f"not recovered: replicas {now}")
    assert len(set(now) - set(before)) == 1  # a new process took the dead one's place
    again = asyncio.run(many(replicas, 8))
    assert all(r["status"] == 200 for r in again)
    # (which replica Ray Serve routes to right after the replacement is its own choice: only the dead
    # process must serve nothing)
    assert not any(r["headers"]["x-looplm-replica"].endswith(f":{dead}") for r in again)
    print(f"recovered {time.monotonic() - t_kill:.1f} s after the kill; {len(retried)} requests retried, "
          f"{len(cut)} streams cut")


@pytest.mark.slow
def test_emulated_replicas_serve_and_a_killed_one_loses_nothing(emulated_replicas):
    """--replicas with --device emulated:h100 (issue 26): both replicas serve; killing one under load
    loses no request that was not streaming from it, and every answered request has its tokens."""
    url, n = emulated_replicas, 400  # (the CPU replicas of this module's other fixture may still run: the
    # replicas are told apart by the pid each response names, not by listing processes)

    got, held, _, dead, _ = asyncio.run(kill_under_load(url, n))
    retried = {i for i, r in enumerate(got) if "x-looplm-retried" in r["headers"]}
    assert retried <= held, (retried, held)  # (see test_killed_replica_loses_no_request_and_is_replaced)
    assert [r["status"] for r in got] == [200] * 32, [r.get("error") for r in got if r["status"] != 200]
    served = {r["headers"]["x-looplm-replica"] for r in got}
    assert 2 <= len(served) <= 3 and any(x.endswith(f":{dead}") for x in served)  # 3: Serve's replacement
    for r in got:
        if "stream_error" in r:  # only a stream under way on the killed replica may end early
            assert r["headers"]["x-looplm-replica"].endswith(f":{dead}") and len(r["ids"]) < n
        else:
            assert len(r["ids"]) == n and all(1 <= d <= 4 for d in r["depths"][1:])
    assert len({r["id"] for r in got}) == 32


@pytest.mark.slow
def test_sweep_on_ray_equals_sequential(tmp_path, ray_tmp):
    from eval import sweep

    spec = {"name": "tiny4", "method": "grid", "parameters": {
        "pretrained": {"value": MODEL}, "tasks": {"value": "looped_cloze"}, "limit": {"value": 6},
        "bench_requests": {"value": 2}, "batch_size": {"value": 4}, "baselines": {"value": False},
        "dtype": {"value": "float64"}, "seed": {"value": SEED}, "exit_threshold": {"values": [0.5, 0.9]},
        "r_min": {"values": [1, 2]}, "kv_layout": {"value": "last_exited"}, "lookahead": {"value": False}}}
    path = tmp_path / "tiny4.yaml"
    path.write_text(yaml.safe_dump(spec))
    seq = sweep.run_sweep(path, tmp_path / "seq")
    sweep.main(["run", str(path), "--out", str(tmp_path / "ray"), "--ray", "--workers", "2"])
    par = json.loads((tmp_path / "ray" / "results.json").read_text())
    keep = lambda r: {k: v for k, v in r.items() if not k.startswith("bench/") and k not in ("seconds", "wandb_run")}
    assert [keep(r) for r in par] == [keep(json.loads(json.dumps(r, default=str))) for r in seq]
    assert len({r["mean_exit_depth"] for r in par}) >= 3 and any(r["looped_cloze/acc"] > 0 for r in par)
    assert all(r["bench/output_tokens_per_s"] > 0 and Path(r["wandb_run"]).is_dir() for r in par)
    assert (tmp_path / "ray" / "pareto.png").stat().st_size > 1000
    assert (tmp_path / "ray" / "results.csv").read_text().splitlines()[0] == \
        (tmp_path / "seq" / "results.csv").read_text().splitlines()[0]

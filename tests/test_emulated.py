"""The emulated device (infer/sim/emulated.py): the real engine and server on a device that only
waits for the simulator's predicted stage times. Checks: the Runner protocol; the engine's rules
(max_tokens, depths within [r_min, r_max], replayed depths equal to the file's); no weights read;
the wall time at least the predicted device time and close to it; the OpenAI routes (streaming
included) on an emulated server; every output says it is emulated; one-line refusals."""
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from infer.sim import emulated as E
from infer.sim import replay as RP
from infer.sim.runner import binomial_depths, depths_from_distribution
from infer.sim.simulate import simulate_mode
from infer.sim.workloads import make_requests
from infer.engine.runner import Runner
from infer.engine.sampling_params import SamplingParams
from infer.serving.async_engine import AsyncEngine
from infer.serving.server import build_app
from looplm.errors import ParamError
from looplm.policy import ExitPolicy
from looplm.presets import paper_config
from test_serve import ServerThread
from helpers import wait_for_server

ROOT = Path(__file__).resolve().parents[1]
EXITS = ROOT / "docs" / "figures" / "ouro-demo-alpaca8.exits.json"  # recorded from ouro-demo (r_max 4)
H100 = "emulated:h100"


def run_all(eng, requests, params=None):
    seqs = [eng.add_request(r.prompt_ids, params or SamplingParams(max_tokens=r.output_len, ignore_eos=True),
                            request_id=str(i)) for i, r in enumerate(requests)]
    t0 = time.perf_counter()
    while eng.has_unfinished():
        eng.step()
    return [eng.output(s) for s in seqs], time.perf_counter() - t0


# ---------------------------------------------------------------------------------- the runner
def test_the_engine_builds_an_emulated_runner():  # (its protocol: test_runner_protocol.py)
    eng = E.emulated_engine("ouro-1.4b", H100)
    assert isinstance(eng.runner, Runner) and isinstance(eng.runner, E.EmulatedRunner)
    assert eng.runner.device_info["emulated"] is True and eng.runner.device_info["device"] == H100


def test_no_weights_exist_or_are_read(monkeypatch):
    import safetensors
    import torch

    def refuse(*a, **k):
        raise AssertionError("a weights file was opened")
    monkeypatch.setattr(safetensors, "safe_open", refuse)
    monkeypatch.setattr("looplm.io.safe_open", refuse)
    monkeypatch.setattr(torch, "load", refuse)
    for model in ("huginn-3.5b", ROOT / "checkpoints" / "ouro-demo"):  # a paper shape; a folder's config.json
        eng = E.emulated_engine(model, H100)
        assert not hasattr(eng.model, "parameters") and not isinstance(eng.model, torch.nn.Module)
        outs, _ = run_all(eng, make_requests("alpaca", 2, seed=0, max_model_len=256, vocab_size=eng.model.cfg.vocab_size))
        assert all(len(o.token_ids) >= 1 for o in outs)
    assert eng.tokenizer is not None and not isinstance(eng.tokenizer, E.TrivialTokenizer)  # the folder's own


def test_wall_time_waits_for_the_predicted_time_and_matches_the_simulator():
    cfg = paper_config("ouro-1.4b")
    reqs = make_requests("alpaca", 16, seed=0, max_model_len=4096, vocab_size=cfg.vocab_size)
    eng = E.emulated_engine("ouro-1.4b", H100, {"max_batch_size": 16}, by_index=True)
    cpu0 = time.process_time()
    outs, wall = run_all(eng, reqs)
    cpu = time.process_time() - cpu0
    predicted = eng.runner.clock
    assert predicted > 0.1  # enough device time to see the waits
    # it waited for the device (never less wall time than predicted) by sleeping, and never slept more than
    # the device would have taken. How much of the wait the host's own time covers instead depends on the
    # machine's load (a benchmark's question: infer.bench --device emulated-h100 reports wall_over_predicted),
    # so the share slept is not asserted: a busy machine slept 0.46 of it once
    assert wall >= predicted * 0.999, (wall, predicted)
    assert 0 < eng.runner.waited <= predicted * (1 + 1e-9) and cpu < wall
    # the same run on the simulator's virtual clock, host and device in series and the CPU path's
    # settings (the emulated device runs them): the same predicted seconds and depths
    depths = depths_from_distribution(binomial_depths(cfg.r_max, 2.5), reqs, 0)
    cost = eng.runner.cost
    raw = simulate_mode(cfg, reqs, {"name": "cdb", "policy": "cdb"}, cost, depths, overlap=False, max_batch_size=16,
                        kv_cache_tokens=eng.config.kv_cache_tokens, async_scheduling=False)
    assert raw["seconds"] == pytest.approx(predicted, rel=1e-9)
    assert [o.exit_depths for o in outs] == raw["exit_depths"]



def test_slowdown_stretches_the_wall_clock_not_the_device_clock():
    """--emulated-slowdown S: each wait is S x the prediction (a small host keeps up with a fast
    device's token rate); the virtual clock and the depths are the unslowed device's."""
    cfg = paper_config("ouro-1.4b")
    reqs = make_requests("alpaca", 6, seed=0, max_model_len=4096, vocab_size=cfg.vocab_size)
    fast, slow = (E.emulated_engine("ouro-1.4b", H100, {"max_batch_size": 8}, by_index=True, slowdown=s) for s in (1, 3))
    (outs_f, _), (outs_s, wall_s) = run_all(fast, reqs), run_all(slow, reqs)
    assert slow.runner.clock == pytest.approx(fast.runner.clock, rel=1e-9)
    assert [o.exit_depths for o in outs_s] == [o.exit_depths for o in outs_f]
    assert wall_s >= 3 * 0.999 * slow.runner.clock and slow.runner.waited > 2 * fast.runner.waited
    assert slow.runner.describe()["slowdown"] == 3
    with pytest.raises(ParamError, match="must be > 0"):
        E.emulated_engine("ouro-1.4b", H100, slowdown=0)


def test_preemption_swaps_are_waited_for():
    from infer.sim.workloads import Request
    eng = E.emulated_engine("ouro-1.4b", H100, {"kv_cache_tokens": 160, "watermark": 0.0, "max_batch_size": 8},
                            by_index=True)
    eng.runner.pcie_bandwidth = 1e9  # slow copies: the swaps' share of the time is visible
    outs, wall = run_all(eng, [Request([3 + i] * 20, 30, 20, 30) for i in range(8)])
    assert eng.metrics()["preemptions"] > 0 and all(len(o.token_ids) == 30 for o in outs)
    assert eng.runner.swap_seconds > 0.01 and wall >= eng.runner.clock * 0.999


@pytest.mark.parametrize("lookahead", [False, True])
def test_token_counts_and_depths_follow_the_engine_rules(lookahead):
    eng = E.emulated_engine("huginn-3.5b", H100, {"max_batch_size": 8, "lookahead": lookahead}, mean_depth=6.0)
    r_min = 2 if lookahead else 1
    assert eng.config.r_min == r_min and eng.config.exit_criterion == "learned"
    ps = [SamplingParams(max_tokens=7), SamplingParams(max_tokens=1), SamplingParams(max_tokens=20, r_min=5),
          SamplingParams(max_tokens=20, r_max=3), SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9)]
    seqs = [eng.add_request([5, 6, 7, 8], p, request_id=f"r{i}") for i, p in enumerate(ps)]
    while eng.has_unfinished():
        eng.step()
    outs = [eng.output(s) for s in seqs]
    assert [len(o.token_ids) for o in outs] == [7, 1, 20, 20, 12]  # emulated tokens are never EOS
    assert all(o.finish_reason == "length" for o in outs)
    seen = set()
    for o, p in zip(outs, ps):
        lo, hi = p.r_min or r_min, p.r_max or 16
        assert o.exit_depths[0] == 16 and all(lo <= d <= hi for d in o.exit_depths[1:]), (p, o.exit_depths)
        seen |= set(o.exit_depths[1:])
    assert len(seen) >= 3  # not vacuous


def test_replayed_depths_equal_the_file():
    doc = RP.load(EXITS)
    w = next(iter(doc["workloads"]))
    eng = E.emulated_engine("ouro-1.4b", H100, replay_exits=EXITS, by_index=True)
    reqs = RP.make_replay_requests(doc, w, eng.model.cfg.vocab_size, eng.max_model_len)
    outs, _ = run_all(eng, reqs)
    rs = RP.engine_settings(doc, {})
    pol = ExitPolicy(rs["exit_criterion"], rs["exit_threshold"], rs["r_min"], 4, False)
    want = RP.replay_depths(doc, w, pol)
    assert [o.exit_depths for o in outs] == want and len({d for row in want for d in row}) >= 2
    assert [len(o.token_ids) for o in outs] == [r["output_len"] for r in RP.requests_of(doc, w)]


def test_depth_sources():
    d = E.DrawnDepths(binomial_depths(4, 2.5), seed=3)
    reqs = make_requests("alpaca", 3, seed=0, max_model_len=512, vocab_size=300)
    want = depths_from_distribution(binomial_depths(4, 2.5), reqs, 3)
    assert [[d(str(i), j) for j in range(len(w))] for i, w in enumerate(want)] == want
    r = E.ReplayedDepths([[4, 1, 2], [4, 3]])
    assert [r("a", 1), r("b", 1), r("c", 1), r("a", 2), r("a", 3), r("a", 4)] == [1, 3, 1, 2, 1, 2]


def test_refusals_name_the_problem():
    with pytest.raises(ParamError, match="unknown emulated device") as e:
        E.emulated_engine("ouro-1.4b", "emulated:tpu")
    assert e.value.param == "device"
    with pytest.raises(ParamError, match="drop --exit-threshold"):
        E.emulated_engine("ouro-1.4b", H100, {"exit_threshold": 0.3})
    with pytest.raises(ParamError, match="config.json"):
        E.emulated_engine("/no/such/model", H100)
    with pytest.raises(ParamError, match="mean depth"):
        E.emulated_engine("ouro-1.4b", H100, mean_depth=9.0)
    with pytest.raises(ParamError, match="r_max"):
        E.emulated_engine("huginn-3.5b", H100, replay_exits=EXITS)  # recorded at r_max 4, Huginn loops 16
    from infer.serving.cli import make_engine, parser
    # serving builds the emulated device itself (no builder passed in by python -m infer.serve)
    assert make_engine(parser().parse_args(["--model", "ouro-1.4b", "--device", H100])).runner.device_info["device"] == H100
    with pytest.raises(ParamError, match="emulated device"):
        make_engine(parser().parse_args(["--model", "ouro-tiny", "--mean-depth", "2"]))


# ---------------------------------------------------------------------------------- the server
@pytest.fixture(scope="module")
def emulated_server():
    from infer.serving.cli import parser
    a = parser().parse_args(["--model", "ouro-1.4b", "--device", H100, "--max-batch-size", "16"])
    eng = E.engine_from_args(a)
    aeng = AsyncEngine(eng)
    srv = ServerThread(build_app(aeng, "ouro-1.4b"))
    yield srv, aeng
    srv.stop()
    assert aeng.engine.blocks.all_free


def test_server_says_it_is_emulated(emulated_server):
    srv, _ = emulated_server
    m = httpx.get(srv.url + "/v1/models").json()["data"][0]
    assert m["device"]["emulated"] is True and m["device"]["device"] == H100 and m["id"] == "ouro-1.4b"
    assert m["vocab_size"] == 49152 and m["max_model_len"] == 4096
    text = httpx.get(srv.url + "/metrics").text
    assert re.search(r'^cdb_info\{.*device="emulated:h100",emulated="true".*\} 1', text, re.M), text[-400:]


def test_server_answers_the_openai_routes(emulated_server):
    srv, _ = emulated_server
    c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    r = c.completions.create(model="ouro-1.4b", prompt=[5, 6, 7, 8, 9], max_tokens=9, temperature=0)
    ch = r.choices[0]
    assert len(ch.token_ids) == 9 and r.usage.completion_tokens == 9 and r.usage.prompt_tokens == 5
    assert ch.finish_reason == "length" and ch.exit_depths[0] == 4 and all(1 <= d <= 4 for d in ch.exit_depths)
    assert ch.text == "".join(f" {t}" for t in ch.token_ids)  # the trivial detokenizer
    chunks = list(c.completions.create(model="ouro-1.4b", prompt=[5, 6, 7], max_tokens=12, stream=True,
                                       stream_options={"include_usage": True}))
    body = [x for x in chunks if x.choices]
    assert sum(len(x.choices[0].token_ids) for x in body) == 12 and chunks[-1].usage.completion_tokens == 12
    assert all(1 <= d <= 4 for x in body for d in x.choices[0].exit_depths)
    msgs = [{"role": "user", "content": "hello"}]
    r = c.chat.completions.create(model="ouro-1.4b", messages=msgs, max_tokens=6)
    assert r.usage.completion_tokens == 6 and r.choices[0].message.role == "assistant"
    stream = list(c.chat.completions.create(model="ouro-1.4b", messages=msgs, max_tokens=6, stream=True))
    got = [x for x in stream if x.choices]
    assert got[0].choices[0].delta.role == "assistant"
    assert "".join(x.choices[0].delta.content or "" for x in got) == r.choices[0].message.content
    r = c.completions.create(model="ouro-1.4b", prompt="text works", max_tokens=5, logprobs=2, stop=["zz"],
                             extra_body={"r_min": 3})
    assert len(r.choices[0].token_ids) == 5 and all(d >= 3 for d in r.choices[0].exit_depths)
    assert len(r.choices[0].logprobs.token_logprobs) == 5
    for depth in ("full", "policy"):  # echo: the prompt's log-probs (uniform over the vocabulary: no model)
        r = c.completions.create(model="ouro-1.4b", prompt=[5, 6, 7], max_tokens=0, echo=True, logprobs=1,
                                 extra_body={"echo_logprobs_depth": depth})
        lp = r.choices[0].logprobs.token_logprobs
        assert lp[0] is None and len(lp) == 3 and all(x < -5 for x in lp[1:]), (depth, lp)
    with pytest.raises(openai.BadRequestError, match="context length"):
        c.completions.create(model="ouro-1.4b", prompt=[5] * 10, max_tokens=5000)


def test_server_replays_recorded_depths_in_arrival_order():
    doc = RP.load(EXITS)
    w = next(iter(doc["workloads"]))
    eng = E.emulated_engine("ouro-1.4b", H100, replay_exits=EXITS)
    srv = ServerThread(build_app(AsyncEngine(eng), "ouro-1.4b"))
    try:
        c = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        rs = RP.engine_settings(doc, {})
        want = RP.replay_depths(doc, w, ExitPolicy(rs["exit_criterion"], rs["exit_threshold"], rs["r_min"], 4))
        for row in want[:3]:
            ch = c.completions.create(model="ouro-1.4b", prompt=[5, 6], max_tokens=len(row)).choices[0]
            assert ch.exit_depths == row
    finally:
        srv.stop()


# ---------------------------------------------------------------------------------- the command lines
def test_offline_bench_json_says_emulated(tmp_path):
    from infer.bench.offline import main
    main(["--model", "ouro-1.4b", "--device", H100, "--workloads", "alpaca", "--num-requests", "6", "--ks", "1",
          "--repeats", "1", "--no-full-depth", "--out", str(tmp_path)])
    data = json.loads((tmp_path / "bench_ouro-1.4b_emulated-h100.json").read_text())
    assert data["emulated"] is True and data["device"]["device"] == H100 and data["params"] == 0
    for r in data["workloads"][0]["results"]:
        assert r["settings"]["emulated"] == H100 and r["seconds"] >= 0.999 * r["predicted_seconds"]
        assert r["wall_over_predicted"] >= 0.999  # (its size above 1 is the host's load: not asserted)
    by = {r["mode"]: r for r in data["workloads"][0]["results"]}
    assert by["cdb_refill_k1"]["speedup_vs_cb"] > 1  # mean depth 2.5 of 4


def test_offline_bench_refuses_recording_exits_on_an_emulated_device(tmp_path, capsys):
    from infer.bench.offline import main
    with pytest.raises(SystemExit):
        main(["--model", "ouro-1.4b", "--device", H100, "--record-exits", str(tmp_path / "x.json"),
              "--out", str(tmp_path)])
    assert "--record-exits" in capsys.readouterr().err


@pytest.mark.slow  # starts python -m infer.serve
def test_cli_banner_says_emulated():
    p = subprocess.Popen([sys.executable, "-m", "infer.serve", "--model", "huginn-3.5b", "--device", H100,
                          "--port", "0"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        url, line = wait_for_server(p)
        assert "EMULATED H100" in line and "no weights" in line, line
        r = httpx.post(url + "/v1/completions", json={"prompt": [5, 6], "max_tokens": 4}, timeout=60).json()
        assert r["usage"]["completion_tokens"] == 4
    finally:
        p.terminate()
        p.wait(timeout=30)


@pytest.mark.slow  # starts an emulated server per policy
def test_bench_online_on_an_emulated_server(tmp_path):
    from infer.bench.online import main
    s = main(["--model", "ouro-1.4b", "--device", H100, "--policies", "cb,cdb-refill", "--rates", "20",
              "--num-prompts", "12", "--dataset", "alpaca", "--length-scale", "1", "--max-seconds", "60",
              "--server-args", "--threads 1", "--out", str(tmp_path)])
    assert s["emulated"] is True and s["device"]["device"] == H100
    assert all(r["failed"] == 0 for runs in s["runs"].values() for r in runs)



# ---------------------------------------------------------------------------------- capacity curves
def test_capacity_point_stats_knees_and_ratios():
    from infer.bench import capacity as C
    reqs = [{"error": None, "output_len": 10, "e2e": 1.0 + i, "ttft": 0.1 * (i + 1)} for i in range(10)]
    reqs.append({"error": "timed out", "output_len": 0, "e2e": None, "ttft": None})
    s = C.point_stats(reqs)
    assert s["completed"] == 10 and s["failed"] == 1
    assert s["norm_latency_mean"] == pytest.approx(0.55) and s["norm_latency_p90"] == pytest.approx(0.91)
    assert s["ttft_mean_s"] == pytest.approx(0.55) and s["ttft_p90_s"] == pytest.approx(0.91)
    pts = {"cb": [{"rate": 1, "norm_latency_mean": 0.1, "failed": 0}, {"rate": 2, "norm_latency_mean": 0.5, "failed": 0}],
           "cdb-refill": [{"rate": 1, "norm_latency_mean": 0.1, "failed": 0},
                          {"rate": 2, "norm_latency_mean": 0.2, "failed": 0}]}
    k = C.knees(pts, 0.3)
    assert k["cb"]["max_rate_within_limit"] == 1 and not k["cb"]["censored"]
    assert k["cb"]["interpolated_rate_at_limit"] == pytest.approx(1.5)
    assert k["cdb-refill"]["max_rate_within_limit"] == 2 and k["cdb-refill"]["censored"]
    assert C.ratios({"cb": 2.0, "cdb-refill": 3.0, "cdb-norefill": None}) == {"cb": 1.0, "cdb-refill": 1.5,
                                                                              "cdb-norefill": None}
    assert (C.coda_batch("ouro-1.4b", "sharegpt"), C.coda_batch("huginn-3.5b", "alpaca"),
            C.coda_batch("huginn-3.5b", "arxiv")) == (1, 16, 2)
    with pytest.raises(ParamError, match="MODEL:WORKLOAD"):
        C.parse_pair("ouro-1.4b:nope")


def test_online_policy_labels():
    from infer.bench.online import main, policy_args
    assert policy_args("cdb-refill-k16") == ["--policy", "cdb", "--refill", "--min-coda-batch", "16"]
    assert policy_args("cdb-refill-kauto")[-1] == "auto" and policy_args("cb") == ["--policy", "cb"]
    assert policy_args("cdb-refill-k0") is None and policy_args("cdb-refill-kx") is None
    with pytest.raises(SystemExit, match="unknown policy 'cdb-refill-k0'"):
        main(["--model", "ouro-1.4b", "--policies", "cb,cdb-refill-k0", "--rates", "1"])


def test_capacity_simulated_knees_order_the_policies():
    from infer.bench import capacity as C
    k = C.sim_knees("ouro-1.4b", "alpaca", num_requests=32)
    assert k["cdb-refill"] > k["cdb-norefill"] > k["cb"] > 0


def test_capacity_sim_only(tmp_path):
    from infer.bench import capacity as C
    rows = C.main(["--sim-only", "--pairs", "huginn-3.5b:arxiv", "--sim-requests", "8", "--out", str(tmp_path)])["sim"]
    assert json.loads((tmp_path / "sim_knees.json").read_text()) == rows
    assert rows[0]["W"] == 8 and rows[0]["K"] == 2 and rows[0]["sim_ratio_to_cb"]["cb"] == 1.0
    # --ks: refill's knee at other K too (issue 39: auto against every fixed K); --k: refill's own
    rows = C.main(["--sim-only", "--pairs", "huginn-3.5b:arxiv", "--sim-requests", "8", "--k", "auto", "--ks", "1",
                   "auto", "--out", str(tmp_path)])["sim"]
    assert rows[0]["K"] == "auto" and rows[0]["sim_knee"]["cdb-refill"] == rows[0]["sim_knee"]["cdb-refill-kauto"]
    assert set(rows[0]["sim_knee"]) == {"cb", "cdb-norefill", "cdb-refill", "cdb-refill-k1", "cdb-refill-kauto"}


@pytest.mark.slow  # three emulated servers and a short sweep (~30 s)
def test_capacity_script_writes_the_table(tmp_path):
    from infer.bench import capacity as C
    res = C.main(["--pairs", "ouro-1.4b:alpaca", "--num-prompts", "8", "--ladder", "0.5", "1.0", "--max-seconds", "30",
                  "--sim-requests", "16", "--slowdown", "2", "--ks", "auto", "--out", str(tmp_path)])
    pair = json.loads((tmp_path / "capacity.json").read_text())["pairs"][0]
    assert pair == json.loads(json.dumps(res["pairs"][0]))
    assert pair["device"]["emulated"] is True and pair["device"]["attention"] == "paged"
    # slowed 2x: half of each rate sent, reported in the GPU's units
    assert pair["device"]["slowdown"] == 2 and pair["slowdown"] == 2
    assert [p["sent_rate"] * 2 for p in pair["points"]["cb"]] == pytest.approx(pair["rates"], rel=1e-3)
    # --ks auto: a refill server at min_coda_batch=auto beside the three, on the same requests
    assert pair["labels"] == [*C.LABELS, "cdb-refill-kauto"] and set(pair["knee"]) == set(pair["labels"])
    assert len(pair["points"]["cb"]) == len(pair["points"]["cdb-refill-kauto"]) == 2
    log = (tmp_path / "ouro-1.4b_alpaca" / "server_cdb-refill-kauto.log").read_text()
    assert "(cdb, refill K=auto, " in log, log[:2000]
    assert pair["authors_ratio_to_cb"]["cdb-refill"] == pytest.approx(53.9 / 34.9)
    assert all(p["failed"] == 0 and p["norm_latency_p90"] >= 0 for pts in pair["points"].values() for p in pts)


def test_layer_split_emulates_the_smaller_model():
    reqs = make_requests("alpaca", 4, seed=0, max_model_len=512, vocab_size=65536)
    clocks = {}
    for split in (None, "0-4-0"):
        eng = E.emulated_engine("huginn-3.5b", H100, {"kv_cache_tokens": 4096}, layer_split=split, by_index=True)
        run_all(eng, reqs)
        clocks[split] = eng.runner.clock
        assert (eng.model.cfg.n_prelude, eng.model.cfg.n_coda) == ((2, 2) if split is None else (0, 0))
    assert clocks["0-4-0"] < clocks[None]

"""Recorded-exit replay (infer/sim/replay.py): recording a live run and replaying it at its own
policy reproduces that run's per-token depths exactly; under replay every CDB mode has the same
depths; a complete recording (r_min = r_max) replays any threshold; what cannot be derived is
refused by name."""
import json

import pytest

from infer.bench import offline
from infer.sim import replay as RP
from infer.sim.__main__ import main as sim_main
from looplm import ExitPolicy
from looplm.errors import ParamError

from helpers import fresh_model, model, THRESHOLD

MODES = [m for m in offline.modes_for([1, 4], norefill=True, full_depth=True) if m["name"] != "cb_separate"]
BASE = {"max_batch_size": 4, "exit_threshold": THRESHOLD}


def _bench(m, modes=MODES, base=None, **kw):
    # a small pool: every mode's engine stays alive for the run, and the CPU default is 512 MB each
    return offline.bench_workload(m, None, "alpaca", num_requests=5, scale=0.05, seed=1, modes=modes, repeats=1,
                                  warmup=False, base={"kv_cache_tokens": 2048, **(base or {})}, **kw)


def _doc(tmp_path, blk, m, name="rec.json"):
    rec = blk["recorded_exits"]
    path = tmp_path / name
    RP.write(path, model="ouro-tiny", policy=rec["policy"], model_r_min=m.cfg.r_min, kv_layout=rec["kv_layout"],
             workloads={"alpaca": {"scale": 0.05, "seed": 1, "requests": rec["requests"]}})
    return RP.load(path)


def _depths(blk):
    return {r["mode"]: r["exit_depths_crc32"] for r in blk["results"]}


@pytest.mark.parametrize("lookahead", [False, True])
def test_record_then_replay_at_the_recorded_policy_reproduces_the_live_depths(tmp_path, lookahead):
    m = model("ouro-tiny")
    base = {**BASE, "lookahead": lookahead, "r_min": 2 if lookahead else 1}
    live = _bench(m, base=base, record=True)
    rec_depths = live["recorded_exits"]["exit_depths"]
    crc = _depths(live)
    adaptive = [n for n in crc if n.startswith("cdb_") and n != "cdb_full_depth"]
    assert len({crc[n] for n in adaptive}) == 1  # the engine is exact: every CDB mode, the same depths
    assert crc[adaptive[0]] == RP.depths_crc32(rec_depths)  # ... as the recording pass
    assert len({d for ds in rec_depths for d in ds[1:]}) > 1, "the test needs a spread of exit depths"
    doc = _doc(tmp_path, live, m)
    replayed = _bench(m, base={"max_batch_size": 4, "lookahead": lookahead}, replay=doc)  # threshold, r_min: the file's
    assert _depths(replayed) == crc
    by = {r["mode"]: r for r in replayed["results"]}
    assert [by[n]["work"] for n in adaptive] == [r["work"] for r in live["results"] if r["mode"] in adaptive]
    assert replayed["replayed_exits"]["threshold"] == THRESHOLD


def test_complete_recording_replays_any_threshold_and_other_models(tmp_path):
    m = model("ouro-tiny")
    blk = _bench(m, base={**BASE, "r_min": m.cfg.r_max}, record=True)
    doc = _doc(tmp_path, blk, m)
    assert doc["complete"] and doc["replay_r_min"] == m.cfg.r_min
    rows = [row for r in doc["workloads"]["alpaca"]["requests"] for row in r["scores"]]
    assert all(len(row) == m.cfg.r_max for row in rows)  # every step's score was read
    means = []
    for q in (0.3, 0.8):
        out = _bench(m, base={"max_batch_size": 4, "exit_threshold": q}, replay=doc, modes=MODES[:-1])
        pol = ExitPolicy(doc["criterion"], q, 1, m.cfg.r_max)
        want = RP.replay_depths(doc, "alpaca", pol)
        crc = _depths(out)
        assert crc["cdb_refill_k1"] == crc["cdb_refill_k4"] == crc["cdb_norefill"] == RP.depths_crc32(want)
        means.append(next(r for r in out["results"] if r["mode"] == "cdb_refill_k1")["mean_exit_depth"])
    # the criterion is a probability: a higher threshold never exits earlier
    assert means == sorted(means, reverse=False) and means[0] < means[-1]
    # another model with the same r_max (other weights) replays the same depths and lengths; one
    # with another r_max is refused
    other = fresh_model("ouro-tiny", seed=11)
    out = _bench(other, base={"max_batch_size": 4, "exit_threshold": 0.8}, replay=doc, modes=MODES[:3])
    assert _depths(out)["cdb_refill_k1"] == crc["cdb_refill_k1"]
    assert {r["output_tokens"] for r in out["results"]} == {sum(r["output_len"] for r in
                                                                doc["workloads"]["alpaca"]["requests"])}
    with pytest.raises(ParamError, match="recorded with r_max 4, this engine runs r_max 6"):
        _bench(model("huginn-tiny"), base={"max_batch_size": 4}, replay=doc, modes=MODES[:3])


def test_replay_refuses_what_a_partial_recording_cannot_decide(tmp_path):
    m = model("ouro-tiny")
    doc = _doc(tmp_path, _bench(m, base={**BASE, "exit_threshold": 0.3}, record=True), m)
    assert not doc["complete"]
    with pytest.raises(ParamError, match="record with --r-min"):
        _bench(m, base={"max_batch_size": 4, "exit_threshold": 0.95}, replay=doc)


def test_derive_follows_the_engines_tracker():
    p = ExitPolicy("learned", 0.5, 1, 4)
    assert RP.derive([0.1, 0.6, 0.9], p) == 2
    assert RP.derive([0.1, 0.2, 0.3], p) == 4  # r_max always stops; its score is not needed
    assert RP.derive([0.9], ExitPolicy("learned", 0.5, 1, 4, lookahead=True)) == 2
    assert RP.derive([0.9, 0.9, 0.9], ExitPolicy("learned", 0.5, 3, 4)) == 3  # no exit below r_min
    with pytest.raises(RP.MissingScore):
        RP.derive([0.1], p)
    assert RP.derive([0.1, 0.1, 0.1], ExitPolicy("latent_diff", 0.2, 1, 4)) == 1  # a distance: below q exits


def test_load_names_a_bad_file(tmp_path):
    with pytest.raises(ParamError, match="no such recorded-exits file"):
        RP.load(tmp_path / "nope.json")
    (tmp_path / "x.json").write_text(json.dumps({"format": "other"}))
    with pytest.raises(ParamError, match="not a recorded-exits file"):
        RP.load(tmp_path / "x.json")


def test_sim_replays_a_recording(tmp_path):
    m = model("ouro-tiny")
    blk = _bench(m, base={**BASE, "r_min": m.cfg.r_max}, record=True)
    path = tmp_path / "rec.json"
    rec = blk["recorded_exits"]
    RP.write(path, model="ouro-tiny", policy=rec["policy"], model_r_min=1, kv_layout=rec["kv_layout"],
             workloads={"alpaca": {"scale": 0.05, "seed": 1, "requests": rec["requests"]}})
    sim_main(["--model", "ouro-1.4b", "--replay-exits", str(path), "--replay-threshold", "0.55", "--ks", "1",
              "--kv-cache-tokens", "32768", "--max-num-batched-tokens", "512",
              "--host-json", "none", "--out", str(tmp_path / "sim")])
    out = json.loads(next((tmp_path / "sim").glob("sim_*.json")).read_text())
    want = RP.replay_depths(RP.load(path), "alpaca", ExitPolicy(rec["policy"].criterion, 0.55, 1, 4))
    res = {r["mode"]: r for r in out["workloads"][0]["results"]}
    assert res["cdb_refill_k1"]["exit_depths_crc32"] == RP.depths_crc32(want)
    assert out["replay_exits"] == str(path) and out["workloads"][0]["replayed_exits"]["policy"]["threshold"] == 0.55


def _full_depth_doc(outputs):
    """A recording of a full-depth (CB) run: criterion none, no scores read."""
    return {"format": RP.FORMAT, "model": "m", "criterion": "none", "threshold": None, "r_min": 4, "r_max": 4,
            "lookahead": False, "kv_layout": "last_exited", "complete": False, "replay_r_min": 4,
            "workloads": {"a": {"requests": [{"prompt_len": 3, "output_len": n, "scores": []} for n in outputs]},
                          "b": {"requests": [{"prompt_len": 5, "output_len": 2, "scores": []}]}}}


def test_a_full_depth_recording_replays_every_output_token_at_r_max():
    """CB's recording reads no scores; its replay still gives each of the output_len tokens r_max
    (the sweep's CB point: the simulator once indexed past a one-entry depth list)."""
    doc = _full_depth_doc([6, 1])
    assert RP.replay_depths(doc, "a", ExitPolicy("none", None, 4, 4)) == [[4] * 6, [4]]


def test_pooled_workloads_keep_every_request_in_order():
    doc = RP.pooled(_full_depth_doc([6, 1]))
    assert list(doc["workloads"]) == [RP.POOLED] and doc["workloads"]["all"]["pooled"] == ["a", "b"]
    assert [r["output_len"] for r in RP.requests_of(doc, "all")] == [6, 1, 2]


def test_sim_replays_on_a_checkpoint_shape_and_another_gpu(tmp_path):
    """infer.sim --model FOLDER: the checkpoint's own shape (its config.json, no weights read);
    --gpu h200 prices its bandwidth; --pool replays the file's workloads as one stream."""
    from looplm import save_pretrained
    folder = save_pretrained(model("ouro-tiny"), tmp_path / "ckpt")
    path = tmp_path / "rec.json"
    path.write_text(json.dumps(_full_depth_doc([6, 3])))
    tps = {}
    for gpu in ("h100", "h200"):
        sim_main(["--model", str(folder), "--replay-exits", str(path), "--pool", "--ks", "1", "--gpu", gpu,
                  "--host-json", "none", "--overhead-us", "0", "--op-us", "0", "--replay-us", "0",
                  "--out", str(tmp_path / gpu)])
        out = json.loads(next((tmp_path / gpu).glob("sim_ckpt_*.json")).read_text())
        assert out["gpu"] == gpu and out["pooled"] and len(out["workloads"]) == 1
        res = {r["mode"]: r for r in out["workloads"][0]["results"]}
        assert res["cb"]["output_tokens"] == 6 + 3 + 2 and res["cdb_refill_k1"]["mean_exit_depth"] == 4
        tps[gpu] = res["cb"]["output_tokens_per_s"]
    assert tps["h200"] / tps["h100"] == pytest.approx(4.8 / 3.35, rel=0.05)  # weight-bound, no host time
    with pytest.raises(SystemExit):
        sim_main(["--model", str(folder), "--pool", "--out", str(tmp_path / "x")])  # --pool without a file


def test_sim_takes_a_csv_length_trace(tmp_path, capsys):
    """--workloads FILE.csv: a length trace the project does not ship (prompt_tokens and
    output_tokens columns, others ignored), e.g. to check min_coda_batch=auto on it."""
    trace = tmp_path / "mine.csv"
    trace.write_text("arrived_at,prompt_tokens,output_tokens\n0.0,12,5\n0.1,30,7\n0.2,8,3\n0.3,20,9\n")
    sim_main(["--model", "ouro-mini", "--workloads", str(trace), "--num-requests", "4", "--ks", "1", "auto",
              "--out", str(tmp_path / "o")])
    out = json.loads(next((tmp_path / "o").glob("sim_*.json")).read_text())
    w = out["workloads"][0]
    assert w["workload"]["workload"] == str(trace) and w["workload"]["output_tokens"] == 5 + 7 + 3 + 9
    assert {r["mode"] for r in w["results"]} >= {"cb", "cdb_refill_k1", "cdb_refill_kauto"}
    bad = tmp_path / "bad.csv"
    bad.write_text("prompt,output\n1,2\n")
    for arg, msg in ((str(bad), "needs the columns prompt_tokens and output_tokens"), ("nope", "unknown workload 'nope'")):
        with pytest.raises(SystemExit):
            sim_main(["--model", "ouro-mini", "--workloads", arg, "--out", str(tmp_path / "x")])
        assert msg in capsys.readouterr().err

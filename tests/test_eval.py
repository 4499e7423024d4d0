"""Evaluation: the lm-eval model "looped" on the local tasks (simple_evaluate and the CLI),
teacher-forced log-probs against the reference decoder (float64), the sweep runner (CSV, offline
wandb runs, plots), the task builder. A tiny random model with a small BPE; no network; seconds."""
import functools
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
import yaml

from eval import lm as looped
from eval import sweep
from infer.engine.config import EngineConfig
from infer.engine.reference import reference_generate
from looplm import ExitPolicy, save_pretrained, tiny_model

ROOT = Path(__file__).resolve().parents[1]
TASKS = looped.TASKS_DIR
THRESHOLD = 0.55


@functools.lru_cache(maxsize=None)
def tokenizer_dir(tmp: Path) -> Path:
    from transformers import AutoTokenizer

    from train.tokenizer import save_tokenizer, train_bpe
    texts = [ln for f in (TASKS / "data").glob("*.jsonl") for ln in f.read_text().splitlines()]
    save_tokenizer(train_bpe(texts, vocab_size=400), tmp / "tok")
    AutoTokenizer.from_pretrained(tmp / "tok")  # loads
    return tmp / "tok"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(model folder, float64 model, tokenizer): a random ouro-tiny with a 400-token BPE and a
    128-token context (the demo models' context), so truncation and rolling windows are exercised."""
    from transformers import AutoTokenizer

    tmp = tmp_path_factory.mktemp("looped")
    tok = AutoTokenizer.from_pretrained(tokenizer_dir(tmp))
    model = tiny_model("ouro-tiny", vocab_size=400, max_position=128, std=0.15, seed=3, exit_threshold=THRESHOLD)
    folder = save_pretrained(model, tmp / "model", tokenizer=tok)
    return folder, model.to(torch.float64), tok


def lm_for(model, tok, **kw) -> looped.LoopedEvalLM:
    return looped.LoopedEvalLM(model, tokenizer=tok, exit_threshold=THRESHOLD, batch_size=4, dtype="float64", **kw)


# ---------------------------------------------------------------- lm-eval through the engine
def test_simple_evaluate_runs_every_local_task(tiny):
    folder, _, _ = tiny
    lm = looped.LoopedEvalLM(str(folder), exit_threshold=THRESHOLD, batch_size=8)
    res = looped.simple_evaluate(lm, tasks=["looped_suite"], limit=3, task_manager=looped.task_manager(),
                                 bootstrap_iters=0, log_samples=False)
    r = res["results"]
    assert set(r) == {"looped_ppl", "looped_cloze", "looped_lastword", "looped_reasoning"}
    assert 0 <= r["looped_cloze"]["acc,none"] <= 1
    assert 0 <= r["looped_lastword"]["exact_match,first-word"] <= 1
    assert 0 <= r["looped_reasoning"]["exact_match,number"] <= 1
    assert r["looped_ppl"]["word_perplexity,none"] > 1
    r_max = lm.model.cfg.r_max
    for task, m in r.items():
        assert 1 <= m["exit_depth,none"] <= r_max, task
        assert 0 < m["adaptive_frac,none"] <= 1, task
    assert res["config"]["exit_settings"]["exit_threshold"] == THRESHOLD
    # the registry route (model name + argument string), as lm-eval's own CLI would build it
    res2 = looped.simple_evaluate("looped", model_args=f"pretrained={folder},exit_threshold={THRESHOLD},batch_size=8",
                                  tasks=["looped_cloze"], limit=3, task_manager=looped.task_manager(),
                                  bootstrap_iters=0, log_samples=False)
    assert res2["results"]["looped_cloze"]["acc,none"] == r["looped_cloze"]["acc,none"]


def test_full_depth_reports_r_max(tiny):
    _, model, tok = tiny
    lm = lm_for(model, tok, full_depth=True)
    looped.simple_evaluate(lm, tasks=["looped_cloze"], limit=2, task_manager=looped.task_manager(),
                           bootstrap_iters=0, log_samples=False)
    assert lm.depth_stats()["looped_cloze"]["exit_depth"] == model.cfg.r_max


@pytest.mark.slow
def test_cli_evaluates_local_task(tiny, tmp_path):
    folder, _, _ = tiny
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "eval", "run", "--model", "looped", "--model_args",
           f"pretrained={folder},exit_threshold={THRESHOLD},r_min=2", "--tasks", "looped_cloze,looped_reasoning",
           "--limit", "2", "--batch_size", "4", "--output_path", str(tmp_path / "out")]
    p = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "exit_depth" in p.stdout and "looped_reasoning" in p.stdout
    out = json.loads(next((tmp_path / "out").rglob("results_*.json")).read_text())
    assert out["results"]["looped_cloze"]["exit_depth,none"] >= 2  # r_min=2 reached the engine
    assert out["config"]["exit_settings"]["r_min"] == 2


# ---------------------------------------------------------------- exactness
CASES = [([5, 6, 7, 8, 9], [10, 11, 12, 13, 14, 15]), ([3], [40, 41, 42]), (list(range(20, 60)), [7] * 9)]


@pytest.mark.parametrize("kw", [dict(kv_layout="last_exited"), dict(kv_layout="shared"),
                                dict(kv_layout="last_exited", lookahead=True), dict(kv_layout="last_exited", r_min=2)])
def test_loglikelihood_equals_reference_float64(tiny, kw):
    _, model, tok = tiny
    lm = lm_for(model, tok, **kw)
    got = lm._loglikelihood_tokens([(None, ctx, cont) for ctx, cont in CASES])
    pol = ExitPolicy.from_config(model.cfg, threshold=THRESHOLD, r_min=kw.get("r_min"),
                                 lookahead=kw.get("lookahead", False))
    depths = []
    for (lp, greedy), (ctx, cont) in zip(got, CASES):
        ref = reference_generate(model, ctx, len(cont), pol, kv_layout=kw["kv_layout"], forced_tokens=cont)
        assert abs(lp - sum(ref.logprobs)) < 1e-10
        depths += ref.exit_depths[1:]
    assert len(set(depths)) >= 2  # the policy really exited at different depths
    stats = lm.depth_stats()["unknown"]
    assert stats["exit_depth"] == pytest.approx(sum(depths) / len(depths))


def test_is_greedy_and_rolling_windows(tiny):
    _, model, tok = tiny
    lm = lm_for(model, tok)
    ctx = [5, 6, 7]
    greedy = reference_generate(model, ctx, 6, ExitPolicy.from_config(model.cfg, threshold=THRESHOLD)).token_ids
    other = greedy[:3] + [(greedy[3] + 1) % 400] + greedy[4:]
    (_, g1), (_, g2) = lm._loglikelihood_tokens([(None, ctx, greedy), (None, ctx, other)])
    assert g1 and not g2
    # a document longer than the context: every token is scored exactly once, over several windows
    text = " ".join(json.loads(ln)["text"] for ln in (TASKS / "data" / "ppl.jsonl").read_text().splitlines()[:6])
    n = len(lm.tok_encode(text))
    assert n > 2 * lm.max_length
    lm.reset_depth_stats()
    req = types.SimpleNamespace(args=(text,), task_name="doc")
    (total,) = lm.loglikelihood_rolling([req])
    assert total < 0 and lm._depth["doc"][2] == n


def test_generate_until_stops_and_caps(tiny):
    _, model, tok = tiny
    lm = lm_for(model, tok)
    prompt = "The river Elbe surged to an all-time record high"
    free = lm.generate_until([types.SimpleNamespace(args=(prompt, {"until": [], "max_gen_toks": 12}),
                                                     task_name="g")])[0]
    assert free and 1 <= lm._depth["g"][2] <= 12  # tokens generated
    # a stop string from the middle of the free generation (ASCII: random byte-level tokens may
    # decode to partial characters)
    stop = next(free[i:i + 2] for i in range(len(free) // 2, len(free) - 1) if free[i:i + 2].isascii())
    cut = lm.generate_until([types.SimpleNamespace(args=(prompt, {"until": [stop], "max_gen_toks": 12}),
                                                    task_name="g")])[0]
    assert cut == free[:free.index(stop)]
    # a prompt longer than the context is left-truncated, not rejected
    long = lm.generate_until([types.SimpleNamespace(args=(prompt * 40, {"until": ["\n"], "max_gen_toks": 4}),
                                                     task_name="g")])[0]
    assert isinstance(long, str)


# ---------------------------------------------------------------- sweeps
@pytest.mark.slow  # two sweep points, each an lm-eval run and a bench (~10 s)
def test_sweep_two_points_writes_csv_wandb_and_plots(tiny, tmp_path):
    _, model, tok = tiny
    spec = yaml.safe_load((ROOT / "eval" / "sweeps" / "smoke.yaml").read_text())
    spec["parameters"]["tasks"] = {"value": "looped_cloze,looped_reasoning"}
    path = tmp_path / "two.yaml"
    path.write_text(yaml.safe_dump(spec))
    out = tmp_path / "sweep"
    rows = sweep.run_sweep(path, out, {"limit": 2, "bench_requests": 2, "baselines": False, "batch_size": 4,
                                       "dtype": "float64"}, model=model, tokenizer=tok)
    assert [r["exit_threshold"] for r in rows] == [0.5, 0.9]
    lines = (out / "results.csv").read_text().splitlines()
    assert len(lines) == 3 and "bench/output_tokens_per_s" in lines[0] and "looped_cloze/acc" in lines[0]
    assert len(json.loads((out / "results.json").read_text())) == 2
    for r in rows:
        run = Path(r["wandb_run"])
        assert run.is_dir() and run.name.startswith("offline-run-") and list(run.glob("*.wandb"))
        assert r["bench/output_tokens_per_s"] > 0 and 1 <= r["mean_exit_depth"] <= 4
    assert (out / "pareto.png").stat().st_size > 1000 and (out / "threshold.png").stat().st_size > 1000


def test_grid_dedupes_equal_policies_and_adds_baselines():
    pts = sweep.grid_points({"exit_threshold": [0.5], "r_min": [1, 2], "kv_layout": ["last_exited", "shared"],
                             "lookahead": [False, True]}, {}, baselines=True)
    assert len(pts) == 8 + 2
    keys = {sweep.policy_key(p) for p in pts}
    assert len(keys) == 4 + 2 + 2  # lookahead: r_min 1 == r_min 2
    kl, gate = ({"exit_criterion": c, "exit_threshold": 0.5, "kv_layout": "shared"} for c in ("kl", "learned"))
    assert sweep.policy_key(kl) != sweep.policy_key(gate)  # the criterion is part of the policy
    from eval.plots import pareto_front
    assert pareto_front([(1, 1), (2, 0.5), (0.5, 2), (0.4, 0.4), (2, 0.4)]) == [2, 0, 1]


def test_pareto_knee_and_where_accuracy_breaks():
    from eval.plots import breaks_after, knee
    front = [(100, 0.99), (150, 0.985), (200, 0.97), (260, 0.60), (300, 0.30)]  # by throughput
    assert knee(front) == 2  # the last point before the collapse
    assert knee(front[:2]) is None and knee([(0, 0), (1, 1), (2, 2)]) is None  # a straight front has no knee
    assert breaks_after(front, ref=0.99, tol=0.01) == 1  # 0.985 keeps full depth's accuracy, 0.97 does not
    assert breaks_after(front, ref=0.999, tol=0.0) is None


@pytest.mark.parametrize("path", sorted((ROOT / "eval" / "sweeps").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_sweeps_are_valid(path):
    spec = sweep.load_sweep(path)
    known = set(sweep.SETTINGS) | set(sweep.DEFAULTS) | {"pretrained", "tokenizer"}
    assert set(spec["fixed"]) | set(spec["grid"]) <= known
    raw = yaml.safe_load(path.read_text())
    assert raw["method"] == "grid" and "${args}" in raw["command"]
    import inspect
    params = inspect.signature(looped.LoopedEvalLM).parameters
    assert all(k in params or k in EngineConfig.field_names() for k in sweep.SETTINGS)


# ---------------------------------------------------------------- task data
def test_build_eval_tasks_from_heldout_text(tmp_path):
    from scripts import build_eval_tasks as b
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    para = ("Ada Lovelace wrote notes on the engine of Babbage. The notes were long and careful and they "
            "described how the engine could compute numbers in sequence. Later readers praised Lovelace.")
    docs = [f"Heading {i}\n{para.replace('Babbage', f'Babbage{i}')} More words follow here for document {i} "
            "so that the paragraph is long enough to cut into a context and a continuation." for i in range(6)]
    (corpus / "heldout.txt").write_text("\n\n".join(docs) + "\n")
    (corpus / "heldout_synthetic.jsonl").write_text("".join(
        json.dumps({"kind": "add", "prompt": f"{i}+{i}=", "answer": str(2 * i)}) + "\n" for i in range(10)))
    counts = b.build(corpus, tmp_path / "out", n=5)
    assert counts["ppl"] > 0 and counts["cloze"] == 5 and counts["reasoning"] == 5 and counts["lastword"] > 0
    load = lambda name: [json.loads(ln) for ln in (tmp_path / "out" / f"{name}.jsonl").read_text().splitlines()]
    for it in load("cloze"):
        assert it["context"] + " " + it["choices"][it["gold"]] in " ".join(d.split("\n")[1] for d in docs)
        assert len(set(it["choices"])) == 4
    for it in load("lastword"):
        assert it["target"] in it["context"]
    for it in load("reasoning"):
        assert it["prompt"].split("\n")[-1].endswith("=")
    assert b.build(corpus, tmp_path / "again", n=5) == counts
    assert (tmp_path / "out" / "cloze.jsonl").read_text() == (tmp_path / "again" / "cloze.jsonl").read_text()


def test_shipped_task_data_is_present():
    for name in ("ppl", "cloze", "lastword", "reasoning"):
        rows = (TASKS / "data" / f"{name}.jsonl").read_text().splitlines()
        assert len(rows) >= 100, name


def test_report_drop_point_and_lookahead_cost(tmp_path):
    from eval import report
    M = "looped_ppl/bits_per_byte"
    rows = [{"policy": "cb", "kv_layout": "last_exited", "exit_threshold": "", "r_min": "", "lookahead": "False",
             "mean_exit_depth": "4", M: "2.00"}]
    for q, d, v in [(0.9, 3.5, 2.01), (0.7, 3.0, 2.016), (0.5, 2.0, 2.104)]:
        rows.append({"policy": "cdb", "kv_layout": "last_exited", "exit_threshold": str(q), "r_min": "2",
                     "lookahead": "False", "mean_exit_depth": str(d), M: str(v)})
    rows.append({"policy": "cdb", "kv_layout": "last_exited", "exit_threshold": "0.6", "r_min": "1",
                 "lookahead": "True", "mean_exit_depth": "2.5", M: "2.1"})
    (drop,) = [s for s in report.drop_points(rows, M, 0.01) if s.startswith("r_min=2")]
    assert "q=0.5" in drop  # 2.104 > 2.00 * 1.01; 2.016 is within 1%
    cost = report.lookahead_cost(rows, M)
    assert "2.0600" in cost[0] and cost[-1].endswith("+0.0400 (lower is better)")  # vs (2.016 + 2.104) / 2
    with open(tmp_path / "r.csv", "w") as f:
        f.write(",".join(rows[1]) + "\n" + "\n".join(",".join(r[k] for k in rows[1]) for r in rows) + "\n")
    assert "| cdb | 0.9 | 2 | last_exited | no | 3.50 | 2.010 |" in report.report(tmp_path / "r.csv")


def test_sweep_point_passes_the_criterion_to_the_bench(monkeypatch):
    from infer.bench import offline as bench
    seen = {}
    monkeypatch.setattr(bench, "throughput", lambda model, **kw: seen.update(kw) or {"output_tokens_per_s": 1.0})
    cfg = {**sweep.DEFAULTS, "bench_repeats": 1}
    sweep.bench_point("m", {"exit_criterion": "learned", "exit_threshold": 0.9, "r_min": 2, "lookahead": False}, cfg)
    assert seen["exit_criterion"] == "learned" and seen["exit_threshold"] == 0.9 and seen["r_min"] == 2


def test_record_exits_model_arg_replays_the_run(tiny, tmp_path, monkeypatch):
    """model_args record_exits=FILE (issue 40, deliverable 3): the exits of the evaluation, each
    task a workload; replayed under the run's own policy they give every token's depth the run
    took (loglikelihood and generation), with the run's lengths; generation keeps its text."""
    from infer.sim import replay as RP
    _, model, tok = tiny
    path = tmp_path / "exits.json"
    prompt = "The river Elbe surged to an all-time record high"
    plain = lm_for(model, tok).generate_until([types.SimpleNamespace(args=(prompt, {"until": [], "max_gen_toks": 9}),
                                                                      task_name="gen")])
    lm = lm_for(model, tok, record_exits=str(path))
    eng, seen = lm.llm.engine, []
    add = eng.add_request

    def recorded(*a, **kw):
        s = add(*a, **kw)
        seen.append(s)
        return s
    monkeypatch.setattr(eng, "add_request", recorded)
    ctx = tok.encode("Rivers rise in spring", add_special_tokens=False)
    lm._loglikelihood_tokens([(None, ctx, [5, 6, 7, 8, 9, 10]), (None, ctx[:3], [11, 12])], tasks=["ll", "ll"])
    got = lm.generate_until([types.SimpleNamespace(args=(prompt, {"until": [], "max_gen_toks": 9}), task_name="gen")])
    assert got == plain
    doc = RP.load(path)
    assert set(doc["workloads"]) == {"ll", "gen"} and doc["r_max"] == model.cfg.r_max
    by_task = {"ll": seen[:2], "gen": seen[2:]}
    for task, seqs in by_task.items():
        rows = RP.requests_of(doc, task)
        assert [(r["prompt_len"], r["output_len"]) for r in rows] == [(len(s.prompt_ids), len(s.output_ids)) for s in seqs]
        assert RP.replay_depths(doc, task, eng.policy) == [s.exit_depths for s in seqs]
    assert len({d for s in seen for d in s.exit_depths[1:]}) >= 2  # the exits vary
    # ... and the simulator replays the file as it is: each task a workload, described by its lengths
    import json

    from infer.sim.__main__ import main as sim_main
    sim_main(["--model", "ouro-1.4b", "--replay-exits", str(path), "--ks", "1", "--out", str(tmp_path / "sim")])
    out = json.loads(next((tmp_path / "sim").glob("sim_*.json")).read_text())
    ws = {w["workload"]["workload"]: w["workload"] for w in out["workloads"]}
    assert set(ws) == {"ll", "gen"} and ws["ll"]["mean_output_len"] == 4 and ws["gen"]["num_requests"] == 1


# ---------------------------------------------------------------- the sweep's GPU throughput (issue 40)
@pytest.mark.slow  # two points: lm-eval, the CPU bench, the simulator and the emulated bench each (~15 s)
def test_sweep_sim_column_equals_a_separate_replay_of_the_points_file(tiny, tmp_path):
    """--throughput emulated:h100: every row's simulated tokens/s is what `python -m infer.sim` gives
    on that point's recorded file (its command, re-run here); the CB row replays at full depth; the
    emulated bench's tokens/s stands beside it; the plot gets the GPU axis and keeps the CPU's."""
    from infer.sim.__main__ import main as sim_main
    folder, model, tok = tiny
    spec = yaml.safe_load((ROOT / "eval" / "sweeps" / "smoke.yaml").read_text())
    spec["parameters"]["tasks"] = {"value": "looped_reasoning"}
    spec["parameters"]["exit_threshold"] = {"value": THRESHOLD}
    path = tmp_path / "one.yaml"
    path.write_text(yaml.safe_dump(spec))
    out = tmp_path / "sweep"
    rows = sweep.run_sweep(path, out, {"limit": 4, "bench_requests": 2, "batch_size": 4, "dtype": "float64",
                                       "pretrained": str(folder), "throughput": "emulated:h100", "wandb": False,
                                       "sim_model": "ouro-1.4b", "baselines": True}, model=model, tokenizer=tok)
    assert [r["policy"] for r in rows] == ["cdb", "cb"]
    for r in rows:
        again = tmp_path / ("again-" + r["name"])
        argv = r["sim/command"].split()[3:]
        argv[argv.index("--out") + 1] = str(again)
        sim_main(argv)
        doc = json.loads(next(again.glob("sim_*.json")).read_text())
        mode = "cb" if r["policy"] == "cb" else "cdb_refill_k1"
        (want,) = [x for x in doc["workloads"][0]["results"] if x["mode"] == mode]
        assert r["sim/output_tokens_per_s"] == want["output_tokens_per_s"]
        assert r["sim/requests"] == 4 and r["sim/model"].startswith("ouro-1.4b")
        assert r["emulated/output_tokens_per_s"] > 0 and r["emulated_vs_sim"] > 0
    cdb, cb = rows
    assert cb["sim/mean_exit_depth"] == 4 and cb["sim/speedup_vs_cb"] == 1.0
    assert cdb["sim/mean_exit_depth"] == pytest.approx(cdb["mean_exit_depth"])  # the depths the evaluation took
    # less work; not necessarily faster: at 4 requests every prompt's chunks ride CDB's r_max + 2 eager
    # launches against CB's one, and the dispatch charge (issue 62) leaves it at ~0.996x CB (the speedup
    # is the simulator's own, compared with a separate replay above)
    assert cdb["sim/compute_ratio"] < 1 and 0 < cdb["sim/speedup_vs_cb"] < 2
    header = (out / "results.csv").read_text().splitlines()[0]
    assert "sim/fraction_of_bound" in header and "bench/output_tokens_per_s" in header
    assert (out / "pareto.png").stat().st_size > 1000


def test_sweep_refuses_an_unknown_throughput_before_evaluating(tmp_path):
    with pytest.raises(ValueError, match="throughput must be one of"):
        sweep.resolve_sweep(ROOT / "eval" / "sweeps" / "smoke.yaml", {"throughput": "sim:tpu"})
    cfg = {**sweep.DEFAULTS, "throughput": "sim:h100", "pretrained": None}
    with pytest.raises(ValueError, match="give `pretrained`"):
        sweep.measure_point(None, None, None, {}, cfg, None, tmp_path)

"""The looped-LM lab (issue 24): the k-hop task generator, its lm-eval tasks, and the shipped
checkpoint that needs its loops (checkpoints/lab-hops). CPU, seconds each."""
import json
import subprocess
import sys
from pathlib import Path

from train.tasks.hops import generate, make_record

ROOT = Path(__file__).resolve().parents[1]
CKPT = ROOT / "checkpoints" / "lab-hops"
HELDOUT_SEED = 7  # the held-out seed of the model card and eval/tasks/data/lab_hops.jsonl


def solve(prompt: str) -> str:
    """Resolve the prompt's chains by following the assignments (the task's ground truth)."""
    body, query = prompt[:-1].split("?")
    env = dict(s.split("=") for s in body.split(";") if s)
    out = []
    for name in query.split(","):
        v, hops = name, 0
        while not v.isdigit():
            v, hops = env[v], hops + 1
        out.append((name, v, hops))
    return ",".join(f"{n}={v}" for n, v, _ in out) + ".", [h for *_, h in out]


def test_generator_is_deterministic_and_correct(tmp_path):
    a, b = generate(11, 60), generate(11, 60)
    assert a == b and a != generate(12, 60)
    assert sorted({r["difficulty"] for r in a}) == [1, 2, 3, 4]
    for r in a:
        answer, hops = solve(r["prompt"])
        assert r["answer"] == answer and r["hops"] == hops and r["difficulty"] == max(hops)
        assert len(r["token_difficulty"]) == len(r["answer"])
        assert [d for d in r["token_difficulty"] if d] == hops  # values carry their hops, the rest is 0
        # easy tokens are copies or format: names from the query, '=', ',', '.'
        assert all(c in "=,." or c in r["prompt"].split("?")[1] for c, d in zip(r["answer"], r["token_difficulty"])
                   if d == 0)
    out = tmp_path / "x.jsonl"
    cmd = [sys.executable, "-m", "train.tasks.hops", "--seed", "11", "--n", "60", "--out", str(out)]
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True)
    assert [json.loads(ln) for ln in out.read_text().splitlines()] == a
    import numpy as np
    r = make_record(np.random.default_rng(0), 4)
    assert r["difficulty"] == 4 and 4 in r["hops"]


def test_shipped_task_data_is_the_heldout_split():
    rows = [json.loads(ln) for ln in (ROOT / "eval/tasks/data/lab_hops.jsonl").read_text().splitlines()]
    assert rows == generate(HELDOUT_SEED, len(rows))


def test_lm_eval_task_scores_exact_match():
    from lm_eval.filters.extraction import RegexFilter

    from eval import lm as looped
    d = looped.task_manager().load(["lab_hops", "lab_hops_4"])["tasks"]
    task = d["lab_hops"]
    docs = list(task.test_docs())
    assert len(docs) == 400 and {doc["difficulty"] for doc in d["lab_hops_4"].test_docs()} == {4}
    doc = docs[5]
    assert task.doc_to_text(doc) == doc["prompt"] and task.doc_to_target(doc) == doc["answer"]
    wrong = doc["answer"].replace(doc["answer"][2], str((int(doc["answer"][2]) + 1) % 10), 1)
    assert task.process_results(doc, [doc["answer"]])["exact_match"] == 1
    assert task.process_results(doc, [wrong])["exact_match"] == 0
    # the regex filter keeps the answer up to its '.', and a malformed generation scores 0
    pattern = task.config.filter_list[0]["filter"][0]["regex_pattern"]
    f = RegexFilter(regex_pattern=pattern)
    kept = [list(x) for x in f.apply([[doc["answer"] + "junk"], ["?" + doc["answer"]]], [doc, doc])]
    assert task.process_results(doc, [kept[0][0]])["exact_match"] == 1
    assert task.process_results(doc, [kept[1][0]])["exact_match"] == 0


def test_checkpoint_loads_and_decodes():
    """The shipped checkpoint loads through the engine with its tokenizer and learned gate."""
    from infer import LLM
    from eval.lab import run
    assert (CKPT / "model.safetensors").stat().st_size < 5e6
    cfg = json.loads((CKPT / "config.json").read_text())
    assert cfg["exit_criterion"] == "learned" and cfg["total_ut_steps"] >= 4
    recs = generate(HELDOUT_SEED, 8)
    llm = LLM(str(CKPT), policy="cdb", max_batch_size=8)
    assert llm.tokenizer.decode(llm.tokenizer.encode(recs[0]["prompt"])) == recs[0]["prompt"]
    r = run(llm, recs)
    assert 0 <= r["acc"] <= 1 and 1 <= r["mean_exit_depth"] <= llm.model.cfg.r_max


def test_checkpoint_needs_its_loops():
    """On 64 held-out items the shipped checkpoint at full depth beats its own depth-1 accuracy by
    >= 40 points, through the engine; the learned gate sends value tokens deeper than copies."""
    from infer import LLM
    from eval.lab import run
    assert (CKPT / "model.safetensors").stat().st_size < 5e6
    cfg = json.loads((CKPT / "config.json").read_text())
    assert cfg["exit_criterion"] == "learned" and cfg["total_ut_steps"] >= 4
    recs = generate(HELDOUT_SEED, 64)
    llm = LLM(str(CKPT), policy="cdb", max_batch_size=64)
    r_max = llm.model.cfg.r_max
    assert llm.tokenizer.decode(llm.tokenizer.encode(recs[0]["prompt"])) == recs[0]["prompt"]
    d1 = run(llm, recs, r_min=1, r_max=1)
    full = run(llm, recs, r_min=r_max, r_max=r_max)
    assert full["acc"] - d1["acc"] >= 0.40, (d1["acc"], full["acc"])
    gate = run(llm, recs)
    assert gate["hard_mean_depth"] >= 1.5 * gate["easy_mean_depth"], gate["mean_exit_depth_by_token_difficulty"]
    assert gate["acc"] >= full["acc"] - 0.05  # the default threshold keeps the accuracy


def test_lengths_trace_is_the_heldout_split_and_benches():
    """eval/tasks/data/lab_hops_lengths.csv (the lab sweep's bench workload) holds the held-out items'
    prompt and answer (+ EOS) token counts, and a CSV trace builds requests even with a tokenizer."""
    from infer.sim.workloads import load_trace, make_requests
    from looplm.io import load_tokenizer
    from train.lab import encode
    path = ROOT / "eval/tasks/data/lab_hops_lengths.csv"
    rows = load_trace(str(path))
    assert rows == tuple((len(encode(r["prompt"])), len(encode(r["answer"])) + 1) for r in generate(HELDOUT_SEED, 400))
    reqs = make_requests(str(path), 8, max_model_len=128, vocab_size=73, tokenizer=load_tokenizer(CKPT))
    assert len(reqs) == 8 and all(3 <= t < 73 for r in reqs for t in r.prompt_ids)


def test_rows_file_round_trips_and_is_what_the_engine_prefills(tmp_path):
    """`python -m train.lab rows` (shared_kv.py --rows): one record per row, its prompt the ids the
    engine prefills (the checkpoint's tokenizer, no BOS), then the answer's ids and EOS; written and
    read back unchanged, with the generator's seed in the file."""
    from looplm.io import load_tokenizer
    from train.lab import record_rows
    from train.shared_kv import Rows
    out = tmp_path / "rows.npz"
    cmd = [sys.executable, "-m", "train.lab", "rows", "--seed", "11", "--n", "24", "--out", str(out)]
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True)
    rows, want, recs = Rows.load(out), record_rows(generate(11, 24)), generate(11, 24)
    assert rows.meta["seed"] == 11 and rows.meta["n"] == 24 and len(rows) == 24
    assert (rows.ids == want.ids).all() and (rows.offsets == want.offsets).all() and (rows.prompt_len == want.prompt_len).all()
    tok = load_tokenizer(CKPT)
    for i, r in enumerate(recs):
        row, pl = rows.row(i).tolist(), int(rows.prompt_len[i])
        assert row[:pl] == tok.encode(r["prompt"]) and row[pl:] == tok.encode(r["answer"]) + [tok.eos_token_id]
        assert tok.decode(row[pl:-1]) == r["answer"]


SHAREDKV = ROOT / "checkpoints" / "lab-hops-sharedkv"


def test_sharedkv_checkpoint_serves_the_shared_layout():
    """checkpoints/lab-hops-sharedkv (lab-hops adapted with shared_kv.py --rows) loads with the shared
    layout from its config and, on 64 held-out items through the engine, keeps >= 90% exact match at
    its threshold under shared and under last_exited (the original scores 0% under shared)."""
    from infer import LLM
    from eval.lab import run
    assert (SHAREDKV / "model.safetensors").stat().st_size < 1e6
    recs = generate(HELDOUT_SEED, 64)
    llm = LLM(str(SHAREDKV), policy="cdb", max_batch_size=64)
    assert llm.engine.config.kv_layout == "shared"
    assert run(llm, recs)["acc"] >= 0.9
    assert run(LLM(str(SHAREDKV), policy="cdb", max_batch_size=64, kv_layout="last_exited"), recs)["acc"] >= 0.9

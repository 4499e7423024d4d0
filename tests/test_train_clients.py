"""train/ as accelerate / datasets users meet it (issue 15): the launch check, the parent-death
guard, FSDP vs DDP on 2 CPU ranks, --dataset, mixed precision and gradient checkpointing, the
output-folder contract and one-line errors. Tiny models, a few steps, CPU, no network."""
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from looplm import load_pretrained, save_pretrained, tiny_model
from looplm.io import load_tokenizer
from train.datasource import from_dataset

pytestmark = pytest.mark.slow  # every test here starts `accelerate launch` or `python train/...`

REPO = Path(__file__).resolve().parents[1]
DEMO_TOK = REPO / "checkpoints" / "ouro-demo"


def _env(tmp: Path, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_DIR", "LOOPLM_DEBUG", "ACCELERATE_"))}
    env.update(PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", WANDB_MODE="offline", HF_HUB_OFFLINE="1",
               HF_DATASETS_OFFLINE="1", HF_HOME=str(REPO / ".cache" / "hf"), LOOPLM_DATASETS_CACHE=str(tmp / "dscache"))
    env.update(extra)
    return env


def _port() -> str:
    return str(29000 + random.SystemRandom().randrange(2000))


def _launch(config: str, args: list[str]) -> list[str]:
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(REPO / "train/configs" / config),
            "--main_process_port", _port(), *args]


def _run(cmd, env, timeout=240):
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def _error_lines(r) -> list[str]:
    return [line for line in (r.stdout + r.stderr).splitlines() if line.startswith("error:")]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny Ouro-style folder (vocab 2048, the demo tokenizer) and random token ids."""
    d = tmp_path_factory.mktemp("clients")
    m = tiny_model("ouro-tiny", std=0.05, exit_criterion="learned", exit_threshold=0.6, vocab_size=2048)
    save_pretrained(m, d / "model", tokenizer=load_tokenizer(DEMO_TOK))
    np.save(d / "tok.npy", np.random.default_rng(0).integers(0, 2048, 20000).astype(np.uint16))
    return d


def _skv(tiny, out, steps=2, extra=()):
    return ["train/shared_kv.py", "--model", str(tiny / "model"), "--output", str(out), "--tokens", str(tiny / "tok.npy"),
            "--steps", str(steps), "--batch", "4", "--ctx", "32", "--save-every", "2", "--log-every", "1",
            "--eval-every", "0", "--eval-windows", "2", "--threads", "1", "--warmup", "1", "--lookahead", "--r-min", "2",
            "--save-dtype", "float32", *extra]  # float32 outputs: the tests compare trained weights to 1e-6


# ------------------------------------------------------------------------------------ launch
def test_cpu_num_processes_2_fails_loudly(tiny, tmp_path):
    """`accelerate launch --cpu --num_processes 2` starts ONE process: the script refuses it and
    names the command that starts two."""
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--cpu", "--num_processes", "2", "--num_machines", "1",
           "--mixed_precision", "no", "--dynamo_backend", "no", *_skv(tiny, out), "--no-wandb"]
    r = _run(cmd, _env(tmp_path))
    assert r.returncode != 0
    errs = _error_lines(r)
    assert len(errs) == 1, r.stderr[-3000:]
    assert "asked for 2 processes but 1 started" in errs[0] and "train/configs/cpu_2ranks.yaml" in errs[0]
    assert not out.exists(), "a failed start leaves no output folder"


def test_two_rank_missing_model_one_error_line(tmp_path):
    r = _run(_launch("cpu_2ranks.yaml", ["train/shared_kv.py", "--model", str(tmp_path / "nope"), "--output",
                                         str(tmp_path / "out")]), _env(tmp_path, ACCELERATE_USE_CPU="true"))
    assert r.returncode != 0
    errs = _error_lines(r)
    assert errs == [f"error: --model {tmp_path / 'nope'}: no such folder (hub ids need HF_HUB_OFFLINE unset)"], \
        r.stderr[-3000:]
    assert not (tmp_path / "out").exists()


def _descendants(pid: int) -> set[int]:
    kids: dict[int, list[int]] = {}
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                ppid = int((p / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            kids.setdefault(ppid, []).append(int(p.name))
    out, todo = set(), [pid]
    while todo:
        for c in kids.get(todo.pop(), []):
            if c not in out:
                out.add(c)
                todo.append(c)
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


@pytest.mark.skipif(not Path("/proc").exists(), reason="needs /proc (Linux)")
def test_launcher_sigkill_leaves_no_worker(tiny, tmp_path):
    """SIGKILL the launcher mid-training: within 10 s no worker (nor wandb's service) survives.
    wandb is on (offline), and its run lands under --output."""
    out = tmp_path / "out"
    log = open(tmp_path / "log.txt", "w")
    proc = subprocess.Popen(_launch("cpu_2ranks.yaml", _skv(tiny, out, steps=100000, extra=["--save-every", "100000"])),
                            cwd=REPO, env=_env(tmp_path, ACCELERATE_USE_CPU="true"), stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    kids: set[int] = set()
    try:
        deadline = time.time() + 120
        while time.time() < deadline:
            h = out / "history.json"
            if h.exists() and any(rec.get("step", 0) >= 2 for rec in json.loads(h.read_text() or "[]")):
                break
            assert proc.poll() is None, (tmp_path / "log.txt").read_text()[-3000:]
            time.sleep(0.5)
        else:
            pytest.fail("training did not start: " + (tmp_path / "log.txt").read_text()[-3000:])
        kids = _descendants(proc.pid)
        assert len(kids) >= 2, kids
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        time.sleep(10)
        survivors = [k for k in kids if _alive(k)]
        assert not survivors, [Path(f"/proc/{k}/cmdline").read_bytes()[:200] for k in survivors if _alive(k)]
        assert list((out / "wandb").glob("offline-run-*")), "wandb's run goes under --output"
    finally:
        for k in kids | {proc.pid}:
            if _alive(k):
                os.kill(k, signal.SIGKILL)
        log.close()


# -------------------------------------------------------------------------------------- FSDP
def test_fsdp_equals_ddp_on_two_cpu_ranks(tiny, tmp_path):
    """gpu_fsdp.yaml's CPU twin (FSDP2, one unit per block): the same final weights as DDP, half the
    parameter bytes per rank. In float64: FSDP2 reduce-scatters a looped block's gradient after each of
    its calls (DDP sums them first), and in float32 that other summation order, through Adam's first
    steps, moves weights by ~1e-5."""
    res = {}
    for name, cfg in (("ddp", "cpu_2ranks.yaml"), ("fsdp", "cpu_fsdp_2ranks.yaml")):
        extra = ["--no-wandb", "--dtype", "float64", "--save-dtype", "float64"]
        r = _run(_launch(cfg, _skv(tiny, tmp_path / name, steps=3, extra=extra)),
                 _env(tmp_path, ACCELERATE_USE_CPU="true"))
        assert r.returncode == 0, r.stderr[-3000:]
        res[name] = json.loads((tmp_path / name / "summary.json").read_text())
    assert res["fsdp"]["distributed_type"] == "FSDP" and res["ddp"]["distributed_type"] == "MULTI_CPU"
    full = res["ddp"]["model_param_bytes"]
    assert res["ddp"]["rank_param_bytes"] == [full, full]
    fb = res["fsdp"]["rank_param_bytes"]
    assert len(fb) == 2 and all(0.45 * full <= b <= 0.55 * full for b in fb), (fb, full)
    a, b = load_pretrained(tmp_path / "ddp", dtype="float64"), load_pretrained(tmp_path / "fsdp", dtype="float64")
    diff = max((p - q).abs().max().item() for p, q in zip(a.state_dict().values(), b.state_dict().values()))
    moved = max((p - q).abs().max().item() for p, q in zip(a.state_dict().values(),
                                                          load_pretrained(tiny / "model", dtype="float64").state_dict().values()))
    print(f"FSDP2 - DDP max |diff| {diff:.3e}, moved {moved:.3e}, rank bytes {fb} of {full}")
    assert diff <= 1e-6 and moved > 1e-3, (diff, moved)


def test_pretrain_two_cpu_ranks(tmp_path):
    tok = tmp_path / "tok.npy"
    np.save(tok, np.random.default_rng(0).integers(0, 64, 8000).astype(np.uint16))
    args = ["train/pretrain.py", "--arch", "huginn", "--run-dir", str(tmp_path / "run"), "--tokens", str(tok),
            "--vocab", "64", "--hidden", "32", "--heads", "2", "--ffn", "64", "--core", "1", "--prelude", "1", "--coda",
            "1", "--r-max", "3", "--ctx", "16", "--batch", "4", "--warmup", "2", "--eval-every", "3", "--log-every", "1",
            "--eval-windows", "2", "--gate-steps", "2", "--threads", "1", "--no-wandb", "--steps", "3"]
    r = _run(_launch("cpu_2ranks.yaml", args), _env(tmp_path, ACCELERATE_USE_CPU="true"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "world_size=2 backend=gloo" in r.stdout
    s = json.loads((tmp_path / "run" / "summary.json").read_text())
    fp = s["stage1_rank_fingerprints"]
    assert s["world_size"] == 2 and len(fp) == 2 and fp[0] == fp[1]


# ----------------------------------------------------------------------------------- dataset
def test_finetune_on_local_jsonl_dataset(tiny, tmp_path):
    """--dataset FILE.jsonl --text-column body: the run's batches are windows of that text,
    tokenised with the model's tokenizer and packed (the fingerprint is recomputed here)."""
    rng = random.Random(0)
    words = ["zebra", "quantum", "lattice", "orchid", "meridian", "cobalt", "falcon", "tundra"]
    docs = [" ".join(rng.choice(words) for _ in range(rng.randrange(20, 60))) + f" doc {i}." for i in range(80)]
    src = tmp_path / "my.jsonl"
    src.write_text("".join(json.dumps({"body": d, "id": i}) + "\n" for i, d in enumerate(docs)))
    out = tmp_path / "out"
    args = _skv(tiny, out, steps=2, extra=["--no-wandb"])
    i = args.index("--tokens")
    args[i:i + 2] = ["--dataset", str(src), "--text-column", "body"]
    r = _run([sys.executable, *args], _env(tmp_path))
    assert r.returncode == 0, r.stderr[-3000:]
    s = json.loads((out / "summary.json").read_text())
    tok = load_tokenizer(DEMO_TOK)
    data = from_dataset(str(src), "body", DEMO_TOK, 32, 0.1, cache_root=tmp_path / "check")  # the same, here
    assert s["data"]["train_sha256"] == data.meta["train_sha256"]
    # every document, EOS-ended, is in the windows whole: in pieces of one window (33 tokens) each
    pieces = Counter(tuple(ids[a:a + 33]) for d in docs
                     for ids in [tok(d, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]]
                     for a in range(0, len(ids), 33))
    got = Counter(tuple(r[dc == k].tolist()) for arr, darr in ((data.train, data.train_doc), (data.heldout, data.heldout_doc))
                  for r, dc in zip(arr, darr) for k in np.unique(dc))
    assert all(got[p] == n for p, n in pieces.items() if len(p) > 1)
    assert all(set(p) == {tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id}
               for p in got - pieces)  # the rest: padding
    assert s["data"]["source"] == str(src) and s["data"]["text_column"] == "body" and s["data"]["documents"] + \
        s["data"]["heldout_documents"] == 80
    rows = {tuple(x) for x in data.train.tolist()}
    assert len(s["first_batch_rank0"]) == 4 and all(tuple(b) in rows for b in s["first_batch_rank0"])
    assert Path(s["data"]["cache"]).parent == tmp_path / "dscache"


# ------------------------------------------------------------------ mixed precision, checkpointing
def test_gradient_checkpointing_same_weights_and_bf16_runs(tiny, tmp_path):
    outs = {}
    for name, extra in (("plain", []), ("gc", ["--gradient-checkpointing"]),
                        ("bf16", ["--gradient-checkpointing", "--mixed-precision", "bf16"])):
        r = _run([sys.executable, *_skv(tiny, tmp_path / name, extra=["--no-wandb", *extra])], _env(tmp_path))
        assert r.returncode == 0, r.stderr[-3000:]
        outs[name] = json.loads((tmp_path / name / "summary.json").read_text())
    assert outs["gc"]["gradient_checkpointing"] and not outs["plain"]["gradient_checkpointing"]
    a, b = load_pretrained(tmp_path / "plain"), load_pretrained(tmp_path / "gc")
    assert max((p - q).abs().max().item() for p, q in zip(a.state_dict().values(), b.state_dict().values())) <= 1e-6
    assert outs["bf16"]["mixed_precision"] == "bf16" and outs["bf16"]["autocast"] == "torch.bfloat16"
    assert outs["plain"]["autocast"] == "off"
    hist = json.loads((tmp_path / "bf16" / "history.json").read_text())
    assert all(np.isfinite(h["loss"]) for h in hist if "loss" in h)
    c = load_pretrained(tmp_path / "bf16")
    diff = max((p - q).abs().max().item() for p, q in zip(a.state_dict().values(), c.state_dict().values()))
    assert 0 < diff < 0.05, diff  # trained, close to the float32 run, not identical (bf16 autocast)


# --------------------------------------------------------------------- output folder, errors
def test_output_folder_contract_and_one_line_errors(tiny, tmp_path):
    env = _env(tmp_path)
    py = lambda *args, **kw: _run([sys.executable, *args], kw.pop("env", env))  # noqa: E731
    out = tmp_path / "out"
    base = _skv(tiny, out, steps=1, extra=["--no-wandb"])
    r = py(*base)
    assert r.returncode == 0, r.stderr[-3000:]
    r = py(*base)  # finished: says so, exits 0, trains nothing
    assert r.returncode == 0 and "already finished" in r.stdout and '"step": 1' not in r.stdout, r.stdout
    r = py(*base, "--lr", "0.1")  # the same folder, another config
    assert r.returncode != 0 and len(_error_lines(r)) == 1 and "Traceback" not in r.stderr
    assert "another model or config" in _error_lines(r)[0] and "new --output" in _error_lines(r)[0]

    cases = [
        (["train/shared_kv.py", "--model", str(tmp_path / "nope"), "--output", str(tmp_path / "o1")], "no such folder",
         tmp_path / "o1"),
        ([*_skv(tiny, tmp_path / "o2"), "--dataset", str(tmp_path / "missing.jsonl")], "no such file",
         tmp_path / "o2"),
        ([*_skv(tiny, tmp_path / "o3"), "--dataset", str(tmp_path / "d.jsonl"), "--text-column", "body"],
         "no column 'body'", tmp_path / "o3"),
        (["train/pretrain.py", "--arch", "ouro", "--run-dir", str(tmp_path / "o4"), "--corpus", str(tmp_path / "none"),
          "--tokenizer", str(tmp_path / "none")], "python -m train.corpus", tmp_path / "o4"),
    ]
    (tmp_path / "d.jsonl").write_text(json.dumps({"text": "hello world"}) + "\n")
    for args, needle, folder in cases:
        if "--dataset" in args:
            i = args.index("--tokens")
            del args[i:i + 2]
        r = py(*args)
        errs = _error_lines(r)
        assert r.returncode != 0 and len(errs) == 1 and needle in errs[0], (args, r.stderr[-2000:])
        assert "Traceback" not in r.stderr, r.stderr[-2000:]
        assert not folder.exists(), f"{folder} left behind"
    r = py(*cases[0][0], env=env | {"LOOPLM_DEBUG": "1"})  # the traceback on request
    assert r.returncode != 0 and "Traceback" in r.stderr and len(_error_lines(r)) == 1

"""train/shared_kv.py at scale (issue 58, deliverables 1, 5, 6): gradient accumulation (2 x batch 4 =
1 x batch 8 in float64), the mixed-precision choice (bf16 on CUDA), the output folder (bf16 shards
with an index that the engine loads; the input folder never written), FSDP v2 per block on 2 CPU
ranks, and the rehearsal at Ouro-1.4B's structure (24 layers, r_max 4) with a resume. Tiny models,
CPU; the accelerate launches are slow-marked."""
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from looplm import load_pretrained, save_pretrained, tiny_model
from looplm.io import load_tokenizer
from train import shared_kv
from train.cli import launcher_mixed_precision
from train.shared_kv import choose_mixed_precision, optimizer_step, parse, policy_for, shard_bytes

REPO = Path(__file__).resolve().parents[1]
DEMO_TOK = REPO / "checkpoints" / "ouro-demo"
SEED = 7


def _fresh_accelerator(n: int):
    """An Accelerator with `n` accumulation steps (accelerate's states are process-wide singletons)."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    return Accelerator(cpu=True, gradient_accumulation_steps=n, step_scheduler_with_optimizer=False)


def _reset_accelerate():
    from accelerate.state import AcceleratorState, GradientState
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


@pytest.mark.parametrize("arch", ["ouro-tiny", "huginn-tiny"])
def test_two_micro_batches_of_4_equal_one_batch_of_8(arch):
    """optimizer_step (the script's step) over 2 micro-batches of 4 rows under accelerate's
    accumulate = 1 batch of 8: the same parameters after one SGD step (float64; SGD so that the
    update is the gradient itself, not Adam's sign-like ratio)."""
    print("seed", SEED)
    ids = torch.randint(0, 256, (8, 17), generator=torch.Generator().manual_seed(SEED))
    a = parse(["--model", "x", "--output", "o", "--layout", "shared", "--r-min", "1"])
    after = {}
    try:
        for n, micros in ((1, [(ids, None, 1)]), (2, [(ids[:4], None, 1), (ids[4:], None, 1)])):
            m = tiny_model(arch, std=0.15, seed=3, exit_criterion="learned", exit_threshold=0.6, dtype=torch.float64)
            acc = _fresh_accelerator(n)
            obj = shared_kv.SharedKVObjective(m, a, policy_for(m.cfg, a))
            opt = torch.optim.SGD(obj.parameters(), lr=1.0)
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
            obj, opt, sched = acc.prepare(obj, opt, sched)
            outs = optimizer_step(acc, obj, opt, sched, micros, clip=1e9)
            assert len(outs) == n and all(np.isfinite(o["loss"]) for o in outs)
            after[n] = ({k: v.detach().clone() for k, v in m.state_dict().items()}, float(np.mean([o["loss"] for o in outs])))
    finally:
        _reset_accelerate()
    base = tiny_model(arch, std=0.15, seed=3, exit_criterion="learned", exit_threshold=0.6, dtype=torch.float64)
    moved = max((after[1][0][k] - v).abs().max().item() for k, v in base.state_dict().items())
    diff = max((after[1][0][k] - after[2][0][k]).abs().max().item() for k in after[1][0])
    print(f"{arch}: moved {moved:.3e}, 2x4 vs 1x8 max |diff| {diff:.3e}, loss {after[1][1]:.6f} / {after[2][1]:.6f}")
    assert moved > 1e-3 and diff < 1e-12
    assert abs(after[1][1] - after[2][1]) < 1e-12  # the reported loss: the mean over the micro-batches


def test_mixed_precision_choice():
    """--mixed-precision, else the launcher's, else bf16 on CUDA and no on CPU."""
    assert choose_mixed_precision(True, None, None) == "bf16"
    assert choose_mixed_precision(False, None, None) == "no"
    assert choose_mixed_precision(True, "no", None) == "no"
    assert choose_mixed_precision(True, None, "fp16") == "fp16"
    assert choose_mixed_precision(True, None, "no") == "no"  # a config's explicit 'no' is a choice
    assert choose_mixed_precision(False, "bf16", "no") == "bf16"
    launch = [sys.executable, "-m", "accelerate.commands.launch"]
    cfg = str(REPO / "train/configs/gpu_fsdp.yaml")
    assert launcher_mixed_precision([*launch, "--config_file", cfg, "train/shared_kv.py"]) == "bf16"
    assert launcher_mixed_precision([*launch, "--mixed_precision", "fp16", "train/shared_kv.py"]) == "fp16"
    assert launcher_mixed_precision([sys.executable, "train/shared_kv.py"]) in (None, os.environ.get("ACCELERATE_MIXED_PRECISION"))


def test_shard_size_spelling():
    assert shard_bytes("5GB") == 5 * 10 ** 9 and shard_bytes("500MB") == 5 * 10 ** 8 and shard_bytes("2KiB") == 2048
    assert shard_bytes("1234") == 1234
    with pytest.raises(Exception, match="--max-shard-size"):
        shard_bytes("lots")


# ------------------------------------------------------------------------------- in-process runs
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny Ouro-style folder with the demo tokenizer (vocab 2048) and random token ids."""
    d = tmp_path_factory.mktemp("scale")
    m = tiny_model("ouro-tiny", std=0.05, exit_criterion="learned", exit_threshold=0.6, vocab_size=2048)
    save_pretrained(m, d / "model", tokenizer=load_tokenizer(DEMO_TOK))
    np.save(d / "tok.npy", np.random.default_rng(SEED).integers(0, 2048, 20000).astype(np.uint16))
    return d


def _args(tiny, out, steps=2, extra=()):
    return ["--model", str(tiny / "model"), "--output", str(out), "--tokens", str(tiny / "tok.npy"), "--steps",
            str(steps), "--batch", "2", "--ctx", "16", "--save-every", "1", "--log-every", "1", "--eval-every", "0",
            "--eval-windows", "2", "--warmup", "1", "--no-wandb", "--staleness-every", "0", *extra]


def _main(argv):
    try:
        shared_kv.main(argv)
    finally:
        _reset_accelerate()


def test_grad_accum_run_output_loads_in_engine_with_shards(tiny, tmp_path):
    """An in-process run with --grad-accum 2: one history record per optimizer step; the output is
    bf16 safetensors, sharded with an index at a small --max-shard-size, with the layout in
    config.json and the tokenizer, and loads in the engine."""
    out = tmp_path / "out"
    _main(_args(tiny, out, extra=["--grad-accum", "2", "--max-shard-size", "100KB"]))
    hist = [h for h in json.loads((out / "history.json").read_text()) if "loss" in h]
    assert [h["step"] for h in hist] == [1, 2]
    idx = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(idx["weight_map"].values()))
    assert len(shards) >= 2 and not (out / "model.safetensors").exists()
    from safetensors import safe_open
    with safe_open(str(out / shards[0]), framework="pt") as f:
        assert all(f.get_tensor(k).dtype == torch.bfloat16 for k in f.keys())
    cfg = json.loads((out / "config.json").read_text())
    assert cfg.get("kv_layout", cfg.get("extra", {}).get("kv_layout")) == "shared"
    assert (out / "tokenizer.json").exists()
    m = load_pretrained(out)
    from infer.engine.llm import LLM, SamplingParams
    llm = LLM(str(out))
    assert llm.config.kv_layout == "shared" and m.cfg.vocab_size == 2048
    res = llm.generate([5, 6, 7], SamplingParams(max_tokens=3, temperature=0.0), use_tqdm=False)
    assert len(res[0].token_ids) == 3
    # the checkpoint's meta.json counts optimizer steps
    meta = json.loads(max((out / "checkpoints").glob("step_*")).joinpath("meta.json").read_text())
    assert meta["step"] == 2


def test_output_inside_model_is_refused(tiny):
    for out in (tiny / "model", tiny / "model" / "run"):
        with pytest.raises(Exception, match="the input folder is never written"):
            _main(_args(tiny, out))
    assert not (tiny / "model" / "run").exists() and not (tiny / "model" / "summary.json").exists()


# ------------------------------------------------------------------------------- the rehearsal
@pytest.mark.slow
def test_rehearsal_fsdp2_grad_accum_resume(tmp_path):
    """train/rehearsal.py at ctx 64 (the documented run is 4,096): Ouro-1.4B's structure (24 layers,
    r_max 4) at width 64 through `accelerate launch` on 2 CPU ranks, FSDP2 per block, --grad-accum 2,
    --gradient-checkpointing; killed after step 2 (--max-steps-this-run) and resumed to step 3; each
    rank holds about half the parameter bytes."""
    r = subprocess.run([sys.executable, "-m", "train.rehearsal", "--out", str(tmp_path), "--ctx", "64"], cwd=REPO,
                       env=dict(os.environ, PYTHONPATH=str(REPO)), capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:] + (tmp_path / "log.txt").read_text()[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    print(res)
    assert res["steps"] == [1, 2, 3] and all(np.isfinite(res["loss"])) and res["distributed_type"] == "FSDP"
    log = (tmp_path / "log.txt").read_text()
    assert "stopped at step 2 of 3" in log and "resumed from" in log and "at step 2" in log
    full, fb = res["model_param_bytes"], res["rank_param_bytes"]
    assert len(fb) == 2 and all(0.45 * full <= b <= 0.55 * full for b in fb), (fb, full)
    m = load_pretrained(tmp_path / "run")
    assert m.cfg.n_core == 24 and m.cfg.r_max == 4

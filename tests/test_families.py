"""The families beyond the paper's two (the retrofitted-recurrence Llama and OLMo-2 layouts, Nanbeige4.2),
served by the engine: token for token, depth for depth and log-prob for log-prob equal to the sequential
reference decoder in float64, for every policy x KV layout x lookahead, with each family's exit criteria
(the retrofits: a learned gate and Huginn's kl / latent_diff / entropy_diff; Nanbeige: a learned gate,
no lookahead at r_max 2). Batch sizes 1 / 3 / 8 rotate over the grid; seeds are printed in failures."""
import functools
from pathlib import Path

import pytest
import torch

from infer import LLM, EngineConfig, LLMEngine, SamplingParams
from infer.engine.reference import reference_generate
from looplm import ExitPolicy, ParamError, load_pretrained, save_pretrained, tiny_model
from looplm.config import replace
from looplm.io import build_model, read_config
from looplm.presets import PAPER_MODELS, paper_config

from helpers import MODES, random_requests, run_staggered, runs, stable_seed

# thresholds at which the tiny random models' exits spread over several depths (test_exits_vary)
CRITERIA = {
    "raven-llama-tiny": {"learned": 0.55, "kl": 0.5, "latent_diff": 0.85, "entropy_diff": 0.1},
    "raven-olmo-tiny": {"learned": 0.55, "latent_diff": 0.9},
    "nanbeige-tiny": {"learned": 0.55},
}
LAYOUTS = ["last_exited", "shared", "first_then_shared", "full_depth"]
BATCHES = (1, 3, 8)


def lookaheads(name):
    return (False,) if name == "nanbeige-tiny" else (False, True)


def cases():
    out = []
    for name, crits in CRITERIA.items():
        for crit in crits:
            # the learned gate over CB and the CDB modes; the output criteria over two CDB modes (CB runs at
            # full depth). K above any batch and K = "auto" are scheduling, the same for every family:
            # tests/test_engine.py runs them
            modes = ["cb", "norefill", "refill_k1", "refill_k4"] if crit == "learned" else ["norefill", "refill_k1"]
            grid = [(m, lay, la) for m in modes for lay in LAYOUTS for la in lookaheads(name) if runs(m, lay, la)]
            out += [(name, crit, m, lay, la, BATCHES[i % 3]) for i, (m, lay, la) in enumerate(grid)]
    return out


@functools.lru_cache(maxsize=None)
def model(name):
    return tiny_model(name, dtype=torch.float64, std=0.15, seed=3)


def policy(name, crit, lookahead, full):
    return ExitPolicy.from_config(model(name).cfg, criterion=crit, threshold=CRITERIA[name][crit],
                                  lookahead=lookahead, full_depth=full)


@functools.lru_cache(maxsize=None)
def reference(name, crit, layout, lookahead, full, seed):
    m = model(name)
    return [reference_generate(m, p, n, policy(name, crit, lookahead, full), kv_layout=layout)
            for p, n in random_requests(seed)]


@pytest.mark.parametrize("name,crit,mode,layout,lookahead,max_batch", cases())
def test_engine_equals_reference(name, crit, mode, layout, lookahead, max_batch):
    seed = stable_seed(name, crit, mode, layout, lookahead, max_batch)
    full = mode == "cb" or layout == "full_depth"
    want = reference(name, crit, layout, lookahead, full, seed % 3)
    eng = LLMEngine(model(name), EngineConfig(
        max_batch_size=max_batch, max_num_batched_tokens=16, kv_cache_tokens=512, kv_layout=layout,
        exit_criterion=crit, exit_threshold=CRITERIA[name][crit], lookahead=lookahead,
        pipeline=lookahead and mode != "cb" and max_batch != 3, async_scheduling=True, **MODES[mode]))
    seqs = run_staggered(eng, random_requests(seed % 3), seed, join=0.3)
    for i, (s, r) in enumerate(zip(seqs, want)):
        assert s.output_ids == r.token_ids and s.exit_depths == r.exit_depths, f"seed {seed}, request {i}"
        assert max(abs(a - b) for a, b in zip(s.logprobs, r.logprobs)) < 1e-10, f"seed {seed}, request {i}"
    assert eng.blocks.all_free


@pytest.mark.parametrize("name,crit", [(n, c) for n, cs in CRITERIA.items() for c in cs])
def test_exits_vary(name, crit):
    """The equality above means something only if exits spread over depths at these thresholds."""
    depths = {d for seed in range(3) for r in reference(name, crit, "last_exited", False, False, seed)
              for d in r.exit_depths[1:]}
    assert len(depths) >= 2, depths


def test_nanbeige_refuses_lookahead():
    """r_max 2: a lookahead signal read after step 1 exits after step 2 = r_max, never early."""
    with pytest.raises(ParamError, match="lookahead needs r_max >= 3"):
        LLM(model("nanbeige-tiny"), dtype="float64", lookahead=True)
    with pytest.raises(ParamError, match="lookahead needs r_max >= 3"):
        ExitPolicy.from_config(model("nanbeige-tiny").cfg, lookahead=True)
    assert LLM(model("nanbeige-tiny"), dtype="float64", lookahead=False).engine.config.lookahead is False


@pytest.mark.parametrize("name", list(CRITERIA))
def test_save_load_round_trip(tmp_path, name):
    """Our checkpoints are written in each family's real format and read back to the same model."""
    m = model(name)
    save_pretrained(m, tmp_path)
    back = load_pretrained(tmp_path, dtype="float64")
    assert back.cfg == m.cfg
    ids = torch.randint(0, 256, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(back(ids).logits, m(ids).logits)


REAL = {  # tensors whose shapes tell the family's real layout apart
    "ouro-2.6b": ("model.layers.47.self_attn.q_proj.weight", (2048, 2048)),
    "retro-llama-3.2-1b": ("transformer.core_block.5.attn.Wqkv.weight", ((32 + 2 * 8) * 64, 2048)),
    "retro-tinyllama-1.1b": ("transformer.core_block.7.attn.Wqkv.weight", ((32 + 2 * 4) * 64, 2048)),
    "retro-olmo2-1b": ("transformer.coda.3.attn.k_norm.weight", (16 * 128,)),
    "nanbeige4.2-3b": ("model.layers.21.self_attn.q_proj.weight", (48 * 128, 3072)),
}


@pytest.mark.parametrize("name", list(REAL))
def test_real_shapes_from_their_config(tmp_path, name):
    """Each family's real shape written as its config.json and read back: the same config, and the
    model it describes (built on the meta device) holds the real tensors."""
    cfg = paper_config(name)
    cfg.save(tmp_path / "config.json")
    back = read_config(tmp_path)
    assert back == cfg, (back, cfg)
    with torch.device("meta"):
        m = build_model(back)
    key, shape = REAL[name]
    assert tuple(m.state_dict()[key].shape) == shape
    assert "lm_head.weight" in m.state_dict() and not back.tie_embeddings


@pytest.mark.parametrize("name", list(REAL))
def test_dummy_load_folder(tmp_path, name):
    """`LLM(folder, load_format="dummy")` through each family's config.json (two layers of the real
    width here; the full shapes run in docs/results/families.md)."""
    cfg = replace(paper_config(name), vocab_size=512, **({"n_core": 2} if cfg_arch(name) == "ouro" else
                                                          {"n_prelude": 1, "n_core": 1, "n_coda": 1}))
    cfg.save(tmp_path / "config.json")
    llm = LLM(str(tmp_path), load_format="dummy", dtype="float32", kv_cache_tokens=64, max_batch_size=2)
    assert llm.engine.model.cfg.family == cfg.family
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3, ignore_eos=True))[0]
    assert len(out.token_ids) == 3


def cfg_arch(name):
    return PAPER_MODELS[name]["arch"]


FIX = Path(__file__).parent / "fixtures" / "parity"


@pytest.mark.parametrize("folder,teacher", [("retro_llama_b", "latent_diff"), ("nanbeige_b", "loss")])
def test_add_gate_to_a_gateless_release(tmp_path, folder, teacher):
    """train/distill_gate.py --add-gate gives a gateless checkpoint of a new family (made by its public
    reference code) a learned exit gate; the engine then serves it equal to the reference decoder."""
    import numpy as np
    from train.distill_gate import main
    rng = np.random.default_rng(0)
    np.save(tmp_path / "train.npy", rng.integers(1, 128, 3000).astype(np.int32))
    np.save(tmp_path / "held.npy", rng.integers(1, 128, 600).astype(np.int32))
    main(["--model", str(FIX / folder), "--output", str(tmp_path / "out"), "--add-gate", "--teacher", teacher,
          "--steps", "10", "--batch", "4", "--ctx", "32", "--warmup", "2", "--lr", "1e-2", "--log-every", "5",
          "--eval-windows", "8", "--tokens", str(tmp_path / "train.npy"), "--heldout-tokens", str(tmp_path / "held.npy"),
          "--no-wandb"])
    m = load_pretrained(tmp_path / "out", dtype="float64")
    assert m.cfg.family == load_pretrained(FIX / folder).cfg.family and m.cfg.exit_criterion == "learned"
    pol = ExitPolicy.from_config(m.cfg)
    reqs = [([int(t) for t in rng.integers(1, 128, n)], 6) for n in (3, 9, 5, 12)]
    want = [reference_generate(m, p, n, pol, kv_layout="last_exited") for p, n in reqs]
    eng = LLMEngine(m, EngineConfig(max_batch_size=3, kv_cache_tokens=256, policy="cdb", refill=True))
    got = run_staggered(eng, reqs, 7, join=0.5)
    for s, r in zip(got, want):
        assert s.output_ids == r.token_ids and s.exit_depths == r.exit_depths


@pytest.mark.parametrize("name,crit", [("raven-llama-tiny", "learned"), ("raven-llama-tiny", "latent_diff"),
                                       ("raven-olmo-tiny", "kl"), ("nanbeige-tiny", "learned")])
@pytest.mark.parametrize("layout", ["shared", "last_exited"])
def test_training_emulation_equals_reference_decoder(name, crit, layout):
    """train/shared_kv.py's parallel emulation of the engine's KV layouts reaches, at its fixed point,
    the sequential reference decoder's log-probs and exit depths (float64) for the new families too."""
    from train.kv_emulation import converge
    m = model(name)
    thr = CRITERIA[name].get(crit, 0.5)
    pol = ExitPolicy.from_config(m.cfg, criterion=crit, threshold=thr)
    prompt = [3, 14, 15, 92]
    forced = torch.randint(0, 256, (14,), generator=torch.Generator().manual_seed(1)).tolist()
    g = reference_generate(m, prompt, len(forced), pol, kv_layout=layout, forced_tokens=forced)
    sw, _, _ = converge(m, torch.tensor([prompt + forced[:-1]]), pol, layout, prompt_len=len(prompt), max_sweeps=40,
                        tol=0.0)
    lp = torch.log_softmax(sw.exit_logits[0, len(prompt) - 1:], -1).gather(-1, torch.tensor(forced)[:, None])[:, 0]
    assert (lp - torch.tensor(g.logprobs, dtype=torch.float64)).abs().max() < 1e-10
    assert sw.depths[0, len(prompt) - 1:].tolist() == g.exit_depths


def test_shared_kv_fine_tune_runs_on_a_retrofit(tmp_path):
    """train/shared_kv.py adapts a retrofitted checkpoint (made by the reference code) to the shared
    layout: a short run writes a folder of the same family that the engine serves."""
    import numpy as np
    from train.shared_kv import main
    np.save(tmp_path / "tok.npy", np.random.default_rng(0).integers(1, 128, 6000).astype(np.uint16))
    main(["--model", str(FIX / "retro_llama_b"), "--output", str(tmp_path / "out"), "--tokens", str(tmp_path / "tok.npy"),
          "--steps", "2", "--batch", "2", "--ctx", "16", "--log-every", "1", "--eval-every", "0", "--eval-windows", "2",
          "--threads", "1", "--warmup", "1", "--criterion", "latent_diff", "--threshold", "0.8",
          "--no-wandb"])
    m = load_pretrained(tmp_path / "out")
    assert m.cfg.family == "raven_llama" and m.cfg.kv_layout == "shared"
    out = LLM(m).generate([[5, 6, 7]], SamplingParams(max_tokens=3, ignore_eos=True))[0]
    assert len(out.token_ids) == 3

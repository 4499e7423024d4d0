"""The shared-KV training step's memory settings (issue 58, deliverable 1) change what is kept for
the backward pass, never the loss nor its gradient: per-layer checkpointing, the chunked CE, the
SDPA context attention, the context reduced to exit depths. Truncated backprop (`backprop_depth`)
changes the gradient only, by name. Tiny float64 models, fixed printed seeds, CPU, seconds each."""
import pytest
import torch
import torch.nn.functional as F

from looplm import ExitPolicy
from tests.helpers import fresh_model
from train.kv_emulation import context_attend, context_mask, sweep
from train.shared_kv import context_sweeps, head_ce, training_loss


def explicit_context_attend(q, k, v, kc, vc, prompt_len):
    """The attention before issue 58 (T x T scores, written out): the reference for the SDPA one."""
    B, T, H, Dh = q.shape
    rep = H // k.shape[2]
    heads = lambda x: x.transpose(1, 2).repeat_interleave(rep, dim=1)  # noqa: E731
    qh, kh, vh, kch, vch = q.transpose(1, 2), heads(k), heads(v), heads(kc), heads(vc)
    p, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    fresh = (j == p) | ((p < prompt_len) & (j <= p))
    scores = torch.where(fresh, qh @ kh.transpose(-1, -2), qh @ kch.transpose(-1, -2)) * Dh ** -0.5
    a = torch.softmax(scores.masked_fill(j > p, float("-inf")), dim=-1)
    return ((a * fresh) @ vh + (a * ~fresh) @ vch).transpose(1, 2)


@pytest.mark.parametrize("prompt_len", [0, 1, 5])
def test_sdpa_context_attention_equals_the_explicit_one(prompt_len):
    g = torch.Generator().manual_seed(prompt_len)
    print(f"seed {prompt_len}")
    q = torch.randn(2, 13, 4, 8, generator=g, dtype=torch.float64, requires_grad=True)
    kv = [torch.randn(2, 13, 2, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(4)]
    a, b = context_attend(q, *kv, prompt_len), explicit_context_attend(q, *kv, prompt_len)
    assert (a - b).abs().max() < 1e-12
    w = torch.randn(a.shape, generator=g, dtype=torch.float64)
    for x, y in zip(torch.autograd.grad((a * w).sum(), [q, *kv]), torch.autograd.grad((b * w).sum(), [q, *kv])):
        assert (x - y).abs().max() < 1e-12
    assert context_mask(13, prompt_len, "cpu").shape == (13, 26)


def setup(arch, T=12, B=2, seed=1):
    m = fresh_model(arch)
    pol = ExitPolicy.from_config(m.cfg, threshold=0.55)
    ids = torch.randint(0, 256, (B, T + 1), generator=torch.Generator().manual_seed(seed))
    print(f"{arch}: ids seed {seed}, B {B}, T {T}")
    return m, pol, ids


def loss_and_grads(m, ids, pol, layout="shared", **options):
    m.zero_grad(set_to_none=True)
    parts: dict = {}
    loss = training_loss(m, ids, pol, layout, 1, parts=parts, **options)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}, parts


@pytest.mark.parametrize("arch,layout", [("ouro-tiny", "shared"), ("huginn-tiny", "shared"),
                                         ("ouro-tiny", "last_exited"), ("huginn-tiny", "full_depth")])
def test_memory_settings_leave_loss_and_gradient_unchanged(arch, layout):
    """checkpoint per layer (and per step), CE in chunks of 5 positions: the same loss and the same
    gradient in every parameter as the plain step, to float64 rounding."""
    m, pol, ids = setup(arch)
    ref_loss, ref, ref_parts = loss_and_grads(m, ids, pol, layout, ce_chunk=0)
    for opts in ({"checkpoint": True, "ce_chunk": 5}, {"checkpoint": "step", "ce_chunk": 1024}):
        loss, got, parts = loss_and_grads(m, ids, pol, layout, **opts)
        assert torch.equal(parts["_depths"], ref_parts["_depths"])
        assert abs(float(loss - ref_loss)) < 1e-12, opts
        assert got.keys() == ref.keys()
        worst = max(float((got[n] - ref[n]).abs().max() / ref[n].abs().max().clamp(min=1e-30)) for n in ref)
        assert worst < 1e-10, (opts, worst)


def test_nothing_t_by_t_nor_all_logits_kept_for_backward():
    """With per-layer checkpointing and the chunked CE, no tensor the backward pass keeps outside the
    recomputed regions is T x T per head (only the one [T, 2T] bool mask is), and no kept tensor
    holds more than a chunk of full-vocabulary logits."""
    m, pol, ids = setup("ouro-tiny", T=48)
    T, V, chunk = 48, m.cfg.vocab_size, 8
    kept = []

    def pack(x):
        kept.append((tuple(x.shape), x.dtype))
        return x
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        loss = training_loss(m, ids, pol, "shared", 1, checkpoint=True, ce_chunk=chunk)
    loss.backward()
    big = [(s, d) for s, d in kept if len(s) >= 2 and s[-2] == T and s[-1] in (T, 2 * T) and d != torch.bool]
    assert not big, big
    logits = [s for s, d in kept if s and s[-1] == V and d != torch.bool and len(s) > 1]
    assert all(torch.Size(s).numel() <= ids.shape[0] * chunk * V for s in logits), logits
    print(f"{len(kept)} tensors kept outside checkpointed regions; largest numel",
          max(torch.Size(s).numel() for s, _ in kept))


def test_context_keeps_only_exit_depth_kv_under_shared():
    """The shared layout's context keeps one K/V per position (its exit depth's), and the loss sweep
    against it equals the one against the full per-step K/V."""
    m, pol, ids = setup("huginn-tiny")
    x = ids[:, :-1]
    with torch.no_grad():
        ctx = context_sweeps(m, x, pol, "shared", 1, pass1_sweeps=2)
        assert ctx.kv_at_depth and ctx.core_kv[0][0].shape[0] == 1 and ctx.states == []
        first = sweep(m, x, pol, "shared", None, 1)
        full = sweep(m, x, pol, "shared", sweep(m, x, pol, "shared", first, 1), 1)  # the same 2 context sweeps
        reduced = sweep(m, x, pol, "shared", ctx, 1)
    assert torch.equal(full.depths, reduced.depths)
    assert (full.exit_logits - reduced.exit_logits).abs().max() < 1e-12


def test_head_ce_in_chunks_equals_whole():
    g = torch.Generator().manual_seed(0)
    m = fresh_model("ouro-tiny")
    h = torch.randn(2, 11, m.cfg.hidden_size, generator=g, dtype=torch.float64, requires_grad=True)
    t = torch.randint(0, m.cfg.vocab_size, (2, 11), generator=g)
    whole = F.cross_entropy(m.head(h).flatten(0, 1), t.flatten(), reduction="none").view(2, 11)
    for chunk in (0, 1, 4, 11, 64):
        got = head_ce(m, h, t, chunk)
        assert (got - whole).abs().max() < 1e-12
        assert (torch.autograd.grad(got.sum(), h)[0] - torch.autograd.grad(whole.sum(), h, retain_graph=True)[0]).abs().max() < 1e-12


@pytest.mark.parametrize("arch", ["ouro-tiny", "huginn-tiny"])
def test_backprop_depth_truncates_the_gradient_only(arch):
    """backprop_depth K: the same loss (truncation changes no value); K >= r_max is the full gradient;
    K = 1 is the gradient with the first r_max - 1 loop steps' states held constant in every sweep:
    it differs, and the parameters that only reach the loss through those steps get no gradient
    from them (Ouro's embedding: its only path is through step 1)."""
    m, pol, ids = setup(arch)
    S = m.cfg.r_max
    ref_loss, ref, _ = loss_and_grads(m, ids, pol)
    loss, full, _ = loss_and_grads(m, ids, pol, backprop_depth=S)
    assert abs(float(loss - ref_loss)) < 1e-12
    assert all(torch.allclose(full[n], ref[n], rtol=1e-10, atol=1e-14) for n in ref)
    loss1, cut, _ = loss_and_grads(m, ids, pol, backprop_depth=1)
    assert abs(float(loss1 - ref_loss)) < 1e-12
    assert any(not torch.allclose(cut.get(n, torch.zeros_like(ref[n])), ref[n]) for n in ref)
    if arch == "ouro-tiny":
        emb = "model.embed_tokens.weight"
        assert emb not in cut or float(cut[emb].abs().max()) == 0.0
    with pytest.raises(ValueError, match="backprop_depth"):
        training_loss(m, ids, pol, backprop_depth=0)


def test_lora_run_trains_adapters_only_and_saves_a_merged_model(tmp_path):
    """--lora-rank 4: the LM weights outside the adapted projections are saved unchanged (frozen), the
    projections changed (adapters merged in), the saved folder has no adapter tensors and loads; the
    step's trainable parameters are the adapters and the gate head only."""
    import numpy as np

    from looplm import load_pretrained, save_pretrained, tiny_model
    from looplm.io import load_tokenizer
    from tests.test_train_scale import DEMO_TOK, _args, _main
    from train.lora import add_lora
    print("seed 0")
    m = tiny_model("ouro-tiny", std=0.05, exit_criterion="learned", exit_threshold=0.6, vocab_size=2048)
    save_pretrained(m, tmp_path / "model", tokenizer=load_tokenizer(DEMO_TOK))
    np.save(tmp_path / "tok.npy", np.random.default_rng(0).integers(0, 2048, 5000).astype(np.uint16))
    out = tmp_path / "out"
    _main(_args(tmp_path, out, steps=3, extra=["--lora-rank", "4", "--lr", "1e-2", "--save-dtype", "float32"]))
    before, after = load_pretrained(tmp_path / "model").state_dict(), load_pretrained(out).state_dict()
    assert before.keys() == after.keys()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all(k.endswith("proj.weight") or "exit_gate" in k for k in changed), sorted(changed)
    assert "model.embed_tokens.weight" not in changed and "lm_head.weight" not in changed
    names = add_lora(tiny_model("ouro-tiny"), 4)
    assert names and all(".lora_A." in n or ".lora_B." in n for n in names)


def test_log_reports_tokens_per_s_and_flops_per_token(tmp_path):
    """Every training record has tokens/s (training steps only) and the FLOPs per trained token
    counted by torch's FlopCounterMode on the launch's first step: more than the forward alone of
    the core layers (2 FLOPs per weight, r_max steps, 3 sweeps)."""
    import json

    import numpy as np

    from looplm import save_pretrained, tiny_model
    from looplm.io import load_tokenizer
    from tests.test_train_scale import DEMO_TOK, _args, _main
    print("seed 0")
    m = tiny_model("ouro-tiny", std=0.05, exit_criterion="learned", exit_threshold=0.6, vocab_size=2048)
    save_pretrained(m, tmp_path / "model", tokenizer=load_tokenizer(DEMO_TOK))
    np.save(tmp_path / "tok.npy", np.random.default_rng(0).integers(0, 2048, 5000).astype(np.uint16))
    _main(_args(tmp_path, tmp_path / "out", steps=2))
    recs = [h for h in json.loads((tmp_path / "out" / "history.json").read_text()) if "loss" in h]
    assert all(r["tokens_per_s"] > 0 for r in recs)
    core = sum(p.numel() for n, p in m.named_parameters() if ".layers." in n)
    # 3 sweeps (2 context + the loss sweep) x r_max steps x 2 FLOPs per weight, forward only
    assert recs[0]["flops_per_token"] > 3 * m.cfg.r_max * 2 * core
    print("flops/token", recs[0]["flops_per_token"], "core params", core)


def test_flop_count_equals_torch_flop_counter():
    """train.flops.FlopCount (what the training log uses) counts what FlopCounterMode counts."""
    from torch.utils.flop_counter import FlopCounterMode

    from train.flops import FlopCount
    m, pol, ids = setup("huginn-tiny")
    with FlopCounterMode(display=False) as ref:
        training_loss(m, ids, pol, checkpoint=True).backward()
    with FlopCount() as got:
        training_loss(m, ids, pol, checkpoint=True).backward()
    assert got.flops == ref.get_total_flops() > 0

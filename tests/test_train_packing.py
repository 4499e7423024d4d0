"""Document-aware packing (issue 59): documents packed into one window are the same computation as
the documents run one by one: positions restart, no attention crosses a boundary, and in the shared-KV
emulation every layout's context and prompt stay inside the document. A packed batch's loss is the
documents' losses weighted by their counted targets, and so is its gradient. Tiny float64 models,
fixed printed seeds, CPU, seconds each."""
import pytest
import torch

from looplm import ExitPolicy
from tests.helpers import fresh_model
from train.common import per_step_outputs
from train.kv_emulation import LAYOUTS, converge
from train.packing import doc_positions, prompt_from_targets
from train.shared_kv import training_loss

TOL = 1e-10


def test_positions_restart_and_prompts_end_where_the_reply_starts():
    docs = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2], [0, 0, 0, 0, 0, 1, 1, 1]])
    assert doc_positions(docs).tolist() == [[0, 1, 2, 0, 1, 0, 1, 2], [0, 1, 2, 3, 4, 0, 1, 2]]
    targets = torch.tensor([[0, 1, 1, 0, 0, 0, 0, 1], [0, 0, 0, 1, 1, 0, 0, 0]], dtype=torch.bool)
    # doc 0: its first counted prediction at 1 -> prompt 0..1; doc 1: none -> all prompt; doc 2: 0..2
    assert prompt_from_targets(targets, docs).int().tolist() == [[1, 1, 0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 1, 1, 1]]
    assert prompt_from_targets(None, docs, 2).int().tolist() == [[1, 1, 0, 1, 1, 1, 1, 0], [1, 1, 0, 0, 0, 1, 1, 0]]


def packed(lengths, seed):
    g = torch.Generator().manual_seed(seed)
    print(f"ids seed {seed}, documents of {lengths} tokens")
    pieces = [torch.randint(1, 256, (n,), generator=g) for n in lengths]
    docs = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])
    return pieces, torch.cat(pieces)[None], docs[None]


@pytest.mark.parametrize("arch", ["ouro-tiny", "huginn-tiny"])
def test_packed_forward_equals_the_documents_one_by_one(arch):
    m = fresh_model(arch)
    pieces, ids, docs = packed([6, 4, 7], seed=5)
    out = per_step_outputs(m, ids[:, :-1], ids[:, 1:], m.cfg.r_max, docs=docs[:, :-1])
    start = 0
    for piece in pieces:
        n = len(piece)
        one = per_step_outputs(m, piece[None, :-1], piece[None, 1:], m.cfg.r_max)
        for k in one:  # every prediction inside the document (the last one predicts the next document)
            assert (out[k][:, :, start:start + n - 1] - one[k]).abs().max() < TOL, k
        start += n
    plain = per_step_outputs(m, ids[:, :-1], ids[:, 1:], m.cfg.r_max)  # without docs the later ones differ
    assert (plain["ce"][:, :, 6:] - out["ce"][:, :, 6:]).abs().max() > 1e-6


@pytest.mark.parametrize("arch", ["ouro-tiny", "huginn-tiny"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_packed_sweeps_equal_the_documents_one_by_one(arch, layout):
    m = fresh_model(arch)
    pol = ExitPolicy.from_config(m.cfg, threshold=0.55)
    pieces, ids, docs = packed([7, 5, 6], seed=7)
    prompts = [3, 1, 2]
    prompt = torch.cat([torch.arange(len(p)) < n for p, n in zip(pieces, prompts)])[None]
    fp, _, _ = converge(m, ids, pol, layout, prompt_len=prompt, max_sweeps=ids.shape[1] + 2, tol=0.0, docs=docs)
    start = 0
    for piece, n in zip(pieces, prompts):
        one, _, _ = converge(m, piece[None], pol, layout, prompt_len=n, max_sweeps=len(piece) + 2, tol=0.0)
        sl = slice(start, start + len(piece))
        assert torch.equal(fp.depths[:, sl], one.depths)
        assert (fp.exit_logits[:, sl] - one.exit_logits).abs().max() < TOL
        start += len(piece)
    assert fp.depths.min() < m.cfg.r_max  # some exit early: the layouts' contexts differ from full depth


def grads(m, fn):
    m.zero_grad(set_to_none=True)
    parts: dict = {}
    loss = fn(parts)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}, parts


@pytest.mark.parametrize("arch,layout", [("ouro-tiny", "shared"), ("huginn-tiny", "shared"), ("huginn-tiny", "last_exited")])
def test_packed_loss_and_gradient_are_the_documents_weighted_by_their_targets(arch, layout):
    """Chat-like documents (a prompt, then counted reply tokens): the packed window's loss (its prompts
    found from the targets) equals the documents' losses, each computed alone with its own prompt
    length, weighted by their counted targets; the gradient likewise (train "lm": the gate's BCE has
    its own denominator, checked below)."""
    m = fresh_model(arch)
    pol = ExitPolicy.from_config(m.cfg, threshold=0.55)
    pieces, ids, docs = packed([8, 6, 7], seed=11)
    prompts = [3, 2, 4]  # tokens of each document's prompt: its targets start at token `prompt`
    masks = [torch.arange(len(p)) >= n for p, n in zip(pieces, prompts)]
    mask = torch.cat(masks)[None]
    opts = dict(pass1_sweeps=2, train="lm")
    prompt = prompt_from_targets(mask[:, 1:], docs[:, :-1])
    loss, g, parts = grads(m, lambda parts: training_loss(m, ids, pol, layout, prompt, docs=docs, mask=mask,
                                                          parts=parts, **opts))
    total, acc, n_all = 0.0, {}, 0
    for piece, n, mk in zip(pieces, prompts, masks):
        li, gi, _ = grads(m, lambda parts: training_loss(m, piece[None], pol, layout, n, mask=mk[None], parts=parts, **opts))
        w = int(mk[1:].sum())
        total, n_all = total + w * li, n_all + w
        for k, v in gi.items():
            acc[k] = acc.get(k, 0) + w * v
    assert abs(loss - total / n_all) < TOL
    assert g.keys() == acc.keys()
    for k in g:
        assert (g[k] - acc[k] / n_all).abs().max() < 1e-9, k
    # the gate's BCE and the mean depth are means over the decode targets (not the prompt's last position)
    full = training_loss(m, ids, pol, layout, prompt, docs=docs, mask=mask, parts=parts, pass1_sweeps=2)
    assert torch.isfinite(full) and parts["mean_depth"] >= 1


def test_a_trailing_user_turn_changes_nothing_under_assistant_only_loss():
    """Tokens after a document's last counted target (a user turn no reply follows) are context for
    nothing: changing them leaves the loss and every gradient unchanged (targets are causal)."""
    m = fresh_model("huginn-tiny")
    pol = ExitPolicy.from_config(m.cfg, threshold=0.55)
    pieces, ids, docs = packed([9, 7], seed=13)
    mask = torch.zeros_like(ids, dtype=torch.bool)
    mask[0, 3:6] = True  # doc 0: prompt 0..2, reply 3..5, then a user turn 6..8
    mask[0, 11:14] = True  # doc 1: reply 11..13, then a user turn 14..15
    prompt = prompt_from_targets(mask[:, 1:], docs[:, :-1])
    fn = lambda x: lambda parts: training_loss(m, x, pol, "shared", prompt, docs=docs, mask=mask, parts=parts)  # noqa: E731
    a, ga, _ = grads(m, fn(ids))
    other = ids.clone()
    other[0, 6:9] = (other[0, 6:9] + 17) % 250 + 1
    other[0, 14:16] = (other[0, 14:16] + 31) % 250 + 1
    b, gb, _ = grads(m, fn(other))
    assert torch.equal(a, b) and all(torch.equal(ga[k], gb[k]) for k in ga)
    counted = mask.clone()
    counted[0, 6:9] = True  # counted, the same change moves the loss
    c, _, _ = grads(m, lambda parts: training_loss(m, ids, pol, "shared", prompt, docs=docs, mask=counted, parts=parts))
    d, _, _ = grads(m, lambda parts: training_loss(m, other, pol, "shared", prompt, docs=docs, mask=counted, parts=parts))
    assert abs(c - d) > 1e-6


@pytest.mark.parametrize("arch", ["ouro", "huginn"])
def test_pretrain_loss_on_packed_documents_is_the_documents_weighted(arch):
    """train/pretrain.py's LM loss on a packed window (documents kept apart, a loss mask) equals the
    documents' losses alone, weighted by their counted targets; the gradient likewise. (Sampled
    depth pinned to r_max: both sides run the same loop count.)"""
    from train.pretrain import lm_loss, parse
    m = fresh_model(f"{arch}-tiny")
    r = m.cfg.r_max
    a = parse(["--arch", arch, "--run-dir", "unused", "--r-max", str(r), "--step-weights", *(["1"] * r),
               "--mean-depth", str(r), "--depth-sigma", "0.001", "--min-depth", str(r), "--bptt", str(r)])
    pieces, ids, docs = packed([7, 5, 8], seed=17)
    masks = [torch.arange(len(p)) >= 2 for p in pieces]  # each document's first two tokens do not count
    mask = torch.cat(masks)[None]
    loss, g, _ = grads(m, lambda parts: lm_loss(m, ids, a, 0, mask, docs)[0])
    total, acc, n_all = 0.0, {}, 0
    for piece, mk in zip(pieces, masks):
        li, gi, _ = grads(m, lambda parts: lm_loss(m, piece[None], a, 0, mk[None])[0])
        w = int(mk[1:].sum())
        total, n_all = total + w * li, n_all + w
        for k, v in gi.items():
            acc[k] = acc.get(k, 0) + w * v
    # (token_ce computes in float32, whatever the model's dtype: float32 agreement, not float64's)
    assert abs(loss - total / n_all) < 1e-5
    for k in g:
        assert torch.allclose(g[k], acc[k] / n_all, rtol=1e-4, atol=1e-6), k

"""qkv.cache: its values are the pass's own (records, hidden states), and its gradients are
the metric's gradients computed another way (edits with a gradient, a run resumed from a leaf,
the rest of the model written out by hand), in float64."""

from __future__ import annotations

import pytest
import torch

import qkv
from intervention_models import assert_refused_and_unchanged, encoder_like, llama_like
from qkv.inspect.cache import KINDS
from qkv.nn.edit import Edit, Swap
from variant_models import TEXT, gemma2_like, tiny

METRIC = "diff: bank, river"
BANK, RIVER = 2, 4  # their ids in variant_models.WORDS


@pytest.fixture(scope="module")
def model():
    pretrained = llama_like()
    pretrained.model.double()
    return pretrained


@pytest.fixture(scope="module")
def found(model):
    return qkv.cache(model, TEXT, grad=METRIC)


def metric_of(logits):  # (…, vocab) -> (…): "diff: bank, river" at the last position
    logprobs = logits[..., -1, :].log_softmax(-1)
    return logprobs[..., BANK] - logprobs[..., RIVER]


def ids_of(model, text=TEXT):
    return torch.tensor([model.encode(text).ids])


def test_values_are_the_records_and_hidden_states(model, found):
    stack = model.model
    with torch.no_grad():
        out = stack(ids_of(model), layers="all", hidden_states=True)
    assert torch.equal(found["embed"], out.hidden_states[0])
    assert torch.equal(found["logits"], out.logits) and torch.equal(found["final"], out.hidden)
    for n, record in out.records.items():
        assert torch.equal(found[f"L{n}.q"], record.q)
        for kind in ("k", "v", "q_before_rotary", "k_before_rotary", "attn_out", "mlp_out"):
            assert torch.equal(found[kind, n], getattr(record, kind))
        assert torch.equal(found[f"L{n}.z"], record.out)
        assert torch.equal(found[f"L{n}.weights"], record.weights())
        torch.testing.assert_close(found[f"L{n}.scores"].softmax(-1), record.weights())
        assert torch.equal(found["resid_pre", n], out.hidden_states[n])
        assert torch.equal(found["resid_post", n], out.hidden_states[n + 1])
        block = stack.blocks[n]
        torch.testing.assert_close(found["resid_mid", n] + found["mlp_out", n],
                                   found["resid_post", n])  # fmt: skip
        torch.testing.assert_close(found["mlp_in", n], block.mlp_norm(found["resid_mid", n]))
        torch.testing.assert_close(found["attn_in", n], block.attn_norm(out.hidden_states[n]))
        # the heads' writes (hook_result) sum to attn_out, the output projection has no bias
        torch.testing.assert_close(found.result(n).sum(1), found["attn_out", n])
    assert found.names == ["embed", *[f"L{n}.{k}" for n in range(2) for k in KINDS], "final",
                           "logits"]  # fmt: skip
    assert float(found.score[0]) == pytest.approx(float(metric_of(out.logits)[0]))


def test_gradients_equal_edits_with_a_gradient(model, found):
    """z, mlp_out, q, k, v and the weights: each swapped (or added to) by a leaf through an
    Edit, the metric's gradient by the leaf is the cache's."""
    stack = model.model
    ids = ids_of(model)
    for n in range(2):
        z_tap = torch.zeros_like(found["z", n], requires_grad=True)
        mlp_tap = torch.zeros_like(found["mlp_out", n], requires_grad=True)
        leaves = {k: found[k, n].clone().requires_grad_(True) for k in ("q", "weights")}
        # k and v swapped by query head (B, H, T, D): their gradients sum over the group
        for kind in ("k", "v"):
            leaves[kind] = found[kind, n].repeat_interleave(2, 1).clone().requires_grad_(True)
        every = torch.ones((), dtype=torch.bool)
        edit = Edit(head_add=z_tap, mlp_add=mlp_tap, q=Swap(every, leaves["q"]),
                    k=Swap(every, leaves["k"]), v=Swap(every, leaves["v"]))  # fmt: skip
        logits = stack(ids, edits={n: edit}).logits
        grads = torch.autograd.grad(metric_of(logits).sum(), [z_tap, mlp_tap, leaves["q"],
                                    leaves["k"], leaves["v"]])  # fmt: skip
        torch.testing.assert_close(grads[0], found.grad("z", n))
        torch.testing.assert_close(grads[1], found.grad("mlp_out", n))
        torch.testing.assert_close(grads[2], found.grad("q", n))
        torch.testing.assert_close(grads[3].sum(1, keepdim=True), found.grad("k", n))
        torch.testing.assert_close(grads[4].sum(1, keepdim=True), found.grad("v", n))
        weights = Edit(weights=Swap(every, leaves["weights"]))
        logits = stack(ids, edits={n: weights}).logits
        (g,) = torch.autograd.grad(metric_of(logits).sum(), leaves["weights"])
        torch.testing.assert_close(g, found.grad("weights", n))
        scores = found["scores", n].clone().requires_grad_(True)
        logits = stack(ids, edits={n: Edit(weights=Swap(every, scores.softmax(-1)))}).logits
        (g,) = torch.autograd.grad(metric_of(logits).sum(), scores)
        torch.testing.assert_close(g, found.grad("scores", n))


@pytest.fixture(scope="module", params=["llama", "gemma2"])
def either(request, model, found):
    """The Llama-like model, and a Gemma 2-like one (norms on each sub-layer's output, a
    window, soft-caps on the scores and the logits)."""
    if request.param == "llama":
        return model, found
    pretrained = tiny(gemma2_like())
    pretrained.model.double()
    return pretrained, qkv.cache(pretrained, TEXT, grad=METRIC)


def test_stream_gradients_equal_the_rest_of_the_model_written_out(either):
    """resid_pre (a run resumed from a leaf), resid_mid, mlp_in and attn_in (the block's
    sub-layers by hand from a leaf, then the run resumed), final and logits."""
    model, found = either
    stack = model.model
    ids = ids_of(model)

    def mlp(block, u):  # what the MLP adds to the stream, from its input u (normalized)
        out = block.mlp(u)
        return out if block.mlp_out_norm is None else block.mlp_out_norm(out)

    def attention(block, a):  # what attention adds, from its input a (normalized)
        out, _ = block.attn(a, causal=True)
        return out if block.attn_out_norm is None else block.attn_out_norm(out)

    def rest(n, after):  # the metric from block n's output on
        if n + 1 == 2:
            return metric_of(stack.project(stack.norm(after)))
        return metric_of(stack(ids, resume=(n + 1, after)).logits)

    for n in range(2):
        block = stack.blocks[n]
        leaf = found["resid_pre", n].clone().requires_grad_(True)
        (g,) = torch.autograd.grad(metric_of(stack(ids, resume=(n, leaf)).logits).sum(), leaf)
        torch.testing.assert_close(g, found.grad("resid_pre", n))
        mid = found["resid_mid", n].clone().requires_grad_(True)
        (g,) = torch.autograd.grad(rest(n, mid + mlp(block, block.mlp_norm(mid))).sum(), mid)
        torch.testing.assert_close(g, found.grad("resid_mid", n))
        mlp_in = found["mlp_in", n].clone().requires_grad_(True)
        (g,) = torch.autograd.grad(rest(n, found["resid_mid", n] + mlp(block, mlp_in)).sum(),
                                   mlp_in)  # fmt: skip
        torch.testing.assert_close(g, found.grad("mlp_in", n))
        attn_in = found["attn_in", n].clone().requires_grad_(True)
        mid = found["resid_pre", n] + attention(block, attn_in)
        (g,) = torch.autograd.grad(rest(n, mid + mlp(block, block.mlp_norm(mid))).sum(), attn_in)
        torch.testing.assert_close(g, found.grad("attn_in", n))
    final = found["final"].clone().requires_grad_(True)
    (g,) = torch.autograd.grad(metric_of(stack.project(final)).sum(), final)
    torch.testing.assert_close(g, found.grad("final"))
    logits = found["logits"].clone().requires_grad_(True)
    (g,) = torch.autograd.grad(metric_of(logits).sum(), logits)
    torch.testing.assert_close(g, found.grad("logits"))


def test_a_gradient_equals_finite_differences(model, found):
    stack = model.model
    ids = ids_of(model)
    direction = torch.randn_like(found["embed"])
    eps = 1e-5

    def at(x):
        with torch.no_grad():
            return float(metric_of(stack(ids, resume=(0, x)).logits)[0])

    slope = (at(found["embed"] + eps * direction) - at(found["embed"] - eps * direction)) / (
        2 * eps
    )
    assert slope == pytest.approx(float((found.grad("embed") * direction).sum()), rel=1e-6)


def test_a_batch_is_each_text_alone_and_the_model_is_left_as_it_was():
    model = llama_like()
    short = "the river was deep"
    before = {k: v.clone() for k, v in model.model.state_dict().items()}
    both = qkv.cache(model, [TEXT, short], grad=METRIC, names=["z", "weights", "embed"])
    assert all(p.grad is None for p in model.model.parameters())
    assert all(torch.equal(v, before[k]) for k, v in model.model.state_dict().items())
    for row, text in enumerate([TEXT, short]):
        alone = qkv.cache(model, text, grad=METRIC, names=["z", "weights", "embed"])
        T = alone["embed"].shape[1]
        for name in alone.names:
            real = (slice(row, row + 1), ..., slice(0, T), slice(None))
            if name.endswith("weights"):
                real = (slice(row, row + 1), slice(None), slice(0, T), slice(0, T))
            torch.testing.assert_close(both[name][real], alone[name], atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(both.grad(name)[real], alone.grad(name), atol=1e-5,
                                       rtol=1e-4)  # fmt: skip
    assert both.names == ["embed", "L0.weights", "L0.z", "L1.weights", "L1.z"]
    only = qkv.cache(model, TEXT, names=["q"], layers=[1])
    assert only.names == ["L1.q"] and not only.grads


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda p: qkv.cache(p, TEXT, names=["nope"]), "no activation is named 'nope'"),
        (lambda p: qkv.cache(p, TEXT, names=["L7.q"]), "layer 7 is out of range"),
        (lambda p: qkv.cache(p, TEXT, layers=[2]), "layer 2 is out of range"),
        (lambda p: qkv.cache(p, TEXT, grad="kl"), "'kl' compares two runs"),
        (lambda p: qkv.cache(p, TEXT, grad="diff: bank, river bank"), "not one token"),
        (lambda p: qkv.cache(p, TEXT).grad("L0.q"), "made without a metric"),
    ],
)
def test_bad_input_is_refused_by_name_and_the_model_left_as_it_was(call, message):
    assert_refused_and_unchanged(call, message)


def test_unknown_names_and_encoders_are_refused(found):
    with pytest.raises(KeyError, match="no activation named 'L0.nope'"):
        found["L0.nope"]
    with pytest.raises(ValueError, match="is an encoder"):
        qkv.cache(encoder_like(), TEXT)

"""The score variants of 2026's families (a sliding window, a soft-cap, a score bias), on every
backend against `loop`, the article itself, computed a pair at a time; and a backend that
cannot compute one is refused by name, never run without it."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qkv.attention import attend, attention_weights, explain_choice, steps
from qkv.attention.inputs import window_mask
from qkv.nn import MultiHeadAttention


@st.composite
def variant_inputs(draw):
    B, Hkv = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    H = Hkv * draw(st.integers(1, 2))
    Tq, Tk, D = draw(st.integers(1, 9)), draw(st.integers(1, 12)), draw(st.sampled_from([2, 8]))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    q = torch.randn(B, H, Tq, D, generator=gen) * 3  # large scores: the cap must bite
    k = torch.randn(B, Hkv, Tk, D, generator=gen) * 3
    v = torch.randn(B, Hkv, Tk, D, generator=gen)
    bias_shape = draw(st.sampled_from([None, (1, H, Tq, Tk), (B, 1, 1, Tk), (Tq, Tk)]))
    bias = None if bias_shape is None else torch.randn(bias_shape, generator=gen)
    mask = None
    if draw(st.booleans()):
        mask = torch.rand(B, 1, 1, Tk, generator=gen) > 0.3
    window = draw(st.sampled_from([None, 1, 2, 5]))
    softcap = draw(st.sampled_from([None, 1.5, 30.0]))
    return q, k, v, mask, draw(st.booleans()), window, softcap, bias


@settings(max_examples=60, deadline=None)
@given(variant_inputs())
def test_every_backend_that_takes_a_variant_equals_the_loop(inputs):
    q, k, v, mask, causal, window, softcap, bias = inputs
    kw = dict(mask=mask, causal=causal, window=window, softcap=softcap, bias=bias)
    want = attend(q, k, v, backend="loop", **kw)
    for backend in ("eager", "sdpa", "auto"):
        if backend == "sdpa" and softcap is not None:
            continue  # refused, below
        got = attend(q, k, v, backend=backend, **kw)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    weights = attention_weights(q, k, **kw)
    torch.testing.assert_close(weights @ v.repeat_interleave(q.shape[1] // k.shape[1], 1), want,
                               atol=1e-5, rtol=0)  # fmt: skip


def test_the_window_hides_keys_that_far_back_and_the_loop_says_which():
    q = k = v = torch.randn(1, 1, 6, 4)
    weights = attention_weights(q, k, causal=True, window=3)[0, 0]
    assert weights[5, :3].eq(0).all() and weights[5, 3:].gt(0).all()  # keys 5-2..5 seen
    assert torch.allclose(weights.sum(-1), torch.ones(6))
    pairs = steps(q, k, v, causal=True, window=3)[5].pairs
    assert [p.allowed for p in pairs] == [False, False, False, True, True, True]
    # an encoder's window looks both ways
    both = window_mask(5, 5, 2, causal=False)
    assert both.int().tolist()[2] == [0, 1, 1, 1, 0]


def test_the_cap_and_the_bias_are_what_the_softmax_reads_in_the_loop():
    q, k, v = torch.randn(1, 1, 2, 4) * 5, torch.randn(1, 1, 3, 4) * 5, torch.randn(1, 1, 3, 4)
    bias = torch.randn(1, 1, 2, 3)
    pair = steps(q, k, v, softcap=2.0, bias=bias)[1].pairs[2]
    scaled = (q[0, 0, 1] @ k[0, 0, 2]).double() / 2.0  # 1/sqrt(4)
    assert math.isclose(pair.scaled_scalar.item(), scaled.item(), rel_tol=1e-6)
    assert math.isclose(pair.score.item(), 2.0 * math.tanh(scaled.item() / 2.0) + bias[0, 0, 1, 2],
                        rel_tol=1e-6)  # fmt: skip
    assert abs(pair.score.item() - bias[0, 0, 1, 2].item()) <= 2.0  # capped to (-2, 2)


def test_a_backend_that_cannot_compute_a_variant_is_refused_by_name_and_auto_passes_it_over():
    q = k = v = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match="backend 'sdpa' cannot run these inputs: it does not "
                       "compute a score softcap"):  # fmt: skip
        attend(q, k, v, softcap=30.0, backend="sdpa")
    with pytest.raises(ValueError, match="'flash' cannot run these inputs: it does not compute "
                       "a score bias or a score softcap"):  # fmt: skip
        attend(q, k, v, softcap=30.0, bias=torch.zeros(4, 4), backend="flash")
    choice = explain_choice(q, k, v, softcap=30.0)
    assert choice.backend == "eager"
    assert "does not compute a score softcap" in choice.passed_over["sdpa"]
    assert explain_choice(q, k, v, bias=torch.zeros(4, 4)).backend == "sdpa"


@pytest.mark.parametrize(
    "bad, says",
    [
        (dict(window=0), "window must be a whole number of tokens >= 1"),
        (dict(window=2.5), "window must be a whole number"),
        (dict(softcap=-1.0), "softcap must be a positive finite number"),
        (dict(softcap=float("inf")), "softcap must be a positive finite number"),
        (dict(bias=torch.zeros(3, 3)), r"bias of shape \(3, 3\) does not broadcast"),
        (dict(bias=torch.zeros(4, 4, dtype=torch.long)), "bias must be a float tensor"),
    ],
)
def test_a_wrong_variant_is_a_clear_error(bad, says):
    q = k = v = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match=says):
        attend(q, k, v, **bad)


@pytest.mark.parametrize("qk_norm", [None, "head", "full"])
def test_a_layer_with_every_variant_keeps_a_record_that_recomputes_its_output(qk_norm):
    """The record holds the window, cap and bias: its weights and the article's steps give
    back exactly what the layer's backend computed."""
    torch.manual_seed(0)
    mha = MultiHeadAttention(16, 4, num_kv_heads=2, softcap=3.0, window=3, scale=0.7,
                             qk_norm=qk_norm)  # fmt: skip
    if qk_norm is not None:
        with torch.no_grad():
            mha.q_norm.weight.uniform_(0.5, 1.5)
    bias = torch.randn(1, 4, 6, 6)
    _, record = mha(torch.randn(2, 6, 16), causal=True, bias=bias, record=True)
    assert (record.window, record.softcap, record.scale) == (3, 3.0, 0.7)
    weights = record.weights()
    assert weights[:, :, 5, :3].eq(0).all()  # three keys back and more: hidden
    values = record.v.repeat_interleave(2, dim=1)
    torch.testing.assert_close(weights @ values, record.out, atol=1e-6, rtol=0)
    for head, query in [(0, 5), (3, 2)]:
        torch.testing.assert_close(
            record.steps(head, query, batch=1).contextualized.float(),
            record.out[1, head, query], atol=1e-6, rtol=0,
        )  # fmt: skip


@pytest.mark.parametrize("causal", [True, False])
def test_flash_takes_a_window_as_the_mask_it_is_and_equals_the_loop(causal):
    """The kernel (in Triton's interpreter here) gets the window folded into its mask; a
    layer on flash keeps the window in its record, so the lse-made weights hide those keys."""
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 9, 16, generator=gen) for _ in range(3))
    want = attend(q, k, v, causal=causal, window=3, backend="loop")
    got = attend(q, k, v, causal=causal, window=3, backend="flash")
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    mha = MultiHeadAttention(32, 2, window=3, backend="flash")
    _, record = mha(torch.randn(1, 9, 32, generator=gen), causal=causal, record=True)
    assert record.lse is not None and record.window == 3
    weights = record.weights()
    assert weights[0, :, 8, :6].eq(0).all()
    torch.testing.assert_close(weights @ record.v, record.out, atol=1e-5, rtol=0)

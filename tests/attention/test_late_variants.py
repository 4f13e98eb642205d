"""The attention of late-2026 families as `attend`'s inputs: learned sinks (gpt-oss), a
temperature per query (Llama 4, Ministral 3), chunks (Llama 4) and values of another size than
the keys (DeepSeek's latent attention), alone and with a score bias. Every backend that takes
one equals `loop`, the article computed a pair at a time; one that cannot is refused by name."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qkv.attention import attend, attention_weights, steps
from qkv.attention.inputs import chunk_mask
from qkv.nn import MultiHeadAttention
from qkv.nn.position import Temperature


@st.composite
def late_inputs(draw):
    B, Hkv = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    H = Hkv * draw(st.integers(1, 2))
    Tq, Tk = draw(st.integers(1, 8)), draw(st.integers(1, 11))
    D, Dv = draw(st.sampled_from([2, 8])), draw(st.sampled_from([None, 3, 8]))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    q = torch.randn(B, H, Tq, D, generator=gen) * 2
    k = torch.randn(B, Hkv, Tk, D, generator=gen) * 2
    v = torch.randn(B, Hkv, Tk, Dv or D, generator=gen)
    sinks = torch.randn(H, generator=gen) * 2 if draw(st.booleans()) else None
    query_scale = None
    if draw(st.booleans()):
        query_scale = torch.rand(draw(st.sampled_from([(B, Tq), (Tq,)])), generator=gen) + 0.5
    chunk = draw(st.sampled_from([None, 1, 3]))
    start = None
    if chunk is not None and draw(st.booleans()):
        start = torch.randint(0, Tk, (B,), generator=gen)
    mask = torch.rand(B, 1, 1, Tk, generator=gen) > 0.3 if draw(st.booleans()) else None
    bias_shape = draw(st.sampled_from([None, (Tq, Tk), (B, 1, Tq, Tk)]))
    bias = None if bias_shape is None else torch.randn(bias_shape, generator=gen)
    options = dict(mask=mask, causal=draw(st.booleans()), sinks=sinks, query_scale=query_scale,
                   chunk=chunk, chunk_start=start, bias=bias)  # fmt: skip
    return q, k, v, options


@settings(max_examples=60, deadline=None)
@given(late_inputs())
def test_every_backend_equals_the_loop_with_sinks_temperatures_chunks_and_other_value_sizes(
    inputs,
):
    q, k, v, options = inputs
    want = attend(q, k, v, backend="loop", **options)
    assert want.shape == (*q.shape[:3], v.shape[-1])
    for backend in ("eager", "sdpa", "auto"):
        torch.testing.assert_close(attend(q, k, v, backend=backend, **options), want, atol=1e-5,
                                   rtol=0)  # fmt: skip
    weights = attention_weights(q, k, **options)
    grouped = v.repeat_interleave(q.shape[1] // k.shape[1], 1)
    torch.testing.assert_close(weights @ grouped, want, atol=1e-5, rtol=0)


def test_a_sink_takes_its_share_and_the_words_share_the_rest():
    q = k = v = torch.randn(1, 2, 4, 8)
    sinks = torch.tensor([2.0, -30.0])
    weights = attention_weights(q, k, causal=True, sinks=sinks)[0]  # (H, Tq, Tk)
    scores = (q[0] @ k[0].mT) / math.sqrt(8)
    hidden = torch.ones(4, 4, dtype=torch.bool).triu(1)
    exps = scores.masked_fill(hidden, float("-inf")).exp()
    sink_share = sinks.exp()[:, None] / (exps.sum(-1) + sinks.exp()[:, None])  # (H, Tq)
    torch.testing.assert_close(1 - weights.sum(-1), sink_share, atol=1e-6, rtol=0)
    assert bool((weights.sum(-1)[0] < 0.99).all())  # head 0's sink takes a visible share
    torch.testing.assert_close(weights.sum(-1)[1], torch.ones(4))  # head 1's takes nothing
    found = steps(q, k, v, causal=True, sinks=sinks)
    first = found[3]  # batch 0, head 0, query 3
    assert first.sink_weight is not None
    assert math.isclose(float(first.sink_weight) + float(first.weights.sum()), 1.0, rel_tol=1e-9)
    assert math.isclose(float(first.sink_weight), float(sink_share[0, 3]), rel_tol=1e-5)


def test_a_query_that_sees_no_key_gives_all_its_weight_to_the_sink_and_gets_zeros():
    q = k = v = torch.randn(1, 1, 3, 4)
    mask = torch.tensor([False, False, False])[None, None, None]
    sinks = torch.tensor([0.5])
    for backend in ("loop", "eager", "sdpa"):
        out = attend(q, k, v, mask=mask, sinks=sinks, backend=backend)
        assert out.eq(0).all() and not out.isnan().any(), backend
    assert attention_weights(q, k, mask=mask, sinks=sinks).eq(0).all()


def test_chunks_hide_the_keys_of_other_chunks_counted_from_each_rows_first_key():
    assert chunk_mask(5, 5, 2)[0, 0].int().tolist() == [
        [1, 1, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [0, 0, 1, 1, 0],
        [0, 0, 1, 1, 0],
        [0, 0, 0, 0, 1],
    ]
    q = k = v = torch.randn(2, 1, 6, 4)
    start = torch.tensor([0, 2])  # row 1 is left-padded by two keys
    padding = (torch.arange(6)[None] >= start[:, None])[:, None, None]  # (B, 1, 1, Tk)
    weights = attention_weights(q, k, causal=True, chunk=3, chunk_start=start, mask=padding)
    assert weights[0, 0, 3, :3].eq(0).all() and weights[0, 0, 3, 3] > 0  # a new chunk at 3
    assert weights[1, 0, 5, :5].eq(0).all() and weights[1, 0, 5, 5] == 1  # at 2 + 3 = 5
    alone = attention_weights(q[1:, :, 2:], k[1:, :, 2:], causal=True, chunk=3)
    torch.testing.assert_close(weights[1:, :, 2:, 2:], alone)
    pairs = steps(q, k, v, causal=True, chunk=3)[5].pairs  # query 5 of row 0
    assert [p.allowed for p in pairs] == [False, False, False, True, True, True]


def test_a_temperature_multiplies_each_querys_scores_and_the_loop_names_it():
    q = k = v = torch.randn(1, 1, 3, 4)
    temperature = torch.tensor([1.0, 1.0, 2.0])
    pair = steps(q, k, v, query_scale=temperature)[2].pairs[0]
    assert math.isclose(float(pair.score), 2 * float(pair.scaled_scalar), rel_tol=1e-12)
    hot = attention_weights(q, k, query_scale=temperature)[0, 0, 2]
    plain = attention_weights(q * 2, k)[0, 0, 2]
    torch.testing.assert_close(hot, plain)


def test_flash_refuses_what_its_kernel_cannot_compute_by_name():
    q = k = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match="'flash' cannot run these inputs: it does not compute "
                       "a learned sink"):  # fmt: skip
        attend(q, k, k, sinks=torch.zeros(2), backend="flash")
    with pytest.raises(ValueError, match="'flash' cannot run these inputs: it does not compute "
                       "a temperature per query"):  # fmt: skip
        attend(q, k, k, query_scale=torch.ones(4), backend="flash")
    with pytest.raises(ValueError, match=r"values of the keys' head size \(here D=8, Dv=3\)"):
        attend(q, k, torch.randn(1, 2, 4, 3), backend="flash")
    with pytest.raises(ValueError, match="'sdpa' cannot run these inputs: it does not compute a "
                       "score softcap"):  # fmt: skip
        attend(q, k, k, sinks=torch.zeros(2), softcap=5.0, backend="sdpa")


@pytest.mark.parametrize(
    "options, says",
    [
        (dict(sinks=torch.zeros(3)), r"sinks of shape \(3,\) does not broadcast to \(2,\)"),
        (dict(sinks=torch.zeros(2, dtype=torch.long)), "sinks must be a float tensor"),
        (dict(sinks=torch.tensor([0.0, float("nan")])), "sinks holds a value that is not finite"),
        (dict(query_scale=torch.zeros(4)), "query_scale must be > 0"),
        (dict(query_scale=torch.ones(5)), r"does not broadcast to \(1, 4\)"),
        (dict(chunk=0), "chunk must be a whole number of tokens >= 1"),
        (dict(chunk_start=torch.zeros(1, dtype=torch.long)), "pass chunk too"),
        (dict(chunk=2, chunk_start=torch.zeros(2, dtype=torch.long)), r"must be \(1,\)"),
    ],
)
def test_a_wrong_late_variant_is_a_clear_error(options, says):
    q = k = v = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match=says):
        attend(q, k, v, **options)


@torch.no_grad()
def test_a_layer_with_sinks_chunks_and_a_temperature_keeps_a_record_that_recomputes_it():
    torch.manual_seed(0)
    mha = MultiHeadAttention(16, 4, num_kv_heads=2, sinks=True, chunk=3, qk_norm="l2",
                             temperature=Temperature(0.5, 2.0, 1.0), backend="sdpa")  # fmt: skip
    with torch.no_grad():
        mha.sinks.copy_(torch.randn(4))
    x = torch.randn(2, 7, 16)
    padding = torch.ones(2, 7, dtype=torch.bool)
    padding[1, :2] = False
    positions = (padding.long().cumsum(-1) - 1).clamp(min=0)  # each row counts from its start
    out, record = mha(x, causal=True, key_padding_mask=padding, positions=positions, record=True)
    assert record.chunk == 3 and record.chunk_start.tolist() == [0, 2]
    weights = record.weights()
    grouped = record.v.repeat_interleave(2, 1)
    torch.testing.assert_close(weights @ grouped, record.out, atol=1e-5, rtol=0)
    share = record.sink_weights()
    torch.testing.assert_close(share + weights.sum(-1), torch.ones_like(share), atol=1e-6, rtol=0)
    step = record.steps(head=3, query=6, batch=1)
    torch.testing.assert_close(step.contextualized.float(), record.out[1, 3, 6], atol=1e-5,
                               rtol=0)  # fmt: skip
    assert math.isclose(float(step.sink_weight), float(share[1, 3, 6]), abs_tol=1e-6)
    # a left-padded row equals the row alone: its chunks and temperatures count from its start
    alone, _ = mha(x[1:, 2:], causal=True)
    torch.testing.assert_close(out[1, 2:], alone[0], atol=1e-5, rtol=0)

"""AttentionRecord: what a layer's backend received and returned, and the weights and steps
read from it, checked against the eager backend and the article's loop on fresh inputs."""

from __future__ import annotations

import math

import pytest
import torch

from qkv.attention import attend_for_record, causal_mask, loop
from qkv.attention import eager as eager_backend
from qkv.nn import KVCache, MultiHeadAttention, RotaryEmbedding

BACKENDS = ["loop", "eager", "sdpa", "flash"]  # flash runs in Triton's interpreter on a CPU


def layer(backend: str, dtype=torch.float32, seed: int = 0) -> MultiHeadAttention:
    torch.manual_seed(seed)
    mha = MultiHeadAttention(48, 6, num_kv_heads=2, rotary=RotaryEmbedding(8), backend=backend)
    return mha.to(dtype)


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_record_is_what_the_backend_received_and_its_weights_are_eagers(backend):
    mha = layer(backend)
    x = torch.randn(2, 7, 48)
    real = torch.ones(2, 7, dtype=torch.bool)
    real[1, 5:] = False  # padding: the second text is 5 tokens long
    seen = []

    def spy(q, k, v, **kwargs):  # what the one door is given, to compare with the record
        seen.append((q, k, v, kwargs))
        return attend_for_record(q, k, v, **kwargs)

    torch.manual_seed(1)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("qkv.nn.attention.attend_for_record", spy)
        _, record = mha(x, key_padding_mask=real, causal=True, record=True)
    ((q, k, v, kwargs),) = seen  # every backend, flash too, through the registry's one door
    assert record.q is q and record.k is k and record.v is v
    assert record.mask is kwargs["mask"] and record.scale == kwargs["scale"] == 1 / math.sqrt(8)
    assert (record.lse is not None) == (backend == "flash")
    # the record's weights are the eager backend's on the same q, k, v, mask and scale
    want_out, want = eager_backend.attend(
        record.q, record.k, record.v, mask=real[:, None, None, :], causal=True,
        return_weights=True,
    )  # fmt: skip
    tolerance = 1e-6 if backend != "loop" else 1e-7
    torch.testing.assert_close(record.weights(), want, rtol=0, atol=tolerance)
    torch.testing.assert_close(record.weights([5, 0]), want[:, [5, 0]], rtol=0, atol=tolerance)
    torch.testing.assert_close(record.out, want_out, rtol=0, atol=2e-6)
    assert not record.weights()[1, :, :, 5:].any(), "padding is hidden from every query"
    assert (record.allowed == (real[:, None, None, :] & causal_mask(7, 7))).all()
    # rotary: the record keeps q and k before the turn, and the turn is the layer's own
    torch.testing.assert_close(mha.rotary(record.q_before_rotary, torch.arange(7)), record.q)


@pytest.mark.parametrize("backend", BACKENDS)
def test_steps_are_the_loop_backend_on_the_record(backend):
    mha = layer(backend, seed=2)
    x = torch.randn(1, 6, 48)
    mask = torch.rand(6, 6) > 0.3  # any mask: a query may even see no key
    mask[4] = False
    _, record = mha(x, mask=mask, causal=True, record=True)
    every = loop.steps(record.q, record.k, record.v, mask=mask, causal=True, scale=record.scale)
    weights = record.weights()
    for head in (0, 3, 5):
        for query in range(6):
            got = record.steps(head, query)
            want = every[head * 6 + query]
            assert (got.head, got.query_index) == (head, query)
            torch.testing.assert_close(got.contextualized, want.contextualized, rtol=0, atol=0)
            allowed = [p.allowed for p in got.pairs]
            assert allowed == (mask[query] & causal_mask(6, 6)[query]).tolist()
            torch.testing.assert_close(got.weights.float(), weights[0, head, query], atol=1e-6,
                                       rtol=0)  # fmt: skip
    assert not record.steps(1, 4).weights.any(), "a query that sees no key gets zeros"


@pytest.mark.parametrize("backend", ["eager", "sdpa", "flash"])
def test_a_cached_steps_record_has_the_causal_offset_of_decoding(backend):
    mha = layer(backend, seed=3)
    x = torch.randn(1, 9, 48)
    _, full = mha(x, causal=True, record=True)
    cache = KVCache()
    mha(x[:, :8], causal=True, cache=cache)
    _, last = mha(x[:, 8:], causal=True, cache=cache, record=True)
    assert last.shape.Tq == 1 and last.shape.Tk == 9
    assert last.allowed.all(), "the newest token sees every cached token and itself"
    torch.testing.assert_close(last.weights(), full.weights()[:, :, 8:], rtol=0, atol=1e-5)
    assert last.k_before_rotary.shape[2] == 1, "before rotary: this call's new key only"


def test_cross_attention_records_the_contexts_keys():
    torch.manual_seed(4)
    mha = MultiHeadAttention(16, 4).double()
    x, context = torch.randn(2, 3, 16).double(), torch.randn(2, 5, 16).double()
    real = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]], dtype=torch.bool)
    _, record = mha(x, context, key_padding_mask=real, record=True)
    assert record.shape.Tq == 3 and record.shape.Tk == 5 and not record.causal
    assert record.q_before_rotary is None
    weights = record.weights()
    assert not weights[1, :, :, 2:].any()
    torch.testing.assert_close(weights.sum(-1), torch.ones(2, 4, 3).double())


def test_bad_heads_and_queries_name_the_range():
    _, record = layer("eager")(torch.randn(1, 4, 48), record=True)
    with pytest.raises(ValueError, match=r"head 6 is out of range: this layer has 6 heads \(0-5\)"):
        record.weights([0, 6])
    with pytest.raises(ValueError, match=r"query 4 is out of range: this record has 4 queries"):
        record.steps(0, 4)
    for bad in ("03", [0.5]):  # a string is not a list of heads, nor is a fraction a head
        with pytest.raises(ValueError, match=r"heads are whole numbers counted from 0 \(0-5\)"):
            record.weights(bad)
    assert layer("eager")(torch.randn(1, 4, 48))[1] is None, "no record unless asked"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_weights_made_with_the_output_are_eagers_and_the_output_is_unchanged(dtype):
    mha = layer("auto", dtype, seed=5)
    x = torch.randn(1, 9, 48, dtype=dtype)
    made = torch.full((6, 9, 9), float("nan"), dtype=dtype)  # every weight must be written
    with torch.no_grad():  # a pass that keeps gradients does not make them (below)
        out, record = mha(x, causal=True, record=True, weights_into=made)
        plain, plain_record = mha(x, causal=True, record=True)
    assert record.made is made and plain_record.made is None
    want = eager_backend.attention_weights(record.q, record.k, causal=True, scale=record.scale)
    tolerance = 1e-12 if dtype == torch.float64 else 1e-6
    torch.testing.assert_close(made, want[0], atol=tolerance, rtol=0)
    torch.testing.assert_close(record.weights([4, 1]), want[:, [4, 1]], atol=tolerance, rtol=0)
    torch.testing.assert_close(out, plain, atol=tolerance, rtol=0)
    assert torch.equal(record.q, plain_record.q) and torch.equal(record.k, plain_record.k)


CANNOT = ["two texts", "padding", "not causal", "flash", "window", "soft-cap", "other shape",
          "gradient"]  # fmt: skip


@pytest.mark.parametrize("case", CANNOT)
def test_a_call_the_weights_cannot_be_made_in_records_as_before(case):
    mha = layer("flash" if case == "flash" else "eager", seed=6)
    if case in ("window", "soft-cap"):
        mha.window, mha.softcap = (3, None) if case == "window" else (None, 5.0)
    x = torch.randn(2 if case == "two texts" else 1, 6, 48)
    made = torch.full((6, 5 if case == "other shape" else 6, 6), float("nan"))
    padding = torch.tensor([[True] * 5 + [False]]) if case == "padding" else None
    with torch.enable_grad() if case == "gradient" else torch.no_grad():
        out, record = mha(
            x, causal=case != "not causal", key_padding_mask=padding, record=True, weights_into=made
        )
    assert record.made is None and made.isnan().all(), "left alone"
    want, _ = mha(x, causal=case != "not causal", key_padding_mask=padding)
    torch.testing.assert_close(out, want, atol=1e-6, rtol=0)


def test_weights_into_is_for_a_record_and_is_refused_without_one():
    made = torch.empty(6, 4, 4)
    with pytest.raises(ValueError, match="weights_into makes the weights a record keeps"):
        layer("eager")(torch.randn(1, 4, 48), causal=True, weights_into=made)

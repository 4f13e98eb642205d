"""MultiHeadAttention against torch.nn.MultiheadAttention with the same weights."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from qkv.attention import causal_mask
from qkv.attention import eager as eager_backend
from qkv.nn import KVCache, MultiHeadAttention, RotaryEmbedding

BACKENDS = ["loop", "eager", "sdpa", "auto"]


def copy_from_torch(ours: MultiHeadAttention, theirs: nn.MultiheadAttention) -> None:
    """torch keeps [query; key; value] matrices in one in_proj; qkv may keep them apart."""
    with torch.no_grad():
        if hasattr(ours, "qkv"):
            ours.qkv.weight.copy_(theirs.in_proj_weight)
            ours.qkv.bias.copy_(theirs.in_proj_bias)
        else:
            for part, w, b in zip(
                (ours.q, ours.k, ours.v),
                theirs.in_proj_weight.chunk(3),
                theirs.in_proj_bias.chunk(3),
                strict=True,
            ):
                part.weight.copy_(w)
                part.bias.copy_(b)
        ours.out.weight.copy_(theirs.out_proj.weight)
        ours.out.bias.copy_(theirs.out_proj.bias)


def pair(C=24, H=4, fused=True, backend="auto", dtype=torch.float64):
    torch.manual_seed(0)
    theirs = nn.MultiheadAttention(C, H, batch_first=True, dtype=dtype).eval()
    ours = MultiHeadAttention(C, H, fused_qkv=fused, backend=backend).to(dtype)
    copy_from_torch(ours, theirs)
    return ours, theirs


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fused", [True, False])
def test_self_attention_with_padding_and_causal_matches_torch(backend, fused):
    ours, theirs = pair(fused=fused, backend=backend)
    B, T, C = 3, 7, 24
    x = torch.randn(B, T, C, dtype=torch.float64)
    real = torch.ones(B, T, dtype=torch.bool)
    real[1, 5:] = False
    real[2, 2:] = False
    for causal in (False, True):
        blocked = ~causal_mask(T, T) if causal else None
        want, want_weights = theirs(
            x, x, x, key_padding_mask=~real, attn_mask=blocked, average_attn_weights=False
        )
        got, record = ours(x, key_padding_mask=real, causal=causal, record=True)
        weights = record.weights([0, 1, 2, 3])
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(weights, want_weights)


@pytest.mark.parametrize("backend", BACKENDS)
def test_cross_attention_matches_torch(backend):
    ours, theirs = pair(backend=backend)
    x, context = torch.randn(2, 5, 24, dtype=torch.float64), torch.randn(2, 9, 24).double()
    real = torch.ones(2, 9, dtype=torch.bool)
    real[0, 6:] = False
    want, want_weights = theirs(
        x, context, context, key_padding_mask=~real, average_attn_weights=False
    )
    got, record = ours(x, context, key_padding_mask=real, record=True)
    weights = record.weights([3, 1])
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(weights, want_weights[:, [3, 1]])
    assert (weights[0, :, :, 6:] == 0).all(), "padding gets no attention"


def test_separate_projections_take_a_context_of_another_width():
    mha = MultiHeadAttention(16, 4, context_width=10)
    out, _ = mha(torch.randn(2, 3, 16), torch.randn(2, 6, 10))
    assert out.shape == (2, 3, 16)
    with pytest.raises(ValueError, match="fused_qkv"):
        MultiHeadAttention(16, 4, context_width=10, fused_qkv=True)


@pytest.mark.parametrize("backend", BACKENDS)
def test_recorded_weights_equal_eager_weights_for_every_backend(backend):
    torch.manual_seed(1)
    mha = MultiHeadAttention(32, 8, num_kv_heads=2, fused_qkv=True, backend=backend).double()
    mha.rotary = RotaryEmbedding(4)
    x = torch.randn(2, 6, 32, dtype=torch.float64)
    real = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]], dtype=torch.bool)
    out, record = mha(x, key_padding_mask=real, causal=True, record=True)
    weights = record.weights(range(8))
    # the same q, k, v by hand, through eager, which materializes the weights itself
    q, k, v = mha.qkv(x).split(mha.sizes, dim=-1)
    q, k, v = mha.split_heads(q, 8), mha.split_heads(k, 2), mha.split_heads(v, 2)
    positions = torch.arange(6)
    q, k = mha.rotary(q, positions), mha.rotary(k, positions)
    eager_out, eager_weights = eager_backend.attend(
        q, k, v, mask=real[:, None, None, :], causal=True, return_weights=True
    )
    torch.testing.assert_close(weights, eager_weights, rtol=0, atol=1e-12)
    torch.testing.assert_close(out, mha.out(eager_out.transpose(1, 2).reshape(2, 6, 32)))
    # the record holds what the backend received and returned: rotated q and k, the mask
    torch.testing.assert_close(record.q, q, rtol=0, atol=0)
    torch.testing.assert_close(record.k, k, rtol=0, atol=0)
    torch.testing.assert_close(record.out, eager_out, rtol=0, atol=1e-12)
    assert record.causal and record.scale == 0.5 and record.backend == backend
    assert (record.allowed == (real[:, None, None, :] & causal_mask(6, 6))).all()


@pytest.mark.parametrize("num_kv_heads", [4, 2, 1])
def test_cache_one_token_at_a_time_equals_the_full_forward(num_kv_heads):
    torch.manual_seed(2)
    mha = MultiHeadAttention(32, 4, num_kv_heads=num_kv_heads, rotary=RotaryEmbedding(8))
    mha = mha.double()
    x = torch.randn(2, 40, 32, dtype=torch.float64)  # past the cache's first capacity of 16
    full, _ = mha(x, causal=True)
    cache = KVCache()
    prompt, _ = mha(x[:, :3], causal=True, cache=cache)
    steps = [mha(x[:, t : t + 1], causal=True, cache=cache)[0] for t in range(3, 40)]
    torch.testing.assert_close(torch.cat([prompt, *steps], dim=1), full)
    assert cache.length == 40


def test_cross_attention_cache_reuses_the_context():
    mha = MultiHeadAttention(16, 2).double()
    x, context = torch.randn(1, 4, 16).double(), torch.randn(1, 5, 16).double()
    full, _ = mha(x, context)
    cache = KVCache()
    steps = [mha(x[:, t : t + 1], context, cache=cache)[0] for t in range(4)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full)
    assert cache.length == 5, "the context's keys and values are stored once"


@pytest.mark.parametrize("backend", ["eager", "sdpa", "loop"])
def test_without_positions_self_attention_is_permutation_equivariant(backend):
    torch.manual_seed(3)
    mha = MultiHeadAttention(16, 4, backend=backend).double()
    x = torch.randn(2, 7, 16, dtype=torch.float64)
    order = torch.randperm(7)
    out, _ = mha(x)
    permuted, _ = mha(x[:, order])
    torch.testing.assert_close(permuted, out[:, order])
    # rotary positions make where a word is matter: the same permutation no longer commutes
    mha.rotary = RotaryEmbedding(4)
    out, _ = mha(x)
    permuted, _ = mha(x[:, order])
    assert not torch.allclose(permuted, out[:, order], atol=1e-6)


def test_bad_heads_and_shapes_are_reported():
    mha = MultiHeadAttention(16, 4, num_kv_heads=2)
    with pytest.raises(ValueError, match=r"head 4 is out of range: this layer has 4 heads \(0-3\)"):
        mha(torch.randn(1, 3, 16), record=True)[1].weights([4])
    with pytest.raises(ValueError, match="not divisible by 3 heads"):
        MultiHeadAttention(16, 3)
    with pytest.raises(ValueError, match="cannot share 3 key/value heads"):
        MultiHeadAttention(24, 4, num_kv_heads=3)
    with pytest.raises(ValueError, match="unknown attention backend 'fast'"):
        MultiHeadAttention(16, 4, backend="fast")(torch.randn(1, 3, 16))


@pytest.mark.parametrize("mask_shape", [(4, 5, 5), (2, 4, 5, 5), (5, 5)])
def test_recorded_weights_of_some_heads_keep_each_heads_own_mask(mask_shape):
    torch.manual_seed(5)
    mha = MultiHeadAttention(16, 4, num_kv_heads=2, backend="sdpa").double()
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    mask = torch.rand(mask_shape) > 0.3
    _, record = mha(x, mask=mask, record=True)
    every, some = record.weights([0, 1, 2, 3]), record.weights([3, 0])
    torch.testing.assert_close(some, every[:, [3, 0]], rtol=0, atol=0)
    blocked = ~mask.expand(2, 4, 5, 5)
    assert (every[blocked] == 0).all()


@pytest.mark.parametrize("fused", [False, True])
def test_the_output_gate_scales_each_channel_of_the_heads_outputs(fused):
    """Qwen3.5's: the concatenated heads' outputs times sigmoid(x W_g) before the projection;
    the record's outputs are the heads' own, before the gate."""
    torch.manual_seed(0)
    gated = MultiHeadAttention(16, 4, num_kv_heads=2, fused_qkv=fused, output_gate=True)
    x = torch.randn(2, 5, 16)
    with torch.no_grad():
        out, record = gated(x, causal=True, record=True)
        heads = record.out.transpose(1, 2).reshape(2, 5, 16)  # (B, T, H*D)
        want = gated.out(heads * torch.sigmoid(gated.gate(x)))
    torch.testing.assert_close(out, want, atol=1e-6, rtol=0)
    assert MultiHeadAttention(16, 4).gate is None

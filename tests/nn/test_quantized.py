"""Int4Linear against a float32 matrix product with the same (dequantized) weights."""

from __future__ import annotations

import pytest
import torch

from qkv.nn.quantized import GROUP, Int4Linear


def random_int4(N: int, K: int, generator: torch.Generator):
    q = torch.randint(0, 16, (N, K), generator=generator, dtype=torch.uint8)
    scale = torch.rand(N, K // GROUP, generator=generator) * 0.02
    zero = torch.randn(N, K // GROUP, generator=generator) * 0.05
    dense = (q.float() - 8).view(N, -1, GROUP) * scale[..., None] + zero[..., None]
    return q, scale, zero, dense.view(N, K)


@pytest.mark.parametrize(("N", "K", "rows"), [(192, 576, 1), (576, 1536, 5), (64, 64, 3)])
def test_int4_linear_matches_the_dequantized_product(N, K, rows):
    generator = torch.Generator().manual_seed(N + K)
    q, scale, zero, dense = random_int4(N, K, generator)
    layer = Int4Linear(q, scale, zero)
    x = torch.randn(2, rows, K, generator=generator)
    # the kernel rounds inputs, scales and zeros to bfloat16 and accumulates in float32
    rounded = (q.float() - 8).view(N, -1, GROUP) * scale.bfloat16().float()[..., None]
    rounded = (rounded + zero.bfloat16().float()[..., None]).view(N, K)
    expected = torch.nn.functional.linear(x.bfloat16().float(), rounded)
    got = layer(x)
    assert got.shape == (2, rows, N) and got.dtype == x.dtype
    torch.testing.assert_close(got, expected, atol=2e-2 * expected.abs().max().item(), rtol=0)
    exact = torch.nn.functional.linear(x, dense)
    assert (got - exact).abs().max() < 0.05 * exact.abs().max()


def test_int4_linear_refuses_shapes_it_cannot_pack():
    with pytest.raises(ValueError, match="int4 weights need"):
        Int4Linear(torch.zeros(4, 40, dtype=torch.uint8), torch.ones(4, 1), torch.zeros(4, 1))


def test_a_bias_is_added_to_the_4_bit_product():
    """An int4 layer once dropped its Linear's bias (Qwen2's q, k, v have one): never again."""
    generator = torch.Generator().manual_seed(7)
    q, scale, zero, _ = random_int4(96, 64, generator)
    bias = torch.randn(96, generator=generator)
    x = torch.randn(3, 64, generator=generator)
    plain, biased = Int4Linear(q, scale, zero), Int4Linear(q, scale, zero, bias)
    torch.testing.assert_close(biased(x), plain(x) + bias, atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match=r"needs a bias of \(96,\)"):
        Int4Linear(q, scale, zero, torch.zeros(95))


def test_stacked_rows_are_the_separate_layers_outputs_side_by_side():
    """One layer of [q; k; v]'s rows (what `use_int4` makes of a block's three) gives each
    layer's own outputs: every output row is its own dot product, whichever layer holds it."""
    generator = torch.Generator().manual_seed(11)
    parts = [random_int4(N, 576, generator)[:3] for N in (576, 192, 192)]
    x = torch.randn(1, 1, 576, generator=generator)
    separate = torch.cat([Int4Linear(*part)(x) for part in parts], dim=-1)
    stacked = Int4Linear(*(torch.cat(column) for column in zip(*parts, strict=True)))(x)
    torch.testing.assert_close(stacked, separate, atol=1e-5, rtol=0)


def test_int8_linear_is_the_product_of_its_rows_rounded_to_8_bits():
    from qkv.nn.quantized import Int8Linear

    generator = torch.Generator().manual_seed(3)
    weight = torch.randn(4096, 576, generator=generator) * 0.05
    bias = torch.randn(4096, generator=generator)
    layer = Int8Linear(weight, bias)
    assert layer.q.dtype == torch.int8 and layer.q.shape == weight.shape
    # each weight within half a step of its row, but where the largest is clamped to 127
    rebuilt = layer.q.float() * layer.scale.float()[:, None]
    step = layer.scale.float()[:, None]
    error = (rebuilt - weight).abs()
    assert bool((error <= 0.5 * step * (1 + 1e-6)).logical_or(layer.q.abs() == 127).all())
    assert bool((error <= 1.01 * step).all())
    x = torch.randn(2, 3, 576, generator=generator)
    expected = torch.nn.functional.linear(x.bfloat16().float(), rebuilt, bias)
    got = layer(x)
    assert got.shape == (2, 3, 4096) and got.dtype == x.dtype
    torch.testing.assert_close(got, expected, atol=1e-2 * expected.abs().max().item(), rtol=0)
    exact = torch.nn.functional.linear(x, weight, bias)
    assert (got - exact).abs().max() < 0.02 * exact.abs().max()

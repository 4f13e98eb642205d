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

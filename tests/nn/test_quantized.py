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


def small_int8_layer(N: int, K: int, generator: torch.Generator):
    """An Int8Linear of 8-bit values within -63..63, with a bias: on any x86 CPU oneDNN's
    u8 x s8 products of them are exact, even where pairs are first summed into 16 bits
    (255 * 63 * 2 < 2**15: no saturation without VNNI)."""
    from qkv.nn.quantized import Int8Linear

    q = torch.randint(-63, 64, (N, K), generator=generator).to(torch.int8)
    scale = (torch.rand(N, generator=generator) * 0.01 + 1e-3).bfloat16()
    bias = torch.randn(N, generator=generator)
    return Int8Linear.from_quantized(q, scale, bias)


def planted(rows: int, K: int, generator: torch.Generator) -> torch.Tensor:
    """Inputs with a few large ones, as a transformer's last hidden state has."""
    x = torch.randn(rows, K, generator=generator)
    x[:, [3, 99, 200]] *= 30
    return x


def test_int8_inputs_are_rounded_outside_the_largest_and_summed_exactly():
    """with_int8_inputs computes, in float64: the OUTLIERS largest |x| of each row times
    their 8-bit columns, plus step * round(x / step) for the others, step = their largest
    |x| / 127; and so stays within half a step per weight of the unrounded product."""
    from qkv.nn.quantized import OUTLIERS, int8_inputs_available

    if not int8_inputs_available():
        pytest.fail("this torch has no oneDNN 8-bit products; the requirements pin one that has")
    generator = torch.Generator().manual_seed(17)
    layer = small_int8_layer(4096, 576, generator)
    x = planted(4, 576, generator)
    got = layer.with_int8_inputs(x)
    assert got.shape == (4, 4096) and got.dtype == torch.float32

    weight = layer.q.double() * layer.scale.double()[:, None]  # (N, K)
    xd = x.double()
    largest = xd.abs().topk(OUTLIERS, dim=-1).indices
    kept = torch.zeros_like(xd, dtype=torch.bool).scatter(-1, largest, True)
    rest = xd.masked_fill(kept, 0)
    step = rest.abs().amax(-1, keepdim=True) / 127
    rounded = (rest / step).round() * step + xd.masked_fill(~kept, 0)
    want = rounded @ weight.T + layer.bias.double()
    torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-5 * float(want.abs().max()))
    # every rounded input is within half a step of its own: the bound on each output
    exact = xd @ weight.T + layer.bias.double()
    bound = 0.5 * step * weight.abs().sum(-1)  # (rows, N)
    assert bool(((got.double() - exact).abs() <= bound * (1 + 1e-6) + 1e-5).all())
    # the planted inputs, rounded with the rest, would move the outputs 10 times as far
    one_step = xd.abs().amax(-1, keepdim=True) / 127
    plain = (xd / one_step).round() * one_step @ weight.T + layer.bias.double()
    assert (got.double() - exact).norm() * 10 < (plain - exact).norm()


def test_int8_inputs_rows_are_their_own_whatever_the_batch(monkeypatch):
    """Each row has its own step: a batch's rows are the rows' products alone, bit for bit,
    however many rows' outlier columns are held at once; an all-zero row is the bias."""
    import qkv.nn.quantized as quantized

    generator = torch.Generator().manual_seed(19)
    layer = small_int8_layer(1024, 576, generator)
    x = planted(5, 576, generator)
    x[4] = 0
    together = layer.with_int8_inputs(x.view(1, 5, 576))
    assert together.shape == (1, 5, 1024)
    alone = torch.cat([layer.with_int8_inputs(row[None]) for row in x])
    assert torch.equal(together[0], alone)
    assert torch.equal(together[0, 4], layer.bias)
    monkeypatch.setattr(quantized, "OUTLIER_ROWS", 2)  # rows 0-1, 2-3 and 4 apart
    assert torch.equal(layer.with_int8_inputs(x), alone)
    # rounding has no gradient: an input that would take one is refused, not cut off
    with pytest.raises(ValueError, match="carry no gradient"):
        layer.with_int8_inputs(x.requires_grad_())
    with torch.no_grad():
        assert torch.equal(layer.with_int8_inputs(x), alone)


def test_int8_inputs_read_the_weights_as_they_are_now():
    """The copies it keeps are made again once q is written in place."""
    from qkv.nn.quantized import Int8Linear

    generator = torch.Generator().manual_seed(23)
    layer = small_int8_layer(512, 64, generator)
    x = torch.randn(2, 64, generator=generator)
    before = layer.with_int8_inputs(x)
    with torch.no_grad():
        layer.q[:10].neg_()
    after = layer.with_int8_inputs(x)
    fresh = Int8Linear.from_quantized(layer.q.clone(), layer.scale, layer.bias)
    assert torch.equal(after, fresh.with_int8_inputs(x))
    assert not torch.equal(after[:, :10], before[:, :10])
    assert torch.equal(after[:, 10:], before[:, 10:])
    # a layer made under inference_mode (a model loaded there) keeps no write counts
    with torch.inference_mode():
        made_there = Int8Linear.from_quantized(layer.q.clone(), layer.scale.clone(), layer.bias)
        assert torch.equal(made_there.with_int8_inputs(x), after)
    assert torch.equal(made_there.with_int8_inputs(x), after)

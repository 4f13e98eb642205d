"""qkv.io.quants against gguf's numpy reference, on fresh random blocks of every type."""

import gguf
import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T

from qkv.io.quants import SUPPORTED, dequantize, int4_groups

# byte offsets of each type's fp16 fields (scales, minimums): random bytes there could be inf
# or NaN, so they get finite values; every other byte stays random
HALF_FIELDS = {
    T.Q4_0: [0],
    T.Q4_1: [0, 2],
    T.Q5_0: [0],
    T.Q5_1: [0, 2],
    T.Q8_0: [0],
    T.Q4_K: [0, 2],
    T.Q6_K: [208],
}
FLOATS = {T.F32: np.float32, T.F16: np.float16}
# one quantization step, as a fraction of a block's largest magnitude
STEP = {T.Q4_0: 1 / 8, T.Q4_1: 2 / 15, T.Q5_0: 1 / 16, T.Q5_1: 2 / 31, T.Q8_0: 1 / 127}


def random_bytes(ggml_type: T, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """A random `shape` tensor (torch order) as `ggml_type` bytes: (*shape[:-1], row bytes)."""
    if ggml_type in FLOATS:
        return rng.standard_normal(shape).astype(FLOATS[ggml_type]).view(np.uint8)
    if ggml_type == T.BF16:
        bits = rng.standard_normal(shape).astype(np.float32).view(np.uint32) >> 16
        return bits.astype(np.uint16).view(np.uint8)
    block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    blocks = rng.integers(0, 256, (*shape[:-1], shape[-1] // block_size, type_size), np.uint8)
    for start in HALF_FIELDS[ggml_type]:
        halves = rng.uniform(-3, 3, (*blocks.shape[:-1], 1)).astype(np.float16)
        blocks[..., start : start + 2] = halves.view(np.uint8)
    return blocks.reshape(*shape[:-1], -1)


@pytest.mark.parametrize("ggml_type", SUPPORTED, ids=lambda t: t.name)
def test_dequantize_matches_gguf_reference_bit_for_bit(ggml_type):
    rng = np.random.default_rng()
    block_size = GGML_QUANT_SIZES[ggml_type][0]
    shape = (3, 5, block_size * int(rng.integers(1, 4)))
    raw = random_bytes(ggml_type, shape, rng)

    expected = torch.from_numpy(np.asarray(gguf.quants.dequantize(raw, ggml_type), np.float32))
    got = dequantize(raw, ggml_type, shape)

    assert got.dtype == torch.float32 and got.shape == shape and got.is_contiguous()
    torch.testing.assert_close(got, expected.reshape(shape), rtol=0, atol=0)


def test_dequantize_takes_torch_bytes_and_many_blocks():
    # more blocks than one internal chunk, from a flat torch uint8 tensor
    rng = np.random.default_rng()
    shape = (1000, 2048)
    raw = random_bytes(T.Q4_1, shape, rng)
    expected = torch.from_numpy(gguf.quants.dequantize(raw, T.Q4_1))
    got = dequantize(torch.from_numpy(raw).reshape(-1), T.Q4_1, shape)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


@pytest.mark.parametrize("ggml_type", list(STEP), ids=lambda t: t.name)
def test_round_trip_through_gguf_quantize(ggml_type):
    values = np.random.default_rng().standard_normal((16, 256)).astype(np.float32)
    raw = gguf.quants.quantize(values, ggml_type)

    got = dequantize(raw, ggml_type, values.shape)

    torch.testing.assert_close(
        got, torch.from_numpy(gguf.quants.dequantize(raw, ggml_type)), rtol=0, atol=0
    )
    # each value lies within one quantization step of its block's largest magnitude
    blocks = values.reshape(-1, 32)
    error = np.abs(got.numpy().reshape(-1, 32) - blocks).max(1)
    assert (error <= np.abs(blocks).max(1) * STEP[ggml_type] * 1.01).all()


def test_float_types_are_copied_not_viewed():
    raw = torch.tensor([1.0, 2.0]).view(torch.uint8)
    got = dequantize(raw, T.F32, (2,))
    raw.view(torch.float32)[0] = 5.0
    assert got.tolist() == [1.0, 2.0]


def test_unsupported_type_names_it_and_the_supported_ones():
    with pytest.raises(ValueError, match=r"Q5_K is not supported; supported: .*Q4_0.*Q6_K"):
        dequantize(np.zeros(176, np.uint8), T.Q5_K, (256,))


def test_wrong_byte_count_is_reported():
    with pytest.raises(ValueError, match="do not hold a Q8_0 tensor of shape"):
        dequantize(np.zeros(33, np.uint8), T.Q8_0, (32,))


@pytest.mark.parametrize("ggml_type", [T.Q4_0, T.Q4_1], ids=lambda t: t.name)
def test_int4_groups_rebuild_the_dequantized_values(ggml_type):
    shape = (6, 96)
    raw = random_bytes(ggml_type, shape, np.random.default_rng(3))
    q, scale, zero = int4_groups(torch.from_numpy(raw.copy()), ggml_type, shape)
    assert q.shape == shape and int(q.max()) <= 15 and scale.shape == zero.shape == (6, 3)
    rebuilt = ((q.float() - 8).view(6, 3, 32) * scale[..., None] + zero[..., None]).view(shape)
    expected = dequantize(raw, ggml_type, shape)
    torch.testing.assert_close(rebuilt, expected, atol=1e-6 * expected.abs().max().item(), rtol=0)
    with pytest.raises(ValueError, match="Q8_0 is not a 4-bit type"):
        int4_groups(torch.from_numpy(raw.copy()), T.Q8_0, shape)

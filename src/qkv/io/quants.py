"""GGUF tensor data to float32, with torch: every block of a tensor at once, no loop over blocks.

A quantized GGUF tensor is a run of equal-size blocks; each block holds an fp16 scale (and for
some types an fp16 minimum) and 32 or 256 small integers packed into bytes. The layouts are
those of ggml (and of the numpy reference in `gguf.quants`); results are bit-identical to it,
because each value is computed with the same float32 operations in the same order.

>>> raw = torch.tensor([0x00, 0x3C] + [0x88] * 16, dtype=torch.uint8)  # Q4_0: d=1.0, all 8s
>>> dequantize(raw, GGMLQuantizationType.Q4_0, (32,))[:4]
tensor([0., 0., 0., 0.])
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from math import prod

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from torch import Tensor

T = GGMLQuantizationType


def _half(blocks: Tensor, start: int) -> Tensor:
    """The fp16 field at byte `start` of every block, as float32: (N, 1)."""
    return blocks[:, start : start + 2].view(torch.float16).float()


def _nibbles(packed: Tensor, width: int) -> Tensor:
    """(N, k * width) bytes -> (N, k, 2 * width): each run of `width` bytes gives its low
    nibbles first, then its high nibbles, as ggml lays them out."""
    runs = packed.reshape(packed.shape[0], -1, 1, width)  # (N, k, 1, width)
    both = torch.cat([runs & 0x0F, runs >> 4], dim=2)  # (N, k, 2, width)
    return both.reshape(packed.shape[0], -1, 2 * width)


def _bits(packed: Tensor) -> Tensor:
    """(N, 4) bytes of a little-endian uint32 -> its 32 bits, lowest first: (N, 32)."""
    shifts = torch.arange(8, dtype=torch.uint8)
    return ((packed.unsqueeze(-1) >> shifts) & 1).reshape(packed.shape[0], 32)


def _q4_0(blocks: Tensor) -> Tensor:  # d: f16, qs: 16 bytes
    q = _nibbles(blocks[:, 2:18], 16).reshape(-1, 32).to(torch.int8) - 8  # (N, 32)
    return q.float().mul_(_half(blocks, 0))


def _q4_1(blocks: Tensor) -> Tensor:  # d: f16, m: f16, qs: 16 bytes
    q = _nibbles(blocks[:, 4:20], 16).reshape(-1, 32)  # (N, 32)
    return q.float().mul_(_half(blocks, 0)).add_(_half(blocks, 2))


def _q5(blocks: Tensor, start: int) -> Tensor:
    """The 5-bit values of Q5_0 / Q5_1: qh (4 bytes, bit i is value i's fifth) at `start`,
    then 16 bytes of low nibbles: (N, 32) uint8."""
    low = _nibbles(blocks[:, start + 4 : start + 20], 16).reshape(-1, 32)
    return low | (_bits(blocks[:, start : start + 4]) << 4)


def _q5_0(blocks: Tensor) -> Tensor:  # d: f16, qh: 4 bytes, qs: 16 bytes
    q = _q5(blocks, 2).to(torch.int8) - 16  # (N, 32)
    return q.float().mul_(_half(blocks, 0))


def _q5_1(blocks: Tensor) -> Tensor:  # d: f16, m: f16, qh: 4 bytes, qs: 16 bytes
    return _q5(blocks, 4).float().mul_(_half(blocks, 0)).add_(_half(blocks, 2))


def _q8_0(blocks: Tensor) -> Tensor:  # d: f16, qs: 32 int8
    return blocks[:, 2:34].view(torch.int8).float().mul_(_half(blocks, 0))


def _q4_k_scales(scales: Tensor) -> tuple[Tensor, Tensor]:
    """12 bytes -> eight 6-bit scales and eight 6-bit minimums, (N, 8) each.
    Bytes 0-3 hold scales 0-3 (low 6 bits), 4-7 minimums 0-3; the top 2 bits of those bytes
    and the nibbles of bytes 8-11 make scales and minimums 4-7."""
    d, m, md = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    scale = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=1)
    minimum = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=1)
    return scale.float(), minimum.float()


def _q4_k(blocks: Tensor) -> Tensor:  # d, dmin: f16, scales: 12 bytes, qs: 128 bytes
    n = blocks.shape[0]
    scale, minimum = _q4_k_scales(blocks[:, 4:16])
    d = (_half(blocks, 0) * scale).unsqueeze(-1)  # (N, 8, 1): one per 32 values
    dm = (_half(blocks, 2) * minimum).unsqueeze(-1)  # (N, 8, 1)
    q = _nibbles(blocks[:, 16:144], 32)  # (N, 4, 64) = (N, 8, 32) sub-blocks
    return q.reshape(n, 8, 32).float().mul_(d).sub_(dm).reshape(n, 256)


def _q6_k(blocks: Tensor) -> Tensor:  # ql: 128 bytes, qh: 64, scales: 16 int8, d: f16
    n = blocks.shape[0]
    low = _nibbles(blocks[:, 0:128], 64).reshape(n, 8, 32)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).reshape(1, 1, 4, 1)
    high = (blocks[:, 128:192].reshape(n, 2, 1, 32) >> shifts) & 3  # (N, 2, 4, 32)
    q = (low | (high.reshape(n, 8, 32) << 4)).to(torch.int8) - 32
    d = (_half(blocks, 208) * blocks[:, 192:208].view(torch.int8).float()).unsqueeze(-1)
    return q.reshape(n, 16, 16).float().mul_(d).reshape(n, 256)  # d: (N, 16, 1)


_BLOCKS: dict[GGMLQuantizationType, Callable[[Tensor], Tensor]] = {
    T.Q4_0: _q4_0,
    T.Q4_1: _q4_1,
    T.Q5_0: _q5_0,
    T.Q5_1: _q5_1,
    T.Q8_0: _q8_0,
    T.Q4_K: _q4_k,
    T.Q6_K: _q6_k,
}
_FLOATS = {T.F32: torch.float32, T.F16: torch.float16, T.BF16: torch.bfloat16}
SUPPORTED = (*_FLOATS, *_BLOCKS)

# Blocks per call: bounds the uint8/int8 temporaries to a few MB, so they stay in cache.
_CHUNK_BLOCKS = 1 << 15


def dequantize(
    raw: Tensor | np.ndarray, ggml_type: GGMLQuantizationType | int, shape: tuple[int, ...]
) -> Tensor:
    """GGUF tensor bytes -> float32 values of `shape` (torch's row-major order, i.e. ggml's
    dimensions reversed).

    `raw` holds the tensor's bytes (any shape, uint8 or another dtype over the same bytes).
    Q4_0 with d=1.0 and every nibble 8 gives zeros:
    >>> raw = np.frombuffer(bytes([0x00, 0x3C] + [0x88] * 16), dtype=np.uint8)
    >>> dequantize(raw, GGMLQuantizationType.Q4_0, (1, 32)).shape
    torch.Size([1, 32])
    """
    ggml_type = GGMLQuantizationType(ggml_type)
    if ggml_type not in SUPPORTED:
        names = ", ".join(t.name for t in SUPPORTED)
        raise ValueError(f"GGUF tensor type {ggml_type.name} is not supported; supported: {names}")
    if isinstance(raw, np.ndarray):
        with warnings.catch_warnings():  # a read-only array (a memory map) is fine: only read
            warnings.simplefilter("ignore", UserWarning)
            raw = torch.from_numpy(raw.reshape(-1).view(np.uint8))
    raw = raw.reshape(-1).view(torch.uint8)
    count = prod(shape)
    block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    if count % block_size or raw.numel() != count // block_size * type_size:
        raise ValueError(
            f"{raw.numel()} bytes do not hold a {ggml_type.name} tensor of shape {tuple(shape)}"
        )
    if ggml_type in _FLOATS:
        # a copy even for F32: `raw` may be a memory map that closes after this call
        return raw.view(_FLOATS[ggml_type]).to(torch.float32, copy=True).reshape(shape)

    blocks = raw.reshape(-1, type_size)  # (N, type_size)
    out = torch.empty(blocks.shape[0], block_size)  # (N, block_size)
    for start in range(0, blocks.shape[0], _CHUNK_BLOCKS):
        chunk = blocks[start : start + _CHUNK_BLOCKS]
        out[start : start + chunk.shape[0]] = _BLOCKS[ggml_type](chunk)
    return out.reshape(shape)


INT4_TYPES = (T.Q4_0, T.Q4_1)


def int4_groups(
    raw: Tensor, ggml_type: GGMLQuantizationType | int, shape: tuple[int, int]
) -> tuple[Tensor, Tensor, Tensor]:
    """A Q4_0 or Q4_1 matrix kept in 4 bits: (q, scale, zero) with value = (q - 8) * scale +
    zero for each group of 32 columns. q (N, K) uint8 in 0..15; scale, zero (N, K / 32).

    Q4_1 stores d * q + m, which is d * (q - 8) + (m + 8d); Q4_0 stores d * (q - 8).
    """
    ggml_type = GGMLQuantizationType(ggml_type)
    if ggml_type not in INT4_TYPES:
        raise ValueError(f"{ggml_type.name} is not a 4-bit type; 4-bit types: Q4_0, Q4_1")
    rows, cols = shape
    type_size = GGML_QUANT_SIZES[ggml_type][1]
    blocks = raw.reshape(-1).view(torch.uint8).reshape(-1, type_size)  # (N * K / 32, size)
    start = 2 if ggml_type == T.Q4_0 else 4  # after d (and m)
    q = _nibbles(blocks[:, start : start + 16], 16).reshape(rows, cols)
    scale = _half(blocks, 0).reshape(rows, -1)  # (N, K / 32)
    if ggml_type == T.Q4_0:
        zero = torch.zeros_like(scale)
    else:
        zero = _half(blocks, 2).reshape(rows, -1) + 8 * scale
    return q, scale, zero

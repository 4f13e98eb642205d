"""Random GGUF K-quant blocks in their exact byte layout, and numpy references of llama.cpp's
arithmetic for them (Q8_K activations, the integer products): numpy only, no torch, so that
the sanitizer test's subprocess runs them too."""

from __future__ import annotations

import numpy as np

BLOCK_BYTES = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}


def random_blocks(fmt: str, N: int, K: int, rng: np.random.Generator) -> np.ndarray:
    """(N, K / 256 * block bytes) uint8: every integer, scale and minimum byte uniformly random
    (the full ranges of the 6-bit scales and minimums, of Q6_K's int8 scales), the float16
    super-block scales random of either sign."""
    nsb = K // 256
    raw = rng.integers(0, 256, (N, nsb, BLOCK_BYTES[fmt]), dtype=np.uint8)
    halves = rng.uniform(1e-3, 2e-2, (N, nsb, 2)) * rng.choice([-1, 1], (N, nsb, 2))
    halves = halves.astype(np.float16).view(np.uint8).reshape(N, nsb, 4)
    if fmt == "Q6_K":
        raw[:, :, 208:210] = halves[:, :, :2]
    else:
        raw[:, :, 0:4] = halves
    return raw.reshape(N, -1)


def decode(fmt: str, raw: np.ndarray, K: int):
    """raw (N, bytes) -> q (N, nsb, 256) int64 (unsigned integers), sc (N, nsb, 16 or 8),
    mn (N, nsb, 8) or None, d and dmin (N, nsb) float32: the layout read afresh from ggml's
    block definitions, as an independent reading of what quant_k.c decodes."""
    N, nsb = raw.shape[0], K // 256
    b = raw.reshape(N, nsb, BLOCK_BYTES[fmt]).astype(np.int64)
    if fmt == "Q6_K":
        ql, qh = b[..., 0:128], b[..., 128:192]
        q = np.zeros((N, nsb, 256), dtype=np.int64)
        for n in range(2):
            lo, hi = ql[..., 64 * n : 64 * n + 64], qh[..., 32 * n : 32 * n + 32]
            q[..., 128 * n : 128 * n + 32] = (lo[..., :32] & 15) | (hi & 3) << 4
            q[..., 128 * n + 32 : 128 * n + 64] = (lo[..., 32:] & 15) | (hi >> 2 & 3) << 4
            q[..., 128 * n + 64 : 128 * n + 96] = (lo[..., :32] >> 4) | (hi >> 4 & 3) << 4
            q[..., 128 * n + 96 : 128 * n + 128] = (lo[..., 32:] >> 4) | (hi >> 6 & 3) << 4
        sc = b[..., 192:208].astype(np.uint8).view(np.int8).astype(np.int64)
        d = raw.reshape(N, nsb, -1)[..., 208:210].copy().view(np.float16)[..., 0]
        return q, sc, None, d.astype(np.float32), np.zeros((N, nsb), np.float32)
    s = b[..., 4:16]
    sc = np.concatenate([s[..., 0:4] & 63, (s[..., 8:12] & 15) | (s[..., 0:4] >> 6) << 4], -1)
    mn = np.concatenate([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | (s[..., 4:8] >> 6) << 4], -1)
    qs = b[..., 48:176] if fmt == "Q5_K" else b[..., 16:144]
    q = np.zeros((N, nsb, 256), dtype=np.int64)
    for g in range(4):
        q[..., 64 * g : 64 * g + 32] = qs[..., 32 * g : 32 * g + 32] & 15
        q[..., 64 * g + 32 : 64 * g + 64] = qs[..., 32 * g : 32 * g + 32] >> 4
        if fmt == "Q5_K":
            qh = b[..., 16:48]
            q[..., 64 * g : 64 * g + 32] |= (qh >> (2 * g) & 1) << 4
            q[..., 64 * g + 32 : 64 * g + 64] |= (qh >> (2 * g + 1) & 1) << 4
    halves = raw.reshape(N, nsb, -1)[..., 0:4].copy().view(np.float16).astype(np.float32)
    return q, sc, mn, halves[..., 0], halves[..., 1]


def q8_k(x: np.ndarray):
    """llama.cpp's quantize_row_q8_K_ref in numpy float32: x (M, K) -> q int8, d float32
    (M, K / 256), bsums int16 (M, K / 16)."""
    M, K = x.shape
    blocks = x.astype(np.float32).reshape(M, K // 256, 256)
    first = np.abs(blocks).argmax(-1)  # the first of the largest in magnitude
    largest = np.take_along_axis(blocks, first[..., None], -1)  # (M, nsb, 1), signed
    zero = largest == 0
    iscale = np.float32(-127.0) / np.where(zero, np.float32(1), largest)
    q = np.minimum(np.rint(iscale * blocks), 127)  # rint: ties to even, as nearest_int
    q = np.where(zero, 0, q).astype(np.int8)
    d = np.where(zero[..., 0], np.float32(0), np.float32(1) / iscale[..., 0]).astype(np.float32)
    bsums = q.reshape(M, -1, 16).astype(np.int64).sum(-1).astype(np.int16)
    return q.reshape(M, K), d, bsums


def reference(fmt: str, raw: np.ndarray, K: int, x: np.ndarray):
    """The product as llama.cpp's arithmetic defines it, in float64 from exact integers:
    (y (M, N), sum over super-blocks of each term's magnitude (M, N), for tolerances)."""
    q, sc, mn, d, dmin = decode(fmt, raw, K)
    xq, xd, _ = q8_k(x)
    M, N, nsb = x.shape[0], raw.shape[0], K // 256
    xs = xq.astype(np.int64).reshape(M, nsb, 256)
    if fmt == "Q6_K":
        prods = np.einsum("nbc,mbc->mnbc", q - 32, xs).reshape(M, N, nsb, 16, 16).sum(-1)
        isum = (prods * sc[None]).sum(-1)  # (M, N, nsb)
        summ = np.zeros_like(isum)
    else:
        prods = np.einsum("nbc,mbc->mnbc", q, xs).reshape(M, N, nsb, 8, 32).sum(-1)
        isum = (prods * sc[None]).sum(-1)
        summ = (xs.reshape(M, 1, nsb, 8, 32).sum(-1) * mn[None]).sum(-1)
    scale = d.astype(np.float64)[None] * xd.astype(np.float64)[:, None]  # (M, N, nsb)
    offset = dmin.astype(np.float64)[None] * xd.astype(np.float64)[:, None]
    terms = scale * isum - offset * summ
    magnitude = np.abs(scale * isum) + np.abs(offset * summ)
    return terms.sum(-1), magnitude.sum(-1)

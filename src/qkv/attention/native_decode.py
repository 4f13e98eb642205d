"""Decode attention over a long cache in C: one query per head over a float16 (or 8-bit) cache.

When a decoder generates, each step's query reads every cached key and value: at 4,096 tokens
SmolLM2's float32 cache is 188 MB a token. `decode_attention` reads a float16 cache (half
of that) or an 8-bit one (a quarter, with one float scale per token and head) with qkv's own
split-K kernel (`decode.c`, "flash decoding"): the positions are cut into chunks shared by the
threads, each chunk's softmax sums kept apart and then combined exactly. It returns each
query's log-sum-exp beside the output, so the weights a record asks for are one product away
(`weights_from_lse`), equal to what `loop` gives on the same keys.

Every size, dtype and bound is checked here, before any C call: a hostile shape never reaches
the kernel. Where there is no native library (`why_not()` says why) the caller runs torch's
`scaled_dot_product_attention` instead; `decode_attention` then raises `NativeUnavailable`.

>>> q = torch.randn(1, 4, 8)  # (B, H, D)
>>> keys = torch.randn(1, 2, 16, 8).half()  # (B, Hkv, capacity, D)
>>> out, lse = decode_attention(q, keys, keys, length=10)  # over the first 10 positions
>>> tuple(out.shape), tuple(lse.shape)
((1, 4, 8), (1, 4))
>>> weights_from_lse(q, keys, lse, length=10).sum(-1).allclose(torch.ones(1, 4))
True
"""

from __future__ import annotations

import ctypes
import functools
import math
import os

import torch
from torch import Tensor

from qkv import native
from qkv.attention.flash.weights import weights_from_lse as _weights_from_lse

FLOAT16, INT8 = 0, 1  # decode.c's cache formats
MOST_THREADS = 256  # the thread pool's
MOST_PARTIAL_BYTES = 2**30  # the kernel's own memory for one call (chunk=1 over a long cache)


class NativeUnavailable(RuntimeError):
    """There is no native library in this process; the message says why."""


@functools.cache
def _library() -> ctypes.CDLL | None:
    lib = native.library()
    if lib is None:
        return None
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    native.declare(lib, "qkv_decode_variants", ctypes.c_int)
    native.declare(lib, "qkv_decode_chunk", i64, i64, i64, i64, ctypes.c_int)
    native.declare(lib, "qkv_decode_attention", ctypes.c_int, ctypes.c_int, ctypes.c_int,
                   p, p, p, p, p, p, i64, i64, i64, i64, i64, i64, i64, ctypes.c_float, i64,
                   p, p, ctypes.c_int)  # fmt: skip
    native.declare(lib, "qkv_cache_append", None, ctypes.c_int, p, p, p, p, p, p,
                   i64, i64, i64, i64, i64)  # fmt: skip
    return lib


def why_not() -> str | None:
    """Why decode attention cannot run natively in this process (None: it can)."""
    return native.why_not()


def _lib() -> ctypes.CDLL:
    lib = _library()
    if lib is None:
        raise NativeUnavailable(f"no native decode attention: {why_not()}")
    return lib


def variants() -> tuple[str, ...]:
    """The kernel variants this CPU runs, lowest first (names of `native.VARIANTS`)."""
    mask = _lib().qkv_decode_variants()
    return tuple(name for i, name in enumerate(native.VARIANTS) if mask >> i & 1)


def _variant_index(variant: str | None) -> int:
    return _index(variant, os.environ.get("QKV_NATIVE_ISA", ""))


@functools.cache  # a step's attention is 30 calls a token: the choice is made once per asking
def _index(variant: str | None, _isa: str) -> int:
    having = variants()
    if variant is None:
        chosen, _ = native.chosen_variant()  # QKV_NATIVE_ISA's, or the CPU's best
        return max(native.VARIANTS.index(v) for v in having if native.VARIANTS.index(v) <= chosen)
    if variant not in having:
        raise ValueError(f"variant {variant!r} does not run on this CPU; it runs {having}")
    return native.VARIANTS.index(variant)


def _whole(name: str, value, least: int, most: int | None = None) -> int:
    if type(value) is not int or value < least or (most is not None and value > most):
        bound = f">= {least}" + ("" if most is None else f" and <= {most}")
        raise ValueError(f"{name} must be a whole number {bound}, got {value!r}")
    return value


def _tensor(name: str, t, shape: tuple[int, ...], dtypes: tuple[torch.dtype, ...]) -> Tensor:
    if not isinstance(t, Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        allowed = " or ".join(map(str, dtypes))
        raise ValueError(f"{name} has dtype {t.dtype}; decode attention takes {allowed}")
    if t.device.type != "cpu":
        raise ValueError(f"{name} is on {t.device}; native decode attention runs on the CPU")
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (call .contiguous() once, not per step)")
    return t


def _cache_inputs(keys, values, key_scales, value_scales) -> tuple[int, tuple[int, ...]]:
    """The cache's format and (B, Hkv, capacity, D), every part checked."""
    if not isinstance(keys, Tensor) or keys.dim() != 4:
        got = tuple(keys.shape) if isinstance(keys, Tensor) else type(keys).__name__
        raise ValueError(f"keys must be a tensor (B, Hkv, capacity, D), got {got}")
    B, Hkv, cap, _ = shape = tuple(keys.shape)
    if min(shape) < 1:
        raise ValueError(f"keys (B, Hkv, capacity, D) = {shape}: every size must be >= 1")
    _tensor("keys", keys, shape, (torch.float16, torch.int8))
    _tensor("values", values, shape, (keys.dtype,))
    if keys.dtype == torch.float16:
        if key_scales is not None or value_scales is not None:
            raise ValueError("a float16 cache has no scales: pass key_scales=value_scales=None")
        return FLOAT16, shape
    for name, scales in (("key_scales", key_scales), ("value_scales", value_scales)):
        if scales is None:
            raise ValueError(f"an int8 cache needs {name} (B, Hkv, capacity) float32")
        _tensor(name, scales, (B, Hkv, cap), (torch.float32,))
    return INT8, shape


def _window(start, length, cap: int) -> tuple[int, int]:
    length = _whole("length", length, 0, cap)
    return _whole("start", start, 0, length), length


def _mask(mask, B: int, cap: int) -> Tensor | None:
    if mask is None:
        return None
    return _tensor("mask", mask, (B, cap), (torch.bool, torch.uint8))


def _scale(scale, D: int) -> float:
    if scale is None:
        return 1.0 / math.sqrt(D)
    if isinstance(scale, bool) or not isinstance(scale, int | float) or not math.isfinite(scale):
        raise ValueError(f"scale must be a finite number or None (1/sqrt(D)), got {scale!r}")
    return float(scale)


def _ptr(t: Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def decode_attention(
    q: Tensor,
    keys: Tensor,
    values: Tensor,
    *,
    length: int,
    start: int = 0,
    mask: Tensor | None = None,
    scale: float | None = None,
    key_scales: Tensor | None = None,
    value_scales: Tensor | None = None,
    threads: int | None = None,
    chunk: int = 0,
    variant: str | None = None,
) -> tuple[Tensor, Tensor]:
    """(out (B, H, D), lse (B, H)), float32: each query q (B, H, D) float32 attends over the
    cached positions [start, length) of keys and values (B, Hkv, capacity, D).

    The cache is float16, or int8 with key_scales and value_scales (B, Hkv, capacity) float32
    (a key is its scale times its bytes). mask (B, capacity) bool or uint8: True where a key
    may be seen (a padded prompt's); start: a sliding window's first position. Query head h
    reads kv-head h // (H // Hkv). scale: 1/sqrt(D) by default. lse is the log of each query's
    softmax denominator: weight = exp(scale * q . k - lse) (`weights_from_lse`). A query that
    may see no key gets zeros and lse = -inf. threads: torch's count by default; chunk: the
    positions per split (0: the kernel's choice; the result does not depend on it beyond
    float32's rounding); variant: a name of `variants()` (None: the best, or QKV_NATIVE_ISA's).
    No gradient flows through it. Raises ValueError for any input it cannot take,
    NativeUnavailable where there is no native library.
    """
    fmt, (B, Hkv, cap, D) = _cache_inputs(keys, values, key_scales, value_scales)
    if not isinstance(q, Tensor) or q.dim() != 3:
        got = tuple(q.shape) if isinstance(q, Tensor) else type(q).__name__
        raise ValueError(f"q must be a tensor (B, H, D) of one query per head, got {got}")
    H = q.shape[1]
    if H < 1 or H % Hkv:
        raise ValueError(f"q's {H} heads must be a multiple of the cache's {Hkv} kv-heads")
    _tensor("q", q, (B, H, D), (torch.float32,))
    start, length = _window(start, length, cap)
    mask = _mask(mask, B, cap)
    scale = _scale(scale, D)
    threads = _whole("threads", torch.get_num_threads() if threads is None else threads, 1,
                     MOST_THREADS)  # fmt: skip
    chunk = _whole("chunk", chunk, 0)
    lib = _lib()
    index = _variant_index(variant)
    used = chunk or lib.qkv_decode_chunk(B, Hkv, length - start, threads)
    partial_bytes = B * H * -(-(length - start) // used) * (D + 2) * 4  # (B, H, chunks, D + 2)
    if partial_bytes > MOST_PARTIAL_BYTES:
        raise ValueError(f"chunk={chunk} over {length - start} positions needs "
                         f"{partial_bytes / 2**30:.1f} GiB of partial sums; take a longer "
                         "chunk")  # fmt: skip
    out = q.new_empty(B, H, D)
    lse = q.new_empty(B, H)
    done = lib.qkv_decode_attention(
        index, fmt, q.data_ptr(), keys.data_ptr(), values.data_ptr(), _ptr(key_scales),
        _ptr(value_scales), _ptr(mask), B, H, Hkv, cap, D, start, length, scale, chunk,
        out.data_ptr(), lse.data_ptr(), threads,
    )  # fmt: skip
    if done == -2:
        raise MemoryError("decode attention could not allocate its partial sums")
    assert done == 0, f"qkv_decode_attention returned {done}"
    return out, lse


def append(
    keys: Tensor,
    values: Tensor,
    k: Tensor,
    v: Tensor,
    at: int,
    *,
    key_scales: Tensor | None = None,
    value_scales: Tensor | None = None,
) -> None:
    """Write one step's k and v (B, Hkv, D) float32 into position `at` of the cache, in place:
    float16 rounded to nearest (as torch's .half()), or int8 with a scale per row, amax / 127,
    and each byte round(x / scale) (halves to even; a row of zeros gets scale 0)."""
    fmt, (B, Hkv, cap, D) = _cache_inputs(keys, values, key_scales, value_scales)
    _tensor("k", k, (B, Hkv, D), (torch.float32,))
    _tensor("v", v, (B, Hkv, D), (torch.float32,))
    at = _whole("at", at, 0, cap - 1)
    _lib().qkv_cache_append(fmt, k.data_ptr(), v.data_ptr(), keys.data_ptr(), values.data_ptr(),
                            _ptr(key_scales), _ptr(value_scales), B, Hkv, cap, D, at)  # fmt: skip


def dequantized(cache: Tensor, scales: Tensor | None = None) -> Tensor:
    """The cache's rows as float32 (B, Hkv, capacity, D): a float16 cache widened, an int8 one
    times its scales (B, Hkv, capacity), in float32, as the kernel reads them."""
    if scales is None:
        return cache.float()
    return scales[..., None] * cache.float()


def weights_from_lse(
    q: Tensor,
    keys: Tensor,
    lse: Tensor,
    *,
    length: int,
    start: int = 0,
    mask: Tensor | None = None,
    scale: float | None = None,
    key_scales: Tensor | None = None,
) -> Tensor:
    """The attention weights (B, H, length - start), float32, that `decode_attention` applied
    over positions [start, length), recomputed from q (B, H, D), the cache's keys and the lse
    (B, H) it returned: exp(scale * q . k - lse); a hidden key 0, a query that saw no key a
    row of zeros. Arguments as `decode_attention` took them."""
    _, (B, Hkv, cap, D) = _cache_inputs(keys, keys, key_scales, key_scales)
    if not isinstance(q, Tensor) or q.dim() != 3 or q.shape[1] % Hkv:
        got = tuple(q.shape) if isinstance(q, Tensor) else type(q).__name__
        raise ValueError(f"q must be (B, H, D) with H a multiple of {Hkv}, got {got}")
    H = q.shape[1]
    _tensor("q", q, (B, H, D), (torch.float32,))
    _tensor("lse", lse, (B, H), (torch.float32,))
    start, length = _window(start, length, cap)
    mask = _mask(mask, B, cap)
    scales = None if key_scales is None else key_scales[:, :, start:length]
    k = dequantized(keys[:, :, start:length], scales)  # (B, Hkv, n, D)
    k = k.repeat_interleave(H // Hkv, dim=1)  # (B, H, n, D): head h reads kv-head h // G
    seen = None if mask is None else mask[:, None, None, start:length].bool()  # (B, 1, 1, n)
    weights = _weights_from_lse(q[:, :, None], k, lse[:, :, None], mask=seen, causal=False,
                                scale=_scale(scale, D))  # fmt: skip
    return weights[:, :, 0]  # (B, H, n)

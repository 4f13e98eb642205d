"""qkv's decode attention in C (attention/decode.c through attention/native_decode.py) against
the article itself (`loop`): every variant this CPU runs, each forced, on fresh random caches.

The cache rounds keys and values (to float16, or to bytes with a scale): `loop` reads the same
rounded numbers (`dequantized`), so what is left between them is float32 against float64.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from qkv import native
from qkv.attention import native_decode as nd
from qkv.attention import steps

pytestmark = pytest.mark.skipif(nd.why_not() is not None, reason="no native library")

# (B, H, Hkv, capacity, D, start, length, masked, chunk)
CASES = [
    (1, 1, 1, 4, 8, 0, 1, False, 0),  # one cached token
    (2, 6, 2, 70, 40, 0, 61, True, 0),  # grouped heads, a padding mask, D not a multiple of 16
    (2, 4, 4, 50, 33, 0, 50, True, 7),  # D with an odd tail; chunks of 7 (a short last one)
    (1, 9, 3, 90, 64, 35, 80, False, 16),  # SmolLM2's heads, a sliding window of 45
    (1, 4, 2, 40, 24, 10, 37, True, 1),  # a window and a mask, one position per chunk
    (1, 4, 2, 3100, 64, 0, 3000, True, 0),  # a long cache, the kernel's own chunks
]


def random_cache(B, Hkv, cap, D, fmt, generator):
    """keys, values and their scales (None for float16): as the kernel and loop read them."""
    k = torch.randn(B, Hkv, cap, D, generator=generator) * 2
    v = torch.randn(B, Hkv, cap, D, generator=generator)
    if fmt == "float16":
        return k.half(), v.half(), None, None
    keys, values = (
        torch.empty(B, Hkv, cap, D, dtype=torch.int8),
        torch.empty_like(k, dtype=torch.int8),
    )
    ks, vs = torch.empty(B, Hkv, cap), torch.empty(B, Hkv, cap)
    for t in range(cap):  # the kernel's own rounding, row by row
        nd.append(keys, values, k[:, :, t].contiguous(), v[:, :, t].contiguous(), t,
                  key_scales=ks, value_scales=vs)  # fmt: skip
    return keys, values, ks, vs


def oracle(q, keys, values, ks, vs, start, length, mask):
    """loop's output (B, H, D), lse (B, H) and weights (B, H, length) in float64, on the rounded
    cache's first `length` positions, the window as loop's own rule: the last query of a causal
    window of length - start."""
    k = nd.dequantized(keys, ks)[:, :, :length].double()
    v = nd.dequantized(values, vs)[:, :, :length].double()
    seen = None if mask is None else mask[:, None, None, :length]
    window = None if start == 0 else length - start
    found = steps(q[:, :, None].double(), k, v, mask=seen, causal=True, window=window)
    B, H = q.shape[:2]
    out = torch.stack([s.contextualized for s in found]).view(B, H, -1)
    weights = torch.stack([s.weights for s in found]).view(B, H, length)
    scores = torch.stack([torch.stack([p.score if p.allowed else torch.tensor(-math.inf,
                          dtype=torch.float64) for p in s.pairs]) for s in found])  # fmt: skip
    return out, torch.logsumexp(scores, -1).view(B, H), weights


@pytest.mark.parametrize("fmt", ["float16", "int8"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "x".join(map(str, c)))
def test_every_variant_equals_loop(case, fmt):
    B, H, Hkv, cap, D, start, length, masked, chunk = case
    seed = int(torch.randint(0, 2**31, ()))
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, D, generator=generator)
    keys, values, ks, vs = random_cache(B, Hkv, cap, D, fmt, generator)
    mask = None
    if masked:
        mask = torch.rand(B, cap, generator=generator) > 0.3
        mask[:, length - 1] = True  # each row sees a key (the blind row is its own test)
    out_loop, lse_loop, weights_loop = oracle(q, keys, values, ks, vs, start, length, mask)
    for variant in (*nd.variants(), None):  # each forced, then the one chosen
        for threads in (1, 2):
            out, lse = nd.decode_attention(
                q, keys, values, length=length, start=start, mask=mask, key_scales=ks,
                value_scales=vs, chunk=chunk, threads=threads, variant=variant,
            )  # fmt: skip
            said = f"seed {seed}, variant {variant}, {threads} threads"
            torch.testing.assert_close(out.double(), out_loop, rtol=1e-5, atol=2e-6, msg=said)
            torch.testing.assert_close(lse.double(), lse_loop, rtol=1e-6, atol=1e-5, msg=said)
            weights = nd.weights_from_lse(q, keys, lse, length=length, start=start, mask=mask,
                                          key_scales=ks)  # fmt: skip
            torch.testing.assert_close(weights.double(), weights_loop[:, :, start:], rtol=1e-5,
                                       atol=1e-6, msg=said)  # fmt: skip
            assert (weights_loop[:, :, :start] == 0).all()  # the window hid them in loop too


def test_a_query_that_sees_no_key_gets_zeros_and_lse_minus_infinity():
    q = torch.randn(2, 4, 16)
    keys, values = torch.randn(2, 2, 30, 16).half(), torch.randn(2, 2, 30, 16).half()
    mask = torch.ones(2, 30, dtype=torch.bool)
    mask[1, :20] = False  # row 1 sees nothing of [0, 20)
    for variant in nd.variants():
        out, lse = nd.decode_attention(q, keys, values, length=20, mask=mask, variant=variant,
                                       chunk=8)  # fmt: skip
        assert torch.isfinite(out).all() and (out[1] == 0).all() and (lse[1] == -math.inf).all()
        assert torch.isfinite(lse[0]).all()
        weights = nd.weights_from_lse(q, keys, lse, length=20, mask=mask)
        assert (weights[1] == 0).all()
        torch.testing.assert_close(weights[0].sum(-1), torch.ones(4))
        out, lse = nd.decode_attention(q, keys, values, start=7, length=7, variant=variant)
        assert (out == 0).all() and (lse == -math.inf).all()  # an empty window


def test_append_rounds_as_torch_does():
    B, Hkv, cap, D = 2, 3, 9, 20
    k, v = torch.randn(B, Hkv, D) * 5, torch.randn(B, Hkv, D)
    v[0, 1] = 0  # a row of zeros: scale 0, bytes 0
    keys, values = torch.zeros(B, Hkv, cap, D).half(), torch.zeros(B, Hkv, cap, D).half()
    nd.append(keys, values, k, v, 4)
    assert torch.equal(keys[:, :, 4], k.half()) and torch.equal(values[:, :, 4], v.half())
    assert (keys[:, :, :4] == 0).all() and (keys[:, :, 5:] == 0).all()
    keys8, values8 = (
        torch.zeros(B, Hkv, cap, D, dtype=torch.int8),
        torch.zeros(B, Hkv, cap, D, dtype=torch.int8),
    )
    ks, vs = torch.zeros(B, Hkv, cap), torch.zeros(B, Hkv, cap)
    nd.append(keys8, values8, k, v, cap - 1, key_scales=ks, value_scales=vs)
    for x, cache, scales in ((k, keys8, ks), (v, values8, vs)):
        scale = x.abs().amax(-1) / 127  # (B, Hkv), float32 as the kernel divides
        expected = torch.where(scale[..., None] > 0, torch.round(x / scale[..., None]), 0)
        assert torch.equal(scales[:, :, -1], scale)
        assert torch.equal(cache[:, :, -1], expected.to(torch.int8))


def good_call():
    q = torch.randn(1, 4, 8)
    keys, values = torch.randn(1, 2, 10, 8).half(), torch.randn(1, 2, 10, 8).half()
    return dict(q=q, keys=keys, values=values, length=10)


HOSTILE = {
    "q float64": dict(q=torch.randn(1, 4, 8, dtype=torch.float64)),
    "q 4-d": dict(q=torch.randn(1, 4, 1, 8)),
    "q not a tensor": dict(q=[[0.0] * 8] * 4),
    "q's D differs": dict(q=torch.randn(1, 4, 6)),
    "q's batch differs": dict(q=torch.randn(2, 4, 8)),
    "heads not a multiple": dict(q=torch.randn(1, 3, 8)),
    "q not contiguous": dict(q=torch.randn(1, 8, 4).transpose(1, 2)),
    "keys float32": dict(keys=torch.randn(1, 2, 10, 8)),
    "values of another dtype": dict(values=torch.randn(1, 2, 10, 8).bfloat16()),
    "values shorter": dict(values=torch.randn(1, 2, 9, 8).half()),
    "keys 3-d": dict(keys=torch.randn(2, 10, 8).half()),
    "an empty cache": dict(keys=torch.randn(1, 2, 0, 8).half(),
                           values=torch.randn(1, 2, 0, 8).half()),
    "length past the capacity": dict(length=11),
    "a negative length": dict(length=-1),
    "a length of True": dict(length=True),
    "a float length": dict(length=3.0),
    "a negative start": dict(start=-2),
    "start past length": dict(start=6, length=5),
    "mask of the wrong shape": dict(mask=torch.ones(1, 9, dtype=torch.bool)),
    "mask float": dict(mask=torch.ones(1, 10)),
    "mask not contiguous": dict(mask=torch.ones(1, 20, dtype=torch.bool)[:, ::2]),
    "scale nan": dict(scale=float("nan")),
    "scale text": dict(scale="0.1"),
    "no threads": dict(threads=0),
    "too many threads": dict(threads=10_000),
    "a negative chunk": dict(chunk=-1),
    "scales for a float16 cache": dict(key_scales=torch.ones(1, 2, 10),
                                       value_scales=torch.ones(1, 2, 10)),
    "int8 without scales": dict(keys=torch.zeros(1, 2, 10, 8, dtype=torch.int8),
                                values=torch.zeros(1, 2, 10, 8, dtype=torch.int8)),
    "int8 scales of the wrong shape": dict(
        keys=torch.zeros(1, 2, 10, 8, dtype=torch.int8),
        values=torch.zeros(1, 2, 10, 8, dtype=torch.int8),
        key_scales=torch.ones(1, 2, 9), value_scales=torch.ones(1, 2, 10)),
    "a chunk of 1 over a huge cache": dict(
        keys=torch.zeros(1, 2, 2**21, 8).half(), values=torch.zeros(1, 2, 2**21, 8).half(),
        length=2**21, chunk=1, q=torch.randn(1, 64, 8)),
}  # fmt: skip


@pytest.mark.parametrize("name", HOSTILE)
def test_hostile_inputs_are_refused_before_any_c_call(name, monkeypatch):
    def no_c_call(*_, **__):
        raise AssertionError("reached the C library")

    call = {**good_call(), **HOSTILE[name]}
    if name != "a chunk of 1 over a huge cache":  # that one asks the kernel its chunk length
        monkeypatch.setattr(nd, "_lib", no_c_call)
    with pytest.raises(ValueError) as refused:
        nd.decode_attention(call.pop("q"), call.pop("keys"), call.pop("values"), **call)
    assert "\n" not in str(refused.value)


def test_append_refuses_a_position_past_the_cache(monkeypatch):
    monkeypatch.setattr(nd, "_lib", lambda: (_ for _ in ()).throw(AssertionError("C")))
    keys = torch.zeros(1, 2, 4, 8).half()
    for at in (4, -1, 1.0):
        with pytest.raises(ValueError, match="at must be"):
            nd.append(keys, keys.clone(), torch.ones(1, 2, 8), torch.ones(1, 2, 8), at)
    with pytest.raises(ValueError, match="k must have shape"):
        nd.append(keys, keys.clone(), torch.ones(1, 2, 7), torch.ones(1, 2, 8), 0)


def test_an_unknown_variant_is_refused():
    with pytest.raises(ValueError, match="does not run on this CPU"):
        nd.decode_attention(**good_call(), variant="avx1024")


def test_without_the_library_it_says_why(monkeypatch):
    monkeypatch.setenv("QKV_NATIVE", "0")
    nd._library.cache_clear()  # QKV_NATIVE is read by every native.library() call
    try:
        assert "QKV_NATIVE=0" in nd.why_not()
        with pytest.raises(nd.NativeUnavailable, match="QKV_NATIVE=0"):
            nd.decode_attention(**good_call())
    finally:
        monkeypatch.delenv("QKV_NATIVE")
        nd._library.cache_clear()
    assert nd.why_not() is None


SANITIZED = """
import ctypes, math, sys
import numpy as np
lib = ctypes.CDLL(sys.argv[1])
p, i64 = ctypes.c_void_p, ctypes.c_int64
lib.qkv_decode_attention.argtypes = [ctypes.c_int, ctypes.c_int, p, p, p, p, p, p, i64, i64,
    i64, i64, i64, i64, i64, ctypes.c_float, i64, p, p, ctypes.c_int]
lib.qkv_cache_append.argtypes = [ctypes.c_int, p, p, p, p, p, p, i64, i64, i64, i64, i64]
ptr = lambda a: None if a is None else a.ctypes.data
rng = np.random.default_rng()
mask_of_variants = lib.qkv_decode_variants()
for B, H, Hkv, cap, D, start, length, chunk in [
        (1, 1, 1, 1, 1, 0, 1, 0), (2, 6, 2, 37, 33, 5, 37, 4), (1, 9, 3, 700, 64, 0, 690, 0),
        (2, 4, 2, 20, 16, 3, 3, 0), (1, 2, 1, 300, 20, 0, 299, 1)]:
    q = rng.standard_normal((B, H, D), dtype=np.float32)
    mask = (rng.random((B, cap)) > 0.3).astype(np.uint8)
    for fmt in (0, 1):
        keys = np.zeros((B, Hkv, cap, D), np.float16 if fmt == 0 else np.int8)
        values = keys.copy()
        ks, vs = np.zeros((B, Hkv, cap), np.float32), np.zeros((B, Hkv, cap), np.float32)
        for t in range(cap):
            k = rng.standard_normal((B, Hkv, D), dtype=np.float32)
            v = rng.standard_normal((B, Hkv, D), dtype=np.float32)
            lib.qkv_cache_append(fmt, ptr(k), ptr(v), ptr(keys), ptr(values), ptr(ks), ptr(vs),
                                 B, Hkv, cap, D, t)
        kf = keys.astype(np.float64) * (ks[..., None] if fmt else 1)
        vf = values.astype(np.float64) * (vs[..., None] if fmt else 1)
        for variant in range(4):
            if not mask_of_variants >> variant & 1:
                continue
            out, lse = np.empty((B, H, D), np.float32), np.empty((B, H), np.float32)
            scales = (ptr(ks), ptr(vs)) if fmt else (None, None)
            assert lib.qkv_decode_attention(variant, fmt, ptr(q), ptr(keys), ptr(values),
                *scales, ptr(mask), B, H, Hkv, cap, D, start, length, 0.125, chunk, ptr(out),
                ptr(lse), 2) == 0
            for b in range(B):
                for h in range(H):
                    seen = mask[b, start:length] > 0
                    s = kf[b, h // (H // Hkv), start:length] @ q[b, h].astype(np.float64) * 0.125
                    if not seen.any():
                        assert (out[b, h] == 0).all() and lse[b, h] == -math.inf
                        continue
                    e = np.where(seen, np.exp(s - s[seen].max()), 0)
                    want = e @ vf[b, h // (H // Hkv), start:length] / e.sum()
                    assert np.allclose(out[b, h], want, atol=1e-5), (variant, fmt, b, h)
                    assert math.isclose(lse[b, h], s[seen].max() + math.log(e.sum()), abs_tol=1e-4)
print("clean")
"""


def test_the_kernel_is_clean_under_address_and_undefined_behaviour_sanitizers(tmp_path: Path):
    library = native.build(tmp_path, sanitize=True)
    libasan = subprocess.run([native.compiler(), "-print-file-name=libasan.so"],
                             capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    assert Path(libasan).is_file(), f"the compiler has no libasan.so ({libasan})"
    env = {**os.environ, "LD_PRELOAD": libasan, "ASAN_OPTIONS": "detect_leaks=0",
           "UBSAN_OPTIONS": "halt_on_error=1:print_stacktrace=1"}  # fmt: skip
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(SANITIZED), str(library)],
                          capture_output=True, text=True, env=env, timeout=600)  # fmt: skip
    assert done.returncode == 0 and done.stdout.strip() == "clean", done.stderr[-3000:]
    assert "runtime error" not in done.stderr and "AddressSanitizer" not in done.stderr


def test_qkv_native_isa_forces_a_lower_variant(monkeypatch):
    call = good_call()
    for variant in nd.variants():
        monkeypatch.setenv("QKV_NATIVE_ISA", variant)
        forced = nd.decode_attention(**call)
        named = nd.decode_attention(**call, variant=variant)
        assert all(torch.equal(a, b) for a, b in zip(forced, named, strict=True)), variant


def test_a_fresh_process_first_call_on_two_threads_returns():
    """The pool's workers answer the task posted by the call that started them (it once hung
    there: a worker that first ran after the task was posted waited for the next one)."""
    code = (
        "import torch; from qkv.attention import native_decode as nd\n"
        "keys = torch.ones(1, 1, 64, 8).half()\n"
        "for n in (2, 3, 2):\n"
        "    out, lse = nd.decode_attention(torch.ones(1, 2, 8), keys, keys, length=64, chunk=8,"
        " threads=n)\n"
        "    print(*lse.flatten().tolist())\n"
    )
    source = str(Path(nd.__file__).parents[2])
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": source})  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    expected = math.log(64) + 8 / math.sqrt(8)  # 64 equal scores of (1 . 1) / sqrt(8)
    found = [float(x) for x in done.stdout.split()]
    assert len(found) == 6 and all(math.isclose(x, expected, rel_tol=1e-6) for x in found)

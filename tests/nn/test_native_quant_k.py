"""qkv's native K-quant products (qkv/nn/quant_k.c) against llama.cpp's arithmetic redone in
numpy (tests/kquant_blocks.py), against the dequantized matrix, and against each other."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf import quants as gguf_quants

from kquant_blocks import BLOCK_BYTES, q8_k, random_blocks, reference
from qkv import native
from qkv.nn import quant_k
from qkv.nn.quant_k import activations_k, matmul_k, repack_k, variants_k
from qkv.nn.quant_linear import QuantLinear

FORMATS = ("Q4_K", "Q5_K", "Q6_K")
SHAPES = [(37, 256, 1), (70, 512, 3), (5, 768, 40), (16, 256, 2)]  # (N, K, M)


def packed_and_raw(fmt, N, K, seed):
    rng = np.random.default_rng(seed)
    raw = random_blocks(fmt, N, K, rng)
    return repack_k(fmt, torch.from_numpy(raw), N, K), raw, rng


def activations(rng, M, K):
    """Inputs of varied scale per block, one block all zeros (Q8_K's d = 0 case)."""
    x = rng.standard_normal((M, K)).astype(np.float32) * rng.uniform(0.1, 10, (M, 1))
    x = x.astype(np.float32)
    x[0, :256] = 0
    return x


def test_activations_are_llama_cpps_q8_k_bit_for_bit():
    rng = np.random.default_rng(0)
    x = activations(rng, 7, 1024)
    x[1, 5] = -np.abs(x[1, :256]).max() * 2  # a negative largest value: d > 0
    # largest 127: the scale is -1 exactly and every x.5 is a tie, rounded to the even integer
    x[2, 256:512] = (np.arange(256) % 120 - 60 + 0.5).astype(np.float32)
    x[2, 300] = 127
    q, d, bsums = activations_k(torch.from_numpy(x))
    q_ref, d_ref, bsums_ref = q8_k(x)
    assert np.array_equal(q.numpy(), q_ref)
    assert np.array_equal(d.numpy().view(np.uint32), d_ref.view(np.uint32))
    assert np.array_equal(bsums.numpy(), bsums_ref)
    assert d[1, 0] > 0 and d[0, 0] == 0 and (d[3:, 0] < 0).any() and d[2, 1] == -1
    assert q[2, 256 + 60].item() == 0 and q[2, 256 + 61].item() == -2  # -0.5 -> 0, -1.5 -> -2


def test_every_variant_rounds_activations_to_the_same_bytes():
    """The AVX2 rounding (every x86 variant above scalar) against llama.cpp's numpy reference:
    ties, the first of two largest magnitudes of opposite signs, a zero block, and blocks with
    a NaN or an infinity (zeros and d NaN, as the scalar code)."""
    lib = quant_k.kernels()
    rng = np.random.default_rng(1)
    x = activations(rng, 5, 1024)
    x[1, 7], x[1, 200] = 900.0, -900.0  # the first largest is positive: d < 0
    x[1, 300], x[1, 301] = -1100.0, 1100.0  # the first largest is negative: d > 0
    x[2, :256] = (np.arange(256) % 120 - 60 + 0.5).astype(np.float32)  # ties to even
    x[2, 40] = -127
    q_ref, d_ref, bsums_ref = q8_k(x)
    assert d_ref[1, 0] < 0 and d_ref[1, 1] > 0
    bad = x.copy()
    bad[3, 256 + 17], bad[4, 512 + 3] = np.nan, -np.inf
    mask = lib.qkv_quant_variants()
    for variant in range(len(native.VARIANTS)):
        q = np.full(x.shape, 99, np.int8)
        d = np.empty((5, 4), np.float32)
        bsums = np.empty((5, 64), np.int16)
        args = (variant, 5, 1024, q.ctypes.data, d.ctypes.data, bsums.ctypes.data)
        called = lib.qkv_quantk_activations_variant(args[0], x.ctypes.data, *args[1:])
        if not mask >> variant & 1:  # a variant this CPU lacks: refused, nothing written
            assert called == -1 and (q == 99).all()
            continue
        assert called == 0, native.VARIANTS[variant]
        assert np.array_equal(q, q_ref), native.VARIANTS[variant]
        assert np.array_equal(d.view(np.uint32), d_ref.view(np.uint32))
        assert np.array_equal(bsums, bsums_ref)
        assert lib.qkv_quantk_activations_variant(args[0], bad.ctypes.data, *args[1:]) == 0
        assert np.isnan(d[3, 1]) and np.isnan(d[4, 2]) and np.isnan(d).sum() == 2
        assert (q[3, 256:512] == 0).all() and (bsums[4, 32:48] == 0).all()
        assert np.array_equal(q[:3], q_ref[:3]) and np.array_equal(q[3, :256], q_ref[3, :256])


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(("N", "K", "M"), SHAPES)
def test_products_equal_the_float64_reference_of_the_same_arithmetic(fmt, N, K, M):
    packed, raw, rng = packed_and_raw(fmt, N, K, seed=N * K + M)
    x = activations(rng, M, K)
    y = matmul_k(packed, torch.from_numpy(x), variant="scalar", threads=1).numpy()
    expected, magnitude = reference(fmt, raw, K, x)
    # float32 rounding only: a few roundings per super-block, over K / 256 super-blocks
    tolerance = 4 * np.finfo(np.float32).eps * (K // 256 + 2) * magnitude + 1e-30
    assert y.shape == (M, N)
    assert (np.abs(y - expected) <= tolerance).all()


@pytest.mark.parametrize("fmt", FORMATS)
def test_products_are_the_dequantized_product_within_the_activations_rounding(fmt):
    N, K, M = 45, 512, 3
    packed, raw, rng = packed_and_raw(fmt, N, K, seed=3)
    x = activations(rng, M, K)
    gtype = GGMLQuantizationType[fmt]
    W = gguf_quants.dequantize(raw, gtype).reshape(N, K).astype(np.float64)
    if fmt != "Q5_K":  # qkv's own dequantization agrees with gguf's
        from qkv.io.quants import dequantize

        ours = dequantize(torch.from_numpy(raw), gtype, (N, K)).double().numpy()
        assert np.array_equal(ours, W)
    y = matmul_k(packed, torch.from_numpy(x), threads=1).numpy()
    exact = x.astype(np.float64) @ W.T
    _, d, _ = q8_k(x)
    half_step = np.repeat(np.abs(d.astype(np.float64)) / 2, 256, axis=1)  # (M, K)
    bound = half_step @ np.abs(W).T  # each input moved at most half a step
    assert (np.abs(y - exact) <= bound * 1.001 + 1e-5 * np.abs(exact).max()).all()
    assert np.abs(y - exact).max() < 0.05 * np.abs(exact).max()


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(("N", "K", "M"), SHAPES)
def test_every_variant_agrees_with_the_scalar_one_bit_for_bit(fmt, N, K, M):
    packed, _, rng = packed_and_raw(fmt, N, K, seed=N + K + M)
    x = torch.from_numpy(activations(rng, M, K))
    bias = torch.randn(N)
    scalar = matmul_k(packed, x, bias, variant="scalar", threads=1)
    having = variants_k()
    assert "scalar" in having and len(having) >= 2  # x86-64: AVX2 at least on these machines
    for name in having:
        got = matmul_k(packed, x, bias, variant=name, threads=1)
        assert torch.equal(got.view(torch.int32), scalar.view(torch.int32)), name
    assert torch.equal(scalar, matmul_k(packed, x, variant="scalar", threads=1) + bias)
    layer = quant_k.product_k(packed, bias, variant="scalar", threads=1)  # checked once
    assert torch.equal(layer(x), scalar) and torch.equal(layer(x[:1]), scalar[:1])


def test_threads_share_panels_and_agree_bit_for_bit():
    """Several threads in a subprocess with a time limit: a pool that never answers fails the
    test instead of hanging the suite."""
    script = (
        "import torch, numpy as np\n"
        "from kquant_blocks import random_blocks\n"
        "from qkv.nn.quant_k import repack_k, matmul_k\n"
        "rng = np.random.default_rng(5)\n"
        "for fmt in ('Q4_K', 'Q6_K'):\n"
        "    raw = torch.from_numpy(random_blocks(fmt, 83, 512, rng))\n"
        "    p = repack_k(fmt, raw, 83, 512)\n"
        "    x = torch.randn(3, 512)\n"
        "    one = matmul_k(p, x, threads=1)\n"
        "    for n in (2, 3, 8):\n"
        "        assert torch.equal(matmul_k(p, x, threads=n), one), n\n"
    )
    paths = [str(Path(quant_k.__file__).parents[2]), str(Path(__file__).parents[1])]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths))
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]


def test_rows_past_n_are_never_written():
    N, K, M = 21, 256, 2
    packed, _, rng = packed_and_raw("Q4_K", N, K, seed=9)
    lib = quant_k.kernels()
    x = torch.from_numpy(activations(rng, M, K))
    y = torch.full((M * N + 64,), 7.25)  # 64 floats past y's end, where a panel's rows would go
    work = torch.empty(lib.qkv_quantk_work_bytes(M, K), dtype=torch.uint8)
    assert lib.qkv_quantk_matmul(0, 0, packed["panels"].data_ptr(), None, N, K, x.data_ptr(), M,
                                 y.data_ptr(), work.data_ptr(), 1) == 0  # fmt: skip
    assert (y[M * N :] == 7.25).all()
    assert torch.equal(y[: M * N].view(M, N), matmul_k(packed, x, variant="scalar", threads=1))
    assert lib.qkv_quantk_matmul(0, 7, packed["panels"].data_ptr(), None, N, K, x.data_ptr(), M,
                                 y.data_ptr(), work.data_ptr(), 1) == -1  # fmt: skip


def test_hostile_shapes_are_refused_before_any_c_call():
    packed, raw, _ = packed_and_raw("Q4_K", 20, 512, seed=1)
    raw = torch.from_numpy(raw)
    x = torch.randn(2, 512)
    refusals = [
        (lambda: repack_k("Q3_K", raw, 20, 512), "formats are"),
        (lambda: repack_k("Q4_K", raw, 20, 500), "multiple of 256"),
        (lambda: repack_k("Q4_K", raw, 20, 0), "multiple of 256"),
        (lambda: repack_k("Q4_K", raw, 0, 512), "at least one row"),
        (lambda: repack_k("Q4_K", raw, 21, 512), r"\(21, 288\) bytes"),
        (lambda: repack_k("Q4_K", raw[:, :-1], 20, 512), "not"),
        (lambda: repack_k("Q4_K", raw.to(torch.int16), 20, 512), "uint8"),
        (lambda: matmul_k(packed, torch.randn(2, 256)), r"\(M, 512\)"),
        (lambda: matmul_k(packed, torch.randn(512)), r"\(M, 512\)"),
        (lambda: matmul_k(packed, x.double()), "float32"),
        (lambda: matmul_k(packed, x, bias=torch.zeros(19)), r"bias of \(20,\)"),
        (lambda: matmul_k(packed, x, bias=torch.zeros(20).double()), "float32"),
        (lambda: matmul_k(packed, x, variant="sse9"), "none of"),
        (lambda: matmul_k(packed, x, variant=17), "none of"),
        (lambda: matmul_k(packed, x, threads=0), "positive"),
        (lambda: matmul_k({**packed, "N": 40}, x), "panels of a Q4_K"),
        (lambda: matmul_k({**packed, "K": 768}, torch.randn(2, 768)), "panels of a Q4_K"),
        (lambda: matmul_k({**packed, "panels": packed["panels"][:-1]}, x), "panels of"),
        (lambda: matmul_k({**packed, "fmt": "Q6_K"}, x), "panels of a Q6_K"),
        (lambda: matmul_k({"panels": packed["panels"]}, x), "what repack_k returned"),
        (lambda: activations_k(torch.randn(2, 300)), "multiple of 256"),
    ]
    for call, message in refusals:
        with pytest.raises(ValueError, match=message):
            call()
    assert matmul_k(packed, torch.empty(0, 512)).shape == (0, 20)


def test_a_variant_this_cpu_lacks_is_refused_by_name():
    missing = [v for v in quant_k.VARIANTS if v not in variants_k()]
    for name in missing:
        packed, _, _ = packed_and_raw("Q6_K", 16, 256, seed=2)
        with pytest.raises(ValueError, match="does not run the variant"):
            matmul_k(packed, torch.randn(1, 256), variant=name)
    assert set(missing) | set(variants_k()) == set(quant_k.VARIANTS)


SANITIZED = """
import ctypes, sys
import numpy as np
from kquant_blocks import random_blocks, reference
lib = ctypes.CDLL(sys.argv[1])
p, i64 = ctypes.c_void_p, ctypes.c_int64
for name, res, args in [("qkv_quantk_panel_bytes", i64, [ctypes.c_int, i64, i64]),
                        ("qkv_quantk_repack", None, [ctypes.c_int, p, i64, i64, p]),
                        ("qkv_quantk_work_bytes", i64, [i64, i64]),
                        ("qkv_quantk_variants", ctypes.c_int, []),
                        ("qkv_quantk_matmul", ctypes.c_int, [ctypes.c_int, ctypes.c_int, p, p,
                          i64, i64, p, i64, p, p, ctypes.c_int])]:
    getattr(lib, name).restype = res
    getattr(lib, name).argtypes = args
rng = np.random.default_rng(4)
mask = lib.qkv_quantk_variants()
ptr = lambda a: a.ctypes.data
for code, fmt in enumerate(("Q4_K", "Q5_K", "Q6_K")):
    for N, K, M in ((21, 256, 1), (5, 512, 3), (33, 256, 34)):
        raw = random_blocks(fmt, N, K, rng)
        panels = np.empty(lib.qkv_quantk_panel_bytes(code, N, K), np.uint8)
        lib.qkv_quantk_repack(code, ptr(raw), N, K, ptr(panels))
        x = rng.standard_normal((M, K)).astype(np.float32)
        bias = rng.standard_normal(N).astype(np.float32)
        work = np.empty(lib.qkv_quantk_work_bytes(M, K), np.uint8)
        results = []
        for variant in range(5):
            if mask >> variant & 1:
                y = np.empty((M, N), np.float32)  # exactly M * N floats: ASan sees overruns
                assert lib.qkv_quantk_matmul(variant, code, ptr(panels), ptr(bias), N, K,
                                             ptr(x), M, ptr(y), ptr(work), 1) == 0
                results.append(y)
        assert all(np.array_equal(r, results[0]) for r in results), fmt
        expected, magnitude = reference(fmt, raw, K, x)
        assert (np.abs(results[0] - bias - expected) <= 1e-5 * magnitude + 1e-6).all()
print("clean", len(results))
"""


def test_the_kernels_run_clean_under_address_and_undefined_behaviour_sanitizers(tmp_path):
    library = native.build(tmp_path, sanitize=True)
    asan = subprocess.run(["gcc", "-print-file-name=libasan.so"], capture_output=True,
                          text=True, check=True).stdout.strip()  # fmt: skip
    env = dict(os.environ, LD_PRELOAD=asan, ASAN_OPTIONS="detect_leaks=0",
               UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1",
               PYTHONPATH=str(Path(__file__).parents[1]))  # fmt: skip
    done = subprocess.run([sys.executable, "-c", SANITIZED, str(library)], env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0 and "clean" in done.stdout, done.stderr[-3000:]
    assert "runtime error" not in done.stderr and "AddressSanitizer" not in done.stderr


def extreme_blocks(fmt: str, N: int, K: int) -> np.ndarray:
    """Blocks whose every product with an input of -127 is as large as the format allows:
    Q4_K's and Q5_K's integers 15 and 31 with scales and minimums 63, Q6_K's 0 (0 - 32) with
    scales -128; small positive float16 scales."""
    nsb = K // 256
    raw = np.full((N, nsb, BLOCK_BYTES[fmt]), 0xFF, dtype=np.uint8)
    small = np.full((N, nsb, 2), 1e-3, np.float16).view(np.uint8).reshape(N, nsb, 4)
    if fmt == "Q6_K":
        raw[:, :, :192] = 0  # ql, qh: every integer 0
        raw[:, :, 192:208] = 0x80  # int8 scales -128
        raw[:, :, 208:210] = small[:, :, :2]
    else:
        raw[:, :, :4] = small  # d, dmin; the scale bytes and the integers stay all ones
    return raw.reshape(N, -1)


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_largest_sums_a_format_allows_stay_exact_in_every_variant(fmt):
    """Every input rounding to -127 against the largest integers and scales: AVX2 sums a
    sub-block's products in 16 bits (30,480, 31,496 and 32,512 here, of 32,767): the float64
    reference of exact integers, and every variant bit for bit."""
    N, K, M = 32, 512, 3
    raw = extreme_blocks(fmt, N, K)
    packed = repack_k(fmt, torch.from_numpy(raw), N, K)
    x = np.full((M, K), -1.0, np.float32)
    x[1] *= 3.5  # every block's largest: all of them -127
    x[2, ::2] = 1.0  # half the products of the other sign
    q, _, _ = q8_k(x)
    assert (q[:2] == -127).all()
    want, magnitude = reference(fmt, raw, K, x)
    scalar = matmul_k(packed, torch.from_numpy(x), variant="scalar", threads=1)
    tolerance = 4 * np.finfo(np.float32).eps * (K // 256 + 2) * magnitude
    assert (np.abs(scalar.numpy() - want) <= tolerance).all()
    for name in variants_k():
        got = matmul_k(packed, torch.from_numpy(x), variant=name, threads=2)
        assert torch.equal(got.view(torch.int32), scalar.view(torch.int32)), name


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_nan_or_infinite_input_gives_nan_outputs_not_numbers(fmt, bad):
    """As quant.c's products: the row that held it all NaN (llama.cpp rounds a NaN to some
    integer and returns a number), the other rows untouched; in one part and in two."""
    N, K = 20, 512
    packed, raw, rng = packed_and_raw(fmt, N, K, seed=5)
    x = torch.from_numpy(activations(rng, 3, K))
    clean = matmul_k(packed, x, variant="scalar", threads=1)
    x[1, 300] = bad
    for name in variants_k():
        y = matmul_k(packed, x, variant=name, threads=1)
        assert torch.isnan(y[1]).all(), name
        assert torch.equal(y[[0, 2]], clean[[0, 2]]), name
    layer = QuantLinear(fmt, torch.from_numpy(raw), K, parts=2)
    y = layer(x)
    assert torch.isnan(y[1]).all() and torch.isfinite(y[[0, 2]]).all()

"""qkv's native products of GGUF blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) by 8-bit activations
(`qkv/nn/quant.c` through `QuantLinear`): every variant this CPU runs, the lower ones forced,
agrees with the scalar one bit for bit; the 8-bit activations equal a numpy version of
llama.cpp's rounding bit for bit; the products equal a float64 reference of the same
integers, and follow x @ W.T within the activations' rounding; hostile shapes are refused
before any C call; an ASan/UBSan build runs clean."""

from __future__ import annotations

import textwrap
import threading

import gguf
import numpy as np
import pytest
import torch

from qkv import native
from qkv.nn.quant_linear import FORMATS, QuantLinear, cores_to_the_kernels, kernels
from sanitized import run_sanitized

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def raw_blocks(fmt: str, N: int, K: int, rng) -> np.ndarray:
    """N rows of random blocks in the file's byte layout (full ranges of the integers)."""
    nb, size = K // 32, FORMATS[fmt][1]
    raw = np.zeros((N, nb, size), np.uint8)
    d = (rng.random((N, nb)) * 0.02 + 1e-4).astype(np.float16)
    raw[:, :, 0:2] = d.view(np.uint8).reshape(N, nb, 2)
    if fmt in ("Q4_1", "Q5_1"):
        m = (-rng.random((N, nb)) * 0.1).astype(np.float16)
        raw[:, :, 2:4] = m.view(np.uint8).reshape(N, nb, 2)
    start = START[fmt]
    raw[:, :, start:] = rng.integers(0, 256, (N, nb, size - start))
    return raw.reshape(N, -1)


START = {"Q4_0": 2, "Q4_1": 4, "Q8_0": 2, "Q5_0": 2, "Q5_1": 4}  # where a block's integers are


def integers(fmt: str, blocks: np.ndarray) -> np.ndarray:
    """The weights' integers (N, nb, 32) of blocks (N, nb, bytes), as ggml's dequantization
    reads them: Q8_0's bytes; Q4's nibbles (a byte's low one column j, its high one 16 + j),
    less 8 for Q4_0; Q5's the same with bit j of the 4 bytes before them as column j's
    fifth, less 16 for Q5_0."""
    qs = blocks[:, :, START[fmt] :]
    if fmt == "Q8_0":
        return qs.copy().view(np.int8).astype(np.int64)
    if fmt in ("Q5_0", "Q5_1"):
        high = qs[:, :, :4].copy().view("<u4").astype(np.int64)  # (N, nb, 1)
        qs = qs[:, :, 4:]
    w = np.concatenate([qs & 15, qs >> 4], -1).astype(np.int64)
    if fmt in ("Q5_0", "Q5_1"):
        w |= (high >> np.arange(32) & 1) << 4
    return w - {"Q4_0": 8, "Q5_0": 16}.get(fmt, 0)


def quantized(x: np.ndarray):
    """llama.cpp's Q8_0/Q8_1 rounding of x (M, K) float32, in numpy: q, d, s per block."""
    blocks = x.reshape(-1, 32)
    scale = np.abs(blocks).max(-1) / np.float32(127)
    inverse = np.where(scale != 0, np.float32(1) / np.where(scale != 0, scale, 1), 0)
    t = (blocks * inverse[:, None].astype(np.float32)).astype(np.float64)
    q = (np.sign(t) * np.floor(np.abs(t) + 0.5)).astype(np.int64)  # roundf: half away from 0
    sums = q.sum(-1)
    d = scale.astype(np.float16).astype(np.float64)
    s = (scale * sums.astype(np.float32)).astype(np.float16).astype(np.float64)
    return q, d, s


def reference(fmt: str, raw: np.ndarray, K: int, x: np.ndarray) -> np.ndarray:
    """sum over blocks of (d_w d_x) isum (+ m_w s_x), in float64 from the raw bytes."""
    N, nb = raw.shape[0], K // 32
    blocks = raw.reshape(N, nb, -1)
    d_w = blocks[:, :, :2].copy().view(np.float16)[..., 0].astype(np.float64)
    w = integers(fmt, blocks)
    q, d_x, s_x = quantized(x)
    M = x.shape[0]
    isum = np.einsum("nbj,mbj->mnb", w, q.reshape(M, nb, 32))  # exact integers
    y = (d_w[None] * d_x.reshape(M, 1, nb) * isum).sum(-1)
    if fmt in ("Q4_1", "Q5_1"):
        m_w = blocks[:, :, 2:4].copy().view(np.float16)[..., 0].astype(np.float64)
        y += (m_w[None] * s_x.reshape(M, 1, nb)).sum(-1)
    return y


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_every_variant_agrees_bit_for_bit_and_with_the_float64_reference(fmt):
    rng = np.random.default_rng()
    seed = int(rng.integers(1 << 30))
    rng = np.random.default_rng(seed)
    for N, K, M in ((37, 64, 1), (192, 576, 3), (20, 1536, 40)):
        raw = raw_blocks(fmt, N, K, rng)
        bias = torch.from_numpy(rng.standard_normal(N).astype(np.float32)) if M == 3 else None
        layer = QuantLinear(fmt, torch.from_numpy(raw), K, bias)
        x = torch.from_numpy(rng.standard_normal((M, K)).astype(np.float32))
        outs = {name: layer.product(native.VARIANTS.index(name), threads)(x)
                for name in native.variants() for threads in (1, 2)}  # fmt: skip
        base = layer.product(0, 1)(x)
        for name, y in outs.items():
            assert torch.equal(y, base), f"{name} differs from scalar ({fmt}, seed {seed})"
        want = reference(fmt, raw, K, x.numpy()) + (0 if bias is None else bias.numpy())
        # float32's rounding of at most 48 blocks' terms: far under 2e-5 of the largest output
        err = np.abs(base.numpy() - want).max() / np.abs(want).max()
        assert err < 2e-5, f"{fmt} seed {seed}: {err:.2e}"
        assert torch.equal(layer(x[None])[0], outs[native.variants()[-1]])


def dequantized(fmt: str, raw: np.ndarray, K: int) -> np.ndarray:
    """The file's matrix (N, K) in float64: each row times the unit vectors, by `reference`
    with inputs that round exactly (one 127 a block, the rest 0)."""
    eye = np.eye(K, dtype=np.float32) * 127
    return reference(fmt, raw, K, eye).T / 127


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_the_reference_reads_blocks_as_the_gguf_package_does(fmt):
    """`integers` and `reference` (the float64 side of these tests) against gguf-py's own
    dequantization of the same bytes: the reference is not qkv's reading of the format."""
    rng = np.random.default_rng()
    N, K = 24, 96
    raw = raw_blocks(fmt, N, K, rng)
    theirs = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[fmt]).astype(np.float64)
    assert theirs.shape == (N, K)
    ours = dequantized(fmt, raw, K)  # float64: gguf's float32 rounds d * q + m once
    assert np.allclose(ours, theirs, rtol=1e-6, atol=1e-7), np.abs(ours - theirs).max()


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_two_parts_are_two_llama_cpp_products_summed_and_hold_the_inputs_finer(fmt):
    """parts=2: the input rounded, then what that left rounded; the two products of the
    float64 reference summed (float32 apart), every variant bit for bit; and against the
    file's matrix times the unrounded input, 1/20 of one part's error at the most."""
    seed = int(np.random.default_rng().integers(1 << 30))
    rng = np.random.default_rng(seed)
    N, K, M = 40, 192, 3
    raw = raw_blocks(fmt, N, K, rng)
    bias = torch.from_numpy(rng.standard_normal(N).astype(np.float32))
    one = QuantLinear(fmt, torch.from_numpy(raw), K, bias)
    two = QuantLinear(fmt, torch.from_numpy(raw), K, bias, parts=2)
    x = torch.from_numpy((rng.standard_normal((M, K)) * np.exp(rng.standard_normal((M, K))))
                         .astype(np.float32))  # fmt: skip
    outs = [two.product(native.VARIANTS.index(name), threads)(x)
            for name in native.variants() for threads in (1, 2)]  # fmt: skip
    assert all(torch.equal(y, outs[0]) for y in outs)
    xn = x.numpy()
    q, d, _ = quantized(xn)
    left = xn - (d.astype(np.float32)[:, None] * q.astype(np.float32)).reshape(M, K)
    want = reference(fmt, raw, K, xn) + reference(fmt, raw, K, left) + bias.numpy()
    assert np.abs(outs[0].numpy() - want).max() / np.abs(want).max() < 2e-5
    exact = xn.astype(np.float64) @ dequantized(fmt, raw, K).T + bias.numpy()
    err_one = np.abs(one(x).numpy() - exact).max()
    err_two = np.abs(outs[0].numpy() - exact).max()
    # measured 1/39 to 1/120 (the second part's rounding is 1/254 of the first's; the worst
    # outputs' terms partly cancel)
    assert err_two < err_one / 20, f"two parts: {err_two:.2e}, one: {err_one:.2e} (seed {seed})"
    with pytest.raises(ValueError, match="1 or 2 parts"):
        QuantLinear(fmt, torch.from_numpy(raw), K, parts=3)


def test_activations_round_as_llama_cpp_does():
    """Every variant's rounding of activations (scalar, AVX2 where the CPU has it) gives the
    bytes, scales and sums of a numpy version of llama.cpp's: halves away from zero, an
    all-zero block, a negative largest value, scales past float16's range either way."""
    lib = kernels()
    seed = int(np.random.SeedSequence().entropy % 2**32)
    print(f"seed {seed}")
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((6, 96)) * rng.random((6, 1)) * 10).astype(np.float32)
    x[0, :32] = 0  # an all-zero block: scale 0, bytes 0
    x[1, 3] = -x[1].__abs__().max() * 2  # the largest is negative
    x[2, :32] = rng.integers(-126, 126, 32) + 0.5  # scale 1 exactly: every product a half
    x[2, 0] = 127
    x[3, 32:64] = -x[2, :32]
    x[4, 64:] *= 1e-5  # a scale below float16's normal numbers
    x[5, :32] *= 1e5  # d near float16's largest, s (d times the bytes' sum) most often past it
    with np.errstate(over="ignore"):  # s past float16's range: infinite, as the cast makes it
        want_q, want_d, want_s = quantized(x)
    assert np.abs(want_q[6] - x[2, :32]).max() == 0.5  # block 6 (row 2): halves to round
    variants = [v for v in range(4) if lib.qkv_quant_variants() >> v & 1]
    for variant in variants:
        q = np.empty(x.shape, np.int8)
        d, s = np.empty(18, np.float32), np.empty(18, np.float32)
        sums = np.empty(18, np.int32)
        assert lib.qkv_quant_activations_variant(variant, x.ctypes.data, 6, 96, q.ctypes.data,
                                                 d.ctypes.data, s.ctypes.data,
                                                 sums.ctypes.data) == 0  # fmt: skip
        assert np.array_equal(q.reshape(-1, 32), want_q), f"variant {variant}"
        assert np.array_equal(d, want_d.astype(np.float32)) and np.array_equal(s, want_s)
        assert np.array_equal(sums, want_q.sum(-1))
    missing = next((v for v in range(4) if not lib.qkv_quant_variants() >> v & 1), None)
    if missing is not None:  # a variant this CPU lacks is refused, nothing written
        assert lib.qkv_quant_activations_variant(missing, x.ctypes.data, 6, 96, 0, 0, 0, 0) == -1


def test_nan_inputs_give_nan_outputs_not_garbage():
    raw = torch.from_numpy(raw_blocks("Q4_1", 16, 64, np.random.default_rng(0)))
    layer = QuantLinear("Q4_1", raw, 64)
    x = torch.randn(2, 64)
    x[1, 5] = float("nan")
    y = layer(x)
    assert torch.isfinite(y[0]).all() and torch.isnan(y[1]).all()


def test_a_prompts_cores_are_its_own_threads_and_torchs_count_comes_back(monkeypatch):
    """Within cores_to_the_kernels a forward's products take every core; another thread's
    products meanwhile take one (the setting is the context's, not the module's), and torch's
    thread count is as it was afterwards."""
    raw = torch.from_numpy(raw_blocks("Q4_1", 16, 64, np.random.default_rng(0)))
    layer = QuantLinear("Q4_1", raw, 64)
    x = torch.randn(3, 64)
    seen = []
    product = QuantLinear.product

    def noted(self, variant_index=None, threads=None):
        seen.append(threads)
        return product(self, variant_index, threads)

    monkeypatch.setattr(QuantLinear, "product", noted)
    before = torch.get_num_threads()
    with cores_to_the_kernels():
        assert torch.get_num_threads() == 1
        mine = layer(x)
        other = threading.Thread(target=layer, args=(x,))
        other.start()
        other.join()
    assert torch.get_num_threads() == before
    assert torch.equal(layer(x), mine)  # the threads share the panels: the same numbers
    assert seen == [native.threads(), 1, 1]


@pytest.mark.parametrize("total", [1, 2, 7, 80, 3072, 100_003])
@pytest.mark.parametrize(("nth", "present"), [(1, 0), (2, 0), (2, 1), (4, 1), (5, 3), (70, 2),
                                              (70, 70)])  # fmt: skip
def test_every_panel_is_taken_once_by_whichever_threads_come(total, nth, present):
    """The panels of a task (qkv_runs in qkv_native.h): each thread its run, then the backs of
    the others'. Every panel is taken exactly once, by the pool's threads at once (present 0)
    or by only some of the threads the panels were cut for, one after another (a pool that runs
    fewer than asked for; 70 is past the 64 threads that have runs of their own). The pool runs
    2 threads here: more would be kept, spinning, for the rest of the tests."""
    lib = native.library()
    count = torch.zeros(total, dtype=torch.int32)
    cut_for = lib.qkv_runs_check(total, nth, present, count.data_ptr())
    assert cut_for == min(nth, total)
    assert torch.equal(count, torch.ones(total, dtype=torch.int32))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("Q2_K", torch.zeros(4, 84, dtype=torch.uint8), 256), "holds Q4_0"),
        (("Q4_1", torch.zeros(4, 20, dtype=torch.uint8), 48), "blocks of 32"),
        (("Q4_1", torch.zeros(4, 21, dtype=torch.uint8), 32), "hold 20 bytes"),
        (("Q4_1", torch.zeros(4, 20, dtype=torch.int8), 32), "uint8"),
        (("Q4_1", torch.zeros(0, 20, dtype=torch.uint8), 32), "uint8"),
        (("Q8_0", torch.zeros(4, 34, dtype=torch.uint8), 32, torch.zeros(5)), "bias of"),
    ],
)
def test_hostile_layers_are_refused(args, message):
    with pytest.raises(ValueError, match=message):
        QuantLinear(*args)


def test_hostile_inputs_are_refused():
    layer = QuantLinear("Q8_0", torch.zeros(4, 34, dtype=torch.uint8), 32)
    with pytest.raises(ValueError, match="takes 32 inputs"):
        layer(torch.zeros(2, 33))
    with pytest.raises(ValueError, match="float inputs"):
        layer(torch.zeros(2, 32, dtype=torch.long))


def test_the_kernels_run_clean_under_sanitizers(tmp_path):
    """ASan and UBSan around every format and variant, in a process without torch (numpy and
    ctypes), the sanitizers' runtime preloaded."""
    built = native.build(tmp_path, sanitize=True)
    script = textwrap.dedent(f"""
        import ctypes, numpy as np
        lib = ctypes.CDLL({str(built)!r})
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        lib.qkv_quant_repack.argtypes = [ctypes.c_int, p, i64, i64, p, p, p]
        lib.qkv_quant_matmul.argtypes = [ctypes.c_int] * 2 + [p] * 4 + [i64, i64, p, i64,
                                                                        ctypes.c_int, p, p,
                                                                        ctypes.c_int]
        lib.qkv_quant_work_bytes.restype = i64
        lib.qkv_quant_work_bytes.argtypes = [i64, i64, i64, ctypes.c_int]
        rng = np.random.default_rng(0)
        mask = lib.qkv_quant_variants()
        # (code, bytes of a file's block, bytes of a panel block): Q4_0, Q4_1, Q8_0, Q5_0, Q5_1
        for code, size, each in ((0, 18, 256), (1, 20, 256), (2, 34, 512), (3, 22, 320),
                                 (4, 24, 320)):
            for N, K, M in ((17, 64, 1), (40, 96, 5)):
                raw = rng.integers(0, 256, (N, K // 32 * size)).astype(np.uint8)
                raw.reshape(N, -1, size)[:, :, 1] = 0x2c  # finite float16 scales
                raw.reshape(N, -1, size)[:, :, 3 if code in (1, 4) else 1] = 0x2c
                P = (N + 15) // 16 * (K // 32)
                panels = np.empty(P * each, np.uint8)
                sc, mi = np.empty(P * 16, np.float32), np.empty(P * 16, np.float32)
                lib.qkv_quant_repack(code, raw.ctypes.data, N, K, panels.ctypes.data,
                                     sc.ctypes.data, mi.ctypes.data)
                x = rng.standard_normal((M, K)).astype(np.float32)
                bias = rng.standard_normal(N).astype(np.float32)
                for parts in (1, 2):
                    work = np.empty(lib.qkv_quant_work_bytes(M, K, N, parts), np.uint8)
                    outs = []
                    for v in range(4):
                        if mask >> v & 1:
                            y = np.empty((M, N), np.float32)
                            assert lib.qkv_quant_matmul(v, code, panels.ctypes.data,
                                sc.ctypes.data, mi.ctypes.data, bias.ctypes.data, N, K,
                                x.ctypes.data, M, parts, y.ctypes.data, work.ctypes.data,
                                2) == 0
                            outs.append(y)
                    assert all(np.array_equal(o, outs[0]) for o in outs)
        print("clean")
    """)
    run_sanitized(script)

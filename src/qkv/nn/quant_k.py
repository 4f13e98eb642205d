"""A GGUF file's K-quant matrices (Q4_K, Q5_K, Q6_K) times 8-bit activations, as llama.cpp
multiplies them, with qkv's native kernels (`qkv/nn/quant_k.c`).

The activations are rounded to llama.cpp's Q8_K (a float32 scale per 256 inputs, int8 values,
and the sums of each 16); the weights' own 4-, 5- or 6-bit integers times those bytes are
summed exactly in 32 bits, scaled per sub-block by the file's 6- or 8-bit scales, and each
super-block's sum is scaled once in float32: y += (d_w * d_x) * isum (- (dmin_w * d_x) * summ,
the minimums' part, for Q4_K and Q5_K). The weights are repacked once into panels of 16 rows
(`repack_k`), then multiplied as often as needed (`matmul_k`):

    packed = repack_k("Q4_K", raw, N=1536, K=768)  # raw: (1536, 3 * 144) uint8
    y = matmul_k(packed, x)  # x (M, 768) float32 -> y (M, 1536)

Every argument is checked here, before any C call: the kernels trust what they are given.
"""

from __future__ import annotations

import ctypes
import functools

import torch
from torch import Tensor

from qkv import native

# format -> (the C kernels' number for it, bytes of one super-block of 256 weights in the file)
FORMATS = {"Q4_K": (0, 144), "Q5_K": (1, 176), "Q6_K": (2, 210)}
SUPER = 256  # columns per super-block
ROWS = 16  # rows per panel
# AVX-VNNI's 256-bit code in AVX-512 VNNI's encoding: runs where AVX-512 VNNI is, so that the
# tests check that code on CPUs without AVX-VNNI; never chosen by itself
TWIN = "avx_vnni_evex"
VARIANTS = (*native.VARIANTS, TWIN)


@functools.cache
def _typed(lib):
    """The library with the K-quant functions typed (once a process)."""
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    native.declare(lib, "qkv_quantk_panel_bytes", i64, i32, i64, i64)
    native.declare(lib, "qkv_quantk_repack", None, i32, p, i64, i64, p)
    native.declare(lib, "qkv_quantk_activations", None, p, i64, i64, p, p, p)
    native.declare(lib, "qkv_quantk_activations_variant", i32, i32, p, i64, i64, p, p, p)
    native.declare(lib, "qkv_quantk_matmul", i32, i32, i32, p, p, i64, i64, p, i64, p, p, i32)
    native.declare(lib, "qkv_quantk_work_bytes", i64, i64, i64)
    native.declare(lib, "qkv_quantk_variants", i32)
    return lib


def kernels():
    """The typed native library; a ValueError naming why where there is none."""
    lib = native.library()
    if lib is None:
        raise ValueError(f"K-quant products need qkv's native kernels: {native.why_not()}")
    return _typed(lib)


def variants_k() -> tuple[str, ...]:
    """The variants this CPU runs, lowest first, the twin of AVX-VNNI's code included."""
    mask = kernels().qkv_quantk_variants()
    return tuple(name for i, name in enumerate(VARIANTS) if mask >> i & 1)


def _check_K(K: int) -> None:
    if not isinstance(K, int) or K < SUPER or K % SUPER:
        raise ValueError(f"K-quant rows hold super-blocks of {SUPER} columns; K={K!r} is not a "
                         f"positive multiple of {SUPER}")  # fmt: skip


def panel_bytes(fmt_name: str, N: int, K: int) -> int:
    """Bytes of the panels `repack_k` makes of an (N, K) matrix of format `fmt_name`."""
    return kernels().qkv_quantk_panel_bytes(FORMATS[fmt_name][0], N, K)


def repack_k(fmt_name: str, raw: Tensor, N: int, K: int) -> dict:
    """A GGUF K-quant matrix W (N, K) repacked for `matmul_k`.

    raw: (N, K / 256 * block bytes) uint8, each row's super-blocks as the file holds them
    (Q4_K 144 bytes, Q5_K 176, Q6_K 210). Returns {"fmt": name, "N": N, "K": K, "panels":
    uint8 tensor}: ceil(N / 16) panels of 16 rows, about the file's own size.
    """
    if fmt_name not in FORMATS:
        raise ValueError(f"K-quant formats are {', '.join(FORMATS)}, not {fmt_name!r}")
    code, block = FORMATS[fmt_name]
    _check_K(K)
    if not isinstance(N, int) or N < 1:
        raise ValueError(f"a matrix has at least one row; N={N!r}")
    if not isinstance(raw, Tensor) or raw.dtype != torch.uint8 or raw.device.type != "cpu":
        raise ValueError(f"{fmt_name} blocks come as a uint8 CPU tensor, got "
                         f"{getattr(raw, 'dtype', type(raw).__name__)}")  # fmt: skip
    row_bytes = K // SUPER * block
    if tuple(raw.shape) != (N, row_bytes):
        raise ValueError(f"{N} {fmt_name} rows of {K} columns are ({N}, {row_bytes}) bytes, "
                         f"not {tuple(raw.shape)}")  # fmt: skip
    lib = kernels()
    raw = raw.contiguous()
    panels = torch.empty(lib.qkv_quantk_panel_bytes(code, N, K), dtype=torch.uint8)
    lib.qkv_quantk_repack(code, raw.data_ptr(), N, K, panels.data_ptr())
    return {"fmt": fmt_name, "N": N, "K": K, "panels": panels}


def _check_x(x: Tensor, K: int) -> Tensor:
    if not isinstance(x, Tensor) or x.dim() != 2 or x.shape[1] != K:
        raise ValueError(f"x must be (M, {K}), got {tuple(getattr(x, 'shape', ()))}")
    if x.dtype != torch.float32 or x.device.type != "cpu":
        raise ValueError(f"x must be float32 on the CPU, got {x.dtype} on {x.device.type}")
    return x.contiguous()


def activations_k(x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """x (M, K) float32 rounded as llama.cpp's Q8_K: q (M, K) int8, d (M, K / 256) float32
    (negative where a block's largest value is positive: that value becomes -127), bsums
    (M, K / 16) int16, the sums of each 16 q. x ~ q * d per block of 256."""
    K = x.shape[-1] if isinstance(x, Tensor) and x.dim() == 2 else -1
    x = _check_x(x, K)
    _check_K(K)
    M, K = x.shape
    q = torch.empty(M, K, dtype=torch.int8)
    d = torch.empty(M, K // SUPER)
    bsums = torch.empty(M, K // 16, dtype=torch.int16)
    if M:
        kernels().qkv_quantk_activations(x.data_ptr(), M, K, q.data_ptr(), d.data_ptr(),
                                         bsums.data_ptr())  # fmt: skip
    return q, d, bsums


def _variant_index(variant: int | str | None, lib) -> int:
    mask = lib.qkv_quantk_variants()
    if variant is None:
        return native.chosen_variant(lib)[0]
    index = VARIANTS.index(variant) if variant in VARIANTS else variant
    if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < len(VARIANTS):
        raise ValueError(f"variant {variant!r} is none of {', '.join(VARIANTS)}")
    if not mask >> index & 1:
        raise ValueError(f"this CPU does not run the variant {VARIANTS[index]!r}; it runs "
                         f"{', '.join(variants_k())}")  # fmt: skip
    return index


def product_k(
    packed: dict,
    bias: Tensor | None = None,
    variant: int | str | None = None,
    threads: int | None = None,
):
    """The product with W (and bias, variant, threads) fixed, checked once: a function of x
    (M, K) float32 -> y (M, N), for a layer called many times a token (it checks only x).
    Arguments as `matmul_k`'s."""
    if not isinstance(packed, dict) or set(packed) != {"fmt", "N", "K", "panels"}:
        raise ValueError("packed must be what repack_k returned: fmt, N, K and panels")
    fmt_name, N, K, panels = packed["fmt"], packed["N"], packed["K"], packed["panels"]
    if fmt_name not in FORMATS:
        raise ValueError(f"K-quant formats are {', '.join(FORMATS)}, not {fmt_name!r}")
    _check_K(K)
    if not isinstance(N, int) or N < 1:
        raise ValueError(f"a matrix has at least one row; N={N!r}")
    lib = kernels()
    code = FORMATS[fmt_name][0]
    size = lib.qkv_quantk_panel_bytes(code, N, K)
    if (not isinstance(panels, Tensor) or panels.dtype != torch.uint8 or panels.dim() != 1
            or panels.numel() != size or not panels.is_contiguous()
            or panels.device.type != "cpu"):  # fmt: skip
        raise ValueError(f"the panels of a {fmt_name} ({N}, {K}) matrix are {size} contiguous "
                         f"uint8 bytes on the CPU, as repack_k makes them")  # fmt: skip
    if bias is not None:
        if not isinstance(bias, Tensor) or tuple(bias.shape) != (N,):
            raise ValueError(f"a product of {N} outputs takes a bias of ({N},), got "
                             f"{tuple(getattr(bias, 'shape', ()))}")  # fmt: skip
        if bias.dtype != torch.float32 or bias.device.type != "cpu":
            raise ValueError(f"the bias must be float32 on the CPU, got {bias.dtype}")
        bias = bias.contiguous()
    nth = torch.get_num_threads() if threads is None else threads
    if not isinstance(nth, int) or isinstance(nth, bool) or nth < 1:
        raise ValueError(f"threads must be a positive integer, got {threads!r}")
    index = _variant_index(variant, lib)
    run, work_bytes = lib.qkv_quantk_matmul, lib.qkv_quantk_work_bytes
    weights, bias_at = panels.data_ptr(), None if bias is None else bias.data_ptr()

    def multiply(x: Tensor) -> Tensor:
        x = _check_x(x, K)
        M = x.shape[0]
        y = torch.empty(M, N)
        if M == 0:
            return y
        work = torch.empty(work_bytes(M, K), dtype=torch.uint8)
        if run(index, code, weights, bias_at, N, K, x.data_ptr(), M, y.data_ptr(),
               work.data_ptr(), nth):  # fmt: skip
            raise ValueError(f"the kernels refused variant {VARIANTS[index]!r} for {fmt_name}")
        return y

    multiply.keep = (panels, bias)  # alive as long as the function
    return multiply


def matmul_k(
    packed: dict,
    x: Tensor,
    bias: Tensor | None = None,
    variant: int | str | None = None,
    threads: int | None = None,
) -> Tensor:
    """y (M, N) = x (M, K) @ W.T (+ bias) with W as `repack_k` packed it, x float32 rounded to
    Q8_K first. bias: (N,) float32; variant: a name of `VARIANTS` or its index (default: the
    best this CPU runs, or QKV_NATIVE_ISA's); threads: default torch's."""
    return product_k(packed, bias, variant, threads)(x)

"""Linear layers that keep a GGUF file's own blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, and the
K-quants Q4_K, Q5_K, Q6_K) and multiply them as llama.cpp does, with qkv's native kernels
(`qkv/nn/quant.c`, `qkv/nn/quant_k.c`).

Each block of 32 inputs is rounded to bytes with one scale (llama.cpp's Q8_0 and Q8_1
activations; Q8_K's blocks of 256 for the K-quants); the bytes times the weights' own 4-, 5-
or 8-bit integers are summed exactly in 32 bits, and each block's sum is scaled: y = sum over
blocks of (d_w * d_x) * isum (+ m_w * s_x for Q4_1 and Q5_1, whose weights are d * q + m).
The file's scales are used as they are (float16), where torch's int4 kernel rounds them to
bfloat16 and turns every weight into a float before it multiplies. The weights are repacked
once into panels of 16 rows, the operand of one VNNI instruction (see quant.c); the variant
for the CPU's instruction set is chosen at run time (`qkv.native.chosen_variant`).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
from contextvars import ContextVar

import torch
from torch import Tensor, nn

from qkv import native
from qkv.nn import quant_k

# format -> (the C kernels' number for it, bytes of one block of 32 weights in the file)
FORMATS = {"Q4_0": (0, 18), "Q4_1": (1, 20), "Q8_0": (2, 34), "Q5_0": (3, 22), "Q5_1": (4, 24)}
# bytes of a row's 32 integers in quant.c's panels: 4 bits each, 8 for Q8_0, 4 + 1 for Q5's
PANEL_ROW_BYTES = {"Q4_0": 16, "Q4_1": 16, "Q8_0": 32, "Q5_0": 20, "Q5_1": 20}
K_FORMATS = quant_k.FORMATS  # Q4_K, Q5_K, Q6_K: llama.cpp's K-quants (qkv/nn/quant_k.c)
BLOCK = 32
ROWS = 16  # rows per panel
# names quant.c's repacked layout: changed with it, a kept copy is stale ("-3": Q5_0 and Q5_1
# held too, in 5 bits, where a copy kept before holds them in float32 or in bytes)
LAYOUT = "panels-16-3"


def _block_of(fmt: str) -> tuple[int, int]:
    """(columns, bytes) of one block of a format QuantLinear holds; a ValueError for others."""
    if fmt in FORMATS:
        return BLOCK, FORMATS[fmt][1]
    if fmt in K_FORMATS:
        return quant_k.SUPER, K_FORMATS[fmt][1]
    raise ValueError(f"QuantLinear holds {', '.join((*FORMATS, *K_FORMATS))} blocks, not "
                     f"{fmt!r}")  # fmt: skip


def _code_of(fmt: str) -> int:
    return FORMATS[fmt][0] if fmt in FORMATS else K_FORMATS[fmt][0]


def _buffer_sizes(fmt: str, N: int, K: int) -> tuple[int, int]:
    """(bytes of the panels, floats of the scales and of the minimums) of an (N, K) layer."""
    if fmt in K_FORMATS:
        return quant_k.panel_bytes(fmt, N, K), 0
    blocks = (N + ROWS - 1) // ROWS * (K // BLOCK) * ROWS
    return blocks * panel_block_bytes(fmt) // ROWS, blocks


def panel_block_bytes(fmt: str) -> int:
    """Bytes of one panel's block of integers (16 rows of 32 columns) in quant.c's layout."""
    return ROWS * PANEL_ROW_BYTES[fmt]


@functools.cache
def _typed(lib):
    """The library with the product's functions typed (once a process)."""
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    native.declare(lib, "qkv_quant_repack", None, i32, p, i64, i64, p, p, p)
    native.declare(lib, "qkv_quant_activations", None, p, i64, i64, p, p, p, p)
    native.declare(lib, "qkv_quant_activations_variant", i32, i32, p, i64, i64, p, p, p, p)
    native.declare(lib, "qkv_quant_matmul", i32, i32, i32, p, p, p, p, i64, i64, p, i64, i32, p, p,
                   i32)  # fmt: skip
    native.declare(lib, "qkv_quant_work_bytes", i64, i64, i64, i64, i32)
    return lib


def kernels():
    """The typed native library, or None where there is none (`native.why_not()` says why)."""
    lib = native.library()
    return None if lib is None else _typed(lib)


@functools.cache
def _variant(asked: str) -> int:  # keyed by QKV_NATIVE_ISA's value, so a change is seen
    return native.chosen_variant(kernels())[0]


def in_generation() -> bool:
    """Whether loading and generation keep a file's blocks in QuantLinears: wherever the
    native kernels are built and not turned off (QKV_NATIVE=0 turns them off; torch's int4
    path runs then). With the decoding step in C (qkv/generate/step.c) they decoded SmolLM2
    at 1.3x llama.cpp's speed on an AVX2 EPYC, where torch's int4 path ran at 0.8x (issue 39,
    benchmarks/generate.py)."""
    return kernels() is not None


# the pool's threads for a forward's products of several rows: 1 but where a generation's
# prompt is read (cores_to_the_kernels), in that thread or task only
_forward_threads: ContextVar[int] = ContextVar("qkv_forward_threads", default=1)


@contextlib.contextmanager
def cores_to_the_kernels():
    """Within: the products of a forward pass's rows (a prompt's) on every core
    (`native.threads()`), and torch's own operations between them on one thread. Torch's
    threads spin for a while after each operation, and the pool's between its tasks: on 2
    cores of an AMD EPYC the two together read SmolLM2's 15-token prompt in 134 ms, the pool
    alone in 67, one thread in 92 (torch's int4 path took 69). Outside, and in other threads
    (a context variable), products run on one thread; torch's thread count is the process's
    and is restored on the way out."""
    torch_threads = torch.get_num_threads()
    token = _forward_threads.set(native.threads())
    torch.set_num_threads(1)
    try:
        yield
    finally:
        _forward_threads.reset(token)
        torch.set_num_threads(torch_threads)


def variant() -> int:
    """The index of the kernel variant products run (`native.chosen_variant`)."""
    return _variant(os.environ.get("QKV_NATIVE_ISA", ""))


class QuantLinear(nn.Module):
    """y = x @ W.T (+ bias) with W (N, K) held as a GGUF file's blocks of one format.

    fmt: "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0" or a K-quant (`K_FORMATS`); raw (N, K /
    columns * block bytes) uint8: each row's blocks as the file holds them; bias (N,) or
    None. Inputs of any float dtype are multiplied in float32, and the output is in the
    input's dtype. CPU only; needs the native library (a
    ValueError naming why where there is none).

    parts: 1, each input rounded to 8 bits per block as llama.cpp rounds it; or 2, the input
    rounded so and then what that left rounded again, the two products (each llama.cpp's
    arithmetic) summed: the input held to about 15 bits for the same read of the weights, and
    twice the integer work (`use_blocks` asks it of attention's projections).
    """

    def __init__(self, fmt: str, raw: Tensor, in_features: int, bias: Tensor | None = None,
                 parts: int = 1):  # fmt: skip
        super().__init__()
        if parts not in (1, 2):
            raise ValueError(f"a QuantLinear rounds its inputs in 1 or 2 parts, not {parts!r}")
        columns, block = _block_of(fmt)
        K = in_features
        if columns > K or K % columns:
            raise ValueError(f"{fmt} rows hold blocks of {columns} columns; {K} columns is not "
                             f"that")  # fmt: skip
        if raw.dtype != torch.uint8 or raw.dim() != 2 or raw.shape[0] < 1:
            raise ValueError(f"{fmt} blocks come as (rows, bytes) uint8, got {tuple(raw.shape)} "
                             f"{raw.dtype}")  # fmt: skip
        N = raw.shape[0]
        if raw.shape[1] != K // columns * block:
            raise ValueError(f"{fmt} rows of {K} columns hold {K // columns * block} bytes, "
                             f"not {raw.shape[1]}")  # fmt: skip
        if bias is not None and bias.shape != (N,):
            raise ValueError(f"a layer of {N} outputs needs a bias of ({N},)")
        lib = kernels()
        if lib is None:
            raise ValueError(f"QuantLinear needs qkv's native kernels: {native.why_not()}")
        self.parts, self.fmt, self.code = parts, fmt, _code_of(fmt)
        self.in_features, self.out_features = K, N
        raw = raw.contiguous().cpu()
        if fmt in K_FORMATS:  # quant_k.c's panels hold their scales: none beside them
            packed = quant_k.repack_k(fmt, raw, N, K)["panels"]
            self.register_buffer("panels", packed)
            self.register_buffer("scales", torch.empty(0))
            self.register_buffer("mins", torch.empty(0))
        else:
            panel_bytes, floats = _buffer_sizes(fmt, N, K)
            self.register_buffer("panels", torch.empty(panel_bytes, dtype=torch.uint8))
            self.register_buffer("scales", torch.empty(floats))
            self.register_buffer("mins", torch.empty(floats))
            lib.qkv_quant_repack(self.code, raw.data_ptr(), N, K, self.panels.data_ptr(),
                                 self.scales.data_ptr(), self.mins.data_ptr())  # fmt: skip
        self.bias = None if bias is None else nn.Parameter(bias.detach().float().clone(), False)

    @classmethod
    def from_panels(cls, fmt: str, panels: Tensor, scales: Tensor, mins: Tensor,
                    in_features: int, out_features: int, bias: Tensor | None = None,
                    parts: int = 1) -> QuantLinear:  # fmt: skip
        """A QuantLinear of buffers an earlier one held (kept on disk by
        `qkv.io.int4_cache`), nothing repacked: every size and dtype checked first, a
        ValueError where one does not fit (a damaged or foreign copy)."""
        columns, _ = _block_of(fmt)
        K, N = in_features, out_features
        if columns > K or K % columns or N < 1 or parts not in (1, 2):
            raise ValueError(f"no {fmt} layer has {K} inputs, {N} outputs in {parts} parts")
        panel_bytes, floats = _buffer_sizes(fmt, N, K)
        wanted = {"panels": (panels, torch.uint8, panel_bytes),
                  "scales": (scales, torch.float32, floats),
                  "mins": (mins, torch.float32, floats)}  # fmt: skip
        for name, (tensor, dtype, numel) in wanted.items():
            if tensor.dtype != dtype or tensor.dim() != 1 or tensor.numel() != numel:
                raise ValueError(f"{name} of a {N}x{K} {fmt} layer are {numel} {dtype}, "
                                 f"not {tuple(tensor.shape)} {tensor.dtype}")  # fmt: skip
        if bias is not None and bias.shape != (N,):
            raise ValueError(f"a layer of {N} outputs needs a bias of ({N},)")
        if kernels() is None:
            raise ValueError(f"QuantLinear needs qkv's native kernels: {native.why_not()}")
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer.parts, layer.fmt, layer.code = parts, fmt, _code_of(fmt)
        layer.in_features, layer.out_features = K, N
        for name, (tensor, _, _) in wanted.items():
            layer.register_buffer(name, tensor.contiguous())
        layer.bias = None if bias is None else nn.Parameter(bias.detach().float().clone(), False)
        return layer

    def product(self, variant_index: int | None = None, threads: int | None = None):
        """x (M, K) -> x @ W.T (+ bias) (M, N) in float32: the product as one
        function, everything but x looked up once (a decoding step calls it 200 times a
        token). variant_index: the kernel variant (default `variant()`); threads: default 1."""
        lib = kernels()
        if lib is None:
            raise ValueError(f"QuantLinear needs qkv's native kernels: {native.why_not()}")
        run, work_bytes = lib.qkv_quant_matmul, lib.qkv_quant_work_bytes
        chosen = variant() if variant_index is None else variant_index
        # One thread unless asked: between products a step runs torch's operations, whose
        # OpenMP threads and this pool's spin for the same 2 cores (SmolLM2 decoded at 6-18
        # tokens/s on 2 threads, 42 on 1, torch's int4 path 40). The step in C, with the pool
        # as its only threads, is what takes both cores (issue 39).
        nth = 1 if threads is None else threads
        if self.fmt in K_FORMATS:
            return self._product_k(chosen, nth)
        code, N, K, parts = self.code, self.out_features, self.in_features, self.parts
        panels, scales, mins = (t.data_ptr() for t in (self.panels, self.scales, self.mins))
        bias = None if self.bias is None else self.bias.data_ptr()
        keep = (self.panels, self.scales, self.mins, self.bias)  # alive as long as the function

        def multiply(x: Tensor) -> Tensor:
            if not x.is_contiguous() or x.dtype != torch.float32:
                x = x.float().contiguous()
            M = x.shape[0]
            y = torch.empty(M, N)
            work = torch.empty(work_bytes(M, K, N, parts), dtype=torch.uint8)
            if run(chosen, code, panels, scales, mins, bias, N, K, x.data_ptr(), M, parts,
                   y.data_ptr(), work.data_ptr(), nth):  # fmt: skip
                raise ValueError(f"this CPU does not run the kernel variant "
                                 f"{native.VARIANTS[chosen]!r}")  # fmt: skip
            return y

        multiply.keep = keep
        return multiply

    def _product_k(self, chosen: int, nth: int):
        """product() of K-quant blocks: quant_k's kernel (the input rounded to llama.cpp's
        Q8_K); in two parts, the products of the input and of what its rounding left, summed,
        then the bias, as quant.c sums the parts."""
        N, K, bias = self.out_features, self.in_features, self.bias
        packed = {"fmt": self.fmt, "N": N, "K": K, "panels": self.panels}
        if self.parts == 1:
            return quant_k.product_k(packed, None if bias is None else bias.detach(), chosen,
                                     nth)  # fmt: skip
        bare = quant_k.product_k(packed, None, chosen, nth)

        def multiply(x: Tensor) -> Tensor:
            x = x.float().contiguous()
            M = len(x)
            q, d, _ = quant_k.activations_k(x)
            rounded = (q.view(M, -1, quant_k.SUPER).float() * d[..., None]).view(M, K)
            both = bare(torch.cat([x, x - rounded]))  # one call: each weight unpacked once
            y = both[:M] + both[M:]
            return y if bias is None else y + bias.detach()

        multiply.keep = (self.panels, bias)
        return multiply

    def forward(self, x: Tensor) -> Tensor:
        if x.device.type != "cpu":
            raise ValueError("a GGUF file's blocks run on the CPU; load without int4 for GPUs")
        if x.shape[-1] != self.in_features:
            raise ValueError(f"the layer takes {self.in_features} inputs, got {x.shape[-1]}")
        if not x.is_floating_point():
            raise ValueError(f"the layer multiplies float inputs, got {x.dtype}")
        flat = x.reshape(-1, self.in_features).float().contiguous()
        if flat.shape[0] == 0:
            return x.new_zeros(*x.shape[:-1], self.out_features, dtype=torch.float32)
        y = self.product(threads=_forward_threads.get())(flat)
        return y.view(*x.shape[:-1], self.out_features).to(x.dtype)

    def extra_repr(self) -> str:
        parts = ", inputs in 2 parts" if self.parts == 2 else ""
        sizes = f"in_features={self.in_features}, out_features={self.out_features}"
        return f"{sizes}, {self.fmt}{parts}"

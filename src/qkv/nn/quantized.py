"""Linear layers whose weights stay in 4 or 8 bits: torch's weight-only kernels on the CPU.

Decoding one token at a time is bound by reading the weights: 4-bit weights are an eighth
of float32's bytes. Each group of 32 input columns of a row has a scale and a zero, and
w = (q - 8) * scale + zero with q in 0..15; the inputs are rounded to bfloat16, as the
kernel requires, and the products accumulate in float32. `Int8Linear` holds a matrix in 8
bits, one scale per row, for the LM head of an int4 model: SmolLM2's tied token matrix is 113
MB in float32, more than all of its 4-bit blocks together, and 28 MB in 8 bits. Decoding can
also round the head's inputs to 8 bits (`Int8Linear.with_int8_inputs`), as llama.cpp does.
"""

from __future__ import annotations

import weakref

import torch
from torch import Tensor, nn

from qkv.device import INT8_FLAGS, Capability, capability

GROUP = 32  # columns per scale: ggml's Q4 block
ROWS = 2048  # rows Int8Linear rounds at once: SmolLM2's 576 columns make 4.7 MB of float32
OUTLIERS = 8  # inputs of a row that `Int8Linear.with_int8_inputs` multiplies in float32
OUTLIER_ROWS = 16  # rows whose outliers' columns it holds in float32 at once (25 MB for 49k)


def int4_available() -> bool:
    """Whether this torch has the CPU int4 kernel (torch 2.6 and later)."""
    ops = torch.ops.aten
    return hasattr(ops, "_weight_int4pack_mm_for_cpu") and hasattr(
        ops, "_convert_weight_to_int4pack_for_cpu"
    )


class Int4Linear(nn.Module):
    """y = x @ W.T with W (N, K) held as 4-bit values, a scale and a zero per 32 columns.

    q (N, K) integers 0..15; scale, zero (N, K / 32); bias (N,) or None, added in the input's
    dtype. CPU only.
    """

    def __init__(self, q: Tensor, scale: Tensor, zero: Tensor, bias: Tensor | None = None):
        super().__init__()
        if not int4_available():
            raise ValueError(f"torch {torch.__version__} has no CPU int4 kernel; use torch >= 2.6")
        N, K = q.shape
        if K % GROUP or scale.shape != (N, K // GROUP) or zero.shape != scale.shape:
            raise ValueError(f"int4 weights need (N, K) values and (N, K/{GROUP}) scales")
        self.in_features, self.out_features = K, N
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32), 2)
        scales_and_zeros = torch.stack([scale, zero], dim=-1).transpose(0, 1)  # (K/32, N, 2)
        self.register_buffer("packed", packed)
        self.register_buffer("scales_and_zeros", scales_and_zeros.contiguous().bfloat16())
        if bias is not None and bias.shape != (N,):
            raise ValueError(f"an int4 layer of {N} outputs needs a bias of ({N},)")
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), False)

    @classmethod
    def from_packed(cls, packed: Tensor, scales_and_zeros: Tensor, bias: Tensor | None,
                    in_features: int, out_features: int) -> Int4Linear:  # fmt: skip
        """The layer whose `packed` and `scales_and_zeros` buffers these are (as another
        Int4Linear of the same sizes held them, on this torch and CPU)."""
        N, K = out_features, in_features
        if (packed.dtype != torch.uint8 or packed.shape != (N, K // 2) or K % GROUP
                or scales_and_zeros.dtype != torch.bfloat16
                or scales_and_zeros.shape != (K // GROUP, N, 2)):  # fmt: skip
            raise ValueError(f"packed int4 weights of ({N}, {K}) need ({N}, {K // 2}) bytes and "
                             f"({K // GROUP}, {N}, 2) bfloat16 scales")  # fmt: skip
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer.in_features, layer.out_features = K, N
        layer.register_buffer("packed", packed)
        layer.register_buffer("scales_and_zeros", scales_and_zeros)
        if bias is not None and bias.shape != (N,):
            raise ValueError(f"an int4 layer of {N} outputs needs a bias of ({N},)")
        layer.bias = None if bias is None else nn.Parameter(bias.detach().clone(), False)
        return layer

    def forward(self, x: Tensor) -> Tensor:
        if x.device.type != "cpu":
            raise ValueError("int4 weights run on the CPU; load the model without int4 for GPUs")
        flat = x.reshape(-1, self.in_features).to(torch.bfloat16)  # (B * T, K)
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(
            flat, self.packed, GROUP, self.scales_and_zeros
        )  # (B * T, N)
        y = y.to(x.dtype)
        if self.bias is not None:
            y = y + self.bias.to(x.dtype)
        return y.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bits=4"


def int8_available() -> bool:
    """Whether this torch has the CPU int8 weight-only kernel."""
    return hasattr(torch.ops.aten, "_weight_int8pack_mm")


def int8_inputs_available() -> bool:
    """Whether this torch has oneDNN's 8-bit products, whose inputs are 8-bit too."""
    if not torch.backends.mkldnn.is_available():
        return False
    return hasattr(torch.ops.onednn, "qlinear_prepack") and hasattr(
        torch.ops.onednn, "qlinear_pointwise"
    )


def choose_int8_inputs(cpu: Capability | None = None) -> tuple[str, str]:
    """("int8" or "bfloat16", why): the inputs of an 8-bit LM head (an int4 model's) when
    decoding rounds them, `Int8Linear.with_int8_inputs`, or keeps them in bfloat16, torch's
    weight-only kernel.

    The weight-only kernel turns every 8-bit weight into a float before it multiplies, and
    that arithmetic bounds it: on 2 cores of an AVX-512 EPYC it read SmolLM2's 28 MB head in
    1.9-3 ms a token (3.9 ms on 1 thread), 9-15 GB/s. oneDNN's u8 x s8 kernel multiplies the
    bytes themselves, 64 pairs an instruction with VNNI: 0.74-1.6 ms as the host allowed,
    0.9-2.2 ms with the rounding and the outliers, a token 0.7-1.1 ms faster in all
    (`docs/speed.md`). Without VNNI or AMX, oneDNN sums byte pairs into 16 bits first
    (AVX2's and AVX-512's vpmaddubsw), where they can saturate (oneDNN's "Nuances of int8
    computations"): held to AVX2 (ONEDNN_MAX_CPU_ISA=AVX2), a product of full-range 8-bit
    rows came out 2.8% off where VNNI's was 0.5% (the inputs' rounding alone), so those
    CPUs keep bfloat16 inputs. Like the precision, this depends on the machine alone.

    >>> choose_int8_inputs(Capability("AVX2", frozenset({"avx2", "fma"})))[0]
    'bfloat16'
    """
    cpu = cpu or capability()
    if not int8_inputs_available():
        return "bfloat16", "this torch has no oneDNN 8-bit products"
    having = [flag for flag in INT8_FLAGS if flag in cpu.flags]
    if not having:
        return "bfloat16", (
            "the CPU has no 8-bit dot-product instructions (avx512_vnni, avx_vnni or "
            "amx_int8), without which oneDNN's 8-bit sums can saturate"
        )
    return "int8", (
        f"the CPU has 8-bit dot-product instructions ({', '.join(having)}): oneDNN multiplies "
        "the 8-bit rows by 8-bit inputs 1.3-3x as fast as the weight-only kernel where measured"
    )


# What `with_int8_inputs` reads besides q and scale, per layer, with the versions of q and scale
# it was made from. Kept beside the layer, not in it: a copy or a state dict of the layer
# never carries oneDNN's opaque tensors.
_PREPARED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class Int8Linear(nn.Module):
    """y = x @ W.T + bias with W (N, K) held in 8 bits: W[n] = q[n] * scale[n], q in -127..127,
    scale[n] = max |W[n]| / 127 rounded to bfloat16 (every weight within half a step of its
    row, the largest within a step). Inputs rounded to bfloat16, as the kernel requires. CPU
    only.
    """

    def __init__(self, weight: Tensor, bias: Tensor | None = None):
        super().__init__()
        if not int8_available():
            raise ValueError(f"torch {torch.__version__} has no CPU int8 kernel")
        weight = weight.detach().float()
        self.out_features, self.in_features = weight.shape
        # the kernel takes bfloat16 scales: round them first, then each weight to its step
        largest = torch.linalg.vector_norm(weight, ord=float("inf"), dim=1)  # max |W[n]|
        scale = (largest.clamp_min(1e-30) / 127).bfloat16()  # (N,)
        q = torch.empty(weight.shape, dtype=torch.int8, device=weight.device)
        steps = scale.float()[:, None]
        for a in range(0, len(q), ROWS):  # a block of rows at a time, in the CPU's cache
            q[a : a + ROWS] = (
                (weight[a : a + ROWS] / steps[a : a + ROWS]).round_().clamp_(-127, 127)
            )
        self.register_buffer("q", q)
        self.register_buffer("scale", scale)
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), False)

    @classmethod
    def from_quantized(cls, q: Tensor, scale: Tensor, bias: Tensor | None) -> Int8Linear:
        """The layer whose `q` and `scale` buffers these are (as another Int8Linear held them)."""
        if (
            q.dtype != torch.int8
            or q.dim() != 2
            or scale.dtype != torch.bfloat16
            or (scale.shape != q.shape[:1])
        ):
            raise ValueError("8-bit weights need (N, K) int8 values and (N,) bfloat16 scales")
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer.out_features, layer.in_features = q.shape
        layer.register_buffer("q", q)
        layer.register_buffer("scale", scale)
        if bias is not None and bias.shape != q.shape[:1]:
            raise ValueError(
                f"an 8-bit layer of {q.shape[0]} outputs needs a bias of ({q.shape[0]},)"
            )
        layer.bias = None if bias is None else nn.Parameter(bias.detach().clone(), False)
        return layer

    def forward(self, x: Tensor) -> Tensor:
        if x.device.type != "cpu":
            raise ValueError("int8 weights run on the CPU; load the model without int4 for GPUs")
        flat = x.reshape(-1, self.in_features).to(torch.bfloat16)  # (B * T, K)
        y = torch.ops.aten._weight_int8pack_mm(flat, self.q, self.scale).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias.to(x.dtype)
        return y.view(*x.shape[:-1], self.out_features)

    def with_int8_inputs(self, x: Tensor) -> Tensor:
        """x @ W.T + bias for x (B, K), its inputs rounded to 8 bits too: (B, N) in x's dtype.

        The product llama.cpp computes for its 8-bit matrices, on oneDNN's u8 x s8 kernel
        (VNNI's instructions; `qkv.nn.quantized.choose_int8_inputs` says where it is used). In each
        row of x, the OUTLIERS inputs of largest magnitude are multiplied in float32 by their
        columns of the 8-bit matrix; the others are rounded to whole steps of (their largest
        magnitude) / 127, and multiplied by the 8-bit rows in 32-bit integers, exactly. A
        few inputs of a transformer's last hidden state are ten times the others (SmolLM2's
        reach 24 where the root-mean-square is 1.9): rounded with the rest, they would set a
        step that rounds away most of the others' digits, and the logits would move by 2.6%
        of their size where bfloat16 inputs move them by 1%; split off, by 1.1%.

        What it reads besides q and scale is made at its first call and kept with the layer:
        oneDNN's layout of q, and q transposed (K, N), whose rows are the outliers' columns;
        each as large as q (0.1 to 0.2 s to make for SmolLM2's head). Both are made again
        when q or scale has changed in place since (their version counters, `_state`). CPU
        only, and without a gradient: an x that would take one is refused.
        """
        if x.device.type != "cpu":
            raise ValueError("int8 weights run on the CPU; load the model without int4 for GPUs")
        if not int8_inputs_available():
            raise ValueError(f"torch {torch.__version__} has no oneDNN 8-bit products")
        if x.requires_grad and torch.is_grad_enabled():
            raise ValueError(
                "inputs rounded to 8 bits carry no gradient; call with_int8_inputs under "
                "torch.no_grad() or inference_mode()"
            )
        packed, columns, scale, zeros = self._prepared()
        rows = x.reshape(-1, self.in_features).float()  # (M, K)
        M, k = rows.shape[0], min(OUTLIERS, self.in_features)
        outliers = rows.abs().topk(k, dim=-1).indices  # (M, k)
        rest = rows.scatter(-1, outliers, 0.0)
        tiny = torch.finfo(torch.float32).tiny  # an all-zero row: steps of 0 would divide by 0
        step = rest.abs().amax(-1, keepdim=True).clamp_min(tiny) / 127  # (M, 1)
        # -127..127 held as 1..255 about the zero point 128: oneDNN's u8 inputs
        ints = torch.round(rest / step).clamp_(-127, 127).add_(128).to(torch.uint8)
        y = torch.ops.onednn.qlinear_pointwise(
            ints, 1.0, 128, packed, scale, zeros, None, 1.0, 0, torch.float32, "none", [], ""
        )  # (M, N): scale[n] * sum_k q[n, k] * (ints[m, k] - 128), summed in int32
        y.mul_(step)
        large = rows.gather(-1, outliers)[:, None]  # (M, 1, k)
        for a in range(0, M, OUTLIER_ROWS):  # their columns in float32: (rows, k, N) at once
            b = min(a + OUTLIER_ROWS, M)
            picked = columns.index_select(0, outliers[a:b].flatten()).view(b - a, k, -1)
            y[a:b].addcmul_(torch.bmm(large[a:b], picked.float())[:, 0], scale)
        if self.bias is not None:
            y = y + self.bias.float()
        return y.to(x.dtype).view(*x.shape[:-1], self.out_features)

    def _prepared(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """oneDNN's layout of q, q transposed (K, N), scale in float32 and oneDNN's zero
        points: made once for these q and scale."""
        made_from = (*_state(self.q), *_state(self.scale))
        kept = _PREPARED.get(self)
        if kept is None or kept[0] != made_from:
            with torch.no_grad():
                prepared = (
                    torch.ops.onednn.qlinear_prepack(self.q, None),
                    _transposed(self.q),
                    self.scale.float(),
                    torch.zeros(self.out_features, dtype=torch.long),
                )
            kept = _PREPARED[self] = (made_from, prepared)
        return kept[1]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bits=8"


def _state(tensor: Tensor) -> tuple[int, int]:
    """Where a tensor's memory is and how often it was written in place (-1 for a tensor
    made under inference_mode, which keeps no count: a write into it, possible only under
    inference_mode, is seen by no one, as a write through `.data` is not)."""
    return tensor.data_ptr(), -1 if tensor.is_inference() else tensor._version


def _transposed(q: Tensor, rows: int = 64) -> Tensor:
    """q (N, K) as a contiguous (K, N), copied `rows` rows at a time: each block is read and
    written within the CPU's cache (twice as fast as q.t().contiguous(), which crosses
    all of the output for every row: 24 against 50 ms for SmolLM2's 28 MB head)."""
    out = q.new_empty(q.shape[1], q.shape[0])
    for start in range(0, q.shape[0], rows):
        out[:, start : start + rows].copy_(q[start : start + rows].t())
    return out

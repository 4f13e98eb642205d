"""Linear layers whose weights stay in 4 or 8 bits: torch's weight-only kernels on the CPU.

Decoding one token at a time is bound by reading the weights: 4-bit weights are an eighth
of float32's bytes. Each group of 32 input columns of a row has a scale and a zero, and
w = (q - 8) * scale + zero with q in 0..15; the inputs are rounded to bfloat16, as the
kernel requires, and the products accumulate in float32. `Int8Linear` holds a matrix in 8
bits, one scale per row, for the LM head of an int4 model: SmolLM2's tied token matrix is 113
MB in float32, more than all of its 4-bit blocks together, and 28 MB in 8 bits.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

GROUP = 32  # columns per scale: ggml's Q4 block
ROWS = 2048  # rows Int8Linear rounds at once: SmolLM2's 576 columns make 4.7 MB of float32


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

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bits=8"

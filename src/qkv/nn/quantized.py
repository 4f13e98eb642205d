"""A linear layer whose weight stays in 4 bits: torch's int4 weight-only kernel on the CPU.

Decoding one token at a time is bound by reading the weights: 4-bit weights are an eighth
of float32's bytes. Each group of 32 input columns of a row has a scale and a zero, and
w = (q - 8) * scale + zero with q in 0..15; the inputs are rounded to bfloat16, as the
kernel requires, and the products accumulate in float32.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

GROUP = 32  # columns per scale: ggml's Q4 block


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

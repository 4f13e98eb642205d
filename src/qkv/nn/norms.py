"""Norms: LayerNorm, and RMSNorm as Llama and Gemma scale it."""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor, nn

NormKind = Literal["layernorm", "rmsnorm", "rmsnorm_plus1"]


class RMSNorm(nn.Module):
    """Scale each vector to unit root-mean-square, then by a learned gain (Llama's norm).

    Computed in float32 (float64 for float64 vectors) and cast back before the gain, as Llama
    checkpoints expect. With
    plus_one (Gemma's norm) the gain is 1 + weight, applied in float32 before the cast, and
    the stored weight starts at 0.
    """

    def __init__(self, width: int, eps: float = 1e-6, *, plus_one: bool = False):
        super().__init__()
        self.eps, self.plus_one = eps, plus_one
        self.weight = nn.Parameter(torch.zeros(width) if plus_one else torch.ones(width))

    def forward(self, x: Tensor) -> Tensor:
        h = x if x.dtype == torch.float64 else x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.plus_one:
            return (h * (1.0 + self.weight.to(h.dtype))).to(x.dtype)
        return self.weight * h.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}" + (", plus_one" if self.plus_one else "")


NORMS = ("layernorm", "rmsnorm", "rmsnorm_plus1")


def make_norm(kind: NormKind, width: int, eps: float, bias: bool = True) -> nn.Module:
    """A norm over the last `width` dimensions; bias: LayerNorm's shift (ModernBERT has
    none). rmsnorm_plus1 is Gemma's RMSNorm, whose gain is 1 + weight."""
    if kind == "layernorm":
        return nn.LayerNorm(width, eps=eps, bias=bias)
    if kind in ("rmsnorm", "rmsnorm_plus1"):
        return RMSNorm(width, eps=eps, plus_one=kind == "rmsnorm_plus1")
    raise ValueError(f"unknown norm {kind!r}; allowed: {', '.join(map(repr, NORMS))}")

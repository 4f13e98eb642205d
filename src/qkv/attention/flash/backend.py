"""The `flash` backend's registry entry: what it can run, and when `auto` should pick it.

Nothing here imports triton at import time, so `import qkv` stays free of it and `auto` can
ask, on every call, whether the kernel applies without paying for the import; the kernel
itself (`function.py`, which imports triton) is loaded by the first call that runs it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from qkv.attention.flash.limits import unsupported
from qkv.attention.inputs import Shape


@dataclass(frozen=True)
class Measured:
    """Shapes where a committed `benchmarks/flash_gpu.py` table shows `flash` faster than
    every backend of torch's scaled_dot_product_attention, forward and backward."""

    device: str  # torch.cuda.get_device_name(), e.g. "NVIDIA H200"
    head_dim: int
    causal: bool
    min_tokens: int  # the keys' length Tk, both ends included
    max_tokens: int


# No GPU has run the kernel yet (benchmarks/results/ holds no flash_gpu table), so `auto`
# never picks `flash`; `backend="flash"` runs it on request.
MEASURED_FASTER: tuple[Measured, ...] = ()


def supports(q: Tensor, mask: Tensor | None, causal: bool, shape: Shape) -> str | None:
    """Registry hook: None when `attend(..., backend="flash")` can run these inputs."""
    if shape.Dv is not None:
        return (f"its kernel takes values of the keys' head size (here D={shape.D}, "
                f"Dv={shape.Dv})")  # fmt: skip
    return unsupported(q, shape.D)


def prefer(q: Tensor, mask: Tensor | None, causal: bool, shape: Shape) -> str | None:
    """Registry hook for `auto`: None only where a committed benchmark measured flash fastest."""
    if q.device.type != "cuda":
        return "auto picks it only on CUDA (on the CPU it runs in Triton's interpreter)"
    name = torch.cuda.get_device_name(q.device)
    for region in MEASURED_FASTER:
        if (
            region.device == name
            and region.head_dim == shape.D
            and region.causal == causal
            and region.min_tokens <= shape.Tk <= region.max_tokens
            and mask is None
        ):
            return None
    return (
        f"no committed benchmark shows it faster than sdpa on {name} for D={shape.D}, "
        f"Tk={shape.Tk}, causal={causal}{', with a mask' if mask is not None else ''}"
    )


def forward(
    q: Tensor, k: Tensor, v: Tensor, *, mask, causal: bool, scale: float, shape: Shape
) -> Tensor:
    """Backend entry for the registry: inputs already checked."""
    return forward_lse(q, k, v, mask=mask, causal=causal, scale=scale, shape=shape)[0]


def forward_lse(
    q: Tensor, k: Tensor, v: Tensor, *, mask, causal: bool, scale: float, shape: Shape
) -> tuple[Tensor, Tensor]:
    """Registry entry for the log-sum-exp: (out (B, H, Tq, D), lse (B, H, Tq) float32)."""
    from qkv.attention.flash.function import flash_attention  # imports triton: on first use

    return flash_attention(q, k, v, mask=mask, causal=causal, scale=scale)

"""The `flash` backend's registry entry: what it can run, and when `auto` should pick it.

Nothing here imports triton, so `import qkv` stays free of it and `auto` can ask, on every
call, whether the kernel applies without paying for the import.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from dataclasses import dataclass

import torch
from torch import Tensor

from qkv.attention.inputs import Shape

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MAX_HEAD_DIM = 256  # a 256-wide tile of K and V is as much as shared memory holds
MIN_CAPABILITY = (8, 0)  # Ampere: bfloat16 tensor cores


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


@functools.cache
def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def interpreter_on() -> bool:
    """TRITON_INTERPRET=1: Triton runs the kernels on the CPU, one program at a time."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on")


def unsupported(q: Tensor, head_dim: int) -> str | None:
    """Why the kernel cannot run on tensors like q, or None when it can."""
    if q.dtype not in DTYPES:
        return f"it computes in bfloat16, float16 or float32, not {q.dtype}"
    if head_dim > MAX_HEAD_DIM:
        return f"head size D={head_dim} is over its largest, {MAX_HEAD_DIM}"
    if q.device.type == "cuda":
        capability = torch.cuda.get_device_capability(q.device)
        if capability < MIN_CAPABILITY:
            return (
                "it needs an NVIDIA GPU of compute capability 8.0 or newer; "
                f"{torch.cuda.get_device_name(q.device)} is {capability[0]}.{capability[1]}"
            )
    elif not interpreter_on():
        return (
            f"it runs on CUDA GPUs and q is on {q.device} (TRITON_INTERPRET=1 runs the "
            "kernels on the CPU, slowly, as the tests do)"
        )
    if not _triton_installed():
        return "it needs the triton package (pip install triton)"
    return None


def supports(q: Tensor, mask: Tensor | None, causal: bool, shape: Shape) -> str | None:
    """Registry hook: None when `attend(..., backend="flash")` can run these inputs."""
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
    from qkv.attention.flash.function import flash_attention

    return flash_attention(q, k, v, mask=mask, causal=causal, scale=scale)[0]

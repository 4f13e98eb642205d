"""What qkv's flash kernel can run: dtypes, head sizes, devices, and whether triton is there.

Nothing here imports triton, so the registry can ask on every call whether the kernel
applies without paying for the import; the kernels and their autograd function ask the same
questions before a launch.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch
from torch import Tensor

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MAX_HEAD_DIM = 256  # a 256-wide tile of K and V is as much as shared memory holds
MIN_CAPABILITY = (8, 0)  # Ampere: bfloat16 tensor cores


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

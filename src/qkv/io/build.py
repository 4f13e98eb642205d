"""A model of a family built from checkpoint tensors: on the meta device, with no random
init, then filled; the same for a Hugging Face folder, a GGUF file and a training run."""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from qkv.io.checkpoint import fill
from qkv.io.families import Family


def with_backend(config, backend: str | None):
    """The same model config with another attention backend (None keeps it)."""
    if backend is None:
        return config
    return replace(config, block=replace(config.block, backend=backend))


class NoRandomInit(TorchFunctionMode):
    """Random initializers return their tensor untouched (on the meta device they would give
    it no values anyway, but their Python meta kernels import torch._dynamo, about 1.5 s, on
    a process's first load). A TorchFunctionMode holds for its own thread only."""

    SKIPPED = frozenset({
        torch.Tensor.normal_, torch.Tensor.uniform_, nn.init.normal_, nn.init.uniform_,
        nn.init.trunc_normal_, nn.init.kaiming_uniform_, nn.init.kaiming_normal_,
    })  # fmt: skip

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self.SKIPPED:
            return args[0] if args else kwargs["tensor"]
        return func(*args, **(kwargs or {}))


def build(family: Family, config, tensors: dict[str, Tensor], dtype: torch.dtype) -> nn.Module:
    """A model of `family` holding `tensors`, in `dtype` and eval mode.

    The model is built on the meta device (shapes, no values), so no time or memory goes
    to a random init that the checkpoint replaces; `fill` then puts the checkpoint's
    tensors in. torch.device and torch function modes are per-thread contexts, so nothing
    process-wide changes: a model built meanwhile on another thread is initialized as usual.
    """
    with torch.device("meta"), NoRandomInit():
        model = family.model(config)
    fill(model, family, config, tensors)
    return model.to(dtype).eval()

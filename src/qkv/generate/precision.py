"""The weights generation reads: the model as loaded, or a copy that keeps a .gguf file's own
4-bit matrices in 4 bits (several times faster to decode on the CPU, as llama.cpp does).

The copy is made once, on first use, and only while it still holds the model's weights: the
file must not have changed on disk since the load, nor the model's weights since the copy.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from qkv.io import int4, int4_cache
from qkv.io.families import Family
from qkv.native import why_not as native_why
from qkv.nn.quant_linear import QuantLinear, in_generation
from qkv.nn.quantized import Int4Linear, int4_available

PRECISIONS = ("auto", "loaded", "int4")


@dataclass(eq=False)
class FourBits:
    """A .gguf file's 4-bit matrices that a model was loaded from (dequantized), and the 4-bit
    copy of the model made from them on first use.

    file: the .gguf file (None when the model came from elsewhere); stamp: its size and
    modification time when it was read; digest: its SHA-256 when loaded, its int4 cache's
    name; made: the copy and the model's weights it was made from (`weights_state`).
    """

    file: Path | None = None
    stamp: tuple | None = None
    digest: str = ""
    made: tuple[nn.Module, tuple] | None = None

    @classmethod
    def of(cls, file: Path | None, digest: str = "") -> FourBits:
        """The 4-bit matrices of `file` as it is now (None: a model with none)."""
        return cls(file, file_stamp(file), digest)

    def generation_model(self, model: nn.Module, family: Family, config, source: str,
                         precision: str = "auto") -> tuple[nn.Module, str]:  # fmt: skip
        """The model `generate(precision=...)` decodes with, and why (`Pretrained.
        generation_model`): "int4" the 4-bit copy, "loaded" the model itself, "auto" the copy
        where it can be made and still holds the model's weights."""
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be 'auto', 'loaded' or 'int4', got {precision!r}")
        if int4_loaded(model):
            return model, "the model as loaded with int4=True"
        if precision == "loaded":
            return model, "the model as loaded, as asked"
        lacks = self.why_not(model, source)
        if lacks is not None:
            if precision == "int4":
                raise ValueError(f"precision='int4' cannot be given here: {lacks}")
            return model, f"the model as loaded ({lacks})"
        if self.made is None:
            self.made = self.four_bit_copy(model, family, config, source), weights_state(model)
        return self.made[0], f"{self.file.name}'s {kept_as(self.made[0])}"

    def why_not(self, model: nn.Module, source: str) -> str | None:
        """Why the 4-bit copy cannot decode for `model` now, or None."""
        parameter = next(model.parameters())
        if self.file is None:
            return f"{source} is not a .gguf file with 4-bit matrices"
        if not in_generation() and not int4_available():
            return (f"torch {torch.__version__} has no CPU int4 kernel, and qkv's own are "
                    f"not here: {native_why()}")  # fmt: skip
        if not in_generation():
            from qkv.io import gguf  # the gguf package: only a .gguf file's model needs it

            if not gguf.int4_matrices(self.file):  # a file of K-quants or Q5 blocks, say
                return (f"{self.file.name} has no Q4_0 or Q4_1 matrices for torch's int4 "
                        f"kernel, and qkv's own kernels are not here: {native_why()}")  # fmt: skip
        if parameter.device.type != "cpu":
            return "the model is not on the CPU"
        if parameter.dtype != torch.float32:
            return f"the model is {parameter.dtype}, not float32"
        if self.made is not None and self.made[1] != weights_state(model):
            # the file's 4-bit matrices are no longer this model's weights
            return "the model's weights have changed since it was loaded"
        if self.made is None and file_stamp(self.file) != self.stamp:
            return f"{self.file.name} has changed on disk since it was loaded"
        return None

    def four_bit_copy(self, model: nn.Module, family: Family, config, source: str) -> nn.Module:
        """The model with the file's 4-bit matrices swapped in, sharing every other tensor:
        from the cache of an earlier process where there is one (`qkv.io.int4_cache`)."""
        from qkv.io import gguf  # imports the gguf package: only a .gguf file's model needs it

        shared = {id(t): t for t in (*model.parameters(), *model.buffers())}
        twin = copy.deepcopy(model, shared)  # the modules copied, their tensors not
        blocks = in_generation()  # the file's own blocks (not where QKV_NATIVE=0)
        cache = None
        if self.digest:
            cache = int4_cache.cache_path(self.digest, gguf.default_cache_dir(), blocks)
            if int4_cache.restore(twin, cache):
                return twin.eval()
        if blocks:
            int4.use_blocks(twin, family, config, gguf.read_blocks(self.file, int4.BLOCK_TYPES),
                            source)  # fmt: skip
        else:
            int4.use_int4(twin, family, config, gguf.read_int4(self.file), source)
        if cache is not None:
            int4_cache.store(twin, cache)
        return twin.eval()


def kept_as(model: nn.Module) -> str:
    """How a 4-bit copy holds the file's matrices: its own blocks (by format), or torch's
    int4 kernel's 4 bits."""
    held = {m.fmt for m in model.modules() if type(m) is QuantLinear}
    if not held:
        return "own 4-bit matrices, in 4 bits"
    formats = [f for f in int4.BLOCK_TYPES if f in held]
    return f"own blocks ({', '.join(formats)}), as the file holds them"


def int4_loaded(model: nn.Module) -> bool:
    """Whether the model was loaded with int4=True (its 4-bit matrices are its own)."""
    return any(isinstance(m, Int4Linear | QuantLinear) for m in model.modules())


def file_stamp(path: Path | None) -> tuple | None:
    """A file's size and modification time: what tells that it was written again."""
    if path is None:
        return None
    try:
        stat = path.stat()
    except OSError:
        return ("gone",)
    return stat.st_size, stat.st_mtime_ns


def weights_state(model: nn.Module) -> tuple:
    """Which tensors the model's weights are, where their memory is and how often each was
    written in place: an optimizer step, a load_state_dict, a swapped parameter or its
    `.data` replaced change it. (A write into `p.data` itself is counted nowhere in torch.)"""
    state = []
    for p in model.parameters():
        try:
            version = p._version
        except RuntimeError:  # an inference tensor keeps no count: never taken as unchanged
            version = object()
        state.append((id(p), p.data_ptr(), version))
    return tuple(state)

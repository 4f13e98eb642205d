"""A .gguf file's matrices as torch's CPU kernels hold them, kept on disk between processes.

`Pretrained.generate` decodes with the file's own 4-bit matrices (`use_int4`): reading their
nibbles, packing them into the int4 kernel's layout and rounding the LM head to 8 bits took
0.3 to 0.45 s of every `qkv generate`, a fifth of the time from the command to its first
token. What comes out depends only on the file, torch's packing and this CPU's kernels, so
it is written once beside the dequantized weights (`$XDG_CACHE_HOME/qkv/gguf`), named by the
file's SHA-256 and those, and later processes put it in place (`restore`): the same buffers,
in the same modules, as `use_int4` makes (tests/test_pretrained.py holds them equal).

qkv's own kernels' copy (`use_blocks`: the file's blocks read and repacked into QuantLinear's
panels, 0.4-1.5 s of a cold start on 2 cores) is kept the same way, under its own name
(`cache_path(..., blocks=True)`): it depends on the file and the layout of the panels only.

A cache that is missing, damaged, or does not fit the model is not used: `restore` then
leaves the model as it was, and the caller makes the matrices again and `store`s them.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save
from torch import Tensor, nn

from qkv.io.files import write_atomically
from qkv.io.int4 import FUSED
from qkv.nn.quant_linear import LAYOUT, QuantLinear
from qkv.nn.quantized import Int4Linear, Int8Linear

logger = logging.getLogger(__name__)

FORMAT = "qkv-int4-1"  # bump when use_int4 would make other modules or buffers


def cache_path(digest: str, cache_dir: Path, blocks: bool = False) -> Path:
    """Where the quantized matrices of the file of SHA-256 `digest` are kept: torch's int4
    kernel's for this torch and this CPU (the layout is theirs), or, `blocks`, the file's own
    blocks as qkv's kernels repack them (QuantLinear's panels: the same on every CPU)."""
    if blocks:
        made_by, kind = f"{FORMAT}|{LAYOUT}", "blocks"
    else:
        made_by = f"{FORMAT}|{torch.__version__}|{torch.backends.cpu.get_cpu_capability()}"
        kind = "int4"
    tag = hashlib.sha256(made_by.encode()).hexdigest()[:16]
    return cache_dir / f"{digest}-{kind}-{tag}.safetensors"


def store(model: nn.Module, path: Path) -> None:
    """Write the 4- and 8-bit matrices of `model` (after `use_int4`) to `path`, all or
    nothing (their biases are the model's own, read again by `restore`); a cache that
    cannot be written is only logged."""
    tensors, modules = {}, []
    for name, module in model.named_modules():
        if type(module) is Int4Linear:
            kind, held = "int4", {"packed": module.packed, "scales": module.scales_and_zeros}
        elif type(module) is Int8Linear:
            kind, held = "int8", {"q": module.q, "scale": module.scale}
        elif type(module) is QuantLinear:  # the kind names its format and its parts
            kind = f"{module.fmt}/{module.parts}"
            held = {"panels": module.panels, "scales": module.scales, "mins": module.mins}
        else:
            continue
        modules.append([name, kind, module.in_features, module.out_features])
        tensors |= {f"{name}.{key}": tensor.contiguous() for key, tensor in held.items()}
    metadata = {"format": FORMAT, "modules": json.dumps(modules)}
    try:
        write_atomically(path, lambda file: file.write(save(tensors, metadata)))
    except OSError as error:
        logger.warning("could not write the int4 cache %s: %s", path, error)


def restore(model: nn.Module, path: Path) -> bool:
    """Put the cached 4- and 8-bit modules in `model` (as loaded, before `use_int4`), each
    in place of the Linear it stands for, or of the Linears it fuses: whether it did. Every
    module is checked against the Linear it replaces before any is swapped, so a cache that
    does not fit leaves the model untouched."""
    if not path.is_file():
        return False
    try:
        with safe_open(path, framework="pt") as file:
            metadata = file.metadata() or {}
            if metadata.get("format") != FORMAT:
                return False
            modules = json.loads(metadata["modules"])
            tensors = {key: file.get_tensor(key) for key in file.keys()}  # noqa: SIM118
    except Exception:  # safetensors' own errors, OSError, bad JSON: rebuilt instead
        return False
    try:
        swaps = [_swap(model, tensors, *entry) for entry in modules]
    except (ValueError, TypeError, KeyError, AttributeError):
        return False
    if not swaps:
        return False
    for parent, replaced, child, made in swaps:
        for part in replaced:
            delattr(parent, part)
        setattr(parent, child, made)
    return True


def _swap(model: nn.Module, tensors: dict[str, Tensor], name: str, kind: str,
          in_features: int, out_features: int) -> tuple:  # fmt: skip
    """(parent, the Linears it replaces, its name, the module) for one cached entry; raises
    ValueError where the model has no Linear of those sizes there."""
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name)
    present = getattr(parent, child, None)
    if type(present) is nn.Linear:
        replaced, linears = (child,), [present]
    elif present is None and child in FUSED:
        replaced = FUSED[child]
        linears = [getattr(parent, part, None) for part in replaced]
    else:
        raise ValueError(f"{name} is not a Linear to replace")
    if any(type(linear) is not nn.Linear or linear.in_features != in_features
           for linear in linears):  # fmt: skip
        raise ValueError(f"{name} does not read {in_features} numbers")
    if sum(linear.out_features for linear in linears) != out_features:
        raise ValueError(f"{name} does not make {out_features} numbers")
    bias = None  # the model's own, as use_int4 takes it: a Linear without one adds zeros
    if any(linear.bias is not None for linear in linears):
        bias = torch.cat([linear.weight.new_zeros(linear.out_features) if linear.bias is None
                          else linear.bias.detach() for linear in linears])  # fmt: skip
    if kind == "int4":
        made = Int4Linear.from_packed(tensors[f"{name}.packed"], tensors[f"{name}.scales"],
                                      bias, in_features, out_features)  # fmt: skip
    elif kind == "int8":
        made = Int8Linear.from_quantized(tensors[f"{name}.q"], tensors[f"{name}.scale"], bias)
    elif kind.partition("/")[2] in ("1", "2"):  # a QuantLinear: its format / its parts
        fmt, _, parts = kind.partition("/")
        made = QuantLinear.from_panels(fmt, tensors[f"{name}.panels"], tensors[f"{name}.scales"],
                                       tensors[f"{name}.mins"], in_features, out_features, bias,
                                       int(parts))  # fmt: skip
    else:
        raise ValueError(f"unknown kind {kind}")
    return parent, replaced, child, made

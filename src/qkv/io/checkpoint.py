"""Checkpoint tensors in and out of a qkv model, through a family's weight map.

Every tensor is shape-checked; a checkpoint key that nothing reads, or a model weight that
nothing fills, is an error: a silent mismatch would give a model that runs and is wrong.
"""

from __future__ import annotations

import json
import re
import zipfile
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import Tensor, nn

from qkv.io.families import Family, Weight

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")


def weight_files(folder: Path) -> list[Path]:
    """The files `read_checkpoint` reads: model.safetensors, the shards its index names, or
    pytorch_model.bin. A shard must be a file in the folder itself."""
    folder = Path(folder)
    single, index, pickle = (folder / name for name in WEIGHT_FILES)
    if single.exists():
        return [single]
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            shards = sorted(set(weight_map.values()))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
            raise ValueError(
                f"{index} is corrupt: it must be JSON with a weight_map of tensor names to "
                "shard files"
            ) from None
        for shard in shards:
            if not isinstance(shard, str) or Path(shard).name != shard or shard in ("", ".", ".."):
                raise ValueError(f"{index} names the shard {shard!r}; a shard is a file beside it")
        return [folder / shard for shard in shards]
    if pickle.exists():
        return [pickle]
    raise ValueError(f"{folder} has no weights: expected one of {', '.join(WEIGHT_FILES)}")


def weight_bytes(folder: Path) -> int:
    """The size of the folder's weight files, which bounds the model its config may claim."""
    return sum(path.stat().st_size for path in weight_files(folder) if path.exists())


def read_checkpoint(folder: Path) -> dict[str, Tensor]:
    """The tensors of a Hugging Face folder: model.safetensors (sharded or not), else
    pytorch_model.bin. A truncated or corrupt file is reported as such."""
    files = weight_files(folder)
    if files[0].name == "pytorch_model.bin":
        return _read_pickle(files[0])
    tensors: dict[str, Tensor] = {}
    for path in files:
        tensors.update(_read_safetensors(path))
    return tensors


def _read_pickle(path: Path) -> dict[str, Tensor]:
    """A torch.save'd state dict, unpickled with weights_only (a pickle that would run code
    is refused). The zip format is memory-mapped; the legacy format, which cannot be, is
    read whole."""
    zipped = zipfile.is_zipfile(path)
    try:
        tensors = torch.load(path, map_location="cpu", weights_only=True, mmap=zipped)
    except Exception as error:  # torch raises several kinds for a damaged file
        text = str(error)
        if "Weights only load failed" in text:  # a pickle that would build other objects
            found = re.search(r"unsupported (GLOBAL|global|operand) [^\s]+", text)
            raise ValueError(
                f"{path} holds more than tensors ({found[0] if found else 'refused by torch'}); "
                "qkv unpickles only tensors, so that a file cannot run code when loaded"
            ) from None
        first = text.strip().splitlines()[0] if text.strip() else type(error).__name__
        raise ValueError(f"{path} is truncated or corrupt: {first}") from None
    if not isinstance(tensors, dict) or not all(
        isinstance(k, str) and isinstance(v, Tensor) for k, v in tensors.items()
    ):
        raise ValueError(f"{path} holds a {type(tensors).__name__}, not a state dict of tensors")
    return tensors


def _read_safetensors(path: Path) -> dict[str, Tensor]:
    if not path.exists():
        raise ValueError(f"{path} is missing")
    try:
        return load_file(path)
    except (SafetensorError, OSError) as error:
        raise ValueError(f"{path} is truncated or corrupt: {error}") from None


def fill(model: nn.Module, family: Family, config, tensors: dict[str, Tensor]) -> None:
    """Put checkpoint tensors into the model's parameters through the family's map.

    Each parameter becomes its checkpoint tensor in the parameter's dtype (assigned, not
    copied, so the model may be built on the meta device, with shapes and no values); tied
    weights are tied again, and buffers computed at construction (rotary frequencies) are
    computed again where the meta device left them empty. A weight may also name a
    persistent buffer the checkpoint holds (DeepSeek-V3's routers' correction bias).
    """
    params = dict(model.named_parameters())  # tied weights appear once, under their first name
    targets = dict(model.named_buffers()) | params  # a buffer a checkpoint holds (DeepSeek's)
    state: dict[str, Tensor] = {}
    used: set[str] = set()
    for weight in family.weights(config):
        found, value, present = _found(weight, tensors, family)
        used.update(present)
        if weight.qkv not in targets:
            raise AssertionError(f"{family.name} weight map names unknown parameter {weight.qkv}")
        target = targets[weight.qkv]
        if weight.rows is not None:  # the checkpoint tensor holds other parameters too
            try:
                value = weight.rows.take(value)
            except ValueError as error:
                raise ValueError(f"{found} {error} (for {weight.qkv})") from None
        value = weight.load(value)
        if value.shape != target.shape:
            raise ValueError(
                f"{found} has shape {tuple(value.shape)} but the model built from "
                f"config.json needs {tuple(target.shape)} for {weight.qkv}"
            )
        state[weight.qkv] = value.to(target.dtype)
    unused = [
        name
        for name in tensors
        if name not in used and not any(re.fullmatch(p, name) for p in family.ignored)
    ]
    if unused:
        raise ValueError(
            f"{len(unused)} checkpoint tensors are not used by qkv's {family.name} model, "
            f"e.g. {', '.join(sorted(unused)[:3])}"
        )
    unfilled = sorted(set(params) - set(state))
    if unfilled:
        raise ValueError(f"the checkpoint leaves these weights unfilled: {', '.join(unfilled[:5])}")
    with torch.no_grad():
        # strict=False: a tied weight's second name is absent; tie_weights restores it
        model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()
    for module in model.modules():
        if any(b.is_meta for b in module.buffers(recurse=False)):
            module.reset_buffers()
    empty = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    assert not empty, f"left on the meta device after filling: {empty[:5]}"


def _found(weight: Weight, tensors: dict[str, Tensor], family: Family):
    """(what was found, for messages; its tensor, joined where it comes in parts; every name
    of it the checkpoint holds). The parts are tried first, then the one-tensor names."""
    parts = weight.parts
    present = [name for name in weight.names if name in tensors]
    if parts is not None:
        held = [name for name in parts.names if name in tensors]
        if len(held) == len(parts.names):
            found = f"{parts.names[0]} and its {len(parts.names) - 1} other parts"
            try:
                value = parts.join([tensors[name] for name in parts.names])
            except RuntimeError as error:  # torch.stack or cat of tensors of unlike shapes
                first = str(error).splitlines()[0]
                raise ValueError(f"{found} do not join into {weight.qkv}: {first}") from None
            return found, value, held + present
        if held and not present:
            missing = [name for name in parts.names if name not in tensors]
            raise ValueError(
                f"the checkpoint has {held[0]} but not {missing[0]} ({len(missing)} of the "
                f"{len(parts.names)} tensors that make {weight.qkv} are missing)"
            )
    if not present:
        raise ValueError(
            f"the checkpoint has no {weight.canonical} (for {weight.qkv}); is it a "
            f"{family.name} checkpoint of this size?"
        )
    return present[0], tensors[present[0]], present


def export(model: nn.Module, family: Family, config) -> dict[str, Tensor]:
    """The model's weights under their canonical checkpoint names and layouts (a parameter
    the checkpoint keeps in parts, as its parts)."""
    targets = dict(model.named_buffers()) | dict(model.named_parameters())
    out = {}
    unwritten: dict[str, set[int]] = {}  # the rows not yet written of tensors held in rows
    for weight in family.weights(config):
        value = weight.save(targets[weight.qkv].detach())
        if weight.rows is not None:
            name, rows = weight.names[0], weight.rows
            if name not in out:
                out[name] = value.new_zeros(rows.total, *value.shape[1:])
                unwritten[name] = set(range(rows.total))
            out[name][rows.index] = value
            unwritten[name] -= set(rows.index.tolist())
            continue
        if weight.parts is None:
            out[weight.names[0]] = value.contiguous()
            continue
        split = weight.parts.split(value)
        assert len(split) == len(weight.parts.names), f"{weight.qkv} split into {len(split)}"
        out.update(zip(weight.parts.names, (t.contiguous() for t in split), strict=True))
    assert not any(unwritten.values()), f"rows no weight writes: {unwritten}"
    return out

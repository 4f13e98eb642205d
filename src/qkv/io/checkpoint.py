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

from qkv.io.families import Family

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
    persistent buffer the checkpoint holds (DeepSeek-V3's routers' correction bias), and
    may be joined from several checkpoint tensors (`Weight.parts`).
    """
    params = dict(model.named_parameters())  # tied weights appear once, under their first name
    targets = dict(model.named_buffers()) | params
    state: dict[str, Tensor] = {}
    used: set[str] = set()
    for weight in family.weights(config):
        if weight.qkv not in targets:
            raise AssertionError(f"{family.name} weight map names unknown parameter {weight.qkv}")
        target = targets[weight.qkv]
        aliases = weight.parts or (weight.names,)  # each checkpoint tensor's names
        found = [_present(names, tensors, weight, family) for names in aliases]
        used.update(name for present in found for name in present)
        read = [tensors[present[0]] for present in found]
        value = weight.load(read if weight.parts else read[0])
        if value.shape != target.shape:
            raise ValueError(
                f"{found[0][0]} has shape {tuple(value.shape)} but the model built from "
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


def _present(aliases: tuple[str, ...], tensors: dict[str, Tensor], weight, family) -> list[str]:
    """The aliases of one checkpoint tensor that the checkpoint holds (the first is read)."""
    present = [name for name in aliases if name in tensors]
    if not present:
        raise ValueError(
            f"the checkpoint has no {aliases[0]} (for {weight.qkv}); is it a "
            f"{family.name} checkpoint of this size?"
        )
    return present


def export(model: nn.Module, family: Family, config) -> dict[str, Tensor]:
    """The model's weights under their canonical checkpoint names and layouts."""
    targets = dict(model.named_buffers()) | dict(model.named_parameters())
    out = {}
    for weight in family.weights(config):
        value = weight.save(targets[weight.qkv].detach())
        if weight.parts:
            for name, part in zip(weight.names, value, strict=True):
                out[name] = part.contiguous()
        else:
            out[weight.names[0]] = value.contiguous()
    return out

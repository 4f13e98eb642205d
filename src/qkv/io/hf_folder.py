"""Hugging Face folders and model ids: config.json + weights + tokenizer.json, in and out.

Files on disk, read and written without transformers; `qkv.hf` is the other way round
(qkv's attention inside a transformers model)."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from qkv.io.build import build, with_backend
from qkv.io.checkpoint import export, read_checkpoint, weight_bytes
from qkv.io.families import Family, family_for
from qkv.io.families.checks import check_weight_bytes, family_config
from qkv.io.files import write_folder_atomically
from qkv.io.json_file import read_json
from qkv.io.linear_layers import with_linear_layers

# what a model needs from a hub repository; everything else there is left alone
HUB_FILES = ["*.json", "*.safetensors", "pytorch_model.bin", "1_Pooling/*", "*.txt"]


@dataclass(frozen=True)
class Pooling:
    """How a sentence-transformers model turns token vectors into one sentence vector."""

    mode: str = "mean"  # "mean", "cls" or "max"
    normalize: bool = False  # scale each sentence vector to length 1
    max_length: int | None = None  # sentence_bert_config.json's max_seq_length: tokens read


def read_config(folder: Path) -> dict:
    path = Path(folder) / "config.json"
    if not path.exists():
        raise ValueError(f"{folder} is not a Hugging Face model folder: config.json is missing")
    hf = read_json(path)
    if not isinstance(hf, dict):
        raise ValueError(f"{path} holds a JSON {type(hf).__name__}; a config is a JSON object")
    return hf


def read_pooling(folder: Path) -> Pooling | None:
    """The pooling a sentence-transformers folder declares (modules.json), if any, with the
    tokens it reads per sentence (sentence_bert_config.json's max_seq_length).

    Every file read lies in a folder inside `folder` (symlinks resolved): modules.json is
    data, and may not send qkv elsewhere. The files may be links, as the hub's cache makes.
    """
    folder = Path(folder)
    modules_file = folder / "modules.json"
    if not modules_file.exists():
        return None
    modules = _read_module_json(modules_file, list)
    if not all(isinstance(m, dict) for m in modules):
        raise ValueError(f"{modules_file} should hold a list of modules like {{'path': ...}}")
    pooling, normalize, max_length = Pooling(), False, None
    for module in modules:
        kind = str(module.get("type", ""))
        if kind.endswith("Pooling"):
            settings = _read_module_json(_module_folder(folder, module) / "config.json")
            modes = [m for m in ("cls", "max", "mean") if settings.get(f"pooling_mode_{m}_token")
                     or settings.get(f"pooling_mode_{m}_tokens")]  # fmt: skip
            if len(modes) != 1:
                raise ValueError(f"unsupported sentence-transformers pooling: {settings}")
            pooling = Pooling(mode=modes[0])
        elif kind.endswith("Normalize"):
            normalize = True
        elif kind.endswith("Transformer"):
            settings_file = _module_folder(folder, module) / "sentence_bert_config.json"
            if settings_file.exists():
                max_length = _read_module_json(settings_file).get("max_seq_length")
                if max_length is not None and (type(max_length) is not int or max_length < 1):
                    raise ValueError(
                        f"{settings_file}: max_seq_length should be a whole number >= 1, "
                        f"not {max_length!r}"
                    )
    return replace(pooling, normalize=normalize, max_length=max_length)


_MODULE_FILE_LIMIT = 2**20  # modules.json and the settings beside it are small


def _module_folder(folder: Path, module: dict) -> Path:
    """A module's folder as modules.json names it, refused unless it lies inside `folder`."""
    name = module.get("path", "")
    if not isinstance(name, str):
        raise ValueError(f"{folder / 'modules.json'} names a module path that is no text: {name!r}")
    path = folder / name
    if not path.resolve().is_relative_to(folder.resolve()):
        raise ValueError(
            f"{folder / 'modules.json'} names the path {name!r}, which lies outside the model "
            f"folder {folder} (at {path.resolve()}); a module must be inside it"
        )
    return path


def _read_module_json(path: Path, kind: type = dict):
    """A sentence-transformers JSON file: a ValueError naming it if it is missing, too large,
    not a plain file (a device such as /dev/zero never ends) or not JSON."""
    if not path.is_file():
        raise ValueError(f"{path} is missing or not a file; modules.json asks for it")
    if path.stat().st_size > _MODULE_FILE_LIMIT:
        raise ValueError(f"{path} is over {_MODULE_FILE_LIMIT:,} bytes; is it the right file?")
    data = read_json(path)
    if not isinstance(data, kind):
        what = "an object" if kind is dict else "a list"
        raise ValueError(f"{path} should hold {what}, not {type(data).__name__}")
    return data


def download(model_id: str) -> Path:
    """A hub model's folder from the local cache, downloading it unless offline."""
    # huggingface_hub's download machinery loads only for a hub id (about 0.3 s)
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError, RepositoryNotFoundError

    try:
        return Path(snapshot_download(model_id, allow_patterns=HUB_FILES))
    except LocalEntryNotFoundError:
        raise ValueError(
            f"{model_id!r} is not in the Hugging Face cache and cannot be downloaded "
            "(offline: HF_HUB_OFFLINE is set or the hub is unreachable)"
        ) from None
    except RepositoryNotFoundError:
        raise ValueError(f"no Hugging Face model {model_id!r}") from None


def save_folder(
    folder: Path, model: nn.Module, family: Family, config, hf_config: dict, tokenizer
) -> None:
    """Write a Hugging Face folder that `transformers` loads; all or nothing."""
    folder = Path(folder)
    if folder.exists() and any(folder.iterdir()):  # before the work of exporting
        raise ValueError(f"{folder} exists and is not empty; choose a new folder")

    def write(staging: Path) -> None:
        tensors = {k: v.to(torch.float32) for k, v in export(model, family, config).items()}
        save_file(tensors, staging / "model.safetensors", metadata={"format": "pt"})
        hf = {k: v for k, v in hf_config.items() if k != "quantization_config"}
        (staging / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
        tokenizer.save(staging)

    write_folder_atomically(folder, write)


def load_folder(folder: Path, dtype: torch.dtype, backend: str | None):
    """(model, family, qkv config, Hugging Face config) from a Hugging Face folder."""
    hf_config = read_config(folder)
    family = with_linear_layers(family_for(hf_config), hf_config)
    config = with_backend(family_config(family, hf_config, Path(folder) / "config.json"), backend)
    check_weight_bytes(config, weight_bytes(folder), Path(folder) / "config.json")
    model = build(family, config, read_checkpoint(folder), dtype)
    return model, family, config, hf_config

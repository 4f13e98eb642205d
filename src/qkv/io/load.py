"""`qkv.load`'s reading half: a source resolved and read into a model and its tokenizer.

A source is an embedded name ("minilm", "smollm2"), a Hugging Face folder, a .gguf file,
a Hugging Face model id (downloaded once, then cached) or a qkv training-run folder (its
last checkpoint). `qkv.pretrained.load` wraps what this returns in a `Pretrained`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from qkv.io import runs
from qkv.io.build import build, with_backend
from qkv.io.embedded import EMBEDDED, embedded_path
from qkv.io.families import Family, family_for
from qkv.io.families.checks import family_config
from qkv.io.hf_folder import Pooling, download, load_folder, read_pooling
from qkv.io.int4 import BLOCK_TYPES, use_blocks, use_int4
from qkv.io.tokenizer import Tokenizer
from qkv.nn.quant_linear import in_generation

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class Loaded:
    """What a `Pretrained` is made of."""

    model: nn.Module
    tokenizer: Tokenizer
    config: object  # the qkv model config
    family: Family
    hf_config: dict  # the config.json (or a GGUF file's translation of its header)
    source: str  # as the caller named it
    pooling: Pooling | None = None  # a sentence-transformers folder's pooling
    run: Path | None = None  # the training-run folder the checkpoint came from
    # a .gguf file whose 4-bit matrices the model holds dequantized (loaded without int4):
    # what `Pretrained.generate(precision="auto")` decodes with on the CPU
    four_bit_file: Path | None = None
    four_bit_digest: str = ""  # that file's SHA-256, which names its cache of 4-bit matrices


def load_source(
    source: str | Path,
    *,
    dtype: str | torch.dtype = "float32",
    backend: str | None = None,
    int4: bool = False,
) -> Loaded:
    """Resolve `source` and read it; the arguments are `qkv.load`'s.

    >>> loaded = load_source("minilm")
    >>> loaded.family.name, loaded.config.num_layers, loaded.pooling.mode
    ('bert', 6, 'mean')
    """
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"unknown dtype {dtype!r}; allowed: {', '.join(DTYPES)}")
        dtype = DTYPES[dtype]
    name = str(source)
    path = embedded_path(name) if name in EMBEDDED else Path(name).expanduser()
    if path.suffix == ".gguf" or (path.is_file() and name.endswith(".gguf")):
        return _load_gguf(path, name, dtype, backend, int4)
    if int4:
        raise ValueError(f"int4 keeps the 4-bit weights of a .gguf file; {name} is not one")
    if not path.exists():
        if path.suffix or name.startswith((".", "/", "~")) or name.count("/") > 1:
            raise ValueError(
                f"{name} does not exist; give an embedded model ({', '.join(EMBEDDED)}), "
                "a Hugging Face folder, a .gguf file or a Hugging Face model id"
            )
        path = download(name)
    if not path.is_dir():
        raise ValueError(f"{name} is neither a folder nor a .gguf file")
    run = None
    if runs.is_run(path):
        run, path = path, runs.last_checkpoint(path)
    model, family, config, hf_config = load_folder(path, dtype, backend)
    return Loaded(model, Tokenizer.from_folder(path), config, family, hf_config, name,
                  pooling=read_pooling(path), run=run)  # fmt: skip


def _load_gguf(path: Path, name: str, dtype: torch.dtype, backend, int4: bool) -> Loaded:
    # the gguf package (0.3 s to import) loads only for a .gguf file
    from qkv.io.gguf import read_blocks, read_gguf, read_int4

    contents = read_gguf(path)
    family = family_for(contents.config)
    config = with_backend(family_config(family, contents.config, path), backend)
    model = build(family, config, contents.state_dict, dtype)
    if int4 and in_generation():  # the file's own blocks (not where QKV_NATIVE=0)
        use_blocks(model, family, config, read_blocks(path, BLOCK_TYPES), name)
    elif int4:
        use_int4(model, family, config, read_int4(path), name)
    tokenizer = Tokenizer(contents.tokenizer, **contents.tokenizer_config, copy=False)
    four_bit_file = path if contents.four_bit and not int4 else None
    return Loaded(model, tokenizer, config, family, contents.config, name,
                  four_bit_file=four_bit_file, four_bit_digest=contents.digest)  # fmt: skip

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
from qkv.io.tokenizer import Tokenizer
from qkv.nn.quantized import Int4Linear, Int8Linear, int4_available, int8_available

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
    from qkv.io.gguf import read_gguf, read_int4

    contents = read_gguf(path)
    family = family_for(contents.config)
    config = with_backend(family_config(family, contents.config, path), backend)
    model = build(family, config, contents.state_dict, dtype)
    if int4:
        use_int4(model, family, config, read_int4(path), name)
    tokenizer = Tokenizer(contents.tokenizer, **contents.tokenizer_config, copy=False)
    four_bit_file = path if contents.four_bit and not int4 else None
    return Loaded(model, tokenizer, config, family, contents.config, name,
                  four_bit_file=four_bit_file, four_bit_digest=contents.digest)  # fmt: skip


def use_int4(model: nn.Module, family: Family, config, groups: dict, name: str) -> None:
    """Swap each Linear whose checkpoint matrix is 4-bit for an Int4Linear of its bits (its
    bias kept). A block's query, key and value matrices become one Int4Linear (`attn.qkv`),
    and its gate and up matrices one (`mlp.gate_up`), where all of them are 4-bit: at one
    token a kernel call costs about as much as reading a small matrix, so 4 calls a block
    instead of 7 make a faster token, with the same numbers (each output row is its own).
    The LM head runs in 8 bits (`Int8Linear`: a scale per row)."""
    if not int4_available():
        raise ValueError(f"int4 needs torch >= 2.6 (this is {torch.__version__})")
    parameter_of = {weight.names[0]: weight.qkv for weight in family.weights(config)}
    four_bit = {}  # the module path of each Linear held in 4 bits: (q, scale, zero, bias)
    for hf_name, (q, scale, zero) in groups.items():
        owner, _, attribute = parameter_of.get(hf_name, "").rpartition(".")  # e.g. blocks.0.attn.q
        linear = model.get_submodule(owner) if attribute == "weight" else None
        if isinstance(linear, nn.Linear):
            four_bit[owner] = (q, scale, zero, linear.bias)
    if not four_bit:
        raise ValueError(f"{name} has no Q4_0 or Q4_1 matrices to keep in 4 bits")
    for path, module in list(model.named_modules()):
        for parts, fused in ((("q", "k", "v"), "qkv"), (("gate", "up"), "gate_up")):
            names = [f"{path}.{part}" for part in parts]
            # self-attention's q, k, v read one x; cross-attention's k, v read the context
            if not all(n in four_bit for n in names) or hasattr(module, fused):
                continue
            if len({four_bit[n][0].shape[1] for n in names}) != 1:
                continue
            q, scale, zero, biases = zip(*(four_bit.pop(n) for n in names), strict=True)
            bias = None
            if any(b is not None for b in biases):
                bias = torch.cat([torch.zeros(len(rows)) if b is None else b.detach()
                                  for b, rows in zip(biases, q, strict=True)])  # fmt: skip
            setattr(module, fused, Int4Linear(torch.cat(q), torch.cat(scale), torch.cat(zero),
                                              bias))  # fmt: skip
            for part in parts:  # MultiHeadAttention keeps its sizes; chunk(2) splits gate_up
                delattr(module, part)
    for owner, (q, scale, zero, bias) in four_bit.items():
        parent, _, child = owner.rpartition(".")
        setattr(model.get_submodule(parent), child, Int4Linear(q, scale, zero, bias))
    head = getattr(model, "lm_head", None)
    if isinstance(head, nn.Linear) and int8_available():
        # the head in 8 bits, as llama.cpp's files keep it (Q8_0): a tied token matrix stays
        # float32 for the embedding lookup, which reads one row a token
        model.lm_head = Int8Linear(head.weight, head.bias)

"""A llama.cpp `.gguf` file of the Llama architecture, read into what a Hugging Face folder holds.

The config, tokenizer and tokenizer settings come from the file's header; the tensors are
dequantized to float32 (`qkv.io.quants`), renamed to `LlamaForCausalLM`'s names, and the query
and key rows llama.cpp interleaved for its rotary kernel are put back in Hugging Face's order.
The dequantized state dict is cached as safetensors, keyed by the file's sha256, so the second
read of a file costs a hash and a memory map.

>>> from qkv.io.embedded import embedded_path
>>> model = read_gguf(embedded_path("smollm2"))  # SmolLM2-135M-Instruct.Q4_1.gguf
>>> model.config["num_attention_heads"], model.config["num_key_value_heads"]
(9, 3)
>>> model.tokenizer.encode("<|im_start|>user").ids
[1, 4093]

The header is parsed here rather than by `gguf.GGUFReader`, which builds a numpy array per
vocabulary string: 2.1 s for SmolLM2's 49k tokens and 49k merges, against 0.09 s here.
"""

from __future__ import annotations

import hashlib
import logging
import mmap
import os
import re
import struct
from collections.abc import Callable
from dataclasses import dataclass
from math import prod
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
from torch import Tensor

from qkv.io.files import write_atomically
from qkv.io.gguf_tokenizer import gguf_tokenizer
from qkv.io.quants import INT4_TYPES, SUPPORTED, dequantize, int4_groups

if TYPE_CHECKING:
    from tokenizers import Tokenizer

logger = logging.getLogger(__name__)

_CACHE_FORMAT = "qkv-gguf-1"  # bump when the cached tensors would come out differently


@dataclass
class GGUFModel:
    """What a Hugging Face folder would hold: config.json, the weights, the tokenizer."""

    config: dict[str, Any]  # a config.json dict for LlamaForCausalLM
    state_dict: dict[str, Tensor]  # LlamaForCausalLM names and layouts, float32
    tokenizer: Tokenizer  # built from the file's own vocabulary and merges
    tokenizer_config: dict[str, Any]  # bos/eos/pad/unk tokens, add_bos_token, chat_template


def read_gguf(
    path: str | os.PathLike,
    *,
    cache_dir: Path | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> GGUFModel:
    """Read a llama `.gguf` file; dequantized weights are cached under `cache_dir` (default
    `$XDG_CACHE_HOME/qkv/gguf`, else `~/.cache/qkv/gguf`). `progress(done, total)` is called
    after each tensor is dequantized, so never on a cache hit.

    >>> read_gguf("missing.gguf")
    Traceback (most recent call last):
    ...
    ValueError: missing.gguf does not exist
    """
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path} does not exist")
    data = _map(path)
    header = _read_header(data, path)
    arch = header.metadata.get("general.architecture")
    if arch != "llama":
        raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: llama")
    config = _llama_config(header)
    tokenizer, tokenizer_config = gguf_tokenizer(header.metadata, path)

    cache_dir = Path(cache_dir) if cache_dir is not None else _default_cache_dir()
    cache = cache_dir / f"{hashlib.sha256(data).hexdigest()}.safetensors"
    names = {
        _hf_name(info.name): info.shape for info in header.tensors if info.name not in _SKIPPED
    }
    state_dict = _load_cache(cache, names)
    if state_dict is None:
        state_dict = _state_dict(header, data, config, progress)
        _save_cache(cache, state_dict, path)
    return GGUFModel(config, state_dict, tokenizer, tokenizer_config)


def read_int4(path: str | os.PathLike) -> dict[str, tuple[Tensor, Tensor, Tensor]]:
    """The file's Q4_0 and Q4_1 matrices kept in 4 bits, under Hugging Face names:
    {name: (q, scale, zero)} as `quants.int4_groups` gives them, query and key rows in
    Hugging Face's order. Read straight from the file: nothing is dequantized or cached."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path} does not exist")
    data = _map(path)
    header = _read_header(data, path)
    config = _llama_config(header)
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    out = {}
    for info in header.tensors:
        if info.ggml_type not in INT4_TYPES or len(info.shape) != 2:
            continue
        raw = torch.frombuffer(data, dtype=torch.uint8, count=info.nbytes, offset=info.start)
        groups = int4_groups(raw.clone(), info.ggml_type, info.shape)
        part = info.name.split(".")[-2]
        if part in heads:
            groups = tuple(_unpermute(t, heads[part]) for t in groups)
        out[_hf_name(info.name)] = groups
    return out


def _default_cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "qkv" / "gguf"


# ---- the header: metadata and the tensor table --------------------------------------------


class _TensorInfo(NamedTuple):
    name: str
    shape: tuple[int, ...]  # torch order: ggml lists dimensions fastest-moving first
    ggml_type: GGMLQuantizationType
    start: int  # byte offset in the file
    nbytes: int


class _Header(NamedTuple):
    metadata: dict[str, Any]
    tensors: list[_TensorInfo]


V = GGUFValueType
_SCALAR = {V.UINT8: "B", V.INT8: "b", V.UINT16: "H", V.INT16: "h", V.UINT32: "I", V.INT32: "i"}
_SCALAR |= {V.FLOAT32: "f", V.BOOL: "?", V.UINT64: "Q", V.INT64: "q", V.FLOAT64: "d"}


def _map(path: Path) -> mmap.mmap | bytes:
    with open(path, "rb") as file:
        if os.fstat(file.fileno()).st_size == 0:
            return b""  # mmap refuses empty files
        # copy-on-write, so torch can wrap it without warning; nothing ever writes to it
        return mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_COPY)


def _read_header(data: mmap.mmap | bytes, path: Path) -> _Header:
    """Parse the metadata and tensor table (GGUF v2 and v3, little-endian); check that every
    tensor lies inside the file."""
    if data[:4] != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file: it does not start with b'GGUF'")
    pos = 4

    def take(fmt: str) -> tuple:
        nonlocal pos
        values = struct.unpack_from("<" + fmt, data, pos)  # struct.error past the end
        pos += struct.calcsize("<" + fmt)
        return values

    def string() -> str:
        nonlocal pos
        (length,) = take("Q")
        if pos + length > len(data):
            raise struct.error("string runs past the end")
        pos += length
        return data[pos - length : pos].decode("utf-8")

    def value(kind: int) -> Any:
        if kind in _SCALAR:
            return take(_SCALAR[kind])[0]
        if kind == V.STRING:
            return string()
        if kind == V.ARRAY:
            item, count = take("IQ")
            if count > len(data) - pos:  # every element takes at least a byte
                raise struct.error("array runs past the end")
            if item in _SCALAR:
                return list(take(f"{count}{_SCALAR[item]}"))
            return [value(item) for _ in range(count)]
        raise ValueError(f"{path} is corrupt: unknown metadata value type {kind}")

    try:
        version, tensor_count, kv_count = take("IQQ")
        if version not in (2, 3):
            raise ValueError(f"{path} is GGUF version {version}; supported: 2, 3")
        metadata = {}
        for _ in range(kv_count):
            key = string()
            metadata[key] = value(take("I")[0])
        table = []
        for _ in range(tensor_count):
            name = string()
            (n_dims,) = take("I")
            dims = take(f"{n_dims}Q")
            kind, offset = take("IQ")
            table.append((name, tuple(reversed(dims)), kind, offset))
    except struct.error:
        raise ValueError(f"{path} is truncated: its header ends early") from None
    except UnicodeDecodeError:
        raise ValueError(f"{path} is corrupt: a header string is not UTF-8") from None

    alignment = metadata.get("general.alignment", 32)
    if not isinstance(alignment, int) or alignment <= 0:
        raise ValueError(f"{path} is corrupt: general.alignment is {alignment!r}")
    data_start = -(-pos // alignment) * alignment  # the tensor data starts aligned
    tensors = []
    for name, shape, kind, offset in table:
        try:
            ggml_type = GGMLQuantizationType(kind)
        except ValueError:
            raise ValueError(f"{path} is corrupt: tensor {name} has unknown type {kind}") from None
        block_size, type_size = GGML_QUANT_SIZES[ggml_type]
        nbytes = prod(shape) // block_size * type_size
        tensors.append(_TensorInfo(name, shape, ggml_type, data_start + offset, nbytes))
    end = max((info.start + info.nbytes for info in tensors), default=data_start)
    if end > len(data):
        raise ValueError(f"{path} is truncated: its tensors need {end} bytes, it has {len(data)}")
    return _Header(metadata, tensors)


# ---- config and weights ---------------------------------------------------------------------


def _llama_config(header: _Header) -> dict[str, Any]:
    """The config.json Hugging Face's LlamaForCausalLM would come with."""
    meta = header.metadata

    def get(key: str, default: Any = None) -> Any:
        if f"llama.{key}" in meta:
            return meta[f"llama.{key}"]
        if default is None:
            raise ValueError(f"the GGUF metadata has no llama.{key}")
        return default

    hidden, heads = get("embedding_length"), get("attention.head_count")
    names = {info.name for info in header.tensors}
    vocab = meta.get("tokenizer.ggml.tokens") or []
    return {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden,
        "intermediate_size": get("feed_forward_length"),
        "num_hidden_layers": get("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": get("attention.head_count_kv", heads),
        "head_dim": get("attention.key_length", get("rope.dimension_count", hidden // heads)),
        "hidden_act": "silu",
        "rms_norm_eps": get("attention.layer_norm_rms_epsilon"),
        "rope_theta": get("rope.freq_base", 10000.0),
        "max_position_embeddings": get("context_length"),
        "vocab_size": get("vocab_size", len(vocab)),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
        "mlp_bias": "blk.0.ffn_up.bias" in names,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
        "unk_token_id": meta.get("tokenizer.ggml.unknown_token_id"),
    }


_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# llama 3's precomputed rotary frequency factors: not a weight in Hugging Face's layout
_SKIPPED = {"rope_freqs.weight"}


def _hf_name(name: str) -> str:
    """'blk.3.attn_q.weight' -> 'model.layers.3.self_attn.q_proj.weight'"""
    stem, _, suffix = name.rpartition(".")
    if stem in _TOP:
        return f"{_TOP[stem]}.{suffix}"
    match = re.fullmatch(r"blk\.(\d+)\.(\w+)", stem)
    if match and match[2] in _LAYER:
        return f"model.layers.{match[1]}.{_LAYER[match[2]]}.{suffix}"
    raise ValueError(f"unsupported tensor {name!r} in a llama GGUF file")


def _unpermute(w: Tensor, n_head: int) -> Tensor:
    """Undo llama.cpp's rotary row order. Hugging Face keeps each head's rows in two halves
    (rotate_half pairs row i with row i + D/2); llama.cpp interleaves them so pairs sit side
    by side: (H, 2, D/2) -> (H, D/2, 2). This is the inverse, on (H * D, ...) rows."""
    rows, rest = w.shape[0], w.shape[1:]
    if rows % (2 * n_head):
        raise ValueError(
            f"a query or key tensor has {rows} rows, not a multiple of 2 * {n_head} heads"
        )
    w = w.reshape(n_head, rows // n_head // 2, 2, *rest)  # (H, D/2, 2, ...)
    return w.transpose(1, 2).reshape(-1, *rest).contiguous()  # (H * D, ...), halves apart


def _state_dict(
    header: _Header,
    data: mmap.mmap | bytes,
    config: dict[str, Any],
    progress: Callable[[int, int], None] | None,
) -> dict[str, Tensor]:
    kept = [info for info in header.tensors if info.name not in _SKIPPED]
    for info in kept:
        _hf_name(info.name)  # unknown names fail before any work is done
        if info.ggml_type not in SUPPORTED:
            supported = ", ".join(t.name for t in SUPPORTED)
            raise ValueError(
                f"tensor {info.name} is {info.ggml_type.name}, which qkv cannot dequantize; "
                f"supported: {supported}"
            )
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    state_dict = {}
    for done, info in enumerate(kept, start=1):
        raw = torch.frombuffer(data, dtype=torch.uint8, count=info.nbytes, offset=info.start)
        weight = dequantize(raw, info.ggml_type, info.shape)
        part = info.name.split(".")[-2]
        if part in heads:
            weight = _unpermute(weight, heads[part])
        state_dict[_hf_name(info.name)] = weight
        if progress is not None:
            progress(done, len(kept))
    return state_dict


# ---- the cache ------------------------------------------------------------------------------


def _load_cache(cache: Path, shapes: dict[str, tuple[int, ...]]) -> dict[str, Tensor] | None:
    """The cached state dict, or None if there is none or it is damaged (then it is rebuilt)."""
    if not cache.is_file():
        return None
    from safetensors import safe_open

    try:
        with safe_open(cache, framework="pt") as file:
            if (file.metadata() or {}).get("format") != _CACHE_FORMAT:
                return None
            state_dict = file.get_tensors()  # memory-mapped, copy-on-write
    except Exception:  # safetensors raises its own error, OSError, or others for bad bytes
        return None
    if {name: tuple(t.shape) for name, t in state_dict.items()} != shapes or any(
        t.dtype != torch.float32 for t in state_dict.values()
    ):
        return None
    return state_dict


def _save_cache(cache: Path, state_dict: dict[str, Tensor], source: Path) -> None:
    """Write the cache all or nothing. A cache that cannot be written is only logged: the
    caller has its weights either way."""
    from safetensors.torch import save_file

    metadata = {"format": _CACHE_FORMAT, "source": source.name}
    try:  # safetensors writes only to a path: the temporary file's
        write_atomically(cache, lambda file: save_file(state_dict, file.name, metadata=metadata))
    except OSError as error:
        logger.warning("could not write the GGUF cache %s: %s", cache, error)

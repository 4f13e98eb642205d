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

Nothing is dequantized, cached or allocated for the tensors until the header
(`qkv.io.gguf_header`), the config it implies and the tensor table agree with each other and
with the file's size.
"""

from __future__ import annotations

import hashlib
import logging
import mmap
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from qkv.io.families import llama
from qkv.io.families.checks import family_config
from qkv.io.files import write_atomically
from qkv.io.gguf_header import Header, read_header
from qkv.io.gguf_tokenizer import gguf_tokenizer
from qkv.io.quants import INT4_TYPES, SUPPORTED, dequantize, int4_groups

if TYPE_CHECKING:
    from tokenizers import Tokenizer

    from qkv.models import DecoderConfig

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
    data, header, config = _open(path)
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
    data, header, config = _open(Path(path))
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


def _map(path: Path) -> mmap.mmap | bytes:
    with open(path, "rb") as file:
        if os.fstat(file.fileno()).st_size == 0:
            return b""  # mmap refuses empty files
        # copy-on-write, so torch can wrap it without warning; nothing ever writes to it
        return mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_COPY)


def _open(path: Path) -> tuple[mmap.mmap | bytes, Header, dict[str, Any]]:
    """The file mapped, its header, and its config.json translation, all checked against
    each other before anything is read or allocated for the tensors. The config's values
    are the checked ones, defaults filled in (num_key_value_heads, head_dim)."""
    if not path.is_file():
        raise ValueError(f"{path} does not exist")
    data = _map(path)
    header = read_header(data, path)
    arch = header.metadata.get("general.architecture")
    if arch != "llama":
        raise ValueError(f"{path}: unsupported GGUF architecture {arch!r}; supported: llama")
    config, names = _llama_config(header)
    if "rms_norm_eps" not in config:  # llama.cpp requires it too: no default is safe
        raise ValueError(f"{path}: the header has no {names['rms_norm_eps']}")
    cfg = family_config(llama.FAMILY, config, path, names)
    _check_tensors(header, cfg, path)
    block = cfg.block
    config |= {
        "hidden_size": block.width,
        "intermediate_size": block.mlp_hidden,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": block.num_heads,
        "num_key_value_heads": block.kv_heads,
        "head_dim": block.head_size,
        "rms_norm_eps": block.norm_eps,
        "rope_theta": cfg.rope_base,
        "max_position_embeddings": cfg.max_positions,
        "vocab_size": cfg.vocab_size,
    }
    return data, header, config


# ---- config and weights ---------------------------------------------------------------------


# the header's own key of each config.json value (under "llama.")
_KEYS = {
    "hidden_size": "embedding_length",
    "intermediate_size": "feed_forward_length",
    "num_hidden_layers": "block_count",
    "num_attention_heads": "attention.head_count",
    "num_key_value_heads": "attention.head_count_kv",
    "rms_norm_eps": "attention.layer_norm_rms_epsilon",
    "rope_theta": "rope.freq_base",
    "max_position_embeddings": "context_length",
    "vocab_size": "vocab_size",
}


def _llama_config(header: Header) -> tuple[dict[str, Any], dict[str, str]]:
    """The config.json Hugging Face's LlamaForCausalLM would come with, and the header key
    each value came from. Values are copied as they are: `llama.config` checks them."""
    meta = header.metadata
    config: dict[str, Any] = {"model_type": "llama", "architectures": ["LlamaForCausalLM"]}
    names = {key: f"llama.{name}" for key, name in _KEYS.items()}
    for key, name in _KEYS.items():
        if f"llama.{name}" in meta:
            config[key] = meta[f"llama.{name}"]
    for name in ("attention.key_length", "rope.dimension_count"):
        if f"llama.{name}" in meta:
            config["head_dim"], names["head_dim"] = meta[f"llama.{name}"], f"llama.{name}"
            break
    tokens = meta.get("tokenizer.ggml.tokens")
    if "vocab_size" not in config and isinstance(tokens, list):
        config["vocab_size"], names["vocab_size"] = len(tokens), "tokenizer.ggml.tokens"
    tensor_names = {info.name for info in header.tensors}
    config |= {
        "hidden_act": "silu",
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": "blk.0.attn_q.bias" in tensor_names,
        "mlp_bias": "blk.0.ffn_up.bias" in tensor_names,
    }
    for name, key in [("bos", "bos"), ("eos", "eos"), ("pad", "padding"), ("unk", "unknown")]:
        config[f"{name}_token_id"] = meta.get(f"tokenizer.ggml.{key}_token_id")
    return config, names


def _expected_shapes(cfg: DecoderConfig, layer: int) -> dict[str, tuple[int, ...]]:
    """What LlamaForCausalLM needs of one layer's tensors, in torch order."""
    block = cfg.block
    C, F = block.width, block.mlp_hidden or 4 * block.width
    q, kv = block.num_heads * block.head_size, block.kv_heads * block.head_size
    shapes = {"attn_norm": (C,), "ffn_norm": (C,), "attn_q": (q, C), "attn_k": (kv, C),
              "attn_v": (kv, C), "attn_output": (C, q), "ffn_gate": (F, C), "ffn_up": (F, C),
              "ffn_down": (C, F)}  # fmt: skip
    return {f"blk.{layer}.{part}.weight": shape for part, shape in shapes.items()}


def _check_tensors(header: Header, cfg: DecoderConfig, path: Path) -> None:
    """The tensor table holds what the architecture needs, in the shapes it needs: no more,
    no less. The count is compared first, so a header claiming 10^9 blocks is refused
    without listing what they would need."""
    kept = [info for info in header.tensors if info.name not in _SKIPPED]
    for info in kept:
        try:
            _hf_name(info.name)  # unknown names are refused by name
        except ValueError as error:
            raise ValueError(f"{path}: {error}") from None
    needed = 2 + (not cfg.tie_embeddings) + 9 * cfg.num_layers
    if len(kept) != needed:
        raise ValueError(
            f"{path} has {len(kept)} weight tensors, but its header (llama.block_count="
            f"{cfg.num_layers}) needs {needed:,}"
        )
    C, V = cfg.block.width, cfg.vocab_size
    shapes = {"token_embd.weight": (V, C), "output_norm.weight": (C,)}
    if not cfg.tie_embeddings:
        shapes["output.weight"] = (V, C)
    for layer in range(cfg.num_layers):  # bounded: the count matched a table of real entries
        shapes |= _expected_shapes(cfg, layer)
    for info in kept:
        if info.name not in shapes:
            raise ValueError(f"{path} has the tensor {info.name}, which its header does not need")
        if info.shape != shapes[info.name]:
            raise ValueError(
                f"{path}: tensor {info.name} has shape {info.shape}, but the header's config "
                f"needs {shapes[info.name]}"
            )


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
    header: Header,
    data: mmap.mmap | bytes,
    config: dict[str, Any],
    progress: Callable[[int, int], None] | None,
) -> dict[str, Tensor]:
    kept = [info for info in header.tensors if info.name not in _SKIPPED]
    for info in kept:  # before any work is done
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
    """Write the cache all or nothing: streamed, one tensor at a time, into a temporary file
    that is renamed into place only when whole. A cache that cannot be written is only
    logged: the caller has its weights either way."""
    try:
        write_atomically(cache, lambda file: _write_safetensors(file, state_dict, source))
    except OSError as error:
        logger.warning("could not write the GGUF cache %s: %s", cache, error)


def _write_safetensors(file, state_dict: dict[str, Tensor], source: Path) -> None:
    """The safetensors format (an 8-byte header length, a JSON header, the raw bytes),
    written into `file` itself: safetensors' own save_file writes only to a path, through a
    file of its own that a failure could leave behind."""
    import json

    header: dict[str, Any] = {"__metadata__": {"format": _CACHE_FORMAT, "source": source.name}}
    offset = 0
    for name, tensor in state_dict.items():
        assert tensor.dtype == torch.float32, (name, tensor.dtype)
        nbytes = tensor.numel() * 4
        header[name] = {"dtype": "F32", "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + nbytes]}  # fmt: skip
        offset += nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned
    file.write(len(encoded).to_bytes(8, "little") + encoded)
    for tensor in state_dict.values():
        file.write(tensor.contiguous().view(torch.uint8).numpy().data)

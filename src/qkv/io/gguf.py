"""A llama.cpp `.gguf` file, read into what a Hugging Face folder holds.

The architectures are those llama.cpp writes for the families qkv reads (llama, qwen2,
qwen3, phi3, gemma, gemma2, gemma3: `qkv.io.gguf_arch`). The config, tokenizer and tokenizer
settings come from the file's header; the tensors are dequantized to float32
(`qkv.io.quants`), renamed to the Hugging Face model's names, and what llama.cpp's convert
script changed is undone: the query and key rows it interleaved for Llama's rotary kernel
are put back in Hugging Face's order, Gemma's norm weights lose the 1 it added.
The dequantized state dict is cached as safetensors, keyed by the file's sha256, so the second
read of a file costs a memory map (and the hash, the first time the file is seen as it is
now: `file_digest`).

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

import copy
import hashlib
import json
import logging
import mmap
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open
from torch import Tensor

from qkv.io.build import NoRandomInit
from qkv.io.families import family_for
from qkv.io.families.checks import family_config
from qkv.io.files import write_atomically
from qkv.io.gguf_arch import ROPE_TENSORS, Arch, arch_of, rope_tensors
from qkv.io.gguf_header import Header, TensorInfo, read_header
from qkv.io.gguf_moe import experts_bounded
from qkv.io.gguf_tokenizer import gguf_tokenizer
from qkv.io.int4 import FOUR_BIT
from qkv.io.quants import INT4_TYPES, SUPPORTED, dequantize, int4_groups

if TYPE_CHECKING:
    from tokenizers import Tokenizer


logger = logging.getLogger(__name__)

_CACHE_FORMAT = "qkv-gguf-1"  # bump when the cached tensors would come out differently


@dataclass
class GGUFModel:
    """What a Hugging Face folder would hold: config.json, the weights, the tokenizer."""

    config: dict[str, Any]  # the config.json of the Hugging Face model (`Arch.architecture`)
    state_dict: dict[str, Tensor]  # that model's names and layouts, float32
    tokenizer: Tokenizer  # built from the file's own vocabulary and merges
    tokenizer_config: dict[str, Any]  # bos/eos/pad/unk tokens, add_bos_token, chat_template
    four_bit: int = 0  # how many of its matrices generation keeps in 4 bits (below)
    digest: str = ""  # the file's SHA-256: what names its caches


def read_gguf(
    path: str | os.PathLike,
    *,
    cache_dir: Path | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> GGUFModel:
    """Read a `.gguf` file of an architecture in `qkv.io.gguf_arch.ARCHES`; dequantized
    weights are cached under `cache_dir` (default `$XDG_CACHE_HOME/qkv/gguf`, else
    `~/.cache/qkv/gguf`). `progress(done, total)` is called after each tensor is
    dequantized, so never on a cache hit.

    >>> read_gguf("missing.gguf")
    Traceback (most recent call last):
    ...
    ValueError: missing.gguf does not exist
    """
    path = Path(path)
    data, header, config, arch = _open(path)
    tokenizer, tokenizer_config = gguf_tokenizer(header.metadata, path)

    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    digest = file_digest(path, data, cache_dir)
    cache = cache_dir / f"{digest}.safetensors"
    state_dict = _load_cache(cache, _hf_shapes(header, arch))
    if state_dict is None:
        state_dict = _state_dict(header, data, config, arch, progress)
        _save_cache(cache, state_dict, path)
    # the matrices generation keeps as the file's blocks: Q4_0 and Q4_1 (torch's int4 kernel or
    # qkv's), Q4_K, Q5_K, Q5_0 and Q5_1 (qkv's kernels: a SmolLM2-sized Q4_K_M file's, whose 576
    # columns are no whole K-quant super-blocks, are mostly Q5_0); a load never builds them (4 s
    # in a fresh cache), nor qkv's kernels (`FourBits.why_not` asks at generation)
    four_bit = sum(info.ggml_type.name in FOUR_BIT and len(info.shape) == 2
                   for info in header.tensors)  # fmt: skip
    return GGUFModel(config, state_dict, tokenizer, tokenizer_config, four_bit, digest)


def int4_matrices(path: str | os.PathLike) -> int:
    """How many of the file's matrices torch's int4 kernel can keep (Q4_0, Q4_1)."""
    _, header, _, _ = _open(Path(path))
    return sum(info.ggml_type in INT4_TYPES and len(info.shape) == 2 for info in header.tensors)


def read_int4(path: str | os.PathLike) -> dict[str, tuple[Tensor, Tensor, Tensor]]:
    """The file's Q4_0 and Q4_1 matrices kept in 4 bits, under Hugging Face names:
    {name: (q, scale, zero)} as `quants.int4_groups` gives them, query and key rows in
    Hugging Face's order. Read straight from the file: nothing is dequantized or cached."""
    data, header, config, arch = _open(Path(path))
    heads = _permuted(arch, config)
    out = {}
    for info in header.tensors:
        if info.ggml_type not in INT4_TYPES or len(info.shape) != 2 or arch.join_of(info.name):
            continue
        raw = torch.frombuffer(data, dtype=torch.uint8, count=info.nbytes, offset=info.start)
        groups = int4_groups(raw.clone(), info.ggml_type, info.shape)
        part = info.name.split(".")[-2]
        if part in heads:
            groups = tuple(_unpermute(t, heads[part]) for t in groups)
        out[arch.hf_name(info.name)] = groups
    return out


def read_blocks(path: str | os.PathLike, types: tuple[str, ...]) -> dict[str, tuple[str, Tensor]]:
    """The file's matrices of the GGML `types` (names: "Q4_1", "Q8_0", ...) as the file
    holds them, under Hugging Face names: {name: (type, raw (rows, bytes per row) uint8)},
    query and key rows in Hugging Face's order (a row's blocks move with it). Read straight
    from the file: nothing is dequantized or cached."""
    data, header, config, arch = _open(Path(path))
    heads = _permuted(arch, config)
    out = {}
    for info in header.tensors:
        kind = info.ggml_type.name
        if kind not in types or len(info.shape) != 2 or arch.join_of(info.name):
            continue
        raw = torch.frombuffer(data, dtype=torch.uint8, count=info.nbytes, offset=info.start)
        raw = raw.view(info.shape[0], -1)  # each row's blocks, side by side
        part = info.name.split(".")[-2]
        out[arch.hf_name(info.name)] = (kind, _unpermute(raw, heads[part]) if part in heads
                                        else raw.clone())  # fmt: skip
    return out


# How long ago a file must have been written for `file_digest` to note its hash: a write
# within the same tick of a coarse clock (a FAT disk keeps 2 s) would leave its times as they
# were (git's "racy" files).
SETTLED_NS = 3 * 10**9


def file_digest(path: Path, data, cache_dir: Path) -> str:
    """The SHA-256 of `data`, the contents of the file at `path`, noted under cache_dir by
    what the file's status says of it: its device, inode, size, and the times it was last
    modified and changed, in nanoseconds. A later call for the file unchanged reads the
    note instead of hashing it again (0.07 s of every load of SmolLM2's 100 MB, a
    twentieth of `qkv generate`'s start). Written again, renamed over, touched or moved
    to another disk, a file has another change time or inode, which no program can set
    back, so it is hashed again. A file written in the last few seconds is hashed every
    time; a note that cannot be read or written is passed over."""
    try:
        before = _identity(path)
    except OSError:
        return hashlib.sha256(data).hexdigest()
    key = "|".join(str(n) for n in (path.resolve(), *before))
    note = cache_dir / "digests" / hashlib.sha256(key.encode()).hexdigest()[:32]
    try:
        with open(note, "rb") as file:
            noted = file.read(65)  # a digest is 64 hex digits: nothing longer is read
        if len(noted) == 64 and all(c in b"0123456789abcdef" for c in noted):
            return noted.decode()
    except OSError:
        pass
    digest = hashlib.sha256(data).hexdigest()
    settled = time.time_ns() - max(before[3:]) > SETTLED_NS
    try:
        if settled and _identity(path) == before:  # not written while it was hashed
            note.parent.mkdir(parents=True, exist_ok=True)
            write_atomically(note, lambda file: file.write(digest.encode()))
    except OSError as error:
        logger.info("could not note the hash of %s: %s", path, error)
    return digest


def _identity(path: Path) -> tuple[int, ...]:
    """(device, inode, size, modification time, change time): what tells one file's contents."""
    found = path.stat()
    return found.st_dev, found.st_ino, found.st_size, found.st_mtime_ns, found.st_ctime_ns


def default_cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "qkv" / "gguf"


def _map(path: Path) -> mmap.mmap | bytes:
    with open(path, "rb") as file:
        if os.fstat(file.fileno()).st_size == 0:
            return b""  # mmap refuses empty files
        # copy-on-write, so torch can wrap it without warning; nothing ever writes to it
        return mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_COPY)


# the last file _open read, by its path and `_identity`: its header is parsed once
# when `read_gguf` and then `read_int4` read one file (SmolLM2's vocabulary is 0.25 s of it)
_OPENED: dict[tuple, tuple] = {}


def _open(path: Path) -> tuple[mmap.mmap | bytes, Header, dict[str, Any], Arch]:
    """The file mapped, its header, its config.json translation and its architecture, all
    checked against each other before anything is read or allocated for the weights. The
    config's values are the checked ones, defaults filled in (num_key_value_heads, head_dim)."""
    if not path.is_file():
        raise ValueError(f"{path} does not exist")
    key = (str(path.resolve()), *_identity(path))
    if key not in _OPENED:
        opened = _read(path)
        _OPENED.clear()
        _OPENED[key] = opened
    data, header, config, arch = _OPENED[key]
    return data, header, copy.deepcopy(config), arch


def _read(path: Path) -> tuple[mmap.mmap | bytes, Header, dict[str, Any], Arch]:
    data = _map(path)
    header = read_header(data, path)
    arch = arch_of(header, path)
    config, names = arch.config(header)
    weights = sum(info.name not in ROPE_TENSORS for info in header.tensors)
    layers = config.get("num_hidden_layers")
    if type(layers) is int and layers > weights:  # before a family lists its layers' types
        raise ValueError(
            f"{path} has {weights} weight tensors, but its header ({names['num_hidden_layers']}"
            f"={layers:,}) needs at least one per layer"
        )
    if "rms_norm_eps" not in config:  # llama.cpp requires it too: no default is safe
        raise ValueError(f"{path}: the header has no {names['rms_norm_eps']}")
    rope_tensors(arch, config, _rope_factors(header, data))
    experts_bounded(arch.name, header, path)
    try:
        family = family_for(config)
    except ValueError as error:  # a family another session has not merged yet, say
        raise ValueError(f"{path}: {error}") from None
    cfg = family_config(family, config, path, names)
    _check_tensors(header, arch, family, cfg, path)
    block = cfg.block
    config |= {
        "hidden_size": block.width,
        "intermediate_size": block.mlp_hidden,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": block.num_heads,
        "num_key_value_heads": block.kv_heads,
        "head_dim": block.head_size,
        "rms_norm_eps": block.norm_eps,
        "max_position_embeddings": cfg.max_positions,
        "vocab_size": cfg.vocab_size,
    }
    if arch.latent:  # a latent head's size is its parts' (qk_*_head_dim), never head_dim
        del config["head_dim"]
    return data, header, config, arch


def _rope_factors(header: Header, data) -> dict[str, Tensor]:
    """The rotary factor tensors (a few dozen numbers each), read before the config is."""
    factors = {}
    for info in header.tensors:
        if info.name in ROPE_TENSORS:
            if info.ggml_type not in SUPPORTED or len(info.shape) != 1 or info.shape[0] > 4096:
                raise ValueError(f"tensor {info.name} should be a short list of float factors")
            raw = torch.frombuffer(data, dtype=torch.uint8, count=info.nbytes, offset=info.start)
            factors[info.name] = dequantize(raw, info.ggml_type, info.shape)
    return factors


# ---- config and weights ---------------------------------------------------------------------


def _check_tensors(header: Header, arch: Arch, family, cfg, path: Path) -> None:
    """The tensor table holds what the architecture needs, in the shapes it needs: no more,
    no less. What it needs is the family's weight map, each weight spelled in GGUF's names
    (`Arch.gguf_names`: one tensor, or the parts of a `Join`); the count is compared first.
    (A header claiming 10^9 blocks or experts was refused before: `_read`.)"""
    kept = [info for info in header.tensors if info.name not in ROPE_TENSORS]
    for info in kept:
        try:
            arch.hf_name(info.name)  # unknown names are refused by name
        except ValueError as error:
            raise ValueError(f"{path}: {error}") from None
    with torch.device("meta"), NoRandomInit():
        parameters = family.model(cfg).state_dict(keep_vars=True)
    needed: dict[str, tuple[int, ...]] = {}  # GGUF name -> its shape
    for weight in family.weights(cfg):
        spelled = [gguf for name in weight.names if (gguf := arch.gguf_names(name))]
        if not spelled:
            raise ValueError(
                f"{path}: the header's config needs {weight.canonical}, which a "
                f"{arch.name} GGUF file cannot hold"
            )
        gguf = spelled[0]
        whole = weight.save(parameters[weight.qkv])
        join = arch.join_of(gguf[0])
        parts = join.split(whole) if join is not None else [whole]
        needed |= {n: tuple(part.shape) for n, part in zip(gguf, parts, strict=True)}
    if len(kept) != len(needed):
        present = {info.name for info in kept}
        missing = next((f" (it lacks {name})" for name in needed if name not in present), "")
        raise ValueError(
            f"{path} has {len(kept)} weight tensors, but its header ({arch.name}.block_count="
            f"{cfg.num_layers}) needs {len(needed):,}{missing}"
        )
    for info in kept:
        if info.name not in needed:
            raise ValueError(f"{path} has the tensor {info.name}, which its header does not need")
        if info.shape != needed[info.name]:
            raise ValueError(
                f"{path}: tensor {info.name} has shape {info.shape}, but the header's config "
                f"needs {needed[info.name]}"
            )


def _hf_shapes(header: Header, arch: Arch) -> dict[str, tuple[int, ...]]:
    """{Hugging Face name: shape} of what the file's tensors make."""
    parts: dict[str, list[TensorInfo]] = {}
    for info in header.tensors:
        if info.name not in ROPE_TENSORS:
            parts.setdefault(arch.hf_name(info.name), []).append(info)
    shapes = {}
    for name, infos in parts.items():
        join = arch.join_of(infos[0].name)
        if join is None:
            shapes[name] = infos[0].shape
            continue
        order = sorted(infos, key=lambda info: join.parts.index(info.name.split(".", 2)[2]))
        meta = [torch.empty(info.shape, device="meta") for info in order]
        shapes[name] = tuple(join.join(meta).shape)
    return shapes


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


def _permuted(arch: Arch, config: dict[str, Any]) -> dict[str, int]:
    """{GGUF part: its head count} of the query and key rows llama.cpp interleaved."""
    if not arch.permute_qk:
        return {}
    return {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}


def _state_dict(
    header: Header,
    data: mmap.mmap | bytes,
    config: dict[str, Any],
    arch: Arch,
    progress: Callable[[int, int], None] | None,
) -> dict[str, Tensor]:
    kept = [info for info in header.tensors if info.name not in ROPE_TENSORS]
    for info in kept:  # before any work is done
        if info.ggml_type not in SUPPORTED:
            supported = ", ".join(t.name for t in SUPPORTED)
            raise ValueError(
                f"tensor {info.name} is {info.ggml_type.name}, which qkv cannot dequantize; "
                f"supported: {supported}"
            )
    heads = _permuted(arch, config)
    state_dict = {}
    waiting: dict[str, dict[str, Tensor]] = {}  # the parts of a Join read so far
    for done, info in enumerate(kept, start=1):
        raw = torch.frombuffer(data, dtype=torch.uint8, count=info.nbytes, offset=info.start)
        weight = dequantize(raw, info.ggml_type, info.shape)
        part = info.name.split(".")[-2]
        if part in heads:
            weight = _unpermute(weight, heads[part])
        name, weight = arch.hf_name(info.name), arch.restore(info.name, weight)
        join = arch.join_of(info.name)
        if join is None:
            state_dict[name] = weight
        else:  # all its parts are in the table (`_check_tensors`)
            parts = waiting.setdefault(name, {})
            parts[info.name.split(".", 2)[2]] = weight
            if len(parts) == len(join.parts):
                del waiting[name]
                state_dict[name] = join.join([parts[p] for p in join.parts]).contiguous()
        if progress is not None:
            progress(done, len(kept))
    return state_dict


# ---- the cache ------------------------------------------------------------------------------


def _load_cache(cache: Path, shapes: dict[str, tuple[int, ...]]) -> dict[str, Tensor] | None:
    """The cached state dict, or None if there is none or it is damaged (then it is rebuilt)."""
    if not cache.is_file():
        return None
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

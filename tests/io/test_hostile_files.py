"""Hostile model files (issue 14): each is refused with one ValueError naming the file and
what is wrong, in bounded time and memory, leaving nothing behind.

GGUF files are written here byte by byte (`gguf_file`), so a header can claim what no
writer would: 10^9 blocks, tensors on the same bytes, a 200 MB array. A case that would
allocate without bound on a loader lacking the checks runs as a `qkv` process under a
memory limit (`hostile.run_qkv`), so that it fails there and not on the machine.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf import GGUFValueType as V

import qkv
from hostile import assert_one_line_error, leftovers, run_qkv
from qkv.io.gguf import read_gguf
from qkv.io.hf_folder import load_folder
from tiny_models import save_tiny

# ---- GGUF files, byte by byte ---------------------------------------------------------------

_FORMATS = {V.UINT32: "I", V.INT32: "i", V.FLOAT32: "f", V.UINT64: "Q", V.BOOL: "?"}


def encode(kind: int, value) -> bytes:
    """One metadata value; an array is (item kind, [items]); bytes are written as they are."""
    if isinstance(value, bytes):
        return value
    if kind == V.STRING:
        raw = value.encode()
        return struct.pack("<Q", len(raw)) + raw
    if kind == V.ARRAY:
        item, items = value
        return struct.pack("<IQ", item, len(items)) + b"".join(encode(item, v) for v in items)
    return struct.pack("<" + _FORMATS[kind], value)


C, H, HKV, D, F, L = 32, 4, 2, 8, 48, 2  # width, heads, kv heads, head size, MLP, layers
TOKENS = ["<unk>", "<s>", "</s>", "a", "b", "c", "ab", "abc"]


def llama_metadata(**changes) -> dict[str, tuple[int, object]]:
    """A tiny llama header's metadata, {key: (value type, value)}; changes replace or add
    entries (a None drops one)."""
    meta = {
        "general.architecture": (V.STRING, "llama"),
        "llama.block_count": (V.UINT32, L),
        "llama.context_length": (V.UINT32, 64),
        "llama.embedding_length": (V.UINT32, C),
        "llama.feed_forward_length": (V.UINT32, F),
        "llama.attention.head_count": (V.UINT32, H),
        "llama.attention.head_count_kv": (V.UINT32, HKV),
        "llama.attention.layer_norm_rms_epsilon": (V.FLOAT32, 1e-5),
        "llama.rope.dimension_count": (V.UINT32, D),
        "tokenizer.ggml.model": (V.STRING, "llama"),
        "tokenizer.ggml.tokens": (V.ARRAY, (V.STRING, TOKENS)),
        "tokenizer.ggml.scores": (V.ARRAY, (V.FLOAT32, [0.0] * len(TOKENS))),
        "tokenizer.ggml.bos_token_id": (V.UINT32, 1),
        "tokenizer.ggml.eos_token_id": (V.UINT32, 2),
    }
    for key, entry in changes.items():
        key = key.replace("__", ".")
        if entry is None:
            meta.pop(key, None)
        else:
            meta[key] = entry
    return meta


def llama_tensors(layers=L, width=C, q=H * D, kv=HKV * D, ffn=F) -> list[tuple[str, tuple]]:
    """The tensors a tied tiny llama needs: (name, torch-order shape)."""
    out = [("token_embd.weight", (len(TOKENS), width)), ("output_norm.weight", (width,))]
    for i in range(layers):
        shapes = {
            "attn_norm": (width,),
            "ffn_norm": (width,),
            "attn_q": (q, width),
            "attn_k": (kv, width),
            "attn_v": (kv, width),
            "attn_output": (width, q),
            "ffn_gate": (ffn, width),
            "ffn_up": (ffn, width),
            "ffn_down": (width, ffn),
        }
        out += [(f"blk.{i}.{part}.weight", shape) for part, shape in shapes.items()]
    return out


def gguf_file(path: Path, meta=None, tensors=None, *, same_bytes=False, tail=b"") -> Path:
    """A GGUF v3 file of float32 tensors with random values; `same_bytes` points every tensor
    at the start of the data section (so one tensor's bytes are all the file holds). Bytes in
    `tail` follow the metadata in place of the tensor table (a header claiming what follows)."""
    meta = llama_metadata() if meta is None else meta
    tensors = llama_tensors() if tensors is None else tensors
    head = struct.pack("<4sIQQ", b"GGUF", 3, len(tensors), len(meta))
    for key, (kind, value) in meta.items():
        head += encode(V.STRING, key) + struct.pack("<I", kind) + encode(kind, value)
    if tail:
        path.write_bytes(head + tail)
        return path
    offset, offsets = 0, []
    for _, shape in tensors:
        offsets.append(0 if same_bytes else offset)
        offset += -(-4 * torch.Size(shape).numel() // 32) * 32
    size = max(4 * torch.Size(s).numel() for _, s in tensors) if same_bytes else offset
    for (name, shape), start in zip(tensors, offsets, strict=True):
        head += encode(V.STRING, name) + struct.pack(f"<I{len(shape)}Q", len(shape), *shape[::-1])
        head += struct.pack("<IQ", T.F32, start)
    head += b"\0" * (-len(head) % 32)
    path.write_bytes(head + (torch.randn(size // 4) * 0.02).numpy().tobytes())
    return path


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """The GGUF cache folder a load without cache_dir uses, empty at the start."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    return tmp_path / "xdg" / "qkv" / "gguf"


def test_the_crafted_llama_file_loads(tmp_path, cache):
    """The baseline the hostile files below change one thing of: it loads, and caches."""
    model = qkv.load(gguf_file(tmp_path / "tiny.gguf"))
    assert model.config.num_layers == L and model.config.block.kv_heads == HKV
    assert len(list(cache.iterdir())) == 1


# ---- GGUF: in-process, each bounded already by the checks before it ------------------------

STRING_BLOCKS = {"llama.block_count": (V.STRING, "2")}
NESTED = (V.ARRAY, bytes(struct.pack("<IQ", V.ARRAY, 1) * 5000))  # arrays 5000 deep
METADATA = [  # (what changes, what the refusal says)
    ({"llama.attention.head_count": (V.UINT32, 0)},
     "llama.attention.head_count must be a whole number >= 1, got 0"),
    ({"llama.attention.head_count_kv": (V.UINT32, 0)},
     "llama.attention.head_count_kv must be a whole number >= 1, got 0"),
    (STRING_BLOCKS, "llama.block_count must be a whole number >= 1, got '2'"),
    ({"llama.embedding_length": None},
     "llama.embedding_length must be a whole number >= 1, got nothing"),
    ({"llama.attention.head_count_kv": (V.UINT32, 3)},
     r"llama.attention.head_count_kv \(3\) must divide num_attention_heads \(4\)"),
    ({"llama.embedding_length": (V.UINT64, 2**31)},
     r"token_embd.weight has shape \(8, 32\), but the header's config needs \(8, 2147483648\)"),
    ({"llama.vocab_size": (V.UINT64, 2**31)},
     r"token_embd.weight has shape \(8, 32\), but the header's config needs \(2147483648, 32\)"),
    ({"general.nested": NESTED}, "is corrupt: general.nested nests arrays more than 2 deep"),
    ({"tokenizer.ggml.bos_token_id": (V.INT32, -1)},
     "tokenizer.ggml.bos_token_id must be a whole number >= 0, got -1"),
    ({"tokenizer.ggml.scores": (V.ARRAY, (V.FLOAT32, [0.0]))},
     "tokenizer.ggml.scores must be an array of 8 numbers, one per token"),
]  # fmt: skip


METADATA_IDS = [
    "0-heads",
    "0-kv-heads",
    "string-blocks",
    "no-width",
    "kv-not-dividing",
    "2^31-wide",
    "2^31-vocab",
    "nested-arrays",
    "negative-bos",
    "short-scores",
]


@pytest.mark.parametrize("changes, says", METADATA, ids=METADATA_IDS)
def test_bad_gguf_metadata_is_refused_by_key_and_caches_nothing(tmp_path, cache, changes, says):
    path = gguf_file(tmp_path / "bad.gguf", llama_metadata(**changes))
    with pytest.raises(ValueError, match=says) as error:
        qkv.load(path)
    assert str(path) in str(error.value) and "\n" not in str(error.value)
    assert not cache.exists() or leftovers(cache) == []


def _wrong_q(tensors):
    return [(n, (H * D + 2, C) if n == "blk.1.attn_q.weight" else s) for n, s in tensors]


def _twice(tensors):
    return [*tensors, tensors[-1]]


def _extra_bias(tensors):
    return [*tensors, ("blk.0.attn_q.bias", (H * D,))]


TABLES = [
    (_wrong_q, r"tensor blk.1.attn_q.weight has shape \(34, 32\), but the header's config needs"),
    (_twice, "is corrupt: tensor blk.1.ffn_down.weight appears twice"),
    (_extra_bias, "Llama checkpoints with attention_bias=True and mlp_bias=False are not"),
    (lambda t: t[:-1], "has 19 weight tensors, but its header .* needs 20"),
]


@pytest.mark.parametrize("change, says", TABLES, ids=["shape", "twice", "bias", "missing"])
def test_a_tensor_table_that_does_not_fit_the_header_is_refused_and_caches_nothing(
    tmp_path, cache, change, says
):
    path = gguf_file(tmp_path / "bad.gguf", tensors=change(llama_tensors()))
    with pytest.raises(ValueError, match=says):
        qkv.load(path)
    assert not cache.exists() or leftovers(cache) == []


def test_tensors_sharing_bytes_are_refused(tmp_path):
    path = gguf_file(tmp_path / "shared.gguf", same_bytes=True)
    with pytest.raises(ValueError, match="shared.gguf is corrupt: tensors .* overlap"):
        read_gguf(path, cache_dir=tmp_path / "cache")


PAD = b"\0" * 64  # what a tensor table entry takes at the least, and more
HEADERS = [  # what follows the metadata, in place of the tensor table; what the refusal says
    (encode(V.STRING, "token_embd.weight")[:20], "truncated: its header ends early"),  # cut
    (struct.pack("<Q", 2**60) + PAD, "corrupt: a tensor name of length 1,152,921,504,606,846,976"),
    (encode(V.STRING, "token_embd.weight") + struct.pack("<I", 2**31) + PAD,
     "corrupt: tensor token_embd.weight has 2147483648 dimensions"),
    (encode(V.STRING, "token_embd.weight") + struct.pack("<I2QIQ", 2, C, 8, 99, 0) + PAD,
     "corrupt: tensor token_embd.weight has unknown type 99"),
]  # fmt: skip


@pytest.mark.parametrize("tail, says", HEADERS, ids=["cut", "length", "dims", "type"])
def test_a_corrupt_header_is_told_from_a_truncated_one(tmp_path, tail, says):
    path = gguf_file(tmp_path / "h.gguf", tensors=[("token_embd.weight", (8, C))], tail=tail)
    with pytest.raises(ValueError, match=says):
        read_gguf(path, cache_dir=tmp_path / "cache")


def test_metadata_key_count_past_any_model_is_corrupt_not_truncated(tmp_path):
    path = tmp_path / "keys.gguf"
    path.write_bytes(struct.pack("<4sIQQ", b"GGUF", 3, 0, 2**40) + b"\0" * 64)
    with pytest.raises(ValueError, match="keys.gguf is corrupt: its metadata key count"):
        read_gguf(path, cache_dir=tmp_path / "cache")


def test_an_array_longer_than_the_rest_of_the_file_is_truncated(tmp_path):
    """A count below the sane maximum is still bounded by the bytes left in the file."""
    claim = (V.ARRAY, struct.pack("<IQ", V.UINT32, 10_000_000) + b"\0" * 64)
    path = gguf_file(tmp_path / "long.gguf", llama_metadata(general__claim=claim), tail=b"\0")
    with pytest.raises(ValueError, match="long.gguf is truncated"):
        read_gguf(path, cache_dir=tmp_path / "cache")


STRING_ARRAYS = [  # an array of 3 strings whose second is bad; what the refusal says
    (struct.pack("<Q", 2) + b"\xff\xfe", "corrupt: the string general.names is not UTF-8"),
    (struct.pack("<Q", 2**60), "corrupt: the string general.names of length 1,152,921"),
    (struct.pack("<Q", 10_000), "truncated"),  # longer than the rest of the file
]


@pytest.mark.parametrize("bad, says", STRING_ARRAYS, ids=["utf8", "length", "cut"])
def test_a_bad_string_in_an_array_is_refused_by_key(tmp_path, bad, says):
    """Vocabularies are arrays of strings, read in one loop: each string checked as alone."""
    good = encode(V.STRING, "a")
    claim = (V.ARRAY, struct.pack("<IQ", V.STRING, 3) + good + bad + good)
    path = gguf_file(tmp_path / "s.gguf", llama_metadata(general__names=claim), tail=b"\0")
    with pytest.raises(ValueError, match=f"s.gguf is {says}"):
        read_gguf(path, cache_dir=tmp_path / "cache")
    names = (V.ARRAY, struct.pack("<IQ", V.STRING, 2) + good + encode(V.STRING, "b"))
    fine = gguf_file(tmp_path / "f.gguf", llama_metadata(general__names=names),
                     tensors=llama_tensors())  # fmt: skip
    from qkv.io.gguf_header import read_header

    assert read_header(fine.read_bytes(), fine).metadata["general.names"] == ["a", "b"]


# ---- GGUF and config.json: under a memory limit, as `qkv` processes ------------------------


def _sparse_array_file(path: Path) -> Path:
    """A 200 MB file (sparse: it takes no disk) whose header holds a 200 MB array of bytes."""
    claim = (V.ARRAY, struct.pack("<IQ", V.UINT8, 200_000_000))
    gguf_file(path, llama_metadata(general__claim=claim), tail=b"\0")
    with open(path, "r+b") as file:
        file.truncate(200_000_000 + 4096)
    return path


def _overlapping_file(path: Path) -> Path:
    """300 blocks 512 wide whose tensors all share one tensor's bytes: a 4 MB file that,
    read as it says, is 5 GB of float32 weights."""
    meta = llama_metadata(
        llama__block_count=(V.UINT32, 300),
        llama__embedding_length=(V.UINT32, 512),
        llama__feed_forward_length=(V.UINT32, 2048),
        llama__attention__head_count=(V.UINT32, 4),
        llama__attention__head_count_kv=(V.UINT32, 4),
        llama__rope__dimension_count=(V.UINT32, 128),
    )
    tensors = llama_tensors(300, width=512, q=512, kv=512, ffn=2048)
    return gguf_file(path, meta, tensors, same_bytes=True)


def _billion_blocks_file(path: Path) -> Path:
    return gguf_file(path, llama_metadata(llama__block_count=(V.UINT32, 10**9)))


@pytest.mark.parametrize(
    "make, says",
    [
        (_overlapping_file, "is corrupt: tensors"),
        (_billion_blocks_file, "has 20 weight tensors, but its header (llama.block_count"),
        (_sparse_array_file, "is corrupt: the array general.claim of length 200,000,000"),
    ],
    ids=["overlap", "billion-blocks", "200MB-array"],
)
def test_gguf_claims_past_the_file_are_refused_in_bounded_memory(tmp_path, make, says):
    path = make(tmp_path / "claims.gguf")
    result = run_qkv("embed", "hi", "--model", path, env={"XDG_CACHE_HOME": str(tmp_path / "x")})
    assert_one_line_error(result, str(path), says)
    assert not (tmp_path / "x").exists() or leftovers(tmp_path / "x") == []


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("llama")
    save_tiny("llama", folder)  # hidden 48, 6 heads, 2 kv heads, 2 layers
    return folder


def _with_config(source: Path, folder: Path, **changes) -> Path:
    shutil.copytree(source, folder)
    config = json.loads((folder / "config.json").read_text())
    for key, value in changes.items():
        if value is _DROP:
            del config[key]
        else:
            config[key] = value
    (folder / "config.json").write_text(json.dumps(config))
    return folder


_DROP = object()


def _load(folder: Path):
    """(model, family, qkv config, config.json) of a folder: the tiny models have no
    tokenizer, so not all of qkv.load."""
    return load_folder(folder, torch.float32, None)


@pytest.mark.parametrize(
    "changes, says",
    [
        ({"num_hidden_layers": 10**9}, "describes a model of at least"),
        ({"hidden_size": 2**31, "num_attention_heads": 2, "num_key_value_heads": 2},
         "describes a model of at least"),
    ],
    ids=["billion-layers", "2^31-wide"],
)  # fmt: skip
def test_a_config_json_claiming_more_than_its_weights_is_refused_in_bounded_memory(
    tmp_path, tiny_llama, changes, says
):
    folder = _with_config(tiny_llama, tmp_path / "m", **changes)
    result = run_qkv("embed", "hi", "--model", folder)
    assert_one_line_error(result, str(folder / "config.json"), says)


# ---- config.json values -----------------------------------------------------------------------

VALUES = [
    ("hidden_size", _DROP, "hidden_size must be a whole number >= 1, got nothing"),
    ("hidden_size", "48", "hidden_size must be a whole number >= 1, got '48'"),
    ("hidden_size", [48], r"hidden_size must be a whole number >= 1, got \[48\]"),
    ("hidden_size", None, "hidden_size must be a whole number >= 1, got None"),
    ("num_hidden_layers", True, "num_hidden_layers must be a whole number >= 1, got True"),
    ("num_attention_heads", 0, "num_attention_heads must be a whole number >= 1, got 0"),
    ("num_key_value_heads", 4, r"num_key_value_heads \(4\) must divide num_attention_heads"),
    ("rms_norm_eps", "1e-6", "rms_norm_eps must be a number, got '1e-6'"),
    ("tie_word_embeddings", "false", "tie_word_embeddings must be true or false, got 'false'"),
]


VALUE_IDS = [f"{k}={'missing' if v is _DROP else repr(v)}" for k, v, _ in VALUES]


@pytest.mark.parametrize("key, value, says", VALUES, ids=VALUE_IDS)
def test_a_bad_config_json_value_is_refused_naming_the_file_and_key(
    tmp_path, tiny_llama, key, value, says
):
    folder = _with_config(tiny_llama, tmp_path / "m", **{key: value})
    with pytest.raises(ValueError, match=says) as error:
        qkv.load(folder)
    assert str(error.value).startswith(f"{folder / 'config.json'}: ")


def test_a_whole_float_in_config_json_reads_as_the_integer(tmp_path, tiny_llama):
    """384.0 is what some JSON writers make of 384: nothing about it is ambiguous."""
    folder = _with_config(tiny_llama, tmp_path / "m", hidden_size=48.0, num_hidden_layers=2.0)
    _, _, config, _ = _load(folder)
    assert config == _load(tiny_llama)[2] and config.block.width == 48
    with pytest.raises(ValueError, match="hidden_size must be a whole number >= 1, got 48.5"):
        _load(_with_config(tiny_llama, tmp_path / "n", hidden_size=48.5))


# ---- pytorch_model.bin ------------------------------------------------------------------------


def _as_pickle(source: Path, folder: Path, state, **save) -> Path:
    folder.mkdir()
    shutil.copy(source / "config.json", folder / "config.json")
    torch.save(state, folder / "pytorch_model.bin", **save)
    return folder


def test_a_legacy_pytorch_model_bin_loads(tmp_path, tiny_llama):
    from safetensors.torch import load_file

    state = load_file(tiny_llama / "model.safetensors")
    folder = _as_pickle(tiny_llama, tmp_path / "m", state, _use_new_zipfile_serialization=False)
    ids = torch.tensor([[1, 5, 7, 2]])
    got = _load(folder)[0](ids).logits
    torch.testing.assert_close(got, _load(tiny_llama)[0](ids).logits, rtol=0, atol=0)


class _RunsCode:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.parametrize("zipped", [True, False])
def test_a_pickle_that_would_run_code_is_refused(tmp_path, tiny_llama, zipped):
    marker = tmp_path / "ran"
    from safetensors.torch import load_file

    # the real weights and one more entry, so the file is as big as its config needs
    state = {**load_file(tiny_llama / "model.safetensors"), "extra": _RunsCode(marker)}
    folder = _as_pickle(tiny_llama, tmp_path / "m", state,
                        _use_new_zipfile_serialization=zipped)  # fmt: skip
    with pytest.raises(ValueError, match="holds more than tensors .*posix.system"):
        _load(folder)
    assert not marker.exists()


def test_a_shard_index_naming_a_file_outside_its_folder_is_refused(tmp_path, tiny_llama):
    folder = tmp_path / "m"
    folder.mkdir()
    shutil.copy(tiny_llama / "config.json", folder)
    shutil.copy(tiny_llama / "model.safetensors", tmp_path / "elsewhere.safetensors")
    index = {"weight_map": {"model.embed_tokens.weight": "../elsewhere.safetensors"}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match="names the shard '../elsewhere.safetensors'; a shard"):
        _load(folder)

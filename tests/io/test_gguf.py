"""qkv.io.gguf: the embedded SmolLM2 file against transformers' own GGUF loader, tiny files
written here with gguf.GGUFWriter against the tensors written, the cache, and bad files."""

import shutil
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType as T
from tokenizers import pre_tokenizers

from qkv.io.embedded import embedded_path
from qkv.io.gguf import read_gguf

SMOLLM2 = embedded_path("smollm2")  # `make test` installs it; missing, it is a failure

STRINGS = [
    "The bank on the side of the river",
    "12345",
    "café naïve 日本語",
    "emoji 🤗🎉 👍🏽",
    "  leading and trailing spaces  ",
    "one\ntwo\n\nthree\r\n",
    "tabs\tand  double  spaces",
    "<|im_start|>user\nhi<|im_end|>",
    "",
    " ",
]


# ---- the real file, against transformers ----------------------------------------------------


@pytest.fixture(scope="module")
def smollm2_file(tmp_path_factory):
    cache_dir = tmp_path_factory.mktemp("gguf-cache")
    return read_gguf(SMOLLM2, cache_dir=cache_dir), cache_dir


@pytest.fixture(scope="module")
def transformers_smollm2(smollm2_hf):
    """transformers' own GGUF load of the same file: (config, float32 state dict, tokenizer)."""
    model, tokenizer = smollm2_hf
    state_dict = {name: t.float() for name, t in model.state_dict().items()}
    return model.config, state_dict, tokenizer


def test_smollm2_weights_equal_transformers(smollm2_file, transformers_smollm2):
    model, _ = smollm2_file
    _, expected, _ = transformers_smollm2
    if model.config["tie_word_embeddings"]:  # transformers lists the tied head too
        expected = {name: t for name, t in expected.items() if name != "lm_head.weight"}
    assert sorted(model.state_dict) == sorted(expected)
    for name, tensor in model.state_dict.items():
        assert tensor.dtype == torch.float32
        torch.testing.assert_close(tensor, expected[name], rtol=0, atol=1e-6, msg=name)


# qkv's model on those weights against transformers' (here rather than in test_pretrained.py:
# the same file's tests share one process, so transformers' load, nearly a minute, runs once)


def test_smollm2_logits_match_transformers_on_the_same_gguf(smollm2, smollm2_hf):
    model, tokenizer = smollm2_hf
    ids = tokenizer("The bank on the side of the river is", return_tensors="pt").input_ids
    assert ids.tolist()[0] == smollm2.tokenizer.encode("The bank on the side of the river is").ids
    with torch.no_grad():
        want = model(ids).logits
    with torch.inference_mode():
        got = smollm2.model(ids).logits
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3 * want.abs().max().item())


def test_smollm2_greedy_continuation_equals_transformers(smollm2, smollm2_hf):
    model, tokenizer = smollm2_hf
    prompt = "The bank on the side of the river"
    ids = tokenizer(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        want = model.generate(ids, max_new_tokens=32, do_sample=False, min_new_tokens=32)
    want_text = tokenizer.decode(want[0, ids.shape[1] :], skip_special_tokens=True)
    got = smollm2.generate(prompt, 32, precision="loaded")  # float32, as transformers
    assert got == want_text


def test_smollm2_config_agrees_with_transformers(smollm2_file, transformers_smollm2):
    from transformers import LlamaConfig

    model, _ = smollm2_file
    expected, _, _ = transformers_smollm2
    ours = LlamaConfig(**model.config)  # transformers takes our dict as a config.json
    fields = [
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "rms_norm_eps",
        "max_position_embeddings",
        "vocab_size",
        "tie_word_embeddings",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
    ]
    assert {f: getattr(ours, f) for f in fields} == {f: getattr(expected, f) for f in fields}
    assert model.config["rope_theta"] == expected.rope_parameters["rope_theta"]
    assert model.config["model_type"] == expected.model_type == "llama"


@pytest.mark.parametrize("text", STRINGS)
def test_smollm2_tokenizer_ids_equal_transformers(smollm2_file, transformers_smollm2, text):
    model, _ = smollm2_file
    _, _, expected = transformers_smollm2
    assert model.tokenizer.encode(text).ids == expected(text)["input_ids"]


def test_smollm2_tokenizer_config_agrees_with_transformers(smollm2_file, transformers_smollm2):
    model, _ = smollm2_file
    _, _, expected = transformers_smollm2
    config = model.tokenizer_config
    for name in ["bos_token", "eos_token", "pad_token", "unk_token", "chat_template"]:
        assert config[name] == getattr(expected, name), name
    assert config["add_bos_token"] is False and config["chat_template"].startswith("{% for")
    text = "<|im_start|>user\nhi<|im_end|>"
    assert (
        model.tokenizer.decode(model.tokenizer.encode(text).ids, skip_special_tokens=False) == text
    )


def test_smollm2_second_read_comes_from_the_cache(smollm2_file):
    first, cache_dir = smollm2_file
    [cache] = cache_dir.glob("*.safetensors")
    calls = []
    second = read_gguf(SMOLLM2, cache_dir=cache_dir, progress=lambda *a: calls.append(a))
    assert calls == []  # nothing was dequantized
    assert list(cache_dir.glob("*.safetensors")) == [cache]
    assert second.config == first.config
    for name, tensor in first.state_dict.items():
        assert torch.equal(second.state_dict[name], tensor), name


def test_truncated_file_is_reported_and_caches_nothing(tmp_path):
    half = tmp_path / "half.gguf"
    with open(SMOLLM2, "rb") as source:
        half.write_bytes(source.read(SMOLLM2.stat().st_size // 2))
    cache_dir = tmp_path / "cache"
    with pytest.raises(ValueError, match="truncated"):
        read_gguf(half, cache_dir=cache_dir)
    assert not cache_dir.exists() or not any(cache_dir.iterdir())


# ---- tiny files written here ----------------------------------------------------------------

C, H, HKV, D, F, L = 64, 4, 2, 16, 96, 2  # width, heads, kv heads, head size, MLP, layers
# each layer tensor: its Hugging Face name, shape, and a storage type; the types vary so that
# every reading path is exercised, q and k included
LAYER = {
    "attn_q": ("self_attn.q_proj", (H * D, C), T.F32),
    "attn_k": ("self_attn.k_proj", (HKV * D, C), T.F16),
    "attn_v": ("self_attn.v_proj", (HKV * D, C), T.Q8_0),
    "attn_output": ("self_attn.o_proj", (C, H * D), T.Q4_0),
    "ffn_gate": ("mlp.gate_proj", (F, C), T.Q8_0),
    "ffn_up": ("mlp.up_proj", (F, C), T.BF16),
    "ffn_down": ("mlp.down_proj", (C, F), T.Q4_1),
    "attn_norm": ("input_layernorm", (C,), T.F32),
    "ffn_norm": ("post_attention_layernorm", (C,), T.F32),
}
CONTROL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py rotary row order, which read_gguf must undo."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def byte_level_vocab():
    """GPT-2-style vocabulary: the 256 byte characters, a few merges, control and
    user-defined tokens. Returns (tokens, token types, merges)."""
    merges = ["Ġ t", "h e", "Ġt he", "a n", "Ġ a", "Ġa n", "Ġan d", "Ġ c", "a t", "Ġc at", "1 2"]
    merged = [m.replace(" ", "") for m in merges]
    tokens = CONTROL + sorted(pre_tokenizers.ByteLevel.alphabet()) + merged + ["<think>"]
    types = [3] * len(CONTROL) + [1] * (len(tokens) - len(CONTROL) - 1) + [4]
    return tokens, types, merges


def sentencepiece_vocab():
    """Llama-2-style vocabulary: unk/bos/eos, byte fallback tokens, pieces with scores."""
    pieces = ["▁", "t", "h", "e", "a", "n", "d", "c", "he", "▁t", "▁the", "▁a", "an", "▁an"]
    pieces += ["▁and", "at", "▁c", "▁cat", "▁h", "▁hat"]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)
    scores = [0.0] * 259 + [-float(i) for i in range(len(pieces))]
    return tokens, types, scores


def write_tiny(path: Path, *, arch="llama", tokenizer="gpt2", pre=None, tied=False, extra=None):
    """A tiny llama GGUF; returns the Hugging Face state dict its tensors should read back as."""
    rng = np.random.default_rng()
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(L)
    writer.add_context_length(256)
    writer.add_embedding_length(C)
    writer.add_feed_forward_length(F)
    writer.add_head_count(H)
    writer.add_head_count_kv(HKV)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(500000.0)
    writer.add_rope_dimension_count(D)
    if tokenizer == "gpt2":
        tokens, types, merges = byte_level_vocab()
        writer.add_token_merges(merges)
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
    else:
        tokens, types, scores = sentencepiece_vocab()
        writer.add_token_scores(scores)
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        writer.add_unk_token_id(0)
    writer.add_tokenizer_model(tokenizer)
    if pre is not None:
        writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_vocab_size(len(tokens))

    tensors = [  # (gguf name, Hugging Face name, shape, storage type)
        ("token_embd.weight", "model.embed_tokens.weight", (len(tokens), C), T.F16),
        ("output_norm.weight", "model.norm.weight", (C,), T.F32),
    ]
    if not tied:
        tensors.append(("output.weight", "lm_head.weight", (len(tokens), C), T.Q8_0))
    for i in range(L):
        for part, (hf_name, shape, ggml_type) in LAYER.items():
            tensors.append(
                (f"blk.{i}.{part}.weight", f"model.layers.{i}.{hf_name}.weight", shape, ggml_type)
            )

    expected = {}
    for name, hf_name, shape, ggml_type in tensors:
        raw = gguf.quants.quantize(rng.standard_normal(shape, np.float32), ggml_type)
        values = gguf.quants.dequantize(raw, ggml_type)
        expected[hf_name] = torch.from_numpy(np.asarray(values, np.float32))
        heads = {"attn_q": H, "attn_k": HKV}.get(name.split(".")[-2])
        if heads is not None:  # rows quantize independently, so permuting after is the same
            raw = permute(raw, heads)
        writer.add_tensor(name, raw, raw_dtype=None if ggml_type in (T.F32, T.F16) else ggml_type)
    if isinstance(extra, tuple):  # (name, values)
        writer.add_tensor(*extra)
    elif extra is not None:
        writer.add_tensor(extra, rng.standard_normal((4, C), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


@pytest.mark.parametrize("tied", [False, True])
def test_tiny_file_reads_back_in_hugging_face_layout(tmp_path, tied):
    expected = write_tiny(tmp_path / "tiny.gguf", tied=tied)
    model = read_gguf(tmp_path / "tiny.gguf", cache_dir=tmp_path / "cache")

    assert sorted(model.state_dict) == sorted(expected)
    for name, tensor in expected.items():
        torch.testing.assert_close(model.state_dict[name], tensor, rtol=0, atol=0, msg=name)
    config = model.config
    assert (
        config["hidden_size"],
        config["num_attention_heads"],
        config["num_key_value_heads"],
    ) == (C, H, HKV)
    assert (config["head_dim"], config["intermediate_size"], config["num_hidden_layers"]) == (
        D,
        F,
        L,
    )
    assert config["rope_theta"] == 500000.0 and config["tie_word_embeddings"] is tied
    assert (
        config["vocab_size"]
        == model.tokenizer.get_vocab_size()
        == expected["model.embed_tokens.weight"].shape[0]
    )


@pytest.mark.parametrize(
    ("tokenizer", "pre"), [("gpt2", None), ("gpt2", "llama-bpe"), ("llama", None)]
)
def test_tiny_tokenizers_equal_transformers(tmp_path, tokenizer, pre):
    write_tiny(tmp_path / "tiny.gguf", tokenizer=tokenizer, pre=pre)
    model = read_gguf(tmp_path / "tiny.gguf", cache_dir=tmp_path / "cache")
    expected = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="tiny.gguf")
    texts = [*STRINGS, "the cat and a hat", "<think>the</think>", "<s>the</s> 123"]
    for text in texts:
        assert model.tokenizer.encode(text).ids == expected(text)["input_ids"], text
    assert model.tokenizer_config["add_bos_token"] is (tokenizer == "llama")


# ---- the cache and bad files -----------------------------------------------------------------


def _cut_short(cache: Path) -> None:
    cache.write_bytes(cache.read_bytes()[:100])


def _other_format(cache: Path) -> None:
    from safetensors.torch import load_file, save_file

    tensors = {name: t.clone() for name, t in load_file(cache).items()}  # off the file first
    save_file(tensors, cache, metadata={"format": "some-older-layout"})


def _other_shapes(cache: Path) -> None:
    from safetensors.torch import save_file

    save_file({"model.norm.weight": torch.zeros(3)}, cache, metadata={"format": "qkv-gguf-1"})


@pytest.mark.parametrize("damage", [_cut_short, _other_format, _other_shapes])
def test_damaged_cache_is_rebuilt(tmp_path, damage):
    expected = write_tiny(tmp_path / "tiny.gguf")
    cache_dir = tmp_path / "cache"
    read_gguf(tmp_path / "tiny.gguf", cache_dir=cache_dir)
    [cache] = cache_dir.iterdir()
    damage(cache)

    calls = []
    model = read_gguf(
        tmp_path / "tiny.gguf", cache_dir=cache_dir, progress=lambda *a: calls.append(a)
    )

    assert calls and calls[-1][0] == calls[-1][1]  # dequantized again, to the last tensor
    assert list(cache_dir.iterdir()) == [cache]
    for name, tensor in expected.items():
        assert torch.equal(model.state_dict[name], tensor), name
    calls.clear()
    read_gguf(tmp_path / "tiny.gguf", cache_dir=cache_dir, progress=lambda *a: calls.append(a))
    assert calls == []  # the rebuilt cache is whole


@pytest.mark.parametrize("error", [OSError("disk full"), KeyboardInterrupt()])
def test_a_failed_cache_write_leaves_no_file(tmp_path, monkeypatch, error):
    import qkv.io.gguf

    real = qkv.io.gguf._write_safetensors

    def fail(file, state_dict, source):
        real(file, dict(list(state_dict.items())[:3]), source)  # part of it, then the failure
        raise error

    write_tiny(tmp_path / "tiny.gguf")
    monkeypatch.setattr(qkv.io.gguf, "_write_safetensors", fail)
    if isinstance(error, OSError):  # only logged: the weights come back regardless
        model = read_gguf(tmp_path / "tiny.gguf", cache_dir=tmp_path / "cache")
        assert "model.norm.weight" in model.state_dict
    else:
        with pytest.raises(KeyboardInterrupt):
            read_gguf(tmp_path / "tiny.gguf", cache_dir=tmp_path / "cache")
    assert list((tmp_path / "cache").iterdir()) == []


def test_same_bytes_under_another_name_share_the_cache(tmp_path):
    write_tiny(tmp_path / "tiny.gguf")
    shutil.copy(tmp_path / "tiny.gguf", tmp_path / "copy.gguf")
    read_gguf(tmp_path / "tiny.gguf", cache_dir=tmp_path / "cache")
    calls = []
    read_gguf(
        tmp_path / "copy.gguf", cache_dir=tmp_path / "cache", progress=lambda *a: calls.append(a)
    )
    assert calls == [] and len(list((tmp_path / "cache").iterdir())) == 1


def test_a_files_hash_is_noted_and_read_back_until_the_file_changes(tmp_path, monkeypatch):
    """The SHA-256 that names a file's caches is hashed once for the file as it is: a later
    read finds it noted by the file's device, inode, size and times. A file written again
    is hashed again; a damaged note is passed over; a file written moments ago is not noted
    (a coarse clock could miss a write within its tick)."""
    import hashlib

    import qkv.io.gguf as reader

    path, cache = tmp_path / "tiny.gguf", tmp_path / "cache"
    write_tiny(path)
    hashed = []  # the sizes of the contents hashed (the notes' names hash a short key)
    real = hashlib.sha256
    monkeypatch.setattr(reader.hashlib, "sha256",
                        lambda data=b"": hashed.append(len(data)) or real(data))  # fmt: skip
    size, digest = path.stat().st_size, real(path.read_bytes()).hexdigest()

    def contents_hashed() -> int:
        got = read_gguf(path, cache_dir=cache).digest
        assert got == real(path.read_bytes()).hexdigest()
        found, hashed[:] = hashed.count(path.stat().st_size), []
        return found

    assert contents_hashed() == 1 and not (cache / "digests").exists()  # written just now
    monkeypatch.setattr(reader, "SETTLED_NS", 0)
    assert contents_hashed() == 1
    [note] = (cache / "digests").iterdir()
    assert note.read_text() == digest
    assert contents_hashed() == 0 and contents_hashed() == 0
    note.write_text("not a digest")
    assert contents_hashed() == 1 and note.read_text() == digest  # noted again
    path.write_bytes(path.read_bytes())  # the same bytes, written again
    assert contents_hashed() == 1 and len(list((cache / "digests").iterdir())) == 2
    write_tiny(path)  # other random weights, the same size
    assert path.stat().st_size == size and real(path.read_bytes()).hexdigest() != digest
    assert contents_hashed() == 1  # and the digest returned is the new contents'


def test_default_cache_dir_follows_xdg_cache_home(tmp_path, monkeypatch):
    write_tiny(tmp_path / "tiny.gguf")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    read_gguf(tmp_path / "tiny.gguf")
    assert len(list((tmp_path / "xdg" / "qkv" / "gguf").iterdir())) == 1


def test_missing_file(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        read_gguf(tmp_path / "nope.gguf", cache_dir=tmp_path)


@pytest.mark.parametrize("content", [b"", b"PK\x03\x04 a zip, not a model", b"GGU"])
def test_not_a_gguf_file(tmp_path, content):
    (tmp_path / "x.gguf").write_bytes(content)
    with pytest.raises(ValueError, match="not a GGUF file"):
        read_gguf(tmp_path / "x.gguf", cache_dir=tmp_path / "cache")


def test_header_cut_short_is_truncated(tmp_path):
    write_tiny(tmp_path / "tiny.gguf")
    (tmp_path / "cut.gguf").write_bytes((tmp_path / "tiny.gguf").read_bytes()[:300])
    with pytest.raises(ValueError, match="cut.gguf is truncated"):
        read_gguf(tmp_path / "cut.gguf", cache_dir=tmp_path / "cache")
    assert not (tmp_path / "cache").exists()


def test_unsupported_architecture(tmp_path):
    write_tiny(tmp_path / "falcon.gguf", arch="falcon")
    with pytest.raises(
        ValueError, match="unsupported GGUF architecture 'falcon'; supported: llama,"
    ):
        read_gguf(tmp_path / "falcon.gguf", cache_dir=tmp_path / "cache")


def test_unsupported_tokenizer_model(tmp_path):
    write_tiny(tmp_path / "bert.gguf", tokenizer="bert")
    with pytest.raises(ValueError, match="tokenizer model 'bert'; supported: gpt2, llama"):
        read_gguf(tmp_path / "bert.gguf", cache_dir=tmp_path / "cache")


def test_unknown_tensor_is_reported(tmp_path):
    write_tiny(tmp_path / "moe.gguf", extra="blk.0.ffn_gate.0.weight")  # old Mixtral: per expert
    with pytest.raises(ValueError, match="unsupported tensor .blk.0.ffn_gate.0.weight."):
        read_gguf(tmp_path / "moe.gguf", cache_dir=tmp_path / "cache")


def test_llama_3s_rope_freqs_become_its_rope_scaling_exactly(tmp_path):
    """llama.cpp stores Llama 3's rope scaling as one factor per frequency (rope_freqs), by
    which it divides each frequency: read as LongRoPE's form, the model turns its queries and
    keys as the scaled Llama 3 checkpoint did (the tensor is no weight)."""
    from qkv.io.families import family_for
    from qkv.nn.rope import RopeScaling, inv_freq

    llama3 = RopeScaling("llama3", factor=8.0, original_max_positions=16)
    plain, _ = inv_freq(D, 500000.0)
    scaled, _ = inv_freq(D, 500000.0, llama3)
    factors = (plain / scaled).numpy()  # what convert_hf_to_gguf.py writes
    expected = write_tiny(tmp_path / "llama3.gguf", extra=("rope_freqs.weight", factors))
    model = read_gguf(tmp_path / "llama3.gguf", cache_dir=tmp_path / "cache")
    assert sorted(model.state_dict) == sorted(expected)
    config = family_for(model.config).config(model.config)
    assert not torch.equal(plain, scaled)
    for length in (10, 300):  # within and past the header's context: the same factors
        rotary = config.rotary()
        freq, factor = inv_freq(D, config.rope_base, config.rope_scaling, length)
        torch.testing.assert_close(freq, scaled, rtol=1e-6, atol=0)
        assert factor == 1.0 and torch.equal(rotary.inv_freq, freq)


def test_rope_freqs_that_are_not_a_list_of_factors_are_refused(tmp_path):
    write_tiny(tmp_path / "bad.gguf", extra="rope_freqs.weight")  # (4, C): not one per freq
    with pytest.raises(ValueError, match="rope_freqs.weight should be a short list of float"):
        read_gguf(tmp_path / "bad.gguf", cache_dir=tmp_path / "cache")


def test_a_byte_level_token_spelled_in_utf8_reads_as_transformers_reads_it(tmp_path, monkeypatch):
    """A token the file spells in plain UTF-8, outside the byte-level alphabet (as some
    converters write added words), is spelled in the alphabet before the BPE sees it, where
    every other token is taken as the file spells it."""
    tokens, types, merges = byte_level_vocab()
    spelled = ["日本", "été"]  # "été": é is in the alphabet (its own byte), 日 is not
    monkeypatch.setattr(sys.modules[__name__], "byte_level_vocab",
                        lambda: ([*tokens, *spelled], [*types, 1, 1], merges))  # fmt: skip
    write_tiny(tmp_path / "tiny.gguf")
    model = read_gguf(tmp_path / "tiny.gguf", cache_dir=tmp_path / "cache")
    expected = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="tiny.gguf")
    vocab = model.tokenizer.get_vocab()
    assert vocab["æĹ¥æľ¬"] == len(tokens) and "日本" not in vocab  # re-spelled: 日本's bytes
    assert vocab["été"] == len(tokens) + 1
    for text in ("日本 the cat", "été 12", *STRINGS):
        assert model.tokenizer.encode(text).ids == expected(text)["input_ids"], text

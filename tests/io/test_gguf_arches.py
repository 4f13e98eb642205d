"""qkv.io.gguf over every architecture it reads: tiny random checkpoints built by
transformers, written to .gguf files as llama.cpp's convert_hf_to_gguf.py writes them, read
by qkv and compared with the checkpoint itself and with transformers' own GGUF reader.

`convert` below is the test's own copy of what convert_hf_to_gguf.py does, written from
llama.cpp rather than from qkv.io.gguf_arch: tensor names come from gguf's own name map
(gguf.get_tensor_name_map), header keys from GGUFWriter's named setters. Where transformers'
GGUF reader fills a default that llama.cpp would not (Gemma 2 and 3's query_pre_attn_scalar,
Qwen3's head_dim, Gemma 2's soft-caps), the tiny config is one where the two agree; qkv
follows llama.cpp, whose reading is what the file means.
"""

from __future__ import annotations

import math
import re

import gguf
import numpy as np
import pytest
import torch
import transformers as hf
from test_gguf import byte_level_vocab, permute

import qkv
from qkv.io.gguf import read_gguf
from qkv.io.gguf_arch import ARCHES, rope_tensors
from qkv.io.gguf_header import Header
from qkv.io.load import load_source

TOKENS, TOKEN_TYPES, MERGES = byte_level_vocab()
V = len(TOKENS)
T = 24  # past every sliding window below (8) and every scaled model's trained context (16)
SHARED = dict(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              max_position_embeddings=256, rms_norm_eps=1e-5)  # fmt: skip

# (architecture, transformers model class, config): each made so that transformers' GGUF
# reader and llama.cpp read the file alike, unless the id says it is a qkv-only case
TINY = {
    "llama": ("llama", hf.LlamaForCausalLM, hf.LlamaConfig(
        **SHARED, num_attention_heads=4, num_key_value_heads=2, attention_bias=False,
        tie_word_embeddings=False, rope_parameters={"rope_type": "default",
                                                    "rope_theta": 500000.0})),
    "qwen2": ("qwen2", hf.Qwen2ForCausalLM, hf.Qwen2Config(
        **SHARED, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)),
    "qwen2-tied": ("qwen2", hf.Qwen2ForCausalLM, hf.Qwen2Config(
        **SHARED, num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True)),
    # transformers' GGUF reader takes Qwen3's head_dim from its class default, 128
    "qwen3": ("qwen3", hf.Qwen3ForCausalLM, hf.Qwen3Config(
        **SHARED, num_attention_heads=2, num_key_value_heads=1, head_dim=128,
        tie_word_embeddings=False)),
    "phi3": ("phi3", hf.Phi3ForCausalLM, hf.Phi3Config(
        **SHARED, num_attention_heads=4, num_key_value_heads=2, pad_token_id=None,
        tie_word_embeddings=False)),
    # llama.cpp's convert writes no rope base for Gemma: it means llama.cpp's 10 000
    "gemma": ("gemma", hf.GemmaForCausalLM, hf.GemmaConfig(
        **SHARED, num_attention_heads=4, num_key_value_heads=2, head_dim=16)),
    # head_dim 256: llama.cpp scales by 1/sqrt(head_dim), transformers' GGUF reader by its
    # default query_pre_attn_scalar (256); the soft-caps are transformers' defaults, which
    # its reader does not read from the file
    "gemma2": ("gemma2", hf.Gemma2ForCausalLM, hf.Gemma2Config(
        **SHARED, num_attention_heads=2, num_key_value_heads=1, head_dim=256,
        query_pre_attn_scalar=256, sliding_window=8, attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0)),
    # six layers: llama.cpp's (and transformers' default) five sliding layers, then a full one
    "gemma3": ("gemma3", hf.Gemma3ForCausalLM, hf.Gemma3TextConfig(
        **{**SHARED, "num_hidden_layers": 6}, num_attention_heads=2, num_key_value_heads=1,
        head_dim=256, query_pre_attn_scalar=256, sliding_window=8, tie_word_embeddings=False)),
}  # fmt: skip
# what transformers' GGUF reader does not read (rope scaling, soft-caps, partial rotary), or
# reads otherwise than llama.cpp: against the checkpoint only
QKV_ONLY = {
    "llama3-rope": ("llama", hf.LlamaForCausalLM, hf.LlamaConfig(
        **{**SHARED, "max_position_embeddings": 64}, num_attention_heads=4,
        num_key_value_heads=2, rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0,
        "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16})),
    # biases on every projection: llama.cpp's permutation turns the q and k biases too
    "llama-biased": ("llama", hf.LlamaForCausalLM, hf.LlamaConfig(
        **SHARED, num_attention_heads=4, num_key_value_heads=2, attention_bias=True,
        mlp_bias=True, tie_word_embeddings=True)),
    "phi3-longrope": ("phi3", hf.Phi3ForCausalLM, hf.Phi3Config(
        **{**SHARED, "max_position_embeddings": 64}, num_attention_heads=4,
        num_key_value_heads=2, pad_token_id=None, original_max_position_embeddings=16,
        partial_rotary_factor=0.5, rope_parameters={"rope_type": "longrope",
        "rope_theta": 10000.0, "short_factor": [1.0, 1.5, 2.0, 3.0],
        "long_factor": [1.0, 2.0, 4.0, 8.0]})),
    "qwen2-yarn": ("qwen2", hf.Qwen2ForCausalLM, hf.Qwen2Config(
        **{**SHARED, "max_position_embeddings": 64}, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=False, rope_parameters={"rope_type": "yarn",
        "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16})),
    "gemma2-capped": ("gemma2", hf.Gemma2ForCausalLM, hf.Gemma2Config(
        **SHARED, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        query_pre_attn_scalar=16, sliding_window=8, attn_logit_softcapping=2.0,
        final_logit_softcapping=3.0)),
    "gemma3-scaled": ("gemma3", hf.Gemma3ForCausalLM, hf.Gemma3TextConfig(
        **{**SHARED, "num_hidden_layers": 6, "max_position_embeddings": 16},
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16,
        sliding_window=8, final_logit_softcapping=3.0, rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}})),
}  # fmt: skip
CASES = TINY | QKV_ONLY
READ_BY_TRANSFORMERS = [case for case in TINY if TINY[case][0] != "gemma"]  # no Gemma reader


def tiny_model(case: str) -> tuple[str, hf.PreTrainedModel]:
    """(GGUF architecture, a seeded random float32 model) with non-zero norms and biases."""
    arch, cls, config = CASES[case]
    torch.manual_seed(0)
    model = cls(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:  # norm gains and biases: far from 1 and 0, so a slip shows
                p.copy_(torch.randn_like(p) * 0.5 + (0.0 if "bias" in name else 0.5))
            else:
                p.normal_(0, 0.1)
    return arch, model


# ---- the test's convert_hf_to_gguf.py -------------------------------------------------------


def _rope(config) -> dict:
    """The full-attention layers' rope parameters (transformers 5 nests Gemma 3's)."""
    rope = dict(config.rope_parameters or {})
    return dict(rope.get("full_attention", rope))


def convert(
    model: hf.PreTrainedModel,
    arch: str,
    path,
    *,
    f16: bool = False,
    q4: bool = False,
    raw: dict | None = None,
) -> None:
    """Write `model` as llama.cpp's convert_hf_to_gguf.py would: float32 tensors, or its
    --outtype f16 (matrices in float16, vectors kept in float32); q4: the blocks' matrices
    in Q4_0 (as llama-quantize writes them; the token matrix kept in float32); raw: {GGUF
    name: (type name, blocks (rows, bytes) uint8)} written as they are, in place of those
    tensors."""
    c = model.config
    rope = _rope(c)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    if arch in ("gemma", "gemma2", "gemma3", "qwen3", "llama"):  # config.json has head_dim
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    if arch not in ("gemma", "gemma2"):  # Gemma's and Gemma 2's converters write no base
        w.add_rope_freq_base(rope["rope_theta"])
    if arch == "llama":
        w.add_rope_dimension_count(head_dim)
    if arch == "phi3":
        w.add_rope_scaling_orig_ctx_len(c.original_max_position_embeddings)
        rope_dims = int(getattr(c, "partial_rotary_factor", 1.0) * c.hidden_size) // (
            c.num_attention_heads
        )
        w.add_rope_dimension_count(rope_dims)
        w.add_sliding_window(c.sliding_window or 0)  # 0: no window (Phi-4)
    if arch == "gemma2":
        w.add_attn_logit_softcapping(c.attn_logit_softcapping)
        w.add_final_logit_softcapping(c.final_logit_softcapping)
        w.add_sliding_window(c.sliding_window)
    if arch == "gemma3":
        if c.final_logit_softcapping:
            w.add_final_logit_softcapping(c.final_logit_softcapping)
        if "sliding_attention" in c.layer_types:
            w.add_sliding_window(c.sliding_window)
        if rope.get("rope_type") == "linear":
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(rope["factor"])
    if arch in ("qwen2", "qwen3") and rope.get("rope_type") == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    w.add_tokenizer_model("gpt2")
    w.add_token_list(TOKENS)
    w.add_token_types(TOKEN_TYPES)
    w.add_token_merges(MERGES)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(0)  # transformers' Phi3Config would take 32000, past this vocabulary

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], c.num_hidden_layers)
    tensors = {}
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        stem, suffix = name.rsplit(".", 1)
        data = tensor.float().numpy().copy()
        if arch == "llama" and stem.endswith(("q_proj", "k_proj")):  # LlamaModel.permute
            heads = c.num_attention_heads if "q_proj" in stem else c.num_key_value_heads
            data = permute(data, heads)
        if arch.startswith("gemma") and name.endswith("norm.weight"):  # 1 + w, stored
            data = data + 1
        tensors[f"{names.get_name(stem)}.{suffix}"] = data
    if arch == "llama" and rope.get("rope_type") == "llama3":  # generate_extra_tensors
        tensors["rope_freqs.weight"] = _llama3_factors(rope, head_dim)
    if arch == "phi3" and rope.get("rope_type") == "longrope":
        scale = c.max_position_embeddings / c.original_max_position_embeddings
        original = c.original_max_position_embeddings
        w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)))
        tensors["rope_factors_long.weight"] = np.asarray(rope["long_factor"], np.float32)
        tensors["rope_factors_short.weight"] = np.asarray(rope["short_factor"], np.float32)
    for name, data in tensors.items():
        if raw and name in raw:
            kind, blocks = raw[name]
            w.add_tensor(name, blocks, raw_shape=blocks.shape,
                         raw_dtype=getattr(gguf.GGMLQuantizationType, kind))  # fmt: skip
            continue
        if q4 and data.ndim == 2 and name.startswith("blk.") and data.shape[1] % 32 == 0:
            packed = gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q4_0)
            w.add_tensor(name, packed, raw_shape=packed.shape,
                         raw_dtype=gguf.GGMLQuantizationType.Q4_0)  # fmt: skip
            continue
        w.add_tensor(name, data.astype(np.float16) if f16 and data.ndim == 2 else data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _llama3_factors(rope: dict, head_dim: int) -> np.ndarray:
    """LlamaModel.generate_extra_tensors: one divisor per frequency."""
    freqs = 1.0 / (rope["rope_theta"] ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old / low, old / high
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            factors.append(1)
        elif wavelen > low_wavelen:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(factors, np.float32)


# ---- qkv against the checkpoint and against transformers' reader ----------------------------


@pytest.fixture
def written(tmp_path, monkeypatch, request):
    """(the transformers model, the .gguf path, qkv's model loaded from it)"""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))  # qkv.load's cache
    arch, model = tiny_model(request.param)
    path = tmp_path / f"{request.param}.gguf"
    convert(model, arch, path)
    return model, path, load_source(str(path))


def _ids(batch: int = 2) -> torch.Tensor:
    return torch.randint(3, V, (batch, T), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("written", list(CASES), indirect=True)
def test_weights_are_the_checkpoints(written):
    model, path, _ = written
    read = read_gguf(path, cache_dir=path.parent / "cache")
    expected = model.state_dict()
    if model.config.tie_word_embeddings:
        expected = {k: v for k, v in expected.items() if k != "lm_head.weight"}
    assert sorted(read.state_dict) == sorted(expected)
    for name, tensor in read.state_dict.items():
        # Gemma's w + 1 and back rounds to the float32 grid of numbers near 2 (2.4e-7 apart)
        torch.testing.assert_close(tensor, expected[name], rtol=0, atol=5e-7, msg=name)


@pytest.mark.parametrize("written", list(CASES), indirect=True)
def test_logits_equal_the_checkpoint(written):
    model, _, loaded = written
    ids = _ids()
    with torch.no_grad():
        expected = model(ids).logits
        ours = loaded.model(ids).logits
    torch.testing.assert_close(ours, expected, rtol=0, atol=1e-4)


@pytest.mark.parametrize("written", READ_BY_TRANSFORMERS, indirect=True)
def test_logits_equal_transformers_reading_the_same_file(written):
    _, path, loaded = written
    theirs = hf.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, attn_implementation="eager", dtype=torch.float32
    ).eval()
    ids = _ids()
    with torch.no_grad():
        expected = theirs(ids).logits
        ours = loaded.model(ids).logits
    torch.testing.assert_close(ours, expected, rtol=0, atol=1e-4)


@pytest.mark.parametrize("written", ["phi3", "gemma2", "gemma3"], indirect=True)
def test_attention_records_equal_transformers_reading_the_same_file(written):
    """The first layer (sliding where the model slides) and the last (full): qkv's record of
    a file's attention is transformers' own, soft-cap and window included, and its trace
    gives the head's own output. Past the first layer the two models' float32 roundings
    have added up in the residual stream (to 4e-6 by Gemma 3's sixth layer)."""
    _, path, loaded = written
    theirs = hf.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, attn_implementation="eager", dtype=torch.float32
    ).eval()
    last = loaded.config.num_layers - 1
    with torch.no_grad():
        expected = theirs(_ids(), output_attentions=True).attentions
        records = loaded.model(_ids(), layers=[0, last]).records
    for layer, atol in [(0, 1e-6), (last, 1e-5)]:
        record = records[layer]
        torch.testing.assert_close(record.weights(), expected[layer], rtol=0, atol=atol)
        steps = record.steps(head=1, query=T - 1)  # in float64: within float32's rounding
        torch.testing.assert_close(steps.contextualized.float(), record.out[0, 1, T - 1],
                                   rtol=1e-6, atol=1e-6)  # fmt: skip


@pytest.mark.parametrize("written", list(CASES), indirect=True)
def test_saved_as_a_hugging_face_folder_it_loads_in_transformers(written):
    """qkv.load of the file, then Pretrained.save: the folder a user would hand on."""
    _, path, _ = written
    ours = qkv.load(str(path))
    ours.save(path.parent / "saved")
    theirs = hf.AutoModelForCausalLM.from_pretrained(
        path.parent / "saved", attn_implementation="eager", dtype=torch.float32
    ).eval()
    with torch.no_grad():
        torch.testing.assert_close(ours.model(_ids()).logits, theirs(_ids()).logits,
                                   rtol=0, atol=1e-4)  # fmt: skip


@pytest.mark.parametrize("case", ["qwen3", "gemma3"])
def test_a_float16_file_equals_transformers_reading_it(tmp_path, monkeypatch, case):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    arch, model = tiny_model(case)
    convert(model, arch, tmp_path / "f16.gguf", f16=True)
    theirs = hf.AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file="f16.gguf", attn_implementation="eager", dtype=torch.float32
    ).eval()
    with torch.no_grad():
        expected = theirs(_ids()).logits
        ours = load_source(str(tmp_path / "f16.gguf")).model(_ids()).logits
        assert not torch.allclose(ours, model(_ids()).logits, rtol=0, atol=1e-4)  # rounded
    torch.testing.assert_close(ours, expected, rtol=0, atol=1e-4)


@pytest.mark.parametrize("native", ["1", "0"])  # qkv's kernels, then torch's int4 kernel
def test_int4_keeps_qwen2s_biases_and_follows_the_dequantized_file(tmp_path, monkeypatch, native):
    """Qwen2's q, k and v have biases; int4 once dropped them (the 4-bit layer had none), and
    its logits were wrong with no word said. A Q4_0 file's int4 load follows its float32
    load (the same 4-bit values, dequantized) up to the rounding of the inputs (8 bits a
    block for qkv's native kernels, bfloat16 for torch's)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("QKV_NATIVE", native)
    arch, model = tiny_model("qwen2")
    for block in model.model.layers:  # biases large enough that dropping one shows
        for linear in (block.self_attn.q_proj, block.self_attn.k_proj, block.self_attn.v_proj):
            torch.nn.init.normal_(linear.bias, std=0.5)
    convert(model, arch, tmp_path / "q4.gguf", q4=True)
    dense = qkv.load(str(tmp_path / "q4.gguf"))
    packed = qkv.load(str(tmp_path / "q4.gguf"), int4=True)
    assert all(hasattr(b.attn, "qkv") and b.attn.qkv.bias is not None
               for b in packed.model.blocks)  # fmt: skip
    with torch.inference_mode():
        want, got = dense.model(_ids()).logits, packed.model(_ids()).logits
    spread = float(want.max() - want.min())
    assert float((got - want).abs().max()) < 0.02 * spread
    unbiased = qkv.load(str(tmp_path / "q4.gguf"), int4=True)
    for block in unbiased.model.blocks:
        block.attn.qkv.bias = None  # what int4 did before
    with torch.inference_mode():
        wrong = unbiased.model(_ids()).logits
    assert float((wrong - want).abs().max()) > 0.1 * spread  # the test would have seen it


@pytest.mark.parametrize("written", ["phi3"], indirect=True)
def test_a_phi3_file_with_a_window_has_none(written, tmp_path):
    """Phi-3-mini's config.json slides a window of 2047; llama.cpp turns Phi-3's window off
    (llama.cpp#13676), and transformers' reader does not read it: neither does qkv."""
    model, _, _ = written
    model.config.sliding_window = 8
    path = tmp_path / "windowed.gguf"
    convert(model, "phi3", path)
    loaded = load_source(str(path))
    assert loaded.config.block.window is None and loaded.hf_config.get("sliding_window") is None
    model.config.sliding_window = None  # the model llama.cpp computes
    with torch.no_grad():
        torch.testing.assert_close(loaded.model(_ids()).logits, model(_ids()).logits,
                                   rtol=0, atol=1e-4)  # fmt: skip


# ---- what llama.cpp's code fixes, not the header -----------------------------------------------


def _header(arch: str, layers: int, **keys) -> Header:
    metadata = {f"{arch}.{k}": v for k, v in keys.items()}
    metadata |= {f"{arch}.block_count": layers, "general.architecture": arch}
    return Header(metadata, [])


@pytest.mark.parametrize(("arch", "layers"), [("gemma2", 46), ("gemma3", 62)])
def test_gemma_27b_scales_by_width_over_heads(arch, layers):
    """llama.cpp gives the 27B models (told apart by their layer count) the scale
    1/sqrt(C / H); every other size 1/sqrt(head_dim)."""
    keys = {"embedding_length": 4608, "attention.head_count": 32, "attention.key_length": 128}
    big, _ = ARCHES[arch].config(_header(arch, layers, **keys))
    small, _ = ARCHES[arch].config(_header(arch, layers - 2, **keys))
    assert big["query_pre_attn_scalar"] == 144 and small["query_pre_attn_scalar"] == 128


def test_gemma3_without_a_window_has_only_full_layers():
    config, _ = ARCHES["gemma3"].config(_header("gemma3", 4, **{"attention.key_length": 16}))
    assert config["layer_types"] == ["full_attention"] * 4


@pytest.mark.parametrize("arch", list(ARCHES))
def test_a_missing_rope_base_is_llama_cpps_default(arch):
    """10 000, as llama.cpp takes it, never a family's own default (Gemma 3's is 10^6)."""
    # what DeepSeek's header must have: its sigmoid router and the latent norms' epsilon
    needed = {"expert_gating_func": 2, "attention.layer_norm_rms_epsilon": 1e-6}
    config, _ = ARCHES[arch].config(_header(arch, 2, **(needed if arch == "deepseek2" else {})))
    assert config["rope_theta"] == 10000.0


def _patch_uint32(path, key: str, value: int) -> None:
    """Set the header's uint32 `key` to `value` in place (the file keeps its length)."""
    data = path.read_bytes()
    at = data.index(key.encode()) + len(key) + 4  # past the name, then the value's type
    path.write_bytes(data[:at] + value.to_bytes(4, "little") + data[at + 4 :])


def test_llama_with_partial_rotary_is_refused(tmp_path):
    """llama.cpp itself refuses a llama whose rotated dimensions are not its head size."""
    _, model = tiny_model("llama")
    convert(model, "llama", tmp_path / "partial.gguf")
    _patch_uint32(tmp_path / "partial.gguf", "llama.rope.dimension_count", 8)  # of 16
    with pytest.raises(ValueError, match="llama.rope.dimension_count"):
        read_gguf(tmp_path / "partial.gguf", cache_dir=tmp_path / "cache")


@pytest.mark.parametrize("case", ["qwen2", "gemma2", "gemma3"])
def test_a_billion_layers_are_refused_before_any_list_of_them(tmp_path, case):
    """Families list each layer's type; a header claiming 10^9 layers is refused first."""
    arch, model = tiny_model(case)
    convert(model, arch, tmp_path / "big.gguf")
    _patch_uint32(tmp_path / "big.gguf", f"{arch}.block_count", 10**9)
    with pytest.raises(ValueError, match=rf"header \({arch}.block_count=1,000,000,000\)"):
        read_gguf(tmp_path / "big.gguf", cache_dir=tmp_path / "cache")


@pytest.mark.parametrize("arch", ["gemma2", "gemma3"])
def test_a_final_cap_of_zero_caps_nothing(arch):
    keys = {"attention.key_length": 16, "final_logit_softcapping": 0.0}
    config, _ = ARCHES[arch].config(_header(arch, 2, **keys))
    assert config["final_logit_softcapping"] is None


def test_a_rope_factor_without_a_type_is_linear():
    """llama.cpp's default scaling type is linear; a factor of 1 (or 0) is none."""
    config, _ = ARCHES["qwen2"].config(_header("qwen2", 2, **{"rope.scaling.factor": 4.0}))
    assert config["rope_scaling"] == {"rope_type": "linear", "factor": 4.0}
    old, _ = ARCHES["llama"].config(_header("llama", 2, **{"rope.scale_linear": 2.0}))
    assert old["rope_scaling"] == {"rope_type": "linear", "factor": 2.0}
    for factor in (0.0, 1.0):
        plain, _ = ARCHES["llama"].config(_header("llama", 2, **{"rope.scaling.factor": factor}))
        assert "rope_scaling" not in plain


REFUSED = [  # (architecture, header keys, what the refusal names)
    ("qwen3", {"attention.key_length": 16, "attention.value_length": 32},
     "qwen3.attention.value_length=32 is not the key head size"),
    ("qwen2", {"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0,
               "rope.scaling.yarn_ext_factor": 0.5}, "qwen2.rope.scaling.yarn_ext_factor"),
    ("qwen2", {"rope.scaling.type": "longrope"}, "qwen2.rope.scaling.type 'longrope'"),
    ("gemma", {"rope.scaling.attn_factor": 2.0}, "gemma.rope.scaling.attn_factor=2.0"),
]  # fmt: skip


@pytest.mark.parametrize(("arch", "keys", "says"), REFUSED, ids=[r[2][:30] for r in REFUSED])
def test_what_qkv_does_not_compute_is_refused_by_key(arch, keys, says):
    with pytest.raises(ValueError, match=re.escape(says)):
        ARCHES[arch].config(_header(arch, 2, **keys))


def test_a_phi3_attention_factor_without_rope_factors_is_refused():
    """llama.cpp would scale every query and key by it; qkv holds one only with LongRoPE."""
    keys = {"rope.scaling.attn_factor": 1.2, "embedding_length": 64, "attention.head_count": 4}
    config, _ = ARCHES["phi3"].config(_header("phi3", 2, **keys))
    with pytest.raises(ValueError, match="phi3.rope.scaling.attn_factor comes without"):
        rope_tensors(ARCHES["phi3"], config, {})


def test_rope_factor_tensors_beside_a_scaling_type_are_refused():
    """llama.cpp would apply both the header's factor and the tensor's; qkv holds one."""
    header = _header("llama", 2, **{"rope.scaling.type": "linear", "rope.scaling.factor": 2.0})
    config, _ = ARCHES["llama"].config(header)
    with pytest.raises(ValueError, match="'linear' comes with per-frequency rope factor"):
        rope_tensors(ARCHES["llama"], config, {"rope_freqs.weight": torch.ones(8)})

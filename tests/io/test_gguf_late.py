"""qkv.io.gguf over the late-2026 architectures (experts, sinks, chunks, latent attention), as
test_gguf_arches.py does the others: tiny random transformers checkpoints written to .gguf
files as llama.cpp's convert_hf_to_gguf.py writes them, read by qkv and compared with the
checkpoint and, where transformers reads the architecture (qwen3moe), with its reader:
it reads no Mixtral (a "llama" file with experts builds a Llama), no llama4, and not
llama.cpp's gpt-oss files (its reader looks for ffn_*_projs tensors, not gguf's
ffn_*_exps, and fails on the file with a TypeError).

`convert` is the test's own copy of the converter, written from llama.cpp's naming (gguf's
name map, GGUFWriter's setters) and the converter's tensor surgery: experts stacked into 3-D
(E, I, C) gate and up and (E, C, I) down tensors, Mixtral written as "llama" with its q and
k rows permuted, Llama 4's not (its converter keeps Meta's interleaved rows). DeepSeek-V3's
(deepseek2) rows are not permuted either: llama.cpp turns deepseek2 as LLAMA_ROPE_TYPE_NORM
(llama_model_rope_type: pairs of neighbouring values), the pairs a rope_interleave checkpoint
turns, so DeepseekV2Model.modify_tensors only stacks the experts and renames the router's
e_score_correction_bias to e_score_correction.bias (exp_probs_b.bias) and, since it splits
kv_b, cuts it per head into attn_k_b and attn_v_b (`SPLIT_KV_B`; before, attn_kv_b whole).
"""

from __future__ import annotations

import re

import gguf
import numpy as np
import pytest
import torch
import transformers as hf
from test_gguf import byte_level_vocab, permute
from test_gguf_arches import _llama3_factors

import qkv
from qkv.io.gguf import read_gguf
from qkv.io.load import load_source

TOKENS, TOKEN_TYPES, MERGES = byte_level_vocab()
V = len(TOKENS)
T = 12
SHARED = dict(vocab_size=V, hidden_size=64, num_hidden_layers=2, max_position_embeddings=256,
              rms_norm_eps=1e-5, num_experts_per_tok=2)  # fmt: skip

TINY = {
    "mixtral": ("llama", hf.MixtralForCausalLM, hf.MixtralConfig(
        **SHARED, intermediate_size=32, num_attention_heads=4, num_key_value_heads=2,
        num_local_experts=4, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    # head_dim 16, not C / H: the file's key_length says it; transformers' GGUF reader takes
    # moe_intermediate_size from its class default, 768 (not expert_feed_forward_length)
    "qwen3moe": ("qwen3moe", hf.Qwen3MoeForCausalLM, hf.Qwen3MoeConfig(
        **SHARED, intermediate_size=48, moe_intermediate_size=768, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, num_experts=4, norm_topk_prob=True,
        tie_word_embeddings=True)),
    # what llama.cpp fixes for Llama 4 (chunks of 8192, its temperature's 8192 and 0.1, a NoPE
    # layer every 4), and the llama3 rope its converter writes as rope_freqs, taking the
    # trained length 8192; 4 layers, experts on every second
    "llama4": ("llama4", hf.Llama4ForCausalLM, hf.Llama4TextConfig(
        **{**SHARED, "num_hidden_layers": 4, "num_experts_per_tok": 1}, intermediate_size=32,
        intermediate_size_mlp=48, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_local_experts=4, interleave_moe_layer_step=2, no_rope_layer_interval=4,
        attention_chunk_size=8192, floor_scale=8192, attn_scale=0.1, use_qk_norm=True,
        attn_temperature_tuning=True, tie_word_embeddings=False,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 16.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 1.0,
                         "original_max_position_embeddings": 8192})),
    # YaRN with its ramp rounded (truncate true): what llama.cpp computes from any gpt-oss file
    "gpt-oss": ("gpt-oss", hf.GptOssForCausalLM, hf.GptOssConfig(
        **SHARED, intermediate_size=32, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, num_local_experts=4, sliding_window=4, tie_word_embeddings=False,
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0,
                         "beta_fast": 32.0, "beta_slow": 1.0, "truncate": True,
                         "original_max_position_embeddings": 64})),
    # DeepSeek-V3 (llama.cpp's deepseek2): its latent norms' eps, 1e-6, is the only one a file
    # can hold; a dense layer, then experts in 4 groups, the best 2 groups chosen; YaRN whose
    # whole correction is the score scale (mscale == mscale_all_dim: what a file can say)
    "deepseek2": ("deepseek2", hf.DeepseekV3ForCausalLM, hf.DeepseekV3Config(
        **{**SHARED, "rms_norm_eps": 1e-6}, intermediate_size=48, moe_intermediate_size=16,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, n_group=4,
        topk_group=2, n_shared_experts=2, first_k_dense_replace=1, norm_topk_prob=True,
        routed_scaling_factor=2.5, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=4,
        qk_nope_head_dim=8, v_head_dim=12, tie_word_embeddings=False,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "mscale": 0.5, "mscale_all_dim": 0.5,
                         "original_max_position_embeddings": 64})),
    # queries straight from x (q_lora_rank null), every layer experts, one group, weights
    # neither renormalized nor scaled, no rope scaling, tied embeddings
    "deepseek2-q": ("deepseek2", hf.DeepseekV3ForCausalLM, hf.DeepseekV3Config(
        **{**SHARED, "rms_norm_eps": 1e-6}, intermediate_size=48, moe_intermediate_size=16,
        num_attention_heads=2, num_key_value_heads=2, n_routed_experts=4, n_group=1,
        topk_group=1, n_shared_experts=1, first_k_dense_replace=0, norm_topk_prob=False,
        routed_scaling_factor=1.0, kv_lora_rank=24, q_lora_rank=None, qk_rope_head_dim=8,
        qk_nope_head_dim=8, v_head_dim=16, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 500.0})),
}  # fmt: skip
READ_BY_TRANSFORMERS = ["qwen3moe"]
# written as llama.cpp's converters write DeepSeek now: kv_b split into attn_k_b and attn_v_b,
# the header's MQA view (head_count_kv 1) and the heads' sizes under *_mla
SPLIT_KV_B = ["deepseek2-q"]


def tiny_model(case: str) -> tuple[str, hf.PreTrainedModel]:
    """(GGUF architecture, a seeded random float32 model) with norms and biases far from 1, 0."""
    arch, cls, config = TINY[case]
    torch.manual_seed(0)
    model = cls(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.copy_(torch.randn_like(p) * 0.5 + (0.0 if "bias" in name else 0.5))
            else:
                p.normal_(0, 0.1)
        for name, b in model.named_buffers():  # DeepSeek's router correction bias: not 0
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b) * 0.5)
    return arch, model


# ---- the test's convert_hf_to_gguf.py -------------------------------------------------------


def _deepseek2_header(w: gguf.GGUFWriter, c, split_kv_b: bool) -> None:
    """DeepseekV2Model.set_gguf_parameters; before converters split kv_b (attn_kv_b whole),
    head_count_kv was the heads' and key_length and value_length the heads' query and value
    sizes; since, they are the compressed keys' MQA view (1 head, R + dr and R) and the heads'
    sizes are under *_mla. The gating function as written for scoring_func "sigmoid"."""
    w.add_leading_dense_block_count(c.first_k_dense_replace)
    w.add_vocab_size(c.vocab_size)
    if c.q_lora_rank is not None:
        w.add_q_lora_rank(c.q_lora_rank)
    w.add_kv_lora_rank(c.kv_lora_rank)
    if split_kv_b:
        w.add_head_count_kv(1)
        w.add_key_length(c.kv_lora_rank + c.qk_rope_head_dim)
        w.add_value_length(c.kv_lora_rank)
        w.add_key_length_mla(c.qk_nope_head_dim + c.qk_rope_head_dim)
        w.add_value_length_mla(c.v_head_dim)
    else:
        w.add_head_count_kv(c.num_key_value_heads)
        w.add_key_length(c.qk_nope_head_dim + c.qk_rope_head_dim)
        w.add_value_length(c.v_head_dim)
    w.add_expert_feed_forward_length(c.moe_intermediate_size)
    w.add_expert_count(c.n_routed_experts)
    w.add_expert_shared_count(c.n_shared_experts)
    w.add_expert_weights_scale(c.routed_scaling_factor)
    w.add_expert_weights_norm(c.norm_topk_prob)
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    w.add_expert_group_count(c.n_group)
    w.add_expert_group_used_count(c.topk_group)
    w.add_rope_dimension_count(c.qk_rope_head_dim)
    rope = c.rope_parameters
    if rope["rope_type"] == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])


def _header(w: gguf.GGUFWriter, c, arch: str, split_kv_b: bool = False) -> None:
    """What TextModel.set_gguf_parameters and each model's own add to it write."""
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    # Llama4Model swaps the widths: the dense layers' is feed_forward_length
    w.add_feed_forward_length(c.intermediate_size_mlp if arch == "llama4" else c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_expert_used_count(c.num_experts_per_tok)
    if arch == "deepseek2":
        _deepseek2_header(w, c, split_kv_b)
        _vocab(w)
        return
    w.add_head_count_kv(c.num_key_value_heads)
    head_dim = getattr(c, "head_dim", None)
    if head_dim:  # written only where config.json has one
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    experts = getattr(c, "num_local_experts", None) or getattr(c, "num_experts", None)
    w.add_expert_count(experts)
    if arch in ("llama", "llama4"):  # LlamaModel: the rotated dimensions, always
        w.add_rope_dimension_count(head_dim or c.hidden_size // c.num_attention_heads)
        w.add_vocab_size(c.vocab_size)
    if arch == "qwen3moe":  # Qwen2MoeModel
        w.add_expert_feed_forward_length(c.moe_intermediate_size)
    if arch in ("llama4", "gpt-oss"):
        w.add_expert_feed_forward_length(c.intermediate_size)
    if arch == "llama4":
        w.add_interleave_moe_layer_step(c.interleave_moe_layer_step)
    if arch == "gpt-oss":  # GptOssModel
        w.add_sliding_window(c.sliding_window)
        rope = c.rope_parameters
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        w.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
        w.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
    _vocab(w)


def _vocab(w: gguf.GGUFWriter) -> None:
    w.add_tokenizer_model("gpt2")
    w.add_token_list(TOKENS)
    w.add_token_types(TOKEN_TYPES)
    w.add_token_merges(MERGES)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)


def _tensors(
    model: hf.PreTrainedModel, arch: str, split_kv_b: bool = False
) -> dict[str, np.ndarray]:
    """The model's tensors under GGUF names, as the converter writes them. The checkpoint
    keeps expert e's gate, up and down apart; the converter stacks them over e, which is
    transformers' in-memory gate_up_proj (E, 2I, C) cut in halves, and its down_proj."""
    c = model.config
    names = gguf.get_tensor_name_map(
        gguf.MODEL_ARCH[arch.upper().replace("-", "_")], c.num_hidden_layers
    )
    out = {}
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        data = tensor.float().numpy().copy()
        if arch == "gpt-oss" and "experts" in name:  # GptOssModel.modify_tensors
            out |= _gpt_oss_experts(name, data, names)
            continue
        if arch == "llama4" and name.endswith("experts.gate_up_proj"):  # (E, C, 2I)
            data = data.transpose(0, 2, 1)
        if arch == "llama4" and name.endswith("experts.down_proj"):  # (E, I, C)
            data = data.transpose(0, 2, 1).copy()
        if name.endswith("experts.gate_up_proj"):
            gate, up = (np.ascontiguousarray(h) for h in np.split(data, 2, axis=1))
            stem = name.removesuffix("gate_up_proj")
            out[f"{names.get_name(stem + 'gate_proj')}.weight"] = gate
            out[f"{names.get_name(stem + 'up_proj')}.weight"] = up
            continue
        if name.endswith("experts.down_proj"):
            out[f"{names.get_name(name)}.weight"] = data
            continue
        stem, suffix = name.rsplit(".", 1)
        if arch == "llama" and stem.endswith(("q_proj", "k_proj")):  # LlamaModel.permute
            heads = c.num_attention_heads if "q_proj" in stem else c.num_key_value_heads
            data = permute(data, heads)
        if split_kv_b and name.endswith("kv_b_proj.weight"):  # DeepseekV2Model's split
            out |= _split_kv_b(name, data, c, names)
            continue
        if name.endswith("e_score_correction_bias"):  # DeepseekV2Model.modify_tensors
            stem, suffix = name.removesuffix("_bias"), "bias"
        if name.endswith("sinks"):  # its converter adds the suffix
            stem, suffix = name, "weight"
        out[f"{names.get_name(stem)}.{suffix}"] = data
    rope = c.rope_parameters
    if rope.get("rope_type") == "llama3":  # LlamaModel.generate_extra_tensors
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        out["rope_freqs.weight"] = _llama3_factors(rope, head_dim)
    return out


def _split_kv_b(name: str, data: np.ndarray, c, names) -> dict[str, np.ndarray]:
    """kv_b (H * (dn + dv), R) per head: k_b its dn key rows turned (H, R, dn), v_b its dv
    value rows (H, dv, R)."""
    per_head = data.reshape(c.num_attention_heads, c.qk_nope_head_dim + c.v_head_dim, -1)
    k_b, v_b = per_head[:, : c.qk_nope_head_dim], per_head[:, c.qk_nope_head_dim :]
    stem = name.removesuffix("kv_b_proj.weight")
    return {f"{names.get_name(stem + 'k_b_proj')}.weight": np.ascontiguousarray(k_b.swapaxes(1, 2)),
            f"{names.get_name(stem + 'v_b_proj')}.weight": np.ascontiguousarray(v_b)}  # fmt: skip


def _gpt_oss_experts(name: str, data: np.ndarray, names) -> dict[str, np.ndarray]:
    """gpt-oss's experts: gate and up interleaved on the last axis, split apart; the
    matrices (E, C, 2I) and (E, I, C) turned to GGUF's (E, I, C) and (E, C, I)."""
    stem = name[: name.index("experts.") + len("experts.")]
    gate, up = f"{names.get_name(stem + 'gate_proj')}", f"{names.get_name(stem + 'up_proj')}"
    down = names.get_name(stem + "down_proj")

    def turned(a):
        return np.ascontiguousarray(a.swapaxes(1, 2))

    if name.endswith("gate_up_proj"):
        return {f"{gate}.weight": turned(data[..., 0::2]), f"{up}.weight": turned(data[..., 1::2])}
    if name.endswith("gate_up_proj_bias"):
        return {f"{gate}.bias": data[:, 0::2].copy(), f"{up}.bias": data[:, 1::2].copy()}
    if name.endswith("down_proj"):
        return {f"{down}.weight": turned(data)}
    assert name.endswith("down_proj_bias"), name
    return {f"{down}.bias": data}


def convert(
    model: hf.PreTrainedModel, arch: str, path, *, q4: bool = False, split_kv_b: bool = False
) -> None:
    """Write `model` as the converter would, in float32; q4: the blocks' matrices, 3-D
    experts too, in Q4_0 (as llama-quantize writes them)."""
    w = gguf.GGUFWriter(str(path), arch)
    _header(w, model.config, arch, split_kv_b)
    for name, data in _tensors(model, arch, split_kv_b).items():
        if q4 and data.ndim >= 2 and name.startswith("blk.") and data.shape[-1] % 32 == 0:
            packed = gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q4_0)
            w.add_tensor(name, packed, raw_shape=packed.shape,
                         raw_dtype=gguf.GGMLQuantizationType.Q4_0)  # fmt: skip
            continue
        w.add_tensor(name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# ---- qkv against the checkpoint and against transformers' reader ----------------------------


@pytest.fixture
def written(tmp_path, monkeypatch, request):
    """(the transformers model, the .gguf path, qkv's model loaded from it)"""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    arch, model = tiny_model(request.param)
    path = tmp_path / f"{request.param}.gguf"
    convert(model, arch, path, split_kv_b=request.param in SPLIT_KV_B)
    return model, path, load_source(str(path))


def _ids(batch: int = 2) -> torch.Tensor:
    return torch.randint(3, V, (batch, T), generator=torch.Generator().manual_seed(1))


def _expected_state_dict(model: hf.PreTrainedModel) -> dict[str, torch.Tensor]:
    expected = model.state_dict()
    if model.config.tie_word_embeddings:
        expected = {k: v for k, v in expected.items() if k != "lm_head.weight"}
    return expected


@pytest.mark.parametrize("written", list(TINY), indirect=True)
def test_weights_are_the_checkpoints(written):
    """Under transformers' in-memory names: the 3-D experts joined, the rows unpermuted."""
    model, path, _ = written
    read = read_gguf(path, cache_dir=path.parent / "cache")
    expected = _expected_state_dict(model)
    assert sorted(read.state_dict) == sorted(expected)
    for name, tensor in read.state_dict.items():
        torch.testing.assert_close(tensor, expected[name], rtol=0, atol=0, msg=name)
    again = read_gguf(path, cache_dir=path.parent / "cache")  # from the cache: the same
    assert all(torch.equal(again.state_dict[n], t) for n, t in read.state_dict.items())


@pytest.mark.parametrize("written", list(TINY), indirect=True)
def test_logits_equal_the_checkpoint(written):
    model, _, loaded = written
    assert loaded.config.block.experts is not None
    with torch.no_grad():
        expected = model(_ids()).logits
        ours = loaded.model(_ids()).logits
    torch.testing.assert_close(ours, expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("written", READ_BY_TRANSFORMERS, indirect=True)
def test_logits_equal_transformers_reading_the_same_file(written):
    _, path, loaded = written
    theirs = hf.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, attn_implementation="eager", dtype=torch.float32
    ).eval()
    with torch.no_grad():
        expected = theirs(_ids()).logits
        ours = loaded.model(_ids()).logits
    torch.testing.assert_close(ours, expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("written", list(TINY), indirect=True)
def test_saved_as_a_hugging_face_folder_it_loads_in_transformers(written):
    """qkv.load of the file, then Pretrained.save (each expert's matrices apart again)."""
    model, path, _ = written
    ours = qkv.load(str(path))
    ours.save(path.parent / "saved")
    theirs = hf.AutoModelForCausalLM.from_pretrained(
        path.parent / "saved", attn_implementation="eager", dtype=torch.float32
    ).eval()
    assert type(theirs) is type(model)
    with torch.no_grad():
        torch.testing.assert_close(ours.model(_ids()).logits, theirs(_ids()).logits,
                                   rtol=0, atol=1e-5)  # fmt: skip


def test_a_q4_file_dequantizes_each_expert_as_transformers_does(tmp_path, monkeypatch):
    """Q4_0 3-D experts are E matrices of 32-value rows: qkv's float32 reading of the file
    equals transformers' (gguf-py's own dequantization), and is not the float32 model."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    arch, model = tiny_model("qwen3moe")
    convert(model, arch, tmp_path / "q4.gguf", q4=True)
    theirs = hf.AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file="q4.gguf", attn_implementation="eager", dtype=torch.float32
    ).eval()
    read = read_gguf(tmp_path / "q4.gguf", cache_dir=tmp_path / "cache").state_dict
    name = "model.layers.1.mlp.experts.gate_up_proj"
    torch.testing.assert_close(read[name], theirs.state_dict()[name], rtol=0, atol=0)
    assert not torch.equal(read[name], model.state_dict()[name])  # it was quantized
    with torch.no_grad():
        ours = load_source(str(tmp_path / "q4.gguf")).model(_ids()).logits
        torch.testing.assert_close(ours, theirs(_ids()).logits, rtol=0, atol=1e-5)


# ---- refusals -------------------------------------------------------------------------------


def _patch_uint32(path, key: str, value: int) -> None:
    data = path.read_bytes()
    at = data.index(key.encode()) + len(key) + 4  # past the name, then the value's type
    path.write_bytes(data[:at] + value.to_bytes(4, "little") + data[at + 4 :])


@pytest.mark.parametrize("count", [10**9, 5])
def test_more_experts_than_the_routers_rows_are_refused_by_key(tmp_path, count):
    """A billion experts are refused before any list of their tensors is made."""
    arch, model = tiny_model("qwen3moe")
    convert(model, arch, tmp_path / "many.gguf")
    _patch_uint32(tmp_path / "many.gguf", "qwen3moe.expert_count", count)
    says = f"qwen3moe.expert_count={count:,} is more experts than its routers"
    with pytest.raises(ValueError, match=re.escape(says)):
        read_gguf(tmp_path / "many.gguf", cache_dir=tmp_path / "cache")


def test_fewer_experts_than_the_tensors_hold_are_refused_by_shape(tmp_path):
    arch, model = tiny_model("mixtral")
    convert(model, arch, tmp_path / "few.gguf")
    _patch_uint32(tmp_path / "few.gguf", "llama.expert_count", 3)
    with pytest.raises(ValueError, match=r"tensor blk.0.ffn_gate_inp.weight has shape \(4, 64\)"):
        read_gguf(tmp_path / "few.gguf", cache_dir=tmp_path / "cache")


def test_an_expert_tensor_missing_is_refused_by_name(tmp_path):
    arch, model = tiny_model("mixtral")
    path = tmp_path / "missing.gguf"
    w = gguf.GGUFWriter(str(path), arch)
    _header(w, model.config, arch)
    for name, data in _tensors(model, arch).items():
        if name != "blk.1.ffn_up_exps.weight":
            w.add_tensor(name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    says = r"has 22 weight tensors, but its header .* needs 23 \(it lacks blk.1.ffn_up_exps"
    with pytest.raises(ValueError, match=says):
        read_gguf(path, cache_dir=tmp_path / "cache")


# ---- what llama.cpp's code fixes, not the header --------------------------------------------


@pytest.mark.parametrize("written", ["llama4"], indirect=True)
def test_llama4_is_what_llama_cpp_computes(written):
    """Chunks of 8192 on the rotary layers, every fourth layer without rotary and with
    llama.cpp's temperature, L2-normed queries and keys: none of it is in the header."""
    _, _, loaded = written
    cfg = loaded.config
    assert cfg.layer_types == ("chunked", "chunked", "chunked", "full")
    assert cfg.rope_layers == (True, True, True, False)
    assert cfg.moe_layers == (False, True, False, True)
    assert cfg.block.chunk == 8192 and cfg.block.qk_norm == "l2"
    temperature = cfg.block.temperature
    assert (temperature.strength, temperature.every, temperature.shift) == (0.1, 8192, 1.0)


@pytest.mark.parametrize("native", ["1", "0"])  # qkv's kernels, then torch's int4 kernel
def test_int4_keeps_deepseeks_rope_rows_in_qkvs_order(tmp_path, monkeypatch, native):
    """DeepSeek's q and kv_a rows come interleaved and qkv's rotary turns halves, so the
    family permutes them (`permuted_rows`); kept in 4 bits, their bits, scales and zeros are
    permuted alike, and the int4 load follows the float32 load of the same Q4_0 file up to
    bfloat16's rounding of the inputs."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("QKV_NATIVE", native)
    arch, model = tiny_model("deepseek2-q")
    convert(model, arch, tmp_path / "q4.gguf", q4=True, split_kv_b=True)
    dense = qkv.load(str(tmp_path / "q4.gguf"))
    packed = qkv.load(str(tmp_path / "q4.gguf"), int4=True)
    attention = packed.model.blocks[0].attn
    kind = "QuantLinear" if native == "1" else "Int4Linear"  # the file's own rows, moved
    assert [type(attention.q).__name__, type(attention.kv_a).__name__] == [kind] * 2
    with torch.inference_mode():
        want, got = dense.model(_ids()).logits, packed.model(_ids()).logits
    spread = float(want.max() - want.min())
    assert float((got - want).abs().max()) < 0.02 * spread

"""qkv.io.gguf_arch's reading of the late-2026 architectures' headers: what llama.cpp's code
fixes and the header leaves out (Llama 4's Maverick, gpt-oss's rounded YaRN and its
sliding pattern), DeepSeek-V3's latent sizes and experts in the newer converters' header
(head_count_kv 1, *_mla keys), and what qkv refuses, by the header's key. The files
themselves are written and read in test_gguf_late.py.
"""

from __future__ import annotations

import re

import pytest
import torch
from gguf import GGMLQuantizationType

from qkv.io.gguf_arch import ARCHES, arch_of
from qkv.io.gguf_header import Header, TensorInfo


def _meta(arch: str, **keys) -> Header:
    metadata = {f"{arch}.{k}": v for k, v in keys.items()}
    return Header(metadata | {"general.architecture": arch}, [])


def test_llama4_with_128_experts_has_no_qk_norm():
    """llama.cpp tells Maverick by its 128 experts and norms no query or key there."""
    config, _ = ARCHES["llama4"].config(_meta("llama4", expert_count=128, feed_forward_length=8))
    assert config["use_qk_norm"] is False and config["intermediate_size_mlp"] == 8
    config, _ = ARCHES["llama4"].config(_meta("llama4", expert_count=16))
    assert config["use_qk_norm"] is True


def test_gpt_oss_is_what_llama_cpp_computes():
    """YaRN's ramp rounded (ggml always rounds it), the SwiGLU's fixed alpha and limit, the
    sliding pattern's period; no scaling type is no scaling (not GptOssConfig's YaRN)."""
    keys = {"rope.scaling.type": "yarn", "rope.scaling.factor": 4.0, "block_count": 6,
            "attention.sliding_window_pattern": 3}  # fmt: skip
    config, _ = ARCHES["gpt-oss"].config(_meta("gpt-oss", **keys))
    assert config["rope_scaling"] == {"rope_type": "yarn", "factor": 4.0, "truncate": True}
    assert (config["swiglu_alpha"], config["swiglu_limit"]) == (1.702, 7.0)
    assert config["layer_types"] == ["sliding_attention", "sliding_attention",
                                     "full_attention"] * 2  # fmt: skip
    plain, _ = ARCHES["gpt-oss"].config(_meta("gpt-oss", block_count=2))
    assert plain["rope_scaling"] == {"rope_type": "default"}
    assert plain["layer_types"] == ["sliding_attention", "full_attention"]


# DeepSeek-V3 as llama.cpp's converter writes it (key_length and value_length: the MQA view
# of its compressed keys; the heads' sizes under *_mla), with the attn_k_b and attn_v_b
# tensors qkv refuses: its header is read here, the older files' logits in test_gguf_late.py
DEEPSEEK2 = {"embedding_length": 32, "attention.head_count": 4, "attention.head_count_kv": 1,
             "attention.layer_norm_rms_epsilon": 1e-6, "rope.dimension_count": 4,
             "attention.kv_lora_rank": 16, "attention.q_lora_rank": 16,
             "attention.key_length": 20, "attention.value_length": 16,
             "attention.key_length_mla": 12, "attention.value_length_mla": 12,
             "leading_dense_block_count": 1, "expert_feed_forward_length": 16,
             "expert_count": 8, "expert_used_count": 2, "expert_shared_count": 2,
             "expert_weights_scale": 2.5, "expert_weights_norm": True, "expert_gating_func": 2,
             "expert_group_count": 4, "expert_group_used_count": 2,
             "rope.scaling.type": "yarn", "rope.scaling.factor": 4.0,
             "rope.scaling.original_context_length": 32,
             "rope.scaling.yarn_log_multiplier": 0.1}  # fmt: skip


def test_deepseek2s_header_is_deepseek_v3s_config():
    config, names = ARCHES["deepseek2"].config(_meta("deepseek2", block_count=3, **DEEPSEEK2))
    assert config["model_type"] == "deepseek_v3"
    assert {
        k: config[k]
        for k in (
            "num_attention_heads",
            "num_key_value_heads",
            "qk_rope_head_dim",
            "qk_nope_head_dim",
            "v_head_dim",
            "kv_lora_rank",
            "q_lora_rank",
        )
    } == {
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "qk_rope_head_dim": 4,
        "qk_nope_head_dim": 8,
        "v_head_dim": 12,
        "kv_lora_rank": 16,
        "q_lora_rank": 16,
    }
    assert {
        k: config[k]
        for k in (
            "first_k_dense_replace",
            "moe_intermediate_size",
            "n_routed_experts",
            "num_experts_per_tok",
            "n_shared_experts",
            "routed_scaling_factor",
            "norm_topk_prob",
            "n_group",
            "topk_group",
        )
    } == {
        "first_k_dense_replace": 1,
        "moe_intermediate_size": 16,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "n_shared_experts": 2,
        "routed_scaling_factor": 2.5,
        "norm_topk_prob": True,
        "n_group": 4,
        "topk_group": 2,
    }
    assert config["rope_interleave"] is True and "head_dim" not in config
    scaling = config["rope_scaling"]
    assert scaling["mscale"] == pytest.approx(1.0) == scaling["mscale_all_dim"]
    assert names["qk_nope_head_dim"] == "deepseek2.attention.key_length_mla"


def test_an_older_deepseek2_header_has_its_head_sizes_under_key_length():
    """Files from before key_length_mla: key_length is the heads' query and key size."""
    keys = {k: v for k, v in DEEPSEEK2.items() if not k.endswith("_mla")}
    keys |= {"attention.key_length": 12, "attention.value_length": 12}
    del keys["expert_weights_norm"], keys["expert_weights_scale"], keys["expert_group_count"]
    config, _ = ARCHES["deepseek2"].config(_meta("deepseek2", **keys))
    assert (config["qk_nope_head_dim"], config["v_head_dim"]) == (8, 12)
    assert (config["norm_topk_prob"], config["routed_scaling_factor"], config["n_group"]) == (
        False, 1.0, 1)  # fmt: skip


def test_deepseek2s_tensor_names():
    arch = ARCHES["deepseek2"]
    name = "model.layers.2.mlp.gate.e_score_correction_bias"
    assert arch.hf_name("blk.2.exp_probs_b.bias") == name
    assert arch.gguf_names(name) == ("blk.2.exp_probs_b.bias",)
    assert arch.hf_name("blk.1.attn_kv_a_mqa.weight").endswith(
        "self_attn.kv_a_proj_with_mqa.weight"
    )
    experts = ("blk.1.ffn_gate_exps.weight", "blk.1.ffn_up_exps.weight")
    assert arch.gguf_names("model.layers.1.mlp.experts.gate_up_proj") == experts
    kv_b = "model.layers.0.self_attn.kv_b_proj.weight"
    assert arch.gguf_names(kv_b) == ("blk.0.attn_kv_b.weight",)  # older converters' whole
    with pytest.raises(ValueError, match="unsupported tensor 'blk.0.attn_k_b.weight'"):
        arch.hf_name("blk.0.attn_k_b.weight")  # not in a file that has attn_kv_b


def test_a_deepseek2_file_with_attn_k_b_joins_it_with_attn_v_b_into_kv_b():
    """Newer converters split kv_b per head: k_b (H, R, dn) turned, v_b (H, dv, R); a file
    that has them is read with the join, and the split gives back those shapes."""
    tensor = TensorInfo("blk.0.attn_k_b.weight", (4, 16, 8), GGMLQuantizationType.F32, 0, 0)
    header = _meta("deepseek2", **DEEPSEEK2)
    arch = arch_of(Header(header.metadata, [tensor]), "f.gguf")
    kv_b = "model.layers.0.self_attn.kv_b_proj.weight"
    assert arch.hf_name("blk.0.attn_v_b.weight") == kv_b
    assert arch.gguf_names(kv_b) == ("blk.0.attn_k_b.weight", "blk.0.attn_v_b.weight")
    join = arch.join_of("blk.0.attn_k_b.weight")
    whole = torch.randn(4 * (8 + 12), 16)  # H (dn + dv) rows of R: each head's dn, then dv
    k_b, v_b = join.split(whole)
    assert k_b.shape == (4, 16, 8) and v_b.shape == (4, 12, 16)
    torch.testing.assert_close(k_b[1].T, whole[20:28], rtol=0, atol=0)  # head 1's keys
    assert torch.equal(join.join([k_b, v_b]), whole)


REFUSED = [  # (architecture, header keys, what the refusal names)
    ("llama4", {"attention.sliding_window": 0}, "llama4.attention.sliding_window=0"),
    ("llama4", {"attention.sliding_window_pattern": 2},
     "llama4.attention.sliding_window_pattern=2"),
    ("gpt-oss", {"rope.freq_base": 1e4, "rope.freq_base_swa": 1e5},
     "gpt-oss.rope.freq_base_swa=100000.0"),
    ("gpt-oss", {"rope.scaling.type": "yarn", "rope.scaling.yarn_log_multiplier": 0.1},
     "gpt-oss.rope.scaling.yarn_log_multiplier"),
    ("deepseek2", {**DEEPSEEK2, "expert_gating_func": 1}, "deepseek2.expert_gating_func=1"),
    ("deepseek2", {k: v for k, v in DEEPSEEK2.items() if k != "expert_gating_func"},
     "deepseek2.expert_gating_func=None"),
    ("deepseek2", {**DEEPSEEK2, "attention.layer_norm_rms_epsilon": 1e-5},
     "deepseek2.attention.layer_norm_rms_epsilon=1e-05"),
    ("deepseek2", {**DEEPSEEK2, "rope.scaling.yarn_ext_factor": 0.5},
     "deepseek2.rope.scaling.yarn_ext_factor"),
    ("llama", {"expert_count": 4, "rope.scaling.attn_factor": 2.0},
     "llama.rope.scaling.attn_factor=2.0"),
]  # fmt: skip


@pytest.mark.parametrize(("arch", "keys", "says"), REFUSED, ids=[r[2][:40] for r in REFUSED])
def test_what_qkv_does_not_compute_is_refused_by_key(arch, keys, says):
    with pytest.raises(ValueError, match=re.escape(says)):
        ARCHES[arch].config(_meta(arch, **keys))

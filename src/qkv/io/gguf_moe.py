"""What llama.cpp's mixture-of-experts architectures add to `qkv.io.gguf_arch`: the header
keys of their experts, and the tensors its converter split, joined or transposed.

A GGUF file keeps a layer's experts as 3-D tensors, one matrix per expert: gate and up
(E, I, C) apart, down (E, C, I). A Hugging Face model may keep them otherwise (transformers'
in memory: gate and up in one (E, 2I, C) tensor; Llama 4's and gpt-oss's checkpoints: (E, C,
2I), gpt-oss's gate and up columns interleaved). A `Join` says how a block's GGUF tensors
make one Hugging Face tensor, and how to split it back (for the shapes a header needs).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from qkv.io.gguf_header import Header


@dataclass(frozen=True)
class Join:
    """The Hugging Face tensor `hf` (its name under model.layers.N) made of the block's GGUF
    tensors `parts` (their names under blk.N, suffix included): join(parts, in order) -> hf;
    split(hf) -> the parts, in order."""

    hf: str
    parts: tuple[str, ...]
    join: Callable[[list[Tensor]], Tensor]
    split: Callable[[Tensor], list[Tensor]]


def _cat(parts: list[Tensor]) -> Tensor:
    return torch.cat(parts, dim=1)


def _halves(whole: Tensor) -> list[Tensor]:
    return list(whole.chunk(2, dim=1))


def _turned(parts: list[Tensor]) -> Tensor:
    return parts[0].transpose(1, 2)


def _turned_back(whole: Tensor) -> list[Tensor]:
    return [whole.transpose(1, 2)]


def _cat_turned(parts: list[Tensor]) -> Tensor:
    return torch.cat(parts, dim=1).transpose(1, 2)


def _halves_turned(whole: Tensor) -> list[Tensor]:
    return list(whole.transpose(1, 2).chunk(2, dim=1))


def _interleaved(parts: list[Tensor]) -> Tensor:
    """(E, I, ...) gate and up -> their columns side by side on the last axis (gpt-oss):
    gate (E, I, C) and up -> (E, C, 2I); gate bias (E, I) and up bias -> (E, 2I)."""
    turned = [p.transpose(1, 2) if p.ndim == 3 else p for p in parts]
    return torch.stack(turned, dim=-1).flatten(-2)


def _deinterleaved(whole: Tensor) -> list[Tensor]:
    parts = [whole[..., 0::2], whole[..., 1::2]]
    return [p.transpose(1, 2) if p.ndim == 3 else p for p in parts]


GATE_UP = ("ffn_gate_exps.weight", "ffn_up_exps.weight")
# transformers' in-memory experts (Mixtral, Qwen3-MoE, DeepSeek-V3): gate_up_proj (E, 2I, C),
# gate above up; down_proj (E, C, I) is the GGUF tensor as it is (`STACKED_DOWN`)
STACKED_EXPERTS = (Join("mlp.experts.gate_up_proj", GATE_UP, _cat, _halves),)
STACKED_DOWN = {"ffn_down_exps.weight": "mlp.experts.down_proj"}
# Llama 4's checkpoint: gate_up_proj (E, C, 2I), down_proj (E, I, C)
LLAMA4_EXPERTS = (
    Join("feed_forward.experts.gate_up_proj", GATE_UP, _cat_turned, _halves_turned),
    Join("feed_forward.experts.down_proj", ("ffn_down_exps.weight",), _turned, _turned_back),
)
# gpt-oss's checkpoint: gate_up_proj (E, C, 2I) and its bias (E, 2I), gate and up interleaved
GPT_OSS_EXPERTS = (
    Join("mlp.experts.gate_up_proj", GATE_UP, _interleaved, _deinterleaved),
    Join("mlp.experts.gate_up_proj_bias", ("ffn_gate_exps.bias", "ffn_up_exps.bias"),
         _interleaved, _deinterleaved),
    Join("mlp.experts.down_proj", ("ffn_down_exps.weight",), _turned, _turned_back),
)  # fmt: skip


def copy_keys(arch: str, config: dict, names: dict, header: Header, keys: dict) -> None:
    """config[hf key] = the header's "<arch>.<key>", where the header has it."""
    for hf, key in keys.items():
        if f"{arch}.{key}" in header.metadata:
            config[hf], names[hf] = header.metadata[f"{arch}.{key}"], f"{arch}.{key}"


def experts_bounded(arch: str, header: Header, source) -> None:
    """A header's expert count, no more than its routers' rows: a family lists each
    expert's tensors, so a claim of 10^9 experts is refused before any list of them."""
    count = header.metadata.get(f"{arch}.expert_count")
    rows = max((info.shape[0] for info in header.tensors
                if info.name.endswith("ffn_gate_inp.weight")), default=0)  # fmt: skip
    if type(count) is int and count > rows:
        raise ValueError(
            f"{source}: {arch}.expert_count={count:,} is more experts than its routers "
            f"(ffn_gate_inp) have rows ({rows})"
        )


def mixtral(config: dict, names: dict, header: Header) -> None:
    """A "llama" file with experts (expert_count > 0) is Mixtral, as llama.cpp's converter
    writes it; llama.cpp's llama has no window, and a Mixtral no biases."""
    count = header.metadata.get("llama.expert_count", 0)
    if count in (0, None):
        return
    for key, tensor in [("attention_bias", "attn_q.bias"), ("mlp_bias", "ffn_up.bias")]:
        if config.pop(key, False):
            raise ValueError(f"a llama file with experts has blk.0.{tensor}, which Mixtral lacks")
    config |= {"model_type": "mixtral", "architectures": ["MixtralForCausalLM"],
               "sliding_window": None}  # fmt: skip
    copy_keys(
        "llama",
        config,
        names,
        header,
        {"num_local_experts": "expert_count", "num_experts_per_tok": "expert_used_count"},
    )


def qwen3moe(config: dict, names: dict, header: Header) -> None:
    """Qwen3-MoE as llama.cpp computes it: experts on every layer, their weights always
    renormalized (its graph fixes norm_w), no window."""
    copy_keys("qwen3moe", config, names, header, {
        "num_experts": "expert_count", "num_experts_per_tok": "expert_used_count",
        "moe_intermediate_size": "expert_feed_forward_length"})  # fmt: skip
    config |= {"norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
               "use_sliding_window": False}  # fmt: skip


# what llama.cpp's llama4 code fixes, not the header: chunks of 8192 tokens on the rotary
# layers, every fourth layer without rotary (its queries' temperature 1 + 0.1 log(1 +
# floor((p + 1) / 8192))), rotary layers' queries and keys L2-normed (not Maverick's 128
# experts, told apart by that count)
LLAMA4_FIXED = {"attention_chunk_size": 8192, "floor_scale": 8192, "attn_scale": 0.1,
                "attn_temperature_tuning": True, "no_rope_layer_interval": 4}  # fmt: skip
LLAMA4_PATTERN = 4  # llama.cpp's set_swa_pattern(4): three chunked layers, then a full one


def llama4(config: dict, names: dict, header: Header) -> None:
    """Llama 4 text: its converter swaps the widths (feed_forward_length is the dense
    layers', expert_feed_forward_length the experts' and the shared expert's), and
    `LLAMA4_FIXED`. A file with no chunks (attention.sliding_window 0: llama.cpp then turns
    every layer but the last) or another chunk pattern is refused by that key."""
    meta = header.metadata
    config.pop("intermediate_size", None), names.pop("intermediate_size", None)
    copy_keys("llama4", config, names, header, {
        "intermediate_size_mlp": "feed_forward_length",
        "intermediate_size": "expert_feed_forward_length",
        "num_local_experts": "expert_count", "num_experts_per_tok": "expert_used_count",
        "interleave_moe_layer_step": "interleave_moe_layer_step"})  # fmt: skip
    if meta.get("llama4.attention.sliding_window") == 0:
        raise ValueError(
            "llama4.attention.sliding_window=0 is not supported: llama.cpp would chunk no "
            "layer and turn every layer but the last"
        )
    pattern = meta.get("llama4.attention.sliding_window_pattern", LLAMA4_PATTERN)
    if pattern != LLAMA4_PATTERN:
        raise ValueError(
            f"llama4.attention.sliding_window_pattern={pattern!r} is not supported: qkv "
            f"chunks the layers with rotary, three of every {LLAMA4_PATTERN}"
        )
    config |= LLAMA4_FIXED | {"use_qk_norm": meta.get("llama4.expert_count") != 128}


GPT_OSS_PATTERN = 2  # llama.cpp's default set_swa_pattern for gpt-oss: even layers slide


def gpt_oss(config: dict, names: dict, header: Header) -> None:
    """gpt-oss as llama.cpp computes it: its clamped SwiGLU's alpha 1.702 and limit 7.0 (fixed
    in its code), layers sliding as attention.sliding_window_pattern says (n: n - 1 sliding
    layers, then a full one; 2 where the key is absent), YaRN with its ramp rounded (ggml
    always rounds it: truncate true, whatever the checkpoint said) or no scaling at all."""
    meta = header.metadata
    config.pop("intermediate_size", None), names.pop("intermediate_size", None)
    copy_keys("gpt-oss", config, names, header, {
        "intermediate_size": "expert_feed_forward_length",
        "num_local_experts": "expert_count", "num_experts_per_tok": "expert_used_count",
        "sliding_window": "attention.sliding_window"})  # fmt: skip
    config |= {"swiglu_alpha": 1.702, "swiglu_limit": 7.0,
               "attention_bias": any(info.name == "blk.0.attn_q.bias"
                                     for info in header.tensors)}  # fmt: skip
    base, local = meta.get("gpt-oss.rope.freq_base"), meta.get("gpt-oss.rope.freq_base_swa")
    if local is not None and local != base:
        raise ValueError(f"gpt-oss.rope.freq_base_swa={local!r} is not supported: qkv's "
                         "sliding layers turn with the full layers' base")  # fmt: skip
    scaling = config.setdefault("rope_scaling", {"rope_type": "default"})
    if scaling["rope_type"] == "yarn":
        scaling["truncate"] = True
    key = "gpt-oss.attention.sliding_window_pattern"
    period, layers = meta.get(key, GPT_OSS_PATTERN), config.get("num_hidden_layers")
    if type(period) is not int or period < 1:
        raise ValueError(f"{key}={period!r} should be a whole number of layers")
    # bounded: a header claiming 10^9 layers has too few tensors, refused once they are counted
    if type(layers) is int and 0 < layers <= max(len(header.tensors), 256):
        config["layer_types"] = [
            "sliding_attention" if i % period < period - 1 else "full_attention"
            for i in range(layers)
        ]


# DeepSeek-V3's header keys under "deepseek2." (config.json key -> header key)
DEEPSEEK2_KEYS = {
    "qk_rope_head_dim": "rope.dimension_count", "kv_lora_rank": "attention.kv_lora_rank",
    "q_lora_rank": "attention.q_lora_rank",
    "first_k_dense_replace": "leading_dense_block_count",
    "moe_intermediate_size": "expert_feed_forward_length", "n_routed_experts": "expert_count",
    "num_experts_per_tok": "expert_used_count", "n_shared_experts": "expert_shared_count",
    "routed_scaling_factor": "expert_weights_scale", "norm_topk_prob": "expert_weights_norm",
    "n_group": "expert_group_count", "topk_group": "expert_group_used_count",
}  # fmt: skip


def _same_float32(value, target: float) -> bool:
    """Whether `value` is a number that float32 (a header's epsilon, llama.cpp's arithmetic)
    holds as it holds `target`: 1e-6 written to a file reads back as 9.99999997e-07."""
    if type(value) not in (int, float):
        return False
    return torch.tensor(value, dtype=torch.float32) == torch.tensor(target, dtype=torch.float32)


SIGMOID = 2  # gguf's ExpertGatingFuncType.SIGMOID, DeepSeek-V3's router
LATENT_NORM_EPS = 1e-6  # DeepSeek-V3's q_a and kv_a norms (llama.cpp: the header's epsilon)


def deepseek2(config: dict, names: dict, header: Header) -> None:
    """DeepSeek-V3 (llama.cpp's deepseek2): latent attention's sizes (key_length_mla and
    value_length_mla; files before them: key_length and value_length), its experts (what
    the header leaves out is llama.cpp's default: scale 1, no renormalization, one group),
    and YaRN's log multiplier as mscale = mscale_all_dim (llama.cpp squares it into the
    score scale and cancels it in the rotary, which is transformers' when the two agree).
    A softmax router (gating function other than 2, or none: DeepSeek-V2) and another
    epsilon than 1e-6 (llama.cpp would use it in the latent norms too) are refused by key."""
    meta = header.metadata
    key = "deepseek2.{}".format
    copy_keys("deepseek2", config, names, header, DEEPSEEK2_KEYS)
    config.setdefault("q_lora_rank", None)
    config.setdefault("routed_scaling_factor", 1.0)
    config.setdefault("norm_topk_prob", False)
    config.setdefault("n_group", 1)
    config.setdefault("topk_group", 1)
    config["num_key_value_heads"] = config.get("num_attention_heads")  # the file's is MQA's 1
    config["rope_interleave"] = True  # llama.cpp's deepseek2 turns neighbouring pairs
    new = key("attention.key_length_mla") in meta
    keys, values = (("attention.key_length_mla", "attention.value_length_mla") if new
                    else ("attention.key_length", "attention.value_length"))  # fmt: skip
    rope, head = config.get("qk_rope_head_dim"), meta.get(key(keys))
    if type(head) is int and type(rope) is int:
        config["qk_nope_head_dim"], names["qk_nope_head_dim"] = head - rope, key(keys)
    copy_keys("deepseek2", config, names, header, {"v_head_dim": values})
    gating = meta.get(key("expert_gating_func"))
    if gating != SIGMOID:
        raise ValueError(
            f"{key('expert_gating_func')}={gating!r} is not supported: qkv computes "
            f"DeepSeek-V3's sigmoid router ({SIGMOID})"
        )
    eps = meta.get(key("attention.layer_norm_rms_epsilon"))
    if not _same_float32(eps, LATENT_NORM_EPS):  # a file holds 1e-6 as float32's nearest
        raise ValueError(
            f"{key('attention.layer_norm_rms_epsilon')}={eps!r} is not supported: llama.cpp "
            f"would use it in the latent norms, qkv's DeepSeek-V3 uses {LATENT_NORM_EPS}"
        )
    multiplier = meta.get(key("rope.scaling.yarn_log_multiplier"))
    scaling = config.get("rope_scaling")
    if multiplier is not None and scaling and scaling.get("rope_type") == "yarn":
        scaling["mscale"] = scaling["mscale_all_dim"] = multiplier / 0.1


def kv_b_split(header: Header) -> Join:
    """Newer converters' kv_b (H * (dn + dv), R) cut per head into attn_k_b (H, R, dn), turned,
    and attn_v_b (H, dv, R), for llama.cpp's absorbed latent attention; joined back by
    stacking each head's dn key rows above its dv value rows. The split (for the shapes a
    header needs) takes H and dn from the header, checked by the family before it is used."""
    meta = header.metadata
    heads = meta.get("deepseek2.attention.head_count")
    head = meta.get(
        "deepseek2.attention.key_length_mla", meta.get("deepseek2.attention.key_length")
    )
    rope = meta.get("deepseek2.rope.dimension_count")
    nope = head - rope if type(head) is int and type(rope) is int else None  # as `deepseek2`

    def join(parts: list[Tensor]) -> Tensor:
        k_b, v_b = parts
        return torch.cat([k_b.transpose(1, 2), v_b], dim=1).flatten(0, 1)

    def split(whole: Tensor) -> list[Tensor]:
        per_head = whole.unflatten(0, (heads, -1))
        return [per_head[:, :nope].transpose(1, 2), per_head[:, nope:]]

    return Join("self_attn.kv_b_proj.weight", ("attn_k_b.weight", "attn_v_b.weight"), join, split)

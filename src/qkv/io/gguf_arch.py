"""The architectures llama.cpp writes, each as a table: its header keys, its tensor names,
and what its convert script did to the Hugging Face weights (which `read_gguf` undoes).

An `Arch` turns a GGUF header into the config.json the Hugging Face checkpoint came with
(`config`), and a GGUF tensor name into its Hugging Face name (`hf_name`). The file means
what llama.cpp computes from it, so a key the header leaves out means llama.cpp's default,
never the Hugging Face class's (a head size of C / H, not Qwen3's 128 or Gemma's 256; a rope
base of 10 000), and what llama.cpp fixes in its code is written here as its code has it:
Phi-3's sliding window switched off, Gemma 2's soft-caps of 50 and 30 and alternating
window, Gemma 3's five sliding layers per full one with their own unscaled rotary base of
10 000, Gemma 2 and 3's 27B score scale. What llama.cpp would compute and qkv cannot (a
Llama turning part of each head, YaRN's extra factors) is refused by its header key.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from torch import Tensor

from qkv.io import gguf_moe
from qkv.io.gguf_header import Header
from qkv.io.gguf_moe import Join

# config.json key -> the header's key under "<arch>." (the same for every architecture)
COMMON_KEYS = {
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

TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
LLAMA_LAYER = {
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
QK_NORMS = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
# a layer's router and experts (mlp.gate, transformers' in-memory names); a key with its
# suffix ("ffn_down_exps.weight") names a tensor whose Hugging Face name has none of its own
EXPERTS = {"ffn_gate_inp": "mlp.gate"} | gguf_moe.STACKED_DOWN
LLAMA4_LAYER = {k: v for k, v in LLAMA_LAYER.items() if not k.startswith("ffn_")} | {
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "feed_forward.gate_proj",
    "ffn_up": "feed_forward.up_proj",
    "ffn_down": "feed_forward.down_proj",
    "ffn_gate_inp": "feed_forward.router",
    "ffn_gate_shexp": "feed_forward.shared_expert.gate_proj",
    "ffn_up_shexp": "feed_forward.shared_expert.up_proj",
    "ffn_down_shexp": "feed_forward.shared_expert.down_proj",
}
GPT_OSS_LAYER = {k: v for k, v in LLAMA_LAYER.items() if not k.startswith("ffn_")} | {
    "post_attention_norm": "post_attention_layernorm",  # the norm before the experts
    "attn_sinks.weight": "self_attn.sinks",
    "ffn_gate_inp": "mlp.router",
    "ffn_down_exps.bias": "mlp.experts.down_proj_bias",
}
DEEPSEEK2_LAYER = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_q_a": "self_attn.q_a_proj",
    "attn_q_a_norm": "self_attn.q_a_layernorm",
    "attn_q_b": "self_attn.q_b_proj",
    "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
    "attn_kv_a_norm": "self_attn.kv_a_layernorm",
    "attn_kv_b": "self_attn.kv_b_proj",  # newer converters' attn_k_b, attn_v_b: `arch_of`
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_shexp": "mlp.shared_experts.gate_proj",
    "ffn_up_shexp": "mlp.shared_experts.up_proj",
    "ffn_down_shexp": "mlp.shared_experts.down_proj",
    "exp_probs_b.bias": "mlp.gate.e_score_correction_bias",
} | EXPERTS
QWEN3MOE_LAYER = {k: v for k, v in LLAMA_LAYER.items() if not k.startswith("ffn_")}
QWEN3MOE_LAYER |= {"ffn_norm": "post_attention_layernorm"} | QK_NORMS | EXPERTS
GEMMA2_LAYER = LLAMA_LAYER | {
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
PHI3_LAYER = {
    "attn_norm": "input_layernorm",
    "attn_qkv": "self_attn.qkv_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_up": "mlp.gate_up_proj",  # llama.cpp keeps Phi-3's fused [gate; up] under ffn_up
    "ffn_down": "mlp.down_proj",
}
# what llama.cpp takes where a header has no rope.freq_base (Gemma's converter writes none)
LLAMA_CPP_ROPE_BASE = 10000.0
# tensors that are no weight in Hugging Face's layout: rotary frequency factors, which
# `config` turns into the config's rope scaling instead
ROPE_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")


@dataclass(frozen=True)
class Arch:
    """One llama.cpp architecture and the Hugging Face model it was converted from."""

    name: str  # general.architecture
    model_type: str  # the config.json's model_type
    architecture: str  # the Hugging Face class
    layer: dict[str, str]  # GGUF part of blk.N -> Hugging Face module under model.layers.N
    fixed: dict[str, Any] = field(default_factory=dict)  # config values llama.cpp implies
    permute_qk: bool = False  # llama.cpp interleaved the query and key rows (Llama only)
    norm_plus_one: bool = False  # llama.cpp stores Gemma's norm weights as 1 + weight
    extra: Callable[[dict, dict, Header], None] | None = None  # arch-specific config
    joins: tuple[Join, ...] = ()  # Hugging Face tensors made of several GGUF ones, or turned
    latent: bool = False  # DeepSeek's latent attention: head sizes read by `extra`

    def key(self, name: str) -> str:
        return f"{self.name}.{name}"

    def hf_name(self, name: str) -> str:
        """'blk.3.attn_q.weight' -> 'model.layers.3.self_attn.q_proj.weight'; each part of a
        `Join` -> the one tensor they make."""
        stem, _, suffix = name.rpartition(".")
        if stem in TOP:
            return f"{TOP[stem]}.{suffix}"
        match = re.fullmatch(r"blk\.(\d+)\.(\w+)", stem)
        if match:
            layer, part = f"model.layers.{match[1]}", f"{match[2]}.{suffix}"
            if (join := self.join_of(name)) is not None:
                return f"{layer}.{join.hf}"
            if part in self.layer:
                return f"{layer}.{self.layer[part]}"
            if match[2] in self.layer:
                return f"{layer}.{self.layer[match[2]]}.{suffix}"
        raise ValueError(f"unsupported tensor {name!r} in a {self.name} GGUF file")

    def join_of(self, name: str) -> Join | None:
        """The `Join` the GGUF tensor `name` is a part of, if any."""
        part = name.split(".", 2)[-1] if name.startswith("blk.") else None
        return next((join for join in self.joins if part in join.parts), None)

    def gguf_names(self, hf: str) -> tuple[str, ...]:
        """The GGUF tensors that make the Hugging Face tensor `hf` (the inverse of
        `hf_name`); () where this architecture has no spelling of it."""
        stem, _, suffix = hf.rpartition(".")
        inverse = {v: k for k, v in TOP.items()}
        if stem in inverse:
            return (f"{inverse[stem]}.{suffix}",)
        match = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", hf)
        if match is None:
            return ()
        block, tail = f"blk.{match[1]}", match[2]
        for join in self.joins:
            if join.hf == tail:
                return tuple(f"{block}.{part}" for part in join.parts)
        for part, module in self.layer.items():
            if module == tail and "." in part:
                return (f"{block}.{part}",)
            if "." not in part and f"{module}.{suffix}" == tail and suffix in ("weight", "bias"):
                return (f"{block}.{part}.{suffix}",)
        return ()

    def restore(self, name: str, weight: Tensor) -> Tensor:
        """A tensor as the Hugging Face checkpoint had it (before what convert did)."""
        if self.norm_plus_one and name.endswith("norm.weight"):
            return weight - 1
        return weight

    def config(self, header: Header) -> tuple[dict[str, Any], dict[str, str]]:
        """The config.json Hugging Face's model would come with, and the header key each
        value came from. Values are copied as they are: the family's `config` checks them."""
        meta = header.metadata
        config: dict[str, Any] = {"model_type": self.model_type,
                                  "architectures": [self.architecture]}  # fmt: skip
        names = {key: self.key(name) for key, name in COMMON_KEYS.items()}
        for key, name in COMMON_KEYS.items():
            if self.key(name) in meta:
                config[key] = meta[self.key(name)]
        config.setdefault("rope_theta", LLAMA_CPP_ROPE_BASE)
        if not self.latent:
            _head_dims(self, config, names, meta)
        tokens = meta.get("tokenizer.ggml.tokens")
        if "vocab_size" not in config and isinstance(tokens, list):
            config["vocab_size"], names["vocab_size"] = len(tokens), "tokenizer.ggml.tokens"
        tensor_names = {info.name for info in header.tensors}
        config["tie_word_embeddings"] = "output.weight" not in tensor_names
        config |= self.fixed
        attn_factor = meta.get(self.key("rope.scaling.attn_factor"), 1.0)
        if self.name != "phi3" and attn_factor != 1.0:  # Phi-3's goes with its rope factors
            raise ValueError(
                f"{self.key('rope.scaling.attn_factor')}={attn_factor!r} is not supported "
                f"for {self.name}: llama.cpp would scale every rotated query and key by it"
            )
        if self.name in ("llama", "qwen3", "qwen3moe"):  # biases are optional there: present or not
            config["attention_bias"] = "blk.0.attn_q.bias" in tensor_names
        if self.name == "llama":
            config["mlp_bias"] = "blk.0.ffn_up.bias" in tensor_names
        _rope_scaling(self, config, names, header)
        if self.extra is not None:
            self.extra(config, names, header)
        for name, key in [("bos", "bos"), ("eos", "eos"), ("pad", "padding"), ("unk", "unknown")]:
            config[f"{name}_token_id"] = meta.get(f"tokenizer.ggml.{key}_token_id")
        return config, names


def _head_dims(arch: Arch, config: dict, names: dict, meta: dict) -> None:
    """llama.cpp's head size: attention.key_length, else C / H (never a family's own
    default: Qwen3's 128, Gemma's 256); its rotated dimensions: rope.dimension_count, else
    the whole head. Llama's interleaved rows turn the whole head (llama.cpp refuses less)."""
    width, heads = config.get("hidden_size"), config.get("num_attention_heads")
    if arch.key("attention.key_length") in meta:
        config["head_dim"] = meta[arch.key("attention.key_length")]
        names["head_dim"] = arch.key("attention.key_length")
    elif arch.permute_qk and arch.key("rope.dimension_count") in meta:
        # Llama turns whole heads, so its rotated dimensions are its head size; read so, as
        # transformers reads it (llama.cpp refuses one that is not C / H)
        config["head_dim"] = meta[arch.key("rope.dimension_count")]
        names["head_dim"] = arch.key("rope.dimension_count")
    elif type(width) is int and type(heads) is int and heads > 0:
        config["head_dim"] = width // heads
        names["head_dim"] = arch.key("embedding_length")
    values = meta.get(arch.key("attention.value_length"), config.get("head_dim"))
    if values != config.get("head_dim"):  # qkv's values have the keys' head size
        raise ValueError(
            f"{arch.key('attention.value_length')}={values!r} is not the key head size "
            f"({config.get('head_dim')}), which is not supported"
        )
    rotated = meta.get(arch.key("rope.dimension_count"))
    head_dim = config.get("head_dim")
    if rotated is None or rotated == head_dim or type(head_dim) is not int or head_dim < 1:
        return
    if arch.permute_qk:
        raise ValueError(
            f"{arch.key('rope.dimension_count')}={rotated!r} is not the head size "
            f"({head_dim}): llama.cpp's {arch.name} turns whole heads"
        )
    config["partial_rotary_factor"] = (
        rotated / head_dim if type(rotated) in (int, float) else rotated
    )
    names["partial_rotary_factor"] = arch.key("rope.dimension_count")


def _rope_scaling(arch: Arch, config: dict, names: dict, header: Header) -> None:
    """The header's rope scaling as config.json's rope_scaling, read as llama.cpp reads it:
    a factor with no type is linear (llama.cpp's default type), and the older key
    rope.scale_linear is the factor. Llama 3's and Phi-3's per-frequency factors come as
    tensors (rope_freqs, rope_factors_long/short), read by `rope_tensors`."""
    meta = header.metadata
    kind = meta.get(arch.key("rope.scaling.type"), "linear")
    factor_key = next(
        (arch.key(k) for k in ("rope.scaling.factor", "rope.scale_linear") if arch.key(k) in meta),
        None,
    )
    factor = meta.get(factor_key) if factor_key else None
    if kind == "none" or (kind == "linear" and factor in (None, 0, 0.0, 1, 1.0)):
        return  # llama.cpp: a factor of 0 (or none) is no scaling
    if kind not in ("linear", "yarn"):
        raise ValueError(
            f"{arch.key('rope.scaling.type')} {kind!r} is not supported; supported: linear, yarn"
        )
    scaling: dict[str, Any] = {"rope_type": kind}
    if factor_key is not None:
        scaling["factor"], names["rope_scaling.factor"] = factor, factor_key
    original = arch.key("rope.scaling.original_context_length")
    if original in meta:
        scaling["original_max_position_embeddings"] = meta[original]
    for name, key in [("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")]:
        if arch.key(f"rope.scaling.{name}") in meta:  # llama.cpp's defaults are HF's: 32, 1
            scaling[key] = meta[arch.key(f"rope.scaling.{name}")]
    for name in ("yarn_ext_factor", "yarn_attn_factor", "yarn_log_multiplier"):
        if name == "yarn_log_multiplier" and arch.latent:  # DeepSeek's mscale: `extra` reads it
            continue
        if arch.key(f"rope.scaling.{name}") in meta:  # each changes llama.cpp's YaRN its way
            raise ValueError(f"{arch.key(f'rope.scaling.{name}')} is not supported")
    config["rope_scaling"] = scaling
    names["rope_scaling"] = arch.key("rope.scaling.type")


def rope_tensors(arch: Arch, config: dict, tensors: dict[str, Tensor]) -> None:
    """Per-frequency rotary factors stored as tensors, as the config's rope scaling.

    llama.cpp divides frequency i by factor i (`rope_freqs`, what Llama 3's scaling computes
    ahead of time; Phi-3's `rope_factors_short` within its trained context and
    `rope_factors_long` past it). That is LongRoPE's form; with one set of factors for both
    lengths and no attention factor it is Llama 3's scaling exactly."""
    given = (config.get("rope_scaling") or {}).get("rope_type")
    if given is not None and any(name in tensors for name in ROPE_TENSORS):
        # llama.cpp would apply both; qkv's rotary holds one scaling
        raise ValueError(
            f"{arch.key('rope.scaling.type')} {given!r} comes with per-frequency rope factor "
            "tensors, which is not supported"
        )
    if "rope_freqs.weight" in tensors:
        factors = [float(f) for f in tensors["rope_freqs.weight"].flatten()]
        config["rope_scaling"] = {
            "rope_type": "longrope", "short_factor": factors, "long_factor": factors,
            "attention_factor": 1.0,
            "original_max_position_embeddings": config.get("max_position_embeddings", 2048),
        }  # fmt: skip
    elif "rope_factors_long.weight" in tensors:
        if "rope_factors_short.weight" not in tensors:
            raise ValueError("the tensor rope_factors_long.weight comes without rope_factors_short")
        rope = config.get("rope_scaling") or {}
        config["rope_scaling"] = rope | {
            "rope_type": "longrope",
            "short_factor": [float(f) for f in tensors["rope_factors_short.weight"].flatten()],
            "long_factor": [float(f) for f in tensors["rope_factors_long.weight"].flatten()],
        }
    elif config.get("rope_scaling", {}).keys() == {"attention_factor"}:
        # llama.cpp would scale every rotated query and key by it; qkv's rotary holds an
        # attention factor only beside LongRoPE's frequency factors, as Phi-3's convert writes it
        raise ValueError(
            f"{arch.key('rope.scaling.attn_factor')} comes without rope_factors_long and "
            "rope_factors_short tensors, which is not supported"
        )


def _phi3(config: dict, names: dict, header: Header) -> None:
    """Phi-3's rope: partial rotary (`_head_dims`), LongRoPE's trained length and attention
    factor. No sliding window: llama.cpp turns Phi-3's off whatever the header says
    (llama.cpp#13676), so the file computes without one (transformers' reader agrees).
    llama.cpp picks the long or short rope factors by its context size, not the text's
    length; qkv picks as transformers does, by the text's length (past the trained length:
    the long factors)."""
    meta = header.metadata
    original = meta.get("phi3.rope.scaling.original_context_length")
    if original is not None:
        config["original_max_position_embeddings"] = original
        names["original_max_position_embeddings"] = "phi3.rope.scaling.original_context_length"
    if meta.get("phi3.rope.scaling.attn_factor") is not None:
        config["rope_scaling"] = (config.get("rope_scaling") or {}) | {
            "attention_factor": meta["phi3.rope.scaling.attn_factor"]
        }


# Gemma 2 and 3 at 27B (llama.cpp tells the size by the layer count) scale the scores by
# 1/sqrt(C / H), every other size by 1/sqrt(head size): llama.cpp's f_attention_scale
GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


def _gemma(config: dict, names: dict, header: Header) -> None:
    """What llama.cpp's Gemma code fixes: the score scale (see GEMMA_27B_LAYERS); Gemma 2's
    soft-caps (50 and 30 where the header names none) and window (4096), even layers
    sliding; Gemma 3's five sliding layers then one full, the sliding ones with a rotary
    base of 10 000 unscaled, and no attention soft-cap. A Gemma 3 header with no window
    (or 0) slides none."""
    meta, arch = header.metadata, config["model_type"].removesuffix("_text")
    layers = config.get("num_hidden_layers")
    if "head_dim" in config:
        config["query_pre_attn_scalar"] = config["head_dim"]
        names["query_pre_attn_scalar"] = names["head_dim"]
    width, heads = config.get("hidden_size"), config.get("num_attention_heads")
    if layers == GEMMA_27B_LAYERS.get(arch) and type(width) is int and type(heads) is int:
        config["query_pre_attn_scalar"] = width // heads if heads > 0 else heads
        names["query_pre_attn_scalar"] = f"{arch}.attention.head_count"
    if arch == "gemma":
        return
    window_key = f"{arch}.attention.sliding_window"
    window = meta.get(window_key, 4096 if arch == "gemma2" else None)
    config["sliding_window"], names["sliding_window"] = window, window_key
    # bounded: a header claiming 10^9 layers has too few tensors, refused once they are counted
    sized = type(layers) is int and 0 < layers <= max(len(header.tensors), 256)
    if arch == "gemma2":
        for key, default in [("attn_logit_softcapping", 50.0), ("final_logit_softcapping", 30.0)]:
            config[key], names[key] = meta.get(f"gemma2.{key}", default), f"gemma2.{key}"
        if config["final_logit_softcapping"] in (0, 0.0):  # llama.cpp: 0 caps nothing
            config["final_logit_softcapping"] = None
        if sized:  # llama.cpp's set_swa_pattern(2): even layers slide
            config["layer_types"] = [
                "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)
            ]
        return
    # Gemma 3: llama.cpp reads no attention soft-cap for it, and a final one only if named
    config["attn_logit_softcapping"] = None
    key = "gemma3.final_logit_softcapping"
    cap = meta.get(key)
    config["final_logit_softcapping"] = None if cap in (0, 0.0) else cap  # 0 caps nothing
    names["final_logit_softcapping"] = key
    config["rope_local_base_freq"] = LLAMA_CPP_ROPE_BASE  # fixed in llama.cpp's gemma3 code
    slides = window not in (None, 0)
    if not slides:
        config["sliding_window"] = None
    if sized:  # llama.cpp's set_swa_pattern(6): five sliding layers, then one full
        config["layer_types"] = [
            "sliding_attention" if slides and (i + 1) % 6 else "full_attention"
            for i in range(layers)
        ]


ARCHES = {
    # a llama file with experts is Mixtral (`gguf_moe.mixtral`)
    "llama": Arch("llama", "llama", "LlamaForCausalLM", LLAMA_LAYER | EXPERTS,
                  {"hidden_act": "silu"}, permute_qk=True, extra=gguf_moe.mixtral,
                  joins=gguf_moe.STACKED_EXPERTS),
    "qwen2": Arch("qwen2", "qwen2", "Qwen2ForCausalLM", LLAMA_LAYER, {"hidden_act": "silu"}),
    "qwen3": Arch("qwen3", "qwen3", "Qwen3ForCausalLM", LLAMA_LAYER | QK_NORMS,
                  {"hidden_act": "silu"}),
    "qwen3moe": Arch("qwen3moe", "qwen3_moe", "Qwen3MoeForCausalLM", QWEN3MOE_LAYER,
                     {"hidden_act": "silu"}, extra=gguf_moe.qwen3moe,
                     joins=gguf_moe.STACKED_EXPERTS),
    # llama.cpp's converter keeps Llama 4's q and k rows as Meta wrote them (undo_permute off)
    "llama4": Arch("llama4", "llama4_text", "Llama4ForCausalLM", LLAMA4_LAYER,
                   {"hidden_act": "silu"}, extra=gguf_moe.llama4, joins=gguf_moe.LLAMA4_EXPERTS),
    "gpt-oss": Arch("gpt-oss", "gpt_oss", "GptOssForCausalLM", GPT_OSS_LAYER,
                    extra=gguf_moe.gpt_oss, joins=gguf_moe.GPT_OSS_EXPERTS),
    # latent attention's sizes are not `_head_dims`' (key_length is the compressed key's)
    "deepseek2": Arch("deepseek2", "deepseek_v3", "DeepseekV3ForCausalLM", DEEPSEEK2_LAYER,
                      {"hidden_act": "silu"}, extra=gguf_moe.deepseek2,
                      joins=gguf_moe.STACKED_EXPERTS, latent=True),
    "phi3": Arch("phi3", "phi3", "Phi3ForCausalLM", PHI3_LAYER, {"hidden_act": "silu"},
                 extra=_phi3),
    "gemma": Arch("gemma", "gemma", "GemmaForCausalLM", LLAMA_LAYER,
                  {"hidden_activation": "gelu_pytorch_tanh"}, norm_plus_one=True, extra=_gemma),
    "gemma2": Arch("gemma2", "gemma2", "Gemma2ForCausalLM", GEMMA2_LAYER,
                   {"hidden_activation": "gelu_pytorch_tanh"}, norm_plus_one=True,
                   extra=_gemma),
    "gemma3": Arch("gemma3", "gemma3_text", "Gemma3ForCausalLM", GEMMA2_LAYER | QK_NORMS,
                   {"hidden_activation": "gelu_pytorch_tanh"}, norm_plus_one=True,
                   extra=_gemma),
}  # fmt: skip


def arch_of(header: Header, source) -> Arch:
    name = header.metadata.get("general.architecture")
    if name not in ARCHES:
        raise ValueError(
            f"{source}: unsupported GGUF architecture {name!r}; supported: {', '.join(ARCHES)}"
        )
    arch = ARCHES[name]
    if name == "deepseek2" and any(i.name.endswith(".attn_k_b.weight") for i in header.tensors):
        return replace(arch, joins=(*arch.joins, gguf_moe.kv_b_split(header)))
    return arch

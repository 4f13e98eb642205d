"""The architectures llama.cpp writes, each as a table: its header keys, its tensor names,
and what its convert script did to the Hugging Face weights (which `read_gguf` undoes).

An `Arch` turns a GGUF header into the config.json the Hugging Face checkpoint came with
(`config`), and a GGUF tensor name into its Hugging Face name (`hf_name`). What a header
does not say and llama.cpp fixes in its code (Gemma 3's local rotary base, its pattern of
five local layers and one global) is written here as llama.cpp's code has it.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

from qkv.io.gguf_header import Header

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

    def key(self, name: str) -> str:
        return f"{self.name}.{name}"

    def hf_name(self, name: str) -> str:
        """'blk.3.attn_q.weight' -> 'model.layers.3.self_attn.q_proj.weight'"""
        stem, _, suffix = name.rpartition(".")
        if stem in TOP:
            return f"{TOP[stem]}.{suffix}"
        match = re.fullmatch(r"blk\.(\d+)\.(\w+)", stem)
        if match and match[2] in self.layer:
            return f"model.layers.{match[1]}.{self.layer[match[2]]}.{suffix}"
        raise ValueError(f"unsupported tensor {name!r} in a {self.name} GGUF file")

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
        if self.key("attention.key_length") in meta:
            config["head_dim"] = meta[self.key("attention.key_length")]
            names["head_dim"] = self.key("attention.key_length")
        elif self.key("rope.dimension_count") in meta and "rope_factors_long.weight" not in {
            t.name for t in header.tensors
        }:
            config["head_dim"] = meta[self.key("rope.dimension_count")]
            names["head_dim"] = self.key("rope.dimension_count")
        tokens = meta.get("tokenizer.ggml.tokens")
        if "vocab_size" not in config and isinstance(tokens, list):
            config["vocab_size"], names["vocab_size"] = len(tokens), "tokenizer.ggml.tokens"
        tensor_names = {info.name for info in header.tensors}
        config["tie_word_embeddings"] = "output.weight" not in tensor_names
        config |= self.fixed
        if self.name in ("llama", "qwen3"):  # biases are optional there: present or not
            config["attention_bias"] = "blk.0.attn_q.bias" in tensor_names
        if self.name == "llama":
            config["mlp_bias"] = "blk.0.ffn_up.bias" in tensor_names
        _rope_scaling(self, config, names, header)
        if self.extra is not None:
            self.extra(config, names, header)
        for name, key in [("bos", "bos"), ("eos", "eos"), ("pad", "padding"), ("unk", "unknown")]:
            config[f"{name}_token_id"] = meta.get(f"tokenizer.ggml.{key}_token_id")
        return config, names


def _rope_scaling(arch: Arch, config: dict, names: dict, header: Header) -> None:
    """The header's rope scaling as config.json's rope_scaling. Llama 3's and Phi-3's
    per-frequency factors come as tensors (rope_freqs, rope_factors_long/short), read by
    `rope_tensors` once the tensors are mapped; the keys are read here."""
    meta = header.metadata
    kind = meta.get(arch.key("rope.scaling.type"))
    if kind in (None, "none"):
        return
    if kind not in ("linear", "yarn"):
        raise ValueError(
            f"{arch.key('rope.scaling.type')} {kind!r} is not supported; supported: linear, yarn"
        )
    scaling: dict[str, Any] = {"rope_type": kind}
    for key, name in [
        ("factor", "rope.scaling.factor"),
        ("original_max_position_embeddings", "rope.scaling.original_context_length"),
    ]:
        if arch.key(name) in meta:
            scaling[key] = meta[arch.key(name)]
    config["rope_scaling"] = scaling
    names["rope_scaling"] = arch.key("rope.scaling.type")


def rope_tensors(arch: Arch, config: dict, tensors: dict[str, Tensor]) -> None:
    """Per-frequency rotary factors stored as tensors, as the config's rope scaling.

    llama.cpp divides frequency i by factor i (`rope_freqs`, what Llama 3's scaling computes
    ahead of time; Phi-3's `rope_factors_short` within its trained context and
    `rope_factors_long` past it). That is LongRoPE's form; with one set of factors for both
    lengths and no attention factor it is Llama 3's scaling exactly."""
    if "rope_freqs.weight" in tensors:
        factors = [float(f) for f in tensors["rope_freqs.weight"].flatten()]
        config["rope_scaling"] = {
            "rope_type": "longrope", "short_factor": factors, "long_factor": factors,
            "attention_factor": 1.0,
            "original_max_position_embeddings": config.get("max_position_embeddings", 2048),
        }  # fmt: skip
    elif "rope_factors_long.weight" in tensors:
        rope = config.get("rope_scaling") or {}
        config["rope_scaling"] = rope | {
            "rope_type": "longrope",
            "short_factor": [float(f) for f in tensors["rope_factors_short.weight"].flatten()],
            "long_factor": [float(f) for f in tensors["rope_factors_long.weight"].flatten()],
        }


def _phi3(config: dict, names: dict, header: Header) -> None:
    meta = header.metadata
    heads, width = config.get("num_attention_heads"), config.get("hidden_size")
    dims = meta.get("phi3.rope.dimension_count")
    if isinstance(heads, int) and isinstance(width, int) and heads and isinstance(dims, int):
        config["partial_rotary_factor"] = dims / (width // heads)
    original = meta.get("phi3.rope.scaling.original_context_length")
    if original is not None:
        config["original_max_position_embeddings"] = original
    if meta.get("phi3.rope.scaling.attn_factor") is not None:
        config["rope_scaling"] = (config.get("rope_scaling") or {}) | {
            "attention_factor": meta["phi3.rope.scaling.attn_factor"]
        }
    if meta.get("phi3.attention.sliding_window") is not None:
        config["sliding_window"] = meta["phi3.attention.sliding_window"]


def _gemma(config: dict, names: dict, header: Header) -> None:
    """Gemma's scale: llama.cpp divides by sqrt(head size) (its 27B models aside, which name
    no key for it); Gemma 2 and 3 name their soft-caps and window in the header."""
    meta, arch = header.metadata, config["model_type"].removesuffix("_text")
    if "head_dim" in config:
        config["query_pre_attn_scalar"] = config["head_dim"]
        names["query_pre_attn_scalar"] = names["head_dim"]
    for key, name in [("attn_logit_softcapping", "attn_logit_softcapping"),
                      ("final_logit_softcapping", "final_logit_softcapping"),
                      ("sliding_window", "attention.sliding_window")]:  # fmt: skip
        if f"{arch}.{name}" in meta:
            config[key], names[key] = meta[f"{arch}.{name}"], f"{arch}.{name}"
    layers = config.get("num_hidden_layers")
    if arch == "gemma2":
        config.setdefault("attn_logit_softcapping", None)
        config.setdefault("final_logit_softcapping", None)
        if isinstance(layers, int) and 0 < layers <= len(header.tensors):
            # llama.cpp: even layers slide (transformers: layer i slides if (i + 1) % 2)
            config["layer_types"] = [
                "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)
            ]
    if arch == "gemma3":
        config["rope_local_base_freq"] = 10000.0  # fixed in llama.cpp's gemma3 code
        if isinstance(layers, int) and 0 < layers <= len(header.tensors):
            # llama.cpp: five sliding layers, then one full (set_swa_pattern(6))
            config["layer_types"] = [
                "full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(layers)
            ]


ARCHES = {
    "llama": Arch("llama", "llama", "LlamaForCausalLM", LLAMA_LAYER,
                  {"hidden_act": "silu"}, permute_qk=True),
    "qwen2": Arch("qwen2", "qwen2", "Qwen2ForCausalLM", LLAMA_LAYER, {"hidden_act": "silu"}),
    "qwen3": Arch("qwen3", "qwen3", "Qwen3ForCausalLM", LLAMA_LAYER | QK_NORMS,
                  {"hidden_act": "silu"}),
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
    return ARCHES[name]

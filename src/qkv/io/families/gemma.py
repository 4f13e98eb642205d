"""Gemma, Gemma 2 and Gemma 3 (text): Llama's decoder with Google's choices.

All three: an RMSNorm whose gain is 1 + weight, token vectors scaled by sqrt(C) (rounded to
the weights' dtype first, as transformers does), a GeGLU MLP (a tanh-gelu gate), a head
size of its own (256 in the released checkpoints) and tied embeddings.

Gemma 2 adds a norm on each sub-layer's output beside the one on its input, a soft-cap on
the attention scores and on the final logits, 1/sqrt(query_pre_attn_scalar) as the score
scale, and sliding-window layers alternating with full ones (a key `sliding_window` or
more tokens back is hidden: transformers' kv > q - window).

Gemma 3 drops the attention soft-cap (its transformers code never applies one), adds a
QK-norm per head, has five sliding layers per full one, and gives the sliding layers a
rotary base of their own (10 000, unscaled) while the full layers' (1 000 000) may be
scaled: linearly by 8 in the 4B and larger checkpoints.

A key missing from a config.json means what it means to transformers, the class default
(Gemma's head_dim is 256, not hidden_size / heads; Gemma 2's soft-caps are 50 and 30); a
key set to null means none. The multimodal Gemma 3 (model_type "gemma3") is refused.
"""

from __future__ import annotations

from collections import ChainMap
from collections.abc import Mapping
from typing import Any

from qkv.io.families.checks import ConfigValueError, divides, flag, real, whole
from qkv.io.families.common import Family, Weight, decoder_weights, fits, require
from qkv.io.families.rotary import FULL, SLIDING, hf_rope, read_rope
from qkv.models import Decoder, DecoderConfig
from qkv.nn import BlockConfig

# transformers' class defaults, for the keys a config.json may leave out
DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma": {"vocab_size": 256000, "hidden_size": 3072, "intermediate_size": 24576,
              "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 16,
              "head_dim": 256, "max_position_embeddings": 8192},
    "gemma2": {"vocab_size": 256000, "hidden_size": 2304, "intermediate_size": 9216,
               "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4,
               "head_dim": 256, "max_position_embeddings": 8192, "query_pre_attn_scalar": 256,
               "sliding_window": 4096, "attn_logit_softcapping": 50.0,
               "final_logit_softcapping": 30.0},
    "gemma3_text": {"vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216,
                    "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4,
                    "head_dim": 256, "max_position_embeddings": 131072,
                    "query_pre_attn_scalar": 256, "sliding_window": 4096,
                    "attn_logit_softcapping": None, "final_logit_softcapping": None,
                    "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0,
                    "sliding_window_pattern": 6},
}  # fmt: skip
NAMES = {"gemma": "Gemma", "gemma2": "Gemma 2", "gemma3_text": "Gemma 3"}

# a config.json activation -> the gated MLP it makes (the gate's activation)
GATED = {"gelu_pytorch_tanh": "geglu_tanh", "gelu_new": "geglu_tanh", "gelu": "geglu",
         "silu": "swiglu", "swish": "swiglu"}  # fmt: skip
LAYER_TYPES = {SLIDING: "sliding", FULL: "full"}


# ---- config.json -> qkv config --------------------------------------------------------------


def _gated(key: str, name: Any) -> str:
    if not isinstance(name, str) or name not in GATED:
        raise ConfigValueError(key, f"{name!r} is not supported; supported: {', '.join(GATED)}")
    return GATED[name]


def _mlp(hf: Mapping, kind: str) -> str:
    """The gated MLP. transformers 5 computes Gemma's hidden_act (its legacy "gelu" meaning
    the tanh approximation) and Gemma 2 and 3's hidden_activation; transformers 4 computed
    Gemma's hidden_activation. Where a config.json holds both keys they must agree."""
    if kind == "gemma":
        act = hf.get("hidden_act", "gelu_pytorch_tanh")
        mlp = _gated("hidden_act", "gelu_pytorch_tanh" if act == "gelu" else act)
        other_key = "hidden_activation"
    else:
        mlp = _gated("hidden_activation", hf.get("hidden_activation", "gelu_pytorch_tanh"))
        other_key = "hidden_act"
    other = hf.get(other_key)
    if other is not None and _gated(other_key, other) != mlp:
        raise ValueError(
            f"{NAMES[kind]} checkpoints whose hidden_act ({hf.get('hidden_act')!r}) and "
            f"hidden_activation ({hf.get('hidden_activation')!r}) disagree are not supported"
        )
    return mlp


def _given(hf: Mapping, kind: str, key: str, read=whole) -> Any:
    """hf[key] read by `read`; transformers' default where the key is missing."""
    return read(hf, key) if key in hf else DEFAULTS[kind][key]


def _cap(hf: Mapping, kind: str, key: str) -> float | None:
    """A soft-cap: the default where missing, none where null."""
    value = hf.get(key, DEFAULTS[kind][key])
    return None if value is None else real({key: value}, key, positive=True)


def _layer_types(hf: Mapping, kind: str, layers: int) -> tuple[str, ...]:
    """Each layer's type: config.json's layer_types, or transformers' pattern (every
    `pattern`-th layer full, the others sliding: Gemma 2 alternates, Gemma 3 takes 6)."""
    given = hf.get("layer_types")
    if given is None:
        pattern = _given(hf, kind, "sliding_window_pattern") if kind == "gemma3_text" else 2
        return tuple("sliding" if (i + 1) % pattern else "full" for i in range(layers))
    if not isinstance(given, list) or len(given) != layers:
        raise ConfigValueError(
            "layer_types", f"must list the {layers} layers' types, got {given!r}"
        )
    odd = sorted({str(t) for t in given} - set(LAYER_TYPES))
    if odd:
        raise ConfigValueError("layer_types", f"holds {odd}; supported: {', '.join(LAYER_TYPES)}")
    return tuple(LAYER_TYPES[t] for t in given)


def _gemma3_rope(hf: Mapping) -> dict:
    """Gemma 3's rope parameters nested by layer type, as transformers 5 nests them: an older
    config.json's rope_scaling and rope_theta are the full layers', rope_local_base_freq the
    sliding layers' base."""
    given = hf.get("rope_parameters") or {}
    if not isinstance(given, Mapping) or not {FULL, SLIDING} >= set(given):
        nesting = f"must be nested by layer type ({FULL}, {SLIDING}), got {given!r}"
        raise ConfigValueError("rope_parameters", nesting)
    nested = {t: dict(given.get(t) or {"rope_type": "default"}) for t in (FULL, SLIDING)}
    scaling = hf.get("rope_scaling")
    if scaling is not None:
        if not isinstance(scaling, Mapping):
            raise ConfigValueError("rope_scaling", f"must be an object, got {scaling!r}")
        nested[FULL].update(scaling)
    nested[FULL].setdefault("rope_theta", _given(hf, "gemma3_text", "rope_theta", real))
    local_base = _given(hf, "gemma3_text", "rope_local_base_freq", real)
    nested[SLIDING].setdefault("rope_theta", local_base)
    return nested


def _config(hf: dict, kind: str) -> DecoderConfig:
    name = NAMES[kind]
    require(hf, name, attention_bias=(False,), use_bidirectional_attention=(None, False))
    width, heads = _given(hf, kind, "hidden_size"), _given(hf, kind, "num_attention_heads")
    kv_heads, head_dim = _given(hf, kind, "num_key_value_heads"), _given(hf, kind, "head_dim")
    divides(hf, "num_key_value_heads", "num_attention_heads", kv_heads, heads)
    num_layers = _given(hf, kind, "num_hidden_layers")
    max_positions = _given(hf, kind, "max_position_embeddings")
    # an overlay, not a copy: the other rotary keys are still looked up in the file itself
    overlay: dict = {"max_position_embeddings": max_positions}
    if kind == "gemma3_text":  # rope_scaling is in the full layers' parameters now
        overlay |= {"rope_parameters": _gemma3_rope(hf), "rope_scaling": None}
    rope_hf = ChainMap(overlay, hf)
    rope = read_rope(rope_hf, head_dim, local=kind == "gemma3_text")
    if rope["rope_dims"] is not None:  # transformers' Gemma turns every dimension
        raise ValueError(f"{name} checkpoints with partial_rotary_factor are not supported")
    later = kind != "gemma"  # Gemma 2 and 3
    layer_types = _layer_types(hf, kind, num_layers) if later else None
    window = None
    if layer_types is not None and "sliding" in layer_types:
        window = _given(hf, kind, "sliding_window")  # null: transformers has no window either
    if kind == "gemma3_text" and hf.get("attn_logit_softcapping") is not None:
        raise ValueError(
            f"Gemma 3 checkpoints with attn_logit_softcapping={hf['attn_logit_softcapping']!r} "
            "are not supported: transformers' Gemma 3 never applies it"
        )
    return DecoderConfig(
        vocab_size=_given(hf, kind, "vocab_size"),
        num_layers=num_layers,
        max_positions=max_positions,
        position="rotary",
        **rope,
        layer_types=layer_types,
        embed_scale=True,
        embed_scale_rounded=True,
        tie_embeddings=flag(hf, "tie_word_embeddings", True),
        logit_softcap=_cap(hf, kind, "final_logit_softcapping") if later else None,
        block=BlockConfig(
            width=width,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            mlp_hidden=_given(hf, kind, "intermediate_size"),
            mlp=_mlp(hf, kind),
            norm="rmsnorm_plus1",
            norm_eps=real(hf, "rms_norm_eps", 1e-6, positive=True),
            bias=False,
            sublayer_norm=later,
            attn_scale=_given(hf, kind, "query_pre_attn_scalar") ** -0.5 if later else None,
            softcap=_cap(hf, kind, "attn_logit_softcapping") if kind == "gemma2" else None,
            window=window,
            qk_norm="head" if kind == "gemma3_text" else None,
        ),
    )


MULTIMODAL = ("multimodal Gemma 3 checkpoints (model_type 'gemma3') are not supported; qkv "
              "reads Gemma 3's text-only checkpoints (model_type 'gemma3_text')")  # fmt: skip


def config(hf: dict) -> DecoderConfig:
    """A Gemma, Gemma 2 or Gemma 3 text config.json -> the qkv config of the same decoder."""
    kind = hf.get("model_type")
    if kind == "gemma3":
        raise ValueError(MULTIMODAL)
    if kind not in NAMES:
        raise ValueError(f"model_type {kind!r} is not a Gemma; Gemma's: {', '.join(NAMES)}")
    return _config(hf, kind)


# ---- qkv config -> config.json --------------------------------------------------------------

HF_ACTIVATION = {"geglu_tanh": "gelu_pytorch_tanh", "geglu": "gelu", "swiglu": "silu"}


def _pre_attn_scalar(name: str, block: BlockConfig) -> int:
    """query_pre_attn_scalar, the whole number whose 1/sqrt is the block's score scale."""
    if block.attn_scale is None:
        return block.head_size
    scalar = round(block.attn_scale**-2)
    if scalar < 1 or scalar**-0.5 != block.attn_scale:
        raise ValueError(
            f"a {name} config.json cannot hold attn_scale={block.attn_scale!r}: its scale is "
            "1/sqrt(query_pre_attn_scalar), a whole number"
        )
    return scalar


def _hf_config(cfg: DecoderConfig, kind: str) -> dict:
    name, block, later = NAMES[kind], cfg.block, kind != "gemma"
    fits(name, cfg, position="rotary", type_vocab_size=0, embed_norm=False, embed_scale=True,
         embed_scale_rounded=True, has_final_norm=True, lm_head_bias=False,
         cross_attention=False, rope_dims=None, block__norm="rmsnorm_plus1",
         block__norm_position="pre", block__bias=False, block__qkv_bias=None,
         block__fused_qkv=False, block__fused_mlp=False, block__parallel=False,
         block__sublayer_norm=later,
         block__qk_norm="head" if kind == "gemma3_text" else None)  # fmt: skip
    if kind == "gemma":
        fits(name, cfg, layer_types=None, local_rope_base=None, logit_softcap=None,
             block__window=None, block__softcap=None, block__attn_scale=None)  # fmt: skip
    if kind == "gemma2":
        fits(name, cfg, local_rope_base=None)
    if kind == "gemma3_text":
        fits(name, cfg, block__softcap=None)
        if cfg.local_rope_base is None:
            raise ValueError("a Gemma 3 config.json needs local_rope_base (the sliding layers')")
    mlp = HF_ACTIVATION.get(block.mlp)
    if mlp is None or (kind == "gemma" and block.mlp == "geglu"):  # Gemma's "gelu" is tanh
        held = [m for m in HF_ACTIVATION if kind != "gemma" or m != "geglu"]
        raise ValueError(f"a {name} config.json cannot hold mlp={block.mlp!r}; it holds "
                         f"{', '.join(held)}")  # fmt: skip
    hf: dict[str, Any] = {
        "model_type": kind,
        "architectures": [f"{name.replace(' ', '')}ForCausalLM"],
        "vocab_size": cfg.vocab_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": block.num_heads,
        "num_key_value_heads": block.kv_heads,
        "head_dim": block.head_size,
        "hidden_size": block.width,
        "intermediate_size": block.mlp_hidden or 4 * block.width,
        "max_position_embeddings": cfg.max_positions,
        "rms_norm_eps": block.norm_eps,
        "hidden_act" if kind == "gemma" else "hidden_activation": mlp,
        "tie_word_embeddings": cfg.tie_embeddings,
        "attention_bias": False,
        **hf_rope(cfg, block.head_size),
    }
    if later:
        hf |= {
            "query_pre_attn_scalar": _pre_attn_scalar(name, block),
            "sliding_window": block.window,
            "layer_types": [f"{cfg.layer_type(i)}_attention" for i in range(cfg.num_layers)],
            "attn_logit_softcapping": block.softcap,
            "final_logit_softcapping": cfg.logit_softcap,
        }
    if kind == "gemma3_text":  # the spelling transformers 4 and 5 both read
        hf["rope_local_base_freq"] = cfg.local_rope_base
    return hf


def hf_config(cfg: DecoderConfig) -> dict:
    """The config.json of a Gemma-shaped decoder: Gemma 3 where it has a QK-norm, Gemma 2
    where it normalizes sub-layer outputs, else Gemma.

    >>> cfg = config({"model_type": "gemma2", "vocab_size": 50, "hidden_size": 16,
    ...               "intermediate_size": 24, "num_hidden_layers": 2,
    ...               "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8})
    >>> cfg.layer_types, cfg.block.window, cfg.block.softcap, cfg.logit_softcap
    (('sliding', 'full'), 4096, 50.0, 30.0)
    >>> config(hf_config(cfg)) == cfg
    True
    """
    if cfg.block.qk_norm is not None:
        return _hf_config(cfg, "gemma3_text")
    return _hf_config(cfg, "gemma2" if cfg.block.sublayer_norm else "gemma")


# ---- weights --------------------------------------------------------------------------------

ATTENTION = [
    ("embed.tokens.weight", "model.embed_tokens.weight"),
    ("norm.weight", "model.norm.weight"),
    ("blocks.{}.attn_norm.weight", "model.layers.{}.input_layernorm.weight"),
    ("blocks.{}.attn.q.weight", "model.layers.{}.self_attn.q_proj.weight"),
    ("blocks.{}.attn.k.weight", "model.layers.{}.self_attn.k_proj.weight"),
    ("blocks.{}.attn.v.weight", "model.layers.{}.self_attn.v_proj.weight"),
    ("blocks.{}.attn.out.weight", "model.layers.{}.self_attn.o_proj.weight"),
    ("blocks.{}.mlp.gate.weight", "model.layers.{}.mlp.gate_proj.weight"),
    ("blocks.{}.mlp.up.weight", "model.layers.{}.mlp.up_proj.weight"),
    ("blocks.{}.mlp.down.weight", "model.layers.{}.mlp.down_proj.weight"),
]
# Gemma: post_attention_layernorm is the MLP's input norm. Gemma 2 and 3: it normalizes
# attention's output, and the MLP has a norm on each side.
GEMMA_NORMS = [("blocks.{}.mlp_norm.weight", "model.layers.{}.post_attention_layernorm.weight")]
SANDWICH_NORMS = [
    ("blocks.{}.attn_out_norm.weight", "model.layers.{}.post_attention_layernorm.weight"),
    ("blocks.{}.mlp_norm.weight", "model.layers.{}.pre_feedforward_layernorm.weight"),
    ("blocks.{}.mlp_out_norm.weight", "model.layers.{}.post_feedforward_layernorm.weight"),
]
QK_NORMS = [
    ("blocks.{}.attn.q_norm.weight", "model.layers.{}.self_attn.q_norm.weight"),
    ("blocks.{}.attn.k_norm.weight", "model.layers.{}.self_attn.k_norm.weight"),
]


def weights(cfg: DecoderConfig) -> list[Weight]:
    templates = ATTENTION + (SANDWICH_NORMS if cfg.block.sublayer_norm else GEMMA_NORMS)
    if cfg.block.qk_norm is not None:
        templates += QK_NORMS
    return decoder_weights(templates, cfg)


READS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
         "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act",
         "hidden_activation", "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings",
         "rope_parameters", "rope_theta", "rope_scaling", "partial_rotary_factor",
         "attention_bias", "use_bidirectional_attention")  # fmt: skip
LATER_READS = ("query_pre_attn_scalar", "sliding_window", "layer_types",
               "attn_logit_softcapping", "final_logit_softcapping")  # fmt: skip
INERT = ("initializer_range", "use_cache", "pad_token_id", "eos_token_id", "bos_token_id",
         "attention_dropout", "cache_implementation")  # fmt: skip
IGNORED = (r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq",)

GEMMA = Family(
    "gemma", ("gemma",), Decoder, config, hf_config, weights, ignored=IGNORED,
    reads=READS, inert=INERT, config_classes=("GemmaConfig",),
)  # fmt: skip
GEMMA2 = Family(
    "gemma2", ("gemma2",), Decoder, config, hf_config, weights, ignored=IGNORED,
    reads=READS + LATER_READS, inert=INERT, config_classes=("Gemma2Config",),
)  # fmt: skip
GEMMA3 = Family(
    "gemma3", ("gemma3_text",), Decoder, config, hf_config, weights, ignored=IGNORED,
    refused_types=(("gemma3", MULTIMODAL),),
    reads=READS + LATER_READS + ("sliding_window_pattern", "rope_local_base_freq"),
    # transformers' own note of the pattern it made layer_types from; layer_types decides
    inert=(*INERT, "_sliding_window_pattern"), config_classes=("Gemma3TextConfig",),
)  # fmt: skip

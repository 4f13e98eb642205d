"""Llama and the decoders built like it: pre-norm blocks with RMSNorm, a SwiGLU MLP, grouped
key/value heads and rotary positions (plain or scaled: linear, dynamic, llama3, yarn).

Mistral adds a sliding window; SmolLM2 is Llama itself; SmolLM3 leaves every few layers
without rotary positions (NoPE). Qwen2 and Qwen3 (qkv.io.families.qwen) read their config
through `read_decoder` too. Each family's `config` reads what is its own and refuses by name
what qkv does not compute; `hf_config` writes it back, refusing what the family cannot hold.
"""

from __future__ import annotations

from collections import ChainMap
from collections.abc import Mapping, Sequence
from typing import Any

from qkv.io.families.checks import ConfigValueError, divides, flag, real, whole
from qkv.io.families.common import Family, Weight, expand, fits, require
from qkv.io.families.rotary import hf_rope, read_rope
from qkv.models import Decoder, DecoderConfig
from qkv.models.config import LayerType
from qkv.nn import BlockConfig

# config.json keys every Llama-shaped family reads, and those that do not change outputs
READS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act",
    "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings", "rope_parameters",
    "rope_theta", "rope_scaling", "partial_rotary_factor",
)  # fmt: skip
INERT = ("attention_dropout", "bos_token_id", "eos_token_id", "pad_token_id",
         "initializer_range", "use_cache", "pretraining_tp")  # fmt: skip

# transformers' names of a layer's attention, and qkv's
LAYER_TYPES: dict[str, LayerType] = {"full_attention": "full", "sliding_attention": "sliding"}


def read_decoder(
    hf: Mapping,
    family: str,
    *,
    max_positions: int,
    tie: bool,
    head_dim: int | None = None,
    rope_base: float = 10000.0,
    layer_types: tuple[LayerType, ...] | None = None,
    rope_layers: tuple[bool, ...] | None = None,
    **block: Any,
) -> DecoderConfig:
    """The qkv config of a Llama-shaped config.json: the keys every such family shares are
    read here; `block` holds the family's own BlockConfig fields (biases, window, QK-norm).

    max_positions, tie, head_dim, rope_base: the family's defaults of
    max_position_embeddings, tie_word_embeddings, head_dim and rope_theta (transformers'
    config class fills them in where a file has none; head_dim None: hidden_size /
    num_attention_heads)."""
    require(hf, family, hidden_act=("silu", "swish"))
    width, heads = whole(hf, "hidden_size"), whole(hf, "num_attention_heads")
    kv_heads = whole(hf, "num_key_value_heads", heads)
    divides(hf, "num_key_value_heads", "num_attention_heads", kv_heads, heads)
    head_dim = whole(hf, "head_dim", head_dim)
    if head_dim is None:
        divides(hf, "num_attention_heads", "hidden_size", heads, width)
        head_dim = width // heads
    max_positions = whole(hf, "max_position_embeddings", max_positions)
    # an overlay, not a copy: the rotary keys are still looked up in the file itself
    rope = read_rope(ChainMap({"max_position_embeddings": max_positions}, hf), head_dim,
                     default_base=rope_base)  # fmt: skip
    if rope["rope_dims"] is not None:  # transformers' rotate_half would fail on a part
        raise ConfigValueError(
            "partial_rotary_factor", f"must be 1 in a {family} checkpoint: it turns whole heads"
        )
    kinds = set(layer_types or ())
    if len(kinds) == 1:  # every layer alike: the block says it
        block["window"] = block.get("window") if kinds == {"sliding"} else None
        layer_types = None
    return DecoderConfig(
        vocab_size=whole(hf, "vocab_size"),
        num_layers=whole(hf, "num_hidden_layers"),
        max_positions=max_positions,
        position="rotary",
        rope_base=rope["rope_base"],
        rope_scaling=rope["rope_scaling"],
        layer_types=layer_types,
        rope_layers=None if rope_layers is None or all(rope_layers) else rope_layers,
        tie_embeddings=flag(hf, "tie_word_embeddings", tie),
        block=BlockConfig(
            width=width,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            mlp_hidden=whole(hf, "intermediate_size"),
            mlp="swiglu",
            norm="rmsnorm",
            norm_eps=real(hf, "rms_norm_eps", 1e-6),
            **block,
        ),
    )


def sliding_window(hf: Mapping, default: int | None) -> int | None:
    """sliding_window: null means none; a missing key, the config class's default."""
    if "sliding_window" in hf and hf["sliding_window"] is None:
        return None
    return whole(hf, "sliding_window", default)


def read_layer_types(hf: Mapping, derived: Sequence[str], window: int | None):
    """Each layer's attention, "full" or "sliding": the file's `layer_types` (transformers 5
    writes it) where it has one, else `derived` (what transformers derives from the older
    keys). Sliding layers need a window, as transformers' mask does."""
    given = hf.get("layer_types")
    names = derived if given is None else given
    layers = whole(hf, "num_hidden_layers")
    if not isinstance(names, list | tuple) or len(names) != layers:
        raise ConfigValueError("layer_types", f"must list {layers} layer types, got {given!r}")
    odd = sorted({str(n) for n in names} - set(LAYER_TYPES))
    if odd:
        raise ConfigValueError("layer_types", f"holds {odd}; qkv computes {list(LAYER_TYPES)}")
    types = tuple(LAYER_TYPES[n] for n in names)
    if "sliding" in types and window is None:
        raise ConfigValueError("sliding_window", "must be set: layer_types has sliding layers")
    return types


def check_fits(family: str, cfg: DecoderConfig, **needed: Any) -> None:
    """Refuse a qkv config that no Llama-shaped config.json describes (and, with `needed`,
    what this family's cannot)."""
    fits(family, cfg, position="rotary", type_vocab_size=0, embed_norm=False,
         embed_scale=False, has_final_norm=True, lm_head_bias=False, cross_attention=False,
         logit_softcap=None, rope_dims=None, local_rope_base=None, block__norm="rmsnorm",
         block__norm_bias=True, block__norm_position="pre", block__sublayer_norm=False,
         block__parallel=False, block__fused_qkv=False, block__fused_mlp=False,
         block__mlp="swiglu", block__attn_scale=None, block__softcap=None,
         **needed)  # fmt: skip


def hf_decoder(cfg: DecoderConfig, model_type: str, architecture: str) -> dict[str, Any]:
    """The config.json keys every Llama-shaped family shares."""
    block, scaling = cfg.block, cfg.rope_scaling
    if (
        scaling is not None
        and scaling.kind == "dynamic"
        and scaling.max_positions != cfg.max_positions
    ):
        raise ValueError(
            f"a {model_type} config.json cannot hold dynamic rope scaling from "
            f"{scaling.max_positions} positions with max_positions={cfg.max_positions}: "
            "transformers grows the base past max_position_embeddings"
        )
    hf = {
        "model_type": model_type,
        "architectures": [architecture],
        "vocab_size": cfg.vocab_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": block.num_heads,
        "num_key_value_heads": block.kv_heads,
        "hidden_size": block.width,
        "intermediate_size": block.mlp_hidden or 4 * block.width,
        "max_position_embeddings": cfg.max_positions,
        "rms_norm_eps": block.norm_eps,
        "hidden_act": "silu",
        "tie_word_embeddings": cfg.tie_embeddings,
    } | hf_rope(cfg, block.head_size)
    if block.head_size != block.width // block.num_heads:  # written only where it differs
        hf["head_dim"] = block.head_size
    return hf


def hf_layer_types(cfg: DecoderConfig) -> list[str]:
    """transformers' `layer_types` of a qkv config."""
    names = {qkv: name for name, qkv in LAYER_TYPES.items()}
    return [names[cfg.layer_type(i)] for i in range(cfg.num_layers)]


def one_bias(hf: Mapping, family: str) -> bool:
    """attention_bias (on q, k, v and o) and mlp_bias: qkv's blocks have one switch for the
    output and MLP projections, so the two must agree."""
    attention, mlp = flag(hf, "attention_bias", False), flag(hf, "mlp_bias", False)
    if attention != mlp:
        raise ValueError(
            f"{family} checkpoints with attention_bias={attention} and mlp_bias={mlp} are not "
            "supported (qkv puts biases on every projection or on none)"
        )
    return attention


def hf_one_bias(family: str, cfg: DecoderConfig) -> dict[str, bool]:
    block = cfg.block
    if block.qkv_bias not in (None, block.bias):
        raise ValueError(
            f"a {family} config.json cannot hold qkv_bias={block.qkv_bias} with "
            f"bias={block.bias}: its attention_bias covers q, k, v and o alike"
        )
    return {"attention_bias": block.bias, "mlp_bias": block.bias}


# ---- Llama (and SmolLM2) --------------------------------------------------------------------


def config(hf: dict) -> DecoderConfig:
    """A Llama config.json -> the qkv config of the same decoder."""
    return read_decoder(hf, "Llama", max_positions=2048, tie=False, bias=one_bias(hf, "Llama"))


def hf_config(cfg: DecoderConfig) -> dict:
    """The config.json of a Llama decoder (LlamaForCausalLM). Dropout is not written: a
    Llama config.json has none where qkv puts it (a training setting only).

    >>> cfg = DecoderConfig(vocab_size=50, num_layers=2, position="rotary", block=BlockConfig(
    ...     width=16, num_heads=4, num_kv_heads=2, head_dim=4, mlp_hidden=40, mlp="swiglu",
    ...     norm="rmsnorm", bias=False))
    >>> hf = hf_config(cfg)
    >>> hf["num_key_value_heads"], hf["rope_theta"], config(hf) == cfg
    (2, 10000.0, True)
    """
    check_fits("Llama", cfg, layer_types=None, rope_layers=None, block__window=None,
               block__qk_norm=None)  # fmt: skip
    return hf_decoder(cfg, "llama", "LlamaForCausalLM") | hf_one_bias("Llama", cfg)


TEMPLATES = [
    ("embed.tokens.weight", "model.embed_tokens.weight"),
    ("norm.weight", "model.norm.weight"),
    ("blocks.{}.attn_norm.weight", "model.layers.{}.input_layernorm.weight"),
    ("blocks.{}.attn.q.weight", "model.layers.{}.self_attn.q_proj.weight"),
    ("blocks.{}.attn.k.weight", "model.layers.{}.self_attn.k_proj.weight"),
    ("blocks.{}.attn.v.weight", "model.layers.{}.self_attn.v_proj.weight"),
    ("blocks.{}.attn.out.weight", "model.layers.{}.self_attn.o_proj.weight"),
    ("blocks.{}.mlp_norm.weight", "model.layers.{}.post_attention_layernorm.weight"),
    ("blocks.{}.mlp.gate.weight", "model.layers.{}.mlp.gate_proj.weight"),
    ("blocks.{}.mlp.up.weight", "model.layers.{}.mlp.up_proj.weight"),
    ("blocks.{}.mlp.down.weight", "model.layers.{}.mlp.down_proj.weight"),
]
QKV_BIASES = [
    ("blocks.{}.attn.q.bias", "model.layers.{}.self_attn.q_proj.bias"),
    ("blocks.{}.attn.k.bias", "model.layers.{}.self_attn.k_proj.bias"),
    ("blocks.{}.attn.v.bias", "model.layers.{}.self_attn.v_proj.bias"),
]
BIASES = [  # the output and MLP projections' (BlockConfig.bias)
    ("blocks.{}.attn.out.bias", "model.layers.{}.self_attn.o_proj.bias"),
    ("blocks.{}.mlp.gate.bias", "model.layers.{}.mlp.gate_proj.bias"),
    ("blocks.{}.mlp.up.bias", "model.layers.{}.mlp.up_proj.bias"),
    ("blocks.{}.mlp.down.bias", "model.layers.{}.mlp.down_proj.bias"),
]
QK_NORMS = [  # Qwen3's per-head RMSNorm of queries and keys
    ("blocks.{}.attn.q_norm.weight", "model.layers.{}.self_attn.q_norm.weight"),
    ("blocks.{}.attn.k_norm.weight", "model.layers.{}.self_attn.k_norm.weight"),
]


def weights(cfg: DecoderConfig) -> list[Weight]:
    """The weight map of every Llama-shaped family: the biases and QK-norms it has."""
    block = cfg.block
    templates = list(TEMPLATES)
    if block.bias if block.qkv_bias is None else block.qkv_bias:
        templates += QKV_BIASES
    if block.bias:
        templates += BIASES
    if block.qk_norm is not None:
        templates += QK_NORMS
    if not cfg.tie_embeddings:
        templates.append(("lm_head.weight", "lm_head.weight"))
    return expand(templates, cfg.num_layers)


IGNORED = (r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq",)

FAMILY = Family(
    "llama", ("llama",), Decoder, config, hf_config, weights, ignored=IGNORED,
    reads=(*READS, "attention_bias", "mlp_bias"), inert=INERT, config_classes=("LlamaConfig",),
)  # fmt: skip


# ---- Mistral: Llama with a sliding window ---------------------------------------------------


def mistral_config(hf: dict) -> DecoderConfig:
    """A Mistral config.json: a key j is seen from query i while i - j < sliding_window
    (transformers' sliding mask), which is qkv's window; null: full attention."""
    return read_decoder(hf, "Mistral", max_positions=4096 * 32, tie=False, bias=False,
                        window=sliding_window(hf, 4096))  # fmt: skip


def mistral_hf_config(cfg: DecoderConfig) -> dict:
    check_fits("Mistral", cfg, layer_types=None, rope_layers=None, block__bias=False,
               block__qkv_bias=None, block__qk_norm=None)  # fmt: skip
    hf = hf_decoder(cfg, "mistral", "MistralForCausalLM")
    return hf | {"sliding_window": cfg.block.window}


MISTRAL = Family(
    "mistral", ("mistral",), Decoder, mistral_config, mistral_hf_config, weights,
    ignored=IGNORED, reads=(*READS, "sliding_window"), inert=INERT,
    config_classes=("MistralConfig",),
)  # fmt: skip


# ---- SmolLM3: Llama where every few layers have no rotary positions -------------------------


def smollm3_config(hf: dict) -> DecoderConfig:
    """A SmolLM3 config.json. no_rope_layers: 1 where a layer turns queries and keys, 0
    where it has no positions (by default every no_rope_layer_interval-th layer). Sliding
    layers are those of layer_types or, without it, the layers without positions when
    use_sliding_window is set (as transformers derives them)."""
    layers = whole(hf, "num_hidden_layers")
    given = hf.get("no_rope_layers")
    # read even where no_rope_layers wins over it (as in transformers), so a wrong kind fails
    interval = whole(hf, "no_rope_layer_interval", 4)
    if given is None:
        given = [int((i + 1) % interval != 0) for i in range(layers)]
    if (
        not isinstance(given, list)
        or len(given) != layers
        or any(type(v) not in (int, bool) or v not in (0, 1) for v in given)
    ):
        raise ConfigValueError("no_rope_layers", f"must list {layers} values 0 or 1, got {given!r}")
    use_window = flag(hf, "use_sliding_window", False)
    window = sliding_window(hf, None)
    derived = ["sliding_attention" if use_window and window is not None and not rope
               else "full_attention" for rope in given]  # fmt: skip
    types = read_layer_types(hf, derived, window)
    if "sliding" in types and not use_window:  # eager would window them, flash would not
        raise ConfigValueError("use_sliding_window", "must be true where layer_types slides")
    return read_decoder(
        hf, "SmolLM3", max_positions=32768, tie=True, rope_base=2000000.0,  # SmolLM3Config's
        bias=one_bias(hf, "SmolLM3"),
        window=window, layer_types=types, rope_layers=tuple(bool(v) for v in given),
    )  # fmt: skip


def smollm3_hf_config(cfg: DecoderConfig) -> dict:
    check_fits("SmolLM3", cfg, block__qk_norm=None)
    hf = hf_decoder(cfg, "smollm3", "SmolLM3ForCausalLM") | hf_one_bias("SmolLM3", cfg)
    rope = cfg.rope_layers or (True,) * cfg.num_layers
    return hf | {
        "no_rope_layers": [int(r) for r in rope],
        "use_sliding_window": cfg.block.window is not None,
        "sliding_window": cfg.block.window,
        "layer_types": hf_layer_types(cfg),
    }


SMOLLM3 = Family(
    "smollm3", ("smollm3",), Decoder, smollm3_config, smollm3_hf_config, weights,
    ignored=IGNORED, inert=INERT, config_classes=("SmolLM3Config",),
    reads=(*READS, "attention_bias", "mlp_bias", "no_rope_layers", "no_rope_layer_interval",
           "use_sliding_window", "sliding_window", "layer_types"),
)  # fmt: skip

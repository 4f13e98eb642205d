"""OLMo 3: OLMo 2 (qkv.io.families.olmo2: each sub-layer's output normalized before the
residual sum, one RMSNorm over all query heads and one over all key heads, SwiGLU, no
biases) with sliding-window layers between full ones (three sliding, then one full, by
default) and a rotary of each layer type's own: the full layers' may be scaled (YaRN in the
released checkpoints), the sliding layers' is plain, at its own base.

The rotary settings are read as transformers' Olmo3Config nests them, quirks included: an
older file's top-level rope_theta and rope_scaling are the full layers' only (the sliding
layers then turn at 500 000), a flat rope_parameters is ignored, and YaRN's `truncate` is
read from beside the two nested objects, never from inside the full layers' own.
"""

from __future__ import annotations

from collections import ChainMap
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from qkv.io.families import llama, olmo2
from qkv.io.families.checks import ConfigValueError, divides, flag, real, whole
from qkv.io.families.common import Family, fits, require
from qkv.io.families.rotary import FULL, SLIDING, hf_rope, read_rope
from qkv.models import Decoder, DecoderConfig
from qkv.nn import BlockConfig

DEFAULT_BASE = 500000.0  # Olmo3Config's default_theta (OLMo 2's is 10 000)


def _object(key: str, value: Any) -> dict | None:
    if value is not None and not isinstance(value, Mapping):
        raise ConfigValueError(key, f"must be an object, got {value!r}")
    return None if value is None else dict(value)


def nested_rope(hf: Mapping) -> dict:
    """The rope parameters nested by layer type, built from a config.json as
    Olmo3Config.convert_rope_params_to_dict builds them."""
    given = _object("rope_parameters", hf.get("rope_parameters"))
    scaling = _object("rope_scaling", hf.get("rope_scaling"))
    outer = given if given is not None else {}
    full = _object("rope_parameters", outer.get(FULL))
    sliding = _object("rope_parameters", outer.get(SLIDING))
    if scaling is not None:  # an older file's scaling: the full layers' only
        if given is not None and full is None:  # transformers fails on it (KeyError)
            raise ConfigValueError(
                "rope_scaling", f"cannot stand beside a rope_parameters without {FULL}"
            )
        full = (full or {"rope_type": "default"}) | scaling
    full = full or {"rope_type": "default"}
    if "rope_theta" not in full:  # an older file's rope_theta, the full layers' only
        full["rope_theta"] = hf.get("rope_theta", DEFAULT_BASE)
    sliding = sliding or {"rope_type": "default"}
    sliding.setdefault("rope_theta", DEFAULT_BASE)  # never the older file's rope_theta
    for params in (full, sliding):
        real(params, "rope_theta", positive=True)  # a null one fails in transformers
    for params in (full, sliding, hf):
        if params.get("partial_rotary_factor") not in (None, 1, 1.0):
            raise ConfigValueError("partial_rotary_factor", "must be 1 in an OLMo 3 checkpoint")
    # transformers' YaRN reads truncate from the outer object, not the full layers' own
    truncate = flag(outer, "truncate", True)
    full.pop("truncate", None)
    if full.get("rope_type", full.get("type")) == "yarn":
        full["truncate"] = truncate
    return {FULL: full, SLIDING: sliding}


def config(hf: dict) -> DecoderConfig:
    """An OLMo 3 config.json -> the qkv config of the same decoder."""
    # attention_bias would bias o_proj too but not the MLP: qkv's biases do not split so
    require(hf, "OLMo 3", attention_bias=(False,), hidden_act=("silu",))
    if "sliding_window" in hf and hf["sliding_window"] is None:
        raise ConfigValueError(
            "sliding_window", "must be set: transformers' OLMo 3 makes a sliding mask always"
        )
    window = whole(hf, "sliding_window", 4096)
    layers = whole(hf, "num_hidden_layers")
    derived = [SLIDING if (i + 1) % 4 else FULL for i in range(layers)]
    types = llama.read_layer_types(hf, derived, window)
    width, heads = whole(hf, "hidden_size"), whole(hf, "num_attention_heads")
    kv_heads = whole(hf, "num_key_value_heads", heads)
    divides(hf, "num_key_value_heads", "num_attention_heads", kv_heads, heads)
    head_dim = whole(hf, "head_dim", None)
    if head_dim is None:
        divides(hf, "num_attention_heads", "hidden_size", heads, width)
        head_dim = width // heads
    max_positions = whole(hf, "max_position_embeddings", 2048)
    # an overlay: the nested parameters stand for every older rotary key of the file
    overlay = {"rope_parameters": nested_rope(hf), "rope_scaling": None, "rope_theta": None,
               "original_max_position_embeddings": None,
               "max_position_embeddings": max_positions}  # fmt: skip
    rope = read_rope(ChainMap(overlay, hf), head_dim, local="sliding" in types)
    return DecoderConfig(
        vocab_size=whole(hf, "vocab_size"),
        num_layers=layers,
        max_positions=max_positions,
        position="rotary",
        tie_embeddings=flag(hf, "tie_word_embeddings", False),
        final_norm=True,
        layer_types=types,
        **rope,
        block=BlockConfig(
            width=width,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            mlp_hidden=whole(hf, "intermediate_size"),
            mlp="swiglu",
            norm="rmsnorm",
            norm_eps=real(hf, "rms_norm_eps", 1e-5),
            norm_position="none",
            sublayer_norm=True,
            qk_norm="full",
            bias=False,
            window=window,
        ),
    )


def hf_config(cfg: DecoderConfig) -> dict:
    """The config.json of an OLMo-3-shaped decoder (Olmo3ForCausalLM), its rotary settings
    nested by layer type (the spelling transformers 5 writes)."""
    block = cfg.block
    fits("OLMo 3", cfg, position="rotary", type_vocab_size=0, embed_norm=False,
         embed_scale=False, has_final_norm=True, lm_head_bias=False, cross_attention=False,
         logit_softcap=None, head_scale=None, rope_dims=None, rope_layers=None,
         moe_layers=None, block__norm="rmsnorm", block__norm_position="none",
         block__sublayer_norm=True, block__parallel=False, block__bias=False,
         block__qkv_bias=None, block__fused_qkv=False, block__fused_mlp=False,
         block__mlp="swiglu", block__attn_scale=None, block__softcap=None,
         block__qk_norm="full", block__chunk=None, block__sinks=False,
         block__temperature=None, block__experts=None, block__latent=None)  # fmt: skip
    types = llama.hf_layer_types(cfg)
    if SLIDING in types and cfg.local_rope_base is None:
        raise ValueError("an OLMo 3 config.json needs local_rope_base (the sliding layers')")
    full = {"rope_type": "default", "rope_theta": cfg.rope_base}
    full |= hf_rope(cfg, block.head_size).get("rope_scaling", {})
    truncate = full.pop("truncate", True)
    rope: dict[str, Any] = {
        FULL: full,
        SLIDING: {"rope_type": "default", "rope_theta": cfg.local_rope_base or DEFAULT_BASE},
    }
    if not truncate:  # where transformers' YaRN looks for it
        rope["truncate"] = False
    hf = olmo2.hf_config(olmo2_shaped(cfg)) | {
        "model_type": "olmo3",
        "architectures": ["Olmo3ForCausalLM"],
        "sliding_window": block.window or 4096,  # never null: transformers needs one
        "layer_types": types,
        "rope_parameters": rope,
    }
    for older in ("rope_theta", "rope_scaling"):  # the nested parameters say it all
        hf.pop(older, None)
    return hf


def olmo2_shaped(cfg: DecoderConfig) -> DecoderConfig:
    """cfg without what OLMo 3 adds to OLMo 2 (its sliding layers and their rotary)."""
    return replace(cfg, layer_types=None, local_rope_base=None,
                   block=replace(cfg.block, window=None))  # fmt: skip


FAMILY = Family(
    "olmo3", ("olmo3",), Decoder, config, hf_config, olmo2.weights, ignored=olmo2.FAMILY.ignored,
    reads=(*olmo2.FAMILY.reads, "sliding_window", "layer_types"), inert=olmo2.FAMILY.inert,
    config_classes=("Olmo3Config",),
)  # fmt: skip

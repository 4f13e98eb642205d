"""Ministral and Ministral 3: Mistral's decoder (qkv.io.families.llama) with Mistral's later
choices.

Ministral (model_type "ministral") lists each layer's attention, sliding or full, in
`layer_types`; transformers makes a sliding mask on every forward pass, so a file must
have a sliding_window even where no layer slides.

Ministral 3 (model_type "ministral3") has a head size of its own (128), no biases, a
sliding window on every layer only where sliding_window is set (by default none), YaRN
rotary positions (by default x16 from 16 384, base 10^6) and a temperature on every query
(Llama 4's "attention scaling"): its scores times 1 + beta * log(1 + floor(p / every)), p
the query's position, beta rope_parameters' llama_4_scaling_beta, every its
original_max_position_embeddings. The released checkpoints are multimodal (model_type
"mistral3"); qkv reads the text model's own files.
"""

from __future__ import annotations

from collections import ChainMap
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from qkv.io.families import llama
from qkv.io.families.checks import ConfigValueError, real, whole
from qkv.io.families.common import Family
from qkv.io.families.rotary import FULL, SLIDING
from qkv.models import Decoder, DecoderConfig
from qkv.nn.position import Temperature

# what every Mistral-shaped family here cannot hold (qkv has it for other families)
NOT_HELD = dict(rope_layers=None, moe_layers=None, head_scale=None, block__bias=False,
                block__qkv_bias=None, block__qk_norm=None, block__chunk=None,
                block__sinks=False, block__experts=None, block__latent=None)  # fmt: skip


def _defaults(hf: Mapping, **defaults: Any) -> ChainMap:
    """hf, with the config class's default where a key is missing (an overlay: each key is
    still looked up in the file itself)."""
    missing = {key: value for key, value in defaults.items() if key not in hf}
    return ChainMap(missing, hf)


def _window_needed(hf: Mapping, family: str) -> int:
    if "sliding_window" in hf and hf["sliding_window"] is None:
        raise ConfigValueError(
            "sliding_window", f"must be set: transformers' {family} makes a sliding mask always"
        )
    return whole(hf, "sliding_window", 4096)


# ---- Ministral: Mistral with a sliding or full attention per layer ---------------------------


def ministral_config(hf: dict) -> DecoderConfig:
    """A Ministral config.json. head_dim null means hidden_size / num_attention_heads (where
    transformers' attention fails; its rotary means that)."""
    hf = _defaults(hf, num_key_value_heads=8)
    window = _window_needed(hf, "Ministral")
    derived = ["sliding_attention"] * whole(hf, "num_hidden_layers")
    types = llama.read_layer_types(hf, derived, window)
    return llama.read_decoder(hf, "Ministral", max_positions=4096 * 32, tie=False, bias=False,
                              window=window, layer_types=types)  # fmt: skip


def ministral_hf_config(cfg: DecoderConfig) -> dict:
    llama.check_fits("Ministral", cfg, block__temperature=None, **NOT_HELD)
    hf = llama.hf_decoder(cfg, "ministral", "MinistralForCausalLM")
    return hf | {
        "head_dim": cfg.block.head_size,  # null fails in transformers' attention
        "sliding_window": cfg.block.window or 4096,  # never null, even where no layer slides
        "layer_types": llama.hf_layer_types(cfg),
    }


MINISTRAL = Family(
    "ministral", ("ministral",), Decoder, ministral_config, ministral_hf_config, llama.weights,
    ignored=llama.IGNORED, reads=(*llama.READS, "sliding_window", "layer_types"),
    inert=llama.INERT, config_classes=("MinistralConfig",),
)  # fmt: skip


# ---- Ministral 3: YaRN and a temperature on every query --------------------------------------

BETA, TRAINED = "llama_4_scaling_beta", "original_max_position_embeddings"


def default_rope(max_positions: Any) -> dict:
    """Ministral3Config's rope_parameters for a file that has none (nor rope_scaling)."""
    return {"type": "yarn", "rope_theta": 1000000.0, "factor": 16.0, TRAINED: 16384,
            "max_position_embeddings": max_positions, "beta_fast": 32.0, "beta_slow": 1.0,
            "mscale_all_dim": 1.0, "mscale": 1.0, BETA: 0.1}  # fmt: skip


def _temperature(hf: Mapping, scaling) -> Temperature | None:
    """The queries' temperature: None where beta is 0 (every factor 1). Its positions per
    step are the YaRN trained length where the scaling has one (transformers fills it in
    from max_position_embeddings), else the rope parameters' own."""
    params = hf.get("rope_scaling") or hf.get("rope_parameters") or {}  # read_rope checked it
    if FULL in params or SLIDING in params:
        raise ConfigValueError("rope_parameters", "must not be nested by layer type in a "
                                                  "Ministral 3 checkpoint")  # fmt: skip
    if params.get(BETA) is None:  # transformers fails on a missing one (None * a tensor)
        raise ConfigValueError("rope_parameters", f"must hold {BETA} in a Ministral 3 checkpoint")
    beta = real(params, BETA)
    if scaling is not None and scaling.kind in ("llama3", "yarn", "longrope"):
        every = scaling.original_max_positions
    elif params.get(TRAINED) is None:
        step = f"must hold {TRAINED} in a Ministral 3 checkpoint (its temperature's step)"
        raise ConfigValueError("rope_parameters", step)
    else:
        every = whole(params, TRAINED)
    return None if beta == 0.0 else Temperature(beta, every, 0.0)


def ministral3_config(hf: dict) -> DecoderConfig:
    """A Ministral 3 (text) config.json -> the qkv config of the same decoder."""
    overlay: dict[str, Any] = {}  # Ministral3Config's defaults, where they are not Mistral's
    if "num_key_value_heads" not in hf:
        overlay["num_key_value_heads"] = 8
    if "rms_norm_eps" not in hf:
        overlay["rms_norm_eps"] = 1e-5
    if not hf.get("rope_scaling") and hf.get("rope_parameters") is None:  # as transformers
        overlay["rope_parameters"] = default_rope(whole(hf, "max_position_embeddings", 262144))
    read = ChainMap(overlay, hf)
    if "head_dim" in hf and hf["head_dim"] is None:  # transformers' config refuses it too
        raise ConfigValueError("head_dim", "must be a whole number >= 1, got None")
    cfg = llama.read_decoder(read, "Ministral 3", max_positions=262144, tie=False,
                             head_dim=128, bias=False,
                             window=llama.sliding_window(hf, None))  # fmt: skip
    temperature = _temperature(read, cfg.rope_scaling)
    return replace(cfg, block=replace(cfg.block, temperature=temperature))


def ministral3_hf_config(cfg: DecoderConfig) -> dict:
    """The config.json of a Ministral-3-shaped decoder (Ministral3ForCausalLM), its rotary
    settings and temperature in one rope_parameters (the spelling transformers 5 writes)."""
    block, scaling = cfg.block, cfg.rope_scaling
    llama.check_fits("Ministral 3", cfg, layer_types=None, block__temperature_where="all",
                     **NOT_HELD)  # fmt: skip
    hf = llama.hf_decoder(cfg, "ministral3", "Ministral3ForCausalLM")
    rope = {"rope_type": "default", "rope_theta": hf.pop("rope_theta")}
    rope |= hf.pop("rope_scaling", {})
    temperature = block.temperature or Temperature(0.0, rope.get(TRAINED, cfg.max_positions))
    every = temperature.every
    if temperature.shift != 0.0 or every != int(every):
        raise ValueError(
            f"a Ministral 3 config.json cannot hold the temperature {temperature}: its shift is "
            "0 and its step a whole number of positions"
        )
    trained = scaling.original_max_positions if scaling is not None else None
    if scaling is not None and scaling.kind in ("llama3", "yarn", "longrope") and every != trained:
        raise ValueError(
            f"a Ministral 3 config.json cannot hold a temperature every {every} positions "
            f"with rotary trained on {trained}: both are {TRAINED}"
        )
    rope |= {BETA: temperature.strength, TRAINED: int(every)}
    return hf | {"head_dim": block.head_size, "sliding_window": block.window,
                 "rope_parameters": rope}  # fmt: skip


MISTRAL3 = ("multimodal Mistral 3 checkpoints (model_type 'mistral3') are not supported; qkv "
            "reads the text model's own (model_type 'ministral3')")  # fmt: skip

MINISTRAL3 = Family(
    "ministral3", ("ministral3",), Decoder, ministral3_config, ministral3_hf_config,
    llama.weights, ignored=llama.IGNORED, refused_types=(("mistral3", MISTRAL3),),
    reads=(*llama.READS, "sliding_window"), inert=llama.INERT,
    config_classes=("Ministral3Config",),
)  # fmt: skip

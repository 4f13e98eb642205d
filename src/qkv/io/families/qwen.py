"""Qwen2 (and Qwen2.5) and Qwen3: Llama-shaped decoders (qkv.io.families.llama).

Qwen2 puts biases on the query, key and value projections only; Qwen3 drops them and
normalizes each query and key head instead (an RMSNorm over the head's D dimensions,
before rotary positions), with a head size of its own (head_dim, 128 by default). Both can
slide a window over some layers: transformers 5 lists them in `layer_types`; older files
say `use_sliding_window`, and the layers from `max_window_layers` on slide.
"""

from __future__ import annotations

from collections.abc import Mapping

from qkv.io.families import llama
from qkv.io.families.checks import flag, whole
from qkv.io.families.common import Family, require
from qkv.models import Decoder, DecoderConfig

WINDOW_KEYS = ("use_sliding_window", "sliding_window", "max_window_layers", "layer_types")


def _windows(hf: Mapping) -> dict:
    """read_decoder's window and layer_types of a Qwen config.json: sliding_window counts
    only with use_sliding_window (as transformers' config reads it)."""
    window = llama.sliding_window(hf, 4096)  # read either way, so a wrong kind fails
    window = window if flag(hf, "use_sliding_window", False) else None
    first = whole(hf, "max_window_layers", 28, minimum=0)
    layers = whole(hf, "num_hidden_layers")
    derived = ["sliding_attention" if window is not None and i >= first else "full_attention"
               for i in range(layers)]  # fmt: skip
    return {"window": window, "layer_types": llama.read_layer_types(hf, derived, window)}


def _hf_windows(cfg: DecoderConfig) -> dict:
    types = llama.hf_layer_types(cfg)
    full = next((i for i, t in enumerate(types) if t != "full_attention"), len(types))
    return {
        "use_sliding_window": cfg.block.window is not None,
        "sliding_window": cfg.block.window,
        "max_window_layers": full,  # what older readers derive layer_types from
        "layer_types": types,
    }


def qwen2_config(hf: dict) -> DecoderConfig:
    """A Qwen2 config.json -> the qkv config: biases on q, k and v, none elsewhere."""
    return llama.read_decoder(hf, "Qwen2", max_positions=32768, tie=False, bias=False,
                              qkv_bias=True, **_windows(hf))  # fmt: skip


def qwen2_hf_config(cfg: DecoderConfig) -> dict:
    llama.check_fits("Qwen2", cfg, rope_layers=None, block__bias=False, block__qkv_bias=True,
                     block__qk_norm=None)  # fmt: skip
    return llama.hf_decoder(cfg, "qwen2", "Qwen2ForCausalLM") | _hf_windows(cfg)


QWEN2 = Family(
    "qwen2", ("qwen2",), Decoder, qwen2_config, qwen2_hf_config, llama.weights,
    ignored=llama.IGNORED, reads=(*llama.READS, *WINDOW_KEYS), inert=llama.INERT,
    config_classes=("Qwen2Config",),
)  # fmt: skip


def qwen3_config(hf: dict) -> DecoderConfig:
    """A Qwen3 config.json -> the qkv config: per-head QK-norm, no biases. attention_bias
    would put biases on q, k, v and o but not on the MLP, which qkv's blocks do not split."""
    require(hf, "Qwen3", attention_bias=(False,))
    return llama.read_decoder(hf, "Qwen3", max_positions=32768, tie=False, head_dim=128,
                              bias=False, qk_norm="head", **_windows(hf))  # fmt: skip


def qwen3_hf_config(cfg: DecoderConfig) -> dict:
    llama.check_fits("Qwen3", cfg, rope_layers=None, block__bias=False, block__qkv_bias=None,
                     block__qk_norm="head")  # fmt: skip
    hf = llama.hf_decoder(cfg, "qwen3", "Qwen3ForCausalLM") | _hf_windows(cfg)
    return hf | {"head_dim": cfg.block.head_size, "attention_bias": False}  # its default: 128


QWEN3 = Family(
    "qwen3", ("qwen3",), Decoder, qwen3_config, qwen3_hf_config, llama.weights,
    ignored=llama.IGNORED, reads=(*llama.READS, *WINDOW_KEYS, "attention_bias"),
    inert=llama.INERT, config_classes=("Qwen3Config",),
)  # fmt: skip

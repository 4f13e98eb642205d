"""The one check of a model config's values, wherever the config comes from.

A config.json and a GGUF file's header (translated to a config.json dict) are read by the
family's `config` through `whole`, `real` and `flag`, which refuse a value of the wrong kind
by its key; `family_config` names the file, in the file's own key names; `check_weight_bytes`
refuses a config that needs far more weights than the files hold, before anything is built.

>>> whole({"hidden_size": 384.0}, "hidden_size")
384
>>> whole({"hidden_size": "384"}, "hidden_size")
Traceback (most recent call last):
...
qkv.io.families.checks.ConfigValueError: hidden_size must be a whole number >= 1, got '384'
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

_MISSING: Any = object()

# A weight takes at least 2 bits in any file qkv reads (Q4 GGUF blocks take 4.5, float16
# takes 16): a config needing more weights than that is not the config of these files.
_MIN_BITS_PER_WEIGHT = 2


class ConfigValueError(ValueError):
    """A config value of the wrong kind; `key` names it so the file's own name can be used."""

    def __init__(self, key: str, problem: str):
        super().__init__(f"{key} {problem}")
        self.key, self.problem = key, problem


def _given(hf: Mapping, key: str, default: Any, kind: str) -> bool:
    """Whether hf holds a value for key; if not, there must be a default."""
    if key in hf and hf[key] is not None:
        return True
    if default is _MISSING:
        raise ConfigValueError(key, f"must be {kind}, got {_shown(hf, key)}")
    return False


def _shown(hf: Mapping, key: str) -> str:
    return repr(hf[key]) if key in hf else "nothing (the key is missing)"


def whole(hf: Mapping, key: str, default: Any = _MISSING, *, minimum: int = 1) -> Any:
    """hf[key] as an int >= minimum (a float such as 384.0 that is whole counts as one);
    `default` if it is missing or null, an error if there is no default."""
    kind = f"a whole number >= {minimum}"
    if not _given(hf, key, default, kind):
        return default
    value = hf[key]
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if type(value) is not int or value < minimum:  # bool is an int to Python, not here
        raise ConfigValueError(key, f"must be {kind}, got {value!r}")
    return value


def real(hf: Mapping, key: str, default: Any = _MISSING, *, positive: bool = False) -> Any:
    """hf[key] as a finite float (> 0 if `positive`); `default` if missing or null."""
    kind = "a number > 0" if positive else "a number"
    if not _given(hf, key, default, kind):
        return default
    value = hf[key]
    if type(value) not in (int, float) or not math.isfinite(value) or (positive and value <= 0):
        raise ConfigValueError(key, f"must be {kind}, got {value!r}")
    return float(value)


def flag(hf: Mapping, key: str, default: Any = _MISSING) -> Any:
    """hf[key] as a bool: the string "false" is not one (it would read as true)."""
    if not _given(hf, key, default, "true or false"):
        return default
    value = hf[key]
    if type(value) is not bool:
        raise ConfigValueError(key, f"must be true or false, got {value!r}")
    return value


def divides(hf: Mapping, part: str, whole_key: str, parts: int, total: int) -> None:
    """`parts` (hf[part]) must divide `total` (hf[whole_key])."""
    if total % parts:
        raise ConfigValueError(part, f"({parts}) must divide {whole_key} ({total})")


def family_config(family, hf: dict, source: str | Path, names: Mapping[str, str] | None = None):
    """family.config(hf), with each refusal naming `source` (a config.json or a .gguf file);
    `names` gives the source's own name of a config.json key (llama.block_count for
    num_hidden_layers)."""
    try:
        return family.config(hf)
    except ConfigValueError as error:
        key = (names or {}).get(error.key, error.key)
        raise ValueError(f"{source}: {key} {error.problem}") from None
    except ValueError as error:
        raise ValueError(f"{source}: {error}") from None


def weight_count(config) -> int:
    """At least how many weights a model of `config` holds: its embedding tables and its
    blocks' matrices (norms, biases and cross-attention left out). Computed, not built, so
    a config claiming 10^9 layers costs nothing to refuse."""
    block = config.block
    C, H, Hkv, D = block.width, block.num_heads, block.kv_heads, block.head_size
    mlp = (3 if block.mlp == "swiglu" else 2) * C * (block.mlp_hidden or 4 * C)
    if block.experts is not None:  # every expert is stored: E gated MLPs
        experts = block.experts.routing.num_experts * 3 * C * block.experts.hidden
        dense = 3 * C * (config.dense_mlp_hidden or block.mlp_hidden or 0)
        mlp = min(experts, dense) if config.moe_layers is not None else experts
    attention = 2 * C * H * D + 2 * C * Hkv * D  # q and out; k and v
    if block.latent is not None:  # at least the output projection and the compressed keys
        latent = block.latent
        attention = latent.num_heads * latent.v_head_dim * C + C * latent.kv_lora_rank
    layers = sum(getattr(config, n, 0) for n in ("num_layers", "encoder_layers", "decoder_layers"))
    positions = config.max_positions * C if config.position == "learned" else 0
    return config.vocab_size * C + positions + layers * (attention + mlp)


def check_weight_bytes(config, nbytes: int, source: str | Path) -> None:
    """Refuse a config that needs more weights than `nbytes` of weight files could hold."""
    needed = weight_count(config)
    if needed * _MIN_BITS_PER_WEIGHT > nbytes * 8:
        raise ValueError(
            f"{source} describes a model of at least {needed:,} weights, but its weight files "
            f"hold {nbytes:,} bytes (at least {needed * _MIN_BITS_PER_WEIGHT // 8:,} needed); "
            "the config does not belong to these weights"
        )

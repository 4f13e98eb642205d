"""The rotary settings of a config.json, both ways, for every family with rotary positions.

Checkpoints spell them two ways: transformers 4 wrote `rope_theta` and `rope_scaling` at the
top level (Phi-3 also `original_max_position_embeddings`, GPT-NeoX `rotary_emb_base` and
`rotary_pct`); transformers 5 writes one `rope_parameters` object, nested by layer type
where sliding and full layers differ (Gemma 3, ModernBERT). `read_rope` reads either and
returns the qkv config's rotary fields; a scaling qkv does not compute is refused by name.

>>> read_rope({"rope_theta": 500000.0, "max_position_embeddings": 64,
...            "rope_scaling": {"rope_type": "linear", "factor": 2.0}}, head_dim=8)["rope_scaling"]
RopeScaling(kind='linear', factor=2.0, original_max_positions=64, low_freq_factor=1.0, \
high_freq_factor=4.0, beta_fast=32.0, beta_slow=1.0, mscale=None, mscale_all_dim=None, \
truncate=True, attention_factor=None, short_factor=(), long_factor=(), max_positions=64)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from qkv.io.families.checks import ConfigValueError, flag, real, whole
from qkv.nn.rope import KINDS, RopeScaling

FULL, SLIDING = "full_attention", "sliding_attention"


def _parameters(hf: Mapping, layer_type: str | None) -> dict[str, Any]:
    """The rope parameters of one layer type (or of every layer), as one flat dict. A
    rope_scaling beside rope_parameters replaces it, as transformers 5 reads the two
    (convert_rope_params_to_dict): a scaling added to a newer file is the one computed."""
    scaling = hf.get("rope_scaling")
    given = scaling or hf.get("rope_parameters") or {}
    if not isinstance(given, Mapping):
        key = "rope_scaling" if scaling else "rope_parameters"
        raise ConfigValueError(key, f"must be an object, got {given!r}")
    if FULL in given or SLIDING in given:  # transformers 5, one object per layer type
        given = given.get(layer_type or FULL) or {}
        if not isinstance(given, Mapping):
            raise ConfigValueError("rope_parameters", f"must hold objects, got {given!r}")
    return dict(given)


def read_rope(
    hf: Mapping,
    head_dim: int,
    *,
    base_keys: tuple[str, ...] = ("rope_theta",),
    partial_keys: tuple[str, ...] = ("partial_rotary_factor",),
    default_base: float = 10000.0,
    local: bool = False,
) -> dict[str, Any]:
    """The StackConfig fields rope_base, rope_dims, rope_scaling (and local_rope_base with
    `local`: the sliding layers' own unscaled base) of a config.json.

    base_keys, partial_keys: where this family keeps the base and the rotated fraction of
    each head at the top level (GPT-NeoX: rotary_emb_base, rotary_pct)."""
    params = _parameters(hf, None)
    base = _first(params, ("rope_theta",)) or _first(hf, base_keys)
    base = real({"rope_theta": base}, "rope_theta", default_base, positive=True)
    fraction = _first(params, ("partial_rotary_factor",)) or _first(hf, partial_keys)
    fraction = real({"partial_rotary_factor": fraction}, "partial_rotary_factor", 1.0)
    if not 0.0 < fraction <= 1.0:
        raise ConfigValueError("partial_rotary_factor", f"must be in (0, 1], got {fraction}")
    dims = int(head_dim * fraction)
    if dims % 2 or dims == 0:
        raise ConfigValueError(
            "partial_rotary_factor",
            f"({fraction}) of head_dim {head_dim} turns {dims} dimensions; rotary needs an "
            "even number of at least 2",
        )
    fields = {
        "rope_base": base,
        "rope_dims": None if dims == head_dim else dims,
        "rope_scaling": _scaling(hf, params, dims),
    }
    if local:
        local_params = _parameters(hf, SLIDING)
        kind = local_params.get("rope_type", local_params.get("type", "default"))
        if kind != "default":
            raise ConfigValueError(
                "rope_parameters", f"sliding layers with rope scaling {kind!r} are not supported"
            )
        local_base = local_params.get("rope_theta", hf.get("rope_local_base_freq"))
        fields["local_rope_base"] = real({"rope_theta": local_base}, "rope_theta", base,
                                         positive=True)  # fmt: skip
    return fields


def _first(hf: Mapping, keys: tuple[str, ...]) -> Any:
    for key in keys:
        if hf.get(key) is not None:
            return hf[key]
    return None


def _scaling(hf: Mapping, params: dict, dims: int) -> RopeScaling | None:
    kind = params.get("rope_type", params.get("type", "default"))
    if kind in ("default", None):
        return None
    if kind not in KINDS:
        raise ConfigValueError(
            "rope_scaling",
            f"type {kind!r} is not supported; supported: default, {', '.join(KINDS)}",
        )
    if kind == "dynamic" and dims == 2:  # its base grows by a power of dims / (dims - 2)
        raise ConfigValueError("rope_scaling", "dynamic needs more than 2 rotated dimensions")
    max_positions = whole(hf, "max_position_embeddings", 2048)
    # Phi-3 keeps the trained length at the top level, and it wins there (as in transformers)
    original = hf.get("original_max_position_embeddings") or params.get(
        "original_max_position_embeddings"
    )
    original = whole({"original_max_position_embeddings": original},
                     "original_max_position_embeddings", max_positions)  # fmt: skip
    factor = params.get("factor")
    if factor is None and kind in ("yarn", "longrope"):
        factor = max_positions / original
    factor = real({"factor": factor}, "factor", 1.0, positive=True)
    values: dict[str, Any] = {"kind": kind, "factor": factor, "original_max_positions": original,
                              "max_positions": max_positions}  # fmt: skip
    for key in ("low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow"):
        if params.get(key) is not None:
            values[key] = real(params, key)
    for key in ("mscale", "mscale_all_dim", "attention_factor"):
        if params.get(key) is not None:
            values[key] = real(params, key)
    if "truncate" in params:
        values["truncate"] = flag(params, "truncate")
    if kind == "longrope":
        for key in ("short_factor", "long_factor"):
            got = params.get(key)
            if not isinstance(got, list) or len(got) != dims // 2:
                raise ConfigValueError(key, f"must be a list of {dims // 2} numbers, got {got!r}")
            values[key] = tuple(real({key: v}, key, positive=True) for v in got)
    return RopeScaling(**values)


def hf_rope(cfg, head_dim: int) -> dict[str, Any]:
    """The config.json keys of a qkv config's rotary fields, in the spelling both
    transformers 4 and 5 read (rope_theta, rope_scaling, partial_rotary_factor)."""
    out: dict[str, Any] = {"rope_theta": cfg.rope_base}
    if cfg.rope_dims is not None:
        out["partial_rotary_factor"] = cfg.rope_dims / head_dim
    s = cfg.rope_scaling
    if s is not None:
        scaling: dict[str, Any] = {"rope_type": s.kind, "factor": s.factor}
        if s.kind in ("llama3", "yarn", "longrope"):
            scaling["original_max_position_embeddings"] = s.original_max_positions
        if s.kind == "llama3":
            scaling |= {"low_freq_factor": s.low_freq_factor,
                        "high_freq_factor": s.high_freq_factor}  # fmt: skip
        if s.kind == "yarn":
            scaling |= {"beta_fast": s.beta_fast, "beta_slow": s.beta_slow,
                        "truncate": s.truncate}  # fmt: skip
            for key in ("mscale", "mscale_all_dim", "attention_factor"):
                if getattr(s, key) is not None:
                    scaling[key] = getattr(s, key)
        if s.kind == "longrope":
            scaling |= {"short_factor": list(s.short_factor), "long_factor": list(s.long_factor)}
            if s.attention_factor is not None:
                scaling["attention_factor"] = s.attention_factor
        out["rope_scaling"] = scaling
    return out

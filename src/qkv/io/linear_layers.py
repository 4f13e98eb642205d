"""Layers of linear attention in a model of another family: a trained run's BERT, GPT-2 or
Llama with Gated DeltaNet layers in place of some softmax layers (`qkv train --layers`).

No Hugging Face family holds such a model, so its config.json is the base family's with one
key more, `qkv_linear_attention`: which layers keep a memory instead of a softmax (its
`layer_types`) and the memory's sizes (a `DeltaConfig`). The linear layers' weights are
saved under their qkv names with a "qkv." prefix; the other weights keep the family's names.
transformers does not read the key: such a folder is qkv's own.

>>> from qkv.io.families import family_named
>>> family = with_linear_layers(family_named("bert"), {"model_type": "bert"})
>>> family.name  # no key: the family itself
'bert'
"""

from __future__ import annotations

import re
from dataclasses import asdict, fields, replace

import torch

from qkv.io.families import Family, Weight
from qkv.io.families.checks import ConfigValueError
from qkv.nn.delta import DeltaConfig, GatedDeltaNet

KEY = "qkv_linear_attention"
PREFIX = "qkv."  # the checkpoint names of the linear layers' weights


def with_linear_layers(family: Family, hf: dict) -> Family:
    """`family` itself, or, where config.json holds `qkv_linear_attention`, the family with
    those layers of linear attention (config both ways and weights)."""
    if KEY not in hf:
        return family
    return linear_family(family)


def linear_family(family: Family) -> Family:
    """The family whose models may have linear layers (read from and written to the
    `qkv_linear_attention` key): the same config.json and weights for the others."""

    def config(hf: dict):
        cfg = family.config({k: v for k, v in hf.items() if k != KEY})
        return cfg if KEY not in hf else _with_layers(cfg, hf[KEY])

    def hf_config(cfg) -> dict:
        if cfg.block.linear is None:
            return family.hf_config(cfg)
        plain = replace(cfg, layer_types=None, block=replace(cfg.block, linear=None))
        linear = {k: v for k, v in asdict(cfg.block.linear).items() if k != "width"}
        return {**family.hf_config(plain), KEY: {"layer_types": list(cfg.layer_types), **linear}}

    def weights(cfg) -> list[Weight]:
        if cfg.block.linear is None:
            return family.weights(cfg)
        plain = replace(cfg, layer_types=None, block=replace(cfg.block, linear=None))
        linear = [i for i, kind in enumerate(cfg.layer_types) if kind == "linear"]
        with torch.device("meta"):
            names = [name for name, _ in GatedDeltaNet(cfg.block.linear).named_parameters()]
        out, added = [], set()
        for weight in family.weights(plain):
            found = re.match(r"(.*?\bblocks\.(\d+)\.attn\.)", weight.qkv)
            if found is None or int(found[2]) not in linear:
                out.append(weight)
            elif found[1] not in added:  # the layer's softmax attention: its memory instead
                added.add(found[1])
                out += [Weight(found[1] + n, (PREFIX + found[1] + n,)) for n in names]
        missing = len(linear) - len(added)
        assert not missing, f"{family.name}'s weight map has no attention in {missing} layers"
        return out

    return replace(family, config=config, hf_config=hf_config, weights=weights)


def _with_layers(cfg, entry):
    """The qkv config with the linear layers `entry` (the config.json key's value) names."""
    if not isinstance(entry, dict):
        raise ConfigValueError(KEY, f"must be an object, got {entry!r}")
    known = {f.name for f in fields(DeltaConfig)} - {"width"}
    odd = sorted(set(entry) - known - {"layer_types"})
    if odd:
        raise ConfigValueError(KEY, f"holds keys qkv does not read: {', '.join(odd)}")
    types = entry.get("layer_types")
    if not isinstance(types, list) or not all(isinstance(t, str) for t in types):
        raise ConfigValueError(KEY, f"needs layer_types, a list of names, got {types!r}")
    try:
        linear = DeltaConfig(width=cfg.block.width, **{k: entry[k] for k in known & set(entry)})
        return replace(cfg, layer_types=tuple(types), block=replace(cfg.block, linear=linear))
    except TypeError as error:  # a size missing
        raise ConfigValueError(KEY, f"is incomplete: {error}") from None

"""Model families: one module each, holding its config.json both ways and its weight map.

A family module defines `config` (config.json -> qkv config), `hf_config` (qkv config ->
config.json, refusing by name what the family cannot hold), `weights` (the weight map, as
templates expanded by `common.expand`) and `FAMILY`. Adding a family is one module and one
line in `FAMILIES`.

>>> family_for({"model_type": "qwen2"}).name
'qwen2'
"""

from __future__ import annotations

from qkv.io.families import (
    bart,
    bert,
    deepseek,
    deepseek_v4,
    distilbert,
    gemma,
    gemma4,
    gpt2,
    gpt_oss,
    kimi_linear,
    llama,
    llama4,
    marian,
    ministral,
    modernbert,
    moe,
    neox,
    olmo2,
    olmo3,
    phi3,
    qwen,
    qwen3_5,
    qwen3_next,
    roberta,
    t5,
)
from qkv.io.families.common import Family, Weight

FAMILIES = [bert.FAMILY, gpt2.FAMILY, llama.FAMILY, bart.FAMILY]
FAMILIES += [llama.MISTRAL, llama.SMOLLM3, qwen.QWEN2, qwen.QWEN3]
FAMILIES += [roberta.FAMILY, roberta.XLM_FAMILY, distilbert.FAMILY, modernbert.FAMILY]
FAMILIES += [phi3.FAMILY, olmo2.FAMILY, neox.FAMILY]
FAMILIES += [gemma.GEMMA, gemma.GEMMA2, gemma.GEMMA3, gemma4.FAMILY]
FAMILIES += [marian.FAMILY, t5.FAMILY]
FAMILIES += [olmo3.FAMILY]
FAMILIES += [ministral.MINISTRAL, ministral.MINISTRAL3]
FAMILIES += [moe.MIXTRAL, moe.QWEN3_MOE]
FAMILIES += [llama4.FAMILY]
FAMILIES += [gpt_oss.FAMILY]
FAMILIES += [deepseek.FAMILY]
FAMILIES += [deepseek_v4.FAMILY]
FAMILIES += [qwen3_5.FAMILY, qwen3_5.MOE, qwen3_next.FAMILY]
FAMILIES += [kimi_linear.FAMILY]

bert_hf_config = bert.hf_config  # the name tests and older callers use

__all__ = ["FAMILIES", "Family", "Weight", "bert_hf_config", "family_for"]


def family_for(hf_config: dict) -> Family:
    """The family that reads a config.json, or a ValueError: why a known type is refused, or
    the types supported."""
    model_type = hf_config.get("model_type")
    for family in FAMILIES:
        if model_type in family.model_types:
            return family
    for family in FAMILIES:
        why = dict(family.refused_types).get(model_type)
        if why is not None:
            raise ValueError(why)
    supported = sorted(t for f in FAMILIES for t in f.model_types)
    raise ValueError(f"unknown model family {model_type!r}; supported: {', '.join(supported)}")


def family_named(name: str) -> Family:
    """The family called `name` ("bert", "gpt2", "llama", "bart"), as a run's model.arch."""
    for family in FAMILIES:
        if family.name == name:
            return family
    raise ValueError(f"unknown model family {name!r}; known: {', '.join(f.name for f in FAMILIES)}")

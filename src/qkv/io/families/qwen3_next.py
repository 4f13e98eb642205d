"""Qwen3-Next: Qwen3.5's decoder (qkv.io.families.qwen3_5) as it came first, with experts.

What differs from Qwen3.5:
- a linear layer's projections are fused and grouped by key head: in_proj_qkvz holds, for
  each of the linear_num_key_heads groups, its query rows, key rows, then the value rows and
  the gate rows of the value heads that read through it; in_proj_ba holds, group by group,
  their write strengths (b) then their fades (a). qkv keeps qkv's own parameters (`qkv`:
  [every query | every key | every value], `gate`, `write`, `fade`), each taken from its
  rows (`Rows`) and written back into the fused tensors on export;
- layer i's MLP is a mixture of experts iff num_experts > 0, (i + 1) % decoder_sparse_step
  == 0 and i is not in mlp_only_layers (else a dense SwiGLU of intermediate_size); the router
  renormalizes its weights with norm_topk_prob; a shared expert beside the experts, its
  output gated by a sigmoid of the token (`Experts.shared_gate`).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from qkv.io.families import qwen3_5
from qkv.io.families.checks import flag, whole
from qkv.io.families.common import Family, Rows, Weight
from qkv.io.families.moe import qwen3_moe_layers
from qkv.models import Decoder, DecoderConfig


def config(hf: dict) -> DecoderConfig:
    """A Qwen3-Next config.json -> the qkv config."""
    hidden = whole(hf, "intermediate_size", 5632)
    if whole(hf, "num_experts", 512, minimum=0) == 0:  # every MLP dense
        whole(hf, "decoder_sparse_step", 1)  # read either way, so a wrong kind fails
        return qwen3_5.read(hf, "Qwen3-Next", mlp_hidden=hidden)
    experts = qwen3_5.moe_experts(hf, normalize=flag(hf, "norm_topk_prob", True))
    cfg = qwen3_5.read(hf, "Qwen3-Next", experts=experts, mlp_hidden=hidden)
    return replace(cfg, moe_layers=qwen3_moe_layers(hf))


def hf_config(cfg: DecoderConfig) -> dict:
    """Dense layers are written as mlp_only_layers (decoder_sparse_step 1); a model without
    experts as num_experts 0."""
    experts = cfg.block.experts
    hf = qwen3_5.hf_text(cfg, "qwen3_next", "Qwen3NextForCausalLM")
    hf["intermediate_size"] = cfg.block.mlp_hidden or 4 * cfg.block.width
    if experts is None:
        qwen3_5.check("Qwen3-Next", cfg, moe_layers=None, dense_mlp_hidden=None)
        return hf | {"num_experts": 0}
    normalize = experts.routing.normalize
    qwen3_5.check("Qwen3-Next", cfg, dense_mlp_hidden=None,
                  **qwen3_5.expected_experts(experts, normalize))  # fmt: skip
    moe = cfg.moe_layers or (True,) * cfg.num_layers
    return (
        hf
        | qwen3_5.hf_experts(experts)
        | {
            "norm_topk_prob": normalize,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [i for i, m in enumerate(moe) if not m],
        }
    )


def fused_linear(n: int, cfg: DecoderConfig, name) -> list[Weight]:
    """in_proj_qkvz and in_proj_ba, each group of a key head in turn, as qkv's parameters."""
    d = cfg.block.linear
    assert d is not None
    group = d.heads // d.key_heads  # value heads per key head
    Dk, Dv = d.key_size, d.value_size
    layer, attn = f"model.layers.{n}.linear_attn", f"blocks.{n}.attn"
    q, k, v, z = qwen3_5.split_rows([Dk, Dk, group * Dv, group * Dv], d.key_heads)
    total = (2 * Dk + 2 * group * Dv) * d.key_heads
    qkvz = name(f"{layer}.in_proj_qkvz.weight")
    rows = torch.cat([q, k, v])  # [every query | every key | every value]
    out = [
        Weight(f"{attn}.qkv.weight", qkvz, rows=Rows(rows, total)),
        Weight(f"{attn}.gate.weight", qkvz, rows=Rows(z, total)),
    ]
    return out + qwen3_5.shared_rows(name(f"{layer}.in_proj_ba.weight"),
                                     [f"{attn}.write.weight", f"{attn}.fade.weight"],
                                     [group, group], d.key_heads)  # fmt: skip


def weights(cfg: DecoderConfig) -> list[Weight]:
    return qwen3_5.decoder_weights(cfg, lambda name: (name,), fused_linear)


FAMILY = Family(
    "qwen3_next", ("qwen3_next",), Decoder, config, hf_config, weights,
    ignored=qwen3_5.IGNORED, config_classes=("Qwen3NextConfig",),
    reads=(*qwen3_5.READS, *qwen3_5.MOE_READS, "intermediate_size", "norm_topk_prob",
           "decoder_sparse_step", "mlp_only_layers"),
    inert=(*qwen3_5.INERT, *qwen3_5.ROUTER_INERT),
)  # fmt: skip

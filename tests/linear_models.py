"""A tiny random decoder whose first layers keep a running memory (linear attention, the gated
delta rule) beside a softmax layer: for the tests of every view on a linear layer's record."""

from __future__ import annotations

from dataclasses import replace

import torch

import qkv
from qkv.nn.delta import DeltaConfig, GatedDeltaNet
from variant_models import decoder, tiny


def linear_model(fade: str = "head", layer_types=("linear", "linear", "full"), heads: int = 2,
                 key_heads: int = 1) -> qkv.Pretrained:  # fmt: skip
    """Linear layers of `heads` heads (Dk 8, Dv 16; by default 2 heads reading one key head,
    as Qwen3.5 shares them) and a full layer, random, with fades near 0.9 and write strengths
    well inside (0, 1), so that every word's write still shows at the last word (the test
    models' weights, times 8, would fade every memory to nothing at once)."""
    linear = DeltaConfig(width=32, heads=heads, key_heads=key_heads, key_size=8, value_size=16,
                         fade=fade, fade_rank=4 if fade == "channel" else None)  # fmt: skip
    config = replace(decoder(linear=linear), num_layers=len(layer_types),
                     layer_types=layer_types)  # fmt: skip
    pretrained = tiny(config)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for block in pretrained.model.blocks:
            if isinstance(block.attn, GatedDeltaNet):
                attn = block.attn
                for p in [*attn.fade.parameters(), *attn.write.parameters()]:
                    p.copy_(0.02 * torch.randn(p.shape, generator=generator))
                attn.fade_bias.copy_(
                    -2.0 + 0.5 * torch.randn(attn.fade_bias.shape, generator=generator)
                )
                attn.fade_log_rate.copy_(torch.linspace(-0.5, -1.5, heads))
    return pretrained


def wide_linear_model() -> qkv.Pretrained:
    """Linear layers 0 and 1 of 4 value heads (over 2 key heads) beside a full layer 2 of 2
    heads, as Qwen3.5's linear layers have more heads than its full ones: for the views'
    (layer, head) tables, NaN where a layer has fewer heads."""
    return linear_model(heads=4, key_heads=2)

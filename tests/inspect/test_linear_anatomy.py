"""What `qkv models` and `qkv explain` say of a model with linear layers: the rule in words, no
softmax scores read from a linear layer, and a cache of fixed size (the memory S), not per
token."""

from __future__ import annotations

from dataclasses import replace

from qkv.cli.info import _cache
from qkv.inspect.anatomy import anatomy, cache_bytes_per_token, layer_anatomy, state_bytes
from qkv.nn.delta import DeltaConfig
from variant_models import decoder

LINEAR = DeltaConfig(width=32, heads=4, key_heads=2, key_size=8, value_size=16)


def config(fade="head"):
    linear = replace(LINEAR, fade=fade, fade_rank=8 if fade == "channel" else None)
    return replace(decoder(linear=linear, head_dim=12), num_layers=4,
                   layer_types=("linear", "linear", "linear", "full"))  # fmt: skip


def test_a_linear_layer_is_told_as_a_running_memory():
    cfg = config()
    a = layer_anatomy(cfg, 0)
    assert a.linear == "gated delta rule, per-head fade"
    assert (a.head_dim, a.value_dim, a.scale) == (8, 16, 8**-0.5)
    assert a.rope_base is None  # no positions enter a linear layer
    full = layer_anatomy(cfg, 3)
    assert full.linear is None and full.head_dim == 12 and full.rope_base == 10000.0
    assert layer_anatomy(config("channel"), 1).linear == "gated delta rule, per-channel fade (KDA)"
    words = anatomy(cfg).attention
    assert "linear (gated delta rule, per-head fade) in 3 of 4 layers" in words
    assert anatomy(cfg).scores == "q.k / sqrt(12)"  # the softmax layer's, not a linear one's


def test_the_cache_of_a_linear_layer_is_its_memory_not_per_token():
    cfg = config()
    # the full layer alone keeps keys and values per token: 2 x 2 heads x 12, 2 bytes each
    assert cache_bytes_per_token(cfg) == 2 * 2 * 12 * 2
    per_layer = 4 * 8 * 16 + (2 * 16 + 64) * 3  # each head's S, the convolution's last inputs
    assert LINEAR.state_bytes == per_layer
    assert state_bytes(cfg) == 3 * per_layer * 2
    a = anatomy(cfg)
    assert a.state_bytes == 3 * per_layer * 2
    assert _cache(a) == "96 B + state S: 4.7 KiB"  # 4,800 bytes
    assert state_bytes(decoder()) == 0 and _cache(anatomy(decoder())) == "256 B"

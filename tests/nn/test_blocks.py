"""Encoder and decoder blocks against torch's TransformerEncoderLayer / DecoderLayer."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from qkv.nn import BlockConfig, DecoderBlock, EncoderBlock, KVCache, RotaryEmbedding

C, H, F = 32, 4, 64


def copy_attention(ours, theirs: nn.MultiheadAttention) -> None:
    ours.qkv.weight.copy_(theirs.in_proj_weight)
    ours.qkv.bias.copy_(theirs.in_proj_bias)
    ours.out.weight.copy_(theirs.out_proj.weight)
    ours.out.bias.copy_(theirs.out_proj.bias)


def copy_module(ours: nn.Module, theirs: nn.Module) -> None:
    ours.load_state_dict(theirs.state_dict())


def config(norm_position, activation):
    return BlockConfig(
        width=C,
        num_heads=H,
        mlp_hidden=F,
        mlp=activation,
        norm_position=norm_position,
        fused_qkv=True,
        backend="sdpa",
    )


@pytest.mark.parametrize("activation", ["relu", "gelu"])
@pytest.mark.parametrize("norm_position", ["pre", "post"])
def test_encoder_block_matches_transformer_encoder_layer(norm_position, activation):
    torch.manual_seed(0)
    theirs = nn.TransformerEncoderLayer(
        C, H, F, dropout=0.0, activation=activation, batch_first=True,
        norm_first=norm_position == "pre", dtype=torch.float64,
    )  # fmt: skip
    ours = EncoderBlock(config(norm_position, activation)).double()
    with torch.no_grad():
        copy_attention(ours.attn, theirs.self_attn)
        copy_module(ours.attn_norm, theirs.norm1)
        copy_module(ours.mlp_norm, theirs.norm2)
        copy_module(ours.mlp.fc_in, theirs.linear1)
        copy_module(ours.mlp.fc_out, theirs.linear2)
    x = torch.randn(2, 6, C, dtype=torch.float64)
    real = torch.ones(2, 6, dtype=torch.bool)
    real[1, 4:] = False
    want = theirs(x, src_key_padding_mask=~real)
    got, _ = ours(x, mask=real[:, None, None, :])
    torch.testing.assert_close(got[real], want[real])


@pytest.mark.parametrize("norm_position", ["pre", "post"])
def test_decoder_block_matches_transformer_decoder_layer(norm_position):
    torch.manual_seed(1)
    theirs = nn.TransformerDecoderLayer(
        C, H, F, dropout=0.0, activation="relu", batch_first=True,
        norm_first=norm_position == "pre", dtype=torch.float64,
    )  # fmt: skip
    ours = DecoderBlock(config(norm_position, "relu"), cross_attention=True).double()
    with torch.no_grad():
        copy_attention(ours.attn, theirs.self_attn)
        copy_attention(ours.cross_attn, theirs.multihead_attn)
        copy_module(ours.attn_norm, theirs.norm1)
        copy_module(ours.cross_norm, theirs.norm2)
        copy_module(ours.mlp_norm, theirs.norm3)
        copy_module(ours.mlp.fc_in, theirs.linear1)
        copy_module(ours.mlp.fc_out, theirs.linear2)
    x, memory = torch.randn(2, 5, C).double(), torch.randn(2, 8, C).double()
    memory_real = torch.ones(2, 8, dtype=torch.bool)
    memory_real[0, 5:] = False
    causal = nn.Transformer.generate_square_subsequent_mask(5, dtype=torch.float64)
    want = theirs(
        x, memory, tgt_mask=causal, tgt_is_causal=True, memory_key_padding_mask=~memory_real
    )
    got, kept, kept_cross, _ = ours(x, memory, context_mask=memory_real, record_cross=True)
    torch.testing.assert_close(got, want)
    cross = kept_cross.weights([0, 2])
    assert kept is None, "only the cross-attention's record was asked for"
    assert cross.shape == (2, 2, 5, 8) and (cross[0, :, :, 5:] == 0).all()


def test_decoder_block_cache_matches_full_forward_with_rotary_gqa_swiglu():
    torch.manual_seed(2)
    cfg = BlockConfig(
        width=C, num_heads=H, num_kv_heads=2, mlp="swiglu", norm="rmsnorm", bias=False
    )
    block = DecoderBlock(cfg, RotaryEmbedding(C // H), cross_attention=True).double()
    x, memory = torch.randn(2, 6, C).double(), torch.randn(2, 4, C).double()
    full, _, _, _ = block(x, memory)
    cache, cross_cache = KVCache(), KVCache()
    steps = [
        block(x[:, t : t + 1], memory, cache=cache, cross_cache=cross_cache)[0] for t in range(6)
    ]
    torch.testing.assert_close(torch.cat(steps, dim=1), full)


def test_decoder_block_with_cross_attention_needs_the_encoder_output():
    block = DecoderBlock(BlockConfig(width=C, num_heads=H), cross_attention=True)
    with pytest.raises(ValueError, match="pass the encoder output"):
        block(torch.randn(1, 3, C))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"width": 30, "num_heads": 4}, "not divisible"),
        ({"width": 32, "num_heads": 4, "num_kv_heads": 3}, "not a multiple"),
        ({"width": 32, "num_heads": 4, "norm_position": "middle"}, "norm_position"),
        ({"width": 32, "num_heads": 4, "dropout": 1.5}, "dropout"),
        ({"width": 32, "num_heads": 4, "norm": "batchnorm"}, "unknown norm"),
        ({"width": 32, "num_heads": 4, "mlp": "tanh"}, "unknown activation"),
    ],
)
def test_bad_block_configs_are_reported(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EncoderBlock(BlockConfig(**kwargs))

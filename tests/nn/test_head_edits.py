"""Edits of one head's own queries, keys, values, weights and inputs (`qkv.nn.head_edits`),
checked against the layer run without them and against torch's own arithmetic."""

from __future__ import annotations

import pytest
import torch

from qkv.models import Decoder, DecoderConfig
from qkv.nn import BlockConfig
from qkv.nn.edit import Edit, Swap

B, T = 2, 6


def model(**block) -> Decoder:
    torch.manual_seed(0)
    config = BlockConfig(width=24, num_heads=4, num_kv_heads=2, norm="rmsnorm", mlp="swiglu",
                         **block)  # fmt: skip
    decoder = Decoder(DecoderConfig(vocab_size=40, num_layers=2, position="rotary", block=config))
    return decoder.double().eval()


@pytest.fixture(scope="module", params=["full", "head", None, "fused"])
def run(request):
    """A "full" QK-norm runs each head's input through the layer's whole chain; the others
    take each head's own rows of the matrices (`head_edits._own_slices`), of one fused
    matrix too."""
    fused = request.param == "fused"
    decoder = model(qk_norm=None if fused else request.param, fused_qkv=fused)
    ids = torch.randint(0, 40, (B, T), generator=torch.Generator().manual_seed(1))
    out = decoder(ids, layers="all", hidden_states=True)
    return decoder, ids, out


def test_zero_head_inputs_and_own_swaps_change_nothing(run):
    decoder, ids, out = run
    record = out.records[1]
    zeros = torch.zeros(B, T, 4, 24, dtype=torch.float64)
    every = torch.ones(1, 4, 1, 1, dtype=torch.bool)
    for edit in (
        Edit(q_input=zeros, k_input=zeros, v_input=zeros),
        Edit(q=Swap(every, record.q), k=Swap(every, record.k.repeat_interleave(2, 1))),
        Edit(weights=Swap(every, record.weights())),
        Edit(head_add=torch.zeros(()), mlp_add=torch.zeros(())),
    ):
        edited = decoder(ids, edits={1: edit}).logits
        torch.testing.assert_close(edited, out.logits, rtol=0, atol=1e-12)


def test_the_same_input_for_every_head_is_the_stream_changed_for_attention_only(run):
    """q, k and v inputs of every head moved by one delta: attention reads x + delta, the
    residual stream stays x: the block's attention output equals the layer run on x + delta."""
    decoder, ids, out = run
    delta = torch.randn(B, T, 24, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    per_head = delta[:, :, None, :].expand(B, T, 4, 24)
    edited = decoder(ids, edits={1: Edit(q_input=per_head, k_input=per_head, v_input=per_head)},
                     layers=[1])  # fmt: skip
    block = decoder.blocks[1]
    rotation = decoder.rotary.rotation_for(
        decoder.rotary.rotations(torch.arange(T), torch.float64), 1
    )
    expected, _ = block.attn(block.attn_norm(out.hidden_states[1] + delta), causal=True,
                             rotation=rotation)  # fmt: skip
    torch.testing.assert_close(edited.records[1].attn_out, expected, rtol=0, atol=1e-12)


def test_one_query_heads_keys_change_it_alone_under_grouped_query_attention(run):
    decoder, ids, out = run
    record = out.records[0]
    keys = record.k.repeat_interleave(2, 1).clone()  # (B, H, T, D): heads 0, 1 share KV head 0
    keys[:, 0] = torch.randn_like(keys[:, 0])
    where = torch.tensor([True, False, False, False])[None, :, None, None]
    edited = decoder(ids, edits={0: Edit(k=Swap(where, keys))}, layers=[0]).records[0]
    changed = (edited.out - record.out).abs().amax(dim=(0, 2, 3))
    assert changed[0] > 1e-3 and torch.all(changed[1:] == 0)
    # head 0's output is softmax(q k'^T / sqrt(D)) v, computed here by torch
    q, v = record.q[:, 0], record.v[:, 0]
    scores = q @ keys[:, 0].transpose(-1, -2) * record.scale
    scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    torch.testing.assert_close(edited.out[:, 0], scores.softmax(-1) @ v, rtol=0, atol=1e-12)


def test_weights_swap_gives_weights_times_values(run):
    decoder, ids, out = run
    record = out.records[1]
    weights = torch.rand(B, 4, T, T, dtype=torch.float64).tril()
    where = torch.tensor([False, False, True, False])[None, :, None, None]
    edited = decoder(ids, edits={1: Edit(weights=Swap(where, weights))}, layers=[1]).records[1]
    # the record keeps what attend returned; the layer's output is the swapped one
    torch.testing.assert_close(edited.out, record.out, rtol=0, atol=0)
    values = record.v[:, 1]  # query head 2 reads key/value head 1
    D = values.shape[-1]
    out_proj = decoder.blocks[1].attn.out.weight  # (C, H*D): head 2's columns 2D..3D
    change = (weights[:, 2] @ values - record.out[:, 2]) @ out_proj[:, 2 * D : 3 * D].T
    torch.testing.assert_close(edited.attn_out, record.attn_out + change, rtol=0, atol=1e-12)
    assert change.abs().max() > 1e-3


def test_mlp_values_replace_and_mlp_add_adds(run):
    decoder, ids, out = run
    record = out.records[0]
    values = torch.randn(B, T, 24, dtype=torch.float64)
    where = torch.zeros(B, T, dtype=torch.bool)
    where[:, 3] = True
    edited = decoder(ids, edits={0: Edit(mlp=where, mlp_values=values)}, layers=[0]).records[0]
    torch.testing.assert_close(edited.mlp_out[:, 3], values[:, 3], rtol=0, atol=0)
    torch.testing.assert_close(edited.mlp_out[:, :3], record.mlp_out[:, :3], rtol=0, atol=0)
    added = decoder(ids, edits={0: Edit(mlp_add=values)}, layers=[0]).records[0]
    torch.testing.assert_close(added.mlp_out, record.mlp_out + values, rtol=0, atol=1e-12)


def test_the_sublayer_outputs_sum_to_the_stream(run):
    _, _, out = run
    for layer in range(2):
        record = out.records[layer]
        total = out.hidden_states[layer] + record.attn_out + record.mlp_out
        torch.testing.assert_close(total, out.hidden_states[layer + 1], rtol=0, atol=1e-12)


def test_refused_by_name():
    with pytest.raises(ValueError, match="Swap"):
        Edit(q=torch.zeros(1))
    with pytest.raises(ValueError, match=r"\(B, T, H, C\)"):
        Edit(q_input=torch.zeros(2, 3))
    with pytest.raises(ValueError, match="mlp_values needs"):
        Edit(mlp_values=torch.zeros(1))
    decoder, ids = model(), torch.tensor([[1, 2, 3]])
    cache = decoder.new_cache()
    zeros = torch.zeros(1, 3, 4, 24, dtype=torch.float64)
    with pytest.raises(ValueError, match="without a cache"):
        decoder(ids, cache=cache, edits={0: Edit(k_input=zeros)})

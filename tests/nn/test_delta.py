"""The linear-attention layer (Gated DeltaNet, KDA) inside a decoder: its record's effective
weights reproduce its heads' reads and equal the loop's steps, decoding from its memory equals
the whole text at once, left padding changes nothing, a hidden pair is a write the query's
memory never got, and the memory a cache keeps does not grow with the text."""

from __future__ import annotations

import pytest
import torch

from qkv.attention.linear import delta_rule
from qkv.models.config import DecoderConfig
from qkv.models.decoder import Decoder
from qkv.nn import BlockConfig
from qkv.nn.delta import DeltaConfig, GatedDeltaNet, MemoryCache
from qkv.nn.edit import Edit

KINDS = {
    "gated deltanet": dict(fade="head", gate="silu"),
    "kda": dict(fade="channel", fade_rank=8, gate="sigmoid", gate_rank=6),
}


def _decoder(kind: str, seed: int = 0) -> Decoder:
    linear = DeltaConfig(width=32, heads=4, key_heads=2, key_size=8, value_size=6, **KINDS[kind])
    block = BlockConfig(width=32, num_heads=4, num_kv_heads=2, mlp="swiglu", norm="rmsnorm",
                        bias=False, linear=linear)  # fmt: skip
    config = DecoderConfig(vocab_size=50, num_layers=3, block=block, position="rotary",
                           layer_types=("linear", "full", "linear"))  # fmt: skip
    torch.manual_seed(seed)
    model = Decoder(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
        for block in model.blocks:  # slow fades, so that a word stays in the memory a while
            if isinstance(block.attn, GatedDeltaNet):
                block.attn.fade_log_rate.fill_(-3.0)
    return model


@pytest.mark.parametrize("kind", KINDS)
def test_a_linear_layers_record_gives_effective_weights_that_reproduce_its_reads(kind):
    model = _decoder(kind)
    ids = torch.randint(0, 50, (2, 75), generator=torch.Generator().manual_seed(1))
    out = model(ids, layers="all")
    record = out.records[2]
    assert record.linear is not None and not record.plain and out.records[1].linear is None
    weights = record.weights()
    assert weights.shape == (2, 4, 75, 75) and weights.dtype == torch.float32
    torch.testing.assert_close(weights @ record.v, record.out, atol=1e-6, rtol=0)
    assert bool((weights.triu(1) == 0).all())
    assert (weights.sum(-1) - 1).abs().max() > 1e-3  # no softmax: rows need not sum to 1
    for head, query in ((0, 0), (3, 70)):
        steps = record.steps(head=head, query=query, batch=1)
        torch.testing.assert_close(steps.weights.float(), weights[1, head, query, : query + 1],
                                   atol=1e-6, rtol=0)  # fmt: skip
        torch.testing.assert_close(steps.contextualized.float(), record.out[1, head, query],
                                   atol=1e-6, rtol=0)  # fmt: skip
    assert record.weights([1, 3]).shape == (2, 2, 75, 75)


@pytest.mark.parametrize("kind", KINDS)
def test_decoding_from_the_memory_equals_the_whole_text(kind):
    model = _decoder(kind)
    ids = torch.randint(0, 50, (2, 80), generator=torch.Generator().manual_seed(2))
    whole = model(ids).logits
    cache = model.new_cache()
    assert isinstance(cache.layers[0], MemoryCache) and not isinstance(cache.layers[1], MemoryCache)
    parts = [model(ids[:, :66], cache=cache).logits]
    kept = cache.layers[0].numel()
    for t in range(66, 80):
        parts.append(model(ids[:, t : t + 1], cache=cache).logits)
    assert cache.layers[0].numel() == kept == 2 * model.config.block.linear.state_bytes
    assert cache.length == 80
    torch.testing.assert_close(torch.cat(parts, 1), whole, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("kind", KINDS)
def test_a_left_padded_row_is_the_row_alone(kind):
    model = _decoder(kind)
    ids = torch.randint(1, 50, (1, 70), generator=torch.Generator().manual_seed(3))
    alone = model(ids).logits
    padded = torch.cat([torch.zeros(1, 4, dtype=torch.long), ids], 1)
    mask = torch.cat([torch.zeros(1, 4), torch.ones(1, 70)], 1).long()
    got = model(padded, attention_mask=mask).logits[:, 4:]
    torch.testing.assert_close(got, alone, atol=1e-4, rtol=1e-5)


def test_a_hidden_pair_is_a_write_the_querys_memory_never_got():
    model = _decoder("gated deltanet")
    ids = torch.randint(0, 50, (1, 40), generator=torch.Generator().manual_seed(4))
    hide = torch.zeros(1, 4, 40, 40, dtype=torch.bool)
    hide[:, 2, 30:35, 5:8] = True  # head 2's queries 30-34 do not read keys 5-7
    clean = model(ids, layers=[0]).records[0]
    edited = model(ids, layers=[0], edits={0: Edit(hide=hide)}).records[0]
    torch.testing.assert_close(edited.q, clean.q)  # the first layer's inputs are unchanged
    beta = clean.linear.beta.clone()
    beta[:, 2, 5:8] = 0  # apart: keys 5-7 never written in head 2
    apart = delta_rule(clean.q, clean.k, clean.v, beta=beta, decay=clean.linear.decay).out
    torch.testing.assert_close(edited.out[:, 2, 30:35], apart[:, 2, 30:35], atol=1e-6, rtol=0)
    torch.testing.assert_close(edited.out[:, :2], clean.out[:, :2], atol=1e-6, rtol=0)
    assert (edited.out[:, 2, 30:35] - clean.out[:, 2, 30:35]).abs().max() > 1e-4
    weights = edited.weights()
    assert bool((weights[:, 2, 30:35, 5:8] == 0).all())
    torch.testing.assert_close(weights @ edited.v, edited.out, atol=1e-6, rtol=0)


def test_bad_linear_configs_are_refused_by_name():
    with pytest.raises(ValueError, match="not a multiple of its 3 key heads"):
        DeltaConfig(width=8, heads=4, key_heads=3, key_size=2, value_size=2)
    with pytest.raises(ValueError, match="fade is per"):
        DeltaConfig(width=8, heads=4, key_heads=2, key_size=2, value_size=2, fade="token")
    block = BlockConfig(width=8, num_heads=2)
    with pytest.raises(ValueError, match="linear layers need the block's linear attention"):
        DecoderConfig(vocab_size=5, num_layers=1, block=block, layer_types=("linear",))
    layer = GatedDeltaNet(DeltaConfig(width=8, heads=2, key_heads=2, key_size=2, value_size=2))
    with pytest.raises(ValueError, match="linear attention is causal"):
        layer(torch.randn(1, 3, 8), causal=False)
    with pytest.raises(ValueError, match="linear attention is self-attention"):
        BlockConfig(width=8, num_heads=2, linear=layer.config).attention(cross=True)

"""The three model shapes: cached decoding, padding, recorded weights, positions."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from qkv.models import (
    Decoder,
    DecoderConfig,
    Encoder,
    EncoderConfig,
    EncoderDecoder,
    EncoderDecoderConfig,
)
from qkv.nn import BlockConfig

LLAMA_LIKE = DecoderConfig(
    vocab_size=61,
    num_layers=3,
    position="rotary",
    rope_base=1000.0,
    block=BlockConfig(
        width=48, num_heads=6, num_kv_heads=2, mlp="swiglu", mlp_hidden=80,
        norm="rmsnorm", norm_eps=1e-6, bias=False,
    ),
)  # fmt: skip
GPT_LIKE = DecoderConfig(
    vocab_size=61,
    num_layers=2,
    position="learned",
    max_positions=64,
    block=BlockConfig(width=32, num_heads=4, mlp="gelu_tanh", fused_qkv=True),
)
BERT_LIKE = EncoderConfig(
    vocab_size=61,
    num_layers=2,
    type_vocab_size=2,
    embed_norm=True,
    block=BlockConfig(width=32, num_heads=4, norm_position="post", norm_eps=1e-12),
)
ORIGINAL = EncoderDecoderConfig(
    vocab_size=61,
    encoder_layers=2,
    decoder_layers=2,
    block=BlockConfig(width=32, num_heads=4, norm_position="post", mlp="relu"),
)


def with_backend(config, backend):
    return replace(config, block=replace(config.block, backend=backend))


def build(cls, config, seed=0):
    torch.manual_seed(seed)
    return cls(config).double().eval()


@pytest.mark.parametrize("config", [LLAMA_LIKE, GPT_LIKE], ids=["llama", "gpt"])
def test_decoding_with_the_cache_equals_the_full_forward(config):
    model = build(Decoder, config)
    ids = torch.randint(0, 61, (2, 21))
    full = model(ids).logits
    cache = model.new_cache()
    logits = [model(ids[:, :4], cache=cache).logits]
    logits += [model(ids[:, t : t + 1], cache=cache).logits for t in range(4, 21)]
    torch.testing.assert_close(torch.cat(logits, dim=1), full)
    assert cache.length == 21


def test_left_padded_batch_with_positions_matches_each_sequence_alone():
    model = build(Decoder, LLAMA_LIKE)
    short, long = torch.randint(0, 61, (1, 3)), torch.randint(0, 61, (1, 5))
    ids = torch.cat([torch.cat([torch.zeros(1, 2, dtype=torch.long), short], 1), long])
    real = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    positions = (real.cumsum(1) - 1).clamp(min=0)  # each sequence counts from its first token
    logits = model(ids, attention_mask=real, positions=positions).logits
    torch.testing.assert_close(logits[0, 2:], model(short).logits[0])
    torch.testing.assert_close(logits[1], model(long).logits[0])


def test_encoder_decoder_decodes_step_by_step_like_the_full_forward():
    model = build(EncoderDecoder, ORIGINAL)
    source, target = torch.randint(0, 61, (2, 7)), torch.randint(0, 61, (2, 6))
    source_mask = torch.ones(2, 7, dtype=torch.long)
    source_mask[1, 5:] = 0
    full = model(source, target, source_mask=source_mask).logits
    encoded = model.read_source(source, source_mask=source_mask)
    cache = model.new_cache()
    steps = [
        model(source, target[:, t : t + 1], source_mask=source_mask, encoded=encoded, cache=cache)
        for t in range(6)
    ]
    torch.testing.assert_close(torch.cat([s.logits for s in steps], 1), full)
    assert model.decoder.lm_head.weight is model.encoder.embed.tokens.weight


def test_padding_does_not_change_the_real_tokens_of_an_encoder():
    model = build(Encoder, BERT_LIKE)
    ids = torch.randint(1, 61, (1, 5))
    padded = torch.cat([ids, torch.zeros(1, 3, dtype=torch.long)], 1)
    real = torch.tensor([[1] * 5 + [0] * 3])
    alone = model(ids).hidden
    together = model(padded, attention_mask=real).hidden
    torch.testing.assert_close(together[:, :5], alone)


@pytest.mark.parametrize(("position", "equivariant"), [("none", True), ("learned", False)])
def test_an_encoder_without_positions_cannot_tell_word_order(position, equivariant):
    model = build(Encoder, replace(BERT_LIKE, position=position, type_vocab_size=0))
    ids = torch.randint(0, 61, (1, 6))
    order = torch.tensor([3, 0, 5, 1, 4, 2])
    out = model(ids).hidden
    permuted = model(ids[:, order]).hidden
    assert torch.allclose(permuted, out[:, order], atol=1e-10) == equivariant


@pytest.mark.parametrize("backend", ["loop", "eager", "sdpa", "auto"])
def test_recorded_weights_are_the_eager_weights_whatever_the_backend(backend):
    ids, real = torch.randint(0, 61, (2, 6)), torch.tensor([[1] * 6, [1] * 4 + [0] * 2])
    eager = build(Decoder, with_backend(LLAMA_LIKE, "eager"))
    model = build(Decoder, with_backend(LLAMA_LIKE, backend))
    want = eager(ids, attention_mask=real, layers=[0, 2])
    got = model(ids, attention_mask=real, layers=[2, 0])
    assert sorted(got.records) == [0, 2]
    torch.testing.assert_close(got.logits, want.logits)
    for layer, heads in ((0, [0]), (2, [5, 1])):
        weights = got.records[layer].weights(heads)
        assert weights.shape == (2, len(heads), 6, 6)
        # float64 throughout: the backends' round-off before layer 2 is of order 1e-16
        torch.testing.assert_close(weights, want.records[layer].weights(heads), rtol=0, atol=1e-12)
        assert (weights.triu(1) == 0).all(), "a decoder never attends to later tokens"
        torch.testing.assert_close(weights.sum(-1), torch.ones(2, len(heads), 6).to(weights))


def test_encoder_decoder_records_all_three_kinds_of_attention():
    model = build(EncoderDecoder, ORIGINAL)
    out = model(
        torch.randint(0, 61, (1, 7)),
        torch.randint(0, 61, (1, 4)),
        encoder_layers=[1],
        layers=[0],
        cross_layers="all",
    )
    assert list(out.encoder_records) == [1] and list(out.decoder_records) == [0]
    assert list(out.cross_records) == list(range(ORIGINAL.decoder_layers))
    assert out.encoder_records[1].weights([2]).shape == (1, 1, 7, 7)
    assert out.decoder_records[0].weights([0]).shape == (1, 1, 4, 4)
    assert out.cross_records[1].weights([3]).shape == (1, 1, 4, 7)
    assert out.decoder_records[0].causal and not out.cross_records[1].causal


def test_layers_and_heads_out_of_range_say_how_many_there_are():
    model = build(Encoder, BERT_LIKE)
    ids = torch.randint(0, 61, (1, 3))
    with pytest.raises(
        ValueError, match=r"layer 2 is out of range: the model has 2 layers \(0-1\)"
    ):
        model(ids, layers=[2])
    with pytest.raises(ValueError, match=r"head 4 is out of range: this layer has 4 heads \(0-3\)"):
        model(ids, layers=[0]).records[0].weights([4])
    with pytest.raises(ValueError, match="layers must be layer indices or 'all', got 'every'"):
        model(ids, layers="every")
    with pytest.raises(ValueError, match="needs a decoder with cross-attention"):
        build(Decoder, GPT_LIKE)(ids, cross_layers=[0])
    with pytest.raises(ValueError, match="position must be"):
        replace(BERT_LIKE, position="absolute")


def test_a_few_training_steps_learn_to_copy():
    """The matrices are learned: gradient descent lowers the loss of a tiny copy task."""
    torch.manual_seed(4)
    model = Decoder(replace(GPT_LIKE, num_layers=1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ids = torch.randint(0, 61, (16, 8))
    ids = torch.cat([ids, ids], dim=1)  # the second half repeats the first

    def loss():
        logits = model(ids[:, :-1]).logits
        return torch.nn.functional.cross_entropy(logits[:, 8:].flatten(0, 1), ids[:, 9:].flatten())

    first = loss().item()
    for _ in range(60):
        optimizer.zero_grad()
        loss().backward()
        optimizer.step()
    assert loss().item() < 0.5 * first

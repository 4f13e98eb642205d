"""`qkv explain` tells what the families of late 2026 do at the step where they do it: the
share a learned sink takes, the query's temperature, the chunk boundary as the reason a weight
is 0, latent keys and values, and which experts the query token went to; and the steps stay
the model's own computation."""

from __future__ import annotations

import math

import pytest
import torch

import qkv
from qkv.nn.experts import Experts
from qkv.nn.latent import LatentConfig
from qkv.nn.position import Temperature
from qkv.nn.routing import Routing
from qkv.viz.narrate import heads_and_layers, narrate
from variant_models import TEXT, decoder, tiny


def explained(pretrained, layer=0, query="deep", key="bank"):
    traced = qkv.trace(pretrained, TEXT, query, key, layer=layer, head=1)
    torch.testing.assert_close(traced.contextualized, traced.model_output, atol=1e-5, rtol=0)
    return traced, narrate(traced) + "\n" + heads_and_layers(traced)


@pytest.fixture(scope="module")
def sunk():
    model = tiny(decoder(sinks=True, experts=Experts(Routing(4, 2), hidden=8)))
    with torch.no_grad():
        for block in model.model.blocks:
            block.attn.sinks.copy_(torch.tensor([0.0, 3.0]))
    return model


def test_the_sinks_share_is_told_and_the_words_share_the_rest(sunk):
    traced, text = explained(sunk)
    assert 0.0 < traced.sink_weight < 1.0
    assert math.isclose(traced.sink_weight + float(traced.weights.sum()), 1.0, rel_tol=1e-5)
    took = f"{100 * traced.sink_weight:.1f}%"
    rest = f"{100 * (1 - traced.sink_weight):.1f}%"
    assert f'the sink took {took} of "deep"\'s attention; the words share the other {rest}' in text
    assert "this head's learned sink (+3.0000)" in text


def test_the_experts_the_query_token_went_to_are_told(sunk):
    traced, text = explained(sunk)
    seen = sunk.attentions(TEXT)
    record = seen.experts[0]
    chosen = record.experts[0, 8].tolist()  # "deep" is token 8
    assert traced.experts == record.describe(0, 8)
    assert f"went to experts {chosen[0]} and {chosen[1]}" in text
    assert "is a mixture of experts" in text


def test_a_chunk_boundary_is_told_as_the_reason_a_weight_is_0():
    traced, text = explained(tiny(decoder(chunk=4, layer_types=("chunked", "full"))))
    assert (traced.query_chunk, traced.key_chunk, traced.weight) == (2, 0, 0.0)
    assert "cuts the text into chunks of 4 tokens" in text
    assert '"bank" is in chunk 0, "deep" in chunk 2: the chunk boundary hides it' in text
    full, words = explained(tiny(decoder(chunk=4, layer_types=("chunked", "full"))), layer=1)
    assert full.chunk is None and full.weight > 0 and "chunk" not in words


def test_the_querys_temperature_is_told_where_it_multiplies_the_score():
    traced, text = explained(tiny(decoder(temperature=Temperature(0.5, 2.0))))
    assert traced.temperature == pytest.approx(1 + 0.5 * math.log(1 + 4))  # position 8
    assert traced.score == pytest.approx(traced.scaled_scalar * traced.temperature, rel=1e-9)
    assert f"Times deep's temperature {traced.temperature:.4f}" in text


def test_latent_attention_says_where_keys_and_values_come_from():
    latent = LatentConfig(32, 2, kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4,
                          v_head_dim=6)  # fmt: skip
    traced, text = explained(tiny(decoder(latent=latent)))
    assert traced.head_dim == 12 and traced.value_vector.numel() == 6
    assert "keys and values come from one 12-number vector per token" in text
    assert "their 6-number outputs are concatenated into 2 x 6 = 12 numbers" in text

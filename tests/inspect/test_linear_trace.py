"""A trace and `qkv explain` on a linear layer (a running memory, the gated delta rule): the
steps are the memory's, the weights the record's effective weights, and no word claims a
softmax happened."""

from __future__ import annotations

import math

import pytest
import torch

import qkv
from linear_models import linear_model
from qkv.inspect.records import why_not_redone
from qkv.viz.narrate import contributions, heads_and_layers, narrate
from variant_models import TEXT

SOFTMAX_WORDS = ("Softmax", "softmax over", "sum to 100%", "Attention scalar",
                 "keeps softmax from saturating", "The softmax reads")  # fmt: skip


@pytest.fixture(scope="module")
def model():
    return linear_model()


def told(pretrained, query="deep", key="bank", layer=1, head=1):
    traced = qkv.trace(pretrained, TEXT, query, key, layer=layer, head=head)
    text = "\n".join([narrate(traced), heads_and_layers(traced), contributions(traced)])
    return traced, text


def test_the_steps_are_the_memorys_and_the_weights_the_records(model):
    traced, text = told(model)
    record = model.attentions(TEXT).records[1]
    expected = record.weights([1])[0, 0, 8]  # "deep" is token 8, "bank" token 1
    torch.testing.assert_close(traced.weights, expected.float(), atol=1e-6, rtol=0)
    assert traced.linear == "head" and traced.weight != 0.0
    torch.testing.assert_close(traced.contextualized, traced.model_output, atol=1e-5, rtol=0)
    # the weight is the key word's write strength times the query carried back to its key
    beta = float(record.linear.beta[0, 1, 1])
    assert traced.write_strength == pytest.approx(beta, rel=1e-6)
    assert traced.write_strength * traced.carried == pytest.approx(traced.weight, rel=1e-6)
    # the fades of the words after "bank", up to "deep", multiplied
    fades = record.linear.decay[0, 1, 2:9].double().exp().prod()
    assert traced.fade == pytest.approx(float(fades), rel=1e-6)
    w = traced.weight
    assert (f'4. No softmax: the effective weight of "bank" for "deep" is {w:+.4f}, what the '
            'memory returns of "bank"\'s value') in text  # fmt: skip
    assert 'when "deep"\'s query reads it' in text
    assert f'so "deep" reads {beta:.4f} x {traced.carried:+.4f} = {w:+.4f}' in text
    assert f"leave {100 * float(fades):.1f}% of it" in text
    assert "linear attention, the gated delta rule, one fade per head" in text
    for words in SOFTMAX_WORDS:
        assert words not in text, words
    torch.testing.assert_close(traced.scaled_value_vector, w * traced.value_vector)


def test_a_per_channel_fade_is_told_and_the_steps_stay_the_models():
    traced, text = told(linear_model(fade="channel"), layer=0, head=0, key="river")
    assert traced.linear == "channel"
    assert "one fade per key channel (KDA)" in text
    torch.testing.assert_close(traced.contextualized, traced.model_output, atol=1e-5, rtol=0)
    assert traced.write_strength * traced.carried == pytest.approx(traced.weight, rel=1e-6)


def test_a_key_after_the_query_has_weight_0_because_nothing_was_written(model):
    traced, text = told(model, query="bank", key="river")
    assert traced.weight == 0.0 and traced.masked and traced.write_strength is None
    assert '"river" comes after "bank": the memory "bank" reads holds nothing of it yet' in text
    assert float(traced.weights[3:].abs().sum()) == 0.0


def test_the_full_layer_beside_them_is_still_a_softmax(model):
    traced, text = told(model, layer=2, head=0)
    assert traced.linear is None
    assert math.isclose(float(traced.weights.sum()), 1.0, rel_tol=1e-5)
    assert "4. Softmax over every key word" in text


def test_readers_of_q_and_k_refuse_a_linear_layer_by_name(model):
    records = model.attentions(TEXT).records
    assert "keeps a running memory (linear attention)" in why_not_redone(records)
    with pytest.raises(ValueError, match="keeps a running memory"):
        qkv.inspect.trace.attention_vectors(model, TEXT)

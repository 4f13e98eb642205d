"""`qkv explain` tells, at the step where it happens, what a model does differently from the
article: its scale, soft-cap, window, score bias, QK-norm, partial or scaled rotary, and
sub-layer norms or parallel blocks; and the steps stay the model's own computation."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
import torch
import transformers
from tokenizers import Tokenizer as Backend
from tokenizers import models, pre_tokenizers

import qkv
from qkv.io.hf_folder import load_folder
from qkv.io.tokenizer import Tokenizer
from qkv.models import EncoderConfig
from qkv.nn import BlockConfig
from qkv.nn.rope import RopeScaling
from qkv.viz.narrate import heads_and_layers, narrate
from variant_models import TEXT, WORDS, decoder, tiny
from variant_models import gemma2_like as gemma2_like_config


def explained(pretrained, layer, query="deep", key="bank"):
    traced = qkv.trace(pretrained, TEXT, query, key, layer=layer, head=1)
    # the steps are still the model's computation, whatever the variant
    torch.testing.assert_close(traced.contextualized, traced.model_output, atol=1e-6, rtol=0)
    return traced, narrate(traced) + "\n" + heads_and_layers(traced)


@pytest.fixture(scope="module")
def gemma2_like():
    return tiny(gemma2_like_config())


def test_the_scale_soft_cap_and_window_are_told_where_they_act(gemma2_like):
    traced, text = explained(gemma2_like, layer=0)
    assert "Divided by sqrt(144) = 12.000, not sqrt(16): this model's own scale" in text
    assert "Divided by sqrt(16)" not in text
    capped = 0.02 * math.tanh(traced.scaled_scalar / 0.02)
    assert traced.score == pytest.approx(capped, abs=1e-12)
    assert abs(traced.score - traced.scaled_scalar) > 1e-3  # the cap is seen to act
    assert f"Capped to 0.02 tanh(s/0.02) = {capped:+.4f}" in text
    assert f"The softmax reads this score: {traced.score:+.4f}" in text
    assert "Softmax over every key word's score" in text
    assert "keys 3 or more tokens back are hidden (weight 0)" in text
    assert '"bank" is 7 tokens back: outside the window, so its weight is 0.' in text
    assert traced.weight == 0.0 and traced.outside_window and "causal mask" not in text
    assert "normalized (this model norms each sub-layer's output)" in text


def test_a_full_layer_of_a_sliding_model_has_no_window_and_the_logits_cap_is_told(gemma2_like):
    traced, text = explained(gemma2_like, layer=1)
    assert traced.window is None and traced.weight > 0 and "window" not in text
    assert "this is the last layer." in text
    assert "Its logits are capped to 30 tanh(x/30)" in text


def test_a_key_after_the_query_is_hidden_by_the_causal_mask_not_the_window(gemma2_like):
    traced, text = explained(gemma2_like, layer=0, query="bank", key="deep")
    assert not traced.outside_window and traced.weight == 0.0
    assert '"deep" comes after "bank": in a decoder the causal mask hides it' in text


def test_a_model_that_does_not_divide_says_so():
    traced, text = explained(tiny(decoder(attn_scale=1.0)), layer=0)
    assert traced.scale == 1.0 and traced.scaled_scalar == traced.attention_scalar
    assert "This model does not divide at all (the article divides by sqrt(16))" in text


def test_qk_norm_partial_and_scaled_rotary_and_parallel_blocks_are_told():
    config = replace(decoder(qk_norm="head", parallel=True), rope_dims=8,
                     rope_scaling=RopeScaling("linear", factor=2.0))  # fmt: skip
    traced, text = explained(tiny(config), layer=0)
    assert "normalizes each query and key first (QK-norm, over each head's 16 numbers)" in text
    assert "Only the first 8 of the 16 numbers turn (partial rotary)" in text
    assert "The angles are rescaled (linear x2)" in text
    assert "attention and the MLP read the same normalized input, side by side" in text
    # the rest of the head was not turned: before and after rotary agree there
    torch.testing.assert_close(traced.query_vector[8:], traced.query_unrotated[8:])
    assert not torch.allclose(traced.query_vector[:8], traced.query_unrotated[:8])


def test_norms_only_on_sub_layer_outputs_are_told():
    config = decoder(norm="rmsnorm", norm_position="none", sublayer_norm=True, qk_norm="full")
    _, text = explained(tiny(config), layer=0)
    assert "norms each sub-layer's output, not its\ninput" in text
    assert "QK-norm, over all heads' numbers" in text


def test_an_encoder_window_looks_both_ways():
    config = EncoderConfig(
        vocab_size=len(WORDS),
        num_layers=1,
        position="learned",
        max_positions=16,
        block=BlockConfig(width=32, num_heads=2, window=2),
    )
    traced, text = explained(tiny(config), layer=0, query="river", key="bank")  # fmt: skip
    assert "keys 2 or more tokens away are hidden (weight 0)" in text
    assert '"bank" is 3 tokens away: outside the window' in text and traced.weight == 0.0
    assert "this is the last layer." in text and "with its own query" not in text


def test_a_score_bias_is_added_before_the_softmax_and_told(gemma2_like):
    # a bias on a layer without relative positions is told as the layer's own (T5's below)
    traced, _ = explained(gemma2_like, layer=1)
    assert not traced.anatomy.relative_bias  # every config has relative_buckets: not a bias
    a = replace(traced.anatomy, relative_bias=True)
    with_bias = replace(traced, bias=0.25, score=traced.score + 0.25, anatomy=a)
    text = narrate(with_bias)
    capped = 0.02 * math.tanh(traced.scaled_scalar / 0.02)
    assert f"Plus a learned bias for the distance between the words: +0.2500, so " \
           f"{capped + 0.25:+.4f}" in text  # fmt: skip
    assert "this layer's score bias" in narrate(replace(with_bias, anatomy=traced.anatomy))


# T5's shape, small: 8 distance buckets up to 16 tokens, d_kv 8, no division of the scores
T5_TINY = dict(vocab_size=len(WORDS), d_model=32, d_kv=8, d_ff=37, num_layers=2,
               num_decoder_layers=2, num_heads=4, relative_attention_num_buckets=8,
               relative_attention_max_distance=16, decoder_start_token_id=0)  # fmt: skip


@pytest.fixture(scope="module")
def tiny_t5(tmp_path_factory):
    """transformers' tiny random T5, and qkv's loading of it with a tokenizer of WORDS."""
    folder = tmp_path_factory.mktemp("t5")
    torch.manual_seed(0)
    theirs = transformers.T5ForConditionalGeneration(transformers.T5Config(**T5_TINY)).eval()
    theirs.save_pretrained(folder)
    model, family, config, hf_config = load_folder(folder, torch.float32, "eager")
    backend = Backend(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    ours = qkv.Pretrained(model, Tokenizer(backend), config, family=family,
                          hf_config=hf_config, source="tiny-t5")  # fmt: skip
    return theirs, ours


def test_t5s_distance_bias_is_told_as_the_score_the_softmax_reads(tiny_t5):
    theirs, ours = tiny_t5
    model = ours.model
    # the encoder's self-attention, where T5 adds its bias, as a model of its own
    encoder = qkv.Pretrained(model.encoder, ours.tokenizer, model.encoder.config,
                             family=ours.family, hf_config=ours.hf_config,
                             source="tiny-t5 encoder")  # fmt: skip
    traced, text = explained(encoder, layer=1)  # the first layer's table serves every layer
    T = len(TEXT.split())
    with torch.no_grad():  # transformers' own bias for this pair: (1, H, T, T)
        table = theirs.encoder.block[0].layer[0].SelfAttention.compute_bias(T, T)
    want = float(table[0, 1, traced.query_index, traced.key_index])
    assert traced.bias == pytest.approx(want, abs=1e-6) and abs(want) > 1e-3
    assert traced.score == pytest.approx(traced.scaled_scalar + traced.bias, abs=1e-9)
    assert traced.anatomy.relative_bias and traced.scale == 1.0
    assert "This model does not divide at all" in text
    assert (f"Plus a learned bias for the distance between the words: {traced.bias:+.4f}, so "
            f"{traced.score:+.4f}") in text  # fmt: skip
    assert f"The softmax reads this score: {traced.score:+.4f}" in text
    # T5's cross-attention has no bias, and its narration claims none
    cross = qkv.trace(ours, TEXT, "river", "bank", target="the river was deep", layer=0, head=1)
    torch.testing.assert_close(cross.contextualized, cross.model_output, atol=1e-6, rtol=0)
    assert cross.bias is None and not cross.anatomy.relative_bias
    assert "Plus " not in narrate(cross) and "distance" not in narrate(cross)


def test_the_plain_article_model_tells_no_variant():
    config = EncoderConfig(vocab_size=len(WORDS), num_layers=2, position="learned",
                           max_positions=16, block=BlockConfig(width=32, num_heads=2,
                                                                norm_position="post"))  # fmt: skip
    traced, text = explained(tiny(config), layer=0, query="river", key="bank")
    assert "Divided by sqrt(16) = 4.000" in text and traced.score == traced.scaled_scalar
    for variant in ("Capped", "window", "QK-norm", "does not divide", "Plus ", "softmax reads",
                    "rescaled", "partial", "sub-layer", "side by side", "logits"):  # fmt: skip
        assert variant not in text, variant
    plain = ("Several layers: that vector is added to the token's input (the residual), "
             "normalized, passed\nthrough an MLP, and becomes the input of layer 1")  # fmt: skip
    assert plain in text


def test_the_json_of_a_trace_carries_the_variants(gemma2_like):
    traced, _ = explained(gemma2_like, layer=0)
    data = json.loads(json.dumps(traced.to_dict()))
    assert data["softcap"] == 0.02 and data["window"] == 3 and data["outside_window"] is True
    assert data["score"] == pytest.approx(traced.score)
    assert data["anatomy"]["scale_divisor"] == 144 and data["anatomy"]["logit_softcap"] == 30.0


def test_the_pages_own_steps_are_refused_where_the_vectors_cannot_redo_the_weights(gemma2_like):
    # the qkv show page redoes a clicked pair from q, k, v and the scale alone
    from qkv.inspect.records import why_not_redone
    from qkv.inspect.trace import attention_vectors

    with pytest.raises(ValueError, match=r"layer 0 caps its scores \(0.02 tanh\(s/0.02\)\)"):
        attention_vectors(gemma2_like, TEXT)
    windowed = tiny(decoder(window=4))
    assert "hides keys 4 or more tokens away" in why_not_redone(
        windowed.attentions(TEXT).records, applies=()
    )
    q, _, _ = attention_vectors(tiny(decoder(attn_scale=1.0)), TEXT)  # a scale the page has
    assert q.shape == (2, 2, len(TEXT.split()), 16)

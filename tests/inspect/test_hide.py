"""`qkv.inspect.hide` is exact by construction: a hidden pair is a masked pair, checked
against the loop backend, transformers' key padding and a full forward, never against itself."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from intervention_models import (
    assert_refused_and_unchanged,
    assert_unchanged,
    encoder_like,
    gemma2_like_pretrained,
    llama_like,
    snapshot,
)
from qkv.attention import attend
from qkv.inspect.hide import hide, hide_mask, senses_without_context
from qkv.inspect.probe import probe
from qkv.io.embedded import embedded_path
from qkv.nn.edit import Edit
from variant_models import TEXT, WORDS


@pytest.mark.parametrize("backend", ["loop", "eager", "sdpa", "flash"])
def test_a_hidden_pair_is_the_loop_backend_with_that_pair_masked(backend):
    """The record of the layer where 'river' is hidden from 'bank': its q, k, v are the
    clean run's (nothing before changed), and its output is the loop backend's over them
    with the pair masked, on every backend."""
    pretrained = llama_like(backend=backend)
    stack = pretrained.model
    ids = torch.tensor([pretrained.encode("the river bank was deep").ids])  # bank: token 2
    hidden = hide_mask(5, 2, keys=[(1, 2)], query=(2, 3), heads=[1])  # river from bank, head 1
    with torch.inference_mode():
        clean = stack(ids, layers=[1])
        edited = stack(ids, layers=[1], edits={1: Edit(hide=hidden)})
    before, record = clean.records[1], edited.records[1]
    assert torch.equal(record.q, before.q) and torch.equal(record.k, before.k)
    allowed = torch.ones(5, 5, dtype=torch.bool).tril()[None, None].repeat(1, 2, 1, 1)
    allowed[0, 1, 2, 1] = False
    expected = attend(record.q.double(), record.k.double(), record.v.double(), mask=allowed,
                      backend="loop")  # fmt: skip
    torch.testing.assert_close(record.out.double(), expected, atol=1e-5, rtol=1e-5)
    # the pair's weight is zero, the rest of the row renormalized; head 0 untouched
    weights = record.weights()[0]
    assert weights[1, 2, 1] == 0 and weights[1, 2].sum() == pytest.approx(1, abs=1e-6)
    row = before.weights()[0, 1, 2].double()
    renormalized = row * (torch.arange(5) != 1) / (1 - row[1])
    torch.testing.assert_close(weights[1, 2].double(), renormalized, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(record.out[0, 0], before.out[0, 0])
    assert not torch.allclose(record.out[0, 1, 2], before.out[0, 1, 2])


def test_hiding_a_word_from_every_word_everywhere_is_transformers_key_padding(minilm):
    """qkv.hide with no query, in every layer and head, on the embedded MiniLM equals the same
    checkpoint in transformers with the word's token padded out of attention_mask."""
    text = "The bank of the river was muddy"
    hidden = hide(minilm, text, "river")
    encoded = minilm.encode(text)
    start, end = encoded.find("river")
    reference = transformers.AutoModel.from_pretrained(embedded_path("minilm")).eval()
    mask = torch.ones(1, len(encoded.ids), dtype=torch.long)
    mask[0, start:end] = 0
    with torch.inference_mode():
        expected = reference(torch.tensor([encoded.ids]), attention_mask=mask).last_hidden_state
    torch.testing.assert_close(hidden.states, expected[0], atol=2e-5, rtol=1e-4)
    assert not torch.allclose(hidden.states, hidden.clean_states, atol=1e-3)
    # the whole-model change is larger than any single head's
    assert hidden.total > float(hidden.effect.max()) > 0


def test_hide_table_is_each_head_alone_and_resumes_from_the_clean_run():
    """Each cell of the (L, H) table equals a full forward from the embeddings with the key
    hidden in that one head: the table's shortcut (resume from the first hidden layer, heads
    batched) computes the same numbers."""
    pretrained = gemma2_like_pretrained()
    result = hide(pretrained, TEXT, "river", query="deep")
    stack = pretrained.model
    ids = torch.tensor([pretrained.encode(TEXT).ids])
    T = ids.shape[1]
    span = result.query_span
    with torch.inference_mode():
        clean = stack(ids).hidden[0, slice(*span)].mean(0).double()
        for layer, head in [(0, 0), (1, 1)]:
            mask = hide_mask(T, 2, result.key_spans, span, [head])
            alone = stack(ids, edits={layer: Edit(hide=mask)}).hidden[0, slice(*span)].mean(0)
            cosine = torch.nn.functional.cosine_similarity(clean, alone.double(), dim=0)
            assert float(result.effect[layer, head]) == pytest.approx(1 - float(cosine), abs=1e-6)
    assert result.effect.shape == (2, 2) and not result.effect.isnan().any()
    assert result.ranked()[0][2] == float(result.effect.max())
    # a decoder's next token, before and after: the clean run's own top tokens
    assert result.next is not None and result.next.position == span[1] - 1
    assert result.next.before[0].logprob >= result.next.before[-1].logprob


def test_hide_asks_only_the_layers_and_heads_given():
    pretrained = encoder_like()
    result = hide(pretrained, TEXT, "river", query="bank", layers=[1], heads=[0, 2])
    assert result.effect[0].isnan().all() and result.effect[1, [1, 3]].isnan().all()
    assert not result.effect[1, [0, 2]].isnan().any()
    data = result.to_dict()
    assert data["effect"][0] == [None] * 4 and data["effect"][1][0] == float(result.effect[1, 0])
    assert [(r["layer"], r["head"]) for r in data["ranked"]] in ([(1, 0), (1, 2)], [(1, 2), (1, 0)])


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda p: hide(p, TEXT, "river", query="bank"), "comes after"),
        (lambda p: hide(p, TEXT, "lake"), "the key word: 'lake' is not a word"),
        (lambda p: hide(p, TEXT, "river", layers=[2]), "layer 2"),
        (lambda p: hide(p, TEXT, "river", heads=[1, 0, 1]), "head 1 is asked for twice"),
        (lambda p: hide(p, TEXT, "river", layers=[1, 1]), "layer 1 is asked for twice"),
        (lambda p: p.attentions(TEXT, layers=[0, 0]), "layer 0 is asked for twice"),
        (lambda p: hide(p, TEXT, "the"), "occurs 2 times"),
    ],
)
def test_bad_input_is_one_clear_error(call, message):
    assert_refused_and_unchanged(call, message)


@pytest.mark.parametrize("make", [llama_like, encoder_like, gemma2_like_pretrained])
def test_hide_leaves_the_model_as_it_was(make):
    pretrained = make()
    before = snapshot(pretrained)
    hide(pretrained, TEXT, "river", query="deep")
    assert_unchanged(pretrained, before)
    assert not torch.is_grad_enabled() or all(p.grad is None for p in pretrained.model.parameters())


def test_backends_agree_on_a_hide_table():
    """The same table from every backend, our Triton kernel included (in Triton's interpreter
    on a machine without a GPU): hiding is a mask, and every backend computes masks."""
    tables = [hide(llama_like(backend=b), TEXT, "river", query="deep").effect
              for b in ("loop", "eager", "sdpa", "flash")]  # fmt: skip
    for table in tables[1:]:
        torch.testing.assert_close(table, tables[0], atol=1e-5, rtol=1e-3)


def test_the_senses_with_their_context_are_the_probes_last_layer(minilm):
    """senses_without_context's clean side is the probe's last layer (another code path:
    hide's unpadded runs, the probe's padded batch); hiding the context collapses it."""
    senses = senses_without_context(minilm, "bank")
    probed = probe(minilm, "bank")
    assert senses.separation == pytest.approx(probed.separation[-1], abs=1e-5)
    assert senses.accuracy == probed.accuracy[-1]
    assert senses.hidden_separation < senses.separation / 5


def test_an_encoder_decoder_hides_in_its_encoder_as_transformers_pads(tmp_path):
    """T5 (relative position bias, no division of the scores): hiding a word from every word
    in its encoder equals transformers' T5 encoder with that word padded out."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import models, pre_tokenizers

    import qkv
    from qkv.io.hf_folder import load_folder
    from qkv.io.tokenizer import Tokenizer

    config = transformers.T5Config(
        vocab_size=len(WORDS), d_model=32, d_kv=8, d_ff=37, num_layers=2, num_decoder_layers=2,
        num_heads=4, relative_attention_num_buckets=8, relative_attention_max_distance=16,
        decoder_start_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    theirs = transformers.T5ForConditionalGeneration(config).eval()
    theirs.save_pretrained(tmp_path)
    model, family, ours_config, hf_config = load_folder(tmp_path, torch.float32, "sdpa")
    backend = Backend(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    t5 = qkv.Pretrained(model, Tokenizer(backend), ours_config, family=family,
                        hf_config=hf_config, source="tiny-t5")  # fmt: skip
    hidden = hide(t5, TEXT, "river")
    ids = torch.tensor([t5.encode(TEXT).ids])
    mask = (ids != WORDS.index("river")).long()
    with torch.inference_mode():
        expected = theirs.encoder(input_ids=ids, attention_mask=mask).last_hidden_state[0]
    torch.testing.assert_close(hidden.states, expected, atol=1e-5, rtol=1e-4)
    assert hidden.next is None  # an encoder has no next token


def test_without_the_table_only_the_total_is_computed_and_the_json_is_valid():
    pretrained = encoder_like()
    full = hide(pretrained, TEXT, "river", query="bank")
    quick = hide(pretrained, TEXT, "river", query="bank", table=False)
    assert quick.effect.isnan().all() and quick.ranked() == []
    assert quick.total == pytest.approx(full.total, abs=1e-7)
    torch.testing.assert_close(quick.states, full.states)
    for result in (quick, full):
        json.dumps(result.to_dict(), allow_nan=False)  # null, never NaN


def test_a_decoder_recomputes_only_the_positions_hiding_can_change():
    """In a decoder a word's earlier positions never see it: `hide` computes positions from
    the first one it can change, the rest from the clean run's cache. The result is the full
    forward from the embeddings with the key hidden from every word in every layer."""
    pretrained = llama_like()
    result = hide(pretrained, TEXT, "river")  # river is token 4: positions 0-3 stay clean
    ids = torch.tensor([pretrained.encode(TEXT).ids])
    mask = hide_mask(ids.shape[1], 2, result.key_spans, None, [0, 1])
    with torch.inference_mode():
        full = pretrained.model(ids, edits={n: Edit(hide=mask) for n in range(2)}).hidden[0]
    torch.testing.assert_close(result.states, full, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(result.states[:4], result.clean_states[:4], rtol=0, atol=0)
    assert not torch.allclose(result.states[4:], result.clean_states[4:], atol=1e-4)

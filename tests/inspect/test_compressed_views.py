"""Every view on a DeepSeek-V4 model, loaded by `qkv.load` from a folder transformers saved:
the weights are shown on the words (a compressed entry's spread over its block by the
compressor's coefficients, and said so), a trace tells what the query attended to and why a
word got no weight, and what cannot be done exactly is refused by name."""

from __future__ import annotations

import pytest
import torch

import qkv
from deepseek_v4_models import TEXT, deepseek_v4
from qkv.generate.fast_step import fast_step_refusal
from qkv.inspect.anatomy import anatomy as model_anatomy
from qkv.inspect.anatomy import cache_bytes_per_token
from qkv.inspect.census import heads
from qkv.inspect.summaries import chunk_weights
from qkv.inspect.words import compressed_words, on_words
from qkv.viz.narrate import contributions, narrate
from qkv.viz.page import attention_page

QUERY = "deep#3"  # token 26, the last


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return deepseek_v4(tmp_path_factory.mktemp("deepseek-v4"))


@pytest.fixture(scope="module")
def seen(model):
    return model.attentions(TEXT)


def test_attentions_are_on_the_words_and_sum_to_what_the_sink_left(seen):
    T = len(TEXT.split())
    assert seen.weights.shape == (3, 4, T, T)
    for layer, record in seen.records.items():
        keys = record.weights()  # over the record's keys: words, then entries
        assert keys.shape[-1] == T + (0 if record.compressed is None else
                                      record.compressed.blocks.shape[0])  # fmt: skip
        torch.testing.assert_close(seen.weights[layer], on_words(record)[0])
        total = seen.weights[layer].sum(-1) + record.sink_weights()[0]
        torch.testing.assert_close(total, torch.ones_like(total))
    # words beyond the window get weight only through the entries the indexer chose
    words = seen.weights[1, :, 26]  # (H, T) layer 1 (CSA), the last query
    keys = seen.records[1].compressed
    for word in range(T):
        assert (keys.why_zero(26, word) is None) == bool((words[:, word] > 0).all()), word
    assert compressed_words(seen.records).startswith("layers 1, 2 attend over the words of a")


def test_a_trace_in_a_compressed_layer_tells_what_the_query_attended_to(model, seen):
    traced = qkv.trace(model, TEXT, QUERY, "river#2", layer=1, head=1, attentions=seen)
    c = traced.compressed
    assert (c.kind, c.rate, c.window, c.top_k, c.complete) == ("CSA", 4, 4, 2, 6)
    attended = [e for e in c.entries if e.attended]
    assert len(attended) == 2 and all(e.rank <= 2 for e in attended)
    # the window, the chosen entries and the sink take every weight of the softmax
    total = c.window_weight + sum(e.weight for e in attended) + traced.sink_weight
    assert total == pytest.approx(1.0, abs=1e-6)
    # river#2 (word 13) is outside the window: its weight is its shares of the entries
    assert c.from_window == 0 and traced.weight == pytest.approx(c.from_entries, abs=1e-6)
    assert c.key_entry is not None and traced.weight > 0
    entry = seen.records[1].compressed.blocks[c.key_entry]
    assert 13 in entry.tolist()  # steps 2-6 show an entry that holds the key word
    # the words' contributions are the head's output split by word
    torch.testing.assert_close(traced.contextualized, traced.model_output, atol=1e-5, rtol=0)
    assert sum(x.weight for x in traced.contributions) == pytest.approx(1 - traced.sink_weight,
                                                                        abs=1e-5)  # fmt: skip
    text = narrate(traced) + "\n" + contributions(traced)
    assert "This layer (CSA) attends over two kinds of keys" in text
    assert "chose its top 2" in text and f"the sink {100 * traced.sink_weight:.1f}%" in text
    assert f"entry {c.key_entry} (words {int(entry.min())}..{int(entry.max())})" in text
    assert "averaged over" in text and "an attribution" in text


def test_a_word_the_indexer_skipped_says_so_with_its_rank(model, seen):
    traced = qkv.trace(model, TEXT, QUERY, "bank#2", layer=1, head=1, attentions=seen)
    assert traced.weight == 0 and traced.masked
    why = traced.compressed.why_zero
    assert why.startswith("word 10 is outside the window of 4 words before 26")
    assert "was not chosen by the indexer (rank " in why and "of 6, top 2 chosen)" in why
    assert f'"bank#2" gets 0: {why}.' in narrate(traced)


def test_a_heavily_compressed_layer_attends_every_complete_entry(model, seen):
    traced = qkv.trace(model, TEXT, QUERY, "bank#1", layer=2, head=0, attentions=seen)
    c = traced.compressed
    assert (c.kind, c.top_k, c.complete) == ("HCA", None, 3)
    assert [e.attended for e in c.entries] == [True, True, True]
    assert "attends every entry whose block is complete: 3" in narrate(traced)


def test_a_sliding_layer_traces_as_a_window_with_a_sink(model, seen):
    traced = qkv.trace(model, TEXT, QUERY, "river#3", layer=0, head=1, attentions=seen)
    assert traced.compressed is None and traced.outside_window and traced.weight == 0
    torch.testing.assert_close(traced.contextualized, traced.model_output, atol=1e-5, rtol=0)
    assert "outside the window, so its weight is 0" in narrate(traced)


def test_the_layer_and_head_a_trace_chooses_are_read_on_the_words(model, seen):
    traced = qkv.trace(model, TEXT, QUERY, "river#1", attentions=seen)
    best = max((float(seen.weights[n, h, 26, 4]), n, h) for n in range(3) for h in range(4))
    assert (traced.layer, traced.head) == best[1:]


def test_the_page_and_the_census_say_the_words_are_reached_through_the_compressor(model, seen):
    page = attention_page(seen, title="v4").decode()
    assert "averaged over channels" in page
    census = heads(model, prompts=[TEXT], rows=1, length=4)
    assert census.compressed == [False, True, True]
    assert "compressed entries' weights read on their words" in census.effective_words()
    assert bool((census.first_token <= 1).all()) and bool((census.first_token >= 0).all())


@pytest.mark.parametrize(
    ("ask", "message"),
    [
        (lambda m: qkv.hide(m, TEXT, "bank#1", layers=[1]), "DeepSeek-V4 decoder, which keeps n"),
        (lambda m: qkv.ablate(m, TEXT, "all"), "whose layers take no edits"),
        (lambda m: qkv.patch(m, TEXT, TEXT, "prob: river"), "hide, ablate and patch resume"),
        (lambda m: qkv.lens(m, TEXT), "logit lens reads each layer's one vector per token"),
        (lambda m: m.generate(TEXT, 2, record=[1]), "a DeepSeek-V4 layer's cache keeps only"),
        (lambda m: list(chunk_weights(m.attentions(TEXT).records[1])),
         "attends over compressed entries"),
    ],
)  # fmt: skip
def test_what_cannot_be_done_exactly_is_refused_by_name(model, ask, message):
    with pytest.raises(ValueError, match=message):
        ask(model)


def test_generation_runs_the_models_own_forward_with_its_cache(model):
    """The fast step is Decoder's; DeepSeek-V4's forward is its own, so generation must take
    the plain path: greedy tokens equal the argmax of one whole forward after each."""
    ids = list(model.tokenizer.encode(TEXT).ids)
    text = model.generate(TEXT, 4)
    assert fast_step_refusal(model.model, torch.device("cpu")).startswith("the model is a Deep")
    with torch.no_grad():
        for _ in range(4):
            ids.append(int(model.model(torch.tensor([ids])).logits[0, -1].argmax()))
    assert text == model.tokenizer.decode(ids[-4:])


def test_qkv_models_tells_compressed_attention_and_counts_the_entries_a_cache_grows_by(model):
    """The cache per token is what the layers' caches really grow by: an entry per block of
    tokens (and an indexer key per CSA entry), the window's keys a fixed size."""
    config = model.model.config
    anatomy = model_anatomy(config)
    assert "compressed keys in 2 of 3 layers beside a window" in anatomy.attention
    assert anatomy.mlp.startswith(f"{config.num_experts} experts, {config.experts_per_token} a")

    def stored(cache) -> int:
        kept = [(layer.compressor.entries, layer.indexer.entries) for layer in cache.layers]
        return sum(t.shape[1] * t.shape[2] for pair in kept for t in pair if t is not None)

    counts = []
    for length in (32, 64):
        cache = model.model.new_cache()
        with torch.no_grad():
            model.model(torch.zeros(1, length, dtype=torch.long), cache=cache)
        counts.append(stored(cache))
    assert cache_bytes_per_token(config) == 2 * (counts[1] - counts[0]) / 32

"""A token typed without the leading space the model's own token has is never taken silently
(`--token Paris` where SmolLM2 writes " Paris"), and a word of several tokens says which of
them a trace reads (`--query riverbank` reads 'river')."""

from __future__ import annotations

import pytest

import qkv
from qkv.cli.options import say_metric_notes
from qkv.inspect.lens import lens, token_id_of
from qkv.inspect.metrics import Metric
from qkv.io.words import spaced_token, token_note
from qkv.viz import escape
from qkv.viz.lines import lens_lines
from qkv.viz.narrate import tokens_line
from qkv.viz.notebook import trace_html

FRANCE = "The capital of France is"


def test_the_spaced_token_is_offered_only_where_the_vocabulary_has_it(smollm2, minilm):
    tokenizer = smollm2.tokenizer
    plain = tokenizer.encode("Paris", add_special_tokens=False).ids
    spaced = tokenizer.encode(" Paris", add_special_tokens=False).ids
    assert len(plain) == 1 and len(spaced) == 1 and plain != spaced  # two tokens of its own
    assert spaced_token(tokenizer, "Paris") == " Paris"
    assert spaced_token(tokenizer, " Paris") is None
    assert spaced_token(minilm.tokenizer, "paris") is None  # WordPiece drops the space
    note = token_note(tokenizer, "Paris", "--token")
    assert note.startswith("--token 'Paris' has no leading space and reads as one token")
    assert "' Paris'" in note


def test_the_lens_says_so_and_the_spaced_token_is_the_models_choice(smollm2):
    found = lens(smollm2, FRANCE, token="Paris", attribute=False)
    spaced = lens(smollm2, FRANCE, token=" Paris", attribute=False)
    assert spaced.token_note is None
    assert found.token_note == token_note(smollm2.tokenizer, "Paris", "the token")
    assert lens_lines(found).splitlines()[0] == found.token_note
    assert found.to_dict()["token_note"] == found.token_note
    assert spaced.rank[-1] < found.rank[-1]  # the model's own token ranks higher: why it is said


def test_a_split_token_is_refused_with_the_spaced_one_offered(smollm2):
    word = next(w for w in ("Parisian", "Londoner", "Berliner", "Amsterdam")
                if len(smollm2.tokenizer.encode(w, add_special_tokens=False).ids) > 1
                and spaced_token(smollm2.tokenizer, w) is not None)  # fmt: skip
    with pytest.raises(ValueError, match=f"or ' {word}', one token"):
        token_id_of(smollm2, word)
    with pytest.raises(ValueError, match=f"or ' {word}', one token"):
        Metric.parse(f"prob:{word}").ids(smollm2.tokenizer)


def test_a_metrics_token_without_its_space_is_said_on_stderr(smollm2, capsys):
    assert Metric.parse("prob:Paris").notes(smollm2.tokenizer) == [
        token_note(smollm2.tokenizer, "Paris", "the metric's token")
    ]
    assert Metric.parse("diff: Paris, London").notes(smollm2.tokenizer) == []  # spaces kept
    say_metric_notes("prob:Paris", smollm2)
    assert "the metric's token 'Paris' has no leading space" in capsys.readouterr().err


def test_a_word_of_several_tokens_says_which_the_trace_reads(minilm):
    text = "We sat on the riverbank"
    traced = qkv.trace(minilm, text, "riverbank", "sat")
    start, end = minilm.encode(text).find("riverbank")
    assert (traced.query_span, traced.key_span) == ((start, end), minilm.encode(text).find("sat"))
    assert end - start == 2 and traced.query_index == start
    first, second = traced.tokens[start], traced.tokens[start + 1]
    told = tokens_line(traced)  # the header `qkv explain` prints
    assert (f'"riverbank" is 2 tokens ({first!r} {second!r}, tokens {start}-{end - 1}): the query '
            f"is its first, {first!r}, token {start}.") in told  # fmt: skip
    assert "is 2 tokens" not in tokens_line(qkv.trace(minilm, "the river bank", "bank", "river"))
    assert escape.text(told.splitlines()[-1].strip()) in trace_html(traced)  # the notebook too
    assert list(traced.to_dict()["query_span"]) == [start, end]

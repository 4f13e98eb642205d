"""`hide`'s number comes with a scale: each other word of the text hidden instead, in the same
heads, and the key's rank among them (docs/hide.md)."""

from __future__ import annotations

import pytest

from intervention_models import llama_like
from qkv.inspect.hide import hide
from qkv.inspect.hide_scale import key_rank
from qkv.viz.lines import hide_lines
from qkv.viz.notebook_interventions import hidden_html
from variant_models import TEXT

SENTENCE = "The bank on the side of the river"


@pytest.fixture(scope="module")
def hidden(minilm):
    return hide(minilm, SENTENCE, "river", query="bank", layers=[0, 5], heads=[4, 6, 10])


def test_each_other_word_is_hidden_instead_in_the_same_heads(minilm, hidden):
    words = {w.word: w.total for w in hidden.others}
    assert set(words) == {"The#1", "on", "the#2", "side", "of", "the#3"}
    for word in ("side", "the#3"):  # each the change `hide` gives for that word alone
        alone = hide(minilm, SENTENCE, word, query="bank", layers=[0, 5], heads=[4, 6, 10],
                     table=False)  # fmt: skip
        assert words[word] == alone.total
    totals = [w.total for w in hidden.others]
    assert totals == sorted(totals, reverse=True)
    rank = 1 + sum(t > hidden.total for t in totals)
    assert key_rank(hidden.total, hidden.others) == rank
    assert hidden.to_dict()["others"] == [{"word": w, "total": t} for w, t in words.items()]


def test_the_text_and_the_notebook_give_the_scale(hidden):
    told = " ".join(hide_lines(hidden).split())
    low, high = hidden.others[-1], hidden.others[0]
    rank = key_rank(hidden.total, hidden.others)
    assert f"'river' ranks {rank} of 7" in told
    assert f"1 - cosine {low.total:.3g} ('{low.word}') to {high.total:.3g} ('{high.word}')" in told
    assert "in the same 6 heads at once" in told
    html = hidden_html(hidden)
    assert f"&#x27;river&#x27; ranks {rank} of 7" in html or f"'river' ranks {rank} of 7" in html


def test_a_decoder_leaves_out_the_words_after_the_query():
    pretrained = llama_like()
    result = hide(pretrained, TEXT, "river", query="wide")  # the bank of the river was wide
    assert {w.word for w in result.others} == {"the#1", "bank", "of", "the#2", "was"}


def test_no_scale_without_the_table_or_over_several_prompts(minilm):
    assert hide(minilm, SENTENCE, "river", query="bank", layers=[0], table=False).others == []
    several = hide(minilm, [SENTENCE, "The bank by the river"], "river", query="bank",
                   layers=[0], heads=[0])  # fmt: skip
    assert several.others == [] and "for scale" not in hide_lines(several)


def test_a_long_text_asks_only_the_words_nearest_the_query(minilm, monkeypatch):
    """At most hide_scale.MOST other words are hidden (each is a clean run and a knockout):
    the nearest the query, and the text says how many of how many."""
    import qkv.inspect.hide_scale as scale

    monkeypatch.setattr(scale, "MOST", 3)
    found = hide(minilm, SENTENCE, "river", query="bank", layers=[0], heads=[4])
    # The(1) bank(2) on(3) the(4) side(5) of(6) the(7) river(8): nearest 'bank' are The, on, the#2
    assert {w.word for w in found.others} == {"The#1", "on", "the#2"}
    assert found.others_of == 6 and found.to_dict()["others_of"] == 6
    assert "the 3 of 6 other words nearest the query hidden instead" in " ".join(
        hide_lines(found).split()
    )

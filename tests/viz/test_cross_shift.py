"""Cross-attention looks shifted by one because the decoder reads the target shifted right:
every view of it says so, with the rows' own tokens (a tiny random BART)."""

from __future__ import annotations

import pytest

import qkv
from qkv.viz import escape, head_heatmap, model_view, write_html
from qkv.viz.narrate import narrate
from qkv.viz.notebook import _cross_html
from qkv.viz.step_words import shifted_right

SOURCE, TARGET = "a b c d e", "e d c b a"


@pytest.fixture(scope="module")
def bart(folder):
    return qkv.load(folder)


@pytest.fixture(scope="module")
def seen(bart):
    return bart.attentions(SOURCE, target=TARGET)


def test_the_words_name_the_start_token_and_the_next_token(seen):
    rows = seen.query_tokens  # the start token, then the target's
    said = shifted_right(rows)
    assert f'row 0 is its start token "{rows[0]}"' in said
    assert f'(the row of "{rows[1]}" writes "{rows[2]}")' in said
    assert rows[1:] == TARGET.split()
    with pytest.raises(ValueError, match="got 1 row"):
        shifted_right(["</s>"])


def test_the_page_and_the_pngs_say_it(seen, tmp_path, drawn):
    said = shifted_right(seen.query_tokens)
    page = write_html(tmp_path / "cross.html", seen.weights, seen.tokens,
                      query_tokens=seen.query_tokens)  # fmt: skip
    assert f'<p id="shifted" class="note">{escape.text(said)}</p>' in page.read_text("utf-8")
    head_heatmap(seen.weights[0, 0], seen.tokens, tmp_path / "one.png",
                 query_tokens=seen.query_tokens)  # fmt: skip
    model_view(seen.weights, seen.tokens, tmp_path / "all.png", query_tokens=seen.query_tokens)
    below = " ".join(drawn[0]._supxlabel.get_text().split())
    title = " ".join(drawn[1]._suptitle.get_text().split())
    assert said in below and said in title


def test_the_cli_trace_and_the_notebook_say_it(bart, seen, monkeypatch):
    traced = qkv.trace(bart, SOURCE, "e", "d", target=TARGET, layer=0, head=0)
    said = shifted_right(traced.query_tokens)
    assert said in " ".join(narrate(traced).split())
    monkeypatch.setattr("qkv.viz.notebook.NOTEBOOK_PAGE_BYTES", 10)  # the table, not the page
    assert escape.text(said) in _cross_html(seen, seen.weights)

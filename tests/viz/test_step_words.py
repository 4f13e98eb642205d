"""What the query, key and value matrices multiply is said once (`qkv.viz.step_words`) and
every view says it: after layer 0 it is the vector entering the layer, not the embedding."""

from __future__ import annotations

import json

import pytest

import qkv
from browser import offline
from qkv.inspect.trace import attention_vectors
from qkv.viz import escape, write_html
from qkv.viz.narrate import narrate
from qkv.viz.notebook import trace_html
from qkv.viz.report import read_weights
from qkv.viz.step_words import multiplied, multiplied_by_layer

SENTENCE = "The bank on the side of the river"


@pytest.fixture(scope="module")
def traced(minilm):
    return qkv.trace(minilm, SENTENCE, "bank", "river", layer=3, head=5)


def test_the_words_name_the_layer_and_say_embedding_only_in_the_first():
    assert "embedding: the first layer" in multiplied("query", 0)
    later = multiplied("query", 3)
    assert "entering layer 3" in later and "changed by layers 0-2" in later
    assert multiplied("key", 1).endswith("changed by layer 0)")
    assert "out of the encoder" in multiplied("value", 4, cross=True)
    assert "in the decoder's layer 4" in multiplied("query", 4, cross=True, whose='"g"\'s')
    assert multiplied("query", 4, cross=True, whose='"g"\'s').startswith('"g"\'s vector')
    with pytest.raises(ValueError, match="role must be"):
        multiplied("score", 0)
    with pytest.raises(ValueError, match="layer must be"):
        multiplied("query", -1)


def test_the_cli_says_what_layer_3_multiplies(traced):
    told = narrate(traced)
    assert multiplied("query", 3, whose='"bank"\'s') in told
    assert multiplied("key", 3, whose='"river"\'s') in told
    assert multiplied("value", 3, whose='"river"\'s') in told


def test_the_notebook_trace_says_the_vector_entering_the_layer(traced):
    table = trace_html(traced)
    assert "its embedding times" not in table
    for role in ("query", "key", "value"):
        assert f"({escape.text(multiplied(role, 3))} times the {role} matrix)" in table


def test_the_report_page_carries_the_words_and_shows_the_chosen_layers(minilm, tmp_path):
    seen = minilm.attentions(SENTENCE)
    vectors = attention_vectors(minilm, SENTENCE)
    page_file = write_html(tmp_path / "trace.html", seen.weights, seen.tokens, vectors=vectors)
    html = page_file.read_text(encoding="utf-8")
    read_weights(html)  # the page's data still reads back
    data = json.loads(html.split('id="qkv-data">', 1)[1].split("</script>", 1)[0])
    assert data["multiplies"] == multiplied_by_layer(6)
    bank, river = seen.tokens.index("bank"), seen.tokens.index("river")
    with offline(page_file) as page:
        for layer in (0, 3):
            page.select_option("#layer", str(layer))
            page.select_option("#head", "5")
            page.locator(f"#heatmap-table td[data-q='{bank}'][data-k='{river}']").click()
            pair = f"{layer},5,{bank},{river}"
            page.wait_for_function(f"document.getElementById('trace').dataset.pair === '{pair}'")
            text = " ".join(page.inner_text("#trace").split())
            assert f"({multiplied('query', layer)} times the query matrix)" in text
            assert f"({multiplied('value', layer)} times the value matrix)" in text
    assert "its embedding times" not in html

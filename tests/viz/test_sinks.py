"""A query's largest weight on the first or a special token is named an attention sink where
it shows (CLI trace, notebook trace, report page), and only then."""

from __future__ import annotations

import pytest

import qkv
from browser import offline
from qkv.inspect.sinks import is_sink, sink_sentence
from qkv.viz import write_html
from qkv.viz.narrate import narrate
from qkv.viz.notebook import trace_html

SENTENCE = "The bank on the side of the river"


def test_the_sink_is_the_first_or_a_special_token_and_only_when_it_is_the_top():
    tokens = ["Ċ", "the", "[SEP]", "<|im_end|>", "</s>", "bank"]
    assert [is_sink(tokens, i) for i in range(6)] == [True, False, True, True, True, False]
    said = sink_sentence(["Hello", " bank", " river"], [0.65, 0.15, 0.2], '"river"')
    assert said.startswith('"Hello" (token 0) takes "river"\'s largest weight here, 65.00%')
    assert "attention sink" in said
    assert sink_sentence(["Hello", " bank", " river"], [0.3, 0.5, 0.2], '"river"') is None
    with pytest.raises(ValueError, match="2 weights for 3 tokens"):
        sink_sentence(["a", "b", "c"], [0.5, 0.5], "q")


@pytest.mark.parametrize("layer, head", [(3, 0), (0, 10)])
def test_the_cli_and_notebook_trace_name_the_sink_from_the_weights(minilm, layer, head):
    traced = qkv.trace(minilm, SENTENCE, "bank", "river", layer=layer, head=head)
    weights = traced.weights.tolist()
    top = max(range(len(weights)), key=weights.__getitem__)
    told, table = " ".join(narrate(traced).split()), trace_html(traced)
    if top == 0:  # [CLS]
        said = f'"[CLS]" (token 0) takes "bank"\'s largest weight here, {100 * weights[0]:.2f}%'
        assert said in told and "attention sink" in told
        assert "attention sink" in table and f"{100 * weights[0]:.2f}%" in table
    else:
        assert "attention sink" not in told and "attention sink" not in table
    assert (layer, head, top) in {(3, 0, 0), (0, 10, 8)}  # both cases are asked


def test_the_report_pages_row_names_the_sink(minilm, tmp_path):
    seen = minilm.attentions(SENTENCE)
    page_file = write_html(tmp_path / "page.html", seen.weights, seen.tokens, text=SENTENCE)
    bank = seen.tokens.index("bank")
    shown = {}
    with offline(page_file) as page:
        for layer, head in ((3, 0), (0, 10)):
            page.select_option("#layer", str(layer))
            page.select_option("#head", str(head))
            page.locator(f"button.token[data-index='{bank}']").first.click()
            page.wait_for_function(f"document.getElementById('row-title').textContent"
                                   f".includes('layer {layer}, head {head}')")  # fmt: skip
            shown[layer, head] = (page.inner_text("#sink"),
                                  int(page.get_attribute("#sink", "data-top")))  # fmt: skip
    for (layer, head), (text, top) in shown.items():
        row = seen.weights[layer, head, bank]
        assert top == int(row.argmax())
        if top == 0:
            assert text.startswith(f'"[CLS]" (token 0) takes "bank"\'s largest weight here, '
                                   f"{100 * float(row[0]):.2f}%")  # fmt: skip
            assert "attention sink" in text
        else:
            assert text == ""
    assert {top for _, top in shown.values()} == {0, seen.tokens.index("river")}

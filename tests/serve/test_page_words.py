"""The explorer's words (issue 38): its weights list counts from 0 as the tokens do, a clicked
pair is offered the head where its weight is largest, and a generation says what ended it."""

from __future__ import annotations

import pytest

from browser import served, submit
from qkv.inspect.hide import hide
from qkv.inspect.sinks import sink_sentence
from qkv.serve import Limits, create_app
from qkv.serve.compute import ended
from qkv.viz.lines import hide_scale_text

TEXT = "The bank on the side of the river"


def test_the_list_counts_from_0_and_the_strongest_head_is_offered(app, minilm):
    seen = minilm.attentions(TEXT)
    bank, river = seen.tokens.index("bank"), seen.tokens.index("river")
    pair = seen.weights[:, :, bank, river]  # (L, H): the pair's weight in every head
    best = int(pair.argmax())
    layer, head = divmod(best, pair.shape[1])
    assert (layer, head) != (0, 0)  # the page opens on head 0: the offer is needed
    with served(app) as page:
        submit(page, TEXT)
        page.select_option("#layer", "0")
        page.select_option("#head", "0")
        page.locator(f"#heatmap-table td[data-q='{bank}'][data-k='{river}']").click()
        page.wait_for_function(f"document.getElementById('trace').dataset.pair === '0,0,{bank},"
                               f"{river}'")  # fmt: skip
        start = page.get_attribute("#row", "start")
        first = page.eval_on_selector("#row li", "li => +li.dataset.k")
        offered = page.eval_on_selector("#strongest", "p => [+p.dataset.layer, +p.dataset.head, "
                                        "+p.dataset.w, p.textContent]")  # fmt: skip
        page.click("#strongest-show")
        page.wait_for_function(f"document.getElementById('trace').dataset.pair === '{layer},"
                               f"{head},{bank},{river}'")  # fmt: skip
        after = page.inner_text("#strongest")
    assert start == "0" and first == 0  # item k of the list is token k
    assert offered[:2] == [layer, head]
    assert offered[2] == pytest.approx(float(pair[layer, head]), abs=1e-7)
    assert (f"Strongest head for this pair: layer {layer} head {head} "
            f"({100 * float(pair[layer, head]):.2f}%)") in offered[3]  # fmt: skip
    assert f"this one gives it {100 * float(pair[0, 0]):.2f}%" in offered[3]
    assert after.endswith("the one shown.")


def test_a_generation_says_what_ended_it(smollm2):
    app = create_app({"smollm2": smollm2}, Limits(max_new_tokens=16))
    want = smollm2.generate(TEXT, 3)
    with served(app) as page:
        submit(page, TEXT)
        page.fill("#gen-max", "3")
        page.click("#gen-go")
        page.wait_for_function("document.getElementById('gen-status').textContent"
                               ".startsWith('Done')", timeout=60_000)  # fmt: skip
        status, written = page.inner_text("#gen-status"), page.inner_text("#gen-new")
    assert written == want
    assert (
        status
        == f"Done: {ended('end', 3, 3, 30.0)}."
        == ("Done: wrote 3 tokens, the most asked (max_new_tokens 3).")
    )


def test_a_rows_largest_weight_on_cls_is_named_an_attention_sink(app, minilm):
    seen = minilm.attentions(TEXT)
    bank = seen.tokens.index("bank")
    shown = {}
    with served(app) as page:
        submit(page, TEXT)
        for layer, head in ((3, 0), (0, 10)):
            page.select_option("#layer", str(layer))
            page.select_option("#head", str(head))
            page.locator(f"button.token[data-index='{bank}']").first.click()
            page.wait_for_function(f"document.body.dataset.view === '{layer},{head},{bank},'")
            shown[layer, head] = (page.inner_text("#sink"),
                                  int(page.get_attribute("#sink", "data-top")))  # fmt: skip
    for (layer, head), (text, top) in shown.items():
        row = seen.weights[layer, head, bank]
        assert top == int(row.argmax())
        if top == 0:
            assert text == sink_sentence(seen.tokens, row.tolist(), '"bank"') + "."
        else:
            assert text == ""
    assert {top for _, top in shown.values()} == {0, seen.tokens.index("river")}


def test_the_hide_panel_gives_the_scale_of_its_number(minilm):
    text = "The bank of the river flooded the bank"
    want = hide(minilm, text, "river", query="bank#1")
    said = hide_scale_text(want)
    assert said is not None and "'river' ranks" in said
    app = create_app({"minilm": minilm}, Limits())  # its own: see test_hide_panel.py
    with served(app) as page:
        submit(page, text)
        bank, river = want.tokens.index("bank"), want.tokens.index("river")
        page.locator(f"#heatmap-table td[data-q='{bank}'][data-k='{river}']").click()
        page.wait_for_selector("#hide-scale", timeout=60_000)
        shown = page.inner_text("#hide-scale")
    assert shown == said[0].upper() + said[1:] + "."

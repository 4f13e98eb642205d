"""The page's "What if the key were hidden?" panel and its census of heads, in a real headless
Chromium against a real server on loopback (one page load): the heatmap's cells, the largest
effect and the total are `qkv.hide`'s for the pair chosen on the page, and the census table's
top heads and first-token masses are `qkv.heads`'s."""

from __future__ import annotations

import pytest

import qkv
from browser import ARTIFACTS, served, submit
from qkv.inspect.census import heads
from qkv.serve import Limits, create_app

TEXT = "The bank of the river flooded the bank"  # two banks: the page names them bank#1, bank#2


def test_the_hide_heatmap_and_the_census_are_the_librarys(minilm):
    # the library first: its numbers to compare, and the first run of batched heads in this
    # process (which loads what torch imports lazily) not paid within a request's time limit
    want = qkv.hide(minilm, TEXT, "river", query="bank#1")
    census = heads(minilm)
    # an app of its own: a served app's worker pool ends with the server, and the shared
    # `app` serves the `client` of the API tests, which may run after this one
    app = create_app({"minilm": minilm}, Limits())
    with served(app) as page:
        submit(page, TEXT)
        page.select_option("#layer", "4")
        page.select_option("#head", "7")
        bank, river = want.tokens.index("bank"), want.tokens.index("river")
        page.locator(f"#heatmap-table td[data-q='{bank}'][data-k='{river}']").click()
        page.wait_for_function(
            "document.getElementById('hide').dataset.pair === 'bank#1,river'", timeout=30_000
        )
        cells = page.eval_on_selector_all(
            "#hide-table td[data-effect]",
            "tds => tds.map(td => [+td.dataset.layer, +td.dataset.head, +td.dataset.effect])",
        )
        blank = page.locator("#hide-table td.none").count()
        shown = page.eval_on_selector_all(
            "#hide-table td.shown",
            "tds => tds.map(td => [+td.dataset.layer, +td.dataset.head])",
        )
        best = [float(page.get_attribute("#hide-best", f"data-{name}"))
                for name in ("layer", "head", "effect")]  # fmt: skip
        total = float(page.get_attribute("#hide-total", "data-total"))
        title = page.inner_text("#hide h2")
        page.wait_for_selector("#census-top tr[data-score]", timeout=30_000)
        top = page.eval_on_selector_all(
            "#census-top tr",
            "trs => Object.fromEntries(trs.map(tr => [tr.dataset.score, [...tr.cells]"
            ".filter(td => td.dataset.layer !== undefined)"
            ".map(td => [+td.dataset.layer, +td.dataset.head, +td.dataset.value])]))",
        )
        sinks = page.eval_on_selector_all(
            "#census-sinks tr", "trs => trs.map(tr => [+tr.dataset.layer, +tr.dataset.mass])"
        )
        # a census head is a button that shows that head, and marks it in the hide grid
        n, h, _ = census.top("induction")[0]
        cell = f"td[data-layer='{n}'][data-head='{h}']"
        page.click(f"#census-top tr[data-score='induction'] {cell} button")
        page.wait_for_function(
            f"document.getElementById('trace').dataset.pair === '{n},{h},{bank},{river}'"
        )
        marked = page.eval_on_selector_all(
            "#hide-table td.shown",
            "tds => tds.map(td => [+td.dataset.layer, +td.dataset.head])",
        )
        ARTIFACTS.mkdir(exist_ok=True)
        for panel in ("hide", "census-box"):
            page.locator(f"#{panel}").screenshot(path=str(ARTIFACTS / f"serve-{panel}.png"))

    assert "“river” hidden from “bank#1”" in title
    L, H = want.effect.shape
    assert len(cells) == L * H and blank == 0
    for layer, head, effect in cells:  # every digit the library gave
        assert effect == want.effect[layer, head].item(), (layer, head)
    assert shown == [[4, 7]] and marked == [[n, h]]  # the head the page shows is marked
    assert best == [*want.ranked()[0][:2], want.ranked()[0][2]]
    assert total == want.total
    assert set(top) == {"previous_token", "induction", "first_token", "self", "entropy"}
    for name, found in top.items():  # MiniLM has no window: window_use has no row
        assert found == [list(t) for t in census.top(name)], name
    assert sinks == [[n, pytest.approx(m, abs=1e-12)] for n, m in
                     enumerate(census.sink_per_layer.tolist())]  # fmt: skip

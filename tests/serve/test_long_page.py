"""The page's long view in a real headless Chromium against a real server on loopback: a text
over max_tokens (a small one here, max_tokens=16, so that it takes seconds) switches the page
to its summaries; the table, the chosen head's heatmap and a query's top keys are
`summarize`'s, and a click on the heatmap opens the block around it at full resolution,
whose weights are `region`'s (and the slice of `record.weights()`). Nothing but the server
is asked. A screenshot is kept in test-artifacts/serve-long.png."""

from __future__ import annotations

import matplotlib.image
import pytest

from browser import ARTIFACTS, served, submit
from qkv.inspect.summaries import region, summarize
from qkv.serve import Limits, create_app

TEXT = (
    "We walked along the old towpath, past the mill and the lock, to the bank of the river. "
    "The water was high after a week of rain, brown and fast, carrying branches down towards "
    "the town. "
) * 6  # 260 MiniLM tokens: over max_tokens = 16
SHORTER = TEXT[:600]
LAYER, HEAD = 3, 5
CELLS = [(0, 0), (10, 40), (63, 7), (31, 32)]  # (query, key) within the region opened


def test_a_text_over_max_tokens_shows_its_summaries_and_opens_a_region(minilm):
    seen = minilm.attentions(TEXT)
    T = len(seen.tokens)
    want = summarize(seen)
    # 1,110 characters: over max_chars, so the page reads it long without asking for every
    # weight; SHORTER is within max_chars, and the server's 413 (max_tokens) tells the page
    app = create_app({"minilm": minilm}, Limits(max_tokens=16, max_chars=1_000))
    full = []  # the server's queue full at the first ask: the page asks again (it stopped)

    def queue_full_once(route):
        if route.request.method == "POST" and not full:
            full.append(route.request.url)
            detail = "minilm has 8 long texts waiting to be read (max_long_waiting); ask again"
            return route.fulfill(status=503, json={"detail": detail, "limit": None})
        return route.continue_()

    with served(app) as page:
        page.route("**/api/long", queue_full_once)
        submit(page, TEXT, timeout=60_000)
        note = page.inner_text("#long-note")
        short_hidden = page.locator("#heatmap").is_hidden()
        page.select_option("#layer", str(LAYER))
        page.select_option("#head", str(HEAD))
        page.wait_for_function(f"document.getElementById('long').dataset.head === '{LAYER},{HEAD}'")
        rows = page.eval_on_selector_all(
            "#long-table tr[data-layer]",
            "trs => trs.map(tr => [+tr.dataset.layer, +tr.dataset.head, +tr.dataset.entropy,"
            " +tr.dataset.first])",
        )
        # the middle of the heatmap: a query's top keys on hover, then a click
        page.locator("#long-heatmap").scroll_into_view_if_needed()
        box = page.locator("#long-heatmap").bounding_box()
        width = page.eval_on_selector("#long-heatmap", "c => c.width")
        scale = box["width"] / width
        x, y = box["x"] + (46 + 300) * scale, box["y"] + (6 + 200) * scale
        page.mouse.move(x, y)
        hover = page.eval_on_selector("#long-hover", "p => [+p.dataset.q, +p.dataset.k]")
        hover_text = page.inner_text("#long-hover")
        page.mouse.click(x, y)
        page.wait_for_selector("#long-region")
        queries = page.get_attribute("#long-region", "data-queries")
        keys = page.get_attribute("#long-region", "data-keys")
        page.locator("#long-region").scroll_into_view_if_needed()
        region_box = page.locator("#long-region").bounding_box()
        cells, hovered = [], "p => [+p.dataset.q, +p.dataset.k, +p.dataset.w]"
        for i, j in CELLS:  # a few cells' hover numbers
            x = region_box["x"] + (j + 0.5) * region_box["width"] / 64
            page.mouse.move(x, region_box["y"] + (i + 0.5) * region_box["height"] / 64)
            cells.append(page.eval_on_selector("#long-region-hover", hovered))
        page.click("#long-table button[data-sort='entropy']")
        focused = page.eval_on_selector(
            "#long-table tbody tr", "tr => [+tr.dataset.layer, +tr.dataset.head]"
        )
        page.click("#long-table tbody tr:first-child button")  # show the most focused head
        page.wait_for_function(
            f"document.getElementById('long').dataset.head === '{focused[0]},{focused[1]}'"
        )
        chosen = page.input_value("#layer"), page.input_value("#head")
        ARTIFACTS.mkdir(exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "serve-long.png"), full_page=True)
        submit(page, SHORTER, timeout=60_000)
        shorter_note = page.inner_text("#long-note")
        shorter_rows = page.locator("#long-table tr[data-layer]").count()
        submit(page, "The bank of the river")  # back to every weight
        back = page.locator("#heatmap-table").is_visible(), page.locator("#long").is_hidden()

    assert len(full) == 1  # the 503 was answered, and the page read the text after it
    assert f"This text has {len(TEXT):,} characters" in note and "(max_chars)" in note, note
    T_shorter = len(minilm.encode(SHORTER).ids)
    assert f"This text has {T_shorter} tokens" in shorter_note, shorter_note
    assert "(max_tokens)" in shorter_note and shorter_rows == 72
    assert back == (True, True), "a short text after a long one is not drawn whole"
    assert short_hidden, "the views of every weight are shown for a long text"
    assert len(rows) == 6 * 12
    for layer, head, entropy, first in rows:
        assert entropy == pytest.approx(want.entropy[layer, head].mean().item(), rel=1e-6)
        assert first == pytest.approx(want.first_token_mass[layer, head].mean().item(), rel=1e-6)
    lowest = want.entropy.mean(-1).flatten().argmin().item()
    assert focused == [lowest // 12, lowest % 12]
    assert chosen == (str(focused[0]), str(focused[1]))  # the layer and head controls follow
    q, k = hover
    assert 0 <= q < T and 0 <= k < T and abs(q - T * 200 / 512) <= 1 and abs(k - T * 300 / 512) <= 1
    for key in want.top_keys[LAYER, HEAD, q].tolist():
        assert f"({key})" in hover_text
    q0, q1 = (int(n) for n in queries.split(","))
    k0, k1 = (int(n) for n in keys.split(","))
    assert (q1 - q0, k1 - k0) == (64, 64) and q0 <= q < q1 and k0 <= k < k1
    assert (q0, k0) == (q - 32, k - 32)  # centred on the click, away from the edges
    weights = region(seen.records[LAYER], queries=(q0, q1), keys=(k0, k1), heads=[HEAD])[0]
    full = seen.weights[LAYER, HEAD]
    for (i, j, w), (di, dj) in zip(cells, CELLS, strict=True):
        assert (i, j) == (q0 + di, k0 + dj)
        assert w == pytest.approx(weights[i - q0, j - k0].item(), abs=1e-7)
        assert w == pytest.approx(full[i, j].item(), abs=1e-6)
    picture = matplotlib.image.imread(ARTIFACTS / "serve-long.png")
    assert picture[..., :3].std() > 0.05, "the screenshot is blank"

"""The explorer's "why" panel in a real headless Chromium against a real server on loopback
(one page load): a clicked pair's score, weight, largest terms, parts, carried words and checks
are `qkv.why`'s for the same pair, to the last digit; a text that is markup stays text."""

from __future__ import annotations

import qkv
from browser import ARTIFACTS, served, submit
from qkv.inspect.why import encoded_why
from qkv.serve import Limits, create_app

# markup in the text: its tokens ("<", "img", "onerror", ...) must reach the panel as text
TEXT = 'I sat by the river bank <img src=x onerror="document.body.dataset.pwned=1"></script>'
LAYER, HEAD = 2, 11


def panel(page) -> dict:
    """Every number the why panel keeps, as the page holds it (data- attributes)."""
    number = lambda id: float(page.get_attribute(f"#{id}", "data-value"))  # noqa: E731
    rows = ("([sel, names]) => [...document.querySelectorAll(sel)]"
            ".map(e => names.map(n => e.dataset[n]))")  # fmt: skip
    return {
        "score": number("why-score"),
        "weight": number("why-weight"),
        "total": number("why-total"),
        "ranked": page.evaluate(rows, ["#why-terms tbody tr", ["queryPart", "keyPart", "value"]]),
        "query_parts": page.evaluate(rows, ["#why-query-parts li", ["part", "value"]]),
        "carried": page.evaluate(rows, ["#why-carried > li", ["side", "part", "value"]]),
        "carried_words": page.evaluate(rows, ["#why-carried .carried-word", ["index", "value"]]),
        "checks": page.evaluate(rows, ["#why-checks tbody tr", [
            "side", "part", "position", "predictedScore", "realScore", "predictedWeight",
            "realWeight"]]),
        "title": page.inner_text("#why-title"),
    }  # fmt: skip


def test_the_why_panel_is_qkv_why_and_keeps_markup_as_text(minilm):
    want = qkv.why(minilm, TEXT, "bank", "river", layer=LAYER, head=HEAD)
    encoded = minilm.encode(TEXT)
    lt = want.tokens.index("<")
    hostile = encoded_why(minilm.model, encoded, lt, lt + 1, layer=LAYER, head=HEAD)
    app = create_app({"minilm": minilm}, Limits())  # its own: a served app's pool ends with it
    with served(app) as page:
        submit(page, TEXT)
        page.select_option("#layer", str(LAYER))
        page.select_option("#head", str(HEAD))
        q, k = want.query_index, want.key_index
        page.locator(f"#heatmap-table td[data-q='{q}'][data-k='{k}']").click()
        page.wait_for_function(
            f"document.getElementById('why').dataset.pair === '{LAYER},{HEAD},{q},{k}'",
            timeout=30_000,
        )
        got = panel(page)
        ARTIFACTS.mkdir(exist_ok=True)
        page.locator("#why").screenshot(path=str(ARTIFACTS / "serve-why.png"))
        # a pair of markup's tokens: "<" over "img"
        page.locator(f"#heatmap-table td[data-q='{lt}'][data-k='{lt + 1}']").click()
        page.wait_for_function(
            f"document.getElementById('why').dataset.pair === '{LAYER},{HEAD},{lt},{lt + 1}'",
            timeout=30_000,
        )
        markup = panel(page)
        planted = page.evaluate("document.querySelectorAll('#why img, #why script').length")
        pwned = page.evaluate("document.body.dataset.pwned === undefined")

    assert got["score"] == want.score and got["weight"] == want.weight
    assert got["total"] == want.total
    title = f"Why “bank” (token {q}) attends to “river” (token {k}): layer 2, head 11"
    assert got["title"] == title
    assert [[a, b, float(v)] for a, b, v in got["ranked"]] == [list(t) for t in want.ranked(10)]
    assert [[p, float(v)] for p, v in got["query_parts"]] == [
        [p, v] for p, v in want.by_part("query")[:5]
    ]
    assert [[s, p, float(v)] for s, p, v in got["carried"]] == [
        [c.side, c.part, c.value] for c in want.carried
    ]
    assert [[int(i), float(v)] for i, v in got["carried_words"]] == [
        [i, v] for c in want.carried for _, i, _, v in c.words
    ]
    assert len(got["checks"]) == len(want.checks) == 6  # 3 parts of each side removed
    for shown, check in zip(got["checks"], want.checks, strict=True):
        assert shown[:3] == [check.side, check.part, str(check.position)]
        numbers = [check.predicted_score, check.real_score, check.predicted_weight,
                   check.real_weight]  # fmt: skip
        assert [float(x) for x in shown[3:]] == numbers
    # the markup's tokens are text in the title, and no element was made of them
    assert markup["score"] == hostile.score and markup["weight"] == hostile.weight
    assert markup["title"].startswith(
        f"Why “<” (token {lt}) attends to “{encoded.pieces[lt + 1]}” (token {lt + 1})"
    )
    assert planted == 0 and pwned

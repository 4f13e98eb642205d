"""`qkv show`'s page and its "why" panel in a real headless Chromium, offline: a pair taken
apart when the page was written shows `qkv.why`'s numbers to the last digit; any other pair
says it was not and offers those that were; a text that is markup stays text."""

from __future__ import annotations

import qkv
from browser import ARTIFACTS, offline
from qkv.inspect.why import encoded_why
from qkv.viz.page_why import PAGE_CHECKS, PAGE_WHYS
from qkv.viz.show import draw_attention

TEXT = 'I sat by the river bank <img src=x onerror="document.body.dataset.pwned=1"></script>'
LAYER, HEAD = 2, 11


def numbers(page) -> dict:
    """The panel's numbers, as the page keeps them (data- attributes)."""
    rows = ("([sel, names]) => [...document.querySelectorAll(sel)]"
            ".map(e => names.map(n => e.dataset[n]))")  # fmt: skip
    return {
        "pair": page.get_attribute("#why", "data-pair"),
        "score": float(page.get_attribute("#why-score", "data-value")),
        "weight": float(page.get_attribute("#why-weight", "data-value")),
        "ranked": page.evaluate(rows, ["#why-terms tbody tr", ["queryPart", "keyPart", "value"]]),
        "key_parts": page.evaluate(rows, ["#why-key-parts li", ["part", "value"]]),
        "carried": page.evaluate(rows, ["#why-carried > li", ["side", "part", "value"]]),
        "checks": page.evaluate(rows, ["#why-checks tbody tr", ["part", "realScore",
                                                                "predictedWeight"]]),
        "title": page.inner_text("#why-title"),
    }  # fmt: skip


def test_the_pages_why_panel_is_qkv_why_and_says_which_pairs_it_holds(minilm, tmp_path):
    seen = minilm.attentions(TEXT)
    out = tmp_path / "page.html"
    draw_attention(seen, out, name="minilm", text=TEXT, model=minilm.model, layer=LAYER,
                   head=HEAD)  # fmt: skip
    want = qkv.why(minilm, TEXT, "bank", "river", layer=LAYER, head=HEAD, checks=PAGE_CHECKS)
    q, k = want.query_index, want.key_index
    assert int(seen.weights[LAYER, HEAD, q].argmax()) == k  # river: bank's strongest key
    lt = seen.tokens.index("<")  # a token of the markup, one of the first PAGE_WHYS
    strongest = int(seen.weights[LAYER, HEAD, lt].argmax())
    markup = encoded_why(minilm.model, seen.encoded, lt, strongest, layer=LAYER, head=HEAD,
                         checks=PAGE_CHECKS)  # fmt: skip
    with offline(out) as page:
        page.locator(f"#heatmap-table td[data-q='{q}'][data-k='{k}']").click()
        page.wait_for_function(f"document.getElementById('why').dataset.pair === "
                               f"'{LAYER},{HEAD},{q},{k}'")  # fmt: skip
        got = numbers(page)
        ARTIFACTS.mkdir(exist_ok=True)
        page.locator("#why").screenshot(path=str(ARTIFACTS / "report-why.png"))
        page.locator(f"#heatmap-table td[data-q='{q}'][data-k='0']").click()  # bank -> [CLS]
        page.wait_for_function("document.getElementById('why').dataset.pair === 'none'")
        missing = page.inner_text("#why-missing")
        offered = page.eval_on_selector_all(
            ".why-pair", "bs => bs.map(b => [+b.dataset.q, +b.dataset.k])"
        )
        page.locator(f".why-pair[data-q='{lt}']").click()  # a pair it holds: shown
        page.wait_for_function(f"document.getElementById('why').dataset.pair === "
                               f"'{LAYER},{HEAD},{lt},{strongest}'")  # fmt: skip
        hostile = numbers(page)
        planted = page.evaluate("document.querySelectorAll('img, #why script').length")
        pwned = page.evaluate("document.body.dataset.pwned !== undefined")

    assert got["score"] == want.score and got["weight"] == want.weight
    title = f"Why “bank” (token {q}) attends to “river” (token {k}): layer 2, head 11"
    assert got["title"] == title
    assert [[a, b, float(v)] for a, b, v in got["ranked"]] == [list(t) for t in want.ranked(10)]
    assert [[p, float(v)] for p, v in got["key_parts"]] == [list(t) for t in
                                                            want.by_part("key")[:5]]  # fmt: skip
    assert [[s, p, float(v)] for s, p, v in got["carried"]] == [
        [c.side, c.part, c.value] for c in want.carried
    ]
    assert [[p, float(r), float(w)] for p, r, w in got["checks"]] == [
        [c.part, c.real_score, c.predicted_weight] for c in want.checks
    ]
    assert len(want.checks) == 2 * PAGE_CHECKS
    assert "was not taken apart when the page was written" in missing
    assert f"each of the first {PAGE_WHYS} query tokens" in missing
    T = len(seen.tokens)
    assert offered == [[i, int(seen.weights[LAYER, HEAD, i].argmax())]
                       for i in range(min(T, PAGE_WHYS))]  # fmt: skip
    assert hostile["score"] == markup.score and hostile["weight"] == markup.weight
    assert hostile["title"].startswith(f"Why “<” (token {lt}) attends to")
    assert planted == 0 and not pwned

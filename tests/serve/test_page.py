"""The page in a real headless Chromium (Debian's), driven by Playwright, against a real
server on a free loopback port: what it shows must be the model's own numbers, and it must
ask nothing of any other address. A screenshot is kept in test-artifacts/serve.png."""

from __future__ import annotations

import json
from urllib.parse import urlsplit

import matplotlib.image
import pytest
from playwright.sync_api import sync_playwright

import qkv
from browser import ARTIFACTS, CHROMIUM, FLAGS, submit
from qkv.inspect.probe import probe
from qkv.serve import running

TEXT = "The bank of the river flooded the bank"  # two banks: the page names them bank#1, bank#2


def test_the_page_shows_the_models_numbers_and_stays_on_loopback(app, minilm):
    asked, outside = [], []
    with running(app) as url, sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        try:
            context = browser.new_context(viewport={"width": 1366, "height": 900})

            def only_loopback(route):
                host = urlsplit(route.request.url).hostname
                if host in ("127.0.0.1", "localhost", "::1"):
                    asked.append(route.request.url)
                    return route.continue_()
                outside.append(route.request.url)
                return route.abort()

            context.route("**/*", only_loopback)
            page = context.new_page()
            page.goto(url + "/")
            page.wait_for_function("window.qkvReady === true", timeout=20_000)
            submit(page, TEXT)
            page.select_option("#layer", "4")
            page.select_option("#head", "7")
            seen = minilm.attentions(TEXT)
            bank, river = seen.tokens.index("bank"), seen.tokens.index("river")
            page.locator(f"#heatmap-table td[data-q='{bank}'][data-k='{river}']").click()
            page.wait_for_function(
                f"document.getElementById('trace').dataset.pair === '4,7,{bank},{river}'"
            )
            cells = page.eval_on_selector_all(
                "#heatmap-table td",
                "tds => tds.map(td => [+td.dataset.q, +td.dataset.k, +td.dataset.w])",
            )
            row = page.eval_on_selector_all("#row li", "lis => lis.map(li => +li.dataset.w)")
            traced = {
                name: json.loads(page.get_attribute(f"#t-{name}", "data-values"))
                for name in (
                    "query",
                    "key",
                    "scalar",
                    "scaled",
                    "weight",
                    "contextualized",
                    "output",
                )
            }
            # the keyboard way: from the pair, one key to the right, Enter
            page.focus("#heatmap")
            page.keyboard.press("ArrowRight")
            page.keyboard.press("Enter")
            page.wait_for_function(
                f"document.getElementById('trace').dataset.pair === '4,7,{bank},{river + 1}'"
            )
            by_keyboard = json.loads(page.get_attribute("#t-weight", "data-values"))
            page.click("#compare-go")
            page.wait_for_selector("#compare-table tr[data-depth]")
            cosines = page.eval_on_selector_all(
                "#compare-table tr", "trs => trs.slice(1).map(tr => +tr.dataset.cosine)"
            )
            ARTIFACTS.mkdir(exist_ok=True)
            page.screenshot(path=str(ARTIFACTS / "serve.png"), full_page=True)
        finally:
            browser.close()

    assert outside == [], f"the page asked another address for {outside}"
    assert any(a.endswith("/api/attention") for a in asked) and any(
        "/api/trace" in a for a in asked
    )
    T = len(seen.tokens)
    assert len(cells) == T * T
    for q, k, w in cells:  # every cell of layer 4, head 7, as the model gave it (float32)
        assert w == pytest.approx(seen.weights[4, 7, q, k].item(), abs=1e-7)
    assert row == pytest.approx(seen.weights[4, 7, bank].tolist(), abs=1e-7)
    want = qkv.trace(minilm, TEXT, "bank#1", "river", layer=4, head=7)
    assert traced["query"] == pytest.approx(want.query_vector.tolist(), abs=1e-9)
    assert traced["key"] == pytest.approx(want.key_vector.tolist(), abs=1e-9)
    assert traced["scalar"] == pytest.approx(want.attention_scalar, rel=1e-9)
    assert traced["scaled"] == pytest.approx(want.scaled_scalar, rel=1e-9)
    assert traced["weight"] == pytest.approx(want.weight, abs=1e-7)
    assert traced["weight"] == pytest.approx(seen.weights[4, 7, bank, river].item(), abs=1e-5)
    assert traced["contextualized"] == pytest.approx(want.contextualized.tolist(), abs=1e-9)
    assert traced["output"] == pytest.approx(want.model_output.tolist(), abs=1e-9)
    next_word = TEXT.split()[TEXT.split().index("river") + 1]
    assert by_keyboard == pytest.approx(
        qkv.trace(minilm, TEXT, "bank#1", next_word, layer=4, head=7).weight, abs=1e-7
    )
    sentences = ["The bank on the side of the river", "The bank approved my loan."]
    assert cosines == pytest.approx(
        probe(minilm, "bank", sentences).similarity[:, 0, 1].tolist(), abs=1e-6
    )
    picture = matplotlib.image.imread(ARTIFACTS / "serve.png")
    assert picture.shape[0] > 900 and picture[..., :3].std() > 0.05, "the screenshot is blank"

"""The report page in a real headless Chromium (Debian's), driven by Playwright.

The page must work offline: every request that is not the page's own file is blocked and
counted. The numbers it shows must be the model's weights, and a screenshot is kept as a
test artifact (test-artifacts/report.png) and checked to be non-blank.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import matplotlib.image
import pytest
from playwright.sync_api import sync_playwright

import qkv
from qkv.viz import write_html

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"  # `make test` installs it
FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
ARTIFACTS = Path(__file__).parents[2] / "test-artifacts"
SENTENCE = "The bank on the side of the river"


@pytest.fixture(scope="module")
def seen():
    return qkv.load("minilm").attentions(SENTENCE)


def test_the_page_works_offline_and_shows_the_models_numbers(seen, tmp_path):
    page_file = write_html(tmp_path / "page.html", seen.weights, seen.tokens, text=SENTENCE)
    outside = []
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        try:
            context = browser.new_context(viewport={"width": 1200, "height": 900})

            def block(route):
                if route.request.url == page_file.as_uri():
                    return route.continue_()
                outside.append(route.request.url)
                return route.abort()

            context.route("**/*", block)
            page = context.new_page()
            page.goto(page_file.as_uri())
            page.wait_for_function("window.qkvReady === true", timeout=20_000)
            assert page.locator("#layer option").count() == 6
            assert page.locator("#head option").count() == 12
            page.select_option("#layer", "3")
            page.select_option("#head", "5")
            bank = seen.tokens.index("bank")
            page.locator(f"button.token[data-index='{bank}']").first.click()
            page.wait_for_function("document.querySelectorAll('#row li').length > 0")
            shown = page.eval_on_selector_all(
                "#row li", "items => items.map(li => [Number(li.dataset.k), Number(li.dataset.w)])"
            )
            title = page.inner_text("#row-title")
            ARTIFACTS.mkdir(exist_ok=True)
            page.screenshot(path=str(ARTIFACTS / "report.png"), full_page=True)
        finally:
            browser.close()
    assert outside == [], f"the page asked the network for {outside}"
    assert "bank" in title
    want = seen.weights[3, 5, bank]
    assert [k for k, _ in shown] == list(range(len(seen.tokens)))
    for k, w in shown:  # stored to 4 decimals: the model's weight, rounded
        assert abs(w - want[k].item()) <= 0.5e-4 + 1e-7
    picture = matplotlib.image.imread(ARTIFACTS / "report.png")
    assert picture.shape[0] > 300 and picture.shape[1] > 300
    assert picture[..., :3].std() > 0.05, "the screenshot is blank"

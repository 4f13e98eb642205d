"""The atlas's index page in a real headless Chromium: it sorts, filters by layer and by the
search box, and an example opens as its attention page, all offline."""

from __future__ import annotations

from playwright.sync_api import sync_playwright

from browser import CHROMIUM, FLAGS
from intervention_models import llama_like
from qkv.viz.atlas import atlas


def test_the_atlas_page_sorts_filters_and_opens_an_example(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the bank of the river was wide and deep the bank of the river was\n" * 3)
    found = atlas(llama_like(), corpus, tmp_path / "atlas", window=12, top=2)
    folder = (tmp_path / "atlas").resolve()
    outside = []

    def block(route):  # the atlas's own files only
        if route.request.url.startswith(folder.as_uri() + "/"):
            return route.continue_()
        outside.append(route.request.url)
        return route.abort()

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        try:
            context = browser.new_context()
            context.route("**/*", block)
            page = context.new_page()
            page.goto((folder / "index.html").as_uri())
            page.wait_for_function("window.qkvReady === true", timeout=20_000)
            page.select_option("#sort", "self")
            page.select_option("#order", "asc")
            rows = page.eval_on_selector_all(
                "tr.head", "rs => rs.map(r => [+r.dataset.layer, +r.dataset.head])"
            )
            want = sorted(((layer, head) for layer in range(2) for head in range(2)),
                          key=lambda lh: float(found.stats["self"][tuple(lh)]))  # fmt: skip
            assert [tuple(row) for row in rows] == want
            page.select_option("#layer", "1")
            assert page.eval_on_selector_all("tr.head", "rs => rs.map(r => r.dataset.layer)") == [
                "1", "1"]  # fmt: skip
            page.select_option("#layer", "all")
            page.fill("#search", "L0H1")
            assert page.locator("tr.head").count() == 1
            page.locator("tr.head a.example").first.click()
            page.wait_for_function("window.qkvReady === true", timeout=20_000)
            assert page.url.endswith("/examples/L0H1-0.html")
            assert page.locator("#layer option").count() == 1
            title = page.inner_text("h1")
        finally:
            browser.close()
    assert title.startswith("L0 H1 example 1:")
    assert outside == []

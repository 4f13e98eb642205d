"""What the browser tests share: Debian's Chromium, the flags it runs headless with here,
and the folder their screenshots go to."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"  # `make test` installs it
# Headless, and quiet on the network: without the background-networking flags Chromium
# calls Google's hosts at start, which a closed machine refuses.
FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
ARTIFACTS = Path(__file__).parent.parent / "test-artifacts"


def only_file(context, page_file: Path) -> list[str]:
    """Let `context` load `page_file` and nothing else: every other request is blocked and
    listed in the returned list (a page that stays offline leaves it empty)."""
    outside: list[str] = []

    def block(route):
        if route.request.url == page_file.as_uri():
            return route.continue_()
        outside.append(route.request.url)
        return route.abort()

    context.route("**/*", block)
    return outside


def only_loopback(context) -> list[str]:
    """Let `context` reach this machine's loopback addresses only (the server under test):
    every other request is blocked and listed in the returned list."""
    from urllib.parse import urlsplit

    outside: list[str] = []

    def block(route):
        if urlsplit(route.request.url).hostname in ("127.0.0.1", "localhost", "::1"):
            return route.continue_()
        outside.append(route.request.url)
        return route.abort()

    context.route("**/*", block)
    return outside


@contextmanager
def offline(page_file: Path, viewport: dict | None = None) -> Iterator:
    """A Chromium page showing `page_file`, drawn (`window.qkvReady`), every other request
    blocked; on leaving, none must have been asked for."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        try:
            context = browser.new_context(viewport=viewport or {"width": 1200, "height": 900})
            outside = only_file(context, page_file)
            page = context.new_page()
            page.goto(page_file.as_uri())
            page.wait_for_function("window.qkvReady === true", timeout=20_000)
            yield page
        finally:
            browser.close()
    assert outside == [], f"the page asked the network for {outside}"


@contextmanager
def served(app, viewport: dict | None = None) -> Iterator:
    """A Chromium page of `app`'s explorer, served on loopback and drawn (`window.qkvReady`),
    every request to another address blocked; on leaving, none must have been asked for."""
    from playwright.sync_api import sync_playwright

    from qkv.serve.server import running

    with running(app) as url, sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        try:
            context = browser.new_context(viewport=viewport or {"width": 1366, "height": 900})
            outside = only_loopback(context)
            page = context.new_page()
            page.goto(url + "/")
            page.wait_for_function("window.qkvReady === true", timeout=20_000)
            yield page
        finally:
            browser.close()
    assert outside == [], f"the page asked another address for {outside}"


def submit(page, text: str, timeout: float = 30_000) -> None:
    """Type `text` into the explorer's box, press Enter and wait until the page shows it.
    The page may show that text already (its first example): the mark is cleared first, so
    the wait is for this show, not the last one, whose end would reset a pair chosen now."""
    page.fill("#text", text)
    page.evaluate("delete document.body.dataset.shown")
    page.press("#text", "Enter")
    page.wait_for_function(f"document.body.dataset.shown === {json.dumps(text)}", timeout=timeout)


def flat(value) -> list:
    """Every leaf of a page's JSON data (dicts and lists walked): the numbers a test looks
    for on the page."""
    if isinstance(value, dict):
        return [x for v in value.values() for x in flat(v)]
    if isinstance(value, list):
        return [x for v in value for x in flat(v)]
    return [value]

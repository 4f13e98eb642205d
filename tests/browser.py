"""What the browser tests share: Debian's Chromium, the flags it runs headless with here,
and the folder their screenshots go to."""

from __future__ import annotations

import shutil
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

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

"""docs/walkthrough.md is what docs/make_walkthrough.py writes today: it cannot go stale."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

DOCS = Path(__file__).parents[1] / "docs"


def test_the_committed_walkthrough_is_the_real_output_of_today(tmp_path):
    fresh = tmp_path / "walkthrough.md"
    subprocess.run(
        [sys.executable, str(DOCS / "make_walkthrough.py"), str(fresh)], check=True, timeout=900
    )
    committed = (DOCS / "walkthrough.md").read_text()
    # how many times longer the loop takes is the machine's: every other character is not
    ratios = re.compile(r"the loop takes [\d,]+x as long")
    assert ratios.search(committed), "the parallel computation section shows its ratios"
    texts = (fresh.read_text(), committed)
    same = [ratios.sub("the loop takes Nx as long", text) for text in texts]
    assert same[0] == same[1], "run: python docs/make_walkthrough.py"
    for section in ("The algorithm", "Normalization", "Multiple heads", "Multiple layers",
                    "Tokens", "Position embeddings", "Cross-attention", "Parallel computation",
                    "Asked causally: hide a word", "Asked causally: hide the context"):  # fmt: skip
        assert f"## {section}" in committed

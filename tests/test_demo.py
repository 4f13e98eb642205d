"""`make demo`'s script, run as a process: its numbers must agree with each other."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

DEMO = Path(__file__).parents[1] / "examples" / "article_demo.py"


def test_demo_traces_bank_and_agrees_with_the_fused_backend():
    out = subprocess.run(
        [sys.executable, str(DEMO)], capture_output=True, text=True, timeout=300, check=True
    ).stdout
    weights = [float(w) for w in re.findall(r"^\s+(?!sum )\S+\s+(\d\.\d{4})\s+#*$", out, re.M)]
    assert len(weights) == 8, "one weight per word of the article's sentence"
    assert abs(sum(weights) - 1.0) < 1e-3
    gap = float(re.search(r"differs from the loop's by (\S+)", out).group(1))
    assert gap < 1e-5
    assert len(re.findall(r"^  layer \d head 0: 'bank' attends most to", out, re.M)) == 6

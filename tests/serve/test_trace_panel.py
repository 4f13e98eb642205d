"""The explorer's trace panel (serve/static/views.js) shows what a model does differently from
the article, as `qkv explain` does: drawn by node from a real trace's JSON (/api/trace's)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

import qkv
from qkv.serve.compute import trace_answer
from variant_models import TEXT, decoder, gemma2_like, tiny

VIEWS = Path(qkv.__file__).parent / "serve" / "static" / "views.js"
pytestmark = pytest.mark.skipif(shutil.which("node") is None, reason="needs node")


def drawn(traced, tmp_path: Path) -> str:
    """The panel's HTML, as drawTrace writes it for this trace."""
    shutil.copy(VIEWS, tmp_path / "views.mjs")  # an ES module, whatever node's defaults
    (tmp_path / "trace.json").write_text(json.dumps(trace_answer("tiny", traced)))
    script = (
        "import { drawTrace } from './views.mjs';\n"
        "import { readFileSync } from 'node:fs';\n"
        "const panel = { dataset: {}, innerHTML: '', querySelectorAll: () => [] };\n"
        "drawTrace(panel, JSON.parse(readFileSync('trace.json', 'utf8')), 'asked');\n"
        "process.stdout.write(panel.innerHTML);\n"
    )
    (tmp_path / "draw.mjs").write_text(script)
    result = subprocess.run(["node", "draw.mjs"], cwd=tmp_path, capture_output=True, text=True,
                            timeout=60)  # fmt: skip
    assert result.returncode == 0, result.stderr
    return result.stdout


@pytest.fixture(scope="module")
def gemma2():
    return tiny(gemma2_like())


def test_the_panel_shows_the_scale_cap_and_window(gemma2, tmp_path):
    traced = qkv.trace(gemma2, TEXT, "deep", "bank", layer=0, head=1)
    html = drawn(traced, tmp_path)
    assert "Divided by √144 = 12.000, not √16 (this model's own scale)" in html
    assert "capped to 0.02 tanh(s/0.02)" in html and "the softmax reads" in html
    assert f'data-values="{json.dumps(traced.score)}"' in html  # the score, every digit
    assert "keys 3 or more tokens back are hidden (weight 0)" in html
    assert "is 7 tokens back: outside the window, so it is hidden" in html
    assert "causal mask" not in html
    # three keys are visible to "deep" in this layer: itself and the two before it
    assert "the softmax over the\n 3 keys" in html


def test_the_panel_of_an_undivided_qk_normed_partial_rotary_model(tmp_path):
    from dataclasses import replace

    config = replace(decoder(attn_scale=1.0, qk_norm="head"), rope_dims=8)
    traced = qkv.trace(tiny(config), TEXT, "bank", "deep", layer=0, head=0)
    html = drawn(traced, tmp_path)
    assert "Not divided at all (the article divides by √16" in html
    assert "QK-norm, over each head's 16 numbers" in html
    assert "Only the first 8 of the 16 numbers turn (partial rotary)" in html
    assert "comes after" in html and "the causal mask hides it" in html
    assert "capped" not in html and "window" not in html and "softmax reads" not in html

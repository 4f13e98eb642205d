"""`qkv demo` (what `make demo` runs), run as a user runs it."""

from __future__ import annotations

import subprocess
import sys

import qkv
from qkv.cli.demo import free_folder
from qkv.inspect.article import SENTENCE
from qkv.inspect.hide import senses_without_context
from qkv.viz import read_weights


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "qkv.cli", *args], capture_output=True, text=True, timeout=300
    )


def test_demo_walks_the_article_with_minilms_own_numbers(tmp_path, minilm):
    result = run("demo", "--out", str(tmp_path / "report"))
    assert result.returncode == 0, result.stderr
    out = result.stdout
    for section in ("1. Tokens", "2. The article's steps", "3. What added most", "4. Several heads",
                    "5. Context pulls", "6. Asked causally", "7. Hide every other word",
                    "8. The report"):  # fmt: skip
        assert section in out
    # the causal sections are the library's numbers: the head that carries "river" into
    # "bank" most, and the senses that stop separating once the context is hidden
    hidden = qkv.hide(minilm, SENTENCE, "river", query="bank")
    layer, head, effect = hidden.ranked()[0]
    assert f"  {layer:>5}  {head:>4}   {effect:<8.3g}" in out
    senses = senses_without_context(minilm, "bank")
    assert senses.hidden_separation < senses.separation / 5
    hidden_line = f"every other word hidden:  separation {senses.hidden_separation:+.3f}"
    assert hidden_line in out
    traced = qkv.trace(minilm, SENTENCE, "bank", "river")
    assert f'"river" gets {100 * traced.weight:.1f}%' in out
    assert f"Layer {traced.layer}, head {traced.head} of minilm" in out
    assert "largest difference below 1e-6:" in out  # the trace's sum is the model's output
    files = sorted(p.name for p in (tmp_path / "report").iterdir())
    assert files == ["bank_senses.png", f"head_L{traced.layer}_H{traced.head}.png", "index.html",
                     "model_view.png", "tour.html"]  # fmt: skip
    index = (tmp_path / "report" / "index.html").read_text()
    assert '<a href="tour.html">Start with the guided tour' in index  # the page opened first
    weights, tokens = read_weights(index)
    seen = minilm.attentions(SENTENCE)
    assert tokens == seen.tokens
    assert abs(weights - seen.weights.numpy()).max() <= 0.5e-4 + 1e-7  # stored to 4 decimals
    # a used folder is never overwritten: the next demo writes report-2 (the folder the demo
    # asks free_folder for; a second demo run would cost the suite 15 s to show the same)
    assert free_folder(tmp_path / "report") == tmp_path / "report-2"
    (tmp_path / "empty").mkdir()
    assert free_folder(tmp_path / "empty") == tmp_path / "empty"  # an empty one is used

"""`qkv demo` (what `make demo` runs) and `qkv show`, run as a user runs them."""

from __future__ import annotations

import subprocess
import sys

import pytest

import qkv
from qkv.inspect.demo import SENTENCE, free_folder
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
    hidden_line = (
        f"every other word hidden:  same sense minus different {senses.hidden_separation:+.3f}"
    )
    assert hidden_line in out
    traced = qkv.trace(minilm, SENTENCE, "bank", "river")
    assert f'"river" gets {100 * traced.weight:.1f}%' in out
    assert f"Layer {traced.layer}, head {traced.head} of minilm" in out
    assert "largest difference below 1e-6:" in out  # the trace's sum is the model's output
    files = sorted(p.name for p in (tmp_path / "report").iterdir())
    assert files == ["bank_senses.png", f"head_L{traced.layer}_H{traced.head}.png", "index.html",
                     "model_view.png"]  # fmt: skip
    weights, tokens = read_weights((tmp_path / "report" / "index.html").read_text())
    seen = minilm.attentions(SENTENCE)
    assert tokens == seen.tokens
    assert abs(weights - seen.weights.numpy()).max() <= 0.5e-4 + 1e-7  # stored to 4 decimals
    # a used folder is never overwritten: the next demo writes report-2 (the folder the demo
    # asks free_folder for; a second demo run would cost the suite 15 s to show the same)
    assert free_folder(tmp_path / "report") == tmp_path / "report-2"
    (tmp_path / "empty").mkdir()
    assert free_folder(tmp_path / "empty") == tmp_path / "empty"  # an empty one is used


@pytest.mark.parametrize("name", ["page.html", "head.png", "folder"])
def test_show_writes_a_page_a_heatmap_or_a_report(tmp_path, name):
    result = run("show", SENTENCE, "--out", str(tmp_path / name), "--layer", "2", "--head", "3")
    assert result.returncode == 0, result.stderr
    assert (tmp_path / name).exists()
    if name == "folder":
        assert (tmp_path / name / "head_L2_H3.png").exists()


def test_show_draws_a_grid_of_the_chosen_layers_and_heads(tmp_path):
    import matplotlib.image

    few = run(
        "show", SENTENCE, "--layers", "0-1", "--heads", "0,5", "--out", str(tmp_path / "a.png")
    )
    many = run("show", SENTENCE, "--layers", "0-5", "--out", str(tmp_path / "b.png"))
    assert few.returncode == 0 and many.returncode == 0, few.stderr + many.stderr
    small, large = (matplotlib.image.imread(tmp_path / name) for name in ("a.png", "b.png"))
    assert small.shape[0] * small.shape[1] < large.shape[0] * large.shape[1]
    bad = run("show", SENTENCE, "--heads", "1,x", "--out", str(tmp_path / "c.png"))
    assert bad.returncode == 2 and "--heads takes numbers like 0,2,5" in bad.stderr


def test_show_and_demo_refuse_bad_input_in_one_line(tmp_path):
    bad = run("show", SENTENCE, "--layer", "6", "--out", str(tmp_path / "x.html"))
    assert (
        bad.returncode == 2
        and bad.stderr.strip() == "error: layer 6 is out of range: minilm has 6 layers (0-5)"
    )
    assert not (tmp_path / "x.html").exists()
    empty = run("show", "   ", "--out", str(tmp_path / "y.html"))
    assert empty.returncode == 2 and not (tmp_path / "y.html").exists()

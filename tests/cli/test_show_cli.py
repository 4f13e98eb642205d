"""`qkv show`, run as a user runs it: a page, a heatmap, a grid or a report folder."""

from __future__ import annotations

import subprocess
import sys

import pytest

from qkv.inspect.article import SENTENCE


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "qkv.cli", *args], capture_output=True, text=True, timeout=300
    )


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

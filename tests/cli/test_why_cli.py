"""`qkv why`, and `qkv explain`'s step "Why this scalar", on the embedded MiniLM: what they print
is `qkv.why`'s numbers, --json is its `to_dict`, --out a whole PNG, a mistake one clear line."""

from __future__ import annotations

import json
import math
import struct
import subprocess
import sys

import pytest
from typer.testing import CliRunner

import qkv
import qkv.pretrained
from qkv.cli import app
from qkv.viz.why_lines import pair_words, why_lines, why_step

TEXT = "I sat by the river bank"


@pytest.fixture
def run(minilm, monkeypatch):
    """`qkv ARGS` in this process, on the session's MiniLM (loaded once)."""
    monkeypatch.setattr(qkv.pretrained, "load", lambda *args, **kwargs: minilm)
    runner = CliRunner()
    return lambda *args: runner.invoke(app, [str(a) for a in args])


def png_size(data: bytes) -> tuple[int, int]:
    """(width, height) from a PNG's header, which must be one."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_why_prints_the_librarys_terms_and_writes_the_grid(minilm, tmp_path):
    picture = tmp_path / "why" / "terms.png"
    done = subprocess.run(
        [sys.executable, "-m", "qkv.cli", "why", TEXT, "--query", "bank", "--key", "river",
         "--layer", "2", "--head", "11", "--top", "5", "--out", str(picture)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    expected = qkv.why(minilm, TEXT, "bank", "river", layer=2, head=11)
    assert done.stdout == why_lines(expected, 5) + f"\nwrote {picture}\n"
    (a, b, value), *_ = expected.ranked(1)
    assert f"{value:+9.4f}" in done.stdout and f"Score {expected.score:+.4f}" in done.stdout
    assert f"  {pair_words(expected, a, b)}\n" in done.stdout
    c = expected.checks[0]
    assert f"score {c.predicted_score:+.4f} -> {c.real_score:+.4f}" in done.stdout
    width, height = png_size(picture.read_bytes())
    assert width > 600 and height > 400
    assert sorted(p.name for p in picture.parent.iterdir()) == ["terms.png"]


def same(got, want, where: str = "") -> None:
    """JSON's `got` is `want`: the same keys and lists, floats within rounding."""
    if isinstance(want, dict):
        assert isinstance(got, dict) and got.keys() == want.keys(), where
        for key in want:
            same(got[key], want[key], f"{where}.{key}")
    elif isinstance(want, list | tuple):
        assert isinstance(got, list) and len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            same(g, w, f"{where}[{i}]")
    elif isinstance(want, float):
        assert math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-12), (where, got, want)
    else:
        assert got == want, where


def test_why_json_is_the_librarys_to_dict(minilm, run):
    done = run("why", TEXT, "--query", "bank", "--key", "river", "--json", "--top", "7",
               "--checks", "1", "--layer", "2")  # fmt: skip
    assert done.exit_code == 0, done.output
    expected = qkv.why(minilm, TEXT, "bank", "river", layer=2, checks=1)
    data = json.loads(done.stdout)
    same(data, expected.to_dict(7))
    assert len(data["ranked"]) == 7 and len(data["checks"]) == 2
    assert data["chosen"] == "where the query word attends most to the key word"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--key", "lake"], "error: 'lake' is not a word"),
        (["--key", "river", "--layer", "9"], "error: layer 9 is out of range: minilm has layers"),
        (["--key", "river", "--top", "0"], "error: --top must be 1 or more, got 0"),
        (["--key", "river", "--checks", "-1"], "error: --checks must be 0 or more, got -1"),
    ],
)
def test_a_mistake_is_one_clear_line_and_leaves_no_file(run, tmp_path, args, message):
    picture = tmp_path / "out" / "terms.png"
    done = run("why", TEXT, "--query", "bank", *args, "--out", picture)
    assert done.exit_code == 2 and done.stderr.startswith(message), done.output
    assert len(done.stderr.strip().splitlines()) == 1 and done.stdout == ""
    assert list(tmp_path.iterdir()) == []  # neither the file nor its folder


def test_an_out_that_is_not_a_png_is_refused_before_the_model_loads(monkeypatch, tmp_path):
    def load(*args, **kwargs):
        raise AssertionError("the model loaded before --out was checked")

    monkeypatch.setattr(qkv.pretrained, "load", load)
    done = CliRunner().invoke(app, ["why", TEXT, "--query", "bank", "--key", "river", "--out",
                                    str(tmp_path / "terms.jpg")])  # fmt: skip
    assert done.exit_code == 2 and "must end in .png" in done.output
    assert list(tmp_path.iterdir()) == []


def test_explain_tells_why_this_scalar_after_step_3(minilm, run):
    done = run("explain", TEXT, "--query", "bank", "--key", "river", "--layer", "2", "--head", "11")
    assert done.exit_code == 0, done.output
    expected = qkv.why(minilm, TEXT, "bank", "river", layer=2, head=11, checks=0)
    step = "\n".join(why_step(expected))
    assert step in done.stdout
    assert done.stdout.index("3. Attention scalar") < done.stdout.index(step)
    assert done.stdout.index(step) < done.stdout.index("4. Softmax")
    traced = qkv.trace(minilm, TEXT, "bank", "river", layer=2, head=11)
    assert expected.total == pytest.approx(traced.scaled_scalar, rel=1e-5)
    for a, b, value in expected.ranked(3):
        assert f"     {value:+.4f}  {pair_words(expected, a, b)}\n" in done.stdout
    assert f"All 900 terms sum to {expected.total:+.4f}" in step

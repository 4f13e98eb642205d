"""`qkv tour`: writes the page of `qkv.viz.tour`, refuses a bad word or path in one line."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

import qkv.pretrained
from qkv.cli import app


@pytest.fixture
def run(minilm, monkeypatch):
    """`qkv ARGS` in this process, on the session's MiniLM (loaded once)."""
    monkeypatch.setattr(qkv.pretrained, "load", lambda *args, **kwargs: minilm)
    runner = CliRunner()
    return lambda *args: runner.invoke(app, [str(a) for a in args])


def test_tour_writes_the_page_of_the_text(run, minilm, tmp_path):
    out = tmp_path / "pages" / "cats.html"
    done = run("tour", "Cats chase mice at night", "--query", "mice", "--key", "cats",
               "--swap", "dogs", "--out", out)  # fmt: skip
    assert done.exit_code == 0 and f"wrote {out}" in done.output
    page = out.read_text(encoding="utf-8")
    data = json.loads(page.split('id="tour-data">')[1].split("</script>")[0])
    traced = qkv.trace(minilm, "Cats chase mice at night", "mice", "cats")
    assert (data["query"], data["key"], data["layer"], data["head"]) == (
        "mice", "cats", traced.layer, traced.head)  # fmt: skip
    swapped = next(s for s in data["steps"] if s["id"] == "scaling")["experiments"][0]
    assert swapped["result"]["text"] == "dogs chase mice at night"


def test_mistakes_are_one_line_and_write_nothing(run, tmp_path):
    done = run("tour", "--query", "boat", "--out", tmp_path / "t.html")
    assert done.exit_code == 2 and "'boat' is not a word of the text" in done.output
    done = run("tour", "--out", tmp_path / "t.png")
    assert done.exit_code == 2 and "must end in .html" in done.output
    assert list(tmp_path.iterdir()) == []

"""`qkv circuits`: the strongest compositions it prints, in text and JSON, are the library's;
--head adds that head's token tables; bad options are one-line errors."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from typer.testing import CliRunner

import qkv
import qkv.pretrained
from qkv.cli import app
from variant_models import decoder, tiny


@pytest.fixture(scope="module")
def model():
    return tiny(replace(decoder(num_heads=4, num_kv_heads=2), num_layers=3))


@pytest.fixture
def run(model, monkeypatch):
    monkeypatch.setattr(qkv.pretrained, "load", lambda *args, **kwargs: model)
    runner = CliRunner()
    return lambda *args: runner.invoke(app, ["circuits", "--model", "tiny", *args])


def test_the_printed_compositions_are_the_librarys(run, model):
    found = qkv.circuits(model)
    for kind in ("q", "k", "v"):
        expected = found.strongest(kind, 4)
        shown = run("--kind", kind, "--top", "4")
        assert shown.exit_code == 0, shown.output
        lines = shown.stdout.splitlines()
        start = next(i for i, line in enumerate(lines) if "sender" in line) + 1
        rows = [line.split() for line in lines[start : start + 4]]
        assert rows == [[s, r, f"{v:.4f}"] for s, r, v in expected]
        assert lines[start - 2].startswith(f"{kind.upper()}-composition")
        data = json.loads(run("--kind", kind, "--top", "4", "--json").stdout)
        assert [(p["sender"], p["receiver"], p["score"]) for p in data["strongest"]] == expected


def test_head_adds_its_token_tables(run, model):
    head = qkv.circuits(model).head_circuit(2, 3, top=3)
    shown = run("--head", "L2.H3", "--top", "3")
    assert shown.exit_code == 0, shown.output
    lines = shown.stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("L2.H3 (key and value"))
    q, k, s = head.pairs[0]
    assert lines[start + 2].split() == ["#1", repr(q), repr(k), f"{s:.4f}"]
    assert any(line.startswith(f"OV circuit: copying score {head.copying:+.4f}") for line in lines)
    data = json.loads(run("--head", "2.3", "--top", "3", "--json").stdout)
    assert data["head"]["pairs"][0]["score"] == s and data["head"]["copying"] == head.copying
    assert len(data["head"]["by_distance"]) == 3  # rotary: the top pairs at other distances


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--kind", "x"], "error: --kind must be q, k or v, got 'x'"),
        (["--top", "0"], "error: --top must be 1 or more, got 0"),
        (["--head", "2"], "error: --head is a layer and a head as L.H, e.g. 3.5 or L3.H5; got '2'"),
        (["--head", "2.7"], "error: head 7 is out of range: layer 2 has 4 heads (0..3)"),
    ],
)
def test_bad_options_are_one_line_errors(run, args, message):
    told = run(*args)
    assert told.exit_code == 2 and told.stderr == message + "\n"

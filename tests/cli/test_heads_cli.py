"""`qkv heads`: the census as a table, a PNG scatter and JSON, the two telling the same."""

from __future__ import annotations

import json

import matplotlib.image as mpimg
import pytest
import torch
from typer.testing import CliRunner

from qkv.cli import app


def test_heads_prints_the_table_draws_the_scatter_and_dumps_json(tmp_path):
    runner = CliRunner()
    dumped = runner.invoke(app, ["heads", "--json", "--top", "3"])  # minilm by default
    assert dumped.exit_code == 0, dumped.output
    found = json.loads(dumped.stdout)
    assert (found["source"], found["layers"], found["heads"]) == ("minilm", 6, 12)
    assert set(found["top"]) == set(found["scores"]) and len(found["top"]["induction"]) == 3
    assert found["scores"]["window_use"] == [None] * 6 and found["top"]["window_use"] == []
    grid = torch.tensor(found["scores"]["first_token"])  # (L, H)
    assert found["first_token_per_layer"] == pytest.approx(grid.mean(1).tolist())
    best = found["top"]["previous_token"][0]
    assert best["score"] == max(map(max, found["scores"]["previous_token"]))

    png = tmp_path / "plots" / "census.png"
    table = runner.invoke(app, ["heads", "--top", "2", "--out", str(png)])
    assert table.exit_code == 0, table.output
    lines = table.stdout.splitlines()
    assert lines[0].startswith("minilm: 6 layers x 12 heads")
    row = next(line for line in lines if line.strip().startswith("previous token"))
    assert f"L{best['layer']} H{best['head']} {best['score']:.3f}" in row
    assert row.count(" H") == 2
    sinks = [line for line in lines if line.startswith("  layer ")]
    assert [float(line.split()[2]) for line in sinks] == pytest.approx(
        found["first_token_per_layer"], abs=6e-4
    )
    assert lines[-1] == f"wrote {png}" and mpimg.imread(png).shape[2] == 4


def test_heads_refuses_a_bad_out_before_any_work(tmp_path):
    runner = CliRunner()
    result = runner.invoke(app, ["heads", "--out", str(tmp_path / "census.txt")])
    assert result.exit_code == 2
    assert result.stderr == f"error: --out {tmp_path / 'census.txt'} must end in .png\n"
    result = runner.invoke(app, ["heads", "--top", "0"])
    assert result.exit_code == 2 and result.stderr == "error: --top must be 1 or more, got 0\n"
    assert list(tmp_path.iterdir()) == []

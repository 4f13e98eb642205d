"""`qkv hide`, `qkv ablate`, `qkv lens` and `qkv heads` over a file of prompts (--texts): the
means with their intervals printed, every prompt's values in --json, the library's own."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from qkv.cli import app
from qkv.inspect.ablate import ablate
from qkv.inspect.hide import hide
from qkv.inspect.lens import lens

PROMPTS = ["The bank of the river was muddy.", "A river ran past the old bank.",
           "By the river the grassy bank sloped down to the water."]  # fmt: skip


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "prompts.tsv"
    path.write_text("".join(f"{text}\tsome label\n" for text in PROMPTS))
    return path


def invoke(*args: str):
    result = CliRunner().invoke(app, list(args))
    assert result.exit_code == 0, result.output
    return result.stdout


def test_hide_over_a_file_prints_means_with_intervals_and_json_has_each_prompt(minilm, prompts):
    asked = ["--key", "river", "--query", "bank", "--layers", "5", "--heads", "0,6"]
    expected = hide(minilm, prompts, "river", query="bank", layers=[5], heads=[0, 6])
    data = json.loads(invoke("hide", "--texts", str(prompts), *asked, "--json"))
    assert data["texts"] == PROMPTS
    effect = data["spreads"]["effect"]
    assert len(effect["per_prompt"]) == 3 and effect["level"] == 0.95
    assert effect["per_prompt"][2][5][6] == pytest.approx(
        float(expected.spreads["effect"].values[2, 5, 6]), rel=1e-4
    )
    assert data["total"] == pytest.approx(expected.total, rel=1e-4)
    shown = invoke("hide", "--texts", str(prompts), *asked)
    assert "over 3 prompts" in shown
    low, high = (float(expected.spreads["total"].low), float(expected.spreads["total"].high))
    assert f"1 - cosine {expected.total:.3g} [{low:.3g}, {high:.3g}]" in shown


def test_ablate_over_a_file_is_the_librarys(minilm, prompts):
    data = json.loads(invoke("ablate", "--texts", str(prompts), "--layers", "5", "--heads", "6",
                             "--json"))  # fmt: skip
    expected = ablate(minilm, prompts, [(5, 6)])
    assert data["total"] == pytest.approx(expected.total, rel=1e-4)
    assert data["effect"][5][6] == pytest.approx(data["total"], rel=1e-9)  # one head: the total
    assert [round(v, 6) for v in data["spreads"]["total"]["per_prompt"]] == [
        round(float(v), 6) for v in expected.spreads["total"].values
    ]


def test_heads_over_a_file_prints_intervals(prompts):
    shown = invoke("heads", "--texts", str(prompts), "--top", "1")
    assert "then over 3 prompts" in shown
    row = next(line for line in shown.splitlines() if line.strip().startswith("previous token"))
    assert row.count("[") == 1 and row.rstrip().endswith("]")


def test_lens_over_a_file_of_prompts(smollm2, tmp_path):
    path = tmp_path / "prompts.jsonl"
    texts = ["The capital of France is", "The capital of Italy is the city of"]
    path.write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))
    data = json.loads(invoke("lens", "--texts", str(path), "--no-attribution", "--top", "2",
                             "--json"))  # fmt: skip
    expected = lens(smollm2, texts, top=2, attribute=False)
    assert data["texts"] == texts and data["positions"] == expected.positions
    assert data["logprob"] == pytest.approx(expected.logprob, abs=1e-4)
    assert len(data["spreads"]["rank"]["per_prompt"]) == 2


@pytest.mark.parametrize(
    "args, message",
    [
        (["hide", "A text", "--texts", "PROMPTS", "--key", "river"], "not both"),
        (["ablate"], "give the text, or --texts FILE"),
        (["hide", "--texts", "MISSING", "--key", "river"], "MISSING does not exist"),
    ],
)
def test_text_or_file_refused_in_one_line(args, message, prompts, tmp_path):
    args = [str(prompts) if a == "PROMPTS" else str(tmp_path / a) if a == "MISSING" else a
            for a in args]  # fmt: skip
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2 and message in result.stderr and result.stdout == ""

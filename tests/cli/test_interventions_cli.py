"""`qkv hide`, `qkv ablate` and `qkv patch`, run as a user runs them: real processes on the
embedded models, their numbers the library's own."""

from __future__ import annotations

import json
import subprocess
import sys

import matplotlib.image
import pytest
import torch

from qkv.inspect.ablate import ablate
from qkv.inspect.hide import hide
from qkv.inspect.patch import Metric

TEXT = "The bank on the side of the river"


def qkv_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "qkv.cli", *args], capture_output=True, text=True, timeout=300
    )


def test_hide_prints_the_heads_that_carry_the_key_and_its_json_is_the_librarys(minilm, tmp_path):
    picture = tmp_path / "hide.png"
    shown = qkv_cli("hide", TEXT, "--key", "river", "--query", "bank", "--out", str(picture))
    assert shown.returncode == 0, shown.stderr
    expected = hide(minilm, TEXT, "river", query="bank")
    (layer, head, effect), *_ = expected.ranked()
    lines = shown.stdout.splitlines()
    assert lines[3].split()[:3] == [str(layer), str(head), f"{effect:.3g}"]
    assert f"1 - cosine {expected.total:.3g}" in shown.stdout
    image = matplotlib.image.imread(picture)
    assert image.ndim == 3 and image.shape[0] > 100
    as_json = qkv_cli("hide", TEXT, "--key", "river", "--query", "bank", "--json",
                      "--layers", "4-5", "--heads", "0,6")  # fmt: skip
    assert as_json.returncode == 0, as_json.stderr
    data = json.loads(as_json.stdout)
    subset = hide(minilm, TEXT, "river", query="bank", layers=[4, 5], heads=[0, 6])
    assert data["layers"] == [4, 5] and data["heads"] == [0, 6]
    assert data["effect"][5][6] == pytest.approx(float(subset.effect[5, 6]), rel=1e-4)
    assert data["effect"][0][0] is None
    assert data["total"] == pytest.approx(subset.total, rel=1e-4)


def test_ablate_json_is_each_head_alone(minilm):
    shown = qkv_cli("ablate", TEXT, "--layers", "5", "--json")
    assert shown.returncode == 0, shown.stderr
    data = json.loads(shown.stdout)
    expected = ablate(minilm, TEXT, [5])
    assert data["heads"] == [[5, h] for h in range(12)]
    torch.testing.assert_close(
        torch.tensor(data["effect"][5], dtype=torch.float64), expected.effect[5], rtol=1e-4,
        atol=1e-7,
    )  # fmt: skip
    assert data["total"] == pytest.approx(expected.total, rel=1e-4)


def test_patch_json_holds_the_runs_own_metrics(smollm2):
    """The clean and corrupted metrics are those of plain forwards; the last layer's residual
    patched at the last position is the clean run, at any earlier position the corrupted."""
    clean, corrupt = "Mary met John. John thanked", "Mary met John. Mary thanked"
    shown = qkv_cli("patch", clean, corrupt, "--metric", "diff: Mary, John", "--json")
    assert shown.returncode == 0, shown.stderr
    data = json.loads(shown.stdout)
    metric = Metric.parse("diff: Mary, John")
    ids = metric.ids(smollm2.tokenizer)
    with torch.inference_mode():
        for text, name in ((clean, "clean"), (corrupt, "corrupt")):
            logits = smollm2.model(torch.tensor([smollm2.encode(text).ids])).logits[0, -1]
            assert data[name] == pytest.approx(float(metric.score(logits, ids)), abs=1e-3)
    T = len(data["clean_tokens"])
    assert data["residual"][-1][-1] == pytest.approx(data["clean"], abs=1e-3)
    assert data["residual"][-1][: T - 1] == pytest.approx([data["corrupt"]] * (T - 1), abs=1e-3)
    assert len(data["heads"]) == 30 and len(data["heads"][0]) == 9
    assert data["metric"]["tokens"] == [" Mary", " John"]


@pytest.mark.parametrize(
    "args, message",
    [
        (["hide", TEXT, "--key", "lake"], "'lake' is not a word of the text"),
        (["hide", TEXT, "--key", "river", "--layers", "6"], "layer 6"),
        (["hide", TEXT, "--key", "river", "--out", "x.txt"], ".png"),
        (["ablate", TEXT, "--mode", "half"], "mode must be"),
        (["patch", "a b", "a b c", "--metric", "prob: the", "-m", "minilm"], "needs a decoder"),
        (["patch", "The cat", "The big dog", "--metric", "prob: the"], "equal token length"),
        (["patch", "The cat", "The dog", "--metric", "prob: zzqx"], "not one token"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args, message, tmp_path):
    shown = subprocess.run([sys.executable, "-m", "qkv.cli", *args], capture_output=True,
                           text=True, timeout=300, cwd=tmp_path)  # fmt: skip
    assert shown.returncode == 2, shown.stdout + shown.stderr
    assert message in shown.stderr and len(shown.stderr.strip().splitlines()) == 1
    assert list(tmp_path.iterdir()) == []  # nothing written

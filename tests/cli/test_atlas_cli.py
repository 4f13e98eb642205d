"""`qkv atlas`: the folder written, and a bad corpus or a busy folder told in one line, exit
code 2, nothing written."""

from __future__ import annotations

import json

from typer.testing import CliRunner

import qkv.pretrained
from intervention_models import llama_like
from qkv.cli import app


def test_atlas_writes_its_folder_and_refuses_bad_input(tmp_path, monkeypatch):
    model = llama_like()
    monkeypatch.setattr(qkv.pretrained, "load", lambda *args, **kwargs: model)
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("\n".join(json.dumps({"text": "the bank of the river was wide " * 3})
                                for _ in range(4)))  # fmt: skip
    out = tmp_path / "atlas"
    runner = CliRunner()
    done = runner.invoke(app, ["atlas", str(corpus), "--out", str(out), "-m", "tiny",
                               "--window", "8", "--top", "2", "--quiet"])  # fmt: skip
    assert done.exit_code == 0, done.output
    assert done.stdout.startswith(f"wrote {out} (")
    data = json.loads((out / "atlas.json").read_text())
    assert data["options"]["window"] == 8 and len(data["examples"][1][0]) == 2
    assert (out / "index.html").is_file() and (out / "examples" / "L1H0-1.html").is_file()

    (tmp_path / "bad.jsonl").write_text('{"text": 3}\n')
    for args, message in (
        ([str(tmp_path / "bad.jsonl"), "--out", str(tmp_path / "new")], 'has no "text" string'),
        ([str(corpus), "--out", str(out), "--window", "9"], "another options"),
        ([str(corpus), "--out", str(tmp_path), "--window", "9"], "not an atlas's"),
    ):
        refused = runner.invoke(app, ["atlas", *args, "--quiet"])
        assert refused.exit_code == 2, refused.output
        assert refused.stderr.startswith("error: ") and message in refused.stderr
        assert refused.stderr.count("\n") == 1
    assert not (tmp_path / "new").exists()

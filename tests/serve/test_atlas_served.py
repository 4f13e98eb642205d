"""`qkv serve --atlas`: the atlas folder served read-only, only the files it held at start."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from intervention_models import llama_like
from qkv.serve import create_app
from qkv.viz.atlas import atlas


def test_the_server_shows_the_atlas_it_started_with_and_nothing_else(tmp_path):
    model = llama_like()
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the bank of the river was wide and deep the bank of the river\n")
    folder = atlas(model, corpus, tmp_path / "atlas", window=8, top=2) and tmp_path / "atlas"
    (tmp_path / "secret.txt").write_text("not for requests")
    with TestClient(create_app({"tiny": model}, atlas=folder)) as client:
        page = client.get("/atlas/")
        assert page.status_code == 200 and page.content == (folder / "index.html").read_bytes()
        example = client.get("/atlas/examples/L0H1-0.html")
        assert example.content == (folder / "examples" / "L0H1-0.html").read_bytes()
        assert client.get("/api/atlas").json() == json.loads((folder / "atlas.json").read_text())
        for path in ("/atlas/examples/..%2F..%2Fsecret.txt", "/atlas/examples/L9H9-0.html",
                     "/atlas/atlas-state.pt"):  # fmt: skip
            assert client.get(path).status_code == 404, path
    with pytest.raises(ValueError, match="has no index.html and atlas.json"):
        create_app({"tiny": model}, atlas=tmp_path)

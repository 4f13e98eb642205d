"""`qkv.load("Org/name")` offline finds a model that the Hugging Face cache holds: a cache
laid out here as huggingface_hub lays one out (blobs, snapshot links, refs/main)."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from huggingface_hub import constants

import qkv
from qkv.io.embedded import embedded_path
from tiny_models import save_tiny

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def cache_with_tiny_gpt2(tmp_path: Path):
    """A hub cache holding "Org/tiny-gpt2": (the cache folder, transformers' model)."""
    folder = tmp_path / "saved"
    theirs = save_tiny("gpt2", folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):  # any tokenizer will do
        shutil.copy(embedded_path("minilm") / name, folder / name)
    cache = tmp_path / "hub"
    repo = cache / "models--Org--tiny-gpt2"
    snapshot = repo / "snapshots" / COMMIT
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for file in folder.iterdir():  # each file a blob named by its hash, linked from the snapshot
        digest = hashlib.sha256(file.read_bytes()).hexdigest()
        shutil.copy(file, repo / "blobs" / digest)
        (snapshot / file.name).symlink_to(Path("..", "..", "blobs", digest))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    return cache, theirs


def test_a_cached_hub_model_loads_offline(tmp_path, monkeypatch):
    cache, theirs = cache_with_tiny_gpt2(tmp_path)
    # huggingface_hub reads HF_HUB_CACHE and HF_HUB_OFFLINE once, at its import
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    ours = qkv.load("Org/tiny-gpt2")
    assert ours.source == "Org/tiny-gpt2" and ours.family.name == "gpt2"
    ids = torch.randint(0, 99, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(ours.model(ids).logits, theirs(ids).logits, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match=r"'Org/other' is not in the Hugging Face cache"):
        qkv.load("Org/other")


def test_a_cached_hub_model_loads_offline_in_a_fresh_process(tmp_path):
    # as a user runs it: the cache and offline mode in the environment, before any import
    cache, _ = cache_with_tiny_gpt2(tmp_path)
    env = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1",
           "HF_HOME": str(tmp_path / "home")}  # fmt: skip
    script = "import qkv; p = qkv.load('Org/tiny-gpt2'); print(p.family.name, p.config.num_layers)"
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                            text=True, timeout=300)  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["gpt2", "2"]

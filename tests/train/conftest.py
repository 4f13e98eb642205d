"""Shared pieces of the training tests: tiny configs and a small text corpus."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from qkv.data import bank_corpus
from qkv.train import RunConfig

REPO = Path(__file__).resolve().parents[2]


def tiny(arch: str = "gpt2", kind: str = "text", **sections) -> RunConfig:
    """A model small enough to train a few steps in a second or two."""
    values = {
        "model": {"arch": arch, "layers": 2, "heads": 2, "width": 32, "context": 32},
        "data": {"kind": kind, "vocab_size": 300, "examples": 256, "heldout": 32},
        "train": {"steps": 6, "batch_size": 8, "lr": 3e-3, "warmup": 2, "eval_every": 3,
                  "eval_batches": 2, "checkpoint_every": 2, "keep": 2},
    }  # fmt: skip
    for section, entries in sections.items():
        values[section] = {**values[section], **entries}
    return RunConfig().updated(values).check()


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Path:
    """About 60 KB of text in two files, paragraphs separated by blank lines."""
    folder = tmp_path_factory.mktemp("corpus")
    for i, seed in enumerate((1, 2)):
        sentences = [s.text for s in bank_corpus(400, seed=seed)]
        paragraphs = [" ".join(sentences[j : j + 8]) for j in range(0, len(sentences), 8)]
        (folder / f"part{i}.txt").write_text("\n\n".join(paragraphs) + "\n", encoding="utf-8")
    return folder


def text_config(corpus: Path, **sections) -> RunConfig:
    paths = [str(p) for p in sorted(corpus.glob("*.txt"))]
    data = {"paths": paths, **sections.pop("data", {})}
    return tiny("gpt2", "text", data=data, **sections)


def write_toml(config: RunConfig, path: Path) -> Path:
    path.write_text(config.to_toml(), encoding="utf-8")
    return path


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def qkv_command(*args: str, **kwargs) -> subprocess.CompletedProcess:
    """`qkv ARGS` in a fresh Python process, as a user runs it."""
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    return subprocess.run([sys.executable, "-m", "qkv.cli", *args], capture_output=True,
                          text=True, env=env, **kwargs)  # fmt: skip

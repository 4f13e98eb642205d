"""Shared fixtures of the picture tests."""

from __future__ import annotations

import string

import pytest
from matplotlib.figure import Figure

from qkv.data import word_tokenizer
from tiny_models import save_tiny

LETTERS = list(string.ascii_lowercase)  # the tiny BART's words


@pytest.fixture
def drawn(monkeypatch) -> list[Figure]:
    """The figures saved during a test, to read their labels and images back."""
    figures, save = [], Figure.savefig

    def recording(self, *args, **kwargs):
        figures.append(self)
        return save(self, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", recording)
    return figures


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A tiny random BART (transformers builds it) with a word tokenizer over the letters."""
    folder = tmp_path_factory.mktemp("tiny-bart")
    save_tiny("bart", folder)
    word_tokenizer(LETTERS, style="bart").save(folder)  # <s>=0 <pad>=1 </s>=2, then a-z
    return folder

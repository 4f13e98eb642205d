"""Shared fixtures of the picture tests."""

from __future__ import annotations

import pytest
from matplotlib.figure import Figure


@pytest.fixture
def drawn(monkeypatch) -> list[Figure]:
    """The figures saved during a test, to read their labels and images back."""
    figures, save = [], Figure.savefig

    def recording(self, *args, **kwargs):
        figures.append(self)
        return save(self, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", recording)
    return figures

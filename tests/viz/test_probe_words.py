"""The probe's measures have one name each (`qkv.inspect.probe.MEASURES`), defined wherever
they are shown (CLI text, PNG, notebook), and the embeddings' cosines are explained from the
numbers: the same token everywhere, told apart only by a position added there."""

from __future__ import annotations

import html

import pytest
import torch

from intervention_models import llama_like
from qkv.inspect.probe import MEASURES, probe
from qkv.viz.lines import probe_lines
from qkv.viz.notebook import probe_html
from qkv.viz.plots import probe_plot


@pytest.fixture(scope="module")
def found(minilm):
    return probe(minilm, "bank")


def lowest_at_the_embeddings(result) -> float:
    n = len(result.sentences)
    return float(result.similarity[0][~torch.eye(n, dtype=torch.bool)].min())


def test_the_text_uses_the_one_name_of_each_measure_and_defines_it(found):
    told = probe_lines(found)
    flat = " ".join(told.split())
    for depth, name in enumerate(found.layers):
        assert (f"{name}: mean cosine" in told and
                f"separation {found.separation[depth]:+.3f}, "
                f"accuracy {100 * found.accuracy[depth]:.0f}%" in told)  # fmt: skip
    for name, meaning in MEASURES.items():
        assert f"{name}: {meaning}." in flat
    assert "same sense minus different" not in told and "sense accuracy" not in told
    lowest = lowest_at_the_embeddings(found)
    assert lowest < 0.99  # MiniLM adds learned positions to its embeddings
    assert f"the cosines there are below 1 (lowest {lowest:.3f})" in flat
    assert "position" in flat and 'every "bank" is the same token' in flat


def test_a_model_without_positions_at_the_embeddings_says_they_are_equal():
    sentences = ["the bank of the river", "the river was deep and the bank was wide"]
    result = probe(llama_like(), "bank", sentences)
    assert lowest_at_the_embeddings(result) == pytest.approx(1.0, abs=1e-6)
    assert "its vectors are equal (cosine 1)" in " ".join(probe_lines(result).split())


def test_the_png_names_and_defines_them_the_same(found, tmp_path, drawn):
    probe_plot(found, tmp_path / "probe.png")
    figure = drawn[0]
    legend = figure.axes[2].get_legend()
    assert [t.get_text() for t in legend.get_texts()] == ["separation", "accuracy"]
    written = " ".join(" ".join(t.get_text().split()) for t in figure.texts)
    for name, meaning in MEASURES.items():
        assert f"{name}: {meaning}." in written


def test_the_notebook_names_and_defines_them_the_same(found):
    page = html.unescape(" ".join(probe_html(found).split()))
    assert "<th>separation</th>" in page and "<th>accuracy</th>" in page
    for name, meaning in MEASURES.items():
        assert f"{name[0].upper()}{name[1:]}: {meaning}." in page
    assert f"(lowest {lowest_at_the_embeddings(found):.3f})" in page

"""Every heatmap says what its colours mean (a colour bar in a PNG, a legend on a page), in
viridis, and the model view names the tokens along its panels."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch

from browser import offline
from qkv.viz import model_view, write_html
from qkv.viz.grids import grid_plot
from qkv.viz.heatmap import token_label
from qkv.viz.notebook import grid_table

SENTENCE = "The bank on the side of the river"


@pytest.fixture(scope="module")
def seen(minilm):
    return minilm.attentions(SENTENCE)


def test_the_model_view_has_one_colour_bar_and_the_tokens(seen, tmp_path, drawn):
    model_view(seen.weights, seen.tokens, tmp_path / "all.png")
    figure = drawn[0]
    L, H = seen.weights.shape[:2]
    *panels, bar = figure.axes
    assert len(panels) == L * H
    assert bar.get_ylabel() == "weight / the panel's largest" and bar.get_ylim() == (0.0, 1.0)
    assert all(ax.images[0].get_cmap().name == "viridis" for ax in panels)
    names = [token_label(t, 8) for t in seen.tokens]
    first, last_row_first = panels[0], panels[(L - 1) * H]
    assert [x.get_text() for x in first.get_yticklabels()] == names  # queries down the left
    assert [x.get_text() for x in last_row_first.get_xticklabels()] == names  # keys below
    assert first.get_xticklabels() == [] and panels[1].get_yticklabels() == []


def test_a_long_texts_model_view_thins_its_labels_and_numbers_them(tmp_path, drawn):
    T = 300
    weights = torch.softmax(torch.randn(1, 2, T, T, dtype=torch.float64), dim=-1)
    tokens = [f"w{i}" for i in range(T)]
    model_view(weights, tokens, tmp_path / "long.png")
    labels = [x.get_text() for x in drawn[0].axes[0].get_yticklabels()]
    assert 5 < len(labels) < T
    step = int(labels[1].split()[0])
    assert labels[:2] == ["0 w0", f"{step} w{step}"] and len(labels) == math.ceil(T / step)
    ticks = drawn[0].axes[0].get_yticks()  # at the tokens' places in the (block-mean) image
    pixels = drawn[0].axes[0].images[0].get_array().shape[0]
    assert ticks[1] == pytest.approx(step * pixels / T, rel=0.02)


def test_the_intervention_grids_are_viridis_with_a_colour_bar(tmp_path, drawn):
    grid = torch.rand(3, 4, dtype=torch.float64)
    grid_plot([("heads", grid, None)], tmp_path / "grid.png", title="t", label="restored")
    panel, bar = drawn[0].axes
    assert panel.images[0].get_cmap().name == "viridis"
    assert bar.get_ylabel() == "restored"


def test_the_notebooks_grids_carry_their_scale():
    values = [[0.25, 0.5], [0.75, float("nan")]]
    html = grid_table(values, ["a", "b"], ["x", "y"], name="cosine")
    legend = re.search(r'class="legend note" data-low="([^"]+)" data-high="([^"]+)"', html)
    assert legend and (float(legend[1]), float(legend[2])) == (0.25, 0.75)
    assert "colour: cosine, from 0.25 to 0.75" in html
    signed = grid_table([[-2.0, 1.0]], ["a"], ["x", "y"], name="term", diverging=True)
    assert 'data-low="-2.0" data-high="2.0"' in signed


def test_the_report_pages_heatmap_has_a_legend_of_the_heads_own_scale(seen, tmp_path):
    page_file = write_html(tmp_path / "page.html", seen.weights, seen.tokens, text=SENTENCE)
    with offline(page_file) as page:
        page.select_option("#layer", "2")
        page.select_option("#head", "7")
        page.wait_for_function("document.getElementById('legend').dataset.high !== undefined")
        page.wait_for_function(
            f"Number(document.getElementById('legend').dataset.high) === "
            f"{json.dumps(float(seen.weights[2, 7].max()))}"
        )
        text = page.inner_text("#legend")
        label = page.get_attribute("#legend .bar", "aria-label")
        background = page.eval_on_selector("#legend .bar", "e => e.style.background")
    top = float(seen.weights[2, 7].max())
    assert f"{100 * top:.2f}%" in text and text.startswith("0%")
    assert "dark purple" in label and f"{100 * top:.2f}%" in label
    assert "rgb(68, 1, 84)" in background and "rgb(253, 231, 37)" in background

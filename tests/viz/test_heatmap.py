"""PNG heatmaps: real pictures of a real model's heads, checked pixel by pixel."""

from __future__ import annotations

import math
import subprocess
import sys

import matplotlib.image as mpimg
import numpy as np
import pytest
import torch
from matplotlib.figure import Figure

import qkv
from qkv.viz import head_heatmap, model_view
from qkv.viz import heatmap as heatmap_module

DPI = heatmap_module.DPI


@pytest.fixture(scope="module")
def att():
    return qkv.load("minilm").attentions("The bank on the side of the river")


def softmax_rows(*shape: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.softmax(2 * torch.randn(*shape, generator=generator), dim=-1)


def words(T: int) -> list[str]:
    return [f"w{i}" for i in range(T)]


def test_one_head_of_the_real_model_is_a_readable_png(att, tmp_path):
    T = len(att.tokens)
    path = head_heatmap(att.weights[0, 2], att.tokens, tmp_path / "new" / "h.png", title="L0 H2")
    assert path == tmp_path / "new" / "h.png"
    assert sorted(p.name for p in path.parent.iterdir()) == ["h.png"]  # no temporary files left
    image = mpimg.imread(path)  # (height, width, RGBA) floats in [0, 1]
    side = heatmap_module.figure_side(T)
    assert image.shape == (round(side * DPI), round((side + 1.6) * DPI), 4)
    assert image[..., :3].std() > 0.1  # not blank
    assert len(np.unique(image[..., :3].reshape(-1, 3), axis=0)) > 100  # a colour map, labels


def test_figure_grows_with_the_text_and_is_capped(tmp_path):
    heights = {}
    for T in (5, 20, 40, 200, 512):
        path = head_heatmap(softmax_rows(T, T), words(T), tmp_path / f"{T}.png")
        heights[T] = mpimg.imread(path).shape[0]
    assert heights[5] < heights[20] < heights[40] <= heights[200] == heights[512]
    assert heights[512] == heatmap_module.SIDE_MAX * DPI


def test_long_texts_thin_out_their_tick_labels(tmp_path, drawn):
    for T in (10, 512):
        head_heatmap(softmax_rows(T, T), words(T), tmp_path / f"{T}.png")
    short, long = (figure.axes[0] for figure in drawn)
    assert [label.get_text() for label in short.get_xticklabels()] == words(10)
    labels = [label.get_text() for label in long.get_yticklabels()]
    assert 20 < len(labels) < 150
    step = int(labels[1].split()[0])  # thinned labels carry their index: "6 w6"
    assert labels[:2] == ["0 w0", f"{step} w{step}"] and len(labels) == math.ceil(512 / step)


def test_model_view_labels_every_panel_from_zero(att, tmp_path, drawn):
    path = model_view(att.weights, att.tokens, tmp_path / "all.png")
    image = mpimg.imread(path)
    assert image.shape[2] == 4 and image[..., :3].std() > 0.1
    L, H = att.weights.shape[:2]
    titles = [ax.get_title() for ax in drawn[0].axes[:-1]]  # the last: the colour bar
    assert titles == [f"L{layer} H{head}" for layer in range(L) for head in range(H)]
    # each panel is the model's own head, scaled to its own largest weight
    panel = drawn[0].axes[H + 4].images[0]  # L1 H4
    np.testing.assert_array_equal(panel.get_array(), att.weights[1, 4].numpy())
    assert panel.get_clim() == (0.0, float(att.weights[1, 4].max()))


def test_model_view_draws_only_the_chosen_layers_and_heads(att, tmp_path, drawn):
    full = mpimg.imread(model_view(att.weights, att.tokens, tmp_path / "full.png"))
    some = mpimg.imread(
        model_view(att.weights, att.tokens, tmp_path / "some.png", layers=[0, 5], heads=[3])
    )
    assert [ax.get_title() for ax in drawn[1].axes[:-1]] == ["L0 H3", "L5 H3"]
    assert some.shape[0] < full.shape[0] and some.shape[1] < full.shape[1]


def visible(image: np.ndarray, ax) -> np.ndarray:
    """The pixels of `image` inside `ax`, and how many of them are viridis's brightest yellow."""
    box = ax.get_window_extent()  # in pixels from the bottom left
    top, bottom = image.shape[0] - box.y1, image.shape[0] - box.y0
    inside = image[round(top) : round(bottom), round(box.x0) : round(box.x1)]
    return ((inside[..., 0] > 0.8) & (inside[..., 1] > 0.8) & (inside[..., 2] < 0.3)).sum()


def test_a_thin_line_stays_visible_when_512_tokens_shrink_to_a_small_panel(tmp_path, drawn):
    weights = torch.zeros(1, 1, 512, 512)
    weights[0, 0] = torch.eye(512).roll(-1, dims=0)  # every token on the one before it
    image = mpimg.imread(model_view(weights, words(512), tmp_path / "diagonal.png"))
    ax = drawn[0].axes[0]
    cells = ax.images[0].get_array()  # what is drawn: at most one cell a pixel, so no
    assert cells.shape[0] <= ax.get_window_extent().height  # resampling can drop a line
    assert cells.sum() * (512 / cells.shape[0]) ** 2 == pytest.approx(512)  # block means
    assert visible(image, ax) > 100  # the diagonal, about 150 pixels long


def test_a_thin_line_stays_visible_in_one_head_of_a_very_long_text(tmp_path, drawn):
    weights = torch.eye(4096).roll(-1, dims=0)  # (T, T), about 4 tokens a pixel
    image = mpimg.imread(head_heatmap(weights, words(4096), tmp_path / "diagonal.png"))
    ax = drawn[0].axes[0]
    assert ax.get_xlim() == (-0.5, 4095.5)  # ticks still count tokens
    cells = ax.images[0].get_array()
    assert cells.shape[0] <= ax.get_window_extent().height
    assert cells.sum() * (4096 / cells.shape[0]) ** 2 == pytest.approx(4096)
    assert visible(image, ax) > 500  # the diagonal, about 1000 pixels long


@pytest.mark.parametrize("name", ["h.jpg", "h.svg", "h", "h.png.tmp"])
def test_only_png_is_written(att, tmp_path, name):
    with pytest.raises(ValueError, match=r"\.png"):
        head_heatmap(att.weights[0, 0], att.tokens, tmp_path / name)
    with pytest.raises(ValueError, match=r"\.png"):
        model_view(att.weights, att.tokens, tmp_path / name)
    assert list(tmp_path.iterdir()) == []


def test_shapes_and_values_are_checked(att, tmp_path):
    weights, tokens, path = att.weights, att.tokens, tmp_path / "x.png"
    T = len(tokens)
    with pytest.raises(ValueError, match=r"\(T, T\) with T = 10"):
        head_heatmap(weights, tokens, path)  # (L, H, T, T) where one head is wanted
    with pytest.raises(ValueError, match=r"\(L, H, T, T\) with T = 10.*got \(10, 10\)"):
        model_view(weights[0, 0], tokens, path)
    with pytest.raises(ValueError, match="with T = 9"):
        head_heatmap(weights[0, 0], tokens[:-1], path)  # one token short
    with pytest.raises(ValueError, match="NaN"):
        head_heatmap(torch.full((T, T), float("nan")), tokens, path)
    with pytest.raises(ValueError, match="no tokens"):
        head_heatmap(torch.zeros(0, 0), [], path)
    with pytest.raises(ValueError, match=r"layer 6 is out of range: .* has 6 layers \(0-5\)"):
        model_view(weights, tokens, path, layers=[0, 6])
    with pytest.raises(ValueError, match="head -1 is out of range"):
        model_view(weights, tokens, path, heads=[-1])
    with pytest.raises(ValueError, match="head 2 is asked for twice"):  # was a grid of copies
        model_view(weights, tokens, path, heads=[2, 0, 2])
    assert list(tmp_path.iterdir()) == []


def test_a_failed_write_leaves_no_file_behind(att, tmp_path, monkeypatch):
    def half_written(self, file, **kwargs):
        file.write(b"\x89PNG half")
        raise OSError("disk full")

    (tmp_path / "h.png").write_bytes(b"the old picture")
    monkeypatch.setattr(Figure, "savefig", half_written)
    with pytest.raises(OSError, match="disk full"):
        head_heatmap(att.weights[0, 0], att.tokens, tmp_path / "h.png")
    assert [p.name for p in tmp_path.iterdir()] == ["h.png"]
    assert (tmp_path / "h.png").read_bytes() == b"the old picture"


def test_tokens_that_matplotlib_would_misread_are_drawn_as_text(tmp_path, drawn):
    tokens = ["$x$", " ", "a\nb", "ok"]
    head_heatmap(softmax_rows(4, 4), tokens, tmp_path / "odd.png")
    labels = [label.get_text() for label in drawn[0].axes[0].get_xticklabels()]
    assert labels == [r"\$x\$", "' '", "a\\nb", "ok"]


def test_importing_the_package_does_not_import_matplotlib():
    code = "import sys, qkv.viz; assert 'matplotlib' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)

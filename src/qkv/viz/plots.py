"""PNG plots of inspection results: the sense probe's similarity across depths, the
census's scatter of heads and the grid of terms of one score (`qkv.why`). Each is a matplotlib
Figure of its own, written whole or not at all."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import torch

from qkv.inspect.census import Census
from qkv.inspect.probe import MEASURES, Probe
from qkv.inspect.why_parts import Why
from qkv.io.files import write_atomically
from qkv.viz.heatmap import token_label
from qkv.viz.paths import png_path
from qkv.viz.why_lines import terms_grid


def probe_plot(probe: Probe, path: str | os.PathLike[str], layer: int | None = None) -> Path:
    """Draw the probe as a PNG at `path`: the word's similarity matrix after `layer` (default:
    the last) beside the one at the embeddings, and, with labels, separation and accuracy per
    depth. The file is written whole or not at all. Returns the path.
    """
    path = png_path(path, existing_folder=True)
    L = len(probe.layers) - 1
    if layer is None:
        layer = L - 1
    if not isinstance(layer, int) or not 0 <= layer < L:
        raise ValueError(
            f"layer {layer!r} is out of range: the model has {L} layers, 0 to {L - 1} "
            "(the embeddings are always drawn beside it)"
        )

    # a Figure of its own, saved by its own canvas: no pyplot, no backend chosen for the
    # whole process, nothing left open
    from matplotlib.figure import (
        Figure,  # matplotlib loads only when a PNG is drawn: import qkv.viz stays light
    )

    names = [_short(i, s, probe.labels) for i, s in enumerate(probe.sentences)]
    N = len(names)
    panels = 3 if probe.labels is not None else 2
    size = max(4.0, 0.3 * N + 2.5)
    figure = Figure(figsize=(size * 2 + 4.0 * (panels - 2), size), layout="constrained")
    axes = figure.subplots(1, panels, width_ratios=[size, size, 4.0][:panels])
    shown = [0, layer + 1]  # depths drawn: the embeddings, then the layer asked for
    low = float(probe.similarity[shown].min())
    for ax, depth in zip(axes, shown, strict=False):
        image = ax.imshow(probe.similarity[depth].numpy(), vmin=low, vmax=1.0, cmap="viridis")
        ax.set_title(f"{probe.word!r} at {probe.layers[depth]}", fontsize=10)
        ax.set_xticks(range(N), [str(i) for i in range(N)], fontsize=7)
        ax.set_yticks(range(N), names if depth == 0 else [str(i) for i in range(N)], fontsize=7)
    figure.colorbar(image, ax=axes[:2], shrink=0.8, label="cosine similarity")
    if probe.labels is not None:
        ax = axes[2]
        xs = range(L + 1)
        ax.plot(xs, probe.separation, marker="o", label="separation")
        ax.plot(xs, probe.accuracy, marker="s", label="accuracy")
        ax.set_xticks(list(xs), ["emb", *(str(i) for i in range(L))], fontsize=7)
        ax.set_xlabel("depth (embeddings, then layer)", fontsize=8)
        ax.set_title("senses apart, per depth", fontsize=10)
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    shown = ["separation", "accuracy"] if probe.labels is not None else []
    said = [f"{name}: {MEASURES[name]}." for name in ["mean cosine", *shown]]
    figure.text(0.01, 0.0, "\n".join(textwrap.fill(line, 160) for line in said), fontsize=7,
                va="top", ha="left", color="#444")  # fmt: skip

    write_atomically(path, lambda file: figure.savefig(file, format="png", dpi=100,
                                                       bbox_inches="tight"))  # fmt: skip
    return path


def _short(index: int, sentence: str, labels: list[str] | None, width: int = 32) -> str:
    """An axis label: "3 river: Ducks waddled up the st…"."""
    text = " ".join(sentence.split())
    text = text if len(text) <= width else text[: width - 1] + "…"
    return f"{index} {labels[index]}: {text}" if labels is not None else f"{index} {text}"


def census_plot(census: Census, path) -> Path:
    """A PNG scatter at `path`: each head's previous-token score (across) against its
    induction score (up), colored by layer, the best head of each labelled. Written whole or
    not at all. Returns the path."""
    path = png_path(path, existing_folder=True)
    from matplotlib.figure import (
        Figure,  # matplotlib loads only when a PNG is drawn: import qkv.viz stays light
    )

    L, H = census.previous_token.shape
    layer_of = torch.arange(L)[:, None].expand(L, H).flatten()
    figure = Figure(figsize=(7, 5.5), layout="constrained")
    ax = figure.subplots()
    dots = ax.scatter(census.previous_token.flatten(), census.induction.flatten(), c=layer_of,
                      cmap="viridis", vmin=0, vmax=max(L - 1, 1), s=24, alpha=0.85)  # fmt: skip
    for name in ("previous_token", "induction"):
        layer, head, _ = census.top(name, 1)[0]
        point = (float(census.previous_token[layer, head]), float(census.induction[layer, head]))
        ax.annotate(f"L{layer} H{head}", point, textcoords="offset points", xytext=(5, 5),
                    fontsize=8)  # fmt: skip
    ax.set_xlabel("previous-token score (weight on the token before)")
    ax.set_ylabel("induction score (repeated random tokens)")
    ax.set_title(f"{census.source}: {L} layers x {H} heads, one dot per head", fontsize=10)
    ax.set_xlim(-0.02, 1.02)
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    figure.colorbar(dots, ax=ax, label="layer (from 0)")

    write_atomically(path, lambda file: figure.savefig(file, format="png", dpi=100))
    return path


def why_plot(why: Why, path, most: int = 16) -> Path:
    """A PNG heatmap at `path` of the score's terms: the query word's parts down, the key
    word's across, each side's `most` largest parts and "every other part" (`terms_grid`), red
    above 0 and blue below, each term written in its cell. Written whole or not at all.
    Returns the path."""
    path = png_path(path, existing_folder=True)
    from matplotlib.figure import (
        Figure,  # matplotlib loads only when a PNG is drawn: import qkv.viz stays light
    )

    rows, columns, values = terms_grid(why, most)
    query, key = token_label(why.query, 24), token_label(why.key, 24)
    grid = torch.tensor(values, dtype=torch.float64).numpy()  # (rows, columns)
    span = float(abs(grid).max()) or 1.0
    figure = Figure(figsize=(2.5 + 0.55 * len(columns), 2.0 + 0.4 * len(rows)),
                    layout="constrained")  # fmt: skip
    ax = figure.subplots()
    image = ax.imshow(grid, cmap="RdBu_r", vmin=-span, vmax=span, aspect="auto")
    for i, row in enumerate(values):
        for j, value in enumerate(row):
            ink = "white" if abs(value) > 0.6 * span else "black"
            ax.text(j, i, f"{value:.2f}", ha="center", va="center", fontsize=6, color=ink)
    ax.set_xticks(range(len(columns)), columns, rotation=90, fontsize=7)
    ax.set_yticks(range(len(rows)), rows, fontsize=7)
    ax.set_xlabel(f"part of {key}'s key")
    ax.set_ylabel(f"part of {query}'s query")
    ax.set_title(
        f"{token_label(why.source, 40)}: why '{query}' attends to '{key}', layer {why.layer} head "
        f"{why.head}\nscore {why.score:+.4f}, weight {100 * why.weight:.2f}%; the terms sum to "
        f"{why.total:+.4f}",
        fontsize=9,
    )
    figure.colorbar(image, ax=ax, shrink=0.8, label="term (scaled query part . key part)")
    write_atomically(path, lambda file: figure.savefig(file, format="png", dpi=100))
    return path

"""Pictures of a long text's attention from its `Summaries`: max-downsampled heatmaps (PNG)
and a small self-contained page of the per-head summaries (HTML, every image inline).

A long text's (T, T) weights have more cells than a screen has pixels. The heatmaps here
draw `Summaries.heatmap`, where each cell is the MAXIMUM weight of its block of queries x
keys, so a strong weight stays visible however long the text (a mean would dilute it into
its block). The axes count tokens, whatever the block size; `qkv show --region` opens any
rectangle at full resolution.

matplotlib is imported inside the functions, as in `heatmap.py`.
"""

from __future__ import annotations

import base64
import io
import math
import textwrap
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from qkv.io.files import write_atomically
from qkv.viz import escape
from qkv.viz.heatmap import CMAP, DPI, token_text
from qkv.viz.paths import html_path, png_path

PANEL_PIXELS = 150  # one (layer, head) panel of the grid, a side
GRID_MAX_WIDTH, GRID_MAX_HEIGHT = 20.0, 30.0  # inches: the grid shrinks its panels to fit


def downsampled_heatmap(summary, layer: int, head: int, path: str | Path, *, title=None) -> Path:
    """One head's max-downsampled heatmap (`summary.heatmap`) to a PNG, axes in tokens.

    layer and head are the model's (counted from 0), among `summary.layers` and `.heads`.
    """
    path = png_path(path)
    at = _position(summary, layer, head)
    matrix = summary.heatmap[at].float().numpy()  # (Rq, Rk)
    Tq, Tk = summary.entropy.shape[-1], summary.received.shape[-1]
    from matplotlib.figure import (
        Figure,  # matplotlib loads only when a PNG is drawn: import qkv.viz stays light
    )

    figure = Figure(figsize=(11.6, 10.0), dpi=DPI, layout="constrained")
    ax = figure.subplots()
    image = ax.imshow(matrix, cmap=CMAP, vmin=0.0, vmax=float(matrix.max()) or 1.0,
                      interpolation="nearest", extent=(0, Tk, Tq, 0), aspect="auto")  # fmt: skip
    blocks = f"{summary.query_bin} x {summary.key_bin} block"
    cells = "each cell one weight" if blocks == "1 x 1 block" else f"the maximum of each {blocks}"
    figure.colorbar(image, ax=ax, shrink=0.8, label=f"attention weight ({cells})")
    ax.set_xlabel("key token (giving context), by position")
    ax.set_ylabel("query token (getting context), by position")
    title = title or f"L{layer} H{head} over {Tk} tokens"
    ax.set_title(textwrap.fill(f"{title}; {cells}", 90))
    write_atomically(path, lambda file: figure.savefig(file, format="png"))
    return path


def downsampled_grid(
    summary,
    path: str | Path,
    *,
    layers: Sequence[int] | None = None,
    heads: Sequence[int] | None = None,
    title: str | None = None,
) -> Path:
    """A grid of max-downsampled heatmaps, a row per layer and a column per head (the
    model's numbers, from 0; all by default), each scaled to its own largest weight."""
    path = png_path(path)
    figure = _grid_figure(summary, layers, heads, title)
    write_atomically(path, lambda file: figure.savefig(file, format="png"))
    return path


def _grid_figure(summary, layers, heads, title):
    rows_of = _model_indices(summary.layers, layers, "layer")
    cols_of = _model_indices(summary.heads, heads, "head")
    rows, cols = len(rows_of), len(cols_of)
    panel = min(PANEL_PIXELS / DPI, GRID_MAX_WIDTH / cols, GRID_MAX_HEIGHT / rows)
    from matplotlib.figure import (
        Figure,  # matplotlib loads only when a PNG is drawn: import qkv.viz stays light
    )

    heatmap = summary.heatmap.float().numpy()  # (L, H, Rq, Rk)
    f = math.ceil(max(heatmap.shape[-2:]) / (panel * DPI))  # more max-pooling to fit a panel
    # one mosaic drawn once (270 axes of their own take matplotlib seconds): each panel scaled
    # to its own largest weight, a blank line between panels
    cells = [[block_max_2d(heatmap[_position(summary, layer, head)], f) for head in cols_of]
             for layer in rows_of]  # fmt: skip
    ph, pw = cells[0][0].shape
    mosaic = np.full((rows * (ph + 1) - 1, cols * (pw + 1) - 1), np.nan, dtype=np.float32)
    for r, row in enumerate(cells):
        for c, matrix in enumerate(row):
            top = float(matrix.max()) or 1.0
            y, x = r * (ph + 1), c * (pw + 1)
            mosaic[y : y + ph, x : x + pw] = matrix / top
    size = (max(cols * panel, 4.0) + 0.8, rows * panel + 1.1)
    figure = Figure(figsize=size, dpi=DPI, layout="constrained")
    ax = figure.subplots()
    import matplotlib  # matplotlib loads only when a PNG is drawn: import qkv.viz stays light

    cmap = matplotlib.colormaps[CMAP].with_extremes(bad="white")
    ax.imshow(mosaic, cmap=cmap, vmin=0.0, vmax=1.0, interpolation="nearest", aspect="auto")
    ax.set_xticks([c * (pw + 1) + pw / 2 for c in range(cols)], [f"H{h}" for h in cols_of],
                  fontsize=7)  # fmt: skip
    ax.set_yticks([r * (ph + 1) + ph / 2 for r in range(rows)], [f"L{n}" for n in rows_of],
                  fontsize=7)  # fmt: skip
    ax.tick_params(length=0, labeltop=True, labelbottom=False)
    for spine in ax.spines.values():
        spine.set_visible(False)
    qb, kb = summary.query_bin * f, summary.key_bin * f
    T = summary.received.shape[-1]
    title = title or (
        f"attention over {T} tokens: a row per layer, a column per head (from 0); queries "
        f"down, keys across; each pixel the maximum of {qb} x {kb} weights, each panel scaled "
        "to its own largest weight"
    )
    figure.suptitle(textwrap.fill(title, int(size[0] * 14)), fontsize=9)
    return figure


def summary_page(summary, path: str | Path, *, title: str = "Attention", text=None) -> Path:
    """A self-contained .html page of a long text's summaries: the downsampled grid (inline
    PNG), and per (layer, head) its mean entropy, mean first-token mass and the keys that
    receive the most attention. No script, no network."""
    path = html_path(path)
    grid = io.BytesIO()
    _grid_figure(summary, None, None, None).savefig(grid, format="png")
    image = base64.b64encode(grid.getvalue()).decode("ascii")
    tokens = summary.tokens
    rows = []
    for n, layer in enumerate(summary.layers):
        for h, head in enumerate(summary.heads):
            received = summary.received[n, h]
            top = received.topk(min(3, received.shape[0])).indices.tolist()
            keys = ", ".join(
                f"{j} {escape.text(token_text(tokens[j]) if tokens else '')} "
                f"({float(received[j]):.1f})"
                for j in top
            )
            rows.append(
                f"<tr><td>{layer}</td><td>{head}</td>"
                f"<td>{float(summary.entropy[n, h].mean()):.3f}</td>"
                f"<td>{float(summary.first_token_mass[n, h].mean()):.3f}</td><td>{keys}</td></tr>"
            )
    T = summary.received.shape[-1]
    shown = "" if text is None else f"<p class=text>{escape.text(text[:2000])}</p>"
    page = f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{escape.text(title)}</title>
<style>body{{font:14px system-ui,sans-serif;margin:2em}}table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:2px 6px;text-align:right}}td:last-child{{text-align:left}}
.text{{max-height:8em;overflow:auto;color:#555}}img{{max-width:100%}}</style></head><body>
<h1>{escape.text(title)}</h1>{shown}
<p>A text of {T} tokens: too long to draw every weight, so each pixel below is the
<b>maximum</b> weight of its block ({summary.query_bin} x {summary.key_bin} tokens and more
to fit a panel), and no strong weight disappears. Open any region at full resolution with
<code>qkv show TEXT --out region.png --layer L --head H --region Q0:Q1,K0:K1</code>.
Layers and heads count from 0.</p>
<img alt="every layer's and head's attention, max-downsampled" src="data:image/png;base64,{image}">
<h2>Per head</h2>
<p>Entropy: of each query's weights, in nats, averaged over the queries (0: all on one key).
First-token mass: each query's weight on token 0, averaged. Most received: the keys whose
weights summed over every query are largest (position, token, sum).</p>
<table><tr><th>layer</th><th>head</th><th>entropy</th><th>first-token mass</th>
<th>most received</th></tr>
{chr(10).join(rows)}
</table></body></html>
"""
    write_atomically(path, lambda file: file.write(page.encode("utf-8")))
    return path


def block_max_2d(matrix: np.ndarray, f: int) -> np.ndarray:
    """The maxima of f x f blocks of a (R, C) matrix of weights >= 0; the last may be smaller.

    >>> block_max_2d(np.arange(9.0).reshape(3, 3), 2)
    array([[4., 5.],
           [7., 8.]])
    """
    if f == 1:
        return matrix
    R, C = matrix.shape
    padded = np.zeros((math.ceil(R / f) * f, math.ceil(C / f) * f), dtype=matrix.dtype)
    padded[:R, :C] = matrix
    return padded.reshape(padded.shape[0] // f, f, padded.shape[1] // f, f).max(axis=(1, 3))


def _position(summary, layer: int, head: int) -> tuple[int, int]:
    """Where the model's layer and head sit in the summary's tensors."""
    if layer not in summary.layers:
        raise ValueError(f"layer {layer} is not summarized; the layers are {_span(summary.layers)}")
    if head not in summary.heads:
        raise ValueError(f"head {head} is not summarized; the heads are {_span(summary.heads)}")
    return summary.layers.index(layer), summary.heads.index(head)


def _model_indices(present: list[int], chosen, name: str) -> list[int]:
    if chosen is None:
        return list(present)
    if not chosen:
        raise ValueError(f"no {name}s chosen; pick some of {_span(present)}")
    missing = [i for i in chosen if i not in present]
    if missing:
        raise ValueError(f"{name} {missing[0]} is not summarized; the {name}s are {_span(present)}")
    return list(chosen)


def _span(indices: list[int]) -> str:
    if indices == list(range(indices[0], indices[-1] + 1)):
        return f"{indices[0]}-{indices[-1]}"
    return ", ".join(map(str, indices))

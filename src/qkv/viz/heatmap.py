"""PNG heatmaps of attention weights: one head, or a grid of every layer and head.

Rows are query tokens (the word getting context), columns key tokens (the word giving
context); row i of a head's (T, T) matrix is how token i's attention divides over the text,
and sums to 1. Layers and heads count from 0, as everywhere in qkv.

Cross-attention (an encoder-decoder's decoder reading the encoder) is rectangular: pass
`query_tokens`, and the rows are those target tokens (Tq), the columns the source tokens (Tk).

matplotlib is imported inside the functions, so `import qkv.viz` stays light, and the
figures are drawn with its object API (no pyplot): no global state, nothing left open.

Example, with a real model::

    att = qkv.load("minilm").attentions("The bank on the side of the river")
    head_heatmap(att.weights[0, 3], att.tokens, "bank.png", title="L0 H3")
    model_view(att.weights, att.tokens, "all_heads.png")

and an encoder-decoder's cross-attention, target tokens down and source tokens across::

    att = seq2seq.attentions("a b c d", target="d c b a")
    head_heatmap(att.weights[0, 0], att.tokens, "reverse.png", query_tokens=att.query_tokens)
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from qkv.attention.inputs import check_indices
from qkv.io.files import write_atomically
from qkv.viz.paths import png_path
from qkv.viz.step_words import shifted_right

DPI = 100
CMAP = "viridis"
SIDE_MIN, SIDE_MAX = 4.5, 14.0  # inches of a head's heatmap: it grows with T, up to this cap
INCHES_PER_TOKEN = 0.28
LABEL_POINTS = 9.0  # room one tick label needs along an axis; more tokens and labels thin out
VALUES_UP_TO = 12  # write each weight in its cell when the text has at most this many tokens
PANEL_MAX = 1.5  # inches of one (layer, head) panel in the model view
PANEL_LABEL_POINTS = 6.0  # room a model-view panel gives one token label (5-point text)
GRID_MAX_WIDTH, GRID_MAX_HEIGHT = 20.0, 30.0  # the model view shrinks its panels to fit


def head_heatmap(
    weights,
    tokens: Sequence[str],
    path: str | Path,
    *,
    title: str | None = None,
    query_tokens: Sequence[str] | None = None,
) -> Path:
    """Draw one head's (T, T) weights, queries on rows and keys on columns, to a PNG.

    With query_tokens (cross-attention), weights are (Tq, Tk): a row per query (target)
    token, Tq = len(query_tokens), a column per key (source) token, Tk = len(tokens).
    The colour scale runs from 0 to the head's largest weight, with a colorbar; for up to
    12 tokens each cell also shows its weight. Long texts (T up to 512 and beyond) thin
    out the tick labels to what fits and cap the figure at 14 inches a side.
    Returns the path written.
    """
    path = png_path(path)
    cross = query_tokens is not None
    if query_tokens is not None:
        matrix = check_cross_weights(weights, query_tokens, tokens, ndim=2)  # (Tq, Tk)
    else:
        matrix = check_weights(weights, tokens, ndim=2)  # (T, T)
    queries = tokens if query_tokens is None else query_tokens
    Tq, Tk = matrix.shape
    height, width = figure_side(Tq), figure_side(Tk)
    from matplotlib.figure import (
        Figure,  # matplotlib loads only when a PNG is drawn: import qkv.viz stays light
    )

    figure = Figure(figsize=(width + 1.6, height), dpi=DPI, layout="constrained")
    ax = figure.subplots()
    # beyond about one token a pixel, draw the means of f x f blocks (see model_view)
    f = math.ceil(max(Tq / ((height - 1.8) * DPI), Tk / ((width - 1.8) * DPI)))
    shown_matrix = block_means(matrix, f)  # (ceil(Tq / f), ceil(Tk / f))
    top = float(shown_matrix.max()) or 1.0
    extent = (-0.5, Tk - 0.5, Tq - 0.5, -0.5)  # axes in token indices, whatever f is
    aspect = "auto" if cross else None  # the figure's sides already follow Tq and Tk
    image = ax.imshow(shown_matrix, cmap=CMAP, vmin=0.0, vmax=top, interpolation="nearest",
                      extent=extent, aspect=aspect)  # fmt: skip
    label = "attention weight" if f == 1 else f"attention weight (mean of {f} x {f})"
    figure.colorbar(image, ax=ax, shrink=0.8, label=label)

    for axis, names, side, rotation in (
        (ax.xaxis, tokens, width, 90),
        (ax.yaxis, queries, height, 0),
    ):
        step, size = _tick_layout(len(names), side)
        shown = range(0, len(names), step)
        # thinned labels carry their index: a long text repeats its words
        labels = [
            token_label(names[i]) if step == 1 else f"{i} {token_label(names[i])}" for i in shown
        ]
        axis.set_ticks(list(shown), labels, rotation=rotation, fontsize=size)
    if cross:  # the shift by one, said under the map where the learner sees it
        figure.supxlabel(textwrap.fill(shifted_right(list(queries)), int(width * 11)),
                         fontsize=8)  # fmt: skip
        ax.set_xlabel("source token (key)")
        ax.set_ylabel("target token (query)")
    else:
        ax.set_xlabel("key token (giving context)")
        ax.set_ylabel("query token (getting context)")
    if title:
        ax.set_title(textwrap.fill(title, int(width * 9)))  # about 9 characters an inch
    if max(Tq, Tk) <= VALUES_UP_TO:
        for q in range(Tq):
            for k in range(Tk):
                dark = matrix[q, k] < 0.6 * top  # viridis is dark at the low end
                ax.text(
                    k,
                    q,
                    f"{matrix[q, k]:.2f}",
                    ha="center",
                    va="center",
                    fontsize=7,
                    color="white" if dark else "black",
                )
    write_atomically(path, lambda file: figure.savefig(file, format="png"))
    return path


def model_view(
    weights,
    tokens: Sequence[str],
    path: str | Path,
    *,
    layers: Sequence[int] | None = None,
    heads: Sequence[int] | None = None,
    title: str | None = None,
    query_tokens: Sequence[str] | None = None,
) -> Path:
    """Draw a grid of small heatmaps of (L, H, T, T) weights, a row per layer and a column
    per head, each labelled "L{l} H{h}" counting from 0, to a PNG.

    `layers` and `heads` pick which ones (all by default). Each panel is scaled to its own
    largest weight, so that a diffuse head shows its pattern too; the figure says so.
    With query_tokens (cross-attention), weights are (L, H, Tq, Tk): target tokens down,
    source tokens across. Returns the path written.
    """
    path = png_path(path)
    cross = query_tokens is not None
    if query_tokens is not None:
        stack = check_cross_weights(weights, query_tokens, tokens, ndim=4)  # (L, H, Tq, Tk)
    else:
        stack = check_weights(weights, tokens, ndim=4)  # (L, H, T, T)
    L, H = stack.shape[:2]
    layers = chosen_indices(layers, L, "layer")
    heads = chosen_indices(heads, H, "head")
    rows, cols = len(layers), len(heads)
    panel = min(PANEL_MAX, GRID_MAX_WIDTH / cols, GRID_MAX_HEIGHT / rows)
    from matplotlib.figure import (
        Figure,  # matplotlib loads only when a PNG is drawn: import qkv.viz stays light
    )

    # room for the token labels (left and below) and the colour bar (right)
    size = (max(cols * panel, 4.0) + 1.9, rows * panel + 1.6)
    figure = Figure(figsize=size, dpi=DPI, layout="constrained")
    axes = figure.subplots(rows, cols, squeeze=False)
    Tq, T = stack.shape[-2:]
    queries = tokens if query_tokens is None else query_tokens
    # a panel has about panel * DPI pixels a side: average f x f blocks of tokens down to that
    # ourselves, since resampling at draw time would let thin lines (a diagonal) fade away
    f = math.ceil(max(Tq, T) / (panel * DPI))
    aspect = "auto" if cross else None  # a rectangular map fills its square panel
    for r, layer in enumerate(layers):
        for c, head in enumerate(heads):
            ax = axes[r, c]
            matrix = block_means(stack[layer, head], f)  # (ceil(Tq / f), ceil(T / f))
            top = float(matrix.max()) or 1.0
            ax.imshow(matrix, cmap=CMAP, vmin=0.0, vmax=top, interpolation="nearest", aspect=aspect)
            ax.set_title(f"L{layer} H{head}", fontsize=7, pad=2)
            for spine in ax.spines.values():  # a frame would hide the first and last rows
                spine.set_visible(False)
            # the tokens along the left column (queries) and the bottom row (keys) only
            _panel_ticks(ax.yaxis, queries if c == 0 else None, f, panel)
            _panel_ticks(ax.xaxis, tokens if r == rows - 1 else None, f, panel, rotation=90)
    from matplotlib.cm import ScalarMappable
    from matplotlib.colors import Normalize

    # one scale for every panel: each runs from 0 to its own largest weight
    scale = ScalarMappable(Normalize(0.0, 1.0), cmap=CMAP)
    figure.colorbar(scale, ax=axes, shrink=min(1.0, 3.0 / size[1]), pad=0.01,
                    label="weight / the panel's largest")  # fmt: skip
    blocks = f"; each pixel the mean of {f} x {f} weights" if f > 1 else ""
    if cross:
        what = (f"cross-attention of {Tq} target tokens over {T} source tokens "
                f"({shifted_right(list(queries))})")  # fmt: skip
        down = "target tokens (queries) down, source tokens (keys) across"
    else:
        what, down = f"attention weights over {T} tokens", "queries down, keys across"
    title = title or (
        f"{what}: a row per layer, a column per head (from 0); "
        f"{down}; each panel scaled to its own largest weight{blocks}"
    )
    figure.suptitle(textwrap.fill(title, int(size[0] * 14)), fontsize=9)
    write_atomically(path, lambda file: figure.savefig(file, format="png"))
    return path


# ------------------------------------------------------------------ helpers shared with report


def figure_side(T: int) -> float:
    """Inches a side of one head's heatmap: grows with the number of tokens, then is capped."""
    return min(SIDE_MAX, max(SIDE_MIN, 2.0 + INCHES_PER_TOKEN * T))


def block_means(matrix: np.ndarray, f: int) -> np.ndarray:
    """The means of f x f blocks of a (Tq, Tk) matrix; the last blocks may be smaller.

    >>> block_means(np.arange(9.0).reshape(3, 3), 2)
    array([[2. , 3.5],
           [6.5, 8. ]])
    >>> block_means(np.arange(6.0).reshape(2, 3), 2)
    array([[2. , 3.5]])
    """
    if f == 1:
        return matrix
    rows, cols = (np.arange(0, n, f) for n in matrix.shape)
    row_sizes = np.diff(np.append(rows, matrix.shape[0]))
    col_sizes = np.diff(np.append(cols, matrix.shape[1]))
    sums = np.add.reduceat(np.add.reduceat(matrix, rows, axis=0), cols, axis=1)
    return sums / np.outer(row_sizes, col_sizes)


def token_label(token: str, width: int = 16) -> str:
    """A token as a tick label: `token_text`, with "$" kept literal (matplotlib would read
    "$...$" as mathematics).

    >>> token_label("river"), token_label("a$b")
    ('river', 'a\\\\$b')
    """
    return token_text(token, width).replace("$", r"\$")


def token_text(token: str, width: int = 16) -> str:
    """A token as one short line of text: whitespace made visible, long ones cut.

    >>> token_text("river"), token_text(" "), token_text("a\\nb"), token_text("x" * 20)
    ('river', "' '", 'a\\\\nb', 'xxxxxxxxxxxxxxx…')
    """
    shown = repr(token) if not token.strip() else token.replace("\n", "\\n").replace("\t", "\\t")
    return shown if len(shown) <= width else shown[: width - 1] + "…"


def check_weights(weights, tokens: Sequence[str], *, ndim: int) -> np.ndarray:
    """`weights` as a float32 array of `ndim` dimensions ending in (T, T), T = len(tokens)."""
    T = len(tokens)
    if T == 0:
        raise ValueError("there are no tokens: nothing to draw")
    array = _float_array(weights)
    expected = "(T, T)" if ndim == 2 else "(L, H, T, T)"
    if array.ndim != ndim or array.shape[-2:] != (T, T):
        raise ValueError(
            f"weights must have shape {expected} with T = {T} (one row and column per token); "
            f"got {tuple(array.shape)}"
        )
    return _check_values(array)


def check_cross_weights(
    weights, query_tokens: Sequence[str], tokens: Sequence[str], *, ndim: int
) -> np.ndarray:
    """Cross-attention `weights` as a float32 array of `ndim` dimensions ending in (Tq, Tk):
    a row per query (target) token, Tq = len(query_tokens), a column per key (source)
    token, Tk = len(tokens)."""
    Tq, Tk = len(query_tokens), len(tokens)
    if Tq == 0 or Tk == 0:
        raise ValueError(
            f"there are no {'target' if Tq == 0 else 'source'} tokens: nothing to draw"
        )
    array = _float_array(weights)
    expected = "(Tq, Tk)" if ndim == 2 else "(L, H, Tq, Tk)"
    if array.ndim != ndim or array.shape[-2:] != (Tq, Tk):
        flipped = array.shape[-2:] == (Tk, Tq) and Tq != Tk
        hint = " (transposed? the rows are the target's tokens)" if flipped else ""
        raise ValueError(
            f"cross-attention weights must have shape {expected} with Tq = {Tq} target tokens "
            f"(rows) and Tk = {Tk} source tokens (columns); got {tuple(array.shape)}{hint}"
        )
    return _check_values(array)


def _float_array(weights) -> np.ndarray:
    if hasattr(weights, "detach"):  # a torch tensor, on any device and of any float dtype
        weights = weights.detach().float().cpu().numpy()
    return np.asarray(weights, dtype=np.float32)


def _check_values(array: np.ndarray) -> np.ndarray:
    if array.size == 0:
        raise ValueError(f"weights have shape {tuple(array.shape)}: no layer or head to draw")
    finite = np.isfinite(array)
    if array.ndim == 4:  # a head a layer does not have (layers may differ: Qwen3.5's) is NaN
        finite |= np.isnan(array).all(axis=(2, 3), keepdims=True)
    if not finite.all():
        raise ValueError("weights contain NaN or infinity; attention weights are finite (a "
                         "whole head of NaN marks a head its layer does not have)")  # fmt: skip
    return array


def chosen_indices(chosen: Sequence[int] | None, count: int, name: str) -> list[int]:
    """The chosen layers or heads (all when None), each in range and once (`check_indices`),
    one at least."""
    indices = check_indices(name, chosen, count, "the stack of weights")
    if not indices:
        raise ValueError(f"no {name}s chosen; pick some of 0-{count - 1}")
    return indices


def _panel_ticks(axis, names: Sequence[str] | None, f: int, panel: float, rotation=0) -> None:
    """A model-view panel's token labels along `axis`, thinned to what fits a `panel`-inch side
    (an index before each when thinned: a long text repeats its words); none where `names` is
    None. `f`: the panel's pixels are means of f x f tokens."""
    if names is None:
        axis.set_ticks([])
        return
    T = len(names)
    step = max(1, math.ceil(T * PANEL_LABEL_POINTS / (panel * 72)))
    shown = range(0, T, step)
    labels = [token_label(names[i], 8) if step == 1 else f"{i} {token_label(names[i], 8)}"
              for i in shown]  # fmt: skip
    axis.set_ticks([i / f for i in shown], labels, rotation=rotation, fontsize=5)
    axis.set_tick_params(length=1, pad=1)


def _tick_layout(T: int, side: float) -> tuple[int, float]:
    """(every how many tokens a tick label goes, its font size in points) on a side-inch axis."""
    axis_points = (side - 1.8) * 72  # less the room the labels and axis title take
    step = max(1, math.ceil(T * LABEL_POINTS / axis_points))
    size = min(10.0, max(5.0, 0.8 * axis_points * step / T))
    return step, size

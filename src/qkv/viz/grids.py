"""Heatmaps of intervention results: a value per (layer, head), or per (layer, position)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from torch import Tensor

from qkv.io.files import write_atomically
from qkv.viz.paths import png_path


def grid_plot(
    grids: Sequence[tuple[str, Tensor, Sequence[str] | None]],
    path: str | Path,
    *,
    title: str,
    label: str,
) -> Path:
    """Draw one heatmap per (title, grid (L, N), column labels or None for numbers) side by
    side, layers down, as a PNG at `path`, written whole or not at all. NaN cells (not
    computed) are left blank."""
    from matplotlib.figure import (
        Figure,  # matplotlib loads only when a PNG is drawn: import qkv.viz stays light
    )

    path = png_path(path)
    widths = [max(3.0, 0.35 * grid.shape[1] + 1.5) for _, grid, _ in grids]
    height = max(3.0, 0.25 * max(grid.shape[0] for _, grid, _ in grids) + 1.5)
    figure = Figure(figsize=(sum(widths) + 1.0, height), layout="constrained")
    axes = figure.subplots(1, len(grids), width_ratios=widths, squeeze=False)[0]
    for ax, (name, grid, columns) in zip(axes, grids, strict=True):
        values = grid.double().numpy()
        image = ax.imshow(values, cmap="viridis", aspect="auto", interpolation="nearest")
        L, N = values.shape
        ax.set_title(name, fontsize=9)
        ax.set_ylabel("layer", fontsize=8)
        ax.set_xlabel("head" if columns is None else "position", fontsize=8)
        ax.set_yticks(range(L), [str(n) for n in range(L)], fontsize=6)
        names = [str(n) for n in range(N)] if columns is None else [c[:10] for c in columns]
        ax.set_xticks(range(N), names, fontsize=6, rotation=90 if columns else 0)
        figure.colorbar(image, ax=ax, shrink=0.8, label=label)
    figure.suptitle(title, fontsize=10)

    write_atomically(path, lambda file: figure.savefig(file, format="png", dpi=100))
    return path

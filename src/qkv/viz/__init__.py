"""Pictures of attention: PNG heatmaps (matplotlib) and self-contained interactive HTML.

Every function takes (L, H, T, T) or (T, T) weights and the T tokens, so it works with any
model: `qkv.load("minilm").attentions(text)` gives both. matplotlib is imported only when a
PNG is drawn.
"""

from qkv.viz.heatmap import head_heatmap, model_view
from qkv.viz.page_vectors import LayerScores, page_trace
from qkv.viz.report import read_weights, strongest_head, write_html, write_report

__all__ = [
    "LayerScores",
    "head_heatmap",
    "model_view",
    "page_trace",
    "read_weights",
    "strongest_head",
    "write_html",
    "write_report",
]

"""The tour as one self-contained HTML page: the article's steps with the model's numbers, the
model's diagram on top, the experiments beside each step, all offline (works from file://).

The page (`tour.html`, `tour.css` and `tour.js` in this package) inlines its style, script and
the tour's data (`Tour.to_dict()` as JSON in <script type="application/json" id="tour-data">,
escaped for that place by `escape.script_json`) and the diagram's inline SVG
(`viz.diagram.diagram_svg`). The script draws the current step into id="step" with
`textContent` only; the left and right arrow keys, the step buttons (id="steps") and the
Previous / Next buttons move through the steps; the diagram's boxes of the current step get
the class "lit"; a click on a box (or Enter on it) shows its real tensor in id="box-tensor".
Every number shown carries its exact value in data-value (lists in data-values), so a test
can compare it with the library's. The page sets `window.qkvReady = true` once drawn and
`document.body.dataset.step` to the step shown.

>>> import qkv
>>> page = tour_page(qkv.load("minilm"), "The bank on the side of the river")
>>> page.startswith("<!doctype html>") and 'id="tour-data"' in page
True
"""

from __future__ import annotations

import json
import os
import re
from importlib.resources import files
from pathlib import Path

from qkv.inspect.tour import Tour, tour
from qkv.io.files import write_atomically
from qkv.version import __version__
from qkv.viz import escape
from qkv.viz.diagram import diagram_svg, diagram_text
from qkv.viz.paths import html_path

_SLOT = re.compile(r"\{\{(\w+)\}\}")


def render_tour(found: Tour) -> str:
    """The page of a computed `Tour`."""
    asset = files("qkv.viz")
    template = (asset / "tour.html").read_text(encoding="utf-8")
    data = escape.script_json(json.dumps(found.to_dict(), allow_nan=False))
    if found.diagram is not None:
        svg = diagram_svg(found.diagram, lit=found.steps[0].id)
        alternative = escape.text(diagram_text(found.diagram))
    else:
        svg = f'<p class="note">{escape.text(found.diagram_note or "No diagram.")}</p>'
        alternative = escape.text(found.diagram_note or "")
    slots = {
        "title": escape.text(f"Tour of self-attention: {found.text} ({found.source})"),
        "model": escape.text(found.source), "text": escape.text(found.text),
        "version": escape.text(__version__), "css": (asset / "tour.css").read_text("utf-8"),
        "js": (asset / "tour.js").read_text("utf-8"), "data": data, "diagram": svg,
        "diagram_text": alternative,
    }  # fmt: skip
    # one pass: what a slot brings in (a token, the data) is never read for slots again
    return _SLOT.sub(lambda m: slots[m.group(1)], template)


def tour_page(pretrained, text: str | None = None, **options) -> str:
    """The tour of `text` on `pretrained` as one HTML page (see `qkv.inspect.tour.tour` for
    the options: query, key, layer, head, swap, compare)."""
    found = tour(pretrained, **options) if text is None else tour(pretrained, text, **options)
    return render_tour(found)


def write_tour(
    pretrained, text: str | None = None, path: str | os.PathLike[str] = "tour.html", **options
) -> Path:
    """Write the tour of `text` on `pretrained` to `path` (.html), atomically: nothing is
    written if the tour is refused. Returns the path written."""
    path = html_path(path)
    page = tour_page(pretrained, text, **options)
    write_atomically(path, lambda file: file.write(page.encode("utf-8")))
    return path

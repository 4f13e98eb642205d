"""The tour in a notebook: a `Tour` shows itself as its whole page in an iframe (`srcdoc`, so its
ids and script live in a window of their own), and `show_tour` makes one.

>>> import qkv
>>> found = show_tour(qkv.load("minilm"))  # the article's sentence; Jupyter shows the page
>>> found._repr_html_().startswith('<iframe class="qkv-tour"')
True
"""

from __future__ import annotations

from qkv.inspect.tour import Tour, tour
from qkv.viz import escape
from qkv.viz.tour import render_tour


def show_tour(pretrained, text: str | None = None, **options) -> Tour:
    """The tour of `text` (the article's sentence by default) on `pretrained`, which a notebook
    shows as its page (options: query, key, layer, head, swap, compare; see `tour`)."""
    return tour(pretrained, **options) if text is None else tour(pretrained, text, **options)


def tour_html(found: Tour) -> str:
    """The tour's page in an iframe, every character beyond ASCII a character reference."""
    frame = (
        '<iframe class="qkv-tour" title="qkv: a tour of self-attention" '
        f'srcdoc="{escape.attribute(render_tour(found))}" '
        'style="width:100%;height:900px;border:1px solid #ccc"></iframe>'
    )
    return frame.encode("ascii", "xmlcharrefreplace").decode("ascii")


def tour_repr(found: Tour) -> str:
    return (f"Tour({found.text!r} on {found.source}: {found.query!r} <- {found.key!r}, layer "
            f"{found.layer}, head {found.head}; {len(found.steps)} steps)")  # fmt: skip

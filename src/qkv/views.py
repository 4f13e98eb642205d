"""How a result shows itself: its short `repr`, and its `_repr_html_` in a notebook.

Inspection returns data and `viz` draws it; `viz` sits above `inspect` and reads its results, so
a result cannot import the code that draws it. This module, on the bottom floor, is where the two
meet: each result names its view (`view = "trace"`), and the package above both, `qkv`'s own
`__init__`, says which module of `viz` holds the views: that module's `trace_repr(result)` and
`trace_html(result)` draw a `Trace`. The module is imported on a result's first display, so
reading records never loads the page's assets.

Jupyter (JupyterLab, classic Notebook, VS Code) shows an object by calling its `_repr_html_`.
"""

from __future__ import annotations

from importlib import import_module
from typing import ClassVar

# a view's name -> the module of qkv that draws it, filled in by `qkv/__init__.py`
DRAWN_BY: dict[str, str] = {}


class Shown:
    """A result of qkv that shows itself through the view named by `view`. A dataclass that
    inherits it must say `repr=False`, or the dataclass would write its own `repr`."""

    view: ClassVar[str]

    def __repr__(self) -> str:
        return drawing(self.view, "repr")(self)

    def _repr_html_(self) -> str:
        return drawing(self.view, "html")(self)


def drawing(view: str, kind: str):
    """The function that draws `view` as `kind` ('repr' or 'html')."""
    return getattr(import_module(DRAWN_BY[view]), f"{view}_{kind}")

"""The options several verbs share, as typer types: the model, the backend, the layers and
heads chosen, --json and a heatmap's PNG."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

Model = Annotated[str, typer.Option("--model", "-m", help="embedded name, folder, .gguf or id")]
Backend = Annotated[
    str | None,
    typer.Option(help="attention backend: auto, flash, sdpa, eager, loop (see `qkv backends`)"),
]
Layers = Annotated[str | None, typer.Option(help="these layers only, e.g. 0,2,5 or 0-3")]
Heads = Annotated[str | None, typer.Option(help="these heads only, e.g. 0,2,5 or 0-3")]
Json = Annotated[bool, typer.Option("--json", help="every number, as JSON")]
Png = Annotated[Path | None, typer.Option(help="write a layer x head heatmap PNG")]

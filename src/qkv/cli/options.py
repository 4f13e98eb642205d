"""The options several verbs share, as typer types: the model, the backend, the layers and
heads chosen, the pair of words `explain` and `why` take, --json and a heatmap's PNG."""

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
# the pair of words `explain` and `why` read, and where
QueryWord = Annotated[str, typer.Option(help='the word getting context, e.g. bank or "bank#2"')]
KeyWord = Annotated[str, typer.Option(help="the word giving context")]
PairLayer = Annotated[
    int | None, typer.Option(help="counted from 0; default: where query attends most to key")
]
PairHead = Annotated[int | None, typer.Option(help="counted from 0")]
Target = Annotated[
    str | None, typer.Option(help="encoder-decoder models: the decoder's text (query word)")
]


def say_metric_notes(metric: str | None, pretrained) -> None:
    """One line on stderr for each of the metric's tokens typed without the leading space the
    model's own token has ("prob: Paris" where it writes " Paris"): never silently."""
    if metric is None:
        return
    from qkv.inspect.metrics import Metric

    try:
        parsed = Metric.parse(metric)
    except ValueError:
        return  # the verb refuses it itself, in its own words
    for note in parsed.notes(pretrained.tokenizer):
        typer.echo(note, err=True)


class Verb(typer.core.TyperCommand):
    """A verb whose usage line names a required argument in capitals ("TEXT"), not in braces
    ("{text}", typer's own way), which reads as a template left unfilled."""

    def collect_usage_pieces(self, ctx) -> list[str]:
        pieces = super().collect_usage_pieces(ctx)
        return [p[1:-1].upper() if p[:1] == "{" and p[-1:] == "}" else p for p in pieces]

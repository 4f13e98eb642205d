"""`qkv tour`: the article's steps on a real model for one sentence, as one self-contained
HTML page that works offline (`qkv.viz.tour.write_tour`)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from qkv.cli.errors import check_out, user_errors
from qkv.cli.options import Backend, Model, PairHead, PairLayer, Target


def tour(
    text: Annotated[
        str | None, typer.Argument(help="the sentence (default: the article's)", metavar="TEXT")
    ] = None,
    model: Model = "minilm",
    out: Annotated[Path, typer.Option(help="the page to write (.html)")] = Path("tour.html"),
    query: Annotated[str | None, typer.Option(help='the word getting context: "bank#2"')] = None,
    key: Annotated[str | None, typer.Option(help="the word giving context")] = None,
    layer: PairLayer = None,
    head: PairHead = None,
    target: Target = None,
    swap: Annotated[str | None, typer.Option(help="the word put in the key word's place")] = None,
    compare: Annotated[
        str | None, typer.Option(help="a second sentence with the query word")
    ] = None,
    backend: Backend = None,
) -> None:
    """Write a guided tour of self-attention for TEXT: tokens, embeddings, the seven steps,
    scaling, heads, layers, cross-attention, training and parallel computation, each with the
    model's own numbers and experiments, beside a diagram of the model. Open it in a browser."""
    from qkv.pretrained import load
    from qkv.viz.tour import write_tour

    with user_errors(out):
        check_out(out, (".html", ".htm"))
        pretrained = load(model, backend=backend)
        written = write_tour(pretrained, text, out, query=query, key=key, layer=layer, head=head,
                             target=target, swap=swap, compare=compare)  # fmt: skip
    typer.echo(f"wrote {written}")

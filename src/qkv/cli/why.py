"""`qkv why`: why one word attends to another as much as it does, the score taken apart into
terms, each in words, with the causal checks beside them (`qkv.why`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from qkv.cli.errors import check_out, user_errors
from qkv.cli.options import Backend, Json, KeyWord, Model, PairHead, PairLayer, QueryWord, Target


def why(
    text: Annotated[str, typer.Argument(metavar="TEXT")],
    query: QueryWord,
    key: KeyWord,
    model: Model = "minilm",
    layer: PairLayer = None,
    head: PairHead = None,
    target: Target = None,
    top: Annotated[int, typer.Option(help="terms listed, the largest first (--json too)")] = 10,
    checks: Annotated[
        int, typer.Option(help="top parts of each side removed for real and rerun (0: none)")
    ] = 3,
    out: Annotated[Path | None, typer.Option(help="write the grid of terms as a PNG")] = None,
    as_json: Json = False,
    backend: Backend = None,
) -> None:
    """Why QUERY attends to KEY in TEXT: the score as a sum of terms, one per (part of QUERY's
    query, part of KEY's key), the largest in words, then each top part removed for real."""
    from qkv.inspect.why import why as run_why
    from qkv.pretrained import load
    from qkv.viz.why_lines import why_lines

    with user_errors(out):
        if top < 1:
            raise ValueError(f"--top must be 1 or more, got {top}")
        if checks < 0:
            raise ValueError(f"--checks must be 0 or more, got {checks}")
        if out is not None:
            check_out(out, (".png",))
        pretrained = load(model, backend=backend)
        found = run_why(pretrained, text, query, key, layer=layer, head=head, target=target,
                        checks=checks)  # fmt: skip
        if out is not None:
            from qkv.viz.plots import why_plot

            out.parent.mkdir(parents=True, exist_ok=True)  # as `qkv show` makes its folders
            why_plot(found, out)
    typer.echo(json.dumps(found.to_dict(top)) if as_json else why_lines(found, top))
    if out is not None and not as_json:
        typer.echo(f"wrote {out}")

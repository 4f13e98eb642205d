"""`qkv lens` and `qkv heads`: a decoder's prediction after each layer, and a census of what
each head of a model does."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from qkv.cli.errors import check_out, user_errors
from qkv.cli.interventions import Text, Texts, prompts_of
from qkv.cli.options import Backend, Model


def lens(
    text: Text = None,
    model: Model = "smollm2",
    token: Annotated[
        str | None, typer.Option(help="the next token to follow, e.g. ' Paris' (one token)")
    ] = None,
    position: Annotated[
        int, typer.Option(help="the position read in each text, from 0; -1: the last")
    ] = -1,
    top: Annotated[int, typer.Option(help="next tokens shown per layer")] = 5,
    terms: Annotated[int, typer.Option(help="attribution terms shown, the largest first")] = 10,
    attribution: Annotated[
        bool, typer.Option(help="the direct logit attribution (--no-attribution: the lens only)")
    ] = True,
    texts: Texts = None,
    as_json: Annotated[bool, typer.Option("--json", help="every number, as JSON")] = False,
    backend: Backend = None,
) -> None:
    """A decoder's next-token prediction after each layer (the logit lens), and each head's
    and MLP's direct contribution to the token's logit."""
    from qkv.inspect.lens import lens as run_lens
    from qkv.pretrained import load
    from qkv.viz.lines import lens_lines

    with user_errors():
        if terms < 0:
            raise ValueError(f"--terms must be 0 or more, got {terms}")
        prompts = prompts_of(text, texts)
        found = run_lens(load(model, backend=backend), prompts, position=position, token=token,
                         top=top, attribute=attribution)  # fmt: skip
    typer.echo(json.dumps(found.to_dict()) if as_json else lens_lines(found, terms))


def heads_census(
    model: Model = "minilm",
    top: Annotated[int, typer.Option(help="how many heads to list for each score")] = 5,
    out: Annotated[
        Path | None, typer.Option(help="a PNG scatter: previous-token vs induction per head")
    ] = None,
    texts: Annotated[
        Path | None,
        typer.Option(
            help="a file of prompts instead of the built-in ones: one a line, TSV (the first "
            'column) or .jsonl ({"text": ...})'
        ),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="every score, as JSON")] = False,
    backend: Backend = None,
) -> None:
    """A census of the model's heads: previous-token, induction, first-token (sink), self,
    entropy and window use on built-in prompts (or --texts); the top heads, with bootstrap
    95% intervals over the prompts, and each layer's sink mass."""
    from qkv.inspect.census import heads
    from qkv.pretrained import load
    from qkv.viz.lines import census_lines
    from qkv.viz.plots import census_plot

    with user_errors(out):
        if top < 1:
            raise ValueError(f"--top must be 1 or more, got {top}")
        if out is not None:
            check_out(out, (".png",))
        census = heads(load(model, backend=backend), prompts=texts)
        if out is not None:
            out.parent.mkdir(parents=True, exist_ok=True)
            census_plot(census, out)
    if as_json:
        typer.echo(json.dumps(census.to_dict(top)))
        return
    typer.echo(census_lines(census, top))
    if out is not None:
        typer.echo(f"wrote {out}")

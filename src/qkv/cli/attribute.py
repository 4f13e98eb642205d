"""`qkv attribute`: every patch of `qkv patch` estimated from one backward pass (attribution
patching), and with --edges every sender-receiver edge."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from qkv.cli.errors import user_errors
from qkv.cli.options import Backend, Json, Model, say_metric_notes


def attribute(
    clean: Annotated[str | None, typer.Argument(help="the clean text")] = None,
    corrupt: Annotated[str | None, typer.Argument(help="the corrupted text")] = None,
    metric: Annotated[
        str | None,
        typer.Option(
            help="'diff: Mary, John' (log p(' Mary') - log p(' John')), 'prob: Paris', "
            "'logprob: Paris' or 'kl', of the next token; tokens as written, spaces kept"
        ),
    ] = None,
    model: Model = "smollm2",
    pairs: Annotated[
        Path | None,
        typer.Option(
            help="a file of pairs instead of CLEAN CORRUPT: TSV clean<TAB>corrupt"
            "[<TAB>metric] or JSONL"
        ),
    ] = None,
    edges: Annotated[
        bool, typer.Option("--edges", help="score every sender-receiver edge")
    ] = False,
    steps: Annotated[
        int, typer.Option(help="1: gradient x difference; more: integrated gradients (EAP-IG)")
    ] = 1,
    top: Annotated[int, typer.Option(help="heads (and edges) listed, the largest first")] = 10,
    faithfulness: Annotated[
        bool, typer.Option("--faithfulness", help="also run real patching and compare the heads")
    ] = False,
    as_json: Json = False,
    backend: Backend = None,
) -> None:
    """Estimate what patching each head, MLP and residual position of CLEAN into CORRUPT does
    to the next token's METRIC, all at once: gradient x difference (attribution patching)."""
    from qkv.inspect.attribute import attribute as run_attribute
    from qkv.pretrained import load
    from qkv.viz.notebook_attribute import attributed_lines, faithfulness_line

    with user_errors():
        if top < 1:
            raise ValueError(f"--top must be 1 or more, got {top}")
        if (pairs is None) == (clean is None or corrupt is None) or (pairs and clean):
            raise ValueError("give CLEAN and CORRUPT, or --pairs FILE (not both)")
        if metric is None and pairs is None:
            raise ValueError("give --metric, e.g. --metric 'diff: Mary, John'")
        pretrained = load(model, backend=backend)
        say_metric_notes(metric, pretrained)
        if pairs is not None:
            result = run_attribute(pretrained, pairs, None, metric, edges=edges, steps=steps)
        else:
            result = run_attribute(pretrained, clean, corrupt, metric, edges=edges, steps=steps)
        checked = result.faithfulness(min(top, result.heads.numel())) if faithfulness else None
    if as_json:
        found = result.to_dict()
        if checked is not None:
            found["faithfulness"] = checked.to_dict()
        typer.echo(json.dumps(found))
        return
    typer.echo(attributed_lines(result, top))
    if checked is not None:
        typer.echo(faithfulness_line(checked))

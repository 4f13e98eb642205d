"""`qkv circuits`: each head's QK and OV circuits from a model's weights alone, and which
heads could compose (docs/circuits.md)."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from qkv.cli.errors import user_errors
from qkv.cli.options import Model


def circuits(
    model: Model = "smollm2",
    kind: Annotated[
        str,
        typer.Option(
            help="q, k or v: which composition (a later head's queries, keys "
            "or values reading an earlier head's output)"
        ),
    ] = "k",
    top: Annotated[int, typer.Option(help="how many pairs (and tokens) to show")] = 10,
    head: Annotated[
        str | None, typer.Option(help="one head's token tables too, as L.H (e.g. 3.5)")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="every number, as JSON")] = False,
) -> None:
    """The strongest compositions between heads of different layers (Elhage et al. 2021),
    from the weights alone; with --head, that head's top token pairs and copied tokens."""
    from qkv.inspect.circuits import circuits as read_circuits
    from qkv.pretrained import load
    from qkv.viz.notebook_circuits import circuits_lines, head_lines

    with user_errors():
        if kind not in ("q", "k", "v"):
            raise ValueError(f"--kind must be q, k or v, got {kind!r}")
        if top < 1:
            raise ValueError(f"--top must be 1 or more, got {top}")
        where = _head(head) if head is not None else None
        found = read_circuits(load(model))
        one = found.head_circuit(*where, top=top) if where is not None else None
        strongest = found.strongest(kind, top)
    if as_json:
        data = {"source": found.source, "kind": kind,
                "strongest": [{"sender": s, "receiver": r, "score": v} for s, r, v in strongest],
                "notes": found.notes, "head": None if one is None else one.to_dict()}  # fmt: skip
        typer.echo(json.dumps(data))
        return
    typer.echo(circuits_lines(found, kind, top))
    if one is not None:
        typer.echo(head_lines(one))


def _head(text: str) -> tuple[int, int]:
    """ "3.5" or "L3.H5" -> (3, 5)."""
    parts = text.upper().removeprefix("L").replace(".H", ".").split(".")
    if len(parts) != 2 or not all(p.isdigit() for p in parts):
        raise ValueError(f"--head is a layer and a head as L.H, e.g. 3.5 or L3.H5; got {text!r}")
    return int(parts[0]), int(parts[1])

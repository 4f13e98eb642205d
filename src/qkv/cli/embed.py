"""`qkv embed`: sentence vectors, shown as their cosine similarities or as JSON lines."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from qkv.cli.errors import user_errors
from qkv.cli.options import Backend, Model


def embed(
    sentences: Annotated[list[str], typer.Argument(metavar="SENTENCES...")],
    model: Model = "minilm",
    as_json: Annotated[bool, typer.Option("--json", help="one JSON line per sentence")] = False,
    backend: Backend = None,
) -> None:
    """Sentence vectors; shown as their cosine similarities, or as JSON lines."""
    from qkv.pretrained import load

    with user_errors():
        vectors = load(model, backend=backend).embed(sentences)
    if as_json:
        for sentence, vector in zip(sentences, vectors.tolist(), strict=True):
            typer.echo(json.dumps({"sentence": sentence, "embedding": vector}))
        return
    unit = vectors / vectors.norm(dim=-1, keepdim=True)
    similarity = unit @ unit.T
    typer.echo(f"{len(sentences)} sentences, {vectors.shape[1]} numbers each; cosine similarity:")
    for i, sentence in enumerate(sentences):
        row = " ".join(f"{s:+.3f}" for s in similarity[i].tolist())
        typer.echo(f"  [{i}] {row}  {sentence}")

"""`qkv explain` and `qkv probe`: the article's steps for one pair of words, and how context
separates the senses of a word, with a real model's numbers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from qkv.cli.errors import check_out, user_errors
from qkv.cli.options import Backend, Json, KeyWord, Model, PairHead, PairLayer, QueryWord, Target


def explain(
    text: Annotated[str, typer.Argument(metavar="TEXT")],
    query: QueryWord,
    key: KeyWord,
    model: Model = "minilm",
    layer: PairLayer = None,
    head: PairHead = None,
    as_json: Json = False,
    target: Target = None,
    backend: Backend = None,
) -> None:
    """The article's steps for QUERY getting context from KEY in TEXT, with real numbers."""
    from qkv.inspect.trace import trace
    from qkv.pretrained import load
    from qkv.viz.narrate import contributions, heads_and_layers, narrate, tokens_line

    with user_errors():
        pretrained = load(model, backend=backend)
        traced = trace(pretrained, text, query, key, layer=layer, head=head, target=target)
    if as_json:
        typer.echo(json.dumps(traced.to_dict()))
        return
    typer.echo(tokens_line(traced) + "\n")
    typer.echo(narrate(traced, _why(pretrained, traced, text, target)) + "\n")
    for part in (contributions, heads_and_layers):
        typer.echo(part(traced) + "\n")


def _why(pretrained, traced, text: str, target: str | None):
    """The traced pair's score taken apart (`qkv.why`, no reruns: explain stays fast), or why
    it cannot be: None where the layer computes no score the softmax reads for the pair."""
    from qkv.inspect.why import why

    if traced.linear is not None or traced.compressed is not None or traced.masked:
        return None
    try:
        return why(pretrained, text, traced.query, traced.key, layer=traced.layer,
                   head=traced.head, target=target, checks=0)  # fmt: skip
    except ValueError as refused:  # a model qkv.why refuses by name: explain still tells 1-7
        return " ".join(str(refused).split())


def probe(
    word: Annotated[str, typer.Argument(metavar="WORD")],
    sentences: Annotated[
        Path | None,
        typer.Option(
            help="a text file, one sentence a line, or 'label<TAB>sentence', or "
            "'label<TAB>cue<TAB>sentence' (cue: the word that tells the sense)"
        ),
    ] = None,
    model: Model = "minilm",
    out: Annotated[Path | None, typer.Option(help="write the similarity matrices as a PNG")] = None,
    as_json: Json = False,
    hide_context: Annotated[
        bool,
        typer.Option(
            help="also hide every other word from WORD (every layer and head): do its senses "
            "still separate?"
        ),
    ] = False,
) -> None:
    """How context separates the senses of WORD across sentences, layer by layer."""
    from qkv.inspect.probe import probe as run_probe
    from qkv.inspect.sentences_file import read_sentences
    from qkv.pretrained import load
    from qkv.viz.lines import probe_lines
    from qkv.viz.plots import probe_plot

    with user_errors(out):
        texts, labels, cues = read_sentences(sentences) if sentences else (None, None, None)
        if out is not None:
            check_out(out, (".png",))
        pretrained = load(model)
        result = run_probe(pretrained, word, texts, labels, cues=cues)
        senses = None
        if hide_context:
            from qkv.inspect.hide import senses_without_context

            senses = senses_without_context(pretrained, word, result.sentences, result.labels)
        if out is not None:
            out.parent.mkdir(parents=True, exist_ok=True)  # as `qkv show` makes its folders
            probe_plot(result, out)
    if as_json:
        data = result.to_dict()
        if senses is not None:
            data["hidden_context"] = senses.to_dict()
        typer.echo(json.dumps(data))
        return
    typer.echo(probe_lines(result))
    if senses is not None:
        from qkv.viz.lines import senses_lines

        typer.echo("\n" + senses_lines(senses))
    if out is not None:
        typer.echo(f"wrote {out}")

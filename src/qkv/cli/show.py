"""`qkv show`: every layer's and head's attention over a text, as a page, heatmaps or a
report folder (`qkv.viz.show` chooses and draws)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from qkv.cli.errors import check_out, user_errors
from qkv.cli.options import Backend, Model


def show(
    text: Annotated[str, typer.Argument(metavar="TEXT")],
    model: Model = "minilm",
    out: Annotated[
        Path,
        typer.Option(help="FILE.html (interactive page), FILE.png (heatmaps) or a report folder"),
    ] = Path("qkv-show.html"),
    layers: Annotated[
        str | None, typer.Option(help="a PNG grid of these layers, e.g. 0,2,5")
    ] = None,
    heads: Annotated[str | None, typer.Option(help="a PNG grid of these heads, e.g. 0-3")] = None,
    layer: Annotated[int | None, typer.Option(help="the one head to show: its layer")] = None,
    head: Annotated[int | None, typer.Option(help="the one head to show, from 0")] = None,
    target: Annotated[
        str | None,
        typer.Option(help="encoder-decoder models: the decoder's text; shows cross-attention"),
    ] = None,
    backend: Backend = None,
    region: Annotated[
        str | None,
        typer.Option(help="Q0:Q1,K0:K1: these queries x keys of --layer/--head, every weight"),
    ] = None,
    transformers: Annotated[
        bool,
        typer.Option(
            "--transformers",
            help="load MODEL with transformers, any family it reads, "
            "on qkv's attention (docs/hf.md)",
        ),
    ] = False,
) -> None:
    """Every layer's and head's attention over TEXT: a page, heatmaps, or a report folder.

    A .png is one head's heatmap (--layer, --head), or with --layers/--heads a grid of
    every chosen layer x head. With --target, an encoder-decoder's cross-attention: the
    target's tokens down, TEXT's across (a page, a .png or a report folder). A text of more
    than 512 tokens is drawn from its summaries (docs/long.md): heatmaps where each cell is the
    maximum of its block of weights, a page of per-head summaries; --region opens a part at
    full resolution. With --transformers, MODEL (a folder or hub id) is loaded by transformers
    and run on qkv's attention (qkv.hf), so families qkv does not implement show too.
    """
    from qkv.inspect.words import compressed_words
    from qkv.pretrained import load
    from qkv.viz.show import LONG, draw_attention

    def untraced(why: str) -> None:
        typer.echo(f"(the page traces no pair: {why}; qkv explain and qkv serve "
                   "trace this model)", err=True)  # fmt: skip

    with user_errors(out):
        check_out(out)
        if transformers:
            if backend is not None:
                raise ValueError(
                    "--backend chooses the backend of qkv's own models; with "
                    "--transformers qkv's attention takes the fastest (auto)"
                )
            import qkv.hf

            pretrained = qkv.hf.load(model)
        else:
            pretrained = load(model, backend=backend)
        # the one forward pass; a long text is drawn from summaries, never from every weight
        long = len(pretrained.encode(text).ids) > LONG
        seen = pretrained.attentions(text, target=target, weights=False if long else None)
        draw_attention(seen, out, name=model, text=text, model=pretrained.model,
                       transformers=transformers, layers=layers, heads=heads, layer=layer,
                       head=head, region=region, cross=target is not None,
                       untraced=untraced)  # fmt: skip
        spread = compressed_words(seen.records)
        if spread is not None:  # a picture says it in no words of its own
            typer.echo(f"({spread})", err=True)
    typer.echo(f"wrote {out}")

"""`qkv generate`: continue a prompt with a pretrained decoder, printing tokens as they come,
and with --attention a page of what each generated token attended to."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from qkv.cli.errors import check_out, user_errors
from qkv.cli.options import Backend, Model


def generate(
    prompt: Annotated[str, typer.Argument(metavar="PROMPT")],
    model: Model = "smollm2",
    max_new_tokens: Annotated[
        int | None,
        typer.Option("--max-new-tokens", "-n", help="default: 64, or an encoder-decoder's window"),
    ] = None,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int | None = None,
    stop: Annotated[list[str] | None, typer.Option(help="stop at this text (repeatable)")] = None,
    chat: Annotated[bool, typer.Option(help="wrap the prompt in the chat template")] = False,
    system: str | None = None,
    backend: Backend = None,
    int4: Annotated[bool, typer.Option(help="keep a .gguf file's 4-bit weights packed")] = False,
    precision: Annotated[
        str,
        typer.Option(
            help="auto: a .gguf file's own 4- and 5-bit blocks, as the file holds them, on the "
            "CPU; loaded: "
            "the weights as loaded (transformers' numbers); int4"
        ),
    ] = "auto",
    attention: Annotated[
        Path | None,
        typer.Option(help="write a page where each generated token shows what it attended to"),
    ] = None,
    layers: Annotated[
        str | None, typer.Option(help="--attention's layers, e.g. 0,2,5 or 0-3 (default: all)")
    ] = None,
    heads: Annotated[
        str | None, typer.Option(help="--attention's heads, e.g. 0,2 (default: all)")
    ] = None,
) -> None:
    """Continue PROMPT with a pretrained decoder, printing tokens as they come."""
    from qkv.pretrained import load

    with user_errors(attention):
        if not prompt.strip():
            raise ValueError(
                "the prompt is empty; give the text to continue, e.g. qkv generate 'The river bank'"
            )
        from qkv.generate import Sampling

        Sampling(temperature, top_k, top_p, seed)  # checked before the model loads
        if precision not in ("auto", "loaded", "int4"):
            raise ValueError(f"--precision is auto, loaded or int4, not {precision!r}")
        if attention is None and (layers is not None or heads is not None):
            raise ValueError("--layers and --heads choose what --attention FILE.html shows")
        if attention is not None:
            if attention.suffix.lower() not in (".html", ".htm"):
                raise ValueError(f"--attention {attention} must end in .html")
            check_out(attention, (".html", ".htm"))
        pretrained = load(model, backend=backend, int4=int4)
        recording = None
        if attention is not None:
            from qkv.viz.generation_recording import page_recording

            recording = page_recording(pretrained, prompt, layers=layers, heads=heads,
                                       name=model, chat=chat, system=system,
                                       new=max_new_tokens or 64)  # fmt: skip

        def show(row: int, piece: str) -> None:
            sys.stdout.write(piece)
            sys.stdout.flush()

        from qkv.models import EncoderDecoder

        seq2seq = isinstance(pretrained.model, EncoderDecoder)
        if max_new_tokens is None:  # an encoder-decoder writes a new text, up to its window
            max_new_tokens = pretrained.context_window if seq2seq else 64
        if not chat and not seq2seq:
            typer.echo(prompt, nl=False)  # a decoder continues the prompt
        seen = pretrained.generate(
            prompt, max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
            seed=seed, stop=stop or (), stream=show, chat=chat, system=system, record=recording,
            precision=precision,
        )  # fmt: skip
        typer.echo()
        if attention is not None:
            from qkv.viz.generation import write_generation_page

            attention.parent.mkdir(parents=True, exist_ok=True)  # as `qkv show` makes its folders
            write_generation_page(attention, seen, title=f"{model}: attention while generating")
            typer.echo(f"wrote {attention}")

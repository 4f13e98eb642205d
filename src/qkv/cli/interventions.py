"""`qkv hide` and `qkv ablate`: change one head at a time and measure what moves (`qkv patch`
is in `qkv.cli.patch`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from qkv.cli.errors import check_out, user_errors
from qkv.cli.options import Backend, Heads, Json, Layers, Model, Png

# the prompts a verb runs over: one TEXT argument, or a file of them
Text = Annotated[str | None, typer.Argument(help="the text; or give --texts FILE")]
Texts = Annotated[
    Path | None,
    typer.Option(
        help="a file of prompts instead of TEXT: one a line, TSV (the first column) or .jsonl "
        '({"text": ...}); means are printed with their bootstrap 95% intervals'
    ),
]


def prompts_of(text: str | None, texts: Path | None) -> str | Path:
    """The one text or the file: exactly one of them."""
    if (text is None) == (texts is None):
        raise ValueError("give the text, or --texts FILE (a file of prompts), not both")
    return texts if texts is not None else text


def _shape(pretrained, verb: str, model: str) -> tuple[int, int]:
    """(layers, heads) of the stack `qkv VERB` changes: heads, the most a layer has."""
    from qkv.inspect.layer_heads import heads_per_layer  # the library, loaded when run
    from qkv.models import self_attention_stack

    stack = self_attention_stack(pretrained.model, f"qkv {verb}", model)
    return stack.config.num_layers, max(heads_per_layer(stack))


def hide(
    key: Annotated[str, typer.Option(help='the word to hide, e.g. river or "river#2"')],
    text: Text = None,
    query: Annotated[
        str | None, typer.Option(help="the word it is hidden from; default: every word")
    ] = None,
    model: Model = "minilm",
    layers: Layers = None,
    heads: Heads = None,
    top: Annotated[int, typer.Option(help="heads listed, the largest effect first")] = 10,
    texts: Texts = None,
    out: Png = None,
    as_json: Json = False,
    backend: Backend = None,
) -> None:
    """Which heads carry KEY into QUERY: hide it in each head alone, then in all at once."""
    from qkv.attention.index_text import parse_indices
    from qkv.inspect.hide import hide as run_hide
    from qkv.pretrained import load
    from qkv.viz.lines import hide_lines

    with user_errors(out):
        if top < 1:
            raise ValueError(f"--top must be 1 or more, got {top}")
        prompts = prompts_of(text, texts)
        if out is not None:
            check_out(out, (".png",))
        pretrained = load(model, backend=backend)
        L, H = _shape(pretrained, "hide", model)
        result = run_hide(pretrained, prompts, key, query=query,
                          layers=parse_indices(layers, "layers", L, model),
                          heads=parse_indices(heads, "heads", H, model))  # fmt: skip
        if out is not None:
            from qkv.viz.grids import grid_plot

            who = f"'{query}'" if query else "every word"
            grid_plot([("1 - cosine", result.effect, None)], out, label="change",
                      title=f"{model}: '{key}' hidden from {who}, one head at a time")  # fmt: skip
    typer.echo(json.dumps(result.to_dict()) if as_json else hide_lines(result, top))
    if out is not None and not as_json:
        typer.echo(f"wrote {out}")


def ablate(
    text: Text = None,
    model: Model = "minilm",
    layers: Layers = None,
    heads: Heads = None,
    mode: Annotated[
        str, typer.Option(help="zero, or mean (each head's mean output over reference texts)")
    ] = "zero",
    texts: Texts = None,
    out: Png = None,
    as_json: Json = False,
    backend: Backend = None,
) -> None:
    """What each head does to TEXT: ablate it alone (zero or mean), then all chosen at once."""
    from qkv.attention.index_text import parse_indices
    from qkv.attention.inputs import check_indices
    from qkv.inspect.ablate import ablate as run_ablate
    from qkv.inspect.layer_heads import check_heads, heads_per_layer
    from qkv.inspect.runs import stack_of
    from qkv.pretrained import load
    from qkv.viz.lines import ablate_lines

    with user_errors(out):
        prompts = prompts_of(text, texts)
        if out is not None:
            check_out(out, (".png",))
        pretrained = load(model, backend=backend)
        L, H = _shape(pretrained, "ablate", model)
        chosen_layers = check_indices("layer", parse_indices(layers, "layers", L, model), L, model)
        chosen_heads = check_indices("head", parse_indices(heads, "heads", H, model), H, model)
        # each layer's own heads (layers may differ: Qwen3.5's); one no layer asked has is
        # refused by its layer's count
        counts = heads_per_layer(stack_of(pretrained))
        check_heads(chosen_heads, chosen_layers, counts, model)
        pairs = [(n, h) for n in chosen_layers for h in chosen_heads if h < counts[n]]
        result = run_ablate(pretrained, prompts, pairs, mode=mode)
        if out is not None:
            from qkv.viz.grids import grid_plot

            grid_plot([("1 - cosine", result.effect, None)], out, label="change",
                      title=f"{model}: each head {mode}-ablated alone")  # fmt: skip
    typer.echo(json.dumps(result.to_dict()) if as_json else ablate_lines(result))
    if out is not None and not as_json:
        typer.echo(f"wrote {out}")

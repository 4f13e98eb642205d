"""`qkv patch` and `qkv path-patch`: copy one part of the clean run into the corrupted run
(docs/patch.md), or send one head's change through chosen receivers only (docs/path_patch.md),
over one pair of texts or a file of pairs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from qkv.cli.errors import check_out, user_errors
from qkv.cli.options import Backend, Json, Layers, Model, Png, say_metric_notes

Metric = Annotated[
    str | None,
    typer.Option(
        help="'diff: Mary, John' (log p(' Mary') - log p(' John')), 'prob: Paris', "
        "'logprob: Paris' or 'kl', of the next token; tokens as written, spaces kept; a file's "
        "line may give its own"
    ),
]
Pairs = Annotated[
    Path | None,
    typer.Option(
        "--pairs",
        help="a file of pairs instead of CLEAN CORRUPT: TSV 'clean<TAB>corrupt[<TAB>metric]' "
        'lines, or JSONL {"clean", "corrupt", "metric"} (a .jsonl name)',
    ),
]
Seed = Annotated[int, typer.Option(help="the bootstrap interval's seed")]


def _pairs(clean: str | None, corrupt: str | None, pairs: Path | None):
    """(clean, corrupt) as the library takes them: two texts, or a file and None."""
    if pairs is not None:
        if clean is not None or corrupt is not None:
            raise ValueError("give CLEAN CORRUPT or --pairs FILE, not both")
        return pairs, None
    if clean is None or corrupt is None:
        raise ValueError("give two texts, CLEAN and CORRUPT, or --pairs FILE")
    return clean, corrupt


def patch(
    clean: Annotated[str | None, typer.Argument(help="the clean text")] = None,
    corrupt: Annotated[str | None, typer.Argument(help="the corrupted text")] = None,
    metric: Metric = None,
    pairs: Pairs = None,
    what: Annotated[
        str,
        typer.Option(
            help="what to patch, comma-separated: heads, head_positions, q, k, v, weights, "
            "residual, mlp, mlp_layers"
        ),
    ] = "heads,residual",
    model: Model = "smollm2",
    layers: Layers = None,
    seed: Seed = 0,
    out: Png = None,
    as_json: Json = False,
    backend: Backend = None,
) -> None:
    """Patch CLEAN's head outputs, queries, keys, values, weights, MLP outputs or residual
    stream into CORRUPT, one at a time, and score the next token: which parts of the model
    carry the difference (over every pair of --pairs FILE, with 95% intervals)."""
    from qkv.attention.index_text import parse_indices
    from qkv.inspect.patch import patch as run_patch
    from qkv.inspect.runs import stack_of
    from qkv.pretrained import load
    from qkv.viz.lines import patch_lines

    with user_errors(out):
        if out is not None:
            check_out(out, (".png",))
        first, second = _pairs(clean, corrupt, pairs)
        whats = [name.strip() for name in what.split(",") if name.strip()]
        pretrained = load(model, backend=backend)
        say_metric_notes(metric, pretrained)
        L = stack_of(pretrained).config.num_layers
        result = run_patch(pretrained, first, second, metric, what=whats, seed=seed,
                           layers=parse_indices(layers, "layers", L, model))  # fmt: skip
        if out is not None:
            from qkv.viz.grids import grid_plot

            grids = [(name, result.restored(result.grid(name)),
                      result.position_labels() if name in ("residual", "mlp") else None)
                     for name in result.what if result.grid(name).dim() == 2]  # fmt: skip
            if not grids:
                raise ValueError("--out draws the (layer x head) and (layer x position) grids; "
                                 f"--what {what} has none")  # fmt: skip
            grid_plot(grids, out, label="restored", title=f"{model}: {result.metric}")
    typer.echo(json.dumps(result.to_dict()) if as_json else patch_lines(result))
    if out is not None and not as_json:
        typer.echo(f"wrote {out}")


def path_patch(
    clean: Annotated[str | None, typer.Argument(help="the clean text")] = None,
    corrupt: Annotated[str | None, typer.Argument(help="the corrupted text")] = None,
    sender: Annotated[str, typer.Option(help="the sender head, LAYER.HEAD, e.g. 3.1")] = "",
    receivers: Annotated[
        str,
        typer.Option(
            help="'all', or comma-separated LAYER.HEAD, LAYER.mlp and logits, e.g. 5.0,5.mlp"
        ),
    ] = "all",
    via: Annotated[str, typer.Option(help="the receiver heads' inputs: q, k, v or e.g. q,k")] = "q",
    metric: Metric = None,
    pairs: Pairs = None,
    model: Model = "smollm2",
    seed: Seed = 0,
    as_json: Json = False,
    backend: Backend = None,
) -> None:
    """Send the sender head's change (its clean output in the corrupted run) through the
    receivers only, and score the next token: how much of its effect goes that way."""
    from qkv.inspect.path_patch import path_patch as run_path_patch
    from qkv.pretrained import load
    from qkv.viz.lines import path_patch_lines

    with user_errors():
        first, second = _pairs(clean, corrupt, pairs)
        head, chosen = parse_head(sender), parse_receivers(receivers)  # before the model loads
        pretrained = load(model, backend=backend)
        say_metric_notes(metric, pretrained)
        result = run_path_patch(pretrained, first, second, metric,
                                sender=head, receivers=chosen,
                                via=via.replace(" ", "").split(","), seed=seed)  # fmt: skip
    typer.echo(json.dumps(result.to_dict()) if as_json else path_patch_lines(result))


def parse_head(text: str) -> tuple[int, int]:
    """'3.1' -> (3, 1)."""
    layer, dot, head = text.strip().partition(".")
    if not (dot and layer.isdigit() and head.isdigit()):
        raise ValueError(f"--sender is LAYER.HEAD, e.g. 3.1 (counted from 0); got {text!r}")
    return int(layer), int(head)


def parse_receivers(text: str):
    """'all', or '5.0,5.mlp,logits' -> [(5, 0), (5, 'mlp'), 'logits']."""
    if text.strip() == "all":
        return "all"
    found: list = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        layer, dot, rest = part.partition(".")
        if part == "logits":
            found.append("logits")
        elif dot and layer.isdigit() and (rest.isdigit() or rest == "mlp"):
            found.append((int(layer), int(rest) if rest.isdigit() else "mlp"))
        else:
            raise ValueError(f"--receivers takes 'all' or LAYER.HEAD, LAYER.mlp and logits, "
                             f"comma-separated; got {part!r}")  # fmt: skip
    return found

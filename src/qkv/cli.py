"""The `qkv` command. Thin: every verb calls a library function and prints its result."""

from __future__ import annotations

import typer

app = typer.Typer(
    help="qkv: the transformer's self-attention mechanism, real, fast and inspectable.",
    no_args_is_help=True,
    add_completion=False,
)


@app.callback()
def _root() -> None:
    """Keeps `qkv VERB` a group of verbs even while there are few of them."""


@app.command()
def version() -> None:
    """Print qkv's version and the torch it runs on."""
    import torch

    import qkv

    typer.echo(f"qkv {qkv.__version__} (torch {torch.__version__})")


@app.command()
def backends() -> None:
    """List the attention backends, fastest first."""
    from qkv.attention import BACKENDS, backend_names

    for name in backend_names():
        if name == "auto":
            typer.echo("auto     the fastest backend that supports the inputs")
        else:
            typer.echo(f"{name:<8} {BACKENDS[name].description}")


def main() -> None:
    app()


if __name__ == "__main__":
    main()

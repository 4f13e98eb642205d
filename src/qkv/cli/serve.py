"""`qkv serve`: the attention explorer, a local web page and its JSON API, until Ctrl-C."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from qkv.cli.errors import user_errors
from qkv.cli.options import Backend


def serve(
    model: Annotated[
        list[str] | None,
        typer.Option("--model", "-m", help="a model to serve (repeatable); default: the embedded"),
    ] = None,
    host: Annotated[str, typer.Option(help="the address to listen on; loopback by default")] = (
        "127.0.0.1"
    ),
    port: Annotated[int, typer.Option(help="0 picks a free port")] = 8000,
    max_tokens: Annotated[int, typer.Option(help="tokens per text, at most")] = 128,
    max_long_tokens: Annotated[
        int, typer.Option(help="tokens per long text (read from its summaries), at most")
    ] = 4096,
    timeout: Annotated[float, typer.Option(help="seconds per request, at most")] = 10.0,
    backend: Backend = None,
    quiet: Annotated[bool, typer.Option(help="no request log")] = False,
    atlas: Annotated[
        Path | None, typer.Option(help="an atlas folder (qkv atlas) to serve at /atlas/")
    ] = None,
) -> None:
    """The attention explorer: a local web page and its JSON API (/docs), until Ctrl-C."""
    from qkv.io.embedded import EMBEDDED
    from qkv.pretrained import load

    with user_errors():
        try:
            from qkv.serve import Limits, bind, create_app
            from qkv.serve import serve as run_server
            from qkv.serve.server import address
        except ModuleNotFoundError as error:
            if (error.name or "").partition(".")[0] not in _SERVE_EXTRA:
                raise
            raise ValueError(
                f"qkv serve needs the [serve] extra ({error.name} is missing); "
                "install it with: pip install 'qkv[serve]'"
            ) from None
        names = list(dict.fromkeys(model or EMBEDDED))  # each once, in the order given
        limits = Limits(max_tokens=max_tokens, max_long_tokens=max_long_tokens, timeout_s=timeout)
        sock = bind(host, port)  # a port in use fails now, not after the models load
        try:
            models = {}
            for name in names:
                typer.echo(f"loading {name}...", err=True)
                models[name] = load(name, backend=backend)
            served = create_app(models, limits, atlas=atlas)
        except BaseException:
            sock.close()
            raise

    typer.echo(f"qkv serve: {address(sock)} (models: {', '.join(names)}); Ctrl-C stops it")
    run_server(served, sock, quiet=quiet)
    typer.echo("stopped")


# what `pip install 'qkv[serve]'` brings (pyproject.toml), with fastapi's own starlette, pydantic
_SERVE_EXTRA = {"fastapi", "uvicorn", "swagger_ui_bundle", "starlette", "pydantic"}

"""`qkv atlas`: what every head of a model does over a corpus, with its top examples, written
as a folder with a page that sorts and filters the heads (docs/atlas.md). Stopped, the same
command resumes."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from qkv.cli.errors import user_errors
from qkv.cli.options import Backend, Model


def atlas(
    corpus: Annotated[
        Path,
        typer.Argument(metavar="CORPUS", help="a UTF-8 text file, or .jsonl with a text field"),
    ],
    out: Annotated[Path, typer.Option(help="the atlas's folder (new, or a stopped run's)")],
    model: Model = "smollm2",
    window: Annotated[int, typer.Option(help="tokens per window, markers included")] = 256,
    batch: Annotated[int, typer.Option(help="windows per forward pass")] = 8,
    top: Annotated[int, typer.Option(help="examples kept per head")] = 8,
    max_tokens: Annotated[
        int, typer.Option(help="tokens of text read at most (0: the whole corpus)")
    ] = 100_000,
    quiet: Annotated[bool, typer.Option(help="no progress bar")] = False,
    backend: Backend = None,
) -> None:
    """An atlas of the model's heads over CORPUS: each head's entropy, sink mass,
    previous-token, induction, distance, window use and self weight, and its top examples,
    in OUT (atlas.json, index.html, and examples/ to open each example as an attention page)."""
    from qkv.pretrained import load
    from qkv.viz.atlas import atlas as write_atlas
    from qkv.viz.atlas import check_atlas_folder

    with user_errors(out):
        if max_tokens < 0:
            raise ValueError(f"--max-tokens must be 0 (the whole corpus) or more, got {max_tokens}")
        check_atlas_folder(out)
        pretrained = load(model, backend=backend)
        with _Bar(quiet) as bar:
            found = write_atlas(pretrained, corpus, out, window=window, batch=batch, top=top,
                                max_tokens=max_tokens or None, progress=bar.update)  # fmt: skip
    typer.echo(f"wrote {out} ({found.tokens:,} tokens in {found.windows:,} windows; "
               f"open {out / 'index.html'})")  # fmt: skip


class _Bar:
    """A rich progress bar over windows; does nothing when quiet."""

    def __init__(self, quiet: bool):
        self.quiet, self._bar, self._task = quiet, None, None

    def __enter__(self) -> _Bar:
        if not self.quiet:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeRemainingColumn

            self._bar = Progress("atlas", BarColumn(), MofNCompleteColumn(), "windows, left",
                                 TimeRemainingColumn(), transient=True)  # fmt: skip
            self._bar.__enter__()
        return self

    def update(self, done: int, total: int) -> None:
        if self._bar is None:
            return
        if self._task is None:
            self._task = self._bar.add_task("atlas", total=total)
        self._bar.update(self._task, completed=done)

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.__exit__(*exc)

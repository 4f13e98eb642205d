"""A run folder outside the loop: opened (checked, its config.toml written, what a kill
left removed) and, when a new run fails before its first checkpoint, put back as it was, so
that the same command can simply be run again.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import TYPE_CHECKING

from qkv.io.files import write_atomically
from qkv.io.run_config import RESUMABLE, RunConfig
from qkv.io.runs import staging_leftovers
from qkv.train import checkpoint as ckpt

if TYPE_CHECKING:
    from qkv.train.loop import Distributed


@contextmanager
def undone_if_it_fails(run: Path, resume: bool, main: bool) -> Iterator[None]:
    """Around a new run's start: if it fails (any error, Ctrl-C) before its first
    checkpoint, remove what it wrote. A resumed run is left as it is."""
    made = None if resume else _first_missing(run)  # what this call creates, if anything
    try:
        was_empty = not resume and run.is_dir() and not any(run.iterdir())
    except OSError:  # unreadable: open_run refuses it by name
        was_empty = False
    try:
        yield
    except BaseException:
        if main and not resume:
            _undo_start(run, made, was_empty)
        raise


def _first_missing(run: Path) -> Path | None:
    """The outermost folder of `run`'s path that does not exist yet (mkdir makes it)."""
    missing = None
    for folder in (run, *run.parents):
        if folder.exists():
            break
        missing = folder
    return missing


def _undo_start(run: Path, made: Path | None, was_empty: bool) -> None:
    """Remove what a failed start wrote: the run folder if it made it, with the parents it
    made while nothing else is in them (another run may be starting there), or else, in a
    folder that was empty, everything (all written by this call). A run with a
    checkpoint is kept: it can be resumed."""
    try:
        if ckpt.checkpoints(run):
            return
    except OSError:
        return
    if made is not None:
        shutil.rmtree(run, ignore_errors=True)
        for folder in run.parents:
            if folder == made.parent:
                break
            try:
                folder.rmdir()  # only if empty
            except OSError:
                break
    elif was_empty and run.is_dir():
        with suppress(OSError):  # the error that brought us here is the one to report
            _remove(list(run.iterdir()))


def open_run(config: RunConfig, run: Path, resume: bool, dist: Distributed) -> Path | None:
    """Check the folder and write config.toml; return the checkpoint to resume from.

    The first writes are here, so a folder that cannot be written is refused here, by name.
    """
    try:
        return _check_and_write_config(config, run, resume, dist)
    except OSError as error:  # not writable, a file in the way, a read-only disk...
        where = Path(error.filename) if error.filename else run
        at = "" if where == run or run in where.parents else f" ({where})"
        raise ValueError(
            f"cannot write the run folder {run}: {error.strerror or error}{at}; choose a "
            "folder you can write"
        ) from None


def _check_and_write_config(
    config: RunConfig, run: Path, resume: bool, dist: Distributed
) -> Path | None:
    saved = run / "config.toml"
    if resume:
        if not saved.is_file():
            raise ValueError(f"{run} holds no run to resume (no config.toml); start a new one")
        differences = [
            d for d in RunConfig.from_toml(saved).differences(config)
            if d.split(":")[0] not in RESUMABLE
        ]  # fmt: skip
        if differences:
            raise ValueError(
                f"cannot resume {run} with a different config ({'; '.join(differences)}); "
                f"only {', '.join(sorted(RESUMABLE))} may change"
            )
        found = ckpt.checkpoints(run)
        dist.barrier()
        if dist.main:
            _remove_leftovers(run)
            write_atomically(saved, lambda file: file.write(config.to_toml().encode()))
        return found[-1] if found else None
    if run.exists() and (not run.is_dir() or set(run.iterdir()) - set(staging_leftovers(run))):
        raise ValueError(f"{run} exists and is not empty; choose a new folder or resume it")
    dist.barrier()  # every process has looked before the first one writes
    if dist.main:
        run.mkdir(parents=True, exist_ok=True)
        _remove_leftovers(run)  # a start killed while writing config.toml left only these
        write_atomically(saved, lambda file: file.write(config.to_toml().encode()))
    dist.barrier()
    return None


def _remove_leftovers(run: Path) -> None:
    """Remove the staging files and folders of writes a kill cut short (qkv's names only)."""
    _remove(staging_leftovers(run))


def _remove(paths: list[Path]) -> None:
    for path in paths:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)

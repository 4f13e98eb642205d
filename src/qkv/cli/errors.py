"""How the `qkv` command words what went wrong: one line on stderr and exit code 2 for what
the user can fix (a ValueError, a file that cannot be read or written, memory that ran
out), a traceback for a bug in qkv. And `check_out`, which tries an --out path before any
work is done."""

from __future__ import annotations

import errno
import os
import re
import sys
from contextlib import contextmanager
from pathlib import Path

import typer

from qkv.io.files import beside, staged_for


@contextmanager
def user_errors(out: Path | None = None):
    """What the user can fix is one line on stderr and exit code 2: a ValueError, a file
    that cannot be read or written (an OSError; `out`, the path the verb writes, tells a
    write from a read) and memory that ran out. Anything else is a bug in qkv: it keeps its
    traceback."""
    try:
        yield
        return
    except ValueError as error:
        message = " ".join(line.strip() for line in str(error).splitlines())
    except MemoryError as error:
        message = _out_of_memory(error)
    except OSError as error:
        message = _out_of_memory(error) if error.errno == errno.ENOMEM else _file_error(error, out)
    except RuntimeError as error:  # torch's allocators raise RuntimeErrors
        if not _is_out_of_memory(error):
            raise
        message = _out_of_memory(error)
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(2)


def _file_error(error: OSError, out: Path | None) -> str:
    """'cannot write OUT: Permission denied', 'cannot read PATH: Is a directory'."""
    reason = error.strerror or " ".join(str(error).split())
    if error.filename is None:
        return reason
    path = Path(os.fsdecode(error.filename))
    if out is not None:  # compared as absolute paths, named as the user wrote them
        failed, target = Path(os.path.abspath(path)), Path(os.path.abspath(out))
        staged = staged_for(failed)  # the file a staging name stands for
        if staged != failed and target in (staged, *staged.parents):
            return f"cannot write {out}: {reason}"
        if failed in target.parents:
            return f"cannot create the folder {path} for {out}: {reason}"
        if failed == target or target in failed.parents:
            return f"cannot write {path}: {reason}"
    return f"cannot read {path}: {reason}"


def _is_out_of_memory(error: RuntimeError) -> bool:
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(error, torch.OutOfMemoryError):
        return True
    return any(sign in str(error) for sign in ("can't allocate memory", "out of memory"))


def _out_of_memory(error: BaseException) -> str:
    """'out of memory: tried to allocate 108.0 MiB more; ...', one line whatever raised it."""
    text = " ".join(str(error).split())
    size = re.search(r"[Tt]ried to allocate (\d+) bytes", text)
    if size:
        detail = f"tried to allocate {int(size[1]) / 2**20:.1f} MiB more"
    elif found := re.search(r"[Tt]ried to allocate ([\d.]+ \w+)", text):
        detail = f"tried to allocate {found[1]} more"
    else:
        detail = "an allocation failed" if isinstance(error, MemoryError) else text[:200]
    return f"out of memory: {detail}; give a smaller input or model, or run with more memory"


def check_out(out: Path, suffixes: tuple[str, ...] | None = None) -> None:
    """Try --out before the model loads, leaving nothing behind: a wrong suffix, a file where
    a folder belongs, a folder that cannot be made or written in (read-only, /proc, another
    user's) is refused now. The folders it needs are made and a file staged beside it, as
    qkv.io.files would stage it, then both are removed; `user_errors` words what failed."""
    if not out.name:
        raise ValueError(f"--out {out} names no file; give one, e.g. --out attention.html")
    if suffixes and out.suffix.lower() not in suffixes:
        raise ValueError(f"--out {out} must end in {' or '.join(suffixes)}")
    missing = [folder for folder in out.absolute().parents if not folder.exists()]
    existing = out.absolute().parents[len(missing)]
    if not existing.is_dir():
        raise ValueError(f"cannot write {out}: {existing} is a file, not a folder")
    made: list[Path] = []
    try:
        for folder in reversed(missing):
            folder.mkdir()
            made.append(folder)
        trial = beside(out, "tmp")  # the name qkv.io.files would stage it under
        with open(trial, "xb"):
            pass
        trial.unlink()
    finally:
        for folder in reversed(made):
            folder.rmdir()

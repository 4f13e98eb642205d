"""Every file and folder qkv writes, written all or nothing: staged beside the target,
fsynced, renamed into place. A crash, a full disk or an error half-way leaves the target as
it was and no staging file behind.

Staging names are made here rather than by `tempfile`, whose files and folders are private
(modes 0600 and 0700): what qkv writes gets the user's usual permissions, 0666 and 0777
less the umask, like any file they make.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import IO


def beside(path: Path, kind: str) -> Path:
    """A hidden name next to `path` for staging it (same folder, so renaming is atomic):
    .NAME.<8 hex>.tmp for a file, .partial and .old for a folder."""
    return path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.{kind}")


_STAGED = re.compile(r"^\.(.+)\.[0-9a-f]{8}\.(?:tmp|partial|old)$")


def staged_name(name: str) -> str | None:
    """The name a staging name of `beside`'s stands for; None for any other name.

    >>> staged_name(".page.html.0a1b2c3d.tmp"), staged_name("page.html")
    ('page.html', None)
    """
    found = _STAGED.fullmatch(name)
    return found[1] if found else None


def staged_for(path: Path) -> Path:
    """The path a staging path (`beside`'s, or one inside a staged folder) stands for;
    any other path as it is.

    >>> staged_for(Path("out/.page.html.0a1b2c3d.tmp")), staged_for(Path("out/page.html"))
    (PosixPath('out/page.html'), PosixPath('out/page.html'))
    """
    return Path(*(staged_name(part) or part for part in path.parts))


def write_atomically(path: Path, write: Callable[[IO[bytes]], object]) -> None:
    """Write a file all or nothing: `write(file)` fills a temporary file beside `path`,
    which is fsynced and renamed onto it.

    A writer that takes only a path (safetensors' save_file) writes to `file.name`, the
    temporary file's path. It may replace the file (safetensors writes a private file of
    its own and renames it over): the file is fsynced by its path, and given back the
    permissions of a new file.

    >>> import tempfile
    >>> with tempfile.TemporaryDirectory() as folder:
    ...     write_atomically(Path(folder, "a.txt"), lambda file: file.write(b"all"))
    ...     sorted(p.name for p in Path(folder).iterdir())
    ['a.txt']
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temp = beside(path, "tmp")
    try:
        with open(temp, "xb") as file:
            usual = stat.S_IMODE(os.fstat(file.fileno()).st_mode)  # 0666 less the umask
            write(file)
        _settle(temp, usual)
        os.replace(temp, path)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    fsync_folder(path.parent)


def write_folder_atomically(
    folder: Path, write: Callable[[Path], object], *, replace: bool = False
) -> Path:
    """Write a folder all or nothing: `write(staging)` fills a new folder beside `folder`;
    every file in it and the folder itself are fsynced, then it is renamed onto `folder`.

    An existing empty `folder` is replaced; a non-empty one only with replace=True (a
    checkpoint written again after a resume), else it is a ValueError. Returns `folder`.
    """
    folder = Path(folder)
    if folder.exists() and not replace and (not folder.is_dir() or any(folder.iterdir())):
        raise ValueError(f"{folder} exists and is not empty; choose a new folder")
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = beside(folder, "partial")
    os.mkdir(staging)  # honours the umask, unlike mkdtemp's 0700
    try:
        write(staging)
        _settle_tree(staging, stat.S_IMODE(os.stat(staging).st_mode))
        if folder.exists():
            # only an empty folder can be renamed over; move the old one aside first
            old = beside(folder, "old")
            os.replace(folder, old)
            os.replace(staging, folder)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(staging, folder)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    fsync_folder(folder.parent)
    return folder


def append_line(path: Path, line: str) -> None:
    """Append one line to a log (metrics.jsonl) in a single write, so that a run killed
    mid-write leaves at most a torn last line, which readers skip (see `read_lines`)."""
    with open(path, "a", encoding="utf-8") as file:
        file.write(line.rstrip("\n") + "\n")


def read_lines(path: Path) -> list[str]:
    """The complete lines of a log written by `append_line`: a last line without its
    newline is a write cut short by a kill, and is left out."""
    text = Path(path).read_text(encoding="utf-8")
    lines = text.split("\n")
    return lines[:-1]  # after the last newline: "" for a whole log, else the torn line


def _settle(path: Path, mode: int) -> None:
    """fsync a file by its path and give it `mode` if its writer chose another."""
    if stat.S_IMODE(os.stat(path).st_mode) != mode:
        os.chmod(path, mode)
    with open(path, "rb") as file:
        os.fsync(file.fileno())


def _settle_tree(folder: Path, folder_mode: int) -> None:
    """Give every file and folder under `folder` the usual permissions (those of `folder`,
    made by os.mkdir, less the execute bits for files) and fsync them all."""
    for root, folders, files in os.walk(folder):
        for name in files:
            _settle(Path(root, name), folder_mode & 0o666)
        for name in folders:
            if stat.S_IMODE(os.stat(Path(root, name)).st_mode) != folder_mode:
                os.chmod(Path(root, name), folder_mode)
        fsync_folder(Path(root))


def fsync_folder(folder: Path) -> None:
    """Make a rename inside `folder` survive a crash, where the system allows it."""
    try:
        descriptor = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(descriptor)
    except OSError:
        pass  # some systems cannot fsync a folder
    finally:
        os.close(descriptor)

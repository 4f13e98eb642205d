"""Files written all or nothing: a temporary file beside the target, fsync, rename."""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import IO


def write_atomically(path: Path, write: Callable[[IO[bytes]], object]) -> None:
    """Write a file all or nothing: `write(file)` fills a temporary file beside `path`,
    which is fsynced and renamed onto it.

    The temporary name is made here rather than by `tempfile`, whose files are private
    (mode 0600); this one gets the same permissions as any new file.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with open(temp, "xb") as file:
            write(file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temp, path)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise


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

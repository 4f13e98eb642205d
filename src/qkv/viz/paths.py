"""Where viz writes: the one check that an output path names the kind of file written.

>>> png_path("bank.png")
PosixPath('bank.png')
>>> png_path("bank.jpg")
Traceback (most recent call last):
...
ValueError: bank.jpg: the extension must be .png, not '.jpg'
>>> html_path("page")
Traceback (most recent call last):
...
ValueError: page: the extension must be .html, not a name without one
"""

from __future__ import annotations

import os
from pathlib import Path


def png_path(path: str | os.PathLike[str], *, existing_folder: bool = False) -> Path:
    """`path` as a Path that ends in .png (any case); with existing_folder, in a folder that
    exists (a plot that will not create folders), else a ValueError that says what to do."""
    return _checked(path, (".png",), existing_folder)


def html_path(path: str | os.PathLike[str]) -> Path:
    """`path` as a Path that ends in .html or .htm (any case), else a ValueError."""
    return _checked(path, (".html", ".htm"), False)


def _checked(path, suffixes: tuple[str, ...], existing_folder: bool) -> Path:
    path = Path(path)
    if path.suffix.lower() not in suffixes:
        got = repr(path.suffix) if path.suffix else "a name without one"
        raise ValueError(f"{path}: the extension must be {suffixes[0]}, not {got}")
    if existing_folder and not path.parent.is_dir():
        raise ValueError(f"the folder {path.parent} does not exist; create it first")
    return path

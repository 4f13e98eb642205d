"""The JSON files that come with a model (config.json, tokenizer_config.json, modules.json
and the files it names), read with one error for one that is not JSON."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_json(path: Path) -> Any:
    """The JSON value `path` holds, read as UTF-8; a ValueError naming the file where it is
    not UTF-8 JSON. The caller checks that the file exists and what kind of value it holds.

    >>> import tempfile
    >>> with tempfile.TemporaryDirectory() as folder:
    ...     path = Path(folder) / "config.json"
    ...     _ = path.write_text('{"hidden_size": 384,')
    ...     read_json(path)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ValueError: .../config.json is not valid JSON: Expecting property name enclosed in ...
    """
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{path} is not valid JSON: {error}") from None

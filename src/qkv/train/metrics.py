"""A run's metrics.jsonl: one JSON record per optimizer step, read and written only here.

Records are strict JSON (no NaN or Infinity, which `json.dumps` writes by default and no
other reader takes); the loop stops a run before a non-finite value would be logged. A run
killed while appending leaves at most a torn last line: reading drops it, since the
checkpoint a run resumes from is always older than the last step logged. A record that is
not whole anywhere else is damage a user must see, named by file and line.

>>> import tempfile
>>> with tempfile.TemporaryDirectory() as folder:
...     log = Path(folder, "metrics.jsonl")
...     append_record(log, {"step": 1, "loss": 2.5})
...     _ = log.open("a").write('{"step": 2, "lo')  # killed mid-write
...     read_records(log)
[{'step': 1, 'loss': 2.5}]
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from qkv.io.files import append_line, write_atomically

log = logging.getLogger(__name__)


def append_record(path: Path, record: dict) -> None:
    """Log one record; a non-finite value is a ValueError (the loop checks before)."""
    append_line(path, json.dumps(record, allow_nan=False))


def read_records(path: Path) -> list[dict]:
    """Every whole record of `path`, oldest first, without a torn last line."""
    lines = Path(path).read_bytes().split(b"\n")
    if lines[-1] == b"":
        lines.pop()  # the log ends with a newline, as every whole write leaves it
    records = []
    for number, line in enumerate(lines, 1):
        record = _record(line)
        if record is None and number == len(lines):
            log.warning("%s: dropped a torn last line %d (a write cut short)", path, number)
        elif record is None:
            raise ValueError(
                f"{path} line {number} is not a metrics record (step and values as JSON): "
                f"{line[:60]!r}; the file is damaged: remove that line to go on"
            )
        else:
            records.append(record)
    return records


def truncate_records(path: Path, step: int) -> None:
    """Keep the records of steps up to `step`: those after the checkpoint a run resumes
    from are measured again. Also drops a torn last line, so appending goes on from whole
    records."""
    if not path.exists():
        return
    kept = [r for r in read_records(path) if r["step"] <= step]
    text = "".join(json.dumps(r, allow_nan=False) + "\n" for r in kept)
    write_atomically(path, lambda file: file.write(text.encode()))


def _record(line: bytes) -> dict | None:
    try:
        record = json.loads(line.decode("utf-8"), parse_constant=_not_json)
    except ValueError:  # JSONDecodeError, UnicodeDecodeError, NaN or Infinity
        return None
    if not isinstance(record, dict) or type(record.get("step")) is not int:
        return None
    return record


def _not_json(name: str) -> None:
    raise ValueError(f"{name} is not JSON")

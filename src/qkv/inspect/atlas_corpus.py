"""A corpus read for the atlas of heads: streamed, cut into windows of a fixed length, and
named by a fingerprint so that a resumed run knows it reads the same text.

The rules (docs/atlas.md):

- a file ending in .jsonl is one document per line, a JSON object with a "text" string (blank
  lines are skipped); any other file is UTF-8 text, one document read paragraph by paragraph
  (paragraphs end at blank lines; a paragraph past PARAGRAPH_CHARS characters is cut at a line
  end), each paragraph tokenized on its own, its line ends kept;
- each window is the model's own markers ([CLS] ... [SEP], or none) around up to
  `window - markers` tokens of one document: a window never crosses from one document to the
  next (a JSONL object), so no head attends from one text to an unrelated one, and the last
  window of a document may be shorter; a window of fewer than 2 tokens is dropped (no query
  in it has a key but itself);
- reading stops after `max_tokens` tokens of text (markers not counted).

Only one paragraph (or JSONL line) and one window's tokens are held at a time.

>>> from tokenizers import Tokenizer as Backend, models, pre_tokenizers
>>> from qkv.io.tokenizer import Tokenizer
>>> backend = Backend(models.WordLevel({"[UNK]": 0, "a": 1, "b": 2}, unk_token="[UNK]"))
>>> backend.pre_tokenizer = pre_tokenizers.Whitespace()
>>> import tempfile, pathlib
>>> with tempfile.TemporaryDirectory() as folder:
...     corpus = pathlib.Path(folder, "c.txt")
...     _ = corpus.write_text("a b a b a\\n\\nb b\\n")
...     [ids for ids in windows(corpus, Tokenizer(backend), window=4)]
[[1, 2, 1, 2], [1, 2, 2]]
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from pathlib import Path

PARAGRAPH_CHARS = 65_536  # a paragraph longer than this is tokenized a part at a time
HASH_BLOCK = 1 << 20
# a line is read whole (a JSONL document is one line): one longer than this is refused, so a
# file without line breaks cannot make the reader hold all of it
MAX_LINE_BYTES = 16 << 20


def check_corpus(path: str | Path) -> Path:
    """The corpus path, refused by name where it is no readable file."""
    path = Path(path)
    if not path.exists():
        raise ValueError(f"the corpus {path} does not exist; give a text or .jsonl file")
    if not path.is_file():
        raise ValueError(f"the corpus {path} is not a file; give a text or .jsonl file")
    return path


def fingerprint(path: Path) -> dict:
    """What names a corpus: its file's name, size in bytes and SHA-256, read in blocks."""
    digest, size = hashlib.sha256(), 0
    with open(path, "rb") as file:
        while block := file.read(HASH_BLOCK):
            digest.update(block)
            size += len(block)
    return {"name": path.name, "bytes": size, "sha256": digest.hexdigest()}


def documents(path: Path) -> Iterator[Iterator[str]]:
    """Each document of the corpus as its texts in order (paragraphs of a text file, the one
    "text" of a JSONL line); bad input is a ValueError naming its line."""
    if path.suffix.lower() == ".jsonl":
        yield from _jsonl_documents(path)
    else:
        yield _paragraphs(path)


def _jsonl_documents(path: Path) -> Iterator[Iterator[str]]:
    for number, line in _lines(path):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(
                f"line {number} of {path} is not JSON ({error.msg}); a .jsonl corpus has one "
                'object per line, e.g. {"text": "..."}'
            ) from None
        if not isinstance(value, dict) or not isinstance(value.get("text"), str):
            raise ValueError(
                f'line {number} of {path} has no "text" string; each line of a .jsonl corpus '
                'is an object such as {"text": "..."}'
            )
        yield iter([value["text"]])


def _paragraphs(path: Path) -> Iterator[str]:
    held: list[str] = []
    size = 0
    for _, line in _lines(path):
        held.append(line)
        size += len(line)
        if not line.strip() or size >= PARAGRAPH_CHARS:
            yield "".join(held)
            held, size = [], 0
    if held:
        yield "".join(held)


def _lines(path: Path) -> Iterator[tuple[int, str]]:
    """(line number from 1, line with its end) read one at a time, as UTF-8."""
    number = 0
    with open(path, "rb") as file:
        while raw := file.readline(MAX_LINE_BYTES + 1):
            number += 1
            if len(raw) > MAX_LINE_BYTES:
                raise ValueError(
                    f"line {number} of {path} is over {MAX_LINE_BYTES >> 20} MiB; break the text "
                    "into lines (a .jsonl corpus: into more documents)"
                )
            try:
                yield number, raw.decode("utf-8")
            except UnicodeDecodeError as error:
                raise ValueError(
                    f"line {number} of {path} is not UTF-8 text (byte {error.start}); give a "
                    "UTF-8 text or .jsonl file"
                ) from None


def markers(tokenizer) -> tuple[list[int], list[int]]:
    """The model's own markers around a text ([CLS] and [SEP]; BOS; or none), as ids."""
    marked = tokenizer.encode("a")
    if False not in marked.special:
        return [], []
    first = marked.special.index(False)
    last = len(marked.ids) - marked.special[::-1].index(False)
    return list(marked.ids[:first]), list(marked.ids[last:])


def windows(
    path: Path, tokenizer, *, window: int, max_tokens: int | None = None
) -> Iterator[list[int]]:
    """The corpus's windows, each a list of ids: markers, up to `window - markers` tokens of
    one document, markers. Windows of fewer than 2 tokens are left out."""
    prefix, suffix = markers(tokenizer)
    room = window - len(prefix) - len(suffix)
    if room < 1:
        raise ValueError(f"a window of {window} tokens has no room beside the model's "
                         f"{len(prefix) + len(suffix)} markers; give a longer window")  # fmt: skip
    left = max_tokens
    for texts in documents(path):
        held: list[int] = []
        for text in texts:
            if left is not None and left <= len(held):
                break
            if text:
                held.extend(tokenizer.encode(text, add_special_tokens=False).ids)
            while len(held) >= room:
                if left is not None and left < room:
                    break
                ids, held = prefix + held[:room] + suffix, held[room:]
                left = None if left is None else left - room
                yield ids
        held = held if left is None else held[:left]
        if held and len(prefix) + len(held) + len(suffix) >= 2:
            left = None if left is None else left - len(held)
            yield prefix + held + suffix
        if left == 0:
            return

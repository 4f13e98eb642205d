"""The probe's sentences read from a text file, one sentence a line, in one of three forms.

'sentence', 'label<TAB>sentence' or 'label<TAB>cue<TAB>sentence' (the cue: the word that
tells the sense), the same form on every line; blank lines are skipped. What the probe takes
as `texts`, `labels` and `cues` (`qkv probe --sentences FILE`).
"""

from __future__ import annotations

from pathlib import Path


def read_sentences(path: Path) -> tuple[list[str], list[str] | None, list[str] | None]:
    """One sentence a line: 'sentence', 'label<TAB>sentence' or 'label<TAB>cue<TAB>sentence'
    (the cue: the word that tells the sense), the same on every line; blank lines skipped."""
    if path.is_dir():
        raise ValueError(f"{path} is a folder; --sentences takes a text file, one sentence a line")
    if not path.exists():
        raise ValueError(f"{path} does not exist")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"{path} is not UTF-8 text (byte {error.start}: {error.reason})") from None
    lines = [(n, line) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
    if not lines:
        raise ValueError(f"{path} is empty; write one sentence a line, two at least")
    forms = "'sentence', 'label<TAB>sentence' or 'label<TAB>cue<TAB>sentence'"
    first, columns = lines[0][0], lines[0][1].count("\t") + 1
    for n, line in lines:
        found = line.count("\t") + 1
        if found != columns or found > 3:
            raise ValueError(
                f"{path} line {n} has {found} tab-separated columns"
                + (f", line {first} has {columns}" if n != first else "")
                + f"; give every line the same form: {forms}"
            )
    rows = [line.split("\t") for _, line in lines]
    if columns == 3:
        labels, cues, texts = zip(*rows, strict=True)
        return list(texts), [label.strip() for label in labels], [cue.strip() for cue in cues]
    if columns == 2:
        labels, texts = zip(*rows, strict=True)
        return list(texts), [label.strip() for label in labels], None
    return [line for _, line in lines], None, None

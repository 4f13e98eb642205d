"""Layers and heads as people write them on a command line: '0,2,5' or '0-3'.

`parse_indices` reads that text and hands each index to `check_indices`, the one selection
rule, so a range is checked before it is listed: '0-1000000000' is refused, not built.
"""

from __future__ import annotations

from qkv.attention.inputs import check_indices


def parse_indices(spec: str | None, name: str, count: int, owner: str) -> list[int] | None:
    """'0,2,5' or '0-3' -> [0, 2, 5] or [0, 1, 2, 3]; None for all. `name` is the option's
    plural ('layers', 'heads'), `count` how many `owner` has. Each range's ends are checked
    before it is listed: '0-1000000000' is refused, not built.

    >>> parse_indices("0,2-4", "heads", 6, "minilm")
    [0, 2, 3, 4]
    >>> parse_indices("3-1", "heads", 6, "minilm")
    Traceback (most recent call last):
    ...
    ValueError: --heads 3-1 runs backwards; write 1-3
    """
    if spec is None:
        return None
    chosen: list[int] = []
    for part in spec.split(","):
        first, _, last = part.strip().partition("-")
        try:
            ends = [int(first), int(last or first)]
        except ValueError:
            raise ValueError(f"--{name} takes numbers like 0,2,5 or 0-3, got {spec!r}") from None
        check_indices(name[:-1], dict.fromkeys(ends), count, owner)
        if ends[0] > ends[1]:
            raise ValueError(f"--{name} {part.strip()} runs backwards; write {last}-{first}")
        chosen += range(ends[0], ends[1] + 1)
        if len(chosen) > count:  # a repeat, refused before the list grows past the model
            break
    return check_indices(name[:-1], chosen, count, owner)  # each once

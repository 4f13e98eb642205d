"""Toy sequence-to-sequence tasks where cross-attention has a known right answer.

Each target symbol copies one source symbol, and `alignment` says which: a trained
encoder-decoder should put its cross-attention for target position i on source position
alignment[i]. "copy" gives the diagonal, "reverse" the anti-diagonal and "swap" (adjacent
pairs exchanged) an alignment that steps back and forth, so a model cannot get it by
attending monotonically.

>>> example = seq2seq_corpus("swap", 1, seed=0, min_length=5, max_length=5)[0]
>>> example.source, example.target, example.alignment
('n b i p m', 'b n p i m', (1, 0, 3, 2, 4))
"""

from __future__ import annotations

import hashlib
import random
import string
from dataclasses import dataclass

TASKS = ("reverse", "swap", "copy")
SPLITS = ("train", "heldout")
_HELDOUT_ONE_IN = 10  # about one source in ten belongs to the held-out split
_DRAWS_PER_EXAMPLE = 1000  # give up when a split's sources are too rare to find


@dataclass(frozen=True)
class Seq2SeqExample:
    source: str  # symbols separated by spaces, e.g. "c a f b"
    target: str  # e.g. "b f a c" for reverse
    alignment: tuple[int, ...]  # target symbol i is source symbol alignment[i]


def task_symbols(symbols: int = 16) -> list[str]:
    """The first `symbols` lowercase letters: the tasks' vocabulary (2 to 26 symbols).

    >>> task_symbols(4)
    ['a', 'b', 'c', 'd']
    """
    if isinstance(symbols, bool) or not isinstance(symbols, int) or not 2 <= symbols <= 26:
        raise ValueError(f"symbols must be an int from 2 to 26, not {symbols!r}")
    return list(string.ascii_lowercase[:symbols])


def alignment(task: str, length: int) -> tuple[int, ...]:
    """Which source position each target position copies, for a sequence of `length`.

    >>> alignment("reverse", 4), alignment("swap", 5), alignment("copy", 3)
    ((3, 2, 1, 0), (1, 0, 3, 2, 4), (0, 1, 2))
    """
    if task not in TASKS:
        raise ValueError(f"task must be one of {', '.join(TASKS)}, not {task!r}")
    if task == "reverse":
        return tuple(range(length - 1, -1, -1))
    if task == "swap":  # i ^ 1 pairs 0-1, 2-3, ...; an odd last symbol stays in place
        return tuple(i ^ 1 if i ^ 1 < length else i for i in range(length))
    return tuple(range(length))


def split_of(source: str) -> str:
    """ "train" or "heldout", from a stable hash of the source text alone.

    The hash ignores the task and the seed, so no seed's held-out sources ever appear in
    any seed's training split.
    """
    digest = hashlib.blake2b(source.encode("utf-8"), digest_size=8).digest()
    return "heldout" if int.from_bytes(digest, "little") % _HELDOUT_ONE_IN == 0 else "train"


def seq2seq_corpus(
    task: str,
    n: int,
    *,
    split: str = "train",
    seed: int = 0,
    min_length: int = 4,
    max_length: int = 12,
    symbols: int = 16,
) -> list[Seq2SeqExample]:
    """`n` examples of `task` whose sources belong to `split` ("train" or "heldout").

    Sources draw their length uniformly from [min_length, max_length] and their symbols
    uniformly with replacement; draws from the other split are skipped. The same seed
    draws the same sources for every task, so tasks can be compared on equal inputs.
    """
    if task not in TASKS:
        raise ValueError(f"task must be one of {', '.join(TASKS)}, not {task!r}")
    if split not in SPLITS:
        raise ValueError(f"split must be one of {', '.join(SPLITS)}, not {split!r}")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be a positive int, not {n!r}")
    if not 1 <= min_length <= max_length:
        raise ValueError(
            f"lengths must satisfy 1 <= min_length <= max_length, not {min_length} and {max_length}"
        )
    vocabulary = task_symbols(symbols)
    rng = random.Random(seed)
    examples: list[Seq2SeqExample] = []
    for _ in range(n * _DRAWS_PER_EXAMPLE):
        length = rng.randint(min_length, max_length)
        source = [rng.choice(vocabulary) for _ in range(length)]
        if split_of(" ".join(source)) != split:
            continue
        order = alignment(task, length)
        target = " ".join(source[j] for j in order)
        examples.append(Seq2SeqExample(" ".join(source), target, order))
        if len(examples) == n:
            return examples
    raise ValueError(
        f"found only {len(examples)} of {n} {split} sources; allow longer sequences or more symbols"
    )

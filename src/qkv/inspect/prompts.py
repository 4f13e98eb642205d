"""From one example to a dataset: the prompts an intervention runs over, in padded batches, and
the statistic it reports over them.

A prompt set is a text, a list of texts, or a file (`pathlib.Path`): text lines, TSV or JSONL.
A pair set (clean and corrupted texts, each pair with its own metric where the file gives one)
comes from two texts, two lists, or one file. Reading is bounded: at most `MAX_PROMPTS` prompts
and `MAX_FILE_BYTES` bytes, whatever the file claims.

`Spread` holds one value per prompt for every cell of a grid, their mean, and a seeded
bootstrap 95% interval of the mean (percentile method: `RESAMPLES` resamples of the prompts
with replacement).

>>> spread = Spread.of(torch.tensor([[1.0], [2.0], [3.0], [4.0]]))
>>> spread.mean.tolist(), spread.low.shape
([2.5], torch.Size([1]))
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

MAX_PROMPTS = 10_000  # prompts one call reads, whatever a file holds
MAX_FILE_BYTES = 64 << 20  # 64 MiB: a prompt file is read whole, so it is read up to this
RESAMPLES = 1000  # bootstrap resamples of the prompts
LEVEL = 0.95  # the interval's coverage
BOOTSTRAP_BUDGET = 1 << 24  # float64 numbers one step of resampling holds (128 MiB)


# ---------------------------------------------------------------------------- reading


@dataclass(frozen=True)
class Pair:
    """One clean text, its corrupted twin, and the metric the file gave it (None: the call's)."""

    clean: str
    corrupt: str
    metric: str | None = None


def texts_of(texts, what: str = "texts") -> list[str]:
    """A text, a list of texts, or a file (`Path`): one text a line (blank lines skipped), a
    TSV (the first column), or JSONL (each line an object with "text")."""
    if isinstance(texts, Path):
        return [row[0] for row in _rows(texts, ("text",), what)]
    if isinstance(texts, str):
        return [_text(texts, what, 0)]
    if not isinstance(texts, Sequence) or not texts:
        raise ValueError(f"{what} is a text, a non-empty list of texts, or a file (a Path)")
    if len(texts) > MAX_PROMPTS:
        raise ValueError(f"{what} holds {len(texts)} texts; one call takes {MAX_PROMPTS} at most")
    return [_text(text, what, n) for n, text in enumerate(texts)]


def pairs_of(clean, corrupt=None) -> list[Pair]:
    """Clean and corrupted texts paired by position: two texts, two lists of equal length, or
    one file (`Path`, corrupt None): TSV lines 'clean<TAB>corrupt[<TAB>metric]' or JSONL
    objects {"clean": ..., "corrupt": ..., "metric": ...} (metric optional)."""
    if isinstance(clean, Path):
        if corrupt is not None:
            raise ValueError("a file of pairs holds the corrupted texts too: give corrupt=None")
        rows = _rows(clean, ("clean", "corrupt", "metric"), "pairs", least=2)
        return [Pair(row[0], row[1], row[2] if len(row) > 2 else None) for row in rows]
    if corrupt is None:
        raise ValueError("give the corrupted text(s), or a file of pairs as clean")
    if isinstance(clean, str) != isinstance(corrupt, str):
        raise ValueError("clean and corrupt are both texts or both lists of texts")
    cleans, corrupts = texts_of(clean, "clean"), texts_of(corrupt, "corrupt")
    if len(cleans) != len(corrupts):
        raise ValueError(
            f"{len(cleans)} clean texts and {len(corrupts)} corrupted ones: they pair by "
            "position, so give as many of each"
        )
    return [Pair(a, b) for a, b in zip(cleans, corrupts, strict=True)]


def metrics_for(metric, count: int) -> list:
    """One metric for every prompt, or a `list` of `count`, one per prompt (each IOI pair
    names its own people). A tuple is one metric ("diff", " Mary", " John"), never a list."""
    if not isinstance(metric, list):
        return [metric] * count
    if len(metric) != count:
        raise ValueError(f"{len(metric)} metrics for {count} prompts: give one, or one per prompt")
    return list(metric)


def _text(text, what: str, n: int) -> str:
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"{what}[{n}] is {text!r}; every prompt is a non-empty text")
    return text


def _read(path: Path, what: str) -> str:
    if path.is_dir():
        raise ValueError(f"{path} is a folder; {what} is a file: text lines, TSV or JSONL")
    if not path.exists():
        raise ValueError(f"{path} does not exist")
    with path.open("rb") as file:
        data = file.read(MAX_FILE_BYTES + 1)
    if len(data) > MAX_FILE_BYTES:
        raise ValueError(f"{path} is over {MAX_FILE_BYTES >> 20} MiB; split it into smaller files")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"{path} is not UTF-8 text (byte {error.start}: {error.reason})") from None


def _rows(path: Path, fields: tuple[str, ...], what: str, least: int = 1) -> list[list[str]]:
    """The file's rows, each a list of `least` to len(fields) texts: JSONL by its fields
    (a file whose name ends .jsonl), TSV or plain lines by their columns."""
    lines = [(n, line) for n, line in enumerate(_read(path, what).splitlines(), 1) if line.strip()]
    if not lines:
        raise ValueError(f"{path} holds no {what}")
    if len(lines) > MAX_PROMPTS:
        raise ValueError(f"{path} holds {len(lines)} lines; one call takes {MAX_PROMPTS} at most")
    rows = []
    for n, line in lines:
        if path.suffix == ".jsonl":
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{path} line {n} is not JSON: {error.msg}") from None
            if not isinstance(record, dict):
                raise ValueError(f"{path} line {n} is not a JSON object")
            row = [record.get(name) for name in fields]
            while row and row[-1] is None and len(row) > least:
                row.pop()
        else:
            row = line.split("\t")
            if least == 1:
                row = row[:1]
        if len(row) < least or len(row) > len(fields):
            names = ", ".join(fields[:least])
            raise ValueError(
                f"{path} line {n} has {len(row)} fields; {what} give {names}"
                + (f" (and optionally {', '.join(fields[least:])})" if len(fields) > least else "")
            )
        for name, value in zip(fields, row, strict=False):
            if not isinstance(value, str) or not value.strip():
                raise ValueError(f"{path} line {n}: {name} is {value!r}, not a non-empty text")
        rows.append(row)
    return rows


# ---------------------------------------------------------------------------- batches


def padded(ids: Sequence[Sequence[int]], pad: int = 0) -> tuple[Tensor, Tensor]:
    """Token lists -> ids (B, T) right-padded with `pad` and lengths (B,). A causal decoder's
    real tokens never see the padding after them, so a right-padded row needs no mask there."""
    lengths = torch.tensor([len(row) for row in ids])
    out = torch.full((len(ids), int(lengths.max())), pad, dtype=torch.long)
    for b, row in enumerate(ids):
        out[b, : len(row)] = torch.tensor(row, dtype=torch.long)
    return out, lengths


def groups(lengths: Sequence[int], per_token: int, budget: int) -> Iterator[list[int]]:
    """Prompt indices in batches whose padded size (rows x longest x per_token) stays within
    `budget`, prompts of similar length together (sorted by length, stable), each batch's
    indices in the input order."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    batch: list[int] = []
    for i in order:
        longest = max([lengths[j] for j in batch] + [lengths[i]])
        if batch and (len(batch) + 1) * longest * per_token > budget:
            yield sorted(batch)
            batch = []
        batch.append(i)
    if batch:
        yield sorted(batch)


# ---------------------------------------------------------------------------- statistics


@dataclass
class Spread:
    """Per-prompt values (N, *cell) of a grid, their mean (*cell) and a bootstrap interval
    [low, high] of the mean (seeded; NaN cells stay NaN)."""

    values: Tensor  # (N, *cell) float64
    mean: Tensor  # (*cell)
    low: Tensor  # (*cell)
    high: Tensor  # (*cell)
    seed: int = 0
    resamples: int = RESAMPLES

    @classmethod
    def of(cls, values: Tensor, seed: int = 0, resamples: int = RESAMPLES) -> Spread:
        values = values.double()
        low, high = bootstrap(values, seed, resamples)
        return cls(values, values.mean(0), low, high, seed, resamples)

    def to_dict(self) -> dict:
        return {
            "per_prompt": _listed(self.values),
            "mean": _listed(self.mean),
            "low": _listed(self.low),
            "high": _listed(self.high),
            "level": LEVEL,
            "resamples": self.resamples,
            "seed": self.seed,
        }


def bootstrap(values: Tensor, seed: int = 0, resamples: int = RESAMPLES) -> tuple[Tensor, Tensor]:
    """The percentile bootstrap interval (LEVEL) of the mean over the first dimension of
    values (N, *cell): `resamples` draws of N prompts with replacement (a torch.Generator
    seeded with `seed`); one prompt gives the interval [value, value]."""
    N = values.shape[0]
    generator = torch.Generator().manual_seed(seed)
    draws = torch.randint(0, N, (resamples, N), generator=generator)  # (R, N)
    flat = values.double().reshape(N, -1)  # (N, cells)
    means = torch.empty(resamples, flat.shape[1], dtype=torch.float64)
    step = max(1, BOOTSTRAP_BUDGET // max(N * flat.shape[1], 1))  # (step, N, cells) at a time
    for start in range(0, resamples, step):
        means[start : start + step] = flat[draws[start : start + step]].mean(1)
    tail = (1 - LEVEL) / 2
    low = means.quantile(tail, dim=0) if resamples > 1 else means[0]
    high = means.quantile(1 - tail, dim=0) if resamples > 1 else means[0]
    return low.reshape(values.shape[1:]), high.reshape(values.shape[1:])


def _listed(t: Tensor):
    """A tensor as nested lists, None where it is NaN."""

    def clean(x):
        if isinstance(x, list):
            return [clean(v) for v in x]
        return None if x != x else x

    return clean(t.tolist())

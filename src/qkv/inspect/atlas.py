"""An atlas of heads over a corpus: what every head does on real text, and where it does it.

`survey` reads a corpus in windows (`qkv.inspect.atlas_corpus`), a batch of windows per forward
pass with every layer's record, and keeps for every (layer, head), over every query i >= 1 of
every window (query 0 is left out: in a decoder it sees only itself), exact running sums in
float64 of (docs/atlas.md says each exactly):

- entropy: the entropy of the query's row, in nats;
- sink: the weight on key 0, the window's first token;
- previous_token: the weight on key i - 1;
- induction: the weight on the keys j (1 <= j < i) just after an earlier occurrence of the
  query's own token (token j - 1 equals token i), over the queries that have one;
- distance: the mean distance sum_j w_ij |i - j| the weight goes;
- window_use (layers with a sliding window): that distance as a share of the farthest key
  the query could see (`qkv.inspect.census`);
- self: the weight on the query's own position;

and, per head, the `top` queries whose largest weight on a key other than key 0 is largest,
held in a bounded list (the order: weight, then window, query and key ascending, so ties fall
the same way in every run), each with the real weights among the tokens around its query and
key. A linear layer is read on its effective weights' shares, a compressed one on its words,
as the census reads them (`census._weights`).

The state is written atomically every `save_every` batches; a run stopped at any point and
run again continues from its last state and ends with the same numbers, bit for bit, as one
that never stopped: batches are fixed runs of windows, so every sum is added in one order.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import torch
from torch import Tensor

from qkv.inspect.atlas_corpus import check_corpus, fingerprint, windows
from qkv.inspect.census import _listed, _records, _weights, _window_use
from qkv.inspect.layer_heads import heads_per_layer, nan_grid
from qkv.io.files import write_atomically
from qkv.models import self_attention_stack
from qkv.views import Shown

STATS = ("entropy", "sink", "previous_token", "induction", "distance", "window_use", "self")
FORMAT = 1  # the state's and atlas.json's layout; a state of another is refused
BEFORE, AFTER = 8, 4  # tokens kept before and after an example's query and key


EXAMPLE_FIELDS = ("weight", "window", "query", "key", "positions")


@dataclass
class Example:
    """One query where a head put a large weight on a key other than key 0: `weight` on
    `key` from `query` (positions in window `window`, from 0); `weights` (n, n) float32 the
    head's real weights among the window's tokens at `positions` (key 0, and those around
    the query and the key), rows may sum below 1 where keys are not among them."""

    weight: float
    window: int
    query: int
    key: int
    positions: list[int]
    weights: Tensor | None = field(default=None, repr=False)  # None when read from atlas.json

    def order(self) -> tuple:
        return (-self.weight, self.window, self.query, self.key)

    def to_dict(self) -> dict:
        return {"weight": self.weight, "window": self.window, "query": self.query,
                "key": self.key, "positions": list(self.positions)}  # fmt: skip


@dataclass(repr=False)
class Atlas(Shown):
    """Per (layer, head) statistics over a corpus, (L, H) float64 tables, NaN where a layer has
    fewer heads or a statistic counted no query; and each head's top examples."""

    view: ClassVar[str] = "atlas"  # drawn by qkv.viz.notebook_atlas

    source: str
    corpus: dict  # name, bytes, sha256
    options: dict  # window, batch, top, max_tokens
    tokens: int  # tokens the model read, markers included
    windows: int
    heads_per_layer: list[int]
    layer_windows: list[int | None]  # each layer's sliding window, None for a full layer
    stats: dict[str, Tensor]  # name -> (L, H) mean
    counts: dict[str, Tensor]  # name -> (L, H) queries counted
    examples: list[list[list[Example]]]  # [layer][head] -> best first
    contexts: dict[int, list[str]] = field(default_factory=dict)  # window -> its tokens

    def top(self, name: str, k: int = 5) -> list[tuple[int, int, float]]:
        """The k heads highest on `name` (lowest for entropy), as (layer, head, value)."""
        if name not in STATS:
            raise ValueError(f"unknown statistic {name!r}; the statistics are {', '.join(STATS)}")
        grid = self.stats[name]
        flat = grid.flatten()
        keep = torch.nonzero(~flat.isnan()).flatten()
        order = flat[keep].argsort(descending=name != "entropy", stable=True)[:k]
        H = grid.shape[1]
        return [(*divmod(int(keep[i]), H), float(flat[keep[i]])) for i in order]

    def to_dict(self) -> dict:
        """JSON-ready: what atlas.json holds (docs/atlas.md), None for NaN."""
        return {
            "format": FORMAT,
            "model": self.source,
            "corpus": dict(self.corpus),
            "options": dict(self.options),
            "tokens": self.tokens,
            "windows": self.windows,
            "layers": len(self.heads_per_layer),
            "heads_per_layer": list(self.heads_per_layer),
            "layer_windows": list(self.layer_windows),
            "stats": {name: _listed(self.stats[name]) for name in STATS},
            "counts": {name: _listed(self.counts[name]) for name in STATS},
            "examples": [
                [[e.to_dict() for e in head] for head in layer] for layer in self.examples
            ],
            "contexts": {str(w): self.contexts[w] for w in sorted(self.contexts)},
        }

    @classmethod
    def from_dict(cls, data: dict) -> Atlas:
        """An atlas read back from atlas.json (its examples without their weights)."""
        if data.get("format") != FORMAT:
            raise ValueError(f"this atlas.json is of format {data.get('format')!r}; this qkv "
                             f"reads format {FORMAT}")  # fmt: skip

        def grid(rows):
            return torch.tensor([[math.nan if v is None else v for v in row] for row in rows],
                                dtype=torch.float64)  # fmt: skip

        return cls(
            source=data["model"], corpus=data["corpus"], options=data["options"],
            tokens=data["tokens"], windows=data["windows"],
            heads_per_layer=data["heads_per_layer"], layer_windows=data["layer_windows"],
            stats={name: grid(data["stats"][name]) for name in STATS},
            counts={name: grid(data["counts"][name]) for name in STATS},
            examples=[[[Example(**{k: e[k] for k in EXAMPLE_FIELDS}) for e in head]
                       for head in layer] for layer in data["examples"]],
            contexts={int(w): pieces for w, pieces in data["contexts"].items()},
        )  # fmt: skip


def survey(
    pretrained,
    corpus: str | Path,
    state: str | Path,
    *,
    window: int = 256,
    batch: int = 8,
    top: int = 8,
    max_tokens: int | None = 100_000,
    save_every: int = 4,
    progress: Callable[[int, int], object] | None = None,
) -> Atlas:
    """The atlas of `pretrained`'s heads over the text or .jsonl file `corpus`, resuming from
    (and saving to) the state file `state`. `progress(windows_done, windows)` is called after
    each batch; an exception it raises stops the run, which the same call resumes.

    window: tokens per window, markers included; batch: windows per forward pass; top: examples
    kept per head; max_tokens: text tokens read at most (None: the whole corpus); save_every:
    batches between two saves of the state.
    """
    for name, value, low in (("window", window, 2), ("batch", batch, 1), ("top", top, 1),
                             ("save_every", save_every, 1)):  # fmt: skip
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ValueError(f"{name} must be a whole number >= {low}, got {value!r}")
    if max_tokens is not None and (not isinstance(max_tokens, int) or max_tokens < 1):
        raise ValueError(f"max_tokens must be a whole number >= 1 or None, got {max_tokens!r}")
    stack = self_attention_stack(pretrained.model, "the atlas", pretrained.source)
    if window > pretrained.context_window:
        raise ValueError(f"a window of {window} tokens is more than {pretrained.source} reads "
                         f"({pretrained.context_window}); give a shorter window")  # fmt: skip
    path = check_corpus(corpus)
    options = {"window": window, "batch": batch, "top": top, "max_tokens": max_tokens}
    named = {"format": FORMAT, "model": pretrained.source, "corpus": fingerprint(path),
             "options": options}  # fmt: skip

    def read():
        return windows(path, pretrained.tokenizer, window=window, max_tokens=max_tokens)

    total = sum(1 for _ in read())  # every line read and checked before any work is kept
    if total == 0:
        raise ValueError(f"the corpus {path} has no text to read (no window of 2 tokens or more)")
    state = Path(state)
    tally = _resumed(state, named) if state.exists() else Tally.empty(heads_per_layer(stack))
    pending: list[tuple[int, list[int]]] = []
    with torch.inference_mode():
        for index, ids in enumerate(read()):
            if index < tally.done:
                continue
            pending.append((index, ids))
            if len(pending) < batch and index + 1 < total:
                continue
            for group in _same_length(pending):
                tally.add(stack, group, top)
            tally.done, pending = index + 1, []
            if (tally.done // batch) % save_every == 0 or tally.done == total:
                _save(state, named, tally)
            if progress is not None:
                progress(tally.done, total)
    return tally.atlas(pretrained, named, total)


def _same_length(pending: list[tuple[int, list[int]]]) -> list[list[tuple[int, list[int]]]]:
    """A batch's windows grouped by length, in order (only a document's last is shorter)."""
    groups: dict[int, list] = {}
    for item in pending:
        groups.setdefault(len(item[1]), []).append(item)
    return list(groups.values())


@dataclass
class Tally:
    """The running sums and top lists, what the state file holds."""

    done: int  # windows read
    tokens: int
    sums: dict[str, Tensor]  # name -> (L, H) float64
    counts: dict[str, Tensor]
    examples: list[list[list[Example]]]
    window_ids: dict[int, list[int]]  # the windows the examples are in
    layer_windows: list[int | None]

    @classmethod
    def empty(cls, counts: list[int]) -> Tally:
        L = len(counts)
        return cls(0, 0, {name: nan_grid(counts) for name in STATS},
                   {name: nan_grid(counts) for name in STATS},
                   [[[] for _ in range(H)] for H in counts], {}, [None] * L)  # fmt: skip

    def add(self, stack, group: list[tuple[int, list[int]]], top: int) -> None:
        """One forward over windows of one length, their queries added to every sum."""
        ids = torch.tensor([window for _, window in group])  # (B, T)
        B, T = ids.shape
        self.tokens += B * T
        position = torch.arange(T)
        distance = (position[:, None] - position[None]).abs().double()  # (T, T)
        after = _after_earlier(ids)[:, 1:]  # (B, T-1, T) the keys induction reads
        has_earlier = after.any(-1)  # (B, T-1)
        queries = B * (T - 1)
        for layer, record in sorted(_records(stack, ids).items()):
            W = _weights(record)  # (B, H, T, T) float64
            self.layer_windows[layer] = record.window
            rows = W[:, :, 1:]  # (B, H, T-1, T): queries 1..T-1
            added = {
                "entropy": (-torch.special.xlogy(rows, rows).sum((0, 2, 3)), queries),
                "sink": (rows[..., 0].sum((0, 2)), queries),
                "previous_token": (W.diagonal(-1, -2, -1).sum((0, 2)), queries),
                "induction": ((rows * after[:, None]).sum((0, 2, 3)), has_earlier.sum()),
                "distance": ((rows * distance[1:]).sum((0, 2, 3)), queries),
                "self": (W.diagonal(0, -2, -1)[..., 1:].sum((0, 2)), queries),
            }
            if record.window is not None:
                allowed = record.allowed  # (B or 1, H or 1, T, T)
                use = [_window_use(W[b], allowed[b if allowed.shape[0] > 1 else 0])
                       for b in range(B)]  # fmt: skip
                added["window_use"] = (sum(u for u, _ in use), sum(c for _, c in use))
            own = slice(0, W.shape[1])
            for name, (total, counted) in added.items():
                self.sums[name][layer, own] += total
                self.counts[name][layer, own] += counted
            self._examples(layer, W, group, top)
        held = {e.window for layer in self.examples for head in layer for e in head}
        self.window_ids.update((w, ids) for w, ids in group if w in held)
        self.window_ids = {w: self.window_ids[w] for w in sorted(held)}

    def _examples(self, layer: int, W: Tensor, group: list, top: int) -> None:
        """Merge each head's best queries of these windows into its top list."""
        H, T = W.shape[1], W.shape[2]
        if T < 2:
            return
        best, at = W[:, :, 1:, 1:].max(-1)  # (B, H, T-1): largest weight on a key >= 1
        flat = best.transpose(0, 1).reshape(H, -1)  # (H, B*(T-1)), windows then queries
        order = flat.argsort(dim=-1, descending=True, stable=True)[:, :top]  # (H, top)
        for head in range(H):
            new, row_of = [], {}  # row_of: a new example's id -> its window's row here
            for n in order[head].tolist():
                b, query = divmod(n, T - 1)
                key = int(at[b, head, query]) + 1
                found = Example(float(flat[head, n]), group[b][0], query + 1, key,
                                _context(T, query + 1, key))  # fmt: skip
                new.append(found)
                row_of[id(found)] = b
            kept = sorted(self.examples[layer][head] + new, key=Example.order)[:top]
            for e in kept:
                if e.weights is None:  # new: its context's weights, from this batch
                    shown = torch.tensor(e.positions)
                    e.weights = W[row_of[id(e)], head][shown][:, shown].float()  # (n, n)
            self.examples[layer][head] = kept

    def atlas(self, pretrained, named: dict, total: int) -> Atlas:
        means = {name: torch.where(self.counts[name] > 0, self.sums[name] / self.counts[name],
                                   math.nan) for name in STATS}  # fmt: skip
        pieces = {w: pretrained.tokenizer.pieces(ids) for w, ids in self.window_ids.items()}
        counts = [len(heads) for heads in self.examples]
        return Atlas(
            source=pretrained.source, corpus=named["corpus"], options=named["options"],
            tokens=self.tokens, windows=total, heads_per_layer=counts,
            layer_windows=list(self.layer_windows), stats=means,
            counts={name: self.counts[name].clone() for name in STATS},
            examples=self.examples, contexts=pieces,
        )  # fmt: skip


def _after_earlier(ids: Tensor) -> Tensor:
    """(B, T, T) True at (i, j) where 1 <= j < i and token j - 1 is token i: the keys just
    after an earlier occurrence of query i's own token.

    >>> _after_earlier(torch.tensor([[5, 6, 5]]))[0, 2].tolist()
    [False, True, False]
    """
    B, T = ids.shape
    previous = torch.cat([ids.new_full((B, 1), -1), ids[:, :-1]], 1)  # (B, T): token j - 1
    same = ids[:, :, None] == previous[:, None, :]  # (B, T, T)
    return same & torch.ones(T, T, dtype=torch.bool).tril(-1)


def _context(T: int, query: int, key: int) -> list[int]:
    """The positions an example shows: key 0, and BEFORE tokens before to AFTER after its key
    and its query, within the window.

    >>> _context(40, 30, 2)
    [0, 1, 2, 3, 4, 5, 6, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32, 33, 34]
    """
    around = {0}
    for at in (query, key):
        around.update(range(max(0, at - BEFORE), min(T, at + AFTER + 1)))
    return sorted(around)


def _save(state: Path, named: dict, tally: Tally) -> None:
    examples = [[[{**e.to_dict(), "weights": e.weights} for e in head] for head in layer]
                for layer in tally.examples]  # fmt: skip
    data = {"named": named, "done": tally.done, "tokens": tally.tokens, "sums": tally.sums,
            "counts": tally.counts, "examples": examples, "window_ids": tally.window_ids,
            "layer_windows": tally.layer_windows}  # fmt: skip
    write_atomically(state, lambda file: torch.save(data, file))


def _resumed(state: Path, named: dict) -> Tally:
    """The tally a state file holds, refused where it was made by another run."""
    try:
        data = torch.load(state, weights_only=True)
        was = data["named"]
    except Exception as error:  # any unreadable state gets the same answer
        raise ValueError(f"{state} is not an atlas state qkv can read ({type(error).__name__}); "
                         "give a new --out folder") from None  # fmt: skip
    if was != named:
        what = next(part for part in ("format", "model", "corpus", "options")
                    if was.get(part) != named[part])  # fmt: skip
        raise ValueError(
            f"{state.parent} holds an atlas of another {what} ({_said(was.get(what))}, not "
            f"{_said(named[what])}); give a new --out folder, or the same corpus, model and "
            "options to resume it"
        )
    examples = [[[Example(**e) for e in head] for head in layer] for layer in data["examples"]]
    return Tally(data["done"], data["tokens"], data["sums"], data["counts"], examples,
                 data["window_ids"], data["layer_windows"])  # fmt: skip


def _said(value) -> str:
    if isinstance(value, dict):
        return ", ".join(f"{k} {str(v)[:16]}" for k, v in value.items())
    return str(value)

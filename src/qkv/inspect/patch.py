"""Patch one run into another: where a difference between two texts lives.

`patch` copies one activation of the clean run into the corrupted run at a time and scores
the next token: a head's output, its output at one position, its queries, keys, values or
attention weights alone, a layer's MLP output, or the residual stream (`WHATS`). Each patch is
an `Edit` the model's layers apply in their own forward pass, on every backend; the runs of a
table resume from the patched layer, side by side in batches, over every pair of a set at once
(`qkv.inspect.patch_runs`), and the result holds each pair's grids, their mean and a seeded
bootstrap 95% interval (`qkv.inspect.prompts.Spread`).

>>> sorted(WHATS)[:3]
['head_positions', 'heads', 'k']
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import Tensor

from qkv.attention.inputs import check_indices
from qkv.inspect.layer_heads import heads_per_layer
from qkv.inspect.metrics import Metric
from qkv.inspect.patch_runs import (
    Batch,
    Forward,
    PairText,
    batches_of,
    final_logits,
    forward,
    own_heads,
    per_cell,
    read_pairs,
    record_size,
    resumed_rows,
    scores,
)
from qkv.inspect.prompts import Spread
from qkv.inspect.runs import Token, batches, top_tokens
from qkv.nn.edit import Edit, Swap
from qkv.nn.head_edits import per_query_head
from qkv.views import Shown

# what `patch` can copy from the clean run, and each grid's cells
WHATS = {
    "heads": "a head's output (all positions, before the output projection): (L, H)",
    "head_positions": "a head's output at one position: (L, H, T)",
    "q": "a head's queries as attention receives them (after norms and rotation): (L, H)",
    "k": "a query head's keys: (L, H), the shared key/value head split by query head",
    "v": "a query head's values: (L, H), the shared key/value head split by query head",
    "weights": "a head's attention weights (the clean weights times the corrupted values): (L, H)",
    "residual": "the residual stream after a layer's block, at one position: (L, T)",
    "mlp": "a layer's MLP output at one position: (L, T)",
    "mlp_layers": "a layer's MLP output at every position at once: (L,)",
}
DEFAULT_WHAT = ("heads", "residual")
PER_HEAD = ("heads", "q", "k", "v", "weights")  # one cell per (layer, head)
OWN_HEADS = ("q", "k", "v", "weights")  # edits of a head's own q, k, v or weights
AT_POSITIONS = ("head_positions", "residual", "mlp")  # the last index is a position


def check_what(what) -> tuple[str, ...]:
    """A name or a list of names of WHATS, each once, in the order given."""
    names = (what,) if isinstance(what, str) else tuple(what)
    if not names:
        raise ValueError(f"what is one of {', '.join(WHATS)}, or a list of them; got none")
    for name in names:
        if name not in WHATS:
            raise ValueError(f"what={name!r} is not a thing patch copies; choose from "
                             f"{', '.join(WHATS)}")  # fmt: skip
    return tuple(dict.fromkeys(names))


@dataclass(repr=False)
class Patched(Shown):
    """Activation patching over one pair or a set of pairs: the clean run's activations copied,
    one at a time, into the corrupted run, and the metric of the next token measured.

    `grids[what]` is a `Spread`: per-pair values (N, *cells), their mean and 95% interval.
    Cells: (L, H) per head (NaN where a layer has fewer heads than H, the most any has),
    (L, H, T) per head and position, (L, T) per position, (L,) per layer. Positions are
    aligned from the end: column T - 1 is each pair's last token (T: the longest pair); a
    shorter pair's grid is NaN before its first token, so a position's mean is NaN unless
    every pair has it (`position_labels`). `heads` and `residual` are those grids' means.
    `clean` and `corrupt` are the mean metric unpatched (`clean_spread`, `corrupt_spread`
    per pair); `restored(grid)` is (metric - corrupt) / (clean - corrupt): 1 where a patch
    restores the clean metric, 0 where it changes nothing.
    """

    view: ClassVar[str] = "patched"  # drawn by qkv.viz.notebook_interventions

    source: str
    pairs: list[PairText]
    what: tuple[str, ...]
    grids: dict[str, Spread]
    clean_spread: Spread  # (N,)
    corrupt_spread: Spread
    clean_next: list[Token] = field(default_factory=list)  # the first pair's
    corrupt_next: list[Token] = field(default_factory=list)

    @property
    def clean(self) -> float:
        return float(self.clean_spread.mean)

    @property
    def corrupt(self) -> float:
        return float(self.corrupt_spread.mean)

    @property
    def metric(self) -> Metric:
        """The first pair's metric (the one metric, where one was given for all)."""
        return self.pairs[0].metric

    @property
    def clean_text(self) -> str:
        return self.pairs[0].clean_text

    @property
    def corrupt_text(self) -> str:
        return self.pairs[0].corrupt_text

    @property
    def clean_tokens(self) -> list[str]:
        return self.pairs[0].clean_tokens

    @property
    def corrupt_tokens(self) -> list[str]:
        return self.pairs[0].corrupt_tokens

    def grid(self, what: str) -> Tensor:
        """The mean grid of `what` over the pairs."""
        if what not in self.grids:
            raise ValueError(f"this result patched {', '.join(self.grids)}, not {what!r}: "
                             f"ask patch(..., what=[..., {what!r}])")  # fmt: skip
        return self.grids[what].mean

    @property
    def heads(self) -> Tensor:
        return self.grid("heads")  # (L, H)

    @property
    def residual(self) -> Tensor:
        return self.grid("residual")  # (L, T)

    def per_pair(self, what: str, n: int) -> Tensor:
        """Pair n's own grid of `what`, its positions its own (T_n of them)."""
        values = self.grids[what].values[n] if what in self.grids else self.grid(what)
        if what in AT_POSITIONS:
            return values[..., values.shape[-1] - len(self.pairs[n].clean_tokens) :]
        return values

    def position_labels(self) -> list[str]:
        """The position columns' names: the tokens where every pair has the same length,
        else counted from the end ("-1" is each pair's last token)."""
        lengths = {len(p.clean_tokens) for p in self.pairs}
        if len(lengths) == 1:
            return list(self.clean_tokens)
        T = max(lengths)
        return [str(t - T) for t in range(T)]

    def restored(self, grid: Tensor) -> Tensor:
        gap = self.clean - self.corrupt
        if gap == 0:
            return torch.full_like(grid, float("nan"))
        return (grid - self.corrupt) / gap

    def to_dict(self) -> dict:
        """JSON-ready (see docs/patch.md)."""
        first = self.pairs[0].to_dict()
        data = {"source": self.source, **{k: first[k] for k in first if k != "metric"},
                "metric": self.metric.to_dict(), "what": list(self.what),
                "pairs": [p.to_dict() for p in self.pairs], "clean": self.clean,
                "corrupt": self.corrupt, "clean_spread": self.clean_spread.to_dict(),
                "corrupt_spread": self.corrupt_spread.to_dict(),
                "positions": self.position_labels()}  # fmt: skip
        for what, spread in self.grids.items():
            data[what] = listed(spread.mean)
            data[f"{what}_restored"] = listed(self.restored(spread.mean))
        data["spreads"] = {what: spread.to_dict() for what, spread in self.grids.items()}
        data["clean_next"] = [vars(t) for t in self.clean_next]
        data["corrupt_next"] = [vars(t) for t in self.corrupt_next]
        return data


def patch(pretrained, clean, corrupt=None, metric=None, *, what=DEFAULT_WHAT, layers=None,
          seed: int = 0) -> Patched:  # fmt: skip
    """Patch the clean run's `what` (a name of WHATS or a list) into the corrupted run, one
    cell at a time, and score the next token after each pair's last token with its metric.

    clean, corrupt: two texts, two lists paired by position, or a file of pairs (a
    `pathlib.Path`: TSV 'clean<TAB>corrupt[<TAB>metric]' or JSONL; corrupt None).
    metric: a `Metric` or its text ("diff: Mary, John", "prob: A", "logprob: A", "kl") or a
    function of the logits, for every pair; a `list` of one per pair; None where the file
    gives each line's. layers: the layers patched (every one for None; the others' cells are
    NaN). seed: the bootstrap interval's.

    Decoders only; each pair's texts must have the same number of tokens (positions are
    patched into the same positions); pairs may differ in length.

    >>> import qkv  # doctest: +SKIP
    >>> patched = qkv.patch(qkv.load("smollm2"), "When Mary and John went to the store, John "
    ...     "gave a drink to", "When Mary and John went to the store, Mary gave a drink to",
    ...     "diff: Mary, John")  # doctest: +SKIP
    >>> patched.heads.shape, patched.residual.shape  # doctest: +SKIP
    (torch.Size([30, 9]), torch.Size([30, 14]))
    """
    whats = check_what(what)
    stack, pairs = read_pairs(pretrained, clean, corrupt, metric, "patch")
    counts = heads_per_layer(stack)  # each layer's own count
    L, H = stack.config.num_layers, max(counts)
    chosen = check_indices("layer", layers, L, pretrained.source)
    for name in whats:
        if name in OWN_HEADS:
            own_heads(stack, f"patching {name!r}", chosen)
    N, T = len(pairs), max(len(p.clean_ids) for p in pairs)
    values = {name: torch.full((N, *_cells_shape(name, L, H, T)), float("nan"),
                               dtype=torch.float64) for name in whats}  # fmt: skip
    clean_scores = torch.empty(N, dtype=torch.float64)
    corrupt_scores = torch.empty(N, dtype=torch.float64)
    first: tuple[Tensor, Tensor] | None = None
    with torch.inference_mode():
        for batch in batches_of(stack, pairs, per_token=record_size(stack)):
            clean_run = forward(stack, batch.clean, batch.last, "patch")
            corrupt_run = forward(stack, batch.corrupt, batch.last, "patch")
            index = torch.tensor(batch.index)
            clean_scores[index] = scores(batch, clean_run.logits, clean_run.logits)[0]
            corrupt_scores[index] = scores(batch, corrupt_run.logits, clean_run.logits)[0]
            if 0 in batch.index:
                b = batch.index.index(0)
                first = clean_run.logits[b], corrupt_run.logits[b]
            if "mlp" in whats or "mlp_layers" in whats:
                _check_sums(corrupt_run, L, pretrained.source)
            for name in whats:
                for layer in chosen:
                    _patch_layer(stack, batch, clean_run, corrupt_run, name, layer,
                                 counts[layer], values[name], corrupt_scores[index])  # fmt: skip
    assert first is not None
    tokenizer = pretrained.tokenizer
    return Patched(
        source=pretrained.source, pairs=pairs, what=whats,
        grids={name: Spread.of(v, seed) for name, v in values.items()},
        clean_spread=Spread.of(clean_scores, seed), corrupt_spread=Spread.of(corrupt_scores, seed),
        clean_next=top_tokens(tokenizer, first[0].double().log_softmax(-1)),
        corrupt_next=top_tokens(tokenizer, first[1].double().log_softmax(-1)),
    )  # fmt: skip


def _cells_shape(what: str, L: int, H: int, T: int) -> tuple[int, ...]:
    if what in PER_HEAD:
        return (L, H)
    if what == "head_positions":
        return (L, H, T)
    return (L, T) if what in AT_POSITIONS else (L,)


def _cells(what: str, H: int, T: int) -> list[tuple[int, ...]]:
    """One layer's cells: (head,), (head, position), (position,) or () for the layer."""
    if what in PER_HEAD:
        return [(h,) for h in range(H)]
    if what == "head_positions":
        return [(h, t) for h in range(H) for t in range(T)]
    return [(t,) for t in range(T)] if what in AT_POSITIONS else [()]


def _patch_layer(stack, batch: Batch, clean: Forward, corrupt: Forward, what: str, layer: int,
                 H: int, values: Tensor, unpatched: Tensor) -> None:  # fmt: skip
    """Every cell of one layer, in batches of rows within the budget, into values (N, ...).
    unpatched (B,): the corrupted run's metric, which a patch before the batch's first
    differing token leaves as it is (it copies what the corrupted run has there)."""
    B, T = batch.clean.shape
    start = batch.start
    cells = _cells(what, H, T)
    if what in AT_POSITIONS:
        before = [cell for cell in cells if cell[-1] < start]
        _store(values, what, layer, before, unpatched.expand(len(before), B), batch, unpatched)
        cells = [cell for cell in cells if cell[-1] >= start]
    per_row = B * (T - start) * (H * T + stack.config.block.width)  # mask and stream elements
    for part in batches(len(cells), per_row):
        chosen = cells[part]
        edit = _edit(what, layer, chosen, clean, corrupt, B, T, start)
        hidden = resumed_rows(stack, batch, corrupt, layer, {layer: edit}, len(chosen))
        logits = final_logits(stack, hidden, per_cell(batch.last - start, len(chosen)))
        _store(values, what, layer, chosen, scores(batch, logits, clean.logits), batch, unpatched)


def _edit(what: str, layer: int, cells, clean: Forward, corrupt: Forward, B: int, T: int,
          start: int) -> Edit:  # fmt: skip
    """The edit of rows (P * B, ...), cell-major: row p * B + b patches cell p of prompt b, at
    the positions start.. that the rows run (keys and values: every position)."""
    P, record = len(cells), clean.records[layer]
    if what in PER_HEAD or what == "head_positions":
        H = record.out.shape[1]
        at_positions = what == "head_positions"
        where = torch.zeros(P, 1, H, T if at_positions else 1, 1, dtype=torch.bool)
        for p, cell in enumerate(cells):
            where[p, 0, cell[0], cell[1] if at_positions else 0] = True
        where = where[:, :, :, start:] if at_positions else where  # (P, 1, H, T - start, 1)
        where = where.expand(P, B, *where.shape[2:]).reshape(P * B, *where.shape[2:])
        if what in ("heads", "head_positions"):
            values = record.out[:, :, start:]  # (B, H, T - start, D)
            return Edit(heads=where, head_values=per_cell(values, P))
        found = {"q": lambda: record.q[:, :, start:], "k": lambda: per_query_head(record.k, H),
                 "v": lambda: per_query_head(record.v, H),
                 "weights": lambda: record.weights()[:, :, start:]}  # fmt: skip
        return Edit(**{what: Swap(where, per_cell(found[what](), P))})
    positions = torch.zeros(P, 1, T, dtype=torch.bool)
    for p, cell in enumerate(cells):
        positions[p, 0, cell[0] if cell else slice(None)] = True
    positions = positions.expand(P, B, T).reshape(P * B, T)[:, start:]  # (P * B, T - start)
    if what == "residual":
        stream = clean.inputs[layer + 1]  # (B, T, C) after the block
    else:  # the corrupted block's output with the clean MLP's part in place of its own
        stream = (corrupt.inputs[layer] + corrupt.records[layer].attn_out) + record.mlp_out
    return Edit(positions=positions, residual=per_cell(stream[:, start:], P))


def _store(values: Tensor, what: str, layer: int, cells, got: Tensor, batch: Batch,
           unpatched: Tensor) -> None:  # fmt: skip
    """Scores (P, B) of cells into values (N, ...), positions aligned from the end. A cell
    whose patch copies what the corrupted run already has (a position before the pair's first
    differing token; any cell of a pair of one text twice) is the corrupted metric, exactly."""
    index, lengths, differ = torch.tensor(batch.index), batch.lengths, batch.differ
    T = values.shape[-1]
    for p, cell in enumerate(cells):
        if what not in AT_POSITIONS:
            values[(index, layer, *cell)] = torch.where(differ < lengths, got[p], unpatched)
            continue
        t = cell[-1]
        real = lengths > t  # a padding position is no cell of that pair
        column = (T - lengths + t)[real]
        found = torch.where(differ > t, unpatched, got[p])
        values[(index[real], layer, *cell[:-1], column)] = found[real]


def _check_sums(run: Forward, L: int, source: str) -> None:
    """Refuse, by name, a model whose blocks' outputs are not their input plus what attention
    and the MLP added (a post-norm block normalizes the sum): an MLP's output cannot be
    patched alone there."""
    for layer in range(L):
        record = run.records[layer]
        made = None
        if record.attn_out is not None and record.mlp_out is not None:
            made = run.inputs[layer] + record.attn_out + record.mlp_out
        after = run.inputs[layer + 1]
        if made is None or (made - after).abs().max() > 1e-4 * max(1.0, float(after.abs().max())):
            raise ValueError(
                f"patching an MLP's output copies what it adds to the residual stream, but "
                f"layer {layer} of {source} does not add it there (its block's output is not its "
                "input plus what attention and the MLP added: a post-norm block normalizes the "
                "sum); patch 'residual' or 'heads' instead"
            )


def listed(t: Tensor):
    """A tensor as nested lists (a float for a scalar), None where it is NaN."""

    def clean(x):
        if isinstance(x, list):
            return [clean(v) for v in x]
        return None if x != x else x

    return clean(t.tolist())

"""Attribution patching: every patch of `qkv.patch` estimated at once, by gradient x difference.

Patching a head's output from the clean run into the corrupted one changes the metric by
about (clean - corrupted activation) . d metric / d activation, the gradient taken in the
corrupted run: one forward on each text and one backward give the estimate for every head,
query, key, value, MLP and residual position together, where `qkv.patch` runs the model once
per cell. `edges=True` scores every (sender, receiver) edge the same way
(`qkv.inspect.attribute_edges`); `steps > 1` averages the gradients over `steps` points between
the corrupted and the clean embeddings (integrated gradients: EAP-IG), where a straight line's
first step misleads. `faithfulness()` measures the estimate against real patching.

Pairs run in right-padded batches: a causal decoder's real tokens never see the padding after
them, and each row's metric is read at its own last token, so its gradient is its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import Tensor

from qkv.inspect import attribute_edges as edges_of
from qkv.inspect.cache import check_cacheable
from qkv.inspect.metrics import Metric
from qkv.inspect.patch_runs import PairText, read_pairs
from qkv.inspect.prompts import Pair, Spread, groups, padded
from qkv.inspect.runs import decoder_logits, grid_dict, stack_of
from qkv.nn.head_edits import per_query_head
from qkv.views import Shown

BUDGET = 1 << 28  # the most elements (activations, gradients, taps) one batch of pairs holds
GRIDS = ("heads", "q", "k", "v", "residual", "attn", "mlp")
TOP = 10  # cells compared by faithfulness's top-k overlap


@dataclass(repr=False)
class Attributed(Shown):
    """Attribution patching over N pairs: each grid estimates, for every cell, the metric's
    change when that activation of the clean run is patched into the corrupted run, i.e.
    `qkv.patch`'s cell less the corrupted metric.

    `heads` (L, H): a head's output (z, before W_O) over every position; `q` (L, H), `k` and
    `v` (L, Hkv): its queries, keys and values (a key/value head shared by a group, the
    group's); `residual`, `attn`, `mlp` (L, T): the block's output, what attention added and
    what the MLP added, at one position (T the longest pair; NaN past a shorter pair's end).
    Each is the mean over pairs; `values[name]` holds the per-pair grids (N, …) and
    `spread(name)` their bootstrap interval. With edges: `edges` (senders, receivers), the
    mean, NaN where the sender writes after the receiver reads, `edge_values` (N, senders,
    receivers) per pair, and the names `senders` and `receivers` (`attribute_edges.edge_names`).
    """

    view: ClassVar[str] = "attributed"  # drawn by qkv.viz.notebook_attribute

    source: str
    pairs: list[Pair]
    metrics: list[Metric]
    clean_tokens: list[list[str]]
    corrupt_tokens: list[list[str]]
    clean: Tensor  # (N,) float64: the clean metric of each pair
    corrupt: Tensor  # (N,)
    values: dict[str, Tensor]  # (N, …) float64 per grid
    steps: int = 1
    senders: list[str] = field(default_factory=list)
    receivers: list[str] = field(default_factory=list)
    edges: Tensor | None = None  # (senders, receivers) float64
    edge_values: Tensor | None = None  # (N, senders, receivers) float32
    _pretrained: object = None
    _spreads: dict[str, Spread] = field(default_factory=dict)

    heads = property(lambda self: self.values["heads"].mean(0))
    q = property(lambda self: self.values["q"].mean(0))
    k = property(lambda self: self.values["k"].mean(0))
    v = property(lambda self: self.values["v"].mean(0))
    residual = property(lambda self: self.values["residual"].mean(0))
    attn = property(lambda self: self.values["attn"].mean(0))
    mlp = property(lambda self: self.values["mlp"].mean(0))

    def spread(self, name: str) -> Spread:
        """One grid's per-pair values, mean and seeded bootstrap 95% interval (made when
        first asked: 1,000 resamples of every cell)."""
        if name not in self.values:
            raise ValueError(f"no grid named {name!r}; the grids are {', '.join(GRIDS)}")
        if name not in self._spreads:
            self._spreads[name] = Spread.of(self.values[name])
        return self._spreads[name]

    @property
    def gap(self) -> float:
        """The mean of clean - corrupted metric: what patching everything would restore."""
        return float((self.clean - self.corrupt).mean())

    def restored(self, grid: Tensor) -> Tensor:
        """A grid as the share of the gap each cell is estimated to restore (NaN at no gap)."""
        return torch.full_like(grid, float("nan")) if self.gap == 0 else grid / self.gap

    def top_heads(self, k: int = TOP) -> list[tuple[int, int, float]]:
        """The k heads with the largest estimated effect (by size): (layer, head, score)."""
        return _top_cells(self.heads, k)

    def top_edges(self, k: int = TOP) -> list[tuple[str, str, float]]:
        """The k edges with the largest score (by size): (sender, receiver, score)."""
        if self.edges is None:
            raise ValueError("no edges were scored: call qkv.attribute with edges=True")
        flat = torch.nan_to_num(self.edges, nan=0.0).abs().flatten()
        chosen = flat.topk(min(k, int((flat > 0).sum()))).indices.tolist()
        R = len(self.receivers)
        return [(self.senders[i // R], self.receivers[i % R], float(self.edges.flatten()[i]))
                for i in chosen]  # fmt: skip

    def faithfulness(self, top: int = TOP) -> Faithfulness:
        """The heads grid against real patching (`qkv.patch`, pair by pair, its heads less the
        corrupted metric): Pearson and Spearman correlation of the mean grids, and the share
        of the `top` heads by size that both put in their top."""
        from qkv.inspect.patch import patch  # the real thing, a run per cell

        if self._pretrained is None:
            raise ValueError("this result holds no model to patch; call qkv.attribute again")
        patched = torch.stack(
            [
                patch(self._pretrained, pair.clean, pair.corrupt, metric).heads - corrupt
                for pair, metric, corrupt in zip(
                    self.pairs, self.metrics, self.corrupt.tolist(), strict=True
                )
            ]
        )  # (N, L, H) fmt: skip
        return Faithfulness.of(self.heads, patched.mean(0), top)

    def to_dict(self) -> dict:
        """JSON-ready (docs/attribute.md)."""
        found = {
            "source": self.source,
            "pairs": [{"clean": p.clean, "corrupt": p.corrupt} for p in self.pairs],
            "metrics": [m.to_dict() for m in self.metrics],
            "clean_tokens": self.clean_tokens,
            "corrupt_tokens": self.corrupt_tokens,
            "clean": self.clean.tolist(),
            "corrupt": self.corrupt.tolist(),
            "steps": self.steps,
        }
        found |= {name: grid_dict(self.values[name].mean(0)) for name in GRIDS}
        found["spreads"] = {name: self.spread(name).to_dict() for name in GRIDS}
        if self.edges is not None:
            found |= {"senders": self.senders, "receivers": self.receivers,
                      "edges": grid_dict(self.edges)}  # fmt: skip
        return found


@dataclass
class Faithfulness:
    """How well attribution's heads grid ranks heads as real patching does."""

    pearson: float
    spearman: float
    top: int
    overlap: float  # the share of the top heads (by size) both put in their top
    attributed: Tensor  # (L, H)
    patched: Tensor  # (L, H): qkv.patch's heads less the corrupted metric, the pairs' mean

    @classmethod
    def of(cls, attributed: Tensor, patched: Tensor, top: int = TOP) -> Faithfulness:
        if type(top) is not int or top < 1:
            raise ValueError(f"top must be a whole number >= 1, got {top!r}")
        real = (attributed == attributed) & (patched == patched)  # the cells both have
        a, p = attributed[real].double(), patched[real].double()
        top = min(top, a.numel())
        overlap = len(set(a.abs().topk(top).indices.tolist())
                      & set(p.abs().topk(top).indices.tolist())) / top  # fmt: skip
        return cls(_pearson(a, p), _pearson(_ranks(a), _ranks(p)), top, overlap,
                   attributed, patched)  # fmt: skip

    def to_dict(self) -> dict:
        return {"pearson": self.pearson, "spearman": self.spearman, "top": self.top,
                "overlap": self.overlap, "attributed": grid_dict(self.attributed),
                "patched": grid_dict(self.patched)}  # fmt: skip


def _pearson(a: Tensor, b: Tensor) -> float:
    a, b = a - a.mean(), b - b.mean()
    norm = float(a.norm() * b.norm())
    return float("nan") if norm == 0 else float(a @ b) / norm


def _ranks(x: Tensor) -> Tensor:
    """Ranks (ties averaged), for Spearman's correlation."""
    order = x.argsort()
    ranks = torch.empty_like(x)
    ranks[order] = torch.arange(len(x), dtype=x.dtype)
    for value in x.unique():  # ties share their mean rank
        same = x == value
        if int(same.sum()) > 1:
            ranks[same] = ranks[same].mean()
    return ranks


def _top_cells(grid: Tensor, k: int) -> list[tuple[int, int, float]]:
    flat = torch.nan_to_num(grid, nan=0.0).abs().flatten()
    chosen = flat.topk(min(k, flat.numel())).indices.tolist()
    W = grid.shape[1]
    return [(i // W, i % W, float(grid.flatten()[i])) for i in chosen]


# ---------------------------------------------------------------------------- the estimate


def attribute(pretrained, clean, corrupt=None, metric=None, *, edges: bool = False,
              steps: int = 1) -> Attributed:  # fmt: skip
    """Attribution patching of `clean` into `corrupt` (two texts, two lists of texts, or a
    file of pairs as `clean`: `qkv.inspect.prompts.pairs_of`), scored by `metric` at each
    pair's last token ("diff: Mary, John", "prob: A", "logprob: A", "kl", a function of the
    logits; or a list, one per pair; a file's own metric column wins). Each pair's texts have
    one token length. edges: also score every sender-receiver edge. steps: 1 for gradient x
    difference at the corrupted run; more for integrated gradients over the embeddings.

    >>> found = attribute(smollm2, "When Mary and John went to the store, John gave a drink to",
    ...                   "When Mary and John went to the store, Mary gave a drink to",
    ...                   "diff: Mary, John")  # doctest: +SKIP
    >>> found.heads.shape  # (L, H), as qkv.patch's  # doctest: +SKIP
    torch.Size([30, 9])
    """
    stack = stack_of(pretrained)
    check_attributable(stack, pretrained.source, edges)
    if type(steps) is not int or steps < 1:
        raise ValueError(f"steps must be a whole number >= 1 (1: gradient x difference), got "
                         f"{steps!r}")  # fmt: skip
    _, pairs = read_pairs(pretrained, clean, corrupt, metric, "attribution")
    metrics, ids = [p.metric for p in pairs], [p.metric_ids for p in pairs]
    L, H = stack.config.num_layers, stack.blocks[0].attn.num_heads
    Hkv, C = stack.blocks[0].attn.num_kv_heads, stack.config.block.width
    lengths = [len(p.clean_ids) for p in pairs]
    T, N = max(lengths), len(pairs)
    shapes = {"heads": (L, H), "q": (L, H), "k": (L, Hkv), "v": (L, Hkv),
              "residual": (L, T), "attn": (L, T), "mlp": (L, T)}  # fmt: skip
    grids = {name: torch.full((N, *shape), float("nan"), dtype=torch.float64)
             for name, shape in shapes.items()}  # fmt: skip
    clean_scores = torch.empty(N, dtype=torch.float64)
    corrupt_scores = torch.empty(N, dtype=torch.float64)
    senders, receivers = edges_of.edge_names(L, H) if edges else ([], [])
    edge_values = torch.empty(N, len(senders), len(receivers)) if edges else None
    per_token = L * C * (12 + (12 * H if edges else 0) + (len(senders) if edges else 0))
    for part in groups(lengths, per_token, BUDGET):
        rows = [ids[i] for i in part]
        found = _one_batch(stack, [pairs[i] for i in part], [metrics[i] for i in part], rows,
                           edges, steps)  # fmt: skip
        for name in GRIDS:
            grid = found[name]
            grids[name][part, :, : grid.shape[-1]] = grid
        for i in part:  # past a pair's own end: NaN, not the padding's zeros
            for name in ("residual", "attn", "mlp"):
                grids[name][i, :, lengths[i] :] = float("nan")
        clean_scores[part], corrupt_scores[part] = found["clean"], found["corrupt"]
        if edge_values is not None:
            edge_values[part] = found["edges"].float()
    mean_edges = None
    if edge_values is not None:
        mean_edges = edge_values.double().mean(0)
        mean_edges[~edges_of.edge_mask(L, H)] = float("nan")
    return Attributed(
        source=pretrained.source, pairs=[Pair(p.clean_text, p.corrupt_text) for p in pairs],
        metrics=metrics,
        clean_tokens=[p.clean_tokens for p in pairs],
        corrupt_tokens=[p.corrupt_tokens for p in pairs], clean=clean_scores,
        corrupt=corrupt_scores, values=grids,
        steps=steps, senders=senders, receivers=receivers, edges=mean_edges,
        edge_values=edge_values, _pretrained=pretrained,
    )  # fmt: skip


def check_attributable(stack, source: str, edges: bool) -> None:
    """Refuse, by name, what attribution does not compute exactly: qkv.cache's refusals, and
    for edges a head's write that a norm turns before it joins the stream."""
    check_cacheable(stack, source, "qkv.attribute")
    if edges and any(block.attn_out_norm is not None for block in stack.blocks):
        raise ValueError(f"edges split attention's output into each head's write; {source} "
                         "normalizes that output before it joins the stream (a sub-layer "
                         "norm), so a head's write is not its own: edges=False scores its "
                         "heads")  # fmt: skip


def _one_batch(stack, pairs: list[PairText], metrics, ids, edges: bool, steps: int) -> dict:
    """Every grid (B, …) of one batch of pairs, their clean and corrupted metrics (B,), and
    with edges their scores (B, senders, receivers)."""
    clean_ids, lengths = padded([p.clean_ids for p in pairs])  # (B, T), (B,)
    corrupt_ids, _ = padded([p.corrupt_ids for p in pairs])
    B = len(pairs)
    rows = torch.arange(B)
    with torch.no_grad():
        clean_out = stack(clean_ids, layers="all", hidden_states=True, logits=False)
        clean_last = decoder_logits(stack, clean_out.hidden[rows, lengths - 1])  # (B, vocab)
        clean = _activations(clean_out, stack)

    def scored(logits: Tensor) -> Tensor:  # (B, vocab) -> (B,), each row by its own metric
        return torch.stack([metric.score(logits[b], ids[b], clean_last[b])
                            for b, metric in enumerate(metrics)])  # fmt: skip

    corrupt, corrupt_scores, grads = None, None, None
    if steps > 1:  # the corrupted run's own activations, apart from the points between
        with torch.no_grad():
            corrupt_out = stack(corrupt_ids, layers="all", hidden_states=True, logits=False)
            corrupt = _activations(corrupt_out, stack)
            corrupt_scores = scored(decoder_logits(stack, corrupt_out.hidden[rows, lengths - 1]))
    for step in range(steps):
        x = None  # steps == 1: the corrupted run itself; else a point between the embeddings
        if corrupt is not None:
            alpha = (step + 0.5) / steps  # the midpoint of each of `steps` pieces
            x = corrupt["embed"] + alpha * (clean["embed"] - corrupt["embed"])  # (B, T, C)
        found, score, acts = _backward(stack, corrupt_ids, lengths, x, scored, edges)
        if steps == 1:
            corrupt, corrupt_scores = acts, score
        grads = found if grads is None else {k: grads[k] + found[k] for k in grads}
    assert grads is not None and corrupt is not None and corrupt_scores is not None
    grads = {k: g / steps for k, g in grads.items()}
    out = _grids(stack, clean, corrupt, grads)
    out["clean"], out["corrupt"] = scored(clean_last).detach(), corrupt_scores.detach()
    if edges:
        with torch.no_grad():  # W_O is a parameter: no graph for the senders' writes
            delta = edges_of.senders_delta(stack, clean, corrupt)  # (B, S, T, C)
            taps = [grads[f"tap{i}"] for i in range(3 * len(stack.blocks))]
            out["edges"] = edges_of.edge_scores(delta, edges_of.receivers_grad(taps, grads))
    return out


def _activations(out, stack) -> dict[str, Tensor]:
    """The activations attribution reads from a pass, detached."""
    found = {"embed": out.hidden_states[0].detach()}
    for n in range(len(stack.blocks)):
        r = out.records[n]
        found |= {f"L{n}.{name}": t.detach() for name, t in (
            ("z", r.out), ("q", r.q), ("k", r.k), ("v", r.v), ("attn_out", r.attn_out),
            ("mlp_out", r.mlp_out), ("resid_post", out.hidden_states[n + 1]))}  # fmt: skip
    return found


def _backward(stack, ids: Tensor, lengths: Tensor, x: Tensor | None, scored, edges: bool):
    """One pass over ids (from the embeddings x where given) and its backward: the metric's
    gradients by the activations attribution reads ('tap{i}': the edges' input taps), the
    metric (B,), and the pass's activations."""
    B, T = ids.shape
    edits, taps = edges_of.input_taps(stack, B, T) if edges else (None, [])
    with torch.enable_grad():
        out = stack(ids, layers="all", hidden_states=True, logits=False, edits=edits,
                    resume=None if x is None else (0, x))  # fmt: skip
        last = decoder_logits(stack, out.hidden[torch.arange(B), lengths - 1])  # (B, vocab)
        score = scored(last)  # (B,)
        acts = {"embed": out.hidden_states[0]}
        for n in range(len(stack.blocks)):
            r = out.records[n]
            acts |= {f"L{n}.z": r.out, f"L{n}.q": r.q, f"L{n}.k": r.k, f"L{n}.v": r.v,
                     f"L{n}.attn_out": r.attn_out, f"L{n}.mlp_out": r.mlp_out,
                     f"L{n}.resid_post": out.hidden_states[n + 1]}  # fmt: skip
        wanted = {name: t for name, t in acts.items() if name != "embed"}
        wanted |= {f"tap{i}": tap for i, tap in enumerate(taps)}
        found = torch.autograd.grad(score.sum(), list(wanted.values()), allow_unused=True)
    grads = {name: torch.zeros_like(wanted[name]) if g is None else g
             for name, g in zip(wanted, found, strict=True)}  # fmt: skip
    return grads, score.detach(), {name: t.detach() for name, t in acts.items()}


def _grids(stack, clean: dict, corrupt: dict, grads: dict) -> dict[str, Tensor]:
    """Gradient x difference, summed over what each cell covers: (B, L, H) for heads and q,
    (B, L, Hkv) for k and v, (B, L, T) for residual, attn and mlp."""
    out: dict[str, list[Tensor]] = {name: [] for name in GRIDS}
    for n in range(len(stack.blocks)):

        def times(name: str) -> Tensor:  # (clean - corrupt) * gradient, elementwise
            return (clean[name] - corrupt[name]) * grads[name]

        out["heads"].append(times(f"L{n}.z").sum((-1, -2)))  # (B, H)
        out["q"].append(times(f"L{n}.q").sum((-1, -2)))
        for name in ("k", "v"):
            out[name].append(_per_kv_head(clean, corrupt, grads, f"L{n}.{name}"))
        out["residual"].append(times(f"L{n}.resid_post").sum(-1))  # (B, T)
        out["attn"].append(times(f"L{n}.attn_out").sum(-1))
        out["mlp"].append(times(f"L{n}.mlp_out").sum(-1))
    return {name: torch.stack(parts, dim=1).double() for name, parts in out.items()}


def _per_kv_head(clean: dict, corrupt: dict, grads: dict, name: str) -> Tensor:
    """(B, Hkv): keys' or values' gradient x difference per key/value head. Where the pass
    split them by query head (the edges' taps), each query head's copy is summed into its
    group's head: the shared head's gradient is the sum of its copies'."""
    grad, Hkv = grads[name], clean[name].shape[1]
    after, before = (per_query_head(t[name], grad.shape[1]) for t in (clean, corrupt))
    cells = ((after - before) * grad).sum((-1, -2))  # (B, H or Hkv)
    return cells.view(cells.shape[0], Hkv, -1).sum(-1)  # (B, Hkv)

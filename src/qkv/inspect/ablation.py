"""Ablate heads and patch one run into another: what a head does, and where a difference lives.

`ablate` silences heads (their outputs replaced by zeros or by their mean over reference
texts); `patch` copies the clean run's head outputs, or its residual stream at one layer and
position, into a corrupted run, one at a time, and scores the next token. Both are `Edit`s
the model's layers apply in their own forward pass, on every backend, with the runs of a
table resumed from the first changed layer and batched (`qkv.inspect.intervene`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import Tensor

from qkv.attention.inputs import check_indices
from qkv.inspect.intervene import (
    NextTokens,
    Token,
    _logits,
    _top,
    batches,
    changed,
    grid_dict,
    next_tokens,
    resumed,
    run,
    stack_of,
)
from qkv.models import Decoder
from qkv.nn.edit import Edit

# ---------------------------------------------------------------------------- ablate

# texts whose mean head outputs mean-ablation puts in a head's place, by default
REFERENCE = (
    "The bank of the river was muddy after the rain.",
    "She deposited her savings at the bank on Monday.",
    "A cat sat on the warm windowsill and watched the birds.",
    "The committee will announce its decision next week.",
    "He poured the coffee, opened the paper and read the news.",
    "Rivers carry water from the mountains to the sea.",
    "The old library keeps maps, letters and rare books.",
    "Prices rose again this year, and wages did not keep up.",
)


@dataclass
class Ablated:
    """Heads ablated: their outputs replaced by zeros or by their mean over reference texts.

    `states` has every head asked ablated at once, `clean_states` none. `effect` (L, H) is
    each head ablated alone: the mean over every token of 1 - cosine between its final
    vector with and without (NaN for heads not asked); `total` the same with all at once.
    """

    source: str
    text: str
    tokens: list[str]
    mode: str
    heads: list[tuple[int, int]]  # (layer, head), counted from 0
    states: Tensor  # (T, C)
    clean_states: Tensor  # (T, C)
    effect: Tensor  # (L, H) float64
    total: float
    next: NextTokens | None = None  # decoders: after the last token, all heads ablated
    next_by_head: Tensor | None = None  # (L, H): the change of the clean top token's log-prob

    def ranked(self) -> list[tuple[int, int, float]]:
        cells = [(n, h, float(self.effect[n, h])) for n, h in self.heads]
        return sorted(cells, key=lambda c: -c[2])

    def to_dict(self) -> dict:
        """JSON-ready (see docs/ablate.md)."""
        return {
            "source": self.source,
            "text": self.text,
            "tokens": self.tokens,
            "mode": self.mode,
            "heads": [list(h) for h in self.heads],
            "effect": grid_dict(self.effect),
            "total": self.total,
            "ranked": [{"layer": n, "head": h, "effect": e} for n, h, e in self.ranked()],
            "next": None if self.next is None else self.next.to_dict(),
            "next_by_head": None if self.next_by_head is None else grid_dict(self.next_by_head),
        }

    def __repr__(self) -> str:
        from qkv.viz.notebook_interventions import ablated_repr

        return ablated_repr(self)

    def _repr_html_(self) -> str:
        """How Jupyter shows it (see qkv.viz.notebook): self-contained, nothing fetched."""
        from qkv.viz.notebook_interventions import ablated_html

        return ablated_html(self)


def head_pairs(stack, heads, source: str) -> list[tuple[int, int]]:
    """(layer, head) pairs from "all", a list of pairs, or a list of layers (all their heads)."""
    L, H = stack.config.num_layers, stack.config.block.num_heads
    if isinstance(heads, str):
        if heads != "all":
            raise ValueError(f"heads must be 'all' or (layer, head) pairs, got {heads!r}")
        return [(n, h) for n in range(L) for h in range(H)]
    pairs = []
    for item in heads:
        if isinstance(item, int):
            (n,) = check_indices("layer", [item], L, source)
            pairs.extend((n, h) for h in range(H))
            continue
        if not isinstance(item, Sequence) or len(item) != 2:
            raise ValueError(f"a head is a (layer, head) pair, got {item!r}")
        (n,) = check_indices("layer", [item[0]], L, source)
        (h,) = check_indices("head", [item[1]], H, source)
        pairs.append((n, h))
    pairs = sorted(set(pairs))
    if not pairs:
        raise ValueError("no head asked for; give (layer, head) pairs, or 'all'")
    return pairs


def mean_head_outputs(pretrained, stack, texts: Sequence[str]) -> Tensor:
    """(L, H, D): each head's output averaged over every token of `texts`."""
    if isinstance(texts, str) or not texts:
        raise ValueError("reference must be a list of texts (one at least)")
    total, count = None, 0
    with torch.inference_mode():
        for text in texts:
            outputs = run(stack, torch.tensor([pretrained.encode(text).ids])).head_outputs
            summed = outputs.double().sum(2)  # (L, H, D)
            total = summed if total is None else total + summed
            count += outputs.shape[2]
    return total / count


def ablate(
    pretrained,
    text: str,
    heads="all",
    *,
    mode: Literal["zero", "mean"] = "zero",
    reference: Sequence[str] | None = None,
) -> Ablated:
    """Ablate `heads` ((layer, head) pairs, layers meaning all their heads, or "all") in a
    run over `text`: each alone (`effect`) and all at once (`states`, `total`).

    mode "zero" replaces a head's output (before the output projection: the projection's
    bias, which belongs to no head, stays) by zeros; "mean" by that head's mean output over
    every token of `reference` (REFERENCE by default).
    """
    if mode not in ("zero", "mean"):
        raise ValueError(f"mode must be 'zero' or 'mean', got {mode!r}")
    if mode == "zero" and reference is not None:
        raise ValueError("reference texts are for mode='mean'; zero ablation reads none")
    stack = stack_of(pretrained)
    pairs = head_pairs(stack, heads, pretrained.source)
    encoded = pretrained.encode(text)
    ids = torch.tensor([encoded.ids])
    T, L, H = ids.shape[1], stack.config.num_layers, stack.config.block.num_heads
    D = stack.blocks[0].attn.head_dim
    values = torch.zeros(L, H, D)
    if mode == "mean":
        values = mean_head_outputs(pretrained, stack, REFERENCE if reference is None else reference)
    causal = isinstance(stack, Decoder)
    effect = torch.full((L, H), float("nan"), dtype=torch.float64)
    by_head = effect.clone() if causal else None
    with torch.inference_mode():
        clean = run(stack, ids)
        dtype = clean.states.dtype
        values = values.to(dtype)[:, None, :, None, :]  # (L, 1, H, 1, D)
        clean_logprobs = clean.logits[-1].double().log_softmax(-1) if causal else None
        for layer in sorted({n for n, _ in pairs}):
            chosen = [h for n, h in pairs if n == layer]
            which = torch.zeros(len(chosen), H, 1, 1, dtype=torch.bool)
            which[range(len(chosen)), chosen] = True
            edit = Edit(heads=which, head_values=values[layer])
            states = resumed(stack, clean, layer, {layer: edit}, len(chosen))
            effect[layer, chosen] = changed(clean.states[None], states)[0].mean(-1)
            if by_head is not None:
                top = int(clean_logprobs.argmax())
                logprobs = _logits(stack, states[:, -1]).double().log_softmax(-1)
                by_head[layer, chosen] = logprobs[:, top] - clean_logprobs[top]
        edits = {}
        for n, h in pairs:
            which = edits[n].heads if n in edits else torch.zeros(1, H, 1, 1, dtype=torch.bool)
            which[0, h] = True
            edits[n] = Edit(heads=which, head_values=values[n])
        states = resumed(stack, clean, min(edits), edits, 1)
        total = float(changed(clean.states, states[0])[0].mean())
        after = _logits(stack, states[0, -1]) if causal else None
    return Ablated(
        source=pretrained.source, text=text, tokens=list(encoded.tokens), mode=mode,
        heads=pairs, states=states[0], clean_states=clean.states, effect=effect, total=total,
        next=None if after is None else next_tokens(
            pretrained.tokenizer, clean.logits[-1], after, T - 1
        ),
        next_by_head=by_head,
    )  # fmt: skip


# ---------------------------------------------------------------------------- patch


@dataclass(frozen=True)
class Metric:
    """What a patched run is scored by, at the last position's next token.

    kind "diff": log p(tokens[0]) - log p(tokens[1]) (the log-probability difference of two
    tokens, e.g. " Mary" over " John"); "prob": p(tokens[0]).
    A token is written as the model's tokenizer reads it: " Paris" (with its space) is
    another token than "Paris".
    """

    kind: Literal["diff", "prob"]
    tokens: tuple[str, ...]

    def __post_init__(self):
        counts = {"diff": 2, "prob": 1}
        if self.kind not in counts:
            raise ValueError(f"a metric is 'diff' or 'prob', got {self.kind!r}")
        if len(self.tokens) != counts[self.kind]:
            raise ValueError(
                f"metric {self.kind!r} takes {counts[self.kind]} token(s), got {len(self.tokens)}"
            )

    @classmethod
    def parse(cls, spec) -> Metric:
        """A Metric, a ("diff", a, b) / ("prob", t) tuple, or text: "diff: Mary, John"
        (tokens after the colon, split at commas, spaces kept: ' Mary' and ' John') or
        "prob: Paris"."""
        if isinstance(spec, Metric):
            return spec
        if isinstance(spec, tuple | list) and spec:
            return cls(spec[0], tuple(spec[1:]))
        if not isinstance(spec, str) or ":" not in spec:
            raise ValueError(f"a metric is 'diff:TOKEN_A,TOKEN_B' or 'prob:TOKEN', got {spec!r}")
        kind, _, rest = spec.partition(":")
        return cls(kind.strip(), tuple(rest.split(",")))

    def ids(self, tokenizer) -> list[int]:
        found = []
        for token in self.tokens:
            encoded = tokenizer.encode(token, add_special_tokens=False)
            if len(encoded.ids) != 1:
                raise ValueError(
                    f"the metric's token {token!r} is not one token of the vocabulary: it reads "
                    f"as {list(encoded.tokens)}; give one of those, spaces as written"
                )
            found.append(encoded.ids[0])
        return found

    def score(self, logits: Tensor, ids: list[int]) -> Tensor:
        """logits (…, vocab) -> the metric (…), float64."""
        logprobs = logits.double().log_softmax(-1)
        if self.kind == "diff":
            return logprobs[..., ids[0]] - logprobs[..., ids[1]]
        return logprobs[..., ids[0]].exp()

    def __str__(self) -> str:
        if self.kind == "diff":
            return f"log p({self.tokens[0]!r}) - log p({self.tokens[1]!r})"
        return f"p({self.tokens[0]!r})"


@dataclass
class Patched:
    """Activation patching: the clean run's activations copied, one at a time, into the
    corrupted run, and the metric of the corrupted run's next token measured.

    `heads` (L, H): the metric with that head's output patched in; `residual` (L, T): with
    the residual stream after that layer's block patched in at that position. `clean` and
    `corrupt` are the metric unpatched; `restored(grid)` is (metric - corrupt) / (clean -
    corrupt): 1 where a patch restores the clean metric, 0 where it changes nothing.
    """

    source: str
    clean_text: str
    corrupt_text: str
    clean_tokens: list[str]
    corrupt_tokens: list[str]
    metric: Metric
    clean: float
    corrupt: float
    heads: Tensor  # (L, H) float64
    residual: Tensor  # (L, T) float64
    clean_next: list[Token] = field(default_factory=list)
    corrupt_next: list[Token] = field(default_factory=list)

    def restored(self, grid: Tensor) -> Tensor:
        gap = self.clean - self.corrupt
        if gap == 0:
            return torch.full_like(grid, float("nan"))
        return (grid - self.corrupt) / gap

    def to_dict(self) -> dict:
        """JSON-ready (see docs/patch.md)."""
        return {
            "source": self.source,
            "clean_text": self.clean_text,
            "corrupt_text": self.corrupt_text,
            "clean_tokens": self.clean_tokens,
            "corrupt_tokens": self.corrupt_tokens,
            "metric": {
                "kind": self.metric.kind,
                "tokens": list(self.metric.tokens),
                "text": str(self.metric),
            },
            "clean": self.clean,
            "corrupt": self.corrupt,
            "heads": grid_dict(self.heads),
            "residual": grid_dict(self.residual),
            "heads_restored": grid_dict(self.restored(self.heads)),
            "residual_restored": grid_dict(self.restored(self.residual)),
            "clean_next": [vars(t) for t in self.clean_next],
            "corrupt_next": [vars(t) for t in self.corrupt_next],
        }

    def __repr__(self) -> str:
        from qkv.viz.notebook_interventions import patched_repr

        return patched_repr(self)

    def _repr_html_(self) -> str:
        """How Jupyter shows it (see qkv.viz.notebook): self-contained, nothing fetched."""
        from qkv.viz.notebook_interventions import patched_html

        return patched_html(self)


def patch(pretrained, clean: str, corrupt: str, metric) -> Patched:
    """Patch `clean`'s head outputs (per layer and head) and residual stream (per layer and
    position) into the run over `corrupt`, one at a time, and score the next token after
    the last position with `metric` (a `Metric`, or its text: "diff: Mary, John").

    Decoders only; the two texts must have the same number of tokens (positions are
    patched into the same positions).
    """
    stack = stack_of(pretrained)
    if not isinstance(stack, Decoder):
        raise ValueError(
            f"patch scores the next token, so it needs a decoder; {pretrained.source} is "
            f"{pretrained.family.name}"
        )
    metric = Metric.parse(metric)
    ids_of_metric = metric.ids(pretrained.tokenizer)
    clean_encoded, corrupt_encoded = pretrained.encode(clean), pretrained.encode(corrupt)
    if len(clean_encoded.ids) != len(corrupt_encoded.ids):
        raise ValueError(
            f"the clean text has {len(clean_encoded.ids)} tokens and the corrupted text "
            f"{len(corrupt_encoded.ids)}; patching copies positions into the same positions, "
            f"so give texts of equal token length (clean: {list(clean_encoded.tokens)}, "
            f"corrupted: {list(corrupt_encoded.tokens)})"
        )
    L, H = stack.config.num_layers, stack.config.block.num_heads
    T = len(clean_encoded.ids)
    heads = torch.empty(L, H, dtype=torch.float64)
    residual = torch.empty(L, T, dtype=torch.float64)
    with torch.inference_mode():
        source = run(stack, torch.tensor([clean_encoded.ids]))
        target = run(stack, torch.tensor([corrupt_encoded.ids]))

        def scored(states: Tensor) -> Tensor:
            return metric.score(_logits(stack, states[:, -1]), ids_of_metric)

        for layer in range(L):
            values = source.head_outputs[layer][None]  # (1, H, T, D)
            for part in batches(H, H * T * T):
                which = torch.eye(H, dtype=torch.bool)[part, :, None, None]  # row h: head h
                edit = Edit(heads=which, head_values=values)
                states = resumed(stack, target, layer, {layer: edit}, which.shape[0])
                heads[layer, part] = scored(states)
            for part in batches(T, H * T * T):
                where = torch.eye(T, dtype=torch.bool)[part]  # row p patches position p
                edit = Edit(positions=where, residual=source.inputs[layer + 1])
                states = resumed(stack, target, layer, {layer: edit}, where.shape[0])
                residual[layer, part] = scored(states)
        clean_score = float(metric.score(source.logits[-1], ids_of_metric))
        corrupt_score = float(metric.score(target.logits[-1], ids_of_metric))
    tokenizer = pretrained.tokenizer
    return Patched(
        source=pretrained.source, clean_text=clean, corrupt_text=corrupt,
        clean_tokens=list(clean_encoded.tokens), corrupt_tokens=list(corrupt_encoded.tokens),
        metric=metric, clean=clean_score, corrupt=corrupt_score, heads=heads, residual=residual,
        clean_next=_top(tokenizer, source.logits[-1].double().log_softmax(-1)),
        corrupt_next=_top(tokenizer, target.logits[-1].double().log_softmax(-1)),
    )  # fmt: skip

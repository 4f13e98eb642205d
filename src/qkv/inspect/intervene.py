"""Ask the model "what if": hide a word from another, ablate heads, patch one run into another.

The article's claim is causal: "river" gives "bank" its context. `hide` takes "river" away
from "bank" and measures what changes in "bank"'s final vector, in each (layer, head) alone
and everywhere at once; `ablate` silences heads; `patch` copies one run's head outputs or
residual stream into another's and measures a metric of the next token.

Each question is asked of the model itself, through `Edit`s its layers apply in their own
forward pass (`qkv.nn.edit`): a hidden pair joins the layer's mask, so the softmax
renormalizes over the remaining keys exactly as for padding, on whichever backend the
model runs. A table over every (layer, head) reuses one clean forward: each layer's run
resumes from the clean residual stream at that layer, and the heads of a layer run side by
side as one batch, one head edited per row.

Everything runs under `torch.inference_mode` and leaves the model as it was.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from qkv.attention.inputs import check_indices
from qkv.models import Decoder, Encoder, EncoderDecoder
from qkv.nn.edit import Edit, Edits

# the most (rows x heads x queries x keys) mask elements one batched run builds (64 Mi
# booleans): a long text runs its heads in smaller batches instead of taking more memory
MASK_BUDGET = 1 << 26
TOP = 5  # next tokens shown before and after


# ---------------------------------------------------------------------------- the model


def stack_of(pretrained) -> Encoder | Decoder:
    """The stack interventions run on: an encoder's or a decoder's, an encoder-decoder's
    encoder (what `attentions` shows without a target)."""
    model = pretrained.model
    if isinstance(model, EncoderDecoder):
        return model.encoder
    if isinstance(model, Encoder | Decoder):
        return model
    raise ValueError(f"interventions need an encoder or a decoder, not {type(model).__name__}")


@dataclass
class Run:
    """One forward pass of a stack over ids (1, T): the residual stream at every block's
    input (`inputs[l]`, then the last block's output), the final vectors and every layer's
    head outputs (L, H, T, D), as the records keep them."""

    ids: Tensor  # (1, T)
    inputs: list[Tensor]  # L + 1 tensors (1, T, C)
    states: Tensor  # (T, C) after the final norm
    head_outputs: Tensor  # (L, H, T, D)
    logits: Tensor | None  # (T, vocab), decoders


def run(stack: Encoder | Decoder, ids: Tensor, edits: Edits | None = None) -> Run:
    out = _forward(stack, ids, edits, layers="all", hidden_states=True)
    heads = torch.stack([out.records[n].out[0] for n in range(len(stack.blocks))])
    logits = _logits(stack, out.hidden[0]) if isinstance(stack, Decoder) else None
    return Run(ids, out.hidden_states, out.hidden[0], heads, logits)


def _forward(stack, ids: Tensor, edits: Edits | None, **kwargs):
    if isinstance(stack, Decoder):
        return stack(ids, edits=edits, logits=False, **kwargs)
    return stack(ids, edits=edits, **kwargs)


def _logits(stack: Decoder, hidden: Tensor) -> Tensor:
    return stack.project(hidden).float()


def resumed(stack, clean: Run, layer: int, edits: Edits, rows: int) -> Tensor:
    """The final vectors (rows, T, C) of `rows` runs from `layer` on, each starting from the
    clean residual stream there, with `edits` (batched: row b's edit in row b)."""
    ids = clean.ids.expand(rows, -1)
    return _forward(stack, ids, edits, resume=(layer, clean.inputs[layer])).hidden


def batches(count: int, per_row: int) -> Iterator[slice]:
    """Slices of `count` rows, each batch within MASK_BUDGET elements at `per_row` a row."""
    size = max(1, min(count, MASK_BUDGET // max(per_row, 1)))
    for start in range(0, count, size):
        yield slice(start, min(start + size, count))


def changed(before: Tensor, after: Tensor) -> tuple[Tensor, Tensor]:
    """1 - cosine and Euclidean distance between vectors (…, C), float64."""
    before, after = before.double(), after.double()
    return 1 - F.cosine_similarity(before, after, dim=-1), (after - before).norm(dim=-1)


def _layers_heads(stack, layers, heads, source: str) -> tuple[list[int], list[int]]:
    L, H = stack.config.num_layers, stack.config.block.num_heads
    layers = list(range(L)) if layers is None else check_indices("layer", layers, L, source)
    heads = list(range(H)) if heads is None else check_indices("head", heads, H, source)
    if not layers or not heads:
        raise ValueError("no layer or no head asked for; leave layers and heads out for all")
    return layers, heads


# ---------------------------------------------------------------------------- tokens


@dataclass
class Token:
    token: str
    id: int
    logprob: float


@dataclass
class NextTokens:
    """A decoder's next-token log-probabilities at one position, before and after a change."""

    position: int
    before: list[Token]  # the top tokens of the clean run
    after: list[Token]  # the top tokens of the changed run
    # the clean run's top token: its log-probability after the change minus before
    top_change: float

    def to_dict(self) -> dict:
        return {
            "position": self.position,
            "before": [vars(t) for t in self.before],
            "after": [vars(t) for t in self.after],
            "top_change": self.top_change,
        }


def _top(tokenizer, logprobs: Tensor, k: int = TOP) -> list[Token]:
    values, ids = logprobs.topk(min(k, logprobs.numel()))
    return [
        Token(tokenizer.id_to_token(i) or str(i), i, float(v))
        for v, i in zip(values.tolist(), ids.tolist(), strict=True)
    ]


def next_tokens(tokenizer, before: Tensor, after: Tensor, position: int) -> NextTokens:
    """From logits (vocab,) of the clean and the changed run at `position`."""
    before, after = before.double().log_softmax(-1), after.double().log_softmax(-1)
    top = int(before.argmax())
    change = float(after[top] - before[top])
    return NextTokens(position, _top(tokenizer, before), _top(tokenizer, after), change)


def word_span(encoded, word: str, what: str) -> tuple[int, int]:
    """A word's token span [start, end) ("bank", "bank#2"): a word that occurs twice must
    say which."""
    from qkv.inspect.trace import _first_token

    try:
        start = _first_token(encoded, word)
        span = encoded.find(word)
    except ValueError as error:
        raise ValueError(f"{what}: {error}") from None
    assert span[0] == start
    return span


def grid_dict(grid: Tensor) -> list[list[float | None]]:
    """An (L, H) grid as lists, None where it was not computed (NaN)."""
    return [[None if v != v else float(v) for v in row] for row in grid.tolist()]


# ---------------------------------------------------------------------------- hide


@dataclass
class Hidden:
    """What changes when a key word is hidden from a query word (or from every word).

    `states` and `clean_states` are every token's final vector (T, C) with the key hidden
    in every (layer, head) asked, and without. `effect` (L, H) is the change of the query
    word's final vector (the mean over its tokens) when the key is hidden in that head
    alone: 1 - cosine; with no query, the mean of that change over every token. NaN where
    not asked. `distance` is the same as a Euclidean distance; `total` and `total_distance`
    the change with the key hidden everywhere asked at once.
    """

    source: str
    text: str
    tokens: list[str]
    key: str | list[str]
    query: str | None
    key_spans: list[tuple[int, int]]  # each key word's token span [start, end)
    query_span: tuple[int, int] | None
    layers: list[int]  # the layers and heads the key was hidden in
    heads: list[int]
    states: Tensor  # (T, C)
    clean_states: Tensor  # (T, C)
    effect: Tensor  # (L, H) float64
    distance: Tensor  # (L, H) float64
    total: float
    total_distance: float
    # decoders: the next token after the query word (after the last token without a query)
    next: NextTokens | None = None
    next_by_head: Tensor | None = None  # (L, H): the change of the clean top token's log-prob

    def ranked(self) -> list[tuple[int, int, float]]:
        """(layer, head, effect) of every head asked, largest effect first."""
        cells = [(n, h, float(self.effect[n, h])) for n in self.layers for h in self.heads]
        return sorted(cells, key=lambda c: -c[2])

    def to_dict(self) -> dict:
        """JSON-ready (see docs/hide.md)."""
        return {
            "source": self.source,
            "text": self.text,
            "tokens": self.tokens,
            "key": self.key,
            "query": self.query,
            "key_spans": [list(span) for span in self.key_spans],
            "query_span": None if self.query_span is None else list(self.query_span),
            "layers": self.layers,
            "heads": self.heads,
            "effect": grid_dict(self.effect),
            "distance": grid_dict(self.distance),
            "total": self.total,
            "total_distance": self.total_distance,
            "ranked": [{"layer": n, "head": h, "effect": e} for n, h, e in self.ranked()],
            "next": None if self.next is None else self.next.to_dict(),
            "next_by_head": None if self.next_by_head is None else grid_dict(self.next_by_head),
        }


def hide_mask(
    T: int,
    H: int,
    keys: Sequence[tuple[int, int]],
    query: tuple[int, int] | None,
    heads: Sequence[int],
) -> Tensor:
    """(1, H, T, T) boolean: True where the keys' tokens (spans [start, end)) are hidden from
    the query's (every token's with no query), in `heads`."""
    hidden = torch.zeros(1, H, T, T, dtype=torch.bool)
    rows = slice(None) if query is None else slice(*query)
    for key in keys:
        hidden[:, list(heads), rows, slice(*key)] = True
    return hidden


def hide(
    pretrained,
    text: str,
    key: str | Sequence[str],
    *,
    query: str | None = None,
    layers: Iterable[int] | None = None,
    heads: Iterable[int] | None = None,
    table: bool = True,
) -> Hidden:
    """Hide `key` from `query` (from every word if None) in `layers` and `heads` (all by
    default, counted from 0) and measure what changes (see `Hidden`).

    Words are as `explain` takes them ("bank", "bank#2"); a word of several tokens hides,
    and is measured by, all of them; several key words are hidden together. In a decoder a
    word can only hide what comes before it. table=False skips the (L, H) table (`effect`
    is then all NaN) and runs only the model with the key hidden everywhere asked.
    """
    stack = stack_of(pretrained)
    layers, heads = _layers_heads(stack, layers, heads, pretrained.source)
    encoded = pretrained.encode(text)
    keys = [key] if isinstance(key, str) else list(key)
    if not keys:
        raise ValueError("no key word given; name the word to hide")
    key_spans = [word_span(encoded, word, "the key word") for word in keys]
    query_span = None if query is None else word_span(encoded, query, "the query word")
    causal = isinstance(stack, Decoder)
    for word, span in zip(keys, key_spans, strict=True):
        if causal and query_span is not None and span[0] >= query_span[1]:
            raise ValueError(
                f"{pretrained.source} is a decoder: {query!r} (token {query_span[0]}) sees "
                f"only the words before it, and {word!r} (token {span[0]}) comes after; hide "
                "a word that comes earlier"
            )
    ids = torch.tensor([encoded.ids])
    T, H = ids.shape[1], stack.config.block.num_heads
    rows = slice(None) if query_span is None else slice(*query_span)

    def measure(states: Tensor) -> tuple[Tensor, Tensor]:
        """(R, T, C) final vectors -> the change (R,) and distance (R,) of the query."""
        clean = clean_run.states[None]
        if query_span is None:  # every token's change, averaged
            effect, distance = changed(clean, states)
            return effect.mean(-1), distance.mean(-1)
        return changed(clean[:, rows].mean(1), states[:, rows].mean(1))

    position = (T if query_span is None else query_span[1]) - 1  # the next token after it
    L = stack.config.num_layers
    effect = torch.full((L, H), float("nan"), dtype=torch.float64)
    distance, by_head = effect.clone(), effect.clone() if causal else None
    with torch.inference_mode():
        clean_run = run(stack, ids)
        for layer in layers if table else []:
            for part in batches(len(heads), H * T * T):
                chosen = heads[part]
                hidden = torch.cat([hide_mask(T, H, key_spans, query_span, [h]) for h in chosen])
                states = resumed(stack, clean_run, layer, {layer: Edit(hide=hidden)}, len(chosen))
                effect[layer, chosen], distance[layer, chosen] = measure(states)
                if by_head is not None:
                    logprobs = _logits(stack, states[:, position]).double().log_softmax(-1)
                    clean = clean_run.logits[position].double().log_softmax(-1)
                    top = int(clean.argmax())
                    by_head[layer, chosen] = logprobs[:, top] - clean[top]
        everywhere = hide_mask(T, H, key_spans, query_span, heads)
        edits = {layer: Edit(hide=everywhere) for layer in layers}
        states = resumed(stack, clean_run, min(layers), edits, 1)
        total, total_distance = measure(states)
        after = _logits(stack, states[0, position]) if causal else None
    return Hidden(
        source=pretrained.source, text=text, tokens=list(encoded.tokens), key=key,
        query=query, key_spans=key_spans, query_span=query_span, layers=layers, heads=heads,
        states=states[0], clean_states=clean_run.states, effect=effect, distance=distance,
        total=float(total[0]), total_distance=float(total_distance[0]),
        next=None if after is None else next_tokens(
            pretrained.tokenizer, clean_run.logits[position], after, position
        ),
        next_by_head=by_head,
    )  # fmt: skip


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


# ---------------------------------------------------------------------------- senses


@dataclass
class Senses:
    """How far a word's senses lie apart after the last layer, with its context and with
    every other word hidden from it (in every layer and head).

    separation: mean cosine between the word's vectors in sentences of the same sense
    minus that across senses (as `probe`); accuracy: leave-one-out nearest-centroid.
    """

    word: str
    sentences: list[str]
    labels: list[str]
    separation: float
    hidden_separation: float
    accuracy: float
    hidden_accuracy: float

    def to_dict(self) -> dict:
        return vars(self).copy()


def senses_without_context(pretrained, word: str = "bank", sentences=None, labels=None) -> Senses:
    """The sense probe's last layer asked causally: hide every other word of each sentence
    from `word` and see whether its senses still separate. Without sentences, "bank" uses
    the built-in river / money set (`qkv.inspect.bank_sentences`)."""
    from qkv.inspect.probe import _leave_one_out_accuracy, _same_sense, _sentences_and_labels

    sentences, labels = _sentences_and_labels(word, sentences, labels)
    if labels is None:
        raise ValueError("senses need labels: one sense per sentence")
    clean, hidden = [], []
    for sentence in sentences:
        encoded = pretrained.encode(sentence)
        span = word_span(encoded, word, f"sentence {sentence!r}")
        others = [f"{w.text}#{w.occurrence}" for w in encoded.words() if w.token_span != span]
        if not others:
            raise ValueError(f"{sentence!r} has no word but {word!r}: nothing to hide")
        result = hide(pretrained, sentence, others, query=word, table=False)
        clean.append(result.clean_states[slice(*span)].mean(0))
        hidden.append(result.states[slice(*span)].mean(0))
    same = _same_sense(labels) & ~torch.eye(len(labels), dtype=torch.bool)
    across = ~_same_sense(labels)

    def apart(vectors: list[Tensor]) -> tuple[float, float]:
        unit = F.normalize(torch.stack(vectors).double(), dim=-1)
        similarity = unit @ unit.T
        gap = float(similarity[same].mean() - similarity[across].mean())
        return gap, _leave_one_out_accuracy(unit, labels)

    (separation, accuracy), (hidden_separation, hidden_accuracy) = apart(clean), apart(hidden)
    return Senses(word, sentences, labels, separation, hidden_separation, accuracy,
                  hidden_accuracy)  # fmt: skip


# ---------------------------------------------------------------------------- for people


def _next_lines(next: NextTokens | None, what: str) -> list[str]:
    if next is None:
        return []

    def listed(tokens: list[Token]) -> str:
        return ", ".join(f"{t.token!r} {t.logprob:.3g}" for t in tokens)

    return [
        f"next token after position {next.position} (log-probabilities):",
        f"  as the model reads it: {listed(next.before)}",
        f"  {what}: {listed(next.after)}",
        f"  the first one's log-probability changed by {next.top_change:+.3g}",
    ]


def senses_lines(result: Senses) -> str:
    counts = ", ".join(f"{result.labels.count(s)} {s}" for s in dict.fromkeys(result.labels))
    return "\n".join([
        f"'{result.word}' after the last layer, in {len(result.sentences)} sentences ({counts}):",
        f"  with its context:         same sense minus different {result.separation:+.3f}, "
        f"sense accuracy {result.accuracy:.0%}",
        f"  every other word hidden:  same sense minus different "
        f"{result.hidden_separation:+.3f}, sense accuracy {result.hidden_accuracy:.0%}",
        "  (hidden from it in every layer and head: what is left is the word itself, its",
        "  position and the special tokens)",
    ])  # fmt: skip


def hide_lines(result: Hidden, top: int = 10) -> str:
    """The heads that carry the key into the query, largest effect first, and the total."""
    key = result.key if isinstance(result.key, str) else ", ".join(result.key)
    query = f"'{result.query}'" if result.query is not None else "every word"
    lines = [
        f"hiding '{key}' from {query} in {result.source}, in each head alone:",
        f"the change of the final vector of {query} (1 - cosine, and distance)",
        "  layer  head   1-cos     distance",
    ]
    for layer, head, effect in result.ranked()[:top]:
        distance = float(result.distance[layer, head])
        lines.append(f"  {layer:>5}  {head:>4}   {effect:<8.3g}  {distance:.3g}")
    shown = len(result.layers) * len(result.heads)
    if shown > top:
        lines.append(f"  ({shown - top} more heads; --json lists every one)")
    lines.append(
        f"hidden in all {shown} heads at once: 1 - cosine {result.total:.3g}, distance "
        f"{result.total_distance:.3g}"
    )
    return "\n".join(lines + _next_lines(result.next, f"with '{key}' hidden"))


def ablate_lines(result: Ablated, top: int = 10) -> str:
    lines = [
        f"{result.mode}-ablating heads of {result.source}, each alone (mean change of every "
        "token's final vector, 1 - cosine):",
        "  layer  head   1-cos",
    ]
    for layer, head, effect in result.ranked()[:top]:
        lines.append(f"  {layer:>5}  {head:>4}   {effect:.3g}")
    if len(result.heads) > top:
        lines.append(f"  ({len(result.heads) - top} more heads; --json lists every one)")
    lines.append(f"all {len(result.heads)} heads ablated at once: 1 - cosine {result.total:.3g}")
    return "\n".join(lines + _next_lines(result.next, "with them ablated"))


def patch_lines(result: Patched, top: int = 10) -> str:
    restored = result.restored(result.heads)
    cells = sorted(
        ((n, h) for n in range(restored.shape[0]) for h in range(restored.shape[1])),
        key=lambda c: -abs(float(result.heads[c] - result.corrupt)),
    )
    lines = [
        f"metric {result.metric}: clean {result.clean:.4f}, corrupted {result.corrupt:.4f}",
        "head outputs of the clean run patched into the corrupted one, the largest moves:",
        "  layer  head   metric     restored",
    ]
    for n, h in cells[:top]:
        lines.append(f"  {n:>5}  {h:>4}   {float(result.heads[n, h]):+.4f}   "
                     f"{float(restored[n, h]):+.3f}")  # fmt: skip
    residual = result.restored(result.residual)
    lines.append("residual stream patched after each layer, restored (rows: layers; "
                 "columns: positions):")  # fmt: skip
    tokens = result.clean_tokens
    lines.append("         " + " ".join(f"{t[:7]:>7}" for t in tokens))
    for n in range(residual.shape[0]):
        lines.append(f"  {n:>5}  " + " ".join(f"{float(v):+7.2f}" for v in residual[n]))
    return "\n".join(lines)

"""Ask the model "what if": hide a word from another, and the machinery every intervention
shares (ablating heads and patching runs are in `qkv.inspect.ablation`).

The article's claim is causal: "river" gives "bank" its context. `hide` takes "river" away
from "bank" and measures what changes in the final vector of "bank", in each (layer, head)
alone and everywhere at once; `senses_without_context` hides all of a word's context and
asks whether its senses still separate.

Each question is asked of the model itself, through `Edit`s its layers apply in their own
forward pass (`qkv.nn.edit`): a hidden pair joins the layer's mask, so the softmax
renormalizes over the remaining keys exactly as for padding, on whichever backend the
model runs. A table over every (layer, head) reuses one clean forward: each layer's run
resumes from the clean residual stream at that layer, the heads of a layer run side by
side as one batch, one head edited per row, and in a decoder only the positions from the
query word on are computed (the earlier ones never see it; their keys and values come from
the clean run's cache).

Everything runs under `torch.inference_mode` and leaves the model as it was.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from qkv.attention.inputs import check_indices
from qkv.models import Decoder, Encoder, EncoderDecoder
from qkv.nn.attention import KVCache
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
    input (`inputs[l]`, then the last block's output), the final vectors, every layer's head
    outputs (L, H, T, D) and, in a decoder, its keys and values, as the records keep them."""

    ids: Tensor  # (1, T)
    inputs: list[Tensor]  # L + 1 tensors (1, T, C)
    states: Tensor  # (T, C) after the final norm
    head_outputs: Tensor  # (L, H, T, D)
    logits: Tensor | None  # (T, vocab), decoders
    keys: list[Tensor] = field(default_factory=list)  # decoders: L tensors (1, Hkv, T, D)
    values: list[Tensor] = field(default_factory=list)


def run(stack: Encoder | Decoder, ids: Tensor, edits: Edits | None = None) -> Run:
    out = _forward(stack, ids, edits, layers="all", hidden_states=True)
    records = [out.records[n] for n in range(len(stack.blocks))]
    heads = torch.stack([record.out[0] for record in records])
    if not isinstance(stack, Decoder):
        return Run(ids, out.hidden_states, out.hidden[0], heads, None)
    logits = _logits(stack, out.hidden[0])
    keys, values = [r.k for r in records], [r.v for r in records]
    return Run(ids, out.hidden_states, out.hidden[0], heads, logits, keys, values)


def _forward(stack, ids: Tensor, edits: Edits | None, **kwargs):
    if isinstance(stack, Decoder):
        return stack(ids, edits=edits, logits=False, **kwargs)
    return stack(ids, edits=edits, **kwargs)


def _logits(stack: Decoder, hidden: Tensor) -> Tensor:
    return stack.project(hidden).float()


def resumed(stack, clean: Run, layer: int, edits: Edits, rows: int, start: int = 0) -> Tensor:
    """The final vectors (rows, T, C) of `rows` runs from `layer` on, each starting from the
    clean residual stream there, with `edits` (batched: row b's edit in row b).

    start (decoders): the first position an edit can change. A decoder's earlier positions
    never see a later one, so they keep the clean run's vectors, and their keys and values
    come from the clean run's cache: only positions start.. are computed, and the edits'
    masks and vectors cover those positions only (hide: (rows, H, T - start, T)).
    """
    if start == 0:
        ids = clean.ids.expand(rows, -1)
        return _forward(stack, ids, edits, resume=(layer, clean.inputs[layer])).hidden
    assert isinstance(stack, Decoder), "only a decoder's earlier positions are left as they were"
    cache = stack.new_cache()
    for n, (keys, values) in enumerate(zip(clean.keys, clean.values, strict=True)):
        prefix = (t[:, :, :start].expand(rows, -1, -1, -1) for t in (keys, values))
        cache.layers[n] = KVCache.holding(*prefix)
    ids = clean.ids[:, start:].expand(rows, -1)
    x = clean.inputs[layer][:, start:]
    after = stack(ids, edits=edits, resume=(layer, x), cache=cache, logits=False).hidden
    before = clean.states[None, :start].expand(rows, -1, -1)
    return torch.cat([before, after], dim=1)


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
        """(layer, head, effect) of every head asked, largest effect first (none without
        the table)."""
        cells = [(n, h, float(self.effect[n, h])) for n in self.layers for h in self.heads]
        return sorted((c for c in cells if c[2] == c[2]), key=lambda c: -c[2])

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

    def __repr__(self) -> str:
        from qkv.viz.notebook_interventions import hidden_repr

        return hidden_repr(self)

    def _repr_html_(self) -> str:
        """How Jupyter shows it (see qkv.viz.notebook): self-contained, nothing fetched."""
        from qkv.viz.notebook_interventions import hidden_html

        return hidden_html(self)


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
    # a decoder's positions before the first one hiding can change keep their clean vectors
    start = 0
    if causal:
        start = query_span[0] if query_span is not None else min(s for s, _ in key_spans)
    with torch.inference_mode():
        clean_run = run(stack, ids)
        for layer in layers if table else []:
            for part in batches(len(heads), H * (T - start) * T):
                chosen = heads[part]
                hidden = torch.cat([hide_mask(T, H, key_spans, query_span, [h]) for h in chosen])
                edits = {layer: Edit(hide=hidden[:, :, start:])}
                states = resumed(stack, clean_run, layer, edits, len(chosen), start)
                effect[layer, chosen], distance[layer, chosen] = measure(states)
                if by_head is not None:
                    logprobs = _logits(stack, states[:, position]).double().log_softmax(-1)
                    clean = clean_run.logits[position].double().log_softmax(-1)
                    top = int(clean.argmax())
                    by_head[layer, chosen] = logprobs[:, top] - clean[top]
        everywhere = hide_mask(T, H, key_spans, query_span, heads)[:, :, start:]
        edits = {layer: Edit(hide=everywhere) for layer in layers}
        states = resumed(stack, clean_run, min(layers), edits, 1, start)
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

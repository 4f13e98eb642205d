"""Ask the model "what if": hide a word from another.

The article's claim is causal: "river" gives "bank" its context. `hide` takes "river" away
from "bank" and measures what changes in the final vector of "bank", in each (layer, head)
alone and everywhere at once; `senses_without_context` hides all of a word's context and
asks whether its senses still separate.

Each question is asked of the model itself, through `Edit`s its layers apply in their own
forward pass (`qkv.nn.edit`): a hidden pair joins the layer's mask, so the softmax
renormalizes over the remaining keys exactly as for padding, on whichever backend the
model runs. In a linear layer (a running memory, no softmax) a hidden key is not written into
the memory the query reads: its write strength is 0 there, exactly. A table over every
(layer, head) reuses one clean forward and runs the heads of a layer side by side
(`qkv.inspect.runs`).

Everything runs under `torch.inference_mode` and leaves the model as it was.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from qkv.inspect.layer_heads import heads_per_layer
from qkv.inspect.probe import leave_one_out_accuracy, same_sense, sentences_and_labels
from qkv.inspect.runs import (
    NextTokens,
    batches,
    changed,
    decoder_logits,
    grid_dict,
    layers_heads,
    linear_layers,
    next_tokens,
    resumed,
    run,
    stack_of,
    word_span,
)
from qkv.models import Decoder
from qkv.nn.edit import Edit
from qkv.views import Shown


@dataclass(repr=False)
class Hidden(Shown):
    """What changes when a key word is hidden from a query word (or from every word).

    `states` and `clean_states` are every token's final vector (T, C) with the key hidden
    in every (layer, head) asked, and without. `effect` (L, H) is the change of the query
    word's final vector (the mean over its tokens) when the key is hidden in that head
    alone: 1 - cosine; with no query, the mean of that change over every token. NaN where
    not asked, and where a layer has fewer heads (H: the most any layer has). `distance` is
    the same as a Euclidean distance; `total` and `total_distance` the change with the key
    hidden everywhere asked at once.
    """

    view: ClassVar[str] = "hidden"  # drawn by qkv.viz.notebook_interventions

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
    layers, heads = layers_heads(stack, layers, heads, pretrained.source)
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
    T, counts = ids.shape[1], heads_per_layer(stack)  # each layer's own number of heads
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
    effect = torch.full((L, max(counts)), float("nan"), dtype=torch.float64)
    distance, by_head = effect.clone(), effect.clone() if causal else None
    # a decoder's positions before the first one hiding can change keep their clean vectors
    start = 0
    if causal:
        start = query_span[0] if query_span is not None else min(s for s, _ in key_spans)
    linear = set(linear_layers(stack)) & set(layers)
    if linear:  # a memory after the prefix holds every key written there: start at the keys
        start = min(s for s, _ in key_spans)

    def edit(layer: int, hidden: Tensor) -> Edit:
        """hidden (rows, H, T - start, T): a linear layer's memory continues from the prefix's,
        which no key of the prefix is hidden from, so it reads the new tokens' columns only."""
        return Edit(hide=hidden[:, :, :, start:] if layer in linear else hidden)

    with torch.inference_mode():
        clean_run = run(stack, ids)
        for layer in layers if table else []:
            H, own = counts[layer], [h for h in heads if h < counts[layer]]
            for part in batches(len(own), H * (T - start) * T):
                chosen = own[part]
                hidden = torch.cat([hide_mask(T, H, key_spans, query_span, [h]) for h in chosen])
                edits = {layer: edit(layer, hidden[:, :, start:])}
                states = resumed(stack, clean_run, layer, edits, len(chosen), start)
                effect[layer, chosen], distance[layer, chosen] = measure(states)
                if by_head is not None:
                    logprobs = decoder_logits(stack, states[:, position]).double().log_softmax(-1)
                    clean = clean_run.logits[position].double().log_softmax(-1)
                    top = int(clean.argmax())
                    by_head[layer, chosen] = logprobs[:, top] - clean[top]
        edits = {layer: edit(layer, hide_mask(
            T, counts[layer], key_spans, query_span, [h for h in heads if h < counts[layer]]
        )[:, :, start:]) for layer in layers}  # fmt: skip
        states = resumed(stack, clean_run, min(layers), edits, 1, start)
        total, total_distance = measure(states)
        after = decoder_logits(stack, states[0, position]) if causal else None
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
    sentences, labels = sentences_and_labels(word, sentences, labels)
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
    same = same_sense(labels) & ~torch.eye(len(labels), dtype=torch.bool)
    across = ~same_sense(labels)

    def apart(vectors: list[Tensor]) -> tuple[float, float]:
        unit = F.normalize(torch.stack(vectors).double(), dim=-1)
        similarity = unit @ unit.T
        gap = float(similarity[same].mean() - similarity[across].mean())
        return gap, leave_one_out_accuracy(unit, labels)

    (separation, accuracy), (hidden_separation, hidden_accuracy) = apart(clean), apart(hidden)
    return Senses(word, sentences, labels, separation, hidden_separation, accuracy,
                  hidden_accuracy)  # fmt: skip

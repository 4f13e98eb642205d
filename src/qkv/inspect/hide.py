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

A question can be asked of many prompts at once (a list, or a file of them): they run in
padded batches, each read at its own tokens, and the result holds each prompt's answer, the
mean and a bootstrap 95% interval (`qkv.inspect.prompts.Spread`). compare=False runs one
knockout alone: one forward pass, without the clean run a comparison needs.

Everything runs under `torch.inference_mode` and leaves the model as it was.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from qkv.inspect.hide_scale import OtherWord, other_words
from qkv.inspect.layer_heads import heads_per_layer
from qkv.inspect.probe import leave_one_out_accuracy, same_sense, sentences_and_labels
from qkv.inspect.prompts import Spread
from qkv.inspect.runs import (
    NextTokens,
    Rows,
    Token,
    batches,
    changed,
    decoder_logits,
    encoded_prompts,
    forward_rows,
    grid_dict,
    layers_heads,
    linear_layers,
    next_tokens,
    number,
    padded_ids,
    prompt_groups,
    prompt_name,
    resumed_rows,
    run_rows,
    spreads_dict,
    spreads_of,
    stack_of,
    top_tokens,
    word_span,
)
from qkv.models import Decoder
from qkv.nn.edit import Edit
from qkv.views import Shown


@dataclass(repr=False)
class Hidden(Shown):
    """What changes when a key word is hidden from a query word (or from every word), in one
    prompt or in each of several (the mean over them, with a bootstrap 95% interval).

    `states` and `clean_states` are the first prompt's final vectors (T, C) with the key
    hidden in every (layer, head) asked, and without. `effect` (L, H) is the change of the
    query word's final vector (the mean over its tokens) when the key is hidden in that head
    alone: 1 - cosine; with no query, the mean of that change over every token; over several
    prompts, the mean over them. NaN where not asked, and where a layer has fewer heads (H:
    the most any layer has). `distance` is the same as a Euclidean distance; `total` and
    `total_distance` the change with the key hidden everywhere asked at once. `spreads` holds,
    by those names, each prompt's values, their mean and interval (`qkv.inspect.prompts.Spread`).

    compare=False (one knockout, no clean run): `clean_states` is None, `effect`, `total` and
    the rest are NaN, `spreads` is empty and `next` is None; `after` still holds the changed
    run's next tokens.
    """

    view: ClassVar[str] = "hidden"  # drawn by qkv.viz.notebook_interventions

    source: str
    text: str  # the first prompt
    tokens: list[str]  # its tokens
    key: str | list[str]
    query: str | None
    key_spans: list[tuple[int, int]]  # the first prompt's span of each key word [start, end)
    query_span: tuple[int, int] | None
    layers: list[int]  # the layers and heads the key was hidden in
    heads: list[int]
    states: Tensor  # (T, C)
    clean_states: Tensor | None  # (T, C); None without the comparison
    effect: Tensor  # (L, H) float64
    distance: Tensor  # (L, H) float64
    total: float
    total_distance: float
    # decoders: the next token after the query word (after the last token without a query)
    next: NextTokens | None = None
    next_by_head: Tensor | None = None  # (L, H): the change of the clean top token's log-prob
    texts: list[str] = field(default_factory=list)  # every prompt
    # per-prompt values, mean and interval of effect, distance, total, total_distance,
    # next_by_head and top_change (the first next token's change)
    spreads: dict[str, Spread] = field(default_factory=dict)
    after: list[Token] | None = None  # decoders: the first prompt's next tokens, key hidden
    # the scale (with the table): each other word of the first prompt hidden instead, at once
    others: list[OtherWord] = field(default_factory=list)
    others_of: int = 0  # how many other words the text has (others: at most hide_scale.MOST)

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
            "texts": self.texts,
            "tokens": self.tokens,
            "key": self.key,
            "query": self.query,
            "key_spans": [list(span) for span in self.key_spans],
            "query_span": None if self.query_span is None else list(self.query_span),
            "layers": self.layers,
            "heads": self.heads,
            "effect": grid_dict(self.effect),
            "distance": grid_dict(self.distance),
            "total": number(self.total),
            "total_distance": number(self.total_distance),
            "ranked": [{"layer": n, "head": h, "effect": e} for n, h, e in self.ranked()],
            "next": None if self.next is None else self.next.to_dict(),
            "next_by_head": None if self.next_by_head is None else grid_dict(self.next_by_head),
            "after": None if self.after is None else [vars(t) for t in self.after],
            "others": [vars(w) for w in self.others],
            "others_of": self.others_of,
            # several prompts: each one's values, their mean and interval
            **({"spreads": spreads_dict(self.spreads)} if len(self.texts) > 1 else {}),
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
    chosen = slice(None) if list(heads) == list(range(H)) else list(heads)  # a slice is cheaper
    for key in keys:
        hidden[:, chosen, rows, slice(*key)] = True
    return hidden


@dataclass
class _Prompt:
    """One prompt's words: its length, the key words' spans and the query's."""

    length: int
    keys: list[tuple[int, int]]
    query: tuple[int, int] | None

    @property
    def rows(self) -> slice:
        """The positions measured: the query's tokens, or every real token."""
        return slice(0, self.length) if self.query is None else slice(*self.query)

    @property
    def position(self) -> int:
        """The position whose next token a decoder predicts: the query's last, or the last."""
        return (self.length if self.query is None else self.query[1]) - 1


def hide(
    pretrained,
    text: str | Sequence[str] | Path,
    key: str | Sequence[str],
    *,
    query: str | None = None,
    layers: Iterable[int] | None = None,
    heads: Iterable[int] | None = None,
    table: bool = True,
    compare: bool = True,
    scale: bool | None = None,
) -> Hidden:
    """Hide `key` from `query` (from every word if None) in `layers` and `heads` (all by
    default, counted from 0) and measure what changes (see `Hidden`).

    text: one text, a list of texts, or a file (`Path`: text lines, TSV or JSONL, as
    `qkv.inspect.prompts.texts_of` reads it), run in padded batches; every prompt must hold
    the words. Words are as `explain` takes them ("bank", "bank#2"); a word of several tokens
    hides, and is measured by, all of them; several key words are hidden together. In a
    decoder a word can only hide what comes before it. table=False skips the (L, H) table
    (`effect` is then all NaN) and runs only the model with the key hidden everywhere asked.
    compare=False (with table=False) skips the clean run too: one forward pass, the result
    without any before/after comparison. scale (default: with the table): also hide each other
    word instead, for one prompt (`Hidden.others`, `qkv.inspect.hide_scale`).
    """
    if not compare and table:
        raise ValueError("the table compares each head with the clean run: compare=False "
                         "needs table=False")  # fmt: skip
    stack = stack_of(pretrained)
    layers, heads = layers_heads(stack, layers, heads, pretrained.source)
    texts, encoded = encoded_prompts(pretrained, text)
    keys = [key] if isinstance(key, str) else list(key)
    if not keys:
        raise ValueError("no key word given; name the word to hide")
    causal = isinstance(stack, Decoder)
    prompts = [_words(pretrained, e, keys, query, causal, n, texts) for n, e in enumerate(encoded)]
    N, L, counts = len(texts), stack.config.num_layers, heads_per_layer(stack)
    linear = set(linear_layers(stack)) & set(layers)
    nan = torch.full((N, L, max(counts)), float("nan"), dtype=torch.float64)
    effect, distance, by_head = nan.clone(), nan.clone(), nan.clone()
    total, total_distance, top_change = (torch.full((N,), float("nan"), dtype=torch.float64)
                                         for _ in range(3))  # fmt: skip
    tokenizer = pretrained.tokenizer
    first: dict = {}  # the first prompt's states, clean states and next tokens

    with torch.inference_mode():
        for group in prompt_groups(stack, [p.length for p in prompts]):
            chosen = [prompts[p] for p in group]
            ids, mask = padded_ids(pretrained, stack, [encoded[p].ids for p in group])
            batch = _Batch(stack, chosen, ids.shape[1], counts, heads, linear, compare)
            everywhere = batch.everywhere(layers)
            if not compare:  # one forward pass from the embeddings, the key hidden everywhere
                states = forward_rows(stack, ids, mask, everywhere).hidden
                _keep(first, group, states, batch, tokenizer)
                continue
            batch.clean_run(ids, mask)
            for layer in layers if table else []:
                own = [h for h in heads if h < counts[layer]]
                cells = [(row, h) for row in range(len(group)) for h in own]
                for part in batches(len(cells), batch.per_row(layer)):
                    rows, head_index = [r for r, _ in cells[part]], [h for _, h in cells[part]]
                    hidden = torch.cat([batch.masks(layer, [r], h) for r, h in cells[part]])
                    states = batch.resumed(layer, {layer: batch.edit(layer, hidden)}, rows)
                    prompt_index = [group[r] for r in rows]
                    change, far = batch.measure(rows, states)
                    effect[prompt_index, layer, head_index] = change
                    distance[prompt_index, layer, head_index] = far
                    if causal:
                        by_head[prompt_index, layer, head_index] = batch.moved(rows, states)
            every = list(range(len(group)))
            states = batch.resumed(min(layers), everywhere, every)
            total[group], total_distance[group] = batch.measure(every, states)
            if causal:
                top_change[group] = batch.moved(every, states)
            _keep(first, group, states, batch, tokenizer)
    spreads = {}
    if compare:
        found = {"effect": effect, "distance": distance, "total": total,
                 "total_distance": total_distance}  # fmt: skip
        if causal:
            found |= {"next_by_head": by_head, "top_change": top_change}
        spreads = spreads_of(found)
    nan_grid = nan[0]
    one = prompts[0]
    others, others_of = [], 0  # the scale: asked of the first prompt, with the table
    if (table if scale is None else scale) and compare and len(texts) == 1:

        def total_of(word: str) -> float:  # that word hidden instead, in the same heads
            return hide(pretrained, encoded[0].text, word, query=query, layers=layers,
                        heads=heads, table=False).total  # fmt: skip

        others, others_of = other_words(encoded[0], one.keys, one.query, causal, total_of)
    return Hidden(
        source=pretrained.source, text=texts[0], tokens=list(encoded[0].tokens), key=key,
        query=query, key_spans=one.keys, query_span=one.query, layers=layers, heads=heads,
        states=first["states"], clean_states=first["clean"],
        effect=spreads["effect"].mean if compare else nan_grid,
        distance=spreads["distance"].mean if compare else nan_grid.clone(),
        total=float(spreads["total"].mean) if compare else float("nan"),
        total_distance=float(spreads["total_distance"].mean) if compare else float("nan"),
        next=first.get("next"),
        next_by_head=spreads["next_by_head"].mean if compare and causal else None,
        texts=texts, spreads=spreads, after=first.get("after"), others=others,
        others_of=others_of,
    )  # fmt: skip


def _words(pretrained, encoded, keys, query, causal: bool, n: int, texts) -> _Prompt:
    """Prompt n's key and query spans, each word refused by the prompt's name if missing."""
    where = "" if len(texts) == 1 else f"{prompt_name(n, texts[n])}: "
    key_spans = [word_span(encoded, word, f"{where}the key word") for word in keys]
    query_span = None if query is None else word_span(encoded, query, f"{where}the query word")
    for word, span in zip(keys, key_spans, strict=True):
        if causal and query_span is not None and span[0] >= query_span[1]:
            raise ValueError(
                f"{where}{pretrained.source} is a decoder: {query!r} (token {query_span[0]}) "
                f"sees only the words before it, and {word!r} (token {span[0]}) comes after; "
                "hide a word that comes earlier"
            )
    return _Prompt(len(encoded.ids), key_spans, query_span)


class _Batch:
    """One padded batch of prompts (rows), its clean run and the masks that hide its words."""

    def __init__(self, stack, prompts: list[_Prompt], T: int, counts, heads, linear, compare):
        self.stack, self.prompts, self.T, self.counts, self.heads = stack, prompts, T, counts, heads
        self.linear, self.causal = linear, isinstance(stack, Decoder)
        self.clean: Rows | None = None
        self.clean_logprobs: Tensor | None = None  # decoders: (B, vocab) at each position
        # a decoder's positions before the first one hiding can change keep their clean
        # vectors; a linear layer's memory holds every key written before: start at the keys
        self.start = 0
        if self.causal and compare:
            firsts = [p.query[0] if p.query is not None else min(s for s, _ in p.keys)
                      for p in prompts]  # fmt: skip
            keys = [s for p in prompts for s, _ in p.keys] if linear else []
            self.start = min(firsts + keys)

    def masks(self, layer: int, rows: Iterable[int], one: int | None = None) -> Tensor:
        """(R, H, T - start, T): row r's key words hidden from its query in head `one`
        alone, or in every head asked."""
        H = self.counts[layer]
        own = [one] if one is not None else [h for h in self.heads if h < H]
        found = [hide_mask(self.T, H, self.prompts[r].keys, self.prompts[r].query, own)
                 for r in rows]  # fmt: skip
        every = len(own) == H  # the same pairs in every head: one mask, broadcast (R, 1, ...)
        return torch.cat(found)[:, : 1 if every else H, self.start :]

    def everywhere(self, layers: list[int]) -> dict[int, Edit]:
        """Each layer's edit hiding the rows' key words in every head asked. Layers alike (as
        many heads, both softmax or both linear) hide the same pairs: one edit serves them,
        built once (30 masks built one by one cost a knockout 5% of its forward pass)."""
        rows, made = range(len(self.prompts)), {}
        for n in layers:
            alike = (self.counts[n], n in self.linear)
            if alike not in made:
                made[alike] = self.edit(n, self.masks(n, rows))
        return {n: made[self.counts[n], n in self.linear] for n in layers}

    def edit(self, layer: int, hidden: Tensor) -> Edit:
        """hidden (R, H, T - start, T): a linear layer's memory continues from the prefix's,
        which no key of the prefix is hidden from, so it reads the new tokens' columns only."""
        return Edit(hide=hidden[:, :, :, self.start :] if layer in self.linear else hidden)

    def per_row(self, layer: int) -> int:
        """What one row of a table's run holds: its mask, and a few vectors per token."""
        T, C = self.T, self.stack.config.block.width
        return self.counts[layer] * (T - self.start) * T + 4 * T * C

    def clean_run(self, ids: Tensor, mask: Tensor | None) -> None:
        lengths = [p.length for p in self.prompts]
        self.clean = run_rows(self.stack, ids, mask, lengths, records=True)
        if self.causal:
            at = torch.tensor([p.position for p in self.prompts])
            logits = decoder_logits(self.stack, self.clean.states[range(len(lengths)), at])
            self.clean_logprobs = logits.double().log_softmax(-1)  # (B, vocab)

    def resumed(self, layer: int, edits, rows: list[int]) -> Tensor:
        """(R, T, C): the rows' runs from `layer` on with `edits` (row r's in row r)."""
        assert self.clean is not None
        index = torch.tensor(rows)
        return resumed_rows(self.stack, self.clean, layer, edits, index, self.start)

    def measure(self, rows: list[int], states: Tensor) -> tuple[Tensor, Tensor]:
        """(R, T, C) final vectors of the rows' prompts -> the change and distance (R,) of
        each one's query (of each real token, averaged, with no query)."""
        assert self.clean is not None
        found = []
        for r, row in enumerate(rows):
            prompt = self.prompts[row]
            before, after = self.clean.states[row, prompt.rows], states[r, prompt.rows]  # (t, C)
            if prompt.query is None:
                found.append([v.mean() for v in changed(before, after)])
            else:
                found.append(list(changed(before.mean(0), after.mean(0))))
        change, far = torch.tensor(found, dtype=torch.float64).reshape(len(rows), 2).unbind(1)
        return change, far

    def moved(self, rows: list[int], states: Tensor) -> Tensor:
        """The change (R,) of each row's clean top next token's log-probability."""
        assert self.clean_logprobs is not None
        at = torch.tensor([self.prompts[row].position for row in rows])
        logits = decoder_logits(self.stack, states[range(len(rows)), at])
        logprobs = logits.double().log_softmax(-1)  # (R, vocab)
        clean = self.clean_logprobs[rows]  # (R, vocab)
        top = clean.argmax(-1, keepdim=True)  # (R, 1)
        return (logprobs.gather(-1, top) - clean.gather(-1, top))[:, 0]


def _keep(first: dict, group: list[int], states: Tensor, batch: _Batch, tokenizer) -> None:
    """The first prompt's vectors and next tokens, from the batch that holds it."""
    if 0 not in group:
        return
    row = group.index(0)
    prompt = batch.prompts[row]
    first["states"] = states[row, : prompt.length].clone()
    clean = batch.clean
    first["clean"] = None if clean is None else clean.states[row, : prompt.length].clone()
    if batch.causal:
        after = decoder_logits(batch.stack, states[row, prompt.position])
        first["after"] = top_tokens(tokenizer, after.double().log_softmax(-1))
        if batch.clean_logprobs is not None:
            first["next"] = next_tokens(tokenizer, batch.clean_logprobs[row], after,
                                        prompt.position)  # fmt: skip


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

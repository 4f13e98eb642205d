"""The sense probe: how context pulls apart the two senses of one word, layer by layer.

The article's example is "bank": by a river or where money is kept. Before any attention
(the embeddings) every "bank" is the same token, so its vectors in different sentences are
nearly equal (below 1 only where the model adds each token's position there: the word sits
at different positions, and no other word reaches it yet); each layer adds context from the
other words, and a model that understands the sentences moves the river banks and the money
banks apart. `probe` runs a real model over sentences that use the word, takes the word's
vector at every depth (the mean over its tokens), and measures how similar the word is to
itself across sentences: a cosine matrix per depth, and, given each sentence's sense, how
well the senses separate (`MEASURES` names and defines each measure for every view).

>>> import qkv
>>> result = probe(qkv.load("minilm"), "bank")  # the embedded labelled "bank" sentences
>>> result.similarity.shape  # (L+1, N, N): the embeddings, then layers 0..5
torch.Size([7, 16, 16])
>>> result.layers[0], result.layers[-1]
('embeddings', 'layer 5')
>>> result.separation[-1] > result.separation[0]  # context separates the senses
True
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from qkv.data import bank_corpus
from qkv.inspect.bank_sentences import LABELS, SENTENCES
from qkv.inspect.layer_heads import heads_per_layer, nan_grid
from qkv.inspect.words import on_words
from qkv.io.words import parse_word
from qkv.models import Decoder, self_attention_stack
from qkv.views import Shown

# The probe's measures: one name each, and what it means, for every view (CLI, PNG, notebook).
MEASURES = {
    "mean cosine": "the mean cosine similarity of the word's vectors in two different sentences",
    "separation": "the mean cosine between sentences of the same sense minus the mean between "
    "sentences of different senses (above 0: the senses stand apart)",
    "accuracy": "the share of sentences whose sense is the nearest sense centroid's, each "
    "sentence left out of the centroids it is told by (leave-one-out)",
}


@dataclass(repr=False)
class Probe(Shown):
    """The vectors of one word across sentences, at the embeddings and after every layer.

    Depth d is `layers[d]`: depth 0 is the embeddings (before any attention), depth i + 1
    the output of layer i (layers count from 0).
    """

    view: ClassVar[str] = "probe"  # drawn by qkv.viz.notebook

    word: str  # as asked, e.g. "bank" or "bank#2"
    sentences: list[str]
    labels: list[str] | None  # the sense of the word in each sentence, if given
    layers: list[str]  # ["embeddings", "layer 0", ..., "layer L-1"]
    similarity: Tensor  # (L+1, N, N) cosine of the word's vectors in sentences i and j
    vectors: Tensor  # (L+1, N, C) the word's vector in each sentence (mean over its tokens)
    accuracy: list[float] | None  # with labels: leave-one-out nearest-centroid accuracy
    separation: list[float] | None  # with labels: mean within-sense minus across-sense cosine
    cues: list[str] | None = None  # the word that tells the sense in each sentence, if given
    # with cues: (L, H) the share of sentences in which the word attends most to its cue
    cue_attention: Tensor | None = None

    @property
    def cue_head(self) -> tuple[int, int, float] | None:
        """(layer, head, share) of the head in which the word attends most to its cue most
        often; None without cues."""
        if self.cue_attention is None:
            return None
        best = int(self.cue_attention.nan_to_num(-1.0).argmax())  # NaN: a head a layer lacks
        layer, head = divmod(best, self.cue_attention.shape[1])
        return layer, head, float(self.cue_attention[layer, head])

    def to_dict(self) -> dict:
        """JSON-ready: lists of floats, no tensors (see docs/probe.md). `vectors` is left out:
        it is large, and the similarity matrices are what it is for."""
        return {
            "word": self.word,
            "sentences": list(self.sentences),
            "labels": None if self.labels is None else list(self.labels),
            "layers": list(self.layers),
            "similarity": self.similarity.tolist(),
            "accuracy": self.accuracy,
            "separation": self.separation,
            "cues": None if self.cues is None else list(self.cues),
            "cue_attention": None
            if self.cue_attention is None
            else [[None if v != v else v for v in row] for row in self.cue_attention.tolist()],
            "cue_head": None
            if self.cue_head is None
            else dict(zip(("layer", "head", "share"), self.cue_head, strict=True)),
        }


def probe(
    pretrained,
    word: str,
    sentences: Sequence[str] | None = None,
    labels: Sequence[str] | None = None,
    *,
    cues: Sequence[str] | None = None,
    batch_size: int = 32,
) -> Probe:
    """Compare `word`'s vector across sentences at every depth of `pretrained`'s model.

    sentences: texts that each contain the word ("bank#2" names its second occurrence);
    None for "bank" uses the embedded labelled set (`qkv.inspect.bank_sentences`).
    labels: the word's sense in each sentence (any strings, e.g. "river" and "money"); with
    them the probe also reports, per depth, `separation` (mean cosine between sentences of
    the same sense minus mean cosine between sentences of different senses) and `accuracy`
    (each sentence's sense predicted by the nearest sense centroid, by cosine, with the
    centroids, means of unit vectors, computed without that sentence). Each sense needs
    2 sentences at least. Returns similarity (L+1, N, N) and vectors (L+1, N, C), float32.
    cues: the word that tells the sense in each sentence; with them the probe also reports,
    for every layer and head, the share of sentences in which the word's attention (the mean
    row of its tokens) is largest on a token of the cue, every token of the sentence counted.
    A model trained with qkv on the bank corpus probes its held-out sentences by default.
    """
    # an encoder-decoder's encoder: it reads the whole sentence at once
    model = self_attention_stack(pretrained.model, "the probe", pretrained.source)
    if not isinstance(word, str) or not word.strip():
        raise ValueError("the word to probe is empty; give a word such as 'bank'")
    parse_word(word)  # the "bank#2" form, checked where it is defined: "bank#0" is refused
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an integer >= 1, got {batch_size!r}")
    if sentences is None and cues is None:
        sentences, labels, cues = _run_sentences(pretrained, word, labels)
    sentences, labels = sentences_and_labels(word, sentences, labels)
    spans = _spans(pretrained, word, sentences)
    cue_spans = _cue_spans(pretrained, sentences, cues) if cues is not None else None

    L = len(model.blocks)
    layers = "all" if cues else None  # the cue attention reads every layer's record
    # sentences in which the word attends most to its cue; NaN where a layer has fewer heads
    hits = nan_grid(heads_per_layer(model), torch.float32)
    depths: list[list[Tensor]] = [[] for _ in range(L + 1)]  # per depth, (C,) per sentence
    with torch.inference_mode():
        for start in range(0, len(sentences), batch_size):
            rows = sentences[start : start + batch_size]
            # Right padding keeps each sentence's tokens at the positions `encode` gave them.
            ids, mask = pretrained.tokenizer.encode_batch(rows, padding_side="right")  # (B, T)
            extra = {"logits": False} if isinstance(model, Decoder) else {}
            out = model(ids, attention_mask=mask, hidden_states=True, layers=layers, **extra)
            states = out.hidden_states
            for layer, record in out.records.items():
                weights = on_words(record)  # (B, H, T, T)
                for b, (first, last) in enumerate(spans[start : start + batch_size]):
                    cue_first, cue_last = cue_spans[start + b]
                    top = weights[b, :, first:last].float().mean(1).argmax(-1)  # (H,)
                    hits[layer, : len(top)] += (cue_first <= top) & (top < cue_last)
            assert len(states) == L + 1, "a model must return the embeddings and every layer"
            for depth, hidden in enumerate(states):  # hidden: (B, T, C)
                for b, (first, last) in enumerate(spans[start : start + batch_size]):
                    depths[depth].append(hidden[b, first:last].float().mean(0))  # (C,)
    vectors = torch.stack([torch.stack(row) for row in depths])  # (L+1, N, C)
    unit = torch.nn.functional.normalize(vectors, dim=-1)
    similarity = unit @ unit.transpose(-1, -2)  # (L+1, N, N)

    accuracy = separation = None
    if labels is not None:
        accuracy = [leave_one_out_accuracy(unit[d], labels) for d in range(L + 1)]
        separation = [_separation(similarity[d], labels) for d in range(L + 1)]
    return Probe(
        word=word,
        sentences=sentences,
        labels=labels,
        layers=["embeddings", *(f"layer {i}" for i in range(L))],
        similarity=similarity,
        vectors=vectors,
        accuracy=accuracy,
        separation=separation,
        cues=None if cues is None else list(cues),
        cue_attention=None if cues is None else hits / len(sentences),
    )


def _run_sentences(pretrained, word: str, labels):
    """A bank-corpus training run's held-out sentences, senses and cues; else (None,) * 3."""
    run = getattr(pretrained, "run", None)
    if run is None or run.data.kind != "bank" or word.casefold() != "bank" or labels is not None:
        return None, labels, None
    heldout = bank_corpus(run.data.heldout, split="heldout", seed=run.train.seed)
    return [s.text for s in heldout], [s.sense for s in heldout], [s.cue for s in heldout]


def _cue_spans(pretrained, sentences: list[str], cues: Sequence[str]) -> list[tuple[int, int]]:
    """The cue's token span [first, last) in each sentence."""
    if isinstance(cues, str) or len(cues) != len(sentences):
        raise ValueError("cues must be a list with one word per sentence")
    spans = []
    for i, (sentence, cue) in enumerate(zip(sentences, cues, strict=True)):
        try:
            spans.append(pretrained.tokenizer.encode(sentence).find(cue))
        except ValueError as error:
            raise ValueError(f"sentence {i} ({sentence!r}), cue: {error}") from None
    return spans


def sentences_and_labels(
    word: str, sentences: Sequence[str] | None, labels: Sequence[str] | None
) -> tuple[list[str], list[str] | None]:
    """Check the inputs (or pick the default "bank" set); return them as lists."""
    if sentences is None:
        if word.casefold() not in ("bank", "bank#1"):
            raise ValueError(
                f"no sentences given for {word!r}; pass sentences that use it (only 'bank' "
                "has a built-in set)"
            )
        if labels is not None:
            raise ValueError("labels were given without sentences; pass the sentences they label")
        sentences, labels = SENTENCES, LABELS
    if isinstance(sentences, str):
        raise ValueError("sentences must be a list of texts, not one str; wrap it in a list")
    sentences = list(sentences)
    if len(sentences) < 2:
        raise ValueError(f"a probe compares sentences: give at least 2, got {len(sentences)}")
    for i, sentence in enumerate(sentences):
        if not isinstance(sentence, str):
            raise ValueError(f"sentence {i} is a {type(sentence).__name__}, not a str")
    if labels is None:
        return sentences, None
    if isinstance(labels, str):
        raise ValueError("labels must be a list with one sense per sentence, not one str")
    labels = list(labels)
    if len(labels) != len(sentences):
        raise ValueError(
            f"{len(labels)} labels for {len(sentences)} sentences; give one sense per sentence"
        )
    for i, label in enumerate(labels):
        if not isinstance(label, str) or not label:
            raise ValueError(f"label {i} is {label!r}; labels must be non-empty strings")
    counts = {label: labels.count(label) for label in dict.fromkeys(labels)}
    if len(counts) < 2:
        raise ValueError(
            f"every label is {labels[0]!r}; give at least two senses to compare, or no labels"
        )
    lonely = [label for label, n in counts.items() if n < 2]
    if lonely:
        raise ValueError(
            f"sense {lonely[0]!r} has only one sentence; leave-one-out accuracy needs at "
            "least 2 sentences of each sense"
        )
    return sentences, labels


def _spans(pretrained, word: str, sentences: list[str]) -> list[tuple[int, int]]:
    """The word's token span [first, last) in each sentence, as the model will read it."""
    limit = pretrained.context_window
    spans = []
    for i, sentence in enumerate(sentences):
        encoded = pretrained.tokenizer.encode(sentence)
        try:
            spans.append(encoded.find(word))
        except ValueError as error:
            raise ValueError(f"sentence {i} ({sentence!r}): {error}") from None
        if len(encoded) > limit:
            raise ValueError(
                f"sentence {i} has {len(encoded)} tokens; {pretrained.source} reads at most {limit}"
            )
    return spans


def _separation(similarity: Tensor, labels: list[str]) -> float:
    """Mean cosine over pairs of different sentences with the same sense, minus the mean
    over pairs with different senses. similarity: (N, N)."""
    same = same_sense(labels)  # (N, N)
    different_sentence = ~torch.eye(len(labels), dtype=torch.bool)
    within = similarity[same & different_sentence].mean()
    across = similarity[~same].mean()
    return float(within - across)


def leave_one_out_accuracy(unit: Tensor, labels: list[str]) -> float:
    """The fraction of sentences whose sense is that of the nearest centroid (by cosine),
    each sentence left out of the centroids it is compared with. unit: (N, C), norm 1.

    >>> unit = torch.tensor([[1.0, 0.0], [0.9, 0.1], [0.0, 1.0], [0.1, 0.9]])
    >>> leave_one_out_accuracy(unit, ["a", "a", "b", "b"])
    1.0
    """
    senses = list(dict.fromkeys(labels))
    sense_of = torch.tensor([senses.index(label) for label in labels])  # (N,)
    one_hot = torch.nn.functional.one_hot(sense_of, len(senses)).to(unit.dtype)  # (N, S)
    sums = one_hot.T @ unit  # (S, C) sum of each sense's vectors
    counts = one_hot.sum(0)  # (S,)
    # Without sentence n: its own sense's sum loses its vector and its count loses one.
    others = sums[None] - one_hot[:, :, None] * unit[:, None]  # (N, S, C)
    centroids = others / (counts[None] - one_hot)[..., None]  # (N, S, C)
    cosines = torch.nn.functional.cosine_similarity(unit[:, None], centroids, dim=-1)  # (N, S)
    return float((cosines.argmax(-1) == sense_of).float().mean())


def same_sense(labels: list[str]) -> Tensor:
    """(N, N) booleans: True where sentences i and j have the same sense."""
    return torch.tensor([[a == b for b in labels] for a in labels])  # (N, N)

"""A guided tour of the article on a real model: its sections in order, each a step with the
model's own numbers for the learner's sentence.

`tour(pretrained, text)` runs the model once with every layer's record and reads each step
from the library's own functions, never a second way of computing the same thing: the trace
(`qkv.inspect.trace`, the `loop` backend on the layer's own q, k, v) for the seven steps,
its pairs for the softmax with and without dividing by sqrt(D), the record's head outputs
for the concatenation and the output projection, the probe (`qkv.inspect.probe`) for the
word's vector layer by layer and the two senses of "bank", and the interventions
(`qkv.hide`, `qkv.ablate`) for the experiments beside each step (`qkv.inspect.tour_experiments`).

The steps' ids are the diagram's (`qkv.inspect.diagram.STEPS`): tokens, embeddings, qkv,
scaling, heads, layers, cross, training, parallel. Only the parallel step shows a time, taken
on the spot with time.perf_counter; nothing asserts it.

>>> import qkv
>>> t = tour(qkv.load("minilm"), "The bank on the side of the river")
>>> [s.id for s in t.steps][:3], (t.query, t.key)
(['tokens', 'embeddings', 'qkv'], ('bank', 'river'))
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from qkv.inspect.article import SENTENCE
from qkv.inspect.diagram import Diagram, model_diagram
from qkv.inspect.probe import probe
from qkv.inspect.runs import stack_of
from qkv.inspect.tour_boxes import box_values
from qkv.inspect.tour_experiments import experiments
from qkv.inspect.tour_steps import (
    Step,
    cross_step,
    embeddings_step,
    heads_step,
    layers_step,
    parallel_step,
    qkv_step,
    scaling_step,
    tokens_step,
    training_step,
    why_scalar,
)
from qkv.inspect.trace import trace
from qkv.models import EncoderDecoder
from qkv.views import Shown

# the steps in the article's order (the diagram's ids)
STEPS = ("tokens", "embeddings", "qkv", "scaling", "heads", "layers", "cross", "training",
         "parallel")  # fmt: skip
DEFAULT_PAIR = ("bank", "river")  # the article's pair, in its sentence (qkv.inspect.article)


@dataclass(frozen=True, repr=False)
class Tour(Shown):
    """The article's sections for one text, on one model, at one (query, key) pair, layer and
    head (counted from 0). In a notebook it shows itself as its page (qkv.viz.notebook_tour)."""

    view: ClassVar[str] = "tour"

    source: str
    text: str
    tokens: tuple[str, ...]
    query: str
    key: str
    query_index: int
    key_index: int
    layer: int
    head: int
    chosen: str  # why this layer and head ("asked", or where the query attends most to the key)
    num_layers: int
    num_heads: int
    steps: tuple[Step, ...] = field(default_factory=tuple)
    # the model drawn from its config (qkv.inspect.diagram), None where it cannot be drawn
    # (diagram_note says why); boxes: each box's real tensor for this text (tour_boxes)
    diagram: Diagram | None = None
    diagram_note: str | None = None
    boxes: dict = field(default_factory=dict)

    def step(self, id: str) -> Step:
        for step in self.steps:
            if step.id == id:
                return step
        raise ValueError(f"the tour has no step {id!r}; its steps are {', '.join(STEPS)}")

    def to_dict(self) -> dict:
        """JSON-ready: every number a float or a list of floats (see docs/tour.md)."""
        return {
            "source": self.source, "text": self.text, "tokens": list(self.tokens),
            "query": self.query, "key": self.key, "query_index": self.query_index,
            "key_index": self.key_index, "layer": self.layer, "head": self.head,
            "chosen": self.chosen, "num_layers": self.num_layers, "num_heads": self.num_heads,
            "steps": [s.to_dict() for s in self.steps],
            "diagram": None if self.diagram is None else self.diagram.to_dict(),
            "diagram_note": self.diagram_note, "boxes": self.boxes,
        }  # fmt: skip


def tour(
    pretrained,
    text: str = SENTENCE,
    *,
    query: str | None = None,
    key: str | None = None,
    layer: int | None = None,
    head: int | None = None,
    swap: str | None = None,
    compare: str | None = None,
    target: str | None = None,
) -> Tour:
    """The tour of `text` on `pretrained` (an encoder or a decoder; a training run's model adds
    its loss curve and cue head).

    query, key: words as `Encoded.find` takes them ("bank", "bank#2"); by default "bank" and
    "river" where the text has both (read the other way in a decoder, whose words see only
    the words before them), else the last word and the word it attends to most over every
    layer and head. layer, head: counted from 0; by default where the query word attends
    most to the key word (as `trace` chooses). swap: the word put in the key word's place for
    the swap experiment ("money" for "river", else "river"); compare: a second sentence holding
    the query word ("The bank approved my loan." for "bank", else the swapped sentence).
    An encoder-decoder's steps read its encoder; its cross-attention step reads the decoder
    over `target` (by default what the model writes for `text`).
    """
    whole = pretrained
    if isinstance(pretrained.model, EncoderDecoder):
        pretrained = _encoder_of(pretrained)
    elif target is not None:
        raise ValueError(f"a target text is for encoder-decoder models; {pretrained.source} "
                         "is not one")  # fmt: skip
    stack = stack_of(pretrained)  # an encoder or a decoder; refused by name otherwise
    seen = pretrained.attentions(text)
    encoded = seen.encoded
    query, key = _pair(encoded, seen, query, key, causal=seen.causal)
    found = trace(pretrained, text, query, key, layer=layer, head=head, attentions=seen)
    with torch.inference_mode():
        ids = torch.tensor([encoded.ids])  # (1, T)
        extra = {"logits": False} if seen.causal else {}
        states = stack(ids, hidden_states=True, **extra).hidden_states  # L+1 x (1, T, C)
    senses = probe(pretrained, "bank")  # the article's word, in the embedded labelled sentences
    tried = experiments(pretrained, text, found, states, senses, swap=swap, compare=compare)
    steps = (
        tokens_step(pretrained, encoded, found),
        embeddings_step(pretrained, stack, encoded, found, states),
        qkv_step(found, tried["qkv"], why_scalar(pretrained, found)),
        scaling_step(seen, found, tried["scaling"]),
        heads_step(stack, seen, found, tried["heads"]),
        layers_step(found, tried["vectors"], senses, tried["layers"]),
        cross_step(whole, text, target),
        training_step(pretrained),
        parallel_step(seen, found),
    )
    try:
        diagram, note = model_diagram(whole, len(found.tokens)), None
    except ValueError as error:  # a model the diagram cannot draw truthfully: said by name
        diagram, note = None, str(error)
    boxes = box_values(diagram, seen, found, states, steps[1].numbers, steps[4].numbers,
                       prefix="enc." if whole is not pretrained else "")  # fmt: skip
    return Tour(
        source=str(pretrained.source), text=text, tokens=tuple(found.tokens), query=query,
        key=key, query_index=found.query_index, key_index=found.key_index, layer=found.layer,
        head=found.head, chosen=found.chosen, num_layers=found.num_layers,
        num_heads=found.num_heads, steps=steps, diagram=diagram, diagram_note=note, boxes=boxes,
    )  # fmt: skip


def _encoder_of(pretrained):
    """An encoder-decoder as its encoder alone: the same tokenizer and weights, so that every
    self-attention step (trace, hide, ablate, probe) reads the encoder's layers."""
    encoder = copy.copy(pretrained)
    encoder.model = pretrained.model.encoder
    encoder.config = pretrained.model.encoder.config
    return encoder


def _pair(encoded, seen, query: str | None, key: str | None, *, causal: bool) -> tuple[str, str]:
    """The (query, key) words: as given (checked by `Encoded.find`), else the article's pair
    where the text has it, else the text's last word and the word it attends to most."""
    words = encoded.words()
    names = {w.name.casefold(): w.name for w in words}
    if query is None and key is None and all(w in names for w in DEFAULT_PAIR):
        query, key = (names[w] for w in DEFAULT_PAIR)
        if causal and encoded.find(key)[0] > encoded.find(query)[0]:
            query, key = key, query  # a decoder's word sees only the words before it
        return query, key
    if query is None:
        if DEFAULT_PAIR[0] in names and (key is None or key.casefold() != DEFAULT_PAIR[0]):
            query = names[DEFAULT_PAIR[0]]
        else:
            alike = [w for w in words if any(c.isalnum() for c in w.text)] or words
            if not alike:
                raise ValueError("the tour needs a text with words in it")
            query = alike[-1].name
    encoded.find(query)  # a clear error naming the text's words where it is not one
    if key is None:
        key = _most_attended(encoded, seen, query, words, causal)
    encoded.find(key)
    return query, key


def _most_attended(encoded, seen, query: str, words, causal: bool) -> str:
    """The word other than `query` that `query`'s first token attends to most, averaged over
    every layer and head (in a decoder, among the words before it), the text's first token
    only where no other word is there."""
    at = encoded.find(query)[0]
    mean = seen.weights[:, :, at].double().mean((0, 1))  # (T,)
    others = [w for w in words if w.token_start != at and (not causal or w.token_start < at)]
    if not others:
        raise ValueError(f"the query word {query!r} has no other word to attend to; "
                         "give a longer text or another query word")  # fmt: skip
    # the first token gathers weight in many heads whatever it says (an attention sink): a word
    # after it tells more, where there is one
    others = [w for w in others if w.token_start != 0] or others
    best = max(others, key=lambda w: float(mean[w.token_start]))
    return best.name

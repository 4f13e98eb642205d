"""What `qkv.why` returns, and what it adds to the terms: the sum's check, the notes, the
words a head carried, and each top part removed for real (`qkv.inspect.why` computes the terms).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import Tensor

from qkv.inspect.residual import Stream
from qkv.inspect.score_parts import Side, pieces_of_head
from qkv.views import Shown

HEAD = re.compile(r"L(\d+)\.H(\d+)$")
MLP = re.compile(r"L(\d+)\.mlp$")


@dataclass
class Carried:
    """A head's part of one side, split over the words that head read (its weights)."""

    side: str  # "query" or "key": whose part
    part: str  # "L2.H5"
    value: float  # the part's whole share of the score, against the other side's whole vector
    words: list[tuple[str, int, float, float]]  # (token, index, the head's weight, share)
    whole: float  # every word's share summed: `value` again, up to rounding


@dataclass
class Check:
    """One part removed for real: its output zeroed at its word, the model rerun from its layer."""

    side: str
    part: str
    position: int
    predicted_score: float  # the linear prediction: the score without the part's terms
    real_score: float
    predicted_weight: float  # the softmax with only this query's scores changed
    real_weight: float


@dataclass(repr=False)
class Why(Shown):
    """The score of one (query word, key word) pair in one head, taken apart."""

    view: ClassVar[str] = "why"

    source: str
    text: str
    tokens: list[str]
    query: str
    key: str
    query_index: int
    key_index: int
    layer: int
    head: int
    kv_head: int
    chosen: str  # "asked", or why this layer and head
    score: float  # what the softmax read
    pre_cap: float  # scale * temperature * q . k: what `terms` sums to
    softcap: float | None  # score = softcap * tanh(pre_cap / softcap) + bias
    bias: float | None  # T5's relative-position bias on the pair: a term of its own
    sink: float | None  # the head's learned sink: one more score in the softmax
    weight: float  # the pair's weight after the softmax
    scale: float  # on every dot product (1 / sqrt(D) unless the model says otherwise)
    temperature: float | None  # the query's temperature (Llama 4, Ministral 3)
    parts_q: list[str]
    parts_k: list[str]
    terms: Tensor  # (len(parts_q), len(parts_k)) float64
    content: Tensor | None  # (same) each term at distance 0, in a rotary layer; None elsewhere
    # cross-attention: the decoder's tokens, which query_index counts in (the key's are
    # `tokens`, the source's); None for self-attention, where both words are of `tokens`
    query_tokens: list[str] | None = None
    carried: list[Carried] = field(default_factory=list)
    checks: list[Check] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def total(self) -> float:
        """Every term summed: the pre-cap score, up to rounding."""
        return float(self.terms.sum())

    @property
    def position(self) -> float | None:
        """What the words' distance adds: the score minus its content (rotary layers)."""
        return None if self.content is None else self.total - float(self.content.sum())

    def by_part(self, side: str) -> list[tuple[str, float]]:
        """Each part of one side ("query" or "key") against the whole other side, largest first."""
        names, sums = ((self.parts_q, self.terms.sum(1)) if side == "query"
                       else (self.parts_k, self.terms.sum(0)))  # fmt: skip
        return sorted(zip(names, sums.tolist(), strict=True), key=lambda t: -abs(t[1]))

    def ranked(self, top: int = 10) -> list[tuple[str, str, float]]:
        """The `top` largest terms: (query part, key part, value), largest in size first."""
        flat = self.terms.flatten()
        order = flat.abs().argsort(descending=True)[:top].tolist()
        K = len(self.parts_k)
        return [(self.parts_q[i // K], self.parts_k[i % K], float(flat[i])) for i in order]

    def to_dict(self, top: int = 20) -> dict:
        """JSON-ready; the full grid of terms as nested lists."""
        share = max(abs(self.total), 1e-12)
        return {
            "source": self.source, "text": self.text, "tokens": list(self.tokens),
            "query_tokens": None if self.query_tokens is None else list(self.query_tokens),
            "query": self.query, "key": self.key, "query_index": self.query_index,
            "key_index": self.key_index, "layer": self.layer, "head": self.head,
            "kv_head": self.kv_head, "chosen": self.chosen, "score": self.score,
            "pre_cap": self.pre_cap, "total": self.total, "softcap": self.softcap,
            "bias": self.bias, "sink": self.sink, "weight": self.weight, "scale": self.scale,
            "temperature": self.temperature, "parts_q": list(self.parts_q),
            "parts_k": list(self.parts_k), "terms": self.terms.tolist(),
            "ranked": [{"query_part": q, "key_part": k, "value": v, "share": v / share}
                       for q, k, v in self.ranked(top)],
            "by_query_part": [{"part": p, "value": v} for p, v in self.by_part("query")[:top]],
            "by_key_part": [{"part": p, "value": v} for p, v in self.by_part("key")[:top]],
            "content": None if self.content is None else float(self.content.sum()),
            "position": self.position,
            "carried": [{"side": c.side, "part": c.part, "value": c.value,
                         "words": [{"token": t, "index": i, "weight": w, "value": v}
                                   for t, i, w, v in c.words], "whole": c.whole}
                        for c in self.carried],
            "checks": [vars(c) for c in self.checks],
            "notes": list(self.notes),
        }  # fmt: skip


def tolerance_of(dtype: torch.dtype, l2: bool = False) -> float:
    """How near the terms' sum must be to the layer's score, relative: 1e-9 in float64 (1e-5
    where the layer has Llama 4's L2 norm, which the model computes in float32 whatever its
    dtype, as transformers does), 1e-5 in float32, 1e-2 in 16-bit floats."""
    if dtype in (torch.float16, torch.bfloat16):
        return 1e-2
    return 1e-9 if dtype == torch.float64 and not l2 else 1e-5


def check_sum(found: Why, record, l2: bool) -> None:
    """The terms must sum to the score the layer computed (within `tolerance_of`), else the
    decomposition has missed a part: refuse."""
    tolerance = tolerance_of(record.q.dtype, l2)
    gap = abs(found.total - found.pre_cap)
    if gap > tolerance * max(1.0, abs(found.pre_cap)):
        raise ValueError(f"the terms sum to {found.total:.9g}, the layer's score before any cap "
                         f"was {found.pre_cap:.9g}: the parts miss {gap:.3g}, which qkv does not "
                         "hide; please report the model")  # fmt: skip


def notes(found: Why) -> list[str]:
    notes = [
        "every norm's scale is held at its value in this forward pass (one number per word):"
        " the terms are exact for this text, and removing a part changes that scale too"
    ]
    if found.softcap is not None:
        notes.append(
            f"the layer caps its scores: score = {found.softcap:g} * tanh(pre-cap / "
            f"{found.softcap:g}); the terms split the pre-cap score"
        )
    if found.bias is not None:
        notes.append(
            f"T5's relative-position bias adds {found.bias:.4g} to the score, a term of its own"
        )
    if found.sink is not None:
        notes.append(
            f"the head's sink is one more score ({found.sink:.4g}) in the softmax: it "
            "takes part of the weight and no value"
        )
    if found.temperature is not None:
        notes.append(f"the query's temperature {found.temperature:.4g} multiplies every term")
    if found.content is not None:
        notes.append(
            "content is each term with both words turned as if at the same position "
            "(distance 0); position is the rest"
        )
    return notes  # fmt: skip


@dataclass
class Word:
    """One side's word and where its parts came from: the stack and its forward `out`, the
    stream taken apart at the word (its index n there), the word's token position, the
    tokens of its text, and the prefix of its parts' names ("enc." for an encoder's)."""

    stack: object
    out: object
    stream: Stream
    n: int
    position: int
    spell: list[str]
    prefix: str = ""

    def head_of(self, part: str) -> tuple[int, int] | None:
        match = HEAD.match(part.removeprefix(self.prefix)) if part.startswith(self.prefix) else None
        return None if match is None else (int(match[1]), int(match[2]))

    def mlp_of(self, part: str) -> int | None:
        match = MLP.match(part.removeprefix(self.prefix)) if part.startswith(self.prefix) else None
        return None if match is None else int(match[1])


CARRIED_BLOCK = 512  # words carried to the score at once


def carried(found: Why, words: tuple[Word, Word], sides: tuple[Side, Side], factor: float,
            top: int = 2, shown: int = 5) -> list[Carried]:  # fmt: skip
    """The top head parts of each side, split over the words each head read."""
    made = []
    for side, word, mine, other in (("query", words[0], sides[0], sides[1]),
                                    ("key", words[1], sides[1], sides[0])):  # fmt: skip
        split = 0
        for part, value in found.by_part(side):
            if split == top:
                break
            head = word.head_of(part)
            pieces = None if head is None else pieces_of_head(word.stack, word.out, *head,
                                                               word.position)  # fmt: skip
            if pieces is None:
                continue
            split += 1
            weights, written, W_o = pieces
            shares = torch.cat([  # in blocks of words: a long text's (Tk, C) is never held
                factor * mine.linear(word.stream.carry(block @ W_o.T, head[0], word.n))
                @ other.total for block in written.split(CARRIED_BLOCK)])  # fmt: skip
            order = [j for j in shares.abs().argsort(descending=True).tolist() if weights[j] > 0]
            listed = [(word.spell[j], j, float(weights[j]), float(shares[j]))
                      for j in order[:shown]]  # fmt: skip
            made.append(Carried(side, part, value, listed, float(shares.sum())))
    return made


# (side, layer, head or None for the MLP, token position) -> the layer's record, rerun with that
# part's output zeroed at that position
Rerun = Callable[[str, int, int | None, int], object]


def checks(found: Why, words: tuple[Word, Word], sides: tuple[Side, Side, Side | None],
           keys: Tensor, steps, factor: float, top: int, rerun: Rerun) -> list[Check]:  # fmt: skip
    """Each of the top removable parts of each side zeroed at its word, the model rerun.

    sides: the query at the query word, the key at the key word and, in self-attention, the
    key at the query word (a word is a key of its own query too); keys (Tk', D): the layer's
    keys as it used them, Tk' <= Tk (later ones changed by nothing here). The prediction holds
    everything but the part: this query's scores with the part's vectors taken out of the
    query and of the keys at its word."""
    q, k, k_at_query = sides
    made = []
    for side, word in (("query", words[0]), ("key", words[1])):
        names = found.parts_q if side == "query" else found.parts_k
        taken = 0
        for part, _ in found.by_part(side):
            if taken == top:
                break
            head, mlp = word.head_of(part), word.mlp_of(part)
            if head is None and mlp is None:
                continue  # the embedding, the biases and cross-attention's heads stay
            taken += 1
            m, h = head if head is not None else (mlp, None)
            record = rerun(side, m, h, word.position)
            pair = record.steps(found.head, found.query_index).pairs[found.key_index]
            i = names.index(part)
            query, changed = q.total, keys.clone()
            own_query = k_at_query is not None and word.position == found.query_index
            if side == "query" or own_query:
                query = query - q.vectors[i]
                if k_at_query is not None:
                    changed[word.position] -= k_at_query.vectors[i]
            else:
                changed[word.position] -= k.vectors[i]
            change = factor * (changed @ query - keys @ q.total)  # pre-cap
            score, weight = _predicted(steps, found, change)
            made.append(Check(side, part, word.position, score, float(pair.score), weight,
                              float(pair.normalized_weight)))  # fmt: skip
    return made


def _predicted(steps, found: Why, change: Tensor) -> tuple[float, float]:
    """The pair's score and weight when this query's pre-cap scores change by `change` (T,)."""
    temperature = 1.0 if found.temperature is None else found.temperature
    scores, allowed = [], []
    for j, pair in enumerate(steps.pairs):
        s = float(pair.scaled_scalar) * temperature + (float(change[j]) if j < len(change) else 0.0)
        if found.softcap is not None:
            s = found.softcap * math.tanh(s / found.softcap)
        s += float(pair.score) - _capped(float(pair.scaled_scalar) * temperature, found.softcap)
        scores.append(s)
        allowed.append(pair.allowed)
    row = torch.tensor(scores, dtype=torch.float64)
    row = row.masked_fill(~torch.tensor(allowed), float("-inf"))
    if found.sink is not None:
        row = torch.cat([row, torch.tensor([found.sink], dtype=torch.float64)])
    weights = row.softmax(0)
    return float(row[found.key_index]), float(weights[found.key_index])


def _capped(s: float, cap: float | None) -> float:
    return s if cap is None else cap * math.tanh(s / cap)

"""Why does "bank" attend to "river"? One score taken apart, exactly.

The stream entering a layer is a sum of parts: the embedding, each earlier head's output, each
earlier MLP's output, biases (`qkv.inspect.residual`). With every norm's scale held at the value
it had in this forward pass, the query of the query word and the key of the key word are sums
over those parts (`qkv.inspect.score_parts`), so the score the softmax read is a sum over
(query part, key part) pairs: `terms`. What the sum leaves out is stated beside it: a soft-cap
(the pre-cap score is split, the cap named), T5's relative-position bias and a learned sink
(terms of their own). In a rotary layer each term splits again, into content (the term the two
words would have at distance 0) and position (the rest).

One level further, a head's part of a word is what that head moved into it from other words, so
its term splits over those source words by the head's weights (`carried`). And each top part is
removed for real (`checks`): its output zeroed at that word by an `Edit`, the model rerun from
that layer, the real change of the score and the weight set beside the linear prediction; they
differ by how the norms (and the later layers) respond.

>>> import qkv
>>> why = qkv.why(qkv.load("minilm"), "I sat by the river bank", "bank", "river", layer=2, head=1)
>>> abs(why.total - why.pre_cap) < 1e-5 * max(1.0, abs(why.pre_cap))
True
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import Tensor

from qkv.inspect.records import check_head_outputs
from qkv.inspect.residual import check_walkable, walk
from qkv.inspect.score_parts import Side, pieces_of_head, read_self
from qkv.models import Decoder
from qkv.models.stacks import self_attention_stack
from qkv.nn import LatentAttention
from qkv.nn.delta import GatedDeltaNet
from qkv.nn.edit import Edit
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


def why(
    pretrained, text: str, query: str, key: str, *, layer: int | None = None,
    head: int | None = None, target: str | None = None, checks: int = 3,
) -> Why:  # fmt: skip
    """Why `query` attends to `key` in `text` as much as it does: the score taken apart.

    layer, head: counted from 0; by default the pair where the query word attends to the key
    word most (as `qkv.trace`). Words are as `Encoded.find` takes them: "bank", or "bank#2"
    (the first token of each word stands for it). checks: how many top parts of each side to
    remove for real (0: none). target: encoder-decoder cross-attention is not taken apart yet,
    and is refused by name.
    """
    if target is not None:
        raise ValueError("qkv.why takes self-attention apart; an encoder-decoder's "
                         "cross-attention (target=) is not split yet: leave target out for its "
                         "encoder's self-attention")  # fmt: skip
    stack = self_attention_stack(pretrained.model, "qkv.why", pretrained.source)
    encoded = pretrained.encode(text)
    query_index, key_index = encoded.find(query)[0], encoded.find(key)[0]
    ids = torch.tensor([encoded.ids])
    spell = list(encoded.tokens)
    found = stack_why(stack, ids, query_index, key_index, layer=layer, head=head, checks=checks,
                      spell=spell, source=pretrained.source)  # fmt: skip
    found.text, found.query, found.key = text, query, key
    return found


def stack_why(
    stack, ids: Tensor, query_index: int, key_index: int, *, layer: int | None = None,
    head: int | None = None, checks: int = 3, spell: list[str] | None = None,
    source: str = "the model",
) -> Why:  # fmt: skip
    """`why` on an Encoder or Decoder over ids (1, T), at token positions."""
    with torch.inference_mode():
        return _stack_why(stack, ids, query_index, key_index, layer, head, checks, spell, source)


def _stack_why(stack, ids, query_index, key_index, layer, head, checks, spell, source) -> Why:
    check_walkable(stack, source, "qkv.why")
    T = ids.shape[1]
    for name, index in (("query", query_index), ("key", key_index)):
        if not 0 <= index < T:
            raise ValueError(f"the {name} position {index} is outside the text's {T} tokens")
    spell = spell if spell is not None else [str(i) for i in ids[0].tolist()]
    L = stack.config.num_layers
    if layer is not None and (type(layer) is not int or not 0 <= layer < L):
        raise ValueError(f"layer {layer!r} is out of range: {source} has layers 0..{L - 1}")
    if layer is None:
        out = stack(ids, layers="all", hidden_states=True)
    else:  # the layers after the one asked are not needed
        out = stack(ids, layers=list(range(layer + 1)), hidden_states=True, stop=layer + 1)
    chosen = "asked"
    if layer is None or head is None:
        layer, head = _best(stack, out, query_index, key_index, layer, head)
        chosen = "where the query word attends most to the key word"
    _check_layer(stack, layer, source)
    H = stack.blocks[layer].attn.num_heads
    if type(head) is not int or not 0 <= head < H:
        raise ValueError(f"head {head!r} is out of range: layer {layer} has heads 0..{H - 1}")
    check_head_outputs({m: out.records[m] for m in range(layer + 1)}, "qkv.why")
    record = out.records[layer]
    steps = record.steps(head, query_index)
    pair = steps.pairs[key_index]
    if not pair.allowed:
        raise ValueError(f"the query word (token {query_index}) does not see the key word (token "
                         f"{key_index}) in layer {layer}: the layer's mask hides it, so no score "
                         "of the pair reaches the softmax")  # fmt: skip
    stream = walk(stack, out, layer, [query_index, key_index])
    q = read_self(stack, layer, stream, 0, "query", head, T)
    k = read_self(stack, layer, stream, 1, "key", head, T)
    temperature = None
    factor = record.scale
    if record.query_scale is not None:
        temperature = float(record.query_scale.double().expand(1, T)[0, query_index])
        factor *= temperature
    terms = factor * q.vectors @ k.vectors.T  # (P, P)
    content = None if q.plain is None else factor * q.plain @ k.plain.T
    pre_cap = float(pair.scaled_scalar) * (1.0 if temperature is None else temperature)
    bias = None
    if record.bias is not None:
        bias = float(record.bias.double().expand(1, H, T, T)[0, head, query_index, key_index])
    found = Why(
        source=source, text="", tokens=spell, query="", key="", query_index=query_index,
        key_index=key_index, layer=layer, head=head, kv_head=head // record.shape.group,
        chosen=chosen, score=float(pair.score), pre_cap=pre_cap, softcap=record.softcap,
        bias=bias, sink=None if record.sinks is None else float(record.sinks[head]),
        weight=float(pair.normalized_weight), scale=record.scale, temperature=temperature,
        parts_q=list(stream.names), parts_k=list(stream.names), terms=terms, content=content,
    )  # fmt: skip
    _check_sum(found, record, stack.blocks[layer].attn.qk_norm == "l2")
    found.notes += _notes(found, stack)
    found.carried = _carried(stack, out, stream, q, k, factor, spell, found)
    if checks:
        k_at_query = read_self(stack, layer, stream, 0, "key", head, T)
        found.checks = _checks(stack, out, ids, found, (q, k, k_at_query), steps, factor, checks)
    return found


def _check_layer(stack, layer: int, source: str) -> None:
    attn = stack.blocks[layer].attn
    if isinstance(attn, GatedDeltaNet):
        raise ValueError(f"layer {layer} of {source} is linear attention (a running memory): it "
                         "computes no score between two words to take apart")  # fmt: skip
    if isinstance(attn, LatentAttention):
        raise ValueError(f"layer {layer} of {source} is latent attention (keys and values made "
                         "from one compressed vector per word); qkv.why does not split its "
                         "scores yet")  # fmt: skip


def _best(stack, out, query_index, key_index, layer, head) -> tuple[int, int]:
    """The (layer, head) where the query word's weight on the key word peaks, among the layers
    whose scores `why` takes apart."""
    best = None
    layers = range(stack.config.num_layers) if layer is None else [layer]
    for m in layers:
        attn = stack.blocks[m].attn
        if isinstance(attn, GatedDeltaNet | LatentAttention):
            continue
        heads = list(range(attn.num_heads)) if head is None else [head]
        if head is not None and head >= attn.num_heads:
            continue
        row = out.records[m].weights(heads)[0, :, query_index, key_index]
        n = int(row.argmax())
        if best is None or row[n] > best[0]:
            best = (float(row[n]), m, heads[n])
    if best is None:
        raise ValueError("no layer asked computes softmax scores between two words")
    return best[1], best[2]


def tolerance_of(dtype: torch.dtype, l2: bool = False) -> float:
    """How near the terms' sum must be to the layer's score, relative: 1e-9 in float64 (1e-5
    where the layer has Llama 4's L2 norm, which the model computes in float32 whatever its
    dtype, as transformers does), 1e-5 in float32, 1e-2 in 16-bit floats."""
    if dtype in (torch.float16, torch.bfloat16):
        return 1e-2
    return 1e-9 if dtype == torch.float64 and not l2 else 1e-5


def _check_sum(found: Why, record, l2: bool) -> None:
    """The terms must sum to the score the layer computed (within `tolerance_of`), else the
    decomposition has missed a part: refuse."""
    tolerance = tolerance_of(record.q.dtype, l2)
    gap = abs(found.total - found.pre_cap)
    if gap > tolerance * max(1.0, abs(found.pre_cap)):
        raise ValueError(f"the terms sum to {found.total:.9g}, the layer's score before any cap "
                         f"was {found.pre_cap:.9g}: the parts miss {gap:.3g}, which qkv does not "
                         "hide; please report the model")  # fmt: skip


def _notes(found: Why, stack) -> list[str]:
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


def _carried(stack, out, stream, q: Side, k: Side, factor, spell, found: Why, top=2, words=5):
    """The top head parts of each side, split over the words each head read."""
    carried = []
    for side, mine, other, n, position in (
        ("query", q, k, 0, found.query_index),
        ("key", k, q, 1, found.key_index),
    ):
        split_here = 0
        for part, value in found.by_part(side):
            if split_here == top:
                break
            match = HEAD.match(part)
            if match is None:
                continue
            m, h = int(match[1]), int(match[2])
            split = pieces_of_head(stack, out, m, h, position)
            if split is None:
                continue
            split_here += 1
            weights, pieces = split
            shares = factor * mine.linear(stream.carry(pieces, m, n)) @ other.total
            order = [j for j in shares.abs().argsort(descending=True).tolist() if weights[j] > 0]
            order = order[:words]  # the words the head read, by their share
            carried.append(Carried(side, part, value, [
                (spell[j], j, float(weights[j]), float(shares[j])) for j in order],
                float(shares.sum())))  # fmt: skip
    return carried


def _checks(stack, out, ids, found: Why, sides, steps, factor, top) -> list[Check]:
    """Each of the top removable parts of each side zeroed at its word, the model rerun.

    sides: the query at the query word, the key at the key word and the key at the query word
    (a word is a key of its own query too). The prediction holds everything but the part: the
    query's scores where the part's vectors leave the query and the keys at its word."""
    q, k, k_at_query = sides
    made = []
    T = ids.shape[1]
    # a decoder's words after the pair change nothing of it: the reruns leave them out
    end = max(found.query_index, found.key_index) + 1 if isinstance(stack, Decoder) else T
    keys = out.records[found.layer].k[0, found.kv_head, :end].double()  # (end, D)
    for side, position in (("query", found.query_index), ("key", found.key_index)):
        taken = 0
        for part, _ in found.by_part(side):
            if taken == top:
                break
            head, mlp = HEAD.match(part), MLP.match(part)
            if head is None and mlp is None:
                continue  # the embedding and the biases are not removed
            taken += 1
            m = int((head or mlp)[1])
            at = torch.zeros(1, end, dtype=torch.bool)
            at[0, position] = True
            if head is not None:
                heads = torch.zeros(1, out.records[m].shape.H, end, 1, dtype=torch.bool)
                heads[0, int(head[2]), position] = True
                edit = Edit(heads=heads)
            else:
                edit = Edit(mlp=at)
            rerun = stack(
                ids[:, :end],
                layers=[found.layer],
                edits={m: edit},
                resume=(m, out.hidden_states[m][:, :end]),
                stop=found.layer + 1,
            )
            real = rerun.records[found.layer].steps(found.head, found.query_index)
            pair = real.pairs[found.key_index]
            # the linear prediction: the part's vectors taken out where it was removed
            i = found.parts_q.index(part)
            query, changed = q.total, keys.clone()
            if position == found.query_index:
                query = query - q.vectors[i]
                changed[position] -= k_at_query.vectors[i]
            else:
                changed[position] -= k.vectors[i]
            change = factor * (changed @ query - keys @ q.total)  # (end,) pre-cap
            score, weight = _predicted(steps, found, change)
            made.append(Check(side, part, position, score, float(pair.score), weight,
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

"""The article's steps for one (query word, key word) pair, with a real model's numbers.

`trace` runs the model once, keeps what one layer's attention received, and redoes that
head's work with the `loop` backend, the article literally: query vector, key vector, dot
product, division by sqrt(d), softmax over every key word, value vector, scaled value
vector, and the sum. It also keeps the slice of the model's own attention output for that
head and word, so anyone can check that the walk-through is the model's real computation.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch
from torch import Tensor

from qkv.attention import loop
from qkv.models import Decoder, Encoder


@dataclass
class Contribution:
    """What one key word added to the query word's new vector in this head."""

    token: str
    index: int
    weight: float  # the normalized attention weight (softmax), 0..1
    size: float  # the norm of weight * value vector after the output projection


@dataclass
class Trace:
    """Every step of the article for one query word, one key word, one layer and head."""

    source: str
    text: str
    tokens: list[str]
    query: str  # the word as asked, e.g. "bank" or "bank#2"
    key: str
    query_index: int  # the token standing for each word (the first of its tokens)
    key_index: int
    layer: int
    head: int
    kv_head: int  # with grouped-query attention, the key/value head this query head reads
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    width: int
    causal: bool  # a decoder: each word sees only itself and the words before it
    chosen: str  # why this layer and head ("asked", or the one where query attends most to key)
    query_vector: Tensor  # (D,) step 1
    key_vector: Tensor  # (D,) step 2
    attention_scalar: float  # step 3: query . key
    scaled_scalar: float  # the side note: divided by sqrt(D)
    weights: Tensor  # (T,) step 4: softmax over every key word (zeros where masked)
    value_vector: Tensor  # (D,) step 5: the key word's value vector
    scaled_value_vector: Tensor  # (D,) step 6: weight * value vector
    contextualized: Tensor  # (D,) step 7: the sum over every key word
    model_output: Tensor  # (D,) this head's slice of the model's own attention output
    contributions: list[Contribution] = field(default_factory=list)
    query_unrotated: Tensor | None = None  # rotary models: q and k before rotation
    key_unrotated: Tensor | None = None

    @property
    def weight(self) -> float:
        """The normalized weight of the key word for the query word."""
        return float(self.weights[self.key_index])

    @property
    def masked(self) -> bool:
        """True when the causal mask hides the key word from the query word."""
        return self.causal and self.key_index > self.query_index

    def to_dict(self) -> dict:
        """JSON-ready: tensors become lists of floats (see docs/explain.md)."""
        out = {}
        for name, value in asdict(self).items():
            out[name] = value.tolist() if isinstance(value, Tensor) else value
        out["weight"], out["masked"] = self.weight, self.masked
        return out


def trace(
    pretrained, text: str, query: str, key: str, *, layer: int | None = None, head=None
) -> Trace:
    """The article's steps for `query` getting context from `key` in `text`.

    layer, head: counted from 0; by default the pair where the query word attends to the
    key word most. Words are as `Encoded.find` takes them: "bank", or "bank#2".
    """
    model = pretrained.model
    if not isinstance(model, Encoder | Decoder):
        raise ValueError(f"explain supports encoders and decoders; {pretrained.source} is neither")
    if not text.strip():
        raise ValueError("the text is empty; give a sentence")
    encoded = pretrained.tokenizer.encode(text)
    count, limit = len(encoded.ids), pretrained.context_window
    if count > limit:
        raise ValueError(f"the text has {count} tokens; {pretrained.source} reads at most {limit}")
    query_index, key_index = _first_token(encoded, query), _first_token(encoded, key)
    cfg = model.config
    L, H = cfg.num_layers, cfg.block.num_heads
    for name, value, most in (("layer", layer, L), ("head", head, H)):
        if value is not None and not 0 <= value < most:
            raise ValueError(
                f"{name} {value} is out of range: {pretrained.source} has {most} {name}s "
                f"(0-{most - 1})"
            )

    ids = torch.tensor([encoded.ids])
    inputs, concatenated = {}, {}
    hooks = []
    for i, block in enumerate(model.blocks):
        hooks.append(block.attn.register_forward_pre_hook(_keep_input(inputs, i), with_kwargs=True))
        hooks.append(block.attn.out.register_forward_pre_hook(_keep_input(concatenated, i)))
    try:
        with torch.inference_mode():
            recorded = model(ids, record=[(i, h) for i in range(L) for h in range(H)]).attentions
    finally:
        for hook in hooks:
            hook.remove()

    chosen = "asked"
    if layer is None or head is None:
        candidates = [(i, h) for i in range(L) for h in range(H)
                      if (layer is None or i == layer) and (head is None or h == head)]  # fmt: skip
        layer, head = max(candidates, key=lambda p: recorded[p][0, query_index, key_index])
        chosen = "where the query word attends most to the key word"
    attn = model.blocks[layer].attn
    x, positions = inputs[layer]
    D, group = attn.head_dim, attn.num_heads // attn.num_kv_heads
    kv_head = head // group
    with torch.inference_mode():
        q = attn.split_heads(attn.queries(x), attn.num_heads)[0, head]  # (T, D)
        k, v = (attn.split_heads(t, attn.num_kv_heads)[0, kv_head] for t in attn.keys_values(x))
        q_plain, k_plain = q, k
        if attn.rotary is not None:
            if positions is None:
                positions = torch.arange(count)
            q = attn.rotary(q[None, None], positions)[0, 0]
            k = attn.rotary(k[None, None], positions)[0, 0]
        causal = isinstance(model, Decoder)
        allowed = [not causal or j <= query_index for j in range(count)]
        scale = 1 / math.sqrt(D)
        contextualized, pairs = loop.contextualize(
            q[query_index].double(), k.double(), v.double(), allowed, scale
        )
        # what each key word added, after the output projection's columns for this head
        w_out = attn.out.weight[:, head * D : (head + 1) * D].double()  # (C, D)
        contributions = [
            Contribution(encoded.tokens[p.key_index], p.key_index,
                         float(p.normalized_weight), float((w_out @ p.scaled_value_vector).norm()))
            for p in pairs
        ]  # fmt: skip
    pair = pairs[key_index]
    return Trace(
        source=pretrained.source, text=text, tokens=list(encoded.tokens), query=query,
        key=key, query_index=query_index, key_index=key_index, layer=layer, head=head,
        kv_head=kv_head, num_layers=L, num_heads=H, num_kv_heads=attn.num_kv_heads,
        head_dim=D, width=cfg.block.width, causal=causal, chosen=chosen,
        query_vector=q[query_index].double(), key_vector=pair.key_vector,
        attention_scalar=float(pair.attention_scalar), scaled_scalar=float(pair.scaled_scalar),
        weights=torch.stack([p.normalized_weight for p in pairs]).float(),
        value_vector=pair.value_vector, scaled_value_vector=pair.scaled_value_vector,
        contextualized=contextualized,
        model_output=concatenated[layer][0][0, query_index, head * D : (head + 1) * D].double(),
        contributions=contributions,
        query_unrotated=q_plain[query_index].double() if attn.rotary is not None else None,
        key_unrotated=k_plain[key_index].double() if attn.rotary is not None else None,
    )  # fmt: skip


def _first_token(encoded, word: str) -> int:
    """The first token of `word`; a word that occurs twice must say which ("bank#2")."""
    if "#" not in word:
        same = [w for w in encoded.words() if w.text.lower() == word.lower()]
        if len(same) > 1:
            names = ", ".join(f"{word}#{n}" for n in range(1, len(same) + 1))
            raise ValueError(f"'{word}' occurs {len(same)} times in the text; name one: {names}")
    return encoded.find(word)[0]


def _keep_input(store: dict, layer: int):
    """A forward pre-hook keeping a module's input (and rotary positions) for one layer."""

    def hook(module, args, kwargs=None):
        store[layer] = (args[0].detach(), (kwargs or {}).get("positions"))

    return hook

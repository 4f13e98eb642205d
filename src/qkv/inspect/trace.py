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
from qkv.models import Decoder, Encoder, EncoderDecoder


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
    target: str | None = None  # cross-attention: the decoder's text, where the query word is
    query_tokens: list[str] | None = None  # cross-attention: the target's tokens

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
    pretrained,
    text: str,
    query: str,
    key: str,
    *,
    layer: int | None = None,
    head: int | None = None,
    target: str | None = None,
) -> Trace:
    """The article's steps for `query` getting context from `key` in `text`.

    layer, head: counted from 0; by default the pair where the query word attends to the
    key word most. Words are as `Encoded.find` takes them: "bank", or "bank#2".
    Encoder-decoder models trace cross-attention: the key word is in `text` (the source,
    read by the encoder), the query word in `target` (read by the decoder).
    """
    model = pretrained.model
    cross = isinstance(model, EncoderDecoder)
    if not isinstance(model, Encoder | Decoder | EncoderDecoder):
        raise ValueError(f"explain does not support {type(model).__name__} models")
    if cross and target is None:
        raise ValueError("an encoder-decoder traces cross-attention: give the target text too")
    if not cross and target is not None:
        raise ValueError(f"a target text is for encoder-decoder models; {pretrained.source} is not")
    source = pretrained.encode(text)
    if cross:  # the decoder reads its start token, then the target (see decoder_input)
        decoder_ids, query_tokens, queries = pretrained.decoder_input(target)
        query_index = 1 + _first_token(queries, query)
    else:
        query_index, query_tokens = _first_token(source, query), None
    key_index = _first_token(source, key)
    stack = model.decoder if cross else model
    L, H = stack.config.num_layers, stack.config.block.num_heads
    for name, value, most in (("layer", layer, L), ("head", head, H)):
        if value is not None and not 0 <= value < most:
            raise ValueError(
                f"{name} {value} is out of range: {pretrained.source} has {most} {name}s "
                f"(0-{most - 1})"
            )

    modules = [block.cross_attn if cross else block.attn for block in stack.blocks]
    inputs, concatenated, hooks = {}, {}, []
    for i, attn in enumerate(modules):
        hooks.append(attn.register_forward_pre_hook(_keep_input(inputs, i), with_kwargs=True))
        hooks.append(attn.out.register_forward_pre_hook(_keep_input(concatenated, i)))
    record = [(i, h) for i in range(L) for h in range(H)]
    try:
        with torch.inference_mode():
            if cross:
                recorded = model(torch.tensor([source.ids]), decoder_ids,
                                 record_cross=record).cross_attentions  # fmt: skip
            else:
                recorded = model(torch.tensor([source.ids]), record=record).attentions
    finally:
        for hook in hooks:
            hook.remove()

    chosen = "asked"
    if layer is None or head is None:
        candidates = [(i, h) for i, h in record
                      if (layer is None or i == layer) and (head is None or h == head)]  # fmt: skip
        layer, head = max(candidates, key=lambda p: recorded[p][0, query_index, key_index])
        chosen = "where the query word attends most to the key word"
    attn = modules[layer]
    x, context, positions = inputs[layer]
    D, group = attn.head_dim, attn.num_heads // attn.num_kv_heads
    kv_head = head // group
    causal = isinstance(model, Decoder)
    with torch.inference_mode():
        q = attn.split_heads(attn.queries(x), attn.num_heads)[0, head]  # (Tq, D)
        kv = attn.keys_values(context if cross else x)
        k, v = (attn.split_heads(t, attn.num_kv_heads)[0, kv_head] for t in kv)  # (Tk, D)
        q_plain, k_plain = q, k
        if attn.rotary is not None and not cross:
            if positions is None:
                positions = torch.arange(len(source.ids))
            q = attn.rotary(q[None, None], positions)[0, 0]
            k = attn.rotary(k[None, None], positions)[0, 0]
        allowed = [not causal or j <= query_index for j in range(len(source.ids))]
        contextualized, pairs = loop.contextualize(
            q[query_index].double(), k.double(), v.double(), allowed, 1 / math.sqrt(D)
        )
        # what each key word added, after the output projection's columns for this head
        w_out = attn.out.weight[:, head * D : (head + 1) * D].double()  # (C, D)
        contributions = [
            Contribution(source.tokens[p.key_index], p.key_index,
                         float(p.normalized_weight), float((w_out @ p.scaled_value_vector).norm()))
            for p in pairs
        ]  # fmt: skip
    pair = pairs[key_index]
    rotated = attn.rotary is not None and not cross
    return Trace(
        source=pretrained.source, text=text, tokens=list(source.tokens), query=query,
        key=key, query_index=query_index, key_index=key_index, layer=layer, head=head,
        kv_head=kv_head, num_layers=L, num_heads=H, num_kv_heads=attn.num_kv_heads,
        head_dim=D, width=stack.config.block.width, causal=causal, chosen=chosen,
        query_vector=q[query_index].double(), key_vector=pair.key_vector,
        attention_scalar=float(pair.attention_scalar), scaled_scalar=float(pair.scaled_scalar),
        weights=torch.stack([p.normalized_weight for p in pairs]).float(),
        value_vector=pair.value_vector, scaled_value_vector=pair.scaled_value_vector,
        contextualized=contextualized,
        model_output=concatenated[layer][0][0, query_index, head * D : (head + 1) * D].double(),
        contributions=contributions,
        query_unrotated=q_plain[query_index].double() if rotated else None,
        key_unrotated=k_plain[key_index].double() if rotated else None,
        target=target, query_tokens=query_tokens,
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
    """A forward pre-hook keeping a module's input for one layer: (x, context, positions)."""

    def hook(module, args, kwargs=None):
        kwargs = kwargs or {}
        context = args[1] if len(args) > 1 else kwargs.get("context")
        store[layer] = (args[0].detach(), context, kwargs.get("positions"))

    return hook


def attention_vectors(pretrained, text: str) -> tuple[Tensor, Tensor, Tensor]:
    """Every layer's and head's query, key and value vectors over `text`: (L, H, T, D) each.

    The vectors `attend` received (after rotary rotation; with grouped key/value heads, each
    query head gets the key/value head it reads), so that any (query, key) pair's steps can
    be redone from them: weights = softmax(q k^T / sqrt(D)) (causal for decoders), and the
    contextualized vectors = weights v.
    """
    model = pretrained.model
    if not isinstance(model, Encoder | Decoder):
        raise ValueError(f"attention_vectors supports encoders and decoders, not {type(model)}")
    encoded = pretrained.encode(text)
    inputs, hooks = {}, []
    for i, block in enumerate(model.blocks):
        hooks.append(block.attn.register_forward_pre_hook(_keep_input(inputs, i), with_kwargs=True))
    try:
        with torch.inference_mode():
            model(torch.tensor([encoded.ids]))
    finally:
        for hook in hooks:
            hook.remove()
    qs, ks, vs = [], [], []
    with torch.inference_mode():
        for i, block in enumerate(model.blocks):
            attn, (x, _, positions) = block.attn, inputs[i]
            group = attn.num_heads // attn.num_kv_heads
            q = attn.split_heads(attn.queries(x), attn.num_heads)  # (1, H, T, D)
            k, v = (attn.split_heads(t, attn.num_kv_heads) for t in attn.keys_values(x))
            if attn.rotary is not None:
                positions = torch.arange(len(encoded.ids)) if positions is None else positions
                q, k = attn.rotary(q, positions), attn.rotary(k, positions)
            qs.append(q[0])
            ks.append(k[0].repeat_interleave(group, dim=0))  # query head h reads h // group
            vs.append(v[0].repeat_interleave(group, dim=0))
    return torch.stack(qs), torch.stack(ks), torch.stack(vs)

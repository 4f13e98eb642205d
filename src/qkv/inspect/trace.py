"""The article's steps for one (query word, key word) pair, with a real model's numbers.

`trace` runs the model once with its layers' records (`Pretrained.attentions`) and redoes
one head's work for one query with the `loop` backend on that layer's record, the article
literally: query vector, key vector, dot product, scaling, softmax over every key word,
value vector, scaled value vector, and the sum. The record holds q, k, v, the mask and the
scale exactly as the model's backend received them, so the steps cannot drift from the
model's computation; the trace also keeps that head's slice of the backend's own output, so
anyone can check that the walk-through is the model's real computation.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import ClassVar

import torch
from torch import Tensor

from qkv.attention.inputs import check_indices
from qkv.inspect.anatomy import LayerAnatomy, layer_anatomy
from qkv.inspect.layer_heads import check_heads, heads_per_layer
from qkv.inspect.records import check_head_outputs, why_not_redone
from qkv.inspect.trace_compressed import CompressedStep, compressed_steps
from qkv.inspect.words import on_words
from qkv.models import Decoder, Encoder, EncoderDecoder
from qkv.models.deepseek_v4 import DeepseekV4Decoder
from qkv.views import Shown


@dataclass(frozen=True)
class Layout:
    """What a trace reads of a model beside its records: its sizes, each layer's output
    projection (C, H * D; column block h is head h's) and how each layer departs from the
    article (None where unknown). A model that is not qkv's own (a transformers model through
    `qkv.hf`) gives its own from an `attention_layout()` method."""

    num_layers: int
    num_heads: int  # the most heads a layer has
    width: int
    cross: bool  # an encoder-decoder's cross-attention
    out_weight: Callable[[int], Tensor]
    anatomy: Callable[[int], LayerAnatomy | None]
    # each layer's own number of heads where layers differ (Qwen3.5's linear layers have
    # more); None: every layer has num_heads
    layer_heads: tuple[int, ...] | None = None

    def heads_in(self, layer: int) -> int:
        """How many heads `layer` has."""
        return self.num_heads if self.layer_heads is None else self.layer_heads[layer]


def layout_of(pretrained) -> Layout:
    """The Layout of a `Pretrained` (the decoder's, for an encoder-decoder), or the
    `attention_layout()` of a model that offers one."""
    if hasattr(pretrained, "attention_layout"):
        return pretrained.attention_layout()
    model = pretrained.model
    if not isinstance(model, Encoder | Decoder | EncoderDecoder):
        raise ValueError(f"explain does not support {type(model).__name__} models")
    cross = isinstance(model, EncoderDecoder)
    stack = model.decoder if cross else model

    def attn(layer: int):
        return stack.blocks[layer].cross_attn if cross else stack.blocks[layer].attn

    counts = [stack.config.block.num_heads] * stack.config.num_layers if cross else (
        heads_per_layer(stack))  # fmt: skip
    return Layout(stack.config.num_layers, max(counts), stack.config.block.width, cross,
                  lambda layer: attn(layer).out.weight,
                  lambda layer: layer_anatomy(stack.config, layer, cross=cross),
                  tuple(counts))  # fmt: skip


@dataclass
class Contribution:
    """What one key word added to the query word's new vector in this head."""

    token: str
    index: int
    # the normalized attention weight (softmax), 0..1; in a linear layer the effective weight:
    # what the memory returns of this word's value when the query reads it (signed, no softmax)
    weight: float
    # the norm of weight * value vector after the output projection; in a linear layer before
    # it (the head's read passes a gated norm first, which needs the layer's input)
    size: float


@dataclass(repr=False)
class Trace(Shown):
    """Every step of the article for one query word, one key word, one layer and head."""

    view: ClassVar[str] = "trace"  # drawn by qkv.viz.notebook

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
    num_heads: int  # this layer's
    num_kv_heads: int
    head_dim: int
    width: int
    causal: bool  # a decoder: each word sees only itself and the words before it
    chosen: str  # why this layer and head ("asked", or the one where query attends most to key)
    query_vector: Tensor  # (D,) step 1
    key_vector: Tensor  # (D,) step 2 (D: the query and key head size, head_dim)
    attention_scalar: float  # step 3: query . key
    scale: float  # the factor on every dot product: 1/sqrt(D), the article's side note
    scaled_scalar: float  # the side note: times the scale
    # what the softmax reads: the scaled scalar, soft-capped and plus the layer's score bias
    # where it has them (Gemma 2's cap, T5's distance bias); else the scaled scalar itself
    score: float
    weights: Tensor  # (T,) step 4: softmax over every key word (zeros where masked)
    value_vector: Tensor  # (Dv,) step 5: the key word's value vector (Dv: usually D)
    scaled_value_vector: Tensor  # (Dv,) step 6: weight * value vector
    contextualized: Tensor  # (Dv,) step 7: the sum over every key word
    model_output: Tensor  # (Dv,) this head's slice of the model's own attention output
    masked: bool  # the layer's mask (causal, padding) hides the key word from the query word
    contributions: list[Contribution] = field(default_factory=list)
    query_unrotated: Tensor | None = None  # rotary models: q and k before rotation
    key_unrotated: Tensor | None = None
    target: str | None = None  # cross-attention: the decoder's text, where the query word is
    query_tokens: list[str] | None = None  # cross-attention: the target's tokens
    softcap: float | None = None  # the layer's soft-cap on scores (see score)
    bias: float | None = None  # the layer's bias on this pair's score (see score)
    window: int | None = None  # keys this many positions away or more are hidden
    outside_window: bool = False  # the key word is hidden because it is outside the window
    # how this layer departs from the article's plain attention (see qkv.inspect.anatomy)
    anatomy: LayerAnatomy | None = None
    temperature: float | None = None  # the query's temperature on its scores (see score)
    sink: float | None = None  # this head's learned sink: one more score in the softmax
    sink_weight: float | None = None  # the share of the query's weight the sink took
    chunk: int | None = None  # the layer's chunks: a query sees only its own chunk's keys
    query_chunk: int | None = None  # which chunk the query word is in, counted from 0
    key_chunk: int | None = None
    # the query token's mixture of experts in this layer, in words ("went to experts 3 and 7
    # (62% / 38%)"); None where the layer's MLP is a plain one
    experts: str | None = None
    # a linear layer (qkv.attention.linear): no softmax, a running memory. Its fade, "head" (one
    # factor per head: Gated DeltaNet) or "channel" (one per key channel: KDA); None elsewhere.
    # `weights` are then the effective weights (signed, summing to anything)
    linear: str | None = None
    write_strength: float | None = None  # beta of the key word: how strongly it wrote its value
    # each word's tokens [start, end) (the query's in the target for cross-attention): a word
    # of several tokens is traced at its first, query_index / key_index
    query_span: tuple[int, int] | None = None
    key_span: tuple[int, int] | None = None
    # what the fades of the words after the key word (up to the query word) leave of its write:
    # the product of their g (per key channel in KDA: the mean of the channels' products)
    fade: float | None = None
    # the query word's query carried back to the key word's write, through every later word's
    # fade and write, dotted with the key word's key (times the scale): the effective weight is
    # write_strength times this
    carried: float | None = None
    # what the query read of a memory older than the recorded tokens (decoding after a prompt)
    from_state: Tensor | None = None
    # a layer of compressed attention (DeepSeek-V4's CSA, HCA): what the query attended to (the
    # window's words, the entries, each a block of words) and why a word got no weight. Its
    # `weights` are on the words: entries' weights spread by the compressor's coefficients,
    # averaged over channels (an attribution); steps 2-6 show the key word's own key in the
    # window, or the entry that holds the most of it
    compressed: CompressedStep | None = None

    @property
    def weight(self) -> float:
        """The normalized weight of the key word for the query word."""
        return float(self.weights[self.key_index])

    def to_dict(self) -> dict:
        """JSON-ready: tensors become lists of floats (see docs/explain.md)."""
        out = {}
        for name, value in asdict(self).items():
            out[name] = value.tolist() if isinstance(value, Tensor) else value
        out["weight"] = self.weight
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
    attentions=None,
) -> Trace:
    """The article's steps for `query` getting context from `key` in `text`; in a linear layer
    (a running memory, no softmax) the memory's steps, with the effective weights.

    layer, head: counted from 0; by default the pair where the query word attends to the
    key word most. Words are as `Encoded.find` takes them: "bank", or "bank#2".
    Encoder-decoder models trace cross-attention: the key word is in `text` (the source,
    read by the encoder), the query word in `target` (read by the decoder).
    attentions: `pretrained.attentions(text, target=target)` if already at hand, so that the
    model runs once for a trace and a page of the same text.
    """
    layout = layout_of(pretrained)
    cross = layout.cross
    if cross and target is None:
        raise ValueError("an encoder-decoder traces cross-attention: give the target text too")
    if not cross and target is not None:
        raise ValueError(f"a target text is for encoder-decoder models; {pretrained.source} is not")
    source = pretrained.encode(text)
    if cross:  # the decoder reads its start token, then the target (see decoder_input)
        _, query_tokens, queries = pretrained.decoder_input(target)
        start, end = queries.find(query)
        query_span = (1 + start, 1 + end)
    else:
        query_span, query_tokens = source.find(query), None
    key_span = source.find(key)
    query_index, key_index = query_span[0], key_span[0]  # a word of several tokens: its first
    spans = {"query_span": tuple(query_span), "key_span": tuple(key_span)}
    L = layout.num_layers
    counts = [layout.heads_in(n) for n in range(L)]
    if layer is not None:
        check_indices("layer", [layer], L, pretrained.source)
    if head is not None:  # one that the layer asked has (each layer its own count)
        check_heads([head], list(range(L)) if layer is None else [layer], counts,
                    pretrained.source)  # fmt: skip

    seen = attentions if attentions is not None else pretrained.attentions(text, target=target)
    if seen.tokens != list(source.tokens) or seen.query_tokens != query_tokens:
        raise ValueError("the attentions given are of another text; pass those of this one")
    chosen = "asked"
    if layer is None or head is None:  # the first (layer, head) where the pair's weight peaks
        best = None
        for i in seen.layers if layer is None else [layer]:
            if i not in seen.records:
                raise ValueError(f"the attentions given lack layer {i}; record every layer")
            heads = list(range(counts[i])) if head is None else [head]
            if head is not None and head >= counts[i]:
                continue  # a layer of fewer heads (Qwen3.5's full layers beside linear ones)
            row = on_words(seen.records[i], heads)[0, :, query_index, key_index]  # (len(heads),)
            n = int(row.argmax())
            if best is None or row[n] > best[0]:
                best = (row[n], i, heads[n])
        _, layer, head = best
        chosen = "where the query word attends most to the key word"
    if layer not in seen.records:
        raise ValueError(f"the attentions given lack layer {layer}; record it")
    record = seen.records[layer]
    check_head_outputs({layer: record}, "a trace")
    kv_head = head // record.shape.group
    steps = record.steps(head, query_index)  # the loop backend, on the layer's own q, k, v
    if record.linear is not None:
        return replace(_linear_trace(pretrained, text, source, query, key, query_index,
                                     key_index, layer, head, layout, chosen, record, steps,
                                     seen), **spans)  # fmt: skip
    if isinstance(getattr(pretrained, "model", None), DeepseekV4Decoder):
        return replace(_deepseek_v4_trace(pretrained, text, source, query, key, query_index,
                                          key_index, layer, head, layout, chosen, record, steps,
                                          seen), **spans)  # fmt: skip
    D = record.shape.value_size  # each head's output: its values' size
    with torch.inference_mode():
        # what each key word added, after the output projection's columns for this head (and
        # the layer's output gate before them, where it has one: Qwen3.5)
        w_out = layout.out_weight(layer)[:, head * D : (head + 1) * D].double()  # (C, D)
        if record.output_gate is not None:
            w_out = w_out * record.output_gate[0, head, query_index].double()
        contributions = [
            Contribution(source.tokens[p.key_index], p.key_index,
                         float(p.normalized_weight), float((w_out @ p.scaled_value_vector).norm()))
            for p in steps.pairs
        ]  # fmt: skip
    pair = steps.pairs[key_index]
    rotated = record.q_before_rotary is not None
    bias = None
    if record.bias is not None:
        every = record.bias.expand(*record.q.shape[:3], record.k.shape[2])  # (B, H, Tq, Tk)
        bias = float(every[0, head, query_index, key_index])
    distance = query_index - key_index if record.causal else abs(query_index - key_index)
    outside = record.window is not None and distance >= record.window
    late = _late_steps(record, head, query_index, key_index, steps)
    found = getattr(seen, "experts", {}).get(layer)
    late["experts"] = None if found is None else found.describe(0, query_index)
    return Trace(
        source=pretrained.source, text=text, tokens=list(source.tokens), query=query,
        key=key, query_index=query_index, key_index=key_index, layer=layer, head=head,
        kv_head=kv_head, num_layers=L, num_heads=record.shape.H, num_kv_heads=record.shape.Hkv,
        head_dim=record.shape.D, width=layout.width, causal=record.causal, chosen=chosen,
        query_vector=steps.query_vector, key_vector=pair.key_vector,
        attention_scalar=float(pair.attention_scalar), scale=record.scale,
        scaled_scalar=float(pair.scaled_scalar), score=float(pair.score),
        weights=steps.weights.float(),
        value_vector=pair.value_vector, scaled_value_vector=pair.scaled_value_vector,
        contextualized=steps.contextualized,
        model_output=record.out[0, head, query_index].double(),
        masked=not pair.allowed,
        contributions=contributions,
        query_unrotated=record.q_before_rotary[0, head, query_index].double() if rotated else None,
        key_unrotated=None if not rotated or record.k_before_rotary is None  # shared keys
        else record.k_before_rotary[0, kv_head, key_index].double(),
        target=target, query_tokens=query_tokens,
        softcap=record.softcap, bias=bias, window=record.window, outside_window=outside,
        anatomy=layout.anatomy(layer), **late, **spans,
    )  # fmt: skip


def _linear_trace(
    pretrained,
    text,
    source,
    query,
    key,
    query_index,
    key_index,
    layer,
    head,
    layout,
    chosen,
    record,
    steps,
    seen,
) -> Trace:
    """A linear layer's trace: the memory's steps (`loop_memory.MemorySteps`) for the pair.
    No softmax: the weights are effective weights, what the query reads of each value; a key
    after the query (which the query's memory has not yet been written with) has weight 0."""
    T = len(source.tokens)
    weights = torch.zeros(T, dtype=torch.float64)
    weights[: query_index + 1] = steps.weights
    query_vector = record.q[0, head, query_index].double()  # (Dk,) normalized, unscaled
    key_vector = record.k[0, head, key_index].double()
    value_vector = record.v[0, head, key_index].double()
    scalar = float(query_vector @ key_vector)
    written = key_index <= query_index
    pair = steps.pairs[key_index] if written else None
    beta = None if pair is None else float(pair.write_strength)
    fade = None
    if pair is not None:
        later = [p.fade for p in steps.pairs[key_index + 1 :]]
        fade = float(torch.stack(later).prod(0).mean()) if later else 1.0
    carried = None
    if pair is not None and beta != 0:
        carried = float(pair.effective_weight) / beta
    contributions = [
        Contribution(source.tokens[p.key_index], p.key_index, float(p.effective_weight),
                     float(p.scaled_value_vector.norm()))
        for p in steps.pairs
    ]  # fmt: skip
    found = getattr(seen, "experts", {}).get(layer)
    fades = record.linear.decay.dim() == 4  # (B, H, T, Dk): one fade per key channel
    return Trace(
        source=pretrained.source, text=text, tokens=list(source.tokens), query=query, key=key,
        query_index=query_index, key_index=key_index, layer=layer, head=head, kv_head=head,
        num_layers=layout.num_layers, num_heads=record.shape.H, num_kv_heads=record.shape.H,
        head_dim=record.shape.D, width=layout.width, causal=True, chosen=chosen,
        query_vector=query_vector, key_vector=key_vector, attention_scalar=scalar,
        scale=record.scale, scaled_scalar=scalar * record.scale, score=scalar * record.scale,
        weights=weights.float(), value_vector=value_vector,
        scaled_value_vector=weights[key_index] * value_vector,
        contextualized=steps.contextualized, model_output=record.out[0, head, query_index].double(),
        masked=not written or not pair.allowed, contributions=contributions,
        anatomy=layout.anatomy(layer),
        experts=None if found is None else found.describe(0, query_index),
        linear="channel" if fades else "head", write_strength=beta, fade=fade, carried=carried,
        from_state=None if record.linear.state is None else steps.from_state,
    )  # fmt: skip


def _deepseek_v4_trace(pretrained, text, source, query, key, query_index, key_index, layer,
                       head, layout, chosen, record, steps, seen) -> Trace:  # fmt: skip
    """A DeepSeek-V4 layer's trace (`qkv.inspect.trace_compressed`): weights on the words,
    and in a compressed layer what the query attended to."""
    found = compressed_steps(pretrained.model, record, layer, head, query_index, key_index, steps)
    shares = zip(source.tokens, found.pop("contributions"), strict=True)  # (weight, size)
    contributions = [Contribution(token, i, w, size) for i, (token, (w, size)) in enumerate(shares)]
    experts = getattr(seen, "experts", {}).get(layer)
    return Trace(
        source=pretrained.source, text=text, tokens=list(source.tokens), query=query, key=key,
        query_index=query_index, key_index=key_index, layer=layer, head=head, kv_head=0,
        num_layers=layout.num_layers, num_heads=record.shape.H, num_kv_heads=record.shape.Hkv,
        head_dim=record.shape.D, width=layout.width, causal=True, chosen=chosen,
        query_vector=steps.query_vector, scale=record.scale,
        contextualized=steps.contextualized, model_output=record.out[0, head, query_index].double(),
        contributions=contributions, anatomy=layout.anatomy(layer),
        experts=None if experts is None else experts.describe(0, query_index), **found,
    )  # fmt: skip


def _late_steps(record, head: int, query: int, key: int, steps) -> dict:
    """What a late-2026 layer adds to one pair's steps: the query's temperature, the head's
    sink and the share it took, and the chunks of the query and key words."""
    found: dict = {"chunk": record.chunk}
    if record.query_scale is not None:
        scales = record.query_scale.expand(record.shape.B, record.shape.Tq)
        found["temperature"] = float(scales[0, query])
    if record.sinks is not None:
        found["sink"] = float(record.sinks[head])
        found["sink_weight"] = float(steps.sink_weight)
    if record.chunk is not None:
        start = 0 if record.chunk_start is None else int(record.chunk_start[0])
        shift = record.shape.Tk - record.shape.Tq  # queries sit at the end of the keys
        found["query_chunk"] = (query + shift - start) // record.chunk
        found["key_chunk"] = (key - start) // record.chunk
    return found


def attention_vectors(pretrained, text: str) -> tuple[Tensor, Tensor, Tensor]:
    """Every layer's and head's query, key and value vectors over `text`: (L, H, T, D) each.

    The vectors `attend` received, read from the layers' records (`Attentions.vectors`):
    after rotary rotation; with grouped key/value heads, each query head gets the key/value
    head it reads. Any (query, key) pair's steps can be redone from them: weights =
    softmax(q k^T / sqrt(D)) (causal for decoders), and the contextualized vectors = weights v.
    """
    if not isinstance(pretrained.model, Encoder | Decoder):
        raise ValueError(
            f"attention_vectors supports encoders and decoders, not {type(pretrained.model)}"
        )
    seen = pretrained.attentions(text)
    beyond = why_not_redone(seen.records, applies=())
    if beyond is not None:
        raise ValueError(f"the weights are not softmax(q k^T * scale) alone: {beyond}")
    return seen.vectors()

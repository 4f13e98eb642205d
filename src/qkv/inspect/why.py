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

import torch
from torch import Tensor

from qkv.inspect.records import check_head_outputs
from qkv.inspect.residual import check_walkable, walk
from qkv.inspect.score_parts import read, read_self
from qkv.inspect.why_parts import Carried, Check, Why, Word, carried, check_sum, checks, notes
from qkv.models import Decoder, EncoderDecoder
from qkv.models.stacks import self_attention_stack
from qkv.nn.delta import GatedDeltaNet
from qkv.nn.edit import Edit

__all__ = ["Carried", "Check", "Why", "cross_why", "encoded_why", "stack_why", "why"]


def why(
    pretrained, text: str, query: str, key: str, *, layer: int | None = None,
    head: int | None = None, target: str | None = None, checks: int = 3,
) -> Why:  # fmt: skip
    """Why `query` attends to `key` in `text` as much as it does: the score taken apart.

    layer, head: counted from 0; by default the pair where the query word attends to the key
    word most (as `qkv.trace`). Words are as `Encoded.find` takes them: "bank", or "bank#2"
    (the first token of each word stands for it). checks: how many top parts of each side to
    remove for real (0: none). Encoder-decoder models take cross-attention apart with a
    `target`: the key word is in `text` (the source, read by the encoder), the query word in
    `target` (read by the decoder), as `qkv.trace` reads them.
    """
    if target is not None:
        return _cross(pretrained, text, target, query, key, layer, head, checks)
    encoded = pretrained.encode(text)
    query_index, key_index = encoded.find(query)[0], encoded.find(key)[0]
    found = encoded_why(pretrained.model, encoded, query_index, key_index, layer=layer,
                        head=head, checks=checks, source=pretrained.source)  # fmt: skip
    found.text, found.query, found.key = text, query, key
    return found


def encoded_why(
    model, encoded, query_index: int, key_index: int, *, layer: int | None = None,
    head: int | None = None, checks: int = 3, source: str = "the model",
) -> Why:  # fmt: skip
    """`why` at token positions of an `Encoded` text, as a page knows a clicked pair: the same
    numbers as `why` of the words at those tokens. Its `query` and `key` are the words' names
    ("bank#2") where the positions are words' first tokens, else the tokens'; its tokens are
    spelled as people read them (`Encoded.pieces`: " river", not "Ġriver")."""
    stack = self_attention_stack(model, "qkv.why", source)
    found = stack_why(stack, torch.tensor([encoded.ids]), query_index, key_index, layer=layer,
                      head=head, checks=checks, spell=list(encoded.pieces or encoded.tokens),
                      source=source)  # fmt: skip
    named = {word.token_span[0]: word.name for word in encoded.words()}
    found.text = encoded.text
    found.query = named.get(query_index, encoded.tokens[query_index])
    found.key = named.get(key_index, encoded.tokens[key_index])
    return found


def stack_why(
    stack, ids: Tensor, query_index: int, key_index: int, *, layer: int | None = None,
    head: int | None = None, checks: int = 3, spell: list[str] | None = None,
    source: str = "the model",
) -> Why:  # fmt: skip
    """`why` on an Encoder or Decoder over ids (1, T), at token positions."""
    with torch.inference_mode():
        return _stack_why(stack, ids, query_index, key_index, layer, head, checks, spell, source)


def _stack_why(stack, ids, query_index, key_index, layer, head, top, spell, source) -> Why:
    check_walkable(stack, source, "qkv.why")
    T = ids.shape[1]
    _check_position("query", query_index, T)
    _check_position("key", key_index, T)
    spell = spell if spell is not None else [str(i) for i in ids[0].tolist()]
    _check_layer_index(layer, stack.config.num_layers, source)
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
    _check_head(head, H, layer)
    check_head_outputs({m: out.records[m] for m in range(layer + 1)}, "qkv.why")
    record = out.records[layer]
    steps = record.steps(head, query_index)
    pair = steps.pairs[key_index]
    if not pair.allowed:
        raise ValueError(f"the query word (token {query_index}) does not see the key word (token "
                         f"{key_index}) in layer {layer}: the layer's mask hides it, so no score "
                         "of the pair reaches the softmax")  # fmt: skip
    stream = walk(stack, out, layer, [query_index, key_index], ids=ids)
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
    check_sum(found, record, getattr(stack.blocks[layer].attn, "qk_norm", None) == "l2")
    found.notes += notes(found)
    words = (Word(stack, out, stream, 0, query_index, spell),
             Word(stack, out, stream, 1, key_index, spell))  # fmt: skip
    found.carried = carried(found, words, (q, k), factor)
    if top:
        # a decoder's words after the pair change nothing of it: the reruns leave them out
        end = max(query_index, key_index) + 1 if isinstance(stack, Decoder) else T

        def rerun(side: str, m: int, h: int | None, position: int):
            edit = _zeroed(out.records[m].shape.H, end, h, position)
            again = stack(ids[:, :end], layers=[layer], edits={m: edit},
                          resume=(m, out.hidden_states[m][:, :end]), stop=layer + 1)  # fmt: skip
            return again.records[layer]

        k_at_query = read_self(stack, layer, stream, 0, "key", head, T)
        keys = record.k[0, found.kv_head, :end].double()
        found.checks = checks(found, words, (q, k, k_at_query), keys, steps, factor, top, rerun)
    return found


def _check_position(name: str, index: int, T: int) -> None:
    if type(index) is not int or not 0 <= index < T:
        raise ValueError(f"the {name} position {index} is outside the text's {T} tokens")


def _check_layer_index(layer: int | None, L: int, source: str) -> None:
    if layer is not None and (type(layer) is not int or not 0 <= layer < L):
        raise ValueError(f"layer {layer!r} is out of range: {source} has layers 0..{L - 1}")


def _check_head(head: int, H: int, layer: int) -> None:
    if type(head) is not int or not 0 <= head < H:
        raise ValueError(f"head {head!r} is out of range: layer {layer} has heads 0..{H - 1}")


def _check_layer(stack, layer: int, source: str) -> None:
    attn = stack.blocks[layer].attn
    if isinstance(attn, GatedDeltaNet):
        raise ValueError(f"layer {layer} of {source} is linear attention (a running memory): it "
                         "computes no score between two words to take apart")  # fmt: skip


def _best(stack, out, query_index, key_index, layer, head) -> tuple[int, int]:
    """The (layer, head) where the query word's weight on the key word peaks, among the layers
    whose scores `why` takes apart."""
    best = None
    layers = range(stack.config.num_layers) if layer is None else [layer]
    for m in layers:
        attn = stack.blocks[m].attn
        if isinstance(attn, GatedDeltaNet):
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


def _zeroed(H: int, T: int, head: int | None, position: int) -> Edit:
    """An Edit that zeroes one head's output (or, head None, the MLP's) at one position."""
    if head is None:
        return Edit(mlp=torch.arange(T)[None] == position)
    heads = torch.zeros(1, H, T, 1, dtype=torch.bool)
    heads[0, head, position] = True
    return Edit(heads=heads)


def _cross(pretrained, text, target, query, key, layer, head, top) -> Why:
    model = pretrained.model
    if not isinstance(model, EncoderDecoder):
        raise ValueError(f"a target text is for encoder-decoder models' cross-attention; "
                         f"{pretrained.source} is not one")  # fmt: skip
    encoded = pretrained.encode(text)
    targets, query_tokens, queries = pretrained.decoder_input(target)
    query_index = 1 + queries.find(query)[0]  # the decoder reads its start token first
    key_index = encoded.find(key)[0]
    found = cross_why(model, torch.tensor([encoded.ids]), targets, query_index, key_index,
                      layer=layer, head=head, checks=top,
                      spell=list(encoded.pieces or encoded.tokens),
                      query_spell=list(query_tokens), source=pretrained.source)  # fmt: skip
    found.text, found.query, found.key = text, query, key
    return found


def cross_why(
    model: EncoderDecoder, source_ids: Tensor, target_ids: Tensor, query_index: int,
    key_index: int, *, layer: int | None = None, head: int | None = None, checks: int = 3,
    spell: list[str] | None = None, query_spell: list[str] | None = None,
    source: str = "the model",
) -> Why:  # fmt: skip
    """`why` of an encoder-decoder's cross-attention: the query at token `query_index` of
    target_ids (1, Tt), read by the decoder, the key at `key_index` of source_ids (1, S). The
    query's parts are the decoder's (its earlier cross-attention heads "L2.cross.H3" among
    them), the key's the encoder's ("enc.L4.H1"), carried through its final norm."""
    with torch.inference_mode():
        return _cross_why(model, source_ids, target_ids, query_index, key_index, layer, head,
                          checks, spell, query_spell, source)  # fmt: skip


def _cross_why(model, src, tgt, query_index, key_index, layer, head, top, spell, query_spell,
               source) -> Why:  # fmt: skip
    encoder, decoder = model.encoder, model.decoder
    check_walkable(encoder, source, "qkv.why")
    check_walkable(decoder, source, "qkv.why")
    S, T = src.shape[1], tgt.shape[1]
    _check_position("query", query_index, T)
    _check_position("key", key_index, S)
    spell = spell if spell is not None else [str(i) for i in src[0].tolist()]
    query_spell = query_spell if query_spell is not None else [str(i) for i in tgt[0].tolist()]
    L = decoder.config.num_layers
    _check_layer_index(layer, L, source)
    enc = encoder(src, layers="all", hidden_states=True)
    dec = decoder(tgt, context=enc.hidden, layers="all", cross_layers="all", hidden_states=True,
                  logits=False)  # fmt: skip
    chosen = "asked"
    if layer is None or head is None:
        layer, head = _best_cross(dec, query_index, key_index, layer, head)
        chosen = "where the query word attends most to the key word"
    block = decoder.blocks[layer]
    _check_head(head, block.cross_attn.num_heads, layer)
    check_head_outputs(dict(enumerate(enc.records.values())), "qkv.why")
    record = dec.cross_records[layer]
    steps = record.steps(head, query_index)
    pair = steps.pairs[key_index]
    q_stream = walk(decoder, dec, layer, [query_index], into=True, ids=tgt)
    k_stream = walk(encoder, enc, encoder.config.num_layers, [key_index], ids=src)
    norm = block.cross_norm if block.position == "pre" else None
    q = read(block.cross_attn, norm, None, q_stream, 0, "query", head, layer)
    k = read(block.cross_attn, encoder.norm, None, k_stream, 0, "key", head, layer)
    factor = record.scale
    found = Why(
        source=source, text="", tokens=spell, query="", key="", query_index=query_index,
        key_index=key_index, layer=layer, head=head, kv_head=head // record.shape.group,
        chosen=chosen, score=float(pair.score), pre_cap=float(pair.scaled_scalar),
        softcap=record.softcap, bias=None, sink=None, weight=float(pair.normalized_weight),
        scale=record.scale, temperature=None, parts_q=list(q_stream.names),
        parts_k=[f"enc.{name}" for name in k_stream.names],
        terms=factor * q.vectors @ k.vectors.T, content=None, query_tokens=query_spell,
    )  # fmt: skip
    check_sum(found, record, False)
    found.notes += notes(found)
    found.notes.append(
        "cross-attention: the query's parts are the decoder's, up to this layer's own "
        "self-attention; the key's are the encoder's (enc.), through its final norm"
    )
    words = (Word(decoder, dec, q_stream, 0, query_index, query_spell),
             Word(encoder, enc, k_stream, 0, key_index, spell, "enc."))  # fmt: skip
    found.carried = carried(found, words, (q, k), factor)
    if top:

        def rerun(side: str, m: int, h: int | None, position: int):
            if side == "query":
                edit = _zeroed(dec.records[m].shape.H, T, h, position)
                context, first, edits = enc.hidden, (m, dec.hidden_states[m]), {m: edit}
            else:
                edit = _zeroed(enc.records[m].shape.H, S, h, position)
                context = encoder(src, edits={m: edit}, resume=(m, enc.hidden_states[m])).hidden
                first, edits = None, None
            return decoder(tgt, context=context, cross_layers=[layer], edits=edits, resume=first,
                           stop=layer + 1, logits=False).cross_records[layer]  # fmt: skip

        keys = record.k[0, found.kv_head].double()
        found.checks = checks(found, words, (q, k, None), keys, steps, factor, top, rerun)
    return found


def _best_cross(dec, query_index, key_index, layer, head) -> tuple[int, int]:
    best = None
    for m, record in sorted(dec.cross_records.items()):
        if layer is not None and m != layer:
            continue
        heads = list(range(record.shape.H)) if head is None else [head]
        row = record.weights(heads)[0, :, query_index, key_index]
        n = int(row.argmax())
        if best is None or row[n] > best[0]:
            best = (float(row[n]), m, heads[n])
    return best[1], best[2]

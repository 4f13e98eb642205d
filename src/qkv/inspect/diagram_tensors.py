"""The real tensor behind every box of a model diagram, for any family the diagram draws.

`qkv.cache` names a pre-norm decoder's activations; the diagram also draws encoders (MiniLM,
the tour's default), post-norm blocks and encoder-decoders. `diagram_tensors` runs the model
once with every layer's record and every block's input and names what the pass computed, in
the diagram's names (docs/diagram.md): each is the record's own tensor, a block's states, or
made from them by the block's own norms and matrices, never a second model.

>>> import qkv
>>> found = diagram_tensors(qkv.load("minilm"), "the bank of the river")
>>> found["L3.q"].shape  # (B, H, T, D)
torch.Size([1, 12, 7, 32])
"""

from __future__ import annotations

import torch
from torch import Tensor

from qkv.attention.eager import compute_dtype
from qkv.inspect.diagram import model_diagram
from qkv.models import Decoder, Encoder, EncoderDecoder
from qkv.nn.head_edits import per_query_head


def diagram_tensors(model, text, *, target=None) -> dict[str, Tensor]:
    """{name: tensor} of one pass over `text` (a text where `model` is a Pretrained, or ids
    (B, T)); an encoder-decoder also reads `target` (a text, read after the decoder's start
    token, or ids (B, T)). Names: every box's `tensor` with its layer filled in, for every
    layer ("L0.q", ..., "enc.L5.z"), and "tokens" (the ids)."""
    stack = getattr(model, "model", model)
    model_diagram(stack, 1)  # refuses, by name, what the diagram does not draw
    ids = _ids(model, text, "text")
    with torch.no_grad():
        if not isinstance(stack, EncoderDecoder):
            return _stack_tensors(stack, ids, "")
        if target is None:
            raise ValueError("an encoder-decoder reads a source and a target: give target=")
        start = [model.decoder_start()] if isinstance(target, str) else []
        target_ids = _ids(model, target, "target", start)
        if target_ids.shape[0] != ids.shape[0]:
            raise ValueError(f"{ids.shape[0]} source rows but {target_ids.shape[0]} target rows")
        found = _stack_tensors(stack.encoder, ids, "enc.")
        return found | _stack_tensors(stack.decoder, target_ids, "", found["enc.final"])


def _ids(model, text, what: str, start: list[int] | None = None) -> Tensor:
    if isinstance(text, Tensor):
        if text.dim() != 2 or text.dtype != torch.long:
            raise ValueError(f"{what} as ids must be a (B, T) long tensor, got {text.dtype} "
                             f"{tuple(text.shape)}")  # fmt: skip
        return text
    if not isinstance(text, str) or not hasattr(model, "encode"):
        raise ValueError(f"{what} must be ids (B, T), or a text where the model is a Pretrained")
    return torch.tensor([[*(start or []), *model.encode(text).ids]])  # (1, T)


def _stack_tensors(stack: Encoder | Decoder, ids: Tensor, prefix: str,
                   context: Tensor | None = None) -> dict[str, Tensor]:  # fmt: skip
    extra = {} if context is None else {"context": context, "cross_layers": "all"}
    if getattr(stack, "mlm", None) is not None:  # an encoder's masked-language-model head
        extra["logits"] = True
    out = stack(ids, layers="all", hidden_states=True, **extra)
    B, T, rotary = *ids.shape, stack.config.position == "rotary"
    found = {f"{prefix}tokens": ids, f"{prefix}embed": out.hidden_states[0],
             f"{prefix}final": out.hidden}  # fmt: skip
    if getattr(out, "logits", None) is not None:
        found[f"{prefix}logits"] = out.logits
    for n, record in sorted(out.records.items()):
        block, resid_pre = stack.blocks[n], out.hidden_states[n]
        pre, post = block.position == "pre", block.position == "post"
        resid_mid = resid_pre + record.attn_out  # (B, T, C): before a post-norm
        names = {
            "resid_pre": resid_pre, "attn_in": block.attn_norm(resid_pre) if pre else resid_pre,
            **_heads(record, "", rotary), "attn_out": record.attn_out, "resid_mid": resid_mid,
            "mlp_out": record.mlp_out, "resid_post": out.hidden_states[n + 1],
        }  # fmt: skip
        stream = block.attn_norm(resid_mid) if post else resid_mid
        if context is not None:
            cross = out.cross_records[n]
            cross_in = block.cross_norm(stream) if pre else stream
            z = cross.out.transpose(1, 2).reshape(B, T, -1)  # (B, T, H*D): heads side by side
            cross_out = block.cross_attn.out(z)  # (B, T, C)
            if block.cross_out_norm is not None:
                cross_out = block.cross_out_norm(cross_out)
            stream = stream + cross_out
            names |= {"cross_in": cross_in, **_heads(cross, "cross_"), "cross_out": cross_out,
                      "resid_cross": stream}  # fmt: skip
            stream = block.cross_norm(stream) if post else stream
        if block.parallel:  # the MLP reads the layer input, beside attention
            stream = resid_pre
        names["mlp_in"] = block.mlp_norm(stream) if pre else stream
        found |= {f"{prefix}L{n}.{name}": value for name, value in names.items()}
    return found


def _or(tensor: Tensor | None, otherwise: Tensor) -> Tensor:
    return otherwise if tensor is None else tensor


def _heads(record, kind: str, rotary: bool = False) -> dict[str, Tensor]:
    """q, k, v, scores (q.k^T times the scale, -inf where a query did not see a key, before
    any cap or bias), weights and z of one attention record; the position bias where one.
    rotary: the stack's positions rotate, so q and k before rotary are named in every layer
    (those of a layer without positions, SmolLM3's, are its q and k)."""
    k = per_query_head(record.k, record.q.shape[1])  # (B, H, Tk, D)
    scores = (record.q @ k.transpose(-1, -2)).to(compute_dtype(record.q.dtype)) * record.scale
    found = {"q": record.q, "k": record.k, "v": record.v, "z": record.out,
             "scores": scores.masked_fill(~record.allowed, float("-inf")),
             "weights": record.weights()}  # fmt: skip
    if record.q_before_rotary is not None or (rotary and not kind):  # none turned: the same
        found |= {"q_before_rotary": _or(record.q_before_rotary, record.q),
                  "k_before_rotary": _or(record.k_before_rotary, record.k)}  # fmt: skip
    if record.bias is not None:
        found["bias"] = record.bias.expand(record.q.shape[0], -1, -1, -1)  # (B, H, Tq, Tk)
    return {kind + name: value for name, value in found.items()}

"""The attention function transformers calls for `attn_implementation="qkv"`, and what it keeps.

transformers hands every attention layer's call to one function: the module, q (B, H, Tq, D),
k and v (B, Hkv, Tk, D) after its rotary positions, the mask it built, the scale, the dropout,
and family-specific keyword arguments (a sliding window, Gemma 2's soft-cap, gpt-oss's sinks).
`attention` turns them into one `qkv.attend` call: the mask into qkv's (boolean, True where a
query may see a key; the causal rule and a window found in it given as `causal` and `window`,
so the fast unmasked kernels run), grouped key/value heads passed as they are. With
`output_attentions` it returns each layer's weights, recomputed from that call's q and k (and
the kernel's log-sum-exp where it has one) as qkv's `AttentionRecord` does: what eager gives.

What it cannot compute exactly it refuses by name: a model class when the model is made or
switched to "qkv" (`qkv.hf.refusals`), `check(model)` before the first forward, and every
call for the keyword arguments it receives. Weights are made where they are asked for: by
`output_attentions` in the call, or by transformers collecting attentions for the forward.

The mask transformers builds for a registered implementation is the one of the mask function
registered under the same name (transformers builds none for an implementation without one):
`register` registers sdpa's, boolean, and None where the causal rule alone is the mask.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from qkv.attention import attend, attend_for_record, attention_weights, explain_choice
from qkv.attention.eager import compute_dtype, takes_into
from qkv.attention.inputs import allowed_keys, check_indices
from qkv.attention.registry import resolve_backend
from qkv.hf.refusals import (
    EAGER,
    MODULE_REFUSALS,
    class_refusal,
    guard_loading,
    refuse_arguments,
    sinks_as_qkv,
)
from qkv.nn.record import AttentionRecord

try:
    from transformers.utils.output_capturing import _active_collector
except ImportError:  # a transformers without the recorder passes output_attentions itself
    _active_collector = None

NAME = "qkv"  # attn_implementation="qkv"
KEEP = "_qkv_keep"  # the attribute `keep` sets on a model's modules while it is active

_REGISTERED: dict[str, str] = {}  # attn_implementation name -> qkv backend


def register(name: str = NAME, *, backend: str = "auto") -> None:
    """Make `attn_implementation=name` run qkv's attention (importing qkv.hf registers "qkv").

    backend: the qkv backend every call uses ("auto": the fastest for the inputs and device,
    see `qkv.explain_choice`). Registering a name again with the same backend does nothing;
    with another it is refused, since models already loaded with it would change silently.
    """
    resolve_backend(backend)  # an unknown backend is refused by name
    for word in ("flash", "sdpa", "/", ":"):
        if word in name or not name:
            raise ValueError(
                f"attn_implementation name {name!r} cannot contain {word!r}: transformers "
                "treats such names as its own flash or sdpa attention, or as a hub kernel"
            )
    if _REGISTERED.get(name, backend) != backend:
        raise ValueError(
            f"attn_implementation {name!r} is registered with qkv backend "
            f"{_REGISTERED[name]!r}; register another name for {backend!r}"
        )
    AttentionInterface.register(name, functools.partial(attention, backend=backend))
    AttentionMaskInterface.register(name, sdpa_mask)  # boolean, True = may attend
    _REGISTERED[name] = backend
    guard_loading(_REGISTERED.__contains__)  # a model qkv would not compute is refused at load


def check(model: nn.Module) -> None:
    """Refuse by name, before any forward, what qkv's attention cannot compute exactly in a
    transformers `model`: one not loaded with a qkv attn_implementation, one whose class is
    refused at load (`qkv.hf.refusals.class_refusal`: its attention is its own code, or is
    given what qkv does not compute), or one with modules holding attention sinks or a
    relative position bias. Each call checks its own arguments too."""
    config = model.config
    implementation = getattr(config, "_attn_implementation", None)
    if implementation not in _REGISTERED:
        raise ValueError(
            f"{type(model).__name__} runs attn_implementation={implementation!r}; load it with "
            f"attn_implementation={NAME!r} (after import qkv.hf) or one of {sorted(_REGISTERED)}"
        )
    for name, module in model.named_modules():
        for attribute, what in MODULE_REFUSALS.items():
            if attribute == "sinks" and sinks_as_qkv(module):
                continue
            if getattr(module, attribute, None) is not None:
                raise ValueError(
                    f"{name} ({type(module).__name__}) uses {what}, which qkv's attention does "
                    "not compute; load this model with attn_implementation='eager'"
                )
    wrong = class_refusal(type(model))
    if wrong is not None:
        raise ValueError(f"{wrong}; {EAGER}")


@dataclass(eq=False)
class Kept:
    """What `keep` asked of a model, and what its latest forward kept of the layers asked.

    weights: layer -> (B, len(heads), Tq, Tk), the weights `output_attentions=True` returned
    for that layer (the same tensors as the output's `attentions`, which lists the layers
    asked only, in order); records: layer -> `AttentionRecord` of the layer's latest call,
    with `records=True`; modules: layer -> the attention module that made it.
    """

    layers: list[int]
    heads: list[int] | None  # None: every head
    record: bool  # keep each asked layer's AttentionRecord
    weights: dict[int, Tensor] = field(default_factory=dict)
    records: dict[int, AttentionRecord] = field(default_factory=dict)
    modules: dict[int, nn.Module] = field(default_factory=dict)

    def layer_of(self, module: nn.Module) -> int:
        layer = getattr(module, "layer_idx", None)
        if not isinstance(layer, int):
            raise ValueError(
                f"keep chooses layers by their layer_idx, and {type(module).__name__} has "
                "none; leave keep out to have every layer's weights"
            )
        return layer


@contextmanager
def keep(
    model: nn.Module,
    *,
    layers: Sequence[int] | str | None = "all",
    heads: Sequence[int] | None = None,
    records: bool = False,
) -> Iterator[Kept]:
    """While active, `model`'s qkv attention keeps the layers and heads asked, nothing else.

    layers ("all" or None for every one) and heads (None for every one), counted from 0: with
    output_attentions=True the forward returns only their weights, computed for those heads
    only; the other layers return None (transformers then leaves them out of `attentions`),
    so no other layer's (T, T) weights are ever made. records: also keep each asked layer's
    `AttentionRecord` (q, k, v, mask, scale: what qkv's inspection reads) in `Kept.records`.

        with keep(model, layers=[0, 5], heads=[2]) as kept:
            out = model(ids, output_attentions=True)
        len(out.attentions), kept.weights[5].shape  # 2, (1, 1, T, T)
    """
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else None
    config = config or model.config
    name = type(model).__name__
    if getattr(model.config, "is_encoder_decoder", False):
        raise ValueError(
            f"keep chooses the layers of an encoder or a decoder; {name} is an encoder-decoder, "
            "whose encoder and decoder layers share their numbers"
        )
    L, H = config.num_hidden_layers, config.num_attention_heads
    every = layers is None or (isinstance(layers, str) and layers == "all")
    chosen = check_indices("layer", None if every else layers, L, name)
    shown = None if heads is None else check_indices("head", heads, H, name)
    if not chosen or shown == []:
        raise ValueError("no layer or no head asked for; leave layers and heads out for all")
    modules = list(model.modules())
    if any(getattr(m, KEEP, None) is not None for m in modules):
        raise ValueError(f"keep is already active on this {name}; one keep at a time")
    kept = Kept(chosen, shown, records)
    for module in modules:
        setattr(module, KEEP, kept)
    try:
        yield kept
    finally:
        for module in modules:
            delattr(module, KEEP)


def attention(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    *,
    backend: str = "auto",
    **kwargs,
) -> tuple[Tensor, Tensor | None]:
    """transformers' attention interface on `qkv.attend`: query (B, H, Tq, D), key and value
    (B, Hkv, Tk, D), attention_mask as transformers built it; returns out (B, Tq, H, D) and,
    with output_attentions, the weights (B, H, Tq, Tk) in the query's dtype (None otherwise).
    A query that may see no key (a left-padding position) gets zeros, as sdpa gives it, where
    eager gives it a uniform row."""
    refuse_arguments(module, kwargs)
    Tq, D = query.shape[2:]
    Tk = key.shape[2]
    if value.shape[:3] != key.shape[:3]:
        raise ValueError(
            f"{type(module).__name__} has value vectors of shape {tuple(value.shape)} beside "
            f"keys of {tuple(key.shape)}; qkv's attention needs one value per key"
        )
    is_causal = kwargs.get("is_causal")
    is_causal = getattr(module, "is_causal", True) if is_causal is None else bool(is_causal)
    mask, causal, window, bias = _converted(attention_mask, is_causal,
                                            kwargs.get("sliding_window"), Tq, Tk,
                                            getattr(module, "layer_idx", None))  # fmt: skip
    if attention_mask is None and causal and 1 < Tq < Tk:
        # a static cache's empty slots after the queries: sdpa drops them too
        key, value = key[:, :, :Tq], value[:, :, :Tq]
    softcap = kwargs.get("softcap")
    sinks = kwargs.get("s_aux")  # gpt-oss: one learned score per head, in every softmax
    scale = 1.0 / math.sqrt(D) if scaling is None else float(scaling)
    asked = _asked(module, kwargs)
    kept = getattr(module, KEEP, None)
    layer, heads, record = None, None, False
    if kept is not None:
        layer = kept.layer_of(module)
        if layer not in kept.layers:
            asked = False
        heads, record = kept.heads, kept.record and layer in kept.layers
    variants = dict(mask=mask, causal=causal, scale=scale, window=window, softcap=softcap,
                    bias=bias, sinks=sinks)  # fmt: skip
    if dropout and module.training:
        if record:
            raise ValueError(
                "a record of a layer that drops attention weights (training with dropout) "
                "would not redo its output; call model.eval() to keep records"
            )
        out, weights = _dropped(query, key, value, dropout, variants)
        weights = (weights if heads is None else weights[:, heads]) if asked else None
    elif _together(query, key, value, asked, heads, backend, variants):
        # every head's weights asked for a plain causal text on the CPU: made with the
        # output, a block of queries at a time, rather than after a fused kernel's pass
        weights = query.new_empty(query.shape[1:3] + key.shape[2:3],
                                  dtype=compute_dtype(query.dtype))  # fmt: skip
        attended = attend_for_record(query, key, value, weights=weights, **variants)
        assert attended.made is weights  # `_together` asked eager's `takes_into` first
        out = attended.out
        weights = weights[None].to(query.dtype)
        if record:
            kept.records[layer] = AttentionRecord(query, key, value, out, None, True, scale,
                                                  "eager")  # fmt: skip
    elif not (asked or record):  # the output alone: attend chooses the backend itself
        out, weights = attend(query, key, value, backend=backend, **variants), None
    else:
        name = backend
        if name == "auto":  # the record names the backend that ran
            name = explain_choice(query, key, value, **variants).backend
        # with the log-sum-exp of a backend that makes one (flash): it turns q and k into any
        # head's weights directly
        attended = attend_for_record(query, key, value, backend=name, **variants)
        out, lse = attended.out, attended.lse
        seen = AttentionRecord(query, key, value, out, mask, causal, scale, name, lse,
                               window=window, softcap=softcap, bias=bias,
                               sinks=None if sinks is None else sinks.detach())  # fmt: skip
        weights = _weights(seen, heads).to(query.dtype) if asked else None
        if record:
            kept.records[layer] = seen
    if weights is not None and weights.shape[-1] < Tk:  # the cropped slots: weight 0
        weights = F.pad(weights, (0, Tk - weights.shape[-1]))
    if kept is not None and layer in kept.layers:
        kept.modules[layer] = module
        if weights is not None:
            kept.weights[layer] = weights
    return out.transpose(1, 2).contiguous(), weights  # (B, Tq, H, D)


_MASKS: dict[int, tuple] = {}  # id(mask) -> (mask, arguments, last layer, qkv's mask)


def _converted(attention_mask, causal: bool, window, Tq: int, Tk: int, layer: int | None):
    """qkv_mask of this call, remembered for the forward's next layers: transformers hands
    every layer of a forward the same mask tensor (one per kind of layer), and comparing it
    with the causal rule costs more than the attention of one decoding step. Reused only by a
    later layer (`layer_idx`) of the same forward: a layer at or before the one last seen
    starts a new forward and converts again, so a mask changed in place between forwards
    (an inference tensor counts no versions) is read afresh. Kept by the tensor itself, so
    no other can take its place."""
    if not isinstance(attention_mask, Tensor) or not isinstance(layer, int):
        return qkv_mask(attention_mask, causal, window, Tq, Tk)
    version = None if attention_mask.is_inference() else attention_mask._version
    arguments = (version, causal, window, Tq, Tk)
    found = _MASKS.get(id(attention_mask))
    if found and found[0] is attention_mask and found[1] == arguments and layer > found[2]:
        _MASKS[id(attention_mask)] = (*found[:2], layer, found[3])
        return found[3]
    if len(_MASKS) >= 4:  # a forward's kinds of mask: full, sliding, chunked
        _MASKS.clear()
    converted = qkv_mask(attention_mask, causal, window, Tq, Tk)
    _MASKS[id(attention_mask)] = (attention_mask, arguments, layer, converted)
    return converted


def qkv_mask(
    attention_mask: Tensor | None, causal: bool, window: int | None, Tq: int, Tk: int
) -> tuple[Tensor | None, bool, int | None, Tensor | None]:
    """transformers' mask as qkv's (mask, causal, window, bias).

    None stays None, with the module's causal rule. A mask of one row (B, 1, 1, Tk), the
    key-padding mask some encoders hand over, holds for every query. A boolean mask is True
    where a query may see a key; a float mask is 0 there and the dtype's minimum (or -inf)
    elsewhere, any other value a bias added to the scores (as eager adds the mask). A mask
    that is exactly the causal rule, with the layer's sliding window or without one, for
    every row of the batch becomes causal=True (and window) with no mask, so that the
    unmasked kernels run.

    >>> m = torch.ones(3, 3, dtype=torch.bool).tril()[None, None]
    >>> qkv_mask(m, True, None, 3, 3)
    (None, True, None, None)
    """
    if attention_mask is None:
        return None, causal, None, None
    if not isinstance(attention_mask, Tensor) or attention_mask.dim() != 4:
        kind = type(attention_mask).__name__
        shape = tuple(attention_mask.shape) if isinstance(attention_mask, Tensor) else kind
        raise ValueError(
            f"qkv's attention takes a 4-D (B, 1, Tq, Tk) mask from transformers, got {shape}"
        )
    if attention_mask.shape[-2] == 1 < Tq:  # (B, 1, 1, Tk): the same keys for every query
        attention_mask = attention_mask.expand(-1, -1, Tq, -1)
    bias = None
    if attention_mask.dtype == torch.bool:
        allowed = attention_mask
    elif attention_mask.is_floating_point():
        allowed = attention_mask > torch.finfo(attention_mask.dtype).min / 2  # -inf too
        extra = attention_mask.masked_fill(~allowed, 0.0)
        bias = extra if bool(extra.any()) else None
    else:
        raise ValueError(f"an attention mask is boolean or float, not {attention_mask.dtype}")
    if bias is None:
        for candidate in dict.fromkeys([window, None]):  # the window first, then none
            rule = allowed_keys(None, True, Tq, Tk, allowed.device, candidate)  # (Tq, Tk)
            if torch.equal(allowed, rule.expand_as(allowed)):
                return None, True, candidate, None
        if bool(allowed.all()):
            return None, False, None, None
    return allowed, False, None, bias


def _asked(module: nn.Module, kwargs: dict) -> bool:
    """Whether this call's weights are asked for: `output_attentions` among its arguments, or
    transformers collecting attentions for the forward (its output recorder's hooks read the
    weights each attention module returns; GPT-2 and others drop `output_attentions` before
    the call, so the collector is all that says it), or the model's config asking."""
    if kwargs.get("output_attentions"):
        return True
    collecting = _collector()
    if collecting and ("attentions" in collecting or "cross_attentions" in collecting):
        return True
    return bool(getattr(getattr(module, "config", None), "output_attentions", False))


def _collector() -> dict | None:
    """What transformers' `capture_outputs` is collecting in this forward (None outside one)."""
    return None if _active_collector is None else _active_collector.get()


def _together(query, key, value, asked, heads, backend: str, variants: dict) -> bool:
    """Whether a call's output and every head's weights are made together by eager's
    arithmetic (`attend_for_record` with `weights=`): asked for, one causal sequence with no
    mask, window, soft-cap or bias, on the CPU under "auto" (whose fused kernel would be
    sdpa's), with no gradient to keep."""
    variants = {name: setting for name, setting in variants.items() if name != "scale"}
    return (asked and heads is None and backend == "auto" and query.device.type == "cpu"
            and takes_into(query, key, value, **variants))  # fmt: skip


def _weights(record: AttentionRecord, heads: list[int] | None) -> Tensor:
    """record.weights(heads), (B, H', Tq, Tk); one text's every head computed in place where
    the record is plain (`AttentionRecord.weights_in`: one (H, T, T) tensor, no copy beside
    it)."""
    if record.shape.B == 1 and heads in (None, list(range(record.shape.H))):
        return record.weights_in()[None]
    return record.weights(heads)


def _dropped(query, key, value, dropout: float, variants: dict) -> tuple[Tensor, Tensor]:
    """Eager's training arithmetic: the weights, then dropout on them (the same random draws
    as eager's, a tensor of the same shape and dtype), then the weighted sum of values."""
    B, H, Tq, D = query.shape
    Hkv, Tk = key.shape[1], key.shape[2]
    weights = attention_weights(query, key, **variants).to(query.dtype)  # (B, H, Tq, Tk)
    weights = F.dropout(weights, p=dropout, training=True)
    grouped = weights.reshape(B, Hkv, H // Hkv, Tq, Tk)  # query head h reads h // group
    out = (grouped @ value.unsqueeze(2)).reshape(B, H, Tq, D)
    return out, weights

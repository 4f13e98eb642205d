"""The one door to attention: `attend`, its sibling `attend_for_record`, and the registry of
backends they dispatch to.

A backend is one module with a `forward(q, k, v, *, mask, causal, scale, shape)` plus one
`Backend` entry below that says what it offers. `auto` walks the backends from fastest to
slowest and takes the first whose `supports` and `prefer` have no objection;
`explain_choice` says which and why. Every call is checked once, by `inputs.check_call`,
before any backend sees it.

What a backend offers beside its output, declared in its entry:
- `variants`: the score variants its forward computes. A sliding window and chunks reach every
  backend folded into the mask (each is one). A soft-cap, a score bias, a sink and a query's
  temperature change the scores themselves: a backend lists those its forward takes (as
  `softcap=`, `bias=`, `sinks=`, `query_scale=`), and is never handed, or chosen for, one it
  does not; named for one, it is refused by name. A value head size other than the keys'
  (latent attention) is asked of `supports`, through `Shape.Dv`.
- `forward_lse`: the same call returning (out, lse), the log-sum-exp of every query's scores,
  from which a record recomputes any head's weights (`flash`).
- `weights_into`: the output made together with every head's weights, written into a tensor
  the caller gives, where the backend can compute exactly what `attend` would (`eager`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Unpack

from torch import Tensor

from qkv.attention import eager, loop, sdpa
from qkv.attention.flash import backend as flash
from qkv.attention.inputs import NONE, VARIANT_NAMES, Call, Options, Shape, Variants, check_call

Forward = Callable[..., Tensor]
# (q, k, v, *, mask, causal, scale, shape) -> (out, lse (B, H, Tq) float32)
ForwardLse = Callable[..., tuple[Tensor, Tensor]]
# (weights, q, k, v, *, scale, mask=, causal=, window=, softcap=, bias=) -> out, or None where
# this backend cannot make exactly these weights in that tensor with its output
WeightsInto = Callable[..., Tensor | None]
# (q, mask, causal, shape) -> None when the backend can run these inputs, else the reason.
Supports = Callable[[Tensor, Tensor | None, bool, Shape], str | None]


def _always(q, mask, causal, shape) -> str | None:
    return None


@dataclass(frozen=True)
class Backend:
    name: str
    forward: Forward
    speed_rank: int  # lower is faster; `auto` tries backends in this order
    description: str
    supports: Supports = _always  # can it run these inputs at all (asked by every call)
    prefer: Supports = _always  # asked by `auto` only: should it be chosen for them
    auto: bool = True  # False keeps a backend out of `auto` (the slow oracle)
    variants: frozenset[str] = frozenset()  # of VARIANT_NAMES: what forward computes
    forward_lse: ForwardLse | None = None  # offers the log-sum-exp beside the output
    weights_into: WeightsInto | None = None  # offers the weights made with the output

    @property
    def offers(self) -> frozenset[str]:
        """What this backend gives beside its output: a subset of {"lse", "weights"}, and
        the score variants it computes."""
        extras = {"lse": self.forward_lse is not None, "weights": self.weights_into is not None}
        return frozenset(name for name, on in extras.items() if on) | self.variants

    def lacks(self, variants: Variants) -> str | None:
        """Why this backend cannot compute these score variants, or None."""
        missing = sorted(variants.names - self.variants)
        if not missing:
            return None
        return f"it does not compute {' or '.join(VARIANT_WORDS[name] for name in missing)}"


VARIANT_WORDS = {"softcap": "a score softcap", "bias": "a score bias",
                 "sinks": "a learned sink", "query_scale": "a temperature per query"}  # fmt: skip


BACKENDS: dict[str, Backend] = {}


def register_backend(backend: Backend) -> None:
    """Add (or replace) a backend; `attend(..., backend=name)` can then use it."""
    BACKENDS[backend.name] = backend


register_backend(
    Backend(
        "flash", flash.forward, 5,
        "qkv's Triton kernel (FlashAttention-2), forward and backward; CUDA",
        supports=flash.supports, prefer=flash.prefer, forward_lse=flash.forward_lse,
    )
)  # fmt: skip
register_backend(
    Backend(
        "sdpa", sdpa.forward, 10, "torch's fused scaled_dot_product_attention",
        variants=frozenset({"bias", "sinks", "query_scale"}),
    )
)  # fmt: skip
register_backend(
    Backend(
        "eager", eager.forward, 50, "matmul, softmax, matmul; can return weights",
        variants=frozenset(VARIANT_NAMES), weights_into=eager.forward_into,
    )
)  # fmt: skip
register_backend(
    Backend(
        "loop", loop.forward, 100, "the article, one pair at a time, float64", auto=False,
        variants=frozenset(VARIANT_NAMES),
    )
)  # fmt: skip


@dataclass(frozen=True)
class Choice:
    """Which backend `auto` picks for some inputs, and why each faster one was passed over."""

    backend: str
    passed_over: dict[str, str] = field(default_factory=dict)

    def __str__(self) -> str:
        why = "; ".join(f"{name}: {reason}" for name, reason in self.passed_over.items())
        return f"auto -> {self.backend}" + (f" (passed over {why})" if why else "")


def backend_names() -> list[str]:
    """Every backend name `attend` accepts, fastest first, then 'auto'."""
    return [b.name for b in _by_speed()] + ["auto"]


def _by_speed() -> list[Backend]:
    return sorted(BACKENDS.values(), key=lambda b: b.speed_rank)


def _choose(
    q: Tensor, mask: Tensor | None, causal: bool, shape: Shape, variants: Variants = NONE
) -> Choice:
    passed_over = {}
    for backend in _by_speed():
        if not backend.auto:
            continue
        reason = (
            backend.lacks(variants)
            or backend.supports(q, mask, causal, shape)
            or backend.prefer(q, mask, causal, shape)
        )
        if reason is None:
            return Choice(backend.name, passed_over)
        passed_over[backend.name] = reason
    raise ValueError(f"no backend supports these inputs: {passed_over}")


def explain_choice(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mask: Tensor | None = None,
    causal: bool = False,
    scale: float | None = None,
    window: int | None = None,
    chunk: int | None = None,
    chunk_start: Tensor | None = None,
    softcap: float | None = None,
    bias: Tensor | None = None,
    sinks: Tensor | None = None,
    query_scale: Tensor | None = None,
) -> Choice:
    """The backend `attend(..., backend="auto")` would use for these inputs, and why.

    >>> import torch
    >>> x = torch.zeros(1, 2, 3, 4)
    >>> explain_choice(x, x, x).backend
    'sdpa'
    """
    call = check_call(
        q, k, v, mask=mask, causal=causal, scale=scale, window=window, chunk=chunk,
        chunk_start=chunk_start, softcap=softcap, bias=bias, sinks=sinks, query_scale=query_scale,
    )  # fmt: skip
    return _choose(q, call.mask, causal, call.shape, call.variants)


def resolve_backend(name: str) -> Backend | None:
    """The Backend for a name, None for 'auto'; ValueError naming the choices otherwise."""
    if name == "auto":
        return None
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; allowed: {backend_names()}")
    return BACKENDS[name]


def attend(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mask: Tensor | None = None,
    causal: bool = False,
    scale: float | None = None,
    window: int | None = None,
    chunk: int | None = None,
    chunk_start: Tensor | None = None,
    softcap: float | None = None,
    bias: Tensor | None = None,
    sinks: Tensor | None = None,
    query_scale: Tensor | None = None,
    backend: str = "auto",
) -> Tensor:
    """Every query attends to every key it may see; returns the contextualized vectors.

    q: (B, H, Tq, D); k: (B, Hkv, Tk, D), v: (B, Hkv, Tk, Dv) with H a multiple of Hkv (query
    head h uses key/value head h // (H // Hkv)); returns (B, H, Tq, Dv) in q's dtype. Dv is
    usually D; latent attention (DeepSeek) makes values of another size.
    mask: boolean, True where a query may attend to a key, broadcastable to
    (B, H, Tq, Tk); a key-padding mask is (B, 1, 1, Tk). causal: query i sees keys
    j <= i + Tk - Tq (aligned to the end of the keys, as in cached decoding); combines
    with mask. scale: defaults to 1/sqrt(D). A query that may see no key gets zeros.
    window: a key `window` or more positions from its query is hidden (looking back only
    when causal, both ways otherwise): Mistral's and Gemma's sliding windows.
    chunk: a query sees only the keys in its own chunk of `chunk` positions (Llama 4's local
    layers); chunk_start (B,) long: each row's first key, where its chunks begin (past left
    padding; 0 by default).
    query_scale: (B?, Tq), each query's scaled scores times this temperature (Llama 4's layers
    without positions, Ministral 3).
    softcap: each scaled score s becomes softcap * tanh(s / softcap) (Gemma 2).
    bias: a float tensor broadcastable to (B, H, Tq, Tk), added to each score after the scale
    and the cap (T5's relative position buckets, ALiBi).
    sinks: (H,), one learned score per query head, one more entry in every query's softmax
    with no value behind it (gpt-oss): it takes its share of the weight, the keys the rest.
    backend: one of `backend_names()`; "auto" takes the fastest that supports the inputs;
    a named backend that cannot compute a variant is refused by name, never run without it.

    >>> import torch
    >>> q = k = v = torch.eye(2).view(1, 1, 2, 2)
    >>> attend(q, k, v, causal=True)[0, 0, 0].tolist()
    [1.0, 0.0]
    """
    chosen = resolve_backend(backend)
    call = check_call(
        q, k, v, mask=mask, causal=causal, scale=scale, window=window, chunk=chunk,
        chunk_start=chunk_start, softcap=softcap, bias=bias, sinks=sinks, query_scale=query_scale,
    )  # fmt: skip
    return _run(_runnable(chosen, q, call), q, k, v, call)


def _runnable(chosen: Backend | None, q: Tensor, call: Call) -> Backend:
    """The backend named, refused by name if it cannot run this call; or auto's choice."""
    if chosen is None:
        return BACKENDS[_choose(q, call.mask, call.causal, call.shape, call.variants).backend]
    reason = chosen.lacks(call.variants) or chosen.supports(q, call.mask, call.causal, call.shape)
    if reason is not None:
        raise ValueError(f"backend {chosen.name!r} cannot run these inputs: {reason}")
    return chosen


def _run(chosen: Backend, q: Tensor, k: Tensor, v: Tensor, call: Call) -> Tensor:
    return chosen.forward(
        q, k, v, mask=call.mask, causal=call.causal, scale=call.scale, shape=call.shape,
        **call.variants.given(),
    )  # fmt: skip


@dataclass(frozen=True)
class Attended:
    """What `attend_for_record` returns: the output, and what the backend offered beside it."""

    out: Tensor  # (B, H, Tq, Dv), as `attend` returns it
    lse: Tensor | None = None  # (B, H, Tq) float32, from a backend that offers it
    made: Tensor | None = None  # (H, Tq, Tk): the weights, made with the output


def attend_for_record(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    backend: str = "auto",
    weights: Tensor | None = None,
    **options: Unpack[Options],
) -> Attended:
    """`attend`, and what a record of the call needs beside its output: the log-sum-exp
    where the backend offers it, or every head's weights made with the output.

    Arguments and options (mask, causal, scale, window, chunk, chunk_start, softcap, bias,
    sinks, query_scale) as in `attend`.
    weights: a tensor (H, Tq, Tk) of the compute dtype (float32, float64 for float64 inputs)
    to make the weights of one sequence in, with the output in one pass, where a backend that
    offers it (`eager`, for "auto" or "eager") computes exactly what `attend` would
    (`qkv.attention.eager.takes_into`); `made` is then that tensor. Otherwise the tensor is
    left alone and the call is `attend`'s, with the lse of a backend that offers one (`flash`).

    >>> import torch
    >>> q = k = v = torch.eye(2).view(1, 1, 2, 2)
    >>> made = torch.empty(1, 2, 2)
    >>> attended = attend_for_record(q, k, v, causal=True, weights=made)
    >>> attended.made is made, [round(w, 4) for w in made[0, 1].tolist()]
    (True, [0.3302, 0.6698])
    """
    chosen = resolve_backend(backend)
    call = check_call(q, k, v, **options)
    if weights is not None:
        makers = [chosen] if chosen is not None else [b for b in _by_speed() if b.auto]
        for maker in makers:
            if maker.weights_into is None:
                continue
            out = maker.weights_into(weights, q, k, v, **{**options, "scale": call.scale})
            if out is not None:
                return Attended(out, made=weights)
    chosen = _runnable(chosen, q, call)
    if chosen.forward_lse is None:
        return Attended(_run(chosen, q, k, v, call))
    out, lse = chosen.forward_lse(
        q, k, v, mask=call.mask, causal=call.causal, scale=call.scale, shape=call.shape
    )
    return Attended(out, lse)

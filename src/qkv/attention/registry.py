"""The one function, `attend`, and the registry of backends it dispatches to.

A backend is one module with a `forward(q, k, v, *, mask, causal, scale, shape)` plus one
`Backend` line below. `auto` walks the backends from fastest to slowest and takes the
first whose `supports` and `prefer` have no objection; `explain_choice` says which and why.

A sliding window reaches every backend folded into the mask (it is one). A soft-cap and a
score bias change the scores themselves: a backend lists in `variants` those its forward
takes (as `softcap=`, `bias=`), and is never handed, or chosen for, one it does not.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from torch import Tensor

from qkv.attention import eager, loop, sdpa
from qkv.attention.flash import backend as flash
from qkv.attention.inputs import (
    NONE,
    Shape,
    Variants,
    check_inputs,
    check_variants,
    check_window,
    with_window,
)

Forward = Callable[..., Tensor]
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
    variants: frozenset[str] = frozenset()  # of "softcap", "bias": what forward computes

    def lacks(self, variants: Variants) -> str | None:
        """Why this backend cannot compute these score variants, or None."""
        missing = sorted(variants.names - self.variants)
        if not missing:
            return None
        return f"it does not compute a score {' or a '.join(missing)}"


BACKENDS: dict[str, Backend] = {}


def register_backend(backend: Backend) -> None:
    """Add (or replace) a backend; `attend(..., backend=name)` can then use it."""
    BACKENDS[backend.name] = backend


def _loop_forward(q, k, v, *, mask, causal, scale, shape, softcap=None, bias=None):
    return loop.attend(q, k, v, mask=mask, causal=causal, scale=scale, softcap=softcap, bias=bias)


register_backend(
    Backend(
        "flash",
        flash.forward,
        5,
        "qkv's Triton kernel (FlashAttention-2), forward and backward; CUDA",
        supports=flash.supports,
        prefer=flash.prefer,
    )
)
register_backend(
    Backend(
        "sdpa", sdpa.forward, 10, "torch's fused scaled_dot_product_attention",
        variants=frozenset({"bias"}),
    )
)  # fmt: skip
register_backend(
    Backend(
        "eager", eager.forward, 50, "matmul, softmax, matmul; can return weights",
        variants=frozenset({"softcap", "bias"}),
    )
)  # fmt: skip
register_backend(
    Backend(
        "loop", _loop_forward, 100, "the article, one pair at a time, float64", auto=False,
        variants=frozenset({"softcap", "bias"}),
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
    return [b.name for b in sorted(BACKENDS.values(), key=lambda b: b.speed_rank)] + ["auto"]


def _choose(
    q: Tensor, mask: Tensor | None, causal: bool, shape: Shape, variants: Variants = NONE
) -> Choice:
    passed_over = {}
    for backend in sorted(BACKENDS.values(), key=lambda b: b.speed_rank):
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
    softcap: float | None = None,
    bias: Tensor | None = None,
) -> Choice:
    """The backend `attend(..., backend="auto")` would use for these inputs, and why.

    >>> import torch
    >>> x = torch.zeros(1, 2, 3, 4)
    >>> explain_choice(x, x, x).backend
    'sdpa'
    """
    shape, _ = check_inputs(q, k, v, mask, scale)
    variants = check_variants(shape, q, softcap, bias)
    mask = with_window(mask, check_window(window), causal, shape.Tq, shape.Tk, q.device)
    return _choose(q, mask, causal, shape, variants)


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
    softcap: float | None = None,
    bias: Tensor | None = None,
    backend: str = "auto",
) -> Tensor:
    """Every query attends to every key it may see; returns the contextualized vectors.

    q: (B, H, Tq, D); k, v: (B, Hkv, Tk, D) with H a multiple of Hkv (query head h uses
    key/value head h // (H // Hkv)); returns (B, H, Tq, D) in q's dtype.
    mask: boolean, True where a query may attend to a key, broadcastable to
    (B, H, Tq, Tk); a key-padding mask is (B, 1, 1, Tk). causal: query i sees keys
    j <= i + Tk - Tq (aligned to the end of the keys, as in cached decoding); combines
    with mask. scale: defaults to 1/sqrt(D). A query that may see no key gets zeros.
    window: a key `window` or more positions from its query is hidden (looking back only
    when causal, both ways otherwise): Mistral's and Gemma's sliding windows.
    softcap: each scaled score s becomes softcap * tanh(s / softcap) (Gemma 2).
    bias: a float tensor broadcastable to (B, H, Tq, Tk), added to each score after the scale
    and the cap (T5's relative position buckets, ALiBi).
    backend: one of `backend_names()`; "auto" takes the fastest that supports the inputs;
    a named backend that cannot compute a variant is refused by name, never run without it.

    >>> import torch
    >>> q = k = v = torch.eye(2).view(1, 1, 2, 2)
    >>> attend(q, k, v, causal=True)[0, 0, 0].tolist()
    [1.0, 0.0]
    """
    chosen = resolve_backend(backend)
    shape, scale = check_inputs(q, k, v, mask, scale)
    variants = check_variants(shape, q, softcap, bias)
    mask = with_window(mask, check_window(window), causal, shape.Tq, shape.Tk, q.device)
    if chosen is None:
        chosen = BACKENDS[_choose(q, mask, causal, shape, variants).backend]
    else:
        reason = chosen.lacks(variants) or chosen.supports(q, mask, causal, shape)
        if reason is not None:
            raise ValueError(f"backend {chosen.name!r} cannot run these inputs: {reason}")
    extra = {name: getattr(variants, name) for name in variants.names}
    return chosen.forward(q, k, v, mask=mask, causal=causal, scale=scale, shape=shape, **extra)

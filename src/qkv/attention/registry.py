"""The one function, `attend`, and the registry of backends it dispatches to.

A backend is one module with a `forward(q, k, v, *, mask, causal, scale, shape)` plus one
`Backend` line below. `auto` walks the backends from fastest to slowest and takes the
first whose `supports` and `prefer` have no objection; `explain_choice` says which and why.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from torch import Tensor

from qkv.attention import eager, loop, sdpa
from qkv.attention.flash import backend as flash
from qkv.attention.inputs import Shape, check_inputs

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


BACKENDS: dict[str, Backend] = {}


def register_backend(backend: Backend) -> None:
    """Add (or replace) a backend; `attend(..., backend=name)` can then use it."""
    BACKENDS[backend.name] = backend


def _loop_forward(q, k, v, *, mask, causal, scale, shape):
    return loop.attend(q, k, v, mask=mask, causal=causal, scale=scale)


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
register_backend(Backend("sdpa", sdpa.forward, 10, "torch's fused scaled_dot_product_attention"))
register_backend(Backend("eager", eager.forward, 50, "matmul, softmax, matmul; can return weights"))
register_backend(
    Backend("loop", _loop_forward, 100, "the article, one pair at a time, float64", auto=False)
)


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


def _choose(q: Tensor, mask: Tensor | None, causal: bool, shape: Shape) -> Choice:
    passed_over = {}
    for backend in sorted(BACKENDS.values(), key=lambda b: b.speed_rank):
        if not backend.auto:
            continue
        reason = backend.supports(q, mask, causal, shape) or backend.prefer(q, mask, causal, shape)
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
) -> Choice:
    """The backend `attend(..., backend="auto")` would use for these inputs, and why.

    >>> import torch
    >>> x = torch.zeros(1, 2, 3, 4)
    >>> explain_choice(x, x, x).backend
    'sdpa'
    """
    shape, _ = check_inputs(q, k, v, mask, scale)
    return _choose(q, mask, causal, shape)


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
    backend: str = "auto",
) -> Tensor:
    """Every query attends to every key it may see; returns the contextualized vectors.

    q: (B, H, Tq, D); k, v: (B, Hkv, Tk, D) with H a multiple of Hkv (query head h uses
    key/value head h // (H // Hkv)); returns (B, H, Tq, D) in q's dtype.
    mask: boolean, True where a query may attend to a key, broadcastable to
    (B, H, Tq, Tk); a key-padding mask is (B, 1, 1, Tk). causal: query i sees keys
    j <= i + Tk - Tq (aligned to the end of the keys, as in cached decoding); combines
    with mask. scale: defaults to 1/sqrt(D). A query that may see no key gets zeros.
    backend: one of `backend_names()`; "auto" takes the fastest that supports the inputs.

    >>> import torch
    >>> q = k = v = torch.eye(2).view(1, 1, 2, 2)
    >>> attend(q, k, v, causal=True)[0, 0, 0].tolist()
    [1.0, 0.0]
    """
    chosen = resolve_backend(backend)
    shape, scale = check_inputs(q, k, v, mask, scale)
    if chosen is None:
        chosen = BACKENDS[_choose(q, mask, causal, shape).backend]
    else:
        reason = chosen.supports(q, mask, causal, shape)
        if reason is not None:
            raise ValueError(f"backend {chosen.name!r} cannot run these inputs: {reason}")
    return chosen.forward(q, k, v, mask=mask, causal=causal, scale=scale, shape=shape)

"""What every backend may assume: checked shapes, and one way to build the mask.

`check_inputs` turns a wrong call into a `ValueError` that names the fault and what is
allowed, so backends can trust their inputs. `allowed_keys` combines a boolean mask, the
causal rule, a sliding window and chunks into one (…, Tq, Tk) tensor, True where a query may
attend to a key. `check_variants` checks what a model may change in the scores themselves
(`Variants`): a soft-cap, an additive bias, a learned sink per head, a temperature per query.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import TypedDict, Unpack

import torch
from torch import Tensor

DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class Shape:
    """The sizes of one attention call: q (B, H, Tq, D), k (B, Hkv, Tk, D), v (B, Hkv, Tk, Dv).
    Dv, the value head size, is D's unless a model makes values of another size (DeepSeek's
    latent attention); None means D."""

    B: int
    H: int
    Hkv: int
    Tq: int
    Tk: int
    D: int
    Dv: int | None = None

    @property
    def value_size(self) -> int:
        """The head size of the values, and so of the output: Dv, or D."""
        return self.D if self.Dv is None else self.Dv

    @property
    def group(self) -> int:
        """How many query heads share one key/value head (query head h uses h // group)."""
        return self.H // self.Hkv


def check_inputs(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float | None
) -> tuple[Shape, float]:
    """Validate one call of `attend`; return its sizes and the scale to use.

    >>> q = torch.zeros(1, 4, 3, 8); k = v = torch.zeros(1, 2, 5, 8)
    >>> shape, scale = check_inputs(q, k, v, None, None)
    >>> shape.group, round(scale, 4)
    (2, 0.3536)
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(
                f"{name} must have 4 dimensions (B, heads, T, D), got shape {tuple(t.shape)}"
            )
        if t.dtype not in DTYPES:
            raise ValueError(f"{name} has dtype {t.dtype}; allowed: {', '.join(map(str, DTYPES))}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    B, H, Tq, D = q.shape
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(
            f"k and v must have the same shape in (B, Hkv, Tk), one value per key; got "
            f"{tuple(k.shape)} and {tuple(v.shape)}"
        )
    Bk, Hkv, Tk, Dk = k.shape
    Dv = v.shape[3]
    if Bk != B:
        raise ValueError(f"q has batch size {B} but k and v have {Bk}; they must match")
    if Dk != D:
        raise ValueError(f"q has head size D={D} but k and v have D={Dk}; they must match")
    if min(B, H, Hkv, Tq, Tk, D, Dv) == 0:
        raise ValueError(
            f"every size must be at least 1, got B={B}, H={H}, Hkv={Hkv}, Tq={Tq}, Tk={Tk}, "
            f"D={D}, Dv={Dv}"
        )
    if H % Hkv != 0:
        raise ValueError(
            f"q has H={H} heads, which is not a multiple of k and v's Hkv={Hkv} heads; "
            f"allowed Hkv for H={H}: {[n for n in range(1, H + 1) if H % n == 0]}"
        )
    if mask is not None:
        if not isinstance(mask, Tensor) or mask.dtype != torch.bool:
            kind = mask.dtype if isinstance(mask, Tensor) else type(mask).__name__
            raise ValueError(f"mask must be a boolean tensor (True = may attend), got {kind}")
        if mask.device != q.device:
            raise ValueError(f"mask is on {mask.device} but q is on {q.device}")
        target = (B, H, Tq, Tk)
        # each of the mask's sizes, from the right, is 1 or the target's (torch.broadcast_shapes
        # says the same at 16 us a call, a knockout's 30 layers 0.5% of its forward pass)
        sizes = (1,) * (4 - mask.dim()) + tuple(mask.shape)  # (B?, H?, Tq?, Tk?)
        if len(sizes) > 4 or any(m not in (1, t) for m, t in zip(sizes, target, strict=True)):
            raise ValueError(
                f"mask of shape {tuple(mask.shape)} does not broadcast to (B, H, Tq, Tk) = "
                f"{target}; a key-padding mask is ({B}, 1, 1, {Tk})"
            )
    if scale is None:
        scale = 1.0 / math.sqrt(D)
    elif not (isinstance(scale, int | float) and math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be a positive finite number or None, got {scale!r}")
    return Shape(B, H, Hkv, Tq, Tk, D, None if Dv == D else Dv), float(scale)


def causal_mask(Tq: int, Tk: int, device: torch.device | str | None = None) -> Tensor:
    """(Tq, Tk) boolean: query i may see key j when j <= i + Tk - Tq.

    The queries are aligned to the end of the keys, as in decoding with a cache, where the
    new queries are the last Tq of Tk positions.

    >>> causal_mask(2, 3).int().tolist()
    [[1, 1, 0], [1, 1, 1]]
    """
    return torch.ones(Tq, Tk, dtype=torch.bool, device=device).tril(diagonal=Tk - Tq)


def window_mask(Tq: int, Tk: int, window: int, causal: bool, device=None) -> Tensor:
    """(Tq, Tk) boolean: True where key j is fewer than `window` positions from query i.

    Queries are aligned to the end of the keys (query i sits at position i + Tk - Tq). A
    causal model's window looks back only (Mistral: a key `window` or more tokens back is
    hidden); an encoder's looks both ways (ModernBERT's local layers).

    >>> window_mask(3, 3, 2, causal=True).int().tolist()  # the causal rule hides later keys
    [[1, 1, 1], [1, 1, 1], [0, 1, 1]]
    >>> window_mask(3, 3, 2, causal=False).int().tolist()
    [[1, 1, 0], [1, 1, 1], [0, 1, 1]]
    >>> window_mask(1, 4, 2, causal=True).int().tolist()  # decoding: the last query
    [[0, 0, 1, 1]]
    """
    at = torch.arange(Tq, device=device)[:, None] + (Tk - Tq)
    distance = at - torch.arange(Tk, device=device)[None, :]  # > 0: the key is earlier
    near = distance < window
    return near if causal else near & (-distance < window)


@dataclass(frozen=True)
class Variants:
    """What a model changes in the scores of one query i over a key j:

        score_ij = softcap * tanh(query_scale_i * scale * q_i.k_j / softcap) + bias_ij

    `query_scale` (B?, Tq), a temperature on each query's scores (Llama 4's layers without
    positions, Ministral 3: it grows with the query's position); `softcap`, Gemma 2's cap;
    `bias` (B?, H?, Tq, Tk), a float added to every score (T5's relative positions); and
    `sinks` (H,), one learned score per head that joins every query's softmax with no value
    behind it (gpt-oss): it takes part of the weight, and the words share the rest. None: not
    used."""

    softcap: float | None = None
    bias: Tensor | None = None
    sinks: Tensor | None = None
    query_scale: Tensor | None = None

    @property
    def names(self) -> frozenset[str]:
        """Which variants are in use: a subset of {"softcap", "bias", "sinks", "query_scale"}."""
        return frozenset(name for name in VARIANT_NAMES if getattr(self, name) is not None)

    def given(self) -> dict:
        """The variants in use, as keyword arguments of a backend's forward."""
        return {name: getattr(self, name) for name in self.names}


VARIANT_NAMES = ("softcap", "bias", "sinks", "query_scale")


NONE = Variants()


def check_window(window: int | None) -> int | None:
    if window is None:
        return None
    if type(window) is not int or window < 1:
        raise ValueError(f"window must be a whole number of tokens >= 1 or None, got {window!r}")
    return window


def check_chunk(chunk: int | None, chunk_start: Tensor | None, shape: Shape, q: Tensor):
    """Validate chunked attention's size and each row's first key."""
    if chunk is None:
        if chunk_start is not None:
            raise ValueError("chunk_start says where each row's chunks begin: pass chunk too")
        return None
    if type(chunk) is not int or chunk < 1:
        raise ValueError(f"chunk must be a whole number of tokens >= 1 or None, got {chunk!r}")
    if chunk_start is not None:
        if not isinstance(chunk_start, Tensor) or chunk_start.dtype != torch.long:
            kind = chunk_start.dtype if isinstance(chunk_start, Tensor) else type(chunk_start)
            raise ValueError(f"chunk_start must be a long tensor (B,), got {kind}")
        if chunk_start.shape != (shape.B,) or chunk_start.device != q.device:
            got = f"{tuple(chunk_start.shape)} on {chunk_start.device}"
            raise ValueError(f"chunk_start must be ({shape.B},) on {q.device}: each row's first "
                             f"key, got {got}")  # fmt: skip
    return chunk


def _float_tensor(name: str, t, q: Tensor, target: tuple[int, ...], what: str) -> None:
    if not isinstance(t, Tensor) or not t.is_floating_point():
        kind = t.dtype if isinstance(t, Tensor) else type(t).__name__
        raise ValueError(f"{name} must be a float tensor ({what}), got {kind}")
    if t.device != q.device:
        raise ValueError(f"{name} is on {t.device} but q is on {q.device}")
    try:
        broadcast = torch.broadcast_shapes(t.shape, target)
    except RuntimeError:
        broadcast = None
    if t.dim() > len(target) or broadcast != torch.Size(target):
        raise ValueError(f"{name} of shape {tuple(t.shape)} does not broadcast to {target}")
    if not bool(torch.isfinite(t).all()):
        raise ValueError(f"{name} holds a value that is not finite")


def check_variants(
    shape: Shape, q: Tensor, softcap, bias, sinks=None, query_scale=None
) -> Variants:
    """Validate a soft-cap, a score bias, sinks and query scales for a call of `shape`."""
    if softcap is not None and not (
        isinstance(softcap, int | float) and math.isfinite(softcap) and softcap > 0
    ):
        raise ValueError(f"softcap must be a positive finite number or None, got {softcap!r}")
    if bias is not None:
        if not isinstance(bias, Tensor) or not bias.is_floating_point():
            kind = bias.dtype if isinstance(bias, Tensor) else type(bias).__name__
            raise ValueError(f"bias must be a float tensor added to the scores, got {kind}")
        if bias.device != q.device:
            raise ValueError(f"bias is on {bias.device} but q is on {q.device}")
        target = (shape.B, shape.H, shape.Tq, shape.Tk)
        try:
            broadcast = torch.broadcast_shapes(bias.shape, target)
        except RuntimeError:
            broadcast = None
        if bias.dim() > 4 or broadcast != torch.Size(target):
            raise ValueError(
                f"bias of shape {tuple(bias.shape)} does not broadcast to (B, H, Tq, Tk) = {target}"
            )
    if sinks is not None:
        _float_tensor("sinks", sinks, q, (shape.H,), "one learned score per query head")
        if sinks.dim() != 1:
            raise ValueError(f"sinks must be ({shape.H},): one score per query head")
    if query_scale is not None:
        _float_tensor("query_scale", query_scale, q, (shape.B, shape.Tq), "one per query")
        if not bool((query_scale > 0).all()):
            raise ValueError("query_scale must be > 0: a temperature on each query's scores")
    return Variants(None if softcap is None else float(softcap), bias, sinks, query_scale)


class Options(TypedDict, total=False):
    """The keywords of one attention call beside q, k and v, as `qkv.attend` takes them: mask,
    causal, scale, window, chunk, chunk_start, softcap, bias, sinks, query_scale. A backend's
    own entry (`loop.steps`, `eager.attend`) takes them as `**options` and hands them to
    `check_call`."""

    mask: Tensor | None
    causal: bool
    scale: float | None
    window: int | None
    chunk: int | None
    chunk_start: Tensor | None
    softcap: float | None
    bias: Tensor | None
    sinks: Tensor | None
    query_scale: Tensor | None


@dataclass(frozen=True)
class Call:
    """One checked call of attention, as every backend receives it: its sizes, the scale to
    use, the mask with the sliding window folded in, the causal rule and the score variants."""

    shape: Shape
    scale: float
    mask: Tensor | None
    causal: bool
    variants: Variants


def check_call(q: Tensor, k: Tensor, v: Tensor, **options: Unpack[Options]) -> Call:
    """The one prologue of every entry to attention: `check_inputs`, `check_variants`,
    `check_window` and `check_chunk`, then the window and the chunks folded into the mask (each
    is a mask).

    >>> q = k = v = torch.zeros(1, 2, 3, 4)
    >>> call = check_call(q, k, v, causal=True, window=1)
    >>> call.scale, call.mask[2].int().tolist(), call.variants.names  # the last query's keys
    (0.5, [0, 0, 1], frozenset())
    """
    unknown = sorted(set(options) - set(Options.__annotations__))
    if unknown:
        raise TypeError(f"unknown attention option {unknown[0]!r}; allowed: "
                        f"{', '.join(Options.__annotations__)}")  # fmt: skip
    mask, causal = options.get("mask"), options.get("causal", False)
    shape, scale = check_inputs(q, k, v, mask, options.get("scale"))
    variants = check_variants(shape, q, options.get("softcap"), options.get("bias"),
                              options.get("sinks"), options.get("query_scale"))  # fmt: skip
    window = check_window(options.get("window"))
    start = options.get("chunk_start")  # refused by check_chunk without a chunk
    chunk = check_chunk(options.get("chunk"), start, shape, q)
    mask = with_window(mask, window, causal, shape.Tq, shape.Tk, q.device)
    return Call(shape, scale, with_chunks(mask, chunk, start, shape.Tq, shape.Tk, q.device),
                causal, variants)  # fmt: skip


def capped(scores: Tensor, softcap: float | None) -> Tensor:
    """Gemma 2's soft-cap: softcap * tanh(scores / softcap), or the scores themselves."""
    return scores if softcap is None else torch.tanh(scores / softcap) * softcap


def check_indices(what: str, indices, count: int, owner: str) -> list[int]:
    """Layer or head indices as a list of ints, each in 0..count-1 and each once; otherwise a
    ValueError that names the range or the repeat. Layers and heads count from 0 everywhere.
    A repeat is refused so that what is asked for is bounded by what there is: 3,000 copies
    of one head would make 3,000 copies of its weights. `indices=None` chooses every one.
    This is qkv's one rule for choosing layers, heads, queries: every selection calls it.

    >>> check_indices("head", (2, 0), 3, "q")
    [2, 0]
    >>> check_indices("head", None, 3, "q")
    [0, 1, 2]
    >>> check_indices("layer", [6], 6, "minilm")
    Traceback (most recent call last):
    ...
    ValueError: layer 6 is out of range: minilm has 6 layers (0-5)
    >>> check_indices("head", [1, 0, 1], 3, "q")
    Traceback (most recent call last):
    ...
    ValueError: head 1 is asked for twice; name each head once
    """
    if indices is None:
        return list(range(count))
    try:
        if isinstance(indices, str | bytes):
            raise TypeError
        chosen = [operator.index(i) for i in indices]
    except TypeError:
        raise ValueError(
            f"{what}s are whole numbers counted from 0 (0-{count - 1}), got {indices!r}"
        ) from None
    bad = [i for i in chosen if not 0 <= i < count]
    if bad:
        many = {"query": "queries", "batch": "batches"}.get(what, f"{what}s")
        raise ValueError(
            f"{what} {bad[0]} is out of range: {owner} has {count} {many} (0-{count - 1})"
        )
    seen: set[int] = set()
    for i in chosen:
        if i in seen:
            raise ValueError(f"{what} {i} is asked for twice; name each {what} once")
        seen.add(i)
    return chosen


def select_heads(
    heads: list[int], q: Tensor, k: Tensor, mask: Tensor | None, *per_head: Tensor
) -> tuple[Tensor, ...]:
    """Some query heads of one attention call, each beside the key head it reads.

    q (B, H, Tq, D), k (B, Hkv, Tk, D), mask broadcastable to (B, H, Tq, Tk) or None;
    per_head: more tensors indexed by query head on dimension 1, e.g. the lse (B, H, Tq).
    Returns q (B, n, Tq, D), k (B, n, Tk, D) (query head h reads key head h // (H // Hkv)),
    the mask of those heads (a mask shared by every head stays shared), then `per_head`'s.

    >>> q, k = torch.zeros(1, 4, 2, 8), torch.ones(1, 2, 3, 8)
    >>> [tuple(t.shape) for t in select_heads([3], q, k, None)[:2]]
    [(1, 1, 2, 8), (1, 1, 3, 8)]
    """
    group = q.shape[1] // k.shape[1]
    index = torch.tensor(heads, device=q.device, dtype=torch.long)
    chosen = (q.index_select(1, index), k.index_select(1, index // group), heads_of(mask, index))
    return chosen + tuple(t.index_select(1, index) for t in per_head)


def heads_of(t: Tensor | None, index: Tensor) -> Tensor | None:
    """The heads `index` of a mask or a score bias broadcastable to (B, H, Tq, Tk): one
    shared by every head stays shared."""
    if t is None:
        return None
    t = t.reshape((1,) * (4 - t.dim()) + tuple(t.shape))  # (B?, H?, Tq?, Tk)
    return t if t.shape[1] == 1 else t.index_select(1, index)


def allowed_keys(
    mask: Tensor | None,
    causal: bool,
    Tq: int,
    Tk: int,
    device,
    window: int | None = None,
    chunk: int | None = None,
    chunk_start: Tensor | None = None,
) -> Tensor | None:
    """The mask, the causal rule, the window and the chunks combined, broadcastable to
    (B, H, Tq, Tk); None if there is none of them."""
    mask = with_window(mask, window, causal, Tq, Tk, device)
    mask = with_chunks(mask, chunk, chunk_start, Tq, Tk, device)
    if not causal:
        return mask
    tri = causal_mask(Tq, Tk, device)  # (Tq, Tk)
    return tri if mask is None else mask & tri


def with_window(
    mask: Tensor | None, window: int | None, causal: bool, Tq: int, Tk: int, device
) -> Tensor | None:
    """The mask with the sliding window's hidden keys hidden too (the mask itself if no
    window, or if the window reaches past every key)."""
    if window is None or window >= (Tk if causal else max(Tk, Tq)):  # no key is that far
        return mask
    near = window_mask(Tq, Tk, window, causal, device)
    return near if mask is None else mask & near


def chunk_mask(Tq: int, Tk: int, chunk: int, start: Tensor | None = None, device=None) -> Tensor:
    """(B or 1, 1, Tq, Tk) boolean: True where key j is in query i's chunk of `chunk` positions
    (Llama 4's local layers). Queries are aligned to the end of the keys; a row's positions
    count from its key `start[b]` (its first real token, past left padding; 0 if None), so a
    left-padded row is cut into the same chunks as the row alone, as transformers cuts it.

    >>> chunk_mask(4, 4, 2)[0, 0].int().tolist()
    [[1, 1, 0, 0], [1, 1, 0, 0], [0, 0, 1, 1], [0, 0, 1, 1]]
    >>> chunk_mask(1, 5, 2, torch.tensor([1]))[0, 0].int().tolist()  # key 0 is padding
    [[0, 0, 0, 1, 1]]
    """
    keys = torch.arange(Tk, device=device)
    queries = torch.arange(Tq, device=device) + (Tk - Tq)
    first = torch.zeros(1, dtype=torch.long, device=device) if start is None else start
    first = first.to(device)[:, None, None]  # (B, 1, 1)
    same = (queries[None, :, None] - first) // chunk == (keys[None, None, :] - first) // chunk
    return same[:, None]  # (B, 1, Tq, Tk)


def with_chunks(
    mask: Tensor | None, chunk: int | None, start: Tensor | None, Tq: int, Tk: int, device
) -> Tensor | None:
    """The mask with keys outside each query's chunk hidden too (the mask itself if no chunk)."""
    if chunk is None:
        return mask
    inside = chunk_mask(Tq, Tk, chunk, start, device)
    return inside if mask is None else mask & inside

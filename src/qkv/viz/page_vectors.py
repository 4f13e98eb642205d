"""The q, k, v vectors a page carries to redo a clicked pair's steps, and what each layer does
to a score beyond the scale (`LayerScores`): read from records (`page_trace`), checked against
the weights, and packed into the page's data."""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from qkv.inspect.records import why_not_redone
from qkv.viz.encode import pack

# Above this many bytes of float32 q, k, v (3 x L x H x T x D x 4) the vectors are left out:
# they barely compress, and a page of tens of MB is slow to open.
VECTORS_MAX_BYTES = 8 * 2**20
VECTOR_ENCODING = "float32, little-endian, row-major T x D, zlib, base64; one per head"


@dataclasses.dataclass(frozen=True)
class LayerScores:
    """What one layer does to a pair's scaled scalar beyond the article, for the page to redo:
    `window` (keys `window` or more tokens away hidden: back only in a decoder, both ways in
    an encoder), `softcap` (score s -> softcap * tanh(s / softcap)) and `bias` ((H, T, T)
    floats added after the cap, e.g. T5's relative positions; `bias_is_distance` says so;
    (H, Tq, Tk) for cross-attention)."""

    window: int | None = None
    softcap: float | None = None
    bias: object = None  # (H, T, T) array or tensor
    bias_is_distance: bool = False


def page_trace(records: dict, *, bias_is_distance: bool = False, cross: bool = False):
    """(vectors, scores) for a page from one text's `AttentionRecord`s (layer -> record): each
    layer's q, k and v (L, H, T, D), grouped key/value heads repeated so that query head h sits
    beside the one it reads, and its `LayerScores`. A record whose keys a mask hides (padding)
    is refused: the page knows the causal rule and the window only.

    cross: the records are an encoder-decoder's cross-attention (`Attentions.records` of
    `attentions(text, target=...)`): q (L, H, Tq, D) the decoder's, k and v (L, H, Tk, D) the
    encoder output's.
    """
    why = why_not_redone(records, cross=cross)
    if why is not None:
        raise ValueError(f"the page cannot redo these pairs: {why}")
    qs, ks, vs, scores = [], [], [], []
    for _, record in sorted(records.items()):
        s = record.shape
        qs.append(record.q[0])  # (H, T, D)
        ks.append(record.k[0].repeat_interleave(s.group, dim=0))
        vs.append(record.v[0].repeat_interleave(s.group, dim=0))
        bias = None
        if record.bias is not None:
            bias = record.bias.float().expand(s.B, s.H, s.Tq, s.Tk)[0]
        scores.append(LayerScores(record.window, record.softcap, bias, bias_is_distance))
    stack = [np.stack([x.detach().float().cpu().numpy() for x in xs]) for xs in (qs, ks, vs)]
    return stack, scores


def check_vectors(vectors, shape: tuple[int, int, int, int], cross: bool) -> list[np.ndarray]:
    """(q, k, v) as three float32 arrays, q (L, H, Tq, D), k and v (L, H, Tk, D), checked
    against the weights' (L, H, Tq, Tk); Tq = Tk = T for self-attention."""
    L, H, Tq, Tk = shape
    if isinstance(vectors, str | bytes) or len(vectors) != 3:
        what = "(L, H, Tq, D), (L, H, Tk, D) and (L, H, Tk, D)" if cross else "three (L, H, T, D)"
        raise ValueError(f"vectors must be (q, k, v): {what} tensors or arrays")
    arrays = []
    for name, array in zip(("query", "key", "value"), vectors, strict=True):
        if hasattr(array, "detach"):
            array = array.detach().float().cpu().numpy()
        array = np.asarray(array, dtype=np.float32)
        rows, letter = (Tq, "Tq") if name == "query" else (Tk, "Tk")
        want = (L, H, rows)
        if array.ndim != 4 or array.shape[:3] != want:
            form = f"(L, H, {letter}, D)" if cross else "(L, H, T, D)"
            raise ValueError(
                f"the {name} vectors must be {form} = ({', '.join(map(str, want))}, D) "
                f"to match the weights, not {tuple(array.shape)}"
            )
        if not np.isfinite(array).all():
            raise ValueError(f"the {name} vectors hold NaN or infinite numbers")
        arrays.append(array)
    if len({array.shape[-1] for array in arrays}) != 1:
        raise ValueError("the query, key and value vectors must have the same size D")
    return arrays


def check_scores(scores, shape: tuple[int, int, int, int], cross: bool) -> list[LayerScores]:
    """One LayerScores per layer, each bias (H, Tq, Tk) finite float32 (Tq = Tk = T for
    self-attention); cross-attention has no window."""
    L, H, Tq, T = shape
    rules = list(scores)
    if len(rules) != L or not all(isinstance(rule, LayerScores) for rule in rules):
        raise ValueError(f"scores must be one LayerScores per layer: {L}, not {len(rules)}")
    kept = []
    for layer, rule in enumerate(rules):
        bias = rule.bias
        if bias is not None:
            if hasattr(bias, "detach"):
                bias = bias.detach().float().cpu().numpy()
            bias = np.asarray(bias, dtype=np.float32)
            if bias.shape != (H, Tq, T):
                form = "(H, Tq, Tk)" if cross else "(H, T, T)"
                raise ValueError(
                    f"layer {layer}'s score bias must be {form} = ({H}, {Tq}, {T}), "
                    f"not {tuple(bias.shape)}"
                )
            if not np.isfinite(bias).all():
                raise ValueError(f"layer {layer}'s score bias holds NaN or infinite numbers")
        if cross and rule.window is not None:
            raise ValueError(f"layer {layer} has a window; cross-attention hides no key by place")
        if rule.window is not None and not (isinstance(rule.window, int) and rule.window > 0):
            raise ValueError(f"layer {layer}'s window must be a positive whole number or None")
        if rule.softcap is not None and not 0 < rule.softcap < float("inf"):
            raise ValueError(f"layer {layer}'s soft-cap must be a positive number or None")
        kept.append(dataclasses.replace(rule, bias=bias))
    return kept


def vectors_data(
    vectors: list[np.ndarray], scale: float | None, rules: list[LayerScores] | None
) -> dict:
    """The page's "vectors": q, k and v as one packed (T, D) float32 matrix per layer and head,
    the scale on their dot products and, per layer, what it does to a score beyond the scale
    (its window, soft-cap, and bias as one packed (T, T) float32 matrix per head)."""
    packed = {
        name: [[pack(matrix.astype("<f4")) for matrix in heads] for heads in array]
        for name, array in zip(("query", "key", "value"), vectors, strict=True)
    }
    D = int(vectors[0].shape[-1])
    scale = 1 / math.sqrt(D) if scale is None else float(scale)
    layers = [
        {
            "window": rule.window,
            "softcap": rule.softcap,
            "bias": None if rule.bias is None else [pack(m.astype("<f4")) for m in rule.bias],
            "bias_is_distance": rule.bias_is_distance,
        }
        for rule in rules or [LayerScores()] * len(vectors[0])
    ]
    return {"encoding": VECTOR_ENCODING, "size": D, "scale": scale, **packed, "layers": layers}

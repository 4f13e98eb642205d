"""One head's circuits through the vocabulary: which tokens its QK circuit pairs, and which its
OV circuit copies (Elhage et al. 2021).

Each token's embedding (times the model's embedding scale, through the embeddings' own norm;
no position) is read by the layer as the layer reads a stream: its attention norm, the head's
rows of the query (key, value) matrix, a QK-norm; each step exact for that one vector. So:

- QK: score(a, b) = scale * q(a) . k(b), the score query token a would give key token b if the
  stream entering the layer were their embeddings alone, at distance 0 (the same position: a
  rotation turns both alike and changes nothing). The V x V table is never held: it is made in
  blocks of rows and only each block's top scores are kept. `qk_by_distance` turns the two by
  the layer's own rotary angles for any distance.
- OV: copy(t, u) = U_u . W_O v(t), what attending to token t adds to token u's logit, U the
  LM head with the final norm's gain folded in (its scale, one number per position, left out).
  Its diagonal (t = u) says which tokens the head copies, row by row; its nonzero eigenvalues
  are those of a D x D matrix (X Y^T and Y^T X share them), and the copying score is
  sum(eigenvalues) / sum(|eigenvalues|): 1 for a head that only copies, -1 for one that only
  suppresses.

Biases are left out, as in `qkv.inspect.circuits`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from qkv.inspect.residual import freeze
from qkv.nn import RMSNorm
from qkv.nn.position import Rotation

_ROWS = 256  # query tokens per block of the QK table: (rows, V) float64 at a time (100 MB)
TOP = 1000  # the most pairs (and copied tokens) a table keeps: its candidates are held
DISTANCES = (0, 1, 2, 4, 8, 16, 32, 64, 128)  # where a rotary head's top pairs are read again


@dataclass
class HeadCircuit:
    """One head's circuits through the vocabulary.

    pairs: the top (query token, key token, score) its QK circuit gives at `distance` 0
    (pair_ids their ids); eigenvalues (D,) complex128, the nonzero eigenvalues of its OV
    circuit through the embedding and unembedding, largest in size first; copying their
    sum / sum of sizes; copied: the top (token, copy score) of the circuit's diagonal (None,
    like the eigenvalues, where the model has no LM head). A rotary layer's top three pairs
    again at each of `distances` (the key that many positions before the query): by_distance
    (3, len(distances)); empty where nothing turns."""

    source: str
    layer: int
    head: int
    kv_head: int
    distance: int
    pairs: list[tuple[str, str, float]]
    pair_ids: list[tuple[int, int]]
    eigenvalues: Tensor | None
    copying: float | None
    copied: list[tuple[str, float]] | None
    copied_ids: list[int] | None
    distances: list[int] = field(default_factory=list)
    by_distance: list[list[float]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        eig = None
        if self.eigenvalues is not None:
            eig = [[float(z.real), float(z.imag)] for z in self.eigenvalues]
        return {
            "source": self.source, "layer": self.layer, "head": self.head,
            "kv_head": self.kv_head, "distance": self.distance,
            "pairs": [{"query": q, "key": k, "score": s, "ids": list(i)}
                      for (q, k, s), i in zip(self.pairs, self.pair_ids, strict=True)],
            "eigenvalues": eig, "copying": self.copying,
            "copied": None if self.copied is None else [
                {"token": t, "score": s, "id": i}
                for (t, s), i in zip(self.copied, self.copied_ids, strict=True)],
            "distances": list(self.distances), "by_distance": self.by_distance,
            "notes": list(self.notes),
        }  # fmt: skip


def embeddings(stack, ids: Tensor) -> Tensor:
    """(N, C) float64: the tokens' embeddings as the first layer reads them, without position:
    the token's vector times the embedding scale, through the embeddings' norm."""
    embed = stack.embed
    scale = embed.scale
    if embed.round_scale:  # as Embeddings.forward: the scale in the weights' dtype first
        scale = float(torch.tensor(scale, dtype=torch.float32).to(embed.tokens.weight.dtype))
    x = embed.tokens.weight[ids].double() * scale
    return _normed(embed.norm, x, "the embeddings' norm")


def _normed(norm, x: Tensor, what: str) -> Tensor:
    """norm(x), x (N, W), in float64: exact, one vector at a time."""
    frozen = freeze(norm, x, what)
    if frozen is None:
        return x
    x = frozen(x)
    return x if frozen.shift is None else x + frozen.shift


def read(stack, layer: int, head: int, x: Tensor, role: str) -> Tensor:
    """(N, D) float64: the head's query ("query"), its key head's key ("key") or value
    ("value") of streams x (N, C), before any rotation; biases left out."""
    block = stack.blocks[layer]
    attn = block.attn
    if block.position == "pre":
        x = _normed(block.attn_norm, x, f"layer {layer}'s attention norm")
    D = attn.head_dim
    index = {"query": 0, "key": 1, "value": 2}[role]
    start = sum(attn.sizes[:index])
    if hasattr(attn, "qkv"):
        W = attn.qkv.weight[start : start + attn.sizes[index]]
    else:
        W = getattr(attn, ("q", "k", "v")[index]).weight
    full = x @ W.double().T  # (N, H*D) or (N, Hkv*D)
    norm = None if role == "value" else getattr(attn, "q_norm" if role == "query" else "k_norm",
                                                None)  # fmt: skip
    if attn.qk_norm == "full" and norm is not None:
        full = _normed(norm, full, f"layer {layer}'s QK-norm")
    g = head if role == "query" else head // (attn.num_heads // attn.num_kv_heads)
    v = full[:, g * D : (g + 1) * D]
    if attn.qk_norm == "head" and norm is not None:
        v = _normed(norm, v, f"layer {layer}'s QK-norm")
    return v


def _l2(attn, v: Tensor) -> Tensor:
    """Llama 4's QK-norm, after the rotation: each vector over its size, no weight."""
    if getattr(attn, "qk_norm", None) != "l2":
        return v
    return v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + attn.norm_eps)


def head_circuit(stack, layer: int, head: int, top: int, spell, source: str) -> HeadCircuit:
    """`Circuits.head_circuit`: one head's token tables."""
    if type(top) is not int or not 1 <= top <= TOP:
        raise ValueError(f"top must be a whole number from 1 to {TOP}, got {top!r} (the "
                         "candidates for the top are held: the bound bounds memory)")  # fmt: skip
    with torch.no_grad():
        return _head_circuit(stack, layer, head, top, spell, source)


def _head_circuit(stack, layer, head, top, spell, source) -> HeadCircuit:
    attn = stack.blocks[layer].attn
    V = stack.embed.tokens.weight.shape[0]
    E = embeddings(stack, torch.arange(V))  # (V, C)
    q = _l2(attn, read(stack, layer, head, E, "query")) * attn.scale  # (V, D)
    k = _l2(attn, read(stack, layer, head, E, "key"))
    ids, scores = top_pairs(q, k, top)
    notes, distances, by_distance = [], [], []
    if attn.rotary is not None:
        notes.append("the QK table reads each pair at distance 0 (the same position); "
                     "qk_by_distance turns them apart")  # fmt: skip
        distances = list(DISTANCES)
        for a, b in ids[:3]:
            turned = _qk_by_distance(stack, layer, head, a, b, distances)
            by_distance.append(turned.tolist())
    if stack.embed.positions is not None or stack.embed.types is not None:
        notes.append("each token's embedding alone: the position (and segment) embeddings, "
                     "which the stream also holds, are left out")  # fmt: skip
    if attn.window is not None:
        notes.append(f"the layer hides keys {attn.window} or more positions away; "
                     "qk_by_distance scores them all the same")  # fmt: skip
    if attn.softcap is not None:
        notes.append(f"scores before the layer's soft-cap ({attn.softcap})")
    if attn.temperature is not None:
        notes.append("the QK table leaves out the per-position temperature of the queries")
    eigenvalues = copying = copied = copied_ids = None
    lm_head = getattr(stack, "lm_head", None)
    if lm_head is None or type(lm_head) is not nn.Linear:
        notes.append("no LM head: the OV circuit is not read through the vocabulary")
    else:
        values, logits = ov_sides(stack, layer, head, E)  # (V, D) each
        eigenvalues = torch.linalg.eigvals(logits.T @ values)  # (D,): those of values logits^T
        eigenvalues = eigenvalues[torch.argsort(eigenvalues.abs(), descending=True)]
        copying = float(eigenvalues.sum().real / eigenvalues.abs().sum())
        diagonal = (values * logits).sum(-1)  # (V,): copy(t, t), row by row
        best = diagonal.topk(min(top, V))
        copied_ids = best.indices.tolist()
        copied = [(spell(i), float(v)) for i, v in zip(copied_ids, best.values, strict=True)]
    return HeadCircuit(
        source=source, layer=layer, head=head,
        kv_head=head // (attn.num_heads // attn.num_kv_heads), distance=0,
        pairs=[(spell(a), spell(b), s) for (a, b), s in zip(ids, scores, strict=True)],
        pair_ids=ids, eigenvalues=eigenvalues, copying=copying, copied=copied,
        copied_ids=copied_ids, distances=distances, by_distance=by_distance, notes=notes,
    )  # fmt: skip


def ov_sides(stack, layer: int, head: int, E: Tensor) -> tuple[Tensor, Tensor]:
    """The OV circuit through the vocabulary as two (V, D) factors: copy = values @ logits.T.
    values: each token's value in the head (exact, through the layer's norm); logits: the
    LM head's rows (final norm's gain folded, head scale) times the head's output columns
    (a sub-layer output norm's gain folded)."""
    block = stack.blocks[layer]
    values = read(stack, layer, head, E, "value")  # (V, D)
    D = block.attn.head_dim
    W_o = block.attn.out.weight.double()[:, head * D : (head + 1) * D]  # (C, D)
    W_o = fold_rows(getattr(block, "attn_out_norm", None), W_o)
    U = fold_columns(stack.norm, stack.lm_head.weight.double())  # (V, C)
    if stack.config.head_scale is not None:
        U = U * stack.config.head_scale
    return values, U @ W_o


def _gain(norm, what: str) -> tuple[Tensor | None, bool]:
    """A norm's linear part: (its gain or None, whether it centers)."""
    if isinstance(norm, RMSNorm):
        return norm.weight.double() + (1.0 if norm.plus_one else 0.0), False
    if isinstance(norm, nn.LayerNorm):
        return None if norm.weight is None else norm.weight.double(), True
    raise ValueError(f"{what} is a {type(norm).__name__}; qkv folds RMSNorm and LayerNorm only")


def fold_columns(norm, matrix: Tensor) -> Tensor:
    """matrix (R, W) reading a vector that `norm` normalized first: matrix diag(gain) P, P the
    centering where the norm centers (None: no norm, the matrix itself)."""
    if norm is None or isinstance(norm, nn.Identity):
        return matrix
    gain, center = _gain(norm, "the layer's attention norm")
    matrix = matrix if gain is None else matrix * gain
    return matrix - matrix.mean(-1, keepdim=True) if center else matrix


def fold_rows(norm, matrix: Tensor) -> Tensor:
    """matrix (..., W, R) whose output `norm` normalizes next: diag(gain) P matrix."""
    if norm is None or isinstance(norm, nn.Identity):
        return matrix
    gain, center = _gain(norm, "a norm after a head")
    if center:
        matrix = matrix - matrix.mean(-2, keepdim=True)
    return matrix if gain is None else matrix * gain[:, None]


def top_pairs(q: Tensor, k: Tensor, top: int) -> tuple[list[tuple[int, int]], list[float]]:
    """The `top` largest q[a] . k[b] over every (a, b), q (Vq, D) and k (V, D) float64, made in
    blocks of rows: never the whole (Vq, V) table. Returns ([(a, b)], [score]), the largest
    first, each score the float64 dot product.

    Each block is made in float32 first, three times as fast, and only the pairs that could
    reach the top by then are made again in float64: |float32 q.k - q.k| <= margin for every
    pair (the rounding of q and k to float32 and of a D-term sum: (D + 2) u |q| |k|, with u
    2^-24, taken twice), so no pair of the exact top is missed."""
    V, D = k.shape
    q32, k32 = q.float(), k.float()
    margin = (D + 2) * 2.0**-23 * float(q.norm(dim=1).max()) * float(k.norm(dim=1).max())
    best = torch.empty(0, dtype=torch.float64)
    where = torch.empty(0, dtype=torch.long)
    for start in range(0, q.shape[0], _ROWS):
        rough = q32[start : start + _ROWS] @ k32.T  # (rows, V)
        if best.numel() < top:  # the block's k-th largest, at least, is above this
            floor = float(rough.flatten().topk(min(top, rough.numel())).values[-1]) - margin
        else:  # a pair joins the top only above the k-th score so far
            floor = float(best[-1])
        rows, columns = (rough >= floor - margin).nonzero(as_tuple=True)
        exact = (q[start + rows] * k[columns]).sum(-1)  # (n,) float64
        best = torch.cat([best, exact])
        where = torch.cat([where, (start + rows) * V + columns])
        kept = best.topk(min(top, best.numel()))
        best, where = kept.values, where[kept.indices]
    return [(i // V, i % V) for i in where.tolist()], best.tolist()


def qk_by_distance(stack, layer: int, head: int, query_id: int, key_id: int,
                   distances: list[int]) -> Tensor:  # fmt: skip
    """`Circuits.qk_by_distance`: the query token at position max(0, -d) + d, the key token at
    max(0, -d), each turned by the layer's own rotary angles there."""
    if not distances or any(type(d) is not int for d in distances):
        raise ValueError(f"distances must be a list of whole numbers, got {distances!r}")
    with torch.no_grad():
        return _qk_by_distance(stack, layer, head, query_id, key_id, distances)


def _qk_by_distance(stack, layer, head, query_id, key_id, distances) -> Tensor:
    """`qk_by_distance` once its arguments are checked, without a gradient."""
    attn = stack.blocks[layer].attn
    E = embeddings(stack, torch.tensor([query_id, key_id]))
    q = read(stack, layer, head, E[:1], "query")[0]  # (D,)
    k = read(stack, layer, head, E[1:], "key")[0]
    placed = [(max(0, -d) + d, max(0, -d)) for d in distances]  # (query, key) positions
    turn = _turner(stack, layer, max(max(p) for p in placed) + 1)
    scores = []
    for at_q, at_k in placed:
        qd, kd = _l2(attn, turn(q, at_q)), _l2(attn, turn(k, at_k))
        score = attn.scale * float(qd @ kd)
        if attn.temperature is not None:
            score *= float(attn.temperature.of(torch.tensor([at_q])).double()[0])
        scores.append(score)
    return torch.tensor(scores, dtype=torch.float64)


def _turner(stack, layer: int, T: int):
    """v (D,), position -> v turned by the layer's rotary angles there (unturned without)."""
    if stack.blocks[layer].attn.rotary is None:
        return lambda v, position: v
    made = stack.rotary.rotations(torch.arange(T), torch.float64)
    rotation = stack.rotary.rotation_for(made, layer)

    def turn(v: Tensor, position: int) -> Tensor:
        one = Rotation(rotation.cos[position].double(), rotation.sin[position].double())
        return one.apply(v)

    return turn

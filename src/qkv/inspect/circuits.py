"""Each head's circuits, read from the weights alone (Elhage et al. 2021, "A Mathematical
Framework for Transformer Circuits").

A head reads the stream x (a column vector, C wide) twice. Its QK circuit says how much a query
word attends to a key word: score = scale * x_q^T W_QK x_k with W_QK = W_Q^T W_K (C x C), W_Q
the query head's rows of the query matrix (D x C) and W_K its key head's (the head shared by
its group, in grouped-query attention). Its OV circuit says what it writes when it attends:
W_OV x with W_OV = W_O W_V (C x C), W_V its key head's rows of the value matrix and W_O its
columns of the output matrix (C x D). Both have rank D at most, so each is kept as two C x D
factors, W_QK = A B^T and W_OV = L R^T, never as a C x C matrix: singular values come from a QR
of each factor and the SVD of the D x D product of their triangles.

What is folded in: each norm between the stream and a factor, as its linear part (a gain; a
LayerNorm's centering too): the layer's attention norm on the reading side of A, B and R, a
QK-norm's gain on A and B, a sub-layer output norm (Gemma 2 and 3, OLMo 2) on L. Each norm's
scale is one positive number per vector, set by the word the model reads, and is left out:
what the weights alone cannot know. Biases are left out too (a note says where a model has
them).

Composition (Elhage et al.): how much a later head r reads what an earlier head s writes,
comp(W_A, W_B) = ||W_A W_B||_F / (||W_A||_F ||W_B||_F) with W_B = W_OV of s and W_A = W_QK of r
transposed (Q-composition: s writes what r's queries read), W_QK of r (K-composition: what its
keys read), or W_OV of r (V-composition: what its values read). TransformerLens computes the
same scores with row vectors (`OV_s @ QK_r`, `OV_s @ QK_r.T`, `OV_s @ OV_r`). Each numerator is
taken through the factors: ||A B^T W_OV_s||_F = ||R_A (B^T Y_s)||_F, R_A the triangle of A's QR
and Y_s (C x D) the sender's OV with its orthonormal side dropped; D x D products only.

>>> import qkv
>>> found = qkv.circuits(qkv.load("smollm2"))  # 30 layers of 9 query heads, 3 key heads
>>> found.names[:2], tuple(found.qk_singular.shape), found.kv_head[:4]
(['L0.H0', 'L0.H1'], (270, 64), [0, 0, 0, 1])

`found.strongest("k")` then lists the pairs whose K-composition is largest (docs/circuits.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Literal

import torch
from torch import Tensor, nn

from qkv.inspect.circuit_tokens import (
    HeadCircuit,
    fold_columns,
    fold_rows,
    head_circuit,
    qk_by_distance,
)
from qkv.inspect.residual import check_walkable
from qkv.models.stacks import self_attention_stack
from qkv.nn import LatentAttention
from qkv.nn.delta import GatedDeltaNet
from qkv.views import Shown

__all__ = ["Circuits", "HeadCircuit", "circuits", "fold_rows", "head_matrices"]

Kind = Literal["q", "k", "v"]
KINDS = ("q", "k", "v")


@dataclass(repr=False)
class Circuits(Shown):
    """Every softmax head's QK and OV circuits and the composition scores between them.

    names[i] ("L2.H5") names head i, in the order layer by layer; layer[i], head[i], kv_head[i]
    its place; qk_singular and ov_singular (N, D) float64 the singular values of its W_QK and
    W_OV, largest first. `composition(kind)` (L, H, L, H): the score of sender (l, h) and
    receiver (m, g), NaN unless l < m; `strongest(kind)` the top pairs; `head_circuit(l, h)`
    one head's circuits through the embedding and unembedding; `qk_by_distance` its QK for a
    pair of tokens as a function of their distance (rotary layers)."""

    view: ClassVar[str] = "circuits"

    source: str
    num_layers: int
    num_heads: int  # the most heads a layer has
    names: list[str]
    layer: list[int]
    head: list[int]
    kv_head: list[int]
    qk_singular: Tensor
    ov_singular: Tensor
    skipped: list[int]  # layers with no softmax heads (linear attention)
    notes: list[str]
    rotary: bool  # some layer turns its queries and keys by position
    _factors: dict = field(default_factory=dict, compare=False)
    _scores: dict = field(default_factory=dict, compare=False)
    _stack: nn.Module | None = field(default=None, compare=False)
    _spell: object = field(default=None, compare=False)
    _token_id: object = field(default=None, compare=False)

    def index(self, layer: int, head: int) -> int:
        """The position of (layer, head) in `names`; a clear error if it has no QK circuit."""
        name = f"L{layer}.H{head}"
        if name not in self.names:
            if not 0 <= layer < self.num_layers:
                raise ValueError(
                    f"layer {layer} is out of range: {self.source} has {self.num_layers} "
                    f"layers (0..{self.num_layers - 1})"
                )
            if layer in self.skipped:
                raise ValueError(f"layer {layer} of {self.source} is linear attention: its "
                                 "heads have no softmax QK circuit")  # fmt: skip
            count = self.layer.count(layer)
            raise ValueError(f"head {head} is out of range: layer {layer} has {count} heads "
                             f"(0..{count - 1})")  # fmt: skip
        return self.names.index(name)

    def composition(self, kind: Kind = "k") -> Tensor:
        """(L, H, L, H) float64: comp of sender (l, h) into receiver (m, g) for l < m, NaN
        elsewhere. kind "q", "k" or "v" (see the module's docstring). Computed on first use."""
        if kind not in KINDS:
            raise ValueError(f"kind must be 'q', 'k' or 'v', got {kind!r}")
        if kind not in self._scores:
            self._scores[kind] = _composition(self, kind)
        return self._scores[kind]

    def strongest(self, kind: Kind = "k", top: int = 10) -> list[tuple[str, str, float]]:
        """The `top` strongest compositions of a kind: [(sender "L0.H3", receiver "L2.H5",
        score)], the largest score first; the sender always in an earlier layer."""
        if type(top) is not int or top < 1:
            raise ValueError(f"top must be a whole number >= 1, got {top!r}")
        scores = self.composition(kind).flatten()
        valid = scores == scores
        order = torch.argsort(torch.where(valid, scores, -1.0), descending=True)
        order = order[: min(top, int(valid.sum()))]
        H, L = self.num_heads, self.num_layers
        pairs = []
        for i in order.tolist():
            sl, sh, rl, rh = i // (H * L * H), i // (L * H) % H, i // H % L, i % H
            pairs.append((f"L{sl}.H{sh}", f"L{rl}.H{rh}", float(scores[i])))
        return pairs

    def head_circuit(self, layer: int, head: int, top: int = 10) -> HeadCircuit:
        """One head's circuits through the embedding and unembedding (`HeadCircuit`): the top
        token pairs its QK prefers at distance 0 and the tokens its OV copies."""
        self.index(layer, head)
        return head_circuit(self._stack, layer, head, top, self._spell, self.source)

    def qk_by_distance(self, layer: int, head: int, query_token: str | int,
                       key_token: str | int, distances) -> Tensor:  # fmt: skip
        """(len(distances),) float64: the score of `query_token` reading `key_token` placed
        d positions before it (the key at position max(0, -d), the query d after it), for
        each d: what a rotary layer's QK circuit gives the two tokens' embeddings alone."""
        self.index(layer, head)
        ids = [self._token_id(t) for t in (query_token, key_token)]
        return qk_by_distance(self._stack, layer, head, ids[0], ids[1], list(distances))

    def to_dict(self, top: int = 10) -> dict:
        """Plain data for JSON: each head's singular values and the top compositions of each
        kind (computing all three)."""
        return {
            "source": self.source,
            "layers": self.num_layers,
            "heads": self.num_heads,
            "skipped_layers": list(self.skipped),
            "rotary": self.rotary,
            "notes": list(self.notes),
            "singular_values": {
                name: {"qk": self.qk_singular[i].tolist(), "ov": self.ov_singular[i].tolist()}
                for i, name in enumerate(self.names)
            },
            "strongest": {
                kind: [{"sender": s, "receiver": r, "score": v}
                       for s, r, v in self.strongest(kind, top)]
                for kind in KINDS
            },
        }  # fmt: skip


def circuits(pretrained) -> Circuits:
    """Every head's QK and OV circuits from `pretrained`'s weights (the self-attention of an
    encoder or a decoder; an encoder-decoder's encoder). See the module's docstring for what
    is folded and what is left out."""
    from qkv.inspect.lens import token_id_of  # lens imports the decoder's forward; only here

    stack = self_attention_stack(pretrained.model, "qkv.circuits", pretrained.source)
    found = stack_circuits(stack, pretrained.source)
    found._spell = lambda i: pretrained.tokenizer.pieces([i])[0]
    found._token_id = lambda t: token_id_of(pretrained, t)
    return found


def stack_circuits(stack, source: str = "the model") -> Circuits:
    """`circuits` of an Encoder or a Decoder; tokens are spelled by their ids."""
    check_circuits(stack, source)
    with torch.no_grad():
        return _stack_circuits(stack, source)


def check_circuits(stack, source: str) -> None:
    """Refuse, by name, a stack whose heads' circuits the weights alone do not give."""
    check_walkable(stack, source, "qkv.circuits")
    for layer, block in enumerate(stack.blocks):
        attn = block.attn
        if isinstance(attn, LatentAttention):
            raise ValueError(
                f"qkv.circuits reads a head's W_Q^T W_K; {source}'s layer {layer} is latent "
                "attention, whose query and key pass through norms of their own low-rank "
                "steps, so no one matrix gives its scores"
            )
        if isinstance(attn, GatedDeltaNet):
            continue
        if getattr(attn, "gate", None) is not None:
            raise ValueError(f"qkv.circuits reads a head's W_O W_V; {source}'s layer {layer} "
                             "gates each head's output by a sigmoid of its input, so no one "
                             "matrix gives what it writes")  # fmt: skip
        linears = [getattr(attn, n, None) for n in ("q", "k", "v", "qkv")]
        if any(m is not None and type(m) is not nn.Linear for m in linears):
            raise ValueError(f"qkv.circuits reads the query, key and value matrices; {source}'s "
                             f"layer {layer} is packed (int4): load it without int4")  # fmt: skip


def head_matrices(block) -> dict[str, Tensor]:
    """One softmax layer's matrices with its norms' linear parts folded in, float64: "q" (H, D,
    C), "k" and "v" (Hkv, D, C) as they read the stream, "o" (H, C, D) as it writes."""
    attn = block.attn
    H, Hkv, D = attn.num_heads, attn.num_kv_heads, attn.head_dim
    if hasattr(attn, "qkv"):
        q, k, v = attn.qkv.weight.double().split(attn.sizes, dim=0)
    else:
        q, k, v = (m.weight.double() for m in (attn.q, attn.k, attn.v))
    reading = block.attn_norm if block.position == "pre" else None
    q, k, v = (fold_columns(reading, m) for m in (q, k, v))
    if attn.qk_norm == "full":  # over every head at once: fold before the heads are cut
        q, k = fold_rows(attn.q_norm, q), fold_rows(attn.k_norm, k)
    q, k, v = q.view(H, D, -1), k.view(Hkv, D, -1), v.view(Hkv, D, -1)
    if attn.qk_norm == "head":
        q, k = fold_rows(attn.q_norm, q), fold_rows(attn.k_norm, k)
    o = attn.out.weight.double()  # (C, H*D)
    o = fold_rows(getattr(block, "attn_out_norm", None), o)
    return {"q": q, "k": k, "v": v, "o": o.view(-1, H, D).permute(1, 0, 2)}


def _stack_circuits(stack, source: str) -> Circuits:
    names, layers, heads, kv_heads, skipped = [], [], [], [], []
    qk_sv, ov_sv = [], []
    factors: dict[str, list] = {n: [] for n in ("A", "Y", "Ra", "Rb", "Rl", "B", "R")}
    rotary, biased = False, False
    for m, block in enumerate(stack.blocks):
        attn = block.attn
        if isinstance(attn, GatedDeltaNet):
            skipped.append(m)
            continue
        rotary |= attn.rotary is not None
        linears = [getattr(attn, n, None) for n in ("q", "k", "v", "qkv", "out")]
        biased |= any(getattr(x, "bias", None) is not None for x in linears)
        W = head_matrices(block)
        group = attn.num_heads // attn.num_kv_heads
        # the triangles of each factor's QR (the orthonormal sides are never needed)
        Rb = _triangle(W["k"].transpose(1, 2))  # B = W_K^T (Hkv, C, D)
        Rr = _triangle(W["v"].transpose(1, 2))  # R = W_V^T
        Ra = _triangle(W["q"].transpose(1, 2))  # A = W_Q^T (H, C, D)
        Rl = _triangle(W["o"])  # L = W_O's columns (H, C, D)
        g = torch.arange(attn.num_heads) // group  # each query head's key head
        qk_sv.append(torch.linalg.svdvals(Ra @ Rb[g].transpose(1, 2)))  # (H, D)
        ov_sv.append(torch.linalg.svdvals(Rl @ Rr[g].transpose(1, 2)))
        factors["A"].append(W["q"].transpose(1, 2))
        factors["B"].append(W["k"].transpose(1, 2))
        factors["R"].append(W["v"].transpose(1, 2))
        factors["Y"].append(W["o"] @ Rr[g].transpose(1, 2))  # W_OV = Y Qr^T, (H, C, D)
        factors["Ra"].append(Ra)
        factors["Rb"].append(Rb[g])
        factors["Rl"].append(Rl)
        for h in range(attn.num_heads):
            names.append(f"L{m}.H{h}")
            layers.append(m)
            heads.append(h)
            kv_heads.append(int(g[h]))
    if not names:
        raise ValueError(f"qkv.circuits reads softmax heads; {source} has none")
    notes = ["each norm's gain (a LayerNorm's centering too) is folded into the factor that "
             "reads (or writes) through it; its scale, one number per vector, is not"]  # fmt: skip
    if biased:
        notes.append("the query, key, value and output biases are left out")
    if rotary:
        notes.append("rotary layers: W_QK is the score at distance 0 (the same position); "
                     "qk_by_distance gives other distances")  # fmt: skip
    if any(getattr(b.attn, "qk_norm", None) == "l2" for b in stack.blocks):
        notes.append("an L2 QK-norm (no weight) divides each query and key by its size")
    if stack.blocks[0].position == "post":
        notes.append(
            "post-norm blocks: composition scores are refused (a head's output passes "
            "through every later sum's norm before a later head reads it)"
        )
    return Circuits(
        source=source, num_layers=len(stack.blocks), num_heads=max(heads) + 1, names=names,
        layer=layers, head=heads, kv_head=kv_heads, qk_singular=torch.cat(qk_sv),
        ov_singular=torch.cat(ov_sv), skipped=skipped, notes=notes, rotary=rotary,
        _factors=factors, _stack=stack, _spell=str, _token_id=_plain_id,
    )  # fmt: skip


def _triangle(factors: Tensor) -> Tensor:
    """(..., D, D): R of each (C, D) factor's QR, factor = Q R."""
    return torch.linalg.qr(factors.contiguous(), mode="r").R


def _plain_id(token) -> int:
    if type(token) is not int:
        raise ValueError(f"without a tokenizer, tokens are given by id, got {token!r}")
    return token


def _composition(found: Circuits, kind: str) -> Tensor:
    """(L, H, L, H): every (sender, receiver) score of one kind, sender layer < receiver's."""
    stack = found._stack
    if stack is not None and stack.blocks[0].position == "post":
        raise ValueError(f"composition scores read a head's output as a later head reads it; "
                         f"{found.source}'s blocks normalize after each residual sum (post-norm), "
                         "so between them lie norms of the whole stream")  # fmt: skip
    f = found._factors
    L, H = found.num_layers, found.num_heads
    scores = torch.full((L, H, L, H), float("nan"), dtype=torch.float64)
    Y = torch.cat(f["Y"])  # (N, C, D): every head's W_OV as Y Q^T, Q orthonormal
    Y_norm = Y.flatten(1).norm(dim=1)  # (N,) = ||W_OV||_F
    C = Y.shape[1]
    flat = Y.permute(1, 0, 2).reshape(C, -1)  # (C, N*D): every sender side by side
    own = (found.ov_singular if kind == "v" else found.qk_singular).norm(dim=1)  # (N,)
    layer, head = torch.tensor(found.layer), torch.tensor(found.head)
    kv_head = torch.tensor(found.kv_head)
    start = 0
    for i in range(len(f["Ra"])):
        n = f["Ra"][i].shape[0]
        if start:  # every head of an earlier layer sends
            # the receiver's reading side (its query's A, key's B, value's R) and the triangle
            # of its other factor: ||W_A W_OV_s||_F = ||core (side^T Y_s)||_F
            side, core = {"q": (f["A"][i], f["Rb"][i]), "k": (f["B"][i], f["Ra"][i]),
                          "v": (f["R"][i], f["Rl"][i])}[kind]  # fmt: skip
            D = Y.shape[2]
            G = side.transpose(1, 2) @ flat[:, : start * D]  # (G, D, S*D): each reading side
            if G.shape[0] != n:  # key heads shared by groups of query heads
                G = G[kv_head[start : start + n] - kv_head[start]]
            product = (core @ G).view(n, D, start, D)  # (n, D, S, D)
            num = torch.linalg.vector_norm(product, dim=(1, 3))  # (n, S)
            comp = num / (own[start : start + n, None] * Y_norm[None, :start])
            receivers = torch.arange(start, start + n)
            scores[layer[:start, None], head[:start, None], layer[receivers], head[receivers]] = (
                comp.T)  # fmt: skip
        start += n
    return scores

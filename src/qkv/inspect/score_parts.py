"""One word's query (or key) in one head, as a sum over the parts of the stream that made it.

The stream entering a layer is a sum of parts (`qkv.inspect.residual`). Between the stream and
the vector a head's dot product reads lie the layer's norm, its query (key) matrix, a QK-norm
where the model has one, the head's slice, the rotation of the word's position and, in Llama 4,
an L2 norm after it. With every norm's scale held at its value in this forward pass each of
these is linear (or affine: a bias, a norm's shift), so every part has its own query vector and
they sum to the head's real one; the affine shifts join the part "bias". `read` builds that
chain for one side of one pair and applies it to the parts; `Side.linear` applies it, shifts
left out, to any other vector written into the stream at the word (one source word's share of
a head's output).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from qkv.inspect.residual import Frozen, Stream, freeze
from qkv.nn import LatentAttention
from qkv.nn.position import Rotation

Stage = tuple[str, Callable[[Tensor], Tensor], Tensor | None]  # (name, linear map, shift)


@dataclass
class Side:
    """The query (or key) side of a pair: each part's final vector (P, D) float64, in the order
    of the stream's parts; `plain` the same turned as if the word stood at position 0 (a rotary
    layer; None elsewhere); `total` the real vector the chain gives the whole stream."""

    role: str  # "query" or "key"
    vectors: Tensor
    plain: Tensor | None
    total: Tensor
    stages: list[Stage]

    def linear(self, v: Tensor) -> Tensor:
        """v (..., C), written into the stream at this word: its part of the vector (..., D)."""
        for _, fn, _ in self.stages:
            v = fn(v)
        return v


def read(
    attn, norm, rotation: Rotation | None, stream: Stream, n: int, role: str, head: int,
    layer: int,
) -> Side:  # fmt: skip
    """The chain from the stream at word n (of `stream.positions`) to the vector head `head`'s
    dot product reads there: role "query" (the query head) or "key" (its key head). norm: the
    norm the layer reads the stream through (a pre-norm block's; an encoder's final norm for
    cross-attention's keys), or None; rotation: the layer's rotation of every position, or
    None where it turns nothing."""
    position = stream.positions[n]
    stages: list[Stage] = []
    total = stream.actual[n]  # (C,) the model's own stream at the word

    def add(name: str, fn, shift: Tensor | None) -> None:
        nonlocal total
        stages.append((name, fn, shift))
        total = fn(total) if shift is None else fn(total) + shift

    def current() -> Tensor:
        return total

    add_norm(add, freeze(norm, total, f"layer {layer}'s attention norm"), "norm")
    start = 0  # where the turned dimensions of the head's vector begin
    if isinstance(attn, LatentAttention):
        start = _latent(attn, role, head, layer, add, current)
    else:
        _multi_head(attn, role, head, layer, add, current)
    plain_turn = None
    if rotation is not None:
        add("rotation", _turn(rotation, position, start), None)
        plain_turn = _turn(rotation, 0, start)
    if getattr(attn, "qk_norm", None) == "l2":  # Llama 4: no weight, after the rotation
        scale = torch.rsqrt(total.pow(2).mean(-1) + attn.norm_eps)
        add("l2-norm", Frozen(scale, None, False, None), None)
    vectors = _run(stages, stream.vectors[:, n], stream.index("bias"))
    plain = None
    if rotation is not None:
        swapped = [(s[0], plain_turn, s[2]) if s[0] == "rotation" else s for s in stages]
        plain = _run(swapped, stream.vectors[:, n], stream.index("bias"))
    return Side(role, vectors, plain, total, stages)


def _multi_head(attn, role: str, head: int, layer: int, add, current) -> None:
    """MultiHeadAttention's stages: its matrix, a QK-norm over all heads or one, the head
    (a query head's key head where heads share keys)."""
    D = attn.head_dim
    g = head if role == "query" else head // (attn.num_heads // attn.num_kv_heads)
    W, b = _projection(attn, role, layer)
    add("projection", lambda v: v @ W.T, b)
    qk_norm = getattr(attn, "q_norm" if role == "query" else "k_norm", None)
    if attn.qk_norm == "full":  # OLMo 2: over every head at once
        add_norm(add, freeze(qk_norm, current(), f"layer {layer}'s QK-norm"), "qk-norm")
    add("head", lambda v: v[..., g * D : (g + 1) * D], None)
    if attn.qk_norm == "head":  # Qwen3, Gemma 3: over each head alone
        add_norm(add, freeze(qk_norm, current(), f"layer {layer}'s QK-norm"), "qk-norm")


def _latent(attn, role: str, head: int, layer: int, add, current) -> int:
    """Latent attention's stages (DeepSeek-V3): a query from x (or through a low-rank step and
    its norm); a key [k_nope, k_pe] from kv_a's [c, k_pe], c normed and expanded by the head's
    W_uk. Returns where the rotary part begins (qk_nope_head_dim)."""
    cfg = attn.config
    nope, rope, R = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank
    _packed(attn, layer)
    if role == "query":
        if cfg.q_lora_rank is None:
            add("projection", _matrix(attn.q.weight), _bias(attn.q))
        else:
            add("low rank", _matrix(attn.q_a.weight), _bias(attn.q_a))
            add_norm(add, freeze(attn.q_a_norm, current(), f"layer {layer}'s q_a norm"), "norm")
            add("projection", _matrix(attn.q_b.weight), _bias(attn.q_b))
        size = nope + rope
        add("head", lambda v: v[..., head * size : (head + 1) * size], None)
        return nope
    add("compression", _matrix(attn.kv_a.weight), _bias(attn.kv_a))
    frozen = freeze(attn.kv_a_norm, current()[..., :R], f"layer {layer}'s kv_a norm")
    add("latent norm", lambda v: torch.cat([frozen(v[..., :R]), v[..., R:]], -1), None)
    W_uk = attn.kv_b.weight.double().view(cfg.num_heads, nope + cfg.v_head_dim, R)[head, :nope]
    add("head", lambda v: torch.cat([v[..., :R] @ W_uk.T, v[..., R:]], -1), None)
    return nope


def _matrix(weight: Tensor) -> Callable[[Tensor], Tensor]:
    W = weight.double()
    return lambda v: v @ W.T


def _bias(linear: nn.Linear) -> Tensor | None:
    return None if linear.bias is None else linear.bias.double()


def _packed(attn, layer: int) -> None:
    matrices = [getattr(attn, name, None) for name in ("q", "q_a", "q_b", "kv_a", "kv_b")]
    if any(m is not None and type(m) is not nn.Linear for m in matrices):
        raise ValueError(f"taking a score apart reads the query and key matrices; layer {layer}'s "
                         "are packed (int4): load the model without int4")  # fmt: skip


def read_self(stack, layer: int, stream: Stream, n: int, role: str, head: int, T: int) -> Side:
    """`read` for a stack's own self-attention at `layer`, over a text of T tokens."""
    block = stack.blocks[layer]
    norm = block.attn_norm if block.position == "pre" else None  # the layer reads it normed
    return read(block.attn, norm, _rotation(stack, layer, T), stream, n, role, head, layer)


def add_norm(add, frozen: Frozen | None, name: str) -> None:
    if frozen is not None:
        add(name, frozen, frozen.shift)


def _run(stages: list[Stage], parts: Tensor, bias: int) -> Tensor:
    """Parts (P, C) through the stages; each stage's shift joins part `bias`."""
    parts = parts.clone()
    for _, fn, shift in stages:
        parts = fn(parts)
        if shift is not None:
            parts[bias] = parts[bias] + shift
    return parts


def _projection(attn, role: str, layer: int) -> tuple[Tensor, Tensor | None]:
    """The layer's query (or key) matrix (rows: every head's, H*D or Hkv*D) and bias, float64."""
    q_size, kv_size = attn.sizes[0], attn.sizes[1]
    if hasattr(attn, "qkv"):
        linear = attn.qkv
        part = slice(0, q_size) if role == "query" else slice(q_size, q_size + kv_size)
        weight, bias = linear.weight[part], None if linear.bias is None else linear.bias[part]
    else:
        linear = attn.q if role == "query" else attn.k
        weight, bias = linear.weight, linear.bias
    if type(linear) is not nn.Linear:
        raise ValueError(f"taking a score apart reads the query and key matrices; layer {layer}'s "
                         "are packed (int4): load the model without int4")  # fmt: skip
    return weight.double(), None if bias is None else bias.double()


def _rotation(stack, layer: int, T: int) -> Rotation | None:
    """The layer's rotation of positions 0..T-1 in float64, or None where it turns nothing."""
    if stack.blocks[layer].attn.rotary is None:
        return None
    made = stack.rotary.rotations(torch.arange(T), torch.float64)
    return stack.rotary.rotation_for(made, layer)


def _turn(rotation: Rotation, position: int, start: int = 0) -> Callable[[Tensor], Tensor]:
    """The rotation of one position, applied to a head's vectors from dimension `start` on (a
    latent head turns its rotary part, after the unturned one)."""
    one = Rotation(rotation.cos[position].double(), rotation.sin[position].double())
    if not start:
        return one.apply
    return lambda v: torch.cat([v[..., :start], one.apply(v[..., start:])], -1)


def pieces_of_head(
    stack, out, m: int, h: int, position: int
) -> tuple[Tensor, Tensor, Tensor] | None:
    """What head h of layer m wrote at `position`, split over the words it read: (weights (T,),
    written (T, Dv): weight * value * output gate, W_o (C, Dv): the head's slice of the output
    matrix; written @ W_o.T sums over the words to the head's output there), or None where the
    head's output is not such a sum (a linear layer's memory, compressed entries). The weights
    are the query's row by the `loop` backend: never the layer's whole (T, T)."""
    record = out.records[m]
    if record.linear is not None or getattr(record, "compressed", None) is not None:
        return None
    s = record.shape
    weights = record.steps(h, position).weights.double()  # (Tk,)
    values = record.v[0, h // s.group].double()  # (Tk, Dv)
    written = weights[:, None] * values
    if record.output_gate is not None:
        written = written * record.output_gate[0, h, position].double()
    Dv = values.shape[-1]
    W_o = stack.blocks[m].attn.out.weight.double()[:, h * Dv : (h + 1) * Dv]  # (C, Dv)
    return weights, written, W_o

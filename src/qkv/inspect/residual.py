"""The residual stream taken apart: what each earlier part of the model wrote into a word.

A block adds to the stream what its attention and its MLP computed, so the vector entering a
layer is a sum of parts: the embedding, each earlier head's output (through its slice of the
output matrix), each earlier MLP's output, and biases. A norm between them is not linear, but
with its scale held at the value it had in this forward pass (one number per word, which the
stream itself gives) it is: RMSNorm is then a gain, LayerNorm a gain after centering (and its
shift a bias of its own). `walk` follows one forward pass through the blocks and returns the
parts at the words asked, each carried through every frozen norm it passed, summing to the
stream; `carry` sends any other vector written by a head (one source word's share of it) along
the same path.

The direct logit attribution (`qkv.inspect.lens`) reads the last stream this way, `qkv.why` the
stream entering a layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from qkv.models import Decoder, Encoder
from qkv.models.encoder import padded_positions
from qkv.nn import RMSNorm
from qkv.nn.delta import GatedDeltaNet
from qkv.nn.position import positions_for


@dataclass(frozen=True)
class Frozen:
    """A norm with its scale held: v -> gain * scale * (v - mean(v) if center), over the last
    dimension; `shift` (LayerNorm's bias) is added once, to the parts' "bias"."""

    scale: Tensor  # (...,) one per vector normalized, float64
    gain: Tensor | None  # (W,) float64
    center: bool
    shift: Tensor | None  # (W,) float64

    def at(self, n: int) -> Frozen:
        """The same norm with the scale of vector n alone."""
        return Frozen(self.scale[n], self.gain, self.center, self.shift)

    def __call__(self, v: Tensor) -> Tensor:
        """v (..., *scale.shape, W): the linear part of the norm, applied to parts."""
        if self.center:
            v = v - v.mean(-1, keepdim=True)
        v = v * self.scale[..., None]
        return v if self.gain is None else v * self.gain


def freeze(norm: nn.Module | None, actual: Tensor, what: str = "a norm") -> Frozen | None:
    """`norm` with its scale held at its value on `actual` (..., W) (what it normalized in this
    forward pass); None for no norm."""
    if norm is None or isinstance(norm, nn.Identity):
        return None
    actual = actual.double()
    if isinstance(norm, RMSNorm):
        scale = torch.rsqrt(actual.pow(2).mean(-1) + norm.eps)
        gain = norm.weight.double() + (1.0 if norm.plus_one else 0.0)
        return Frozen(scale, gain, False, None)
    if isinstance(norm, nn.LayerNorm):
        scale = torch.rsqrt(actual.var(-1, unbiased=False) + norm.eps)
        gain = None if norm.weight is None else norm.weight.double()
        shift = None if norm.bias is None else norm.bias.double()
        return Frozen(scale, gain, True, shift)
    raise ValueError(f"{what} is a {type(norm).__name__}; qkv holds the scale of RMSNorm and "
                     "LayerNorm only")  # fmt: skip


def head_writes(block, record, x: Tensor, position: int | Tensor) -> Tensor:
    """(H, Dv) or (H, N, Dv) float64: what each head gives the output projection at
    `position` (an int, or a (N,) tensor of them). A softmax layer's record keeps it (times the
    record's output gate where the layer has one); a linear layer's keeps each head's read of
    its memory, which is RMS-normalized and gated by the layer's input first (x (1, T, C): the
    block's input)."""
    if not isinstance(block.attn, GatedDeltaNet):
        out = record.out[0, :, position].double()
        if record.output_gate is not None:  # Qwen3.5's gate, between the heads and W_o
            out = out * record.output_gate[0, :, position].double()
        return out
    h = block.sublayer_input(x, block.attn_norm)  # what the layer read
    # the layer's own gated norm on its own read: the projection's input, (1, T, H, Dv)
    gated = block.attn.gated_read(record.out, h)[0].transpose(0, 1)  # (H, T, Dv)
    return gated[:, position].double()


@dataclass
class Stream:
    """The stream entering layer `layer` at N words, taken apart.

    names[p] names part p: "embedding", "L3.H5", "L3.mlp", "bias" (every bias and norm shift,
    carried like the rest); vectors (P, N, C) float64 sum over P to the stream.
    `maps` keeps, per earlier layer, the frozen norms a head's output passed on its way here
    (`carry`)."""

    layer: int
    positions: list[int]
    names: list[str]
    vectors: Tensor
    actual: Tensor  # (N, C) float64: the model's own stream at those words
    # layer -> (the norm on that layer's attention output alone, the norms on the whole stream
    # after it: attention's post-norm, the MLP's post-norm)
    maps: dict[int, tuple[Frozen | None, list[Frozen]]] = field(default_factory=dict)
    into: bool = False  # the stream after `layer`'s own self-attention (its cross-attention's)
    _index: dict[str, int] = field(default_factory=dict)

    def index(self, name: str) -> int:
        if not self._index:
            self._index.update({n: i for i, n in enumerate(self.names)})
        return self._index[name]

    def carry(self, vectors: Tensor, layer: int, n: int) -> Tensor:
        """vectors (..., C) written by a head of `layer` into the stream at word n (of
        `positions`), before any norm of that layer, as they arrive here: through the same
        frozen norms the head's output passed."""
        vectors = vectors.double()
        for m in range(layer, self.layer + self.into):
            own, after = self.maps[m]
            if m == layer and own is not None:
                vectors = own.at(n)(vectors)
            for frozen in after:
                vectors = frozen.at(n)(vectors)
        return vectors


def check_walkable(stack: Encoder | Decoder, source: str, what: str) -> None:
    """Refuse, by name, a stack whose stream is not a sum of its parts under frozen norms."""
    name = type(stack).__name__
    if name == "DeepseekV4Decoder":
        raise ValueError(
            f"{what} splits one vector per word; {source} is a DeepSeek-V4 decoder, "
            "which keeps n streams per word between layers (hyper-connections)"
        )
    if name == "Gemma4Decoder":
        raise ValueError(f"{what} splits the stream into its parts; {source} is a Gemma 4 "
                         "decoder, whose layers add a per-layer input and scale the whole stream "
                         "by a learned scalar, which qkv does not split yet")  # fmt: skip
    for layer, block in enumerate(stack.blocks):
        if type(block.attn.out) is not nn.Linear:
            raise ValueError(
                f"{what} reads each head's slice of the output matrix; {source}'s "
                f"layer {layer} is packed (int4): load it without int4"
            )


def walk(stack: Encoder | Decoder, out, layer: int, positions: list[int], *,
         into: bool = False, ids: Tensor | None = None) -> Stream:  # fmt: skip
    """The stream entering `layer` at `positions`, taken apart, from `out`: the stack's
    forward with every earlier layer's record (and cross-attention record, in a decoder that
    has cross-attention) and hidden_states=True. into: the stream `layer`'s cross-attention
    reads instead, after the layer's own self-attention. ids (1, T): the forward's tokens,
    to split the embedding into the token's ("embedding"), the learned or sinusoidal
    position's ("position") and the segment's ("segment"); without them it is one part."""
    states = out.hidden_states
    where = torch.tensor(positions)
    x0 = states[0][0, where].double()  # (N, C)
    names, stream = ["embedding", "bias"], torch.stack([x0, torch.zeros_like(x0)])  # (P, N, C)
    if ids is not None and (stack.embed.positions is not None or stack.embed.types is not None):
        names, stream = _embedding_parts(stack, ids, where)
    maps: dict[int, tuple[Frozen | None, list[Frozen]]] = {}
    for m in range(layer + 1 if into else layer):
        block = stack.blocks[m]
        writes = head_writes(block, out.records[m], states[m], where)  # (H, N, Dv)
        post = block.attn_norm if block.position == "post" else None
        stream, own, frozen = _attention(stream, names, writes, block.attn.out,
                                         block.attn_out_norm, post, f"L{m}.H", m)  # fmt: skip
        after = [frozen] if frozen is not None else []
        maps[m] = (own, after)
        if m == layer:
            break  # into: the stream the layer's cross-attention reads
        if getattr(block, "cross_attn", None) is not None:
            writes = out.cross_records[m].out[0, :, where].double()
            post = block.cross_norm if block.position == "post" else None
            stream, _, frozen = _attention(
                stream,
                names,
                writes,
                block.cross_attn.out,
                block.cross_out_norm,
                post,
                f"L{m}.cross.H",
                m,
            )
            after += [frozen] if frozen is not None else []
        names.append(f"L{m}.mlp")
        if block.position == "post":  # norm(x + mlp(x))
            mid = stream.sum(0)  # the MLP's input, (N, C)
            mlp, _ = block._mlp(mid.to(states[m].dtype)[None], False)
            if block.mlp_out_norm is not None:
                mlp = block.mlp_out_norm(mlp)
            mlp = mlp[0].double()
            frozen = freeze(block.mlp_norm, mid + mlp, f"layer {m}'s MLP norm")
            stream = _through(frozen, torch.cat([stream, mlp[None]]))
            after += [frozen] if frozen is not None else []
        else:  # the MLP's part is what the block added beyond the attention's
            mlp = states[m + 1][0, where].double() - stream.sum(0)
            stream = torch.cat([stream, mlp[None]])
    actual = stream.sum(0) if into else states[layer][0, where].double()
    return Stream(layer, list(positions), names, stream, actual, maps, into)


def _embedding_parts(stack, ids: Tensor, where: Tensor) -> tuple[list[str], Tensor]:
    """The embedding at the words `where` as parts: the token's (times the model's scale), the
    position's and the segment's (segment 0, as the forward without token types), through the
    embedding's norm held (its shift joins "bias")."""
    embed, T = stack.embed, ids.shape[1]
    scale = embed.scale
    if embed.round_scale:  # as Embeddings.forward: the scale in the weights' dtype first
        scale = float(torch.tensor(scale, dtype=torch.float32).to(embed.tokens.weight.dtype))
    names = ["embedding", "bias"]
    tokens = embed.tokens.weight[ids[0, where]].double() * scale  # (N, C)
    parts = [tokens, torch.zeros_like(tokens)]
    if embed.positions is not None:
        padding = getattr(stack.config, "position_padding", None)
        at = positions_for(T, device=ids.device) if padding is None else (
            padded_positions(ids, padding)[0])  # fmt: skip
        names.append("position")
        parts.append(embed.positions(at[where]).double())
    if embed.types is not None:
        names.append("segment")
        parts.append(embed.types.weight[0].double().expand_as(tokens))
    stream = torch.stack(parts)
    frozen = freeze(embed.norm, stream.sum(0), "the embeddings' norm")
    return names, _through(frozen, stream)


def _attention(
    stream: Tensor, names: list[str], writes: Tensor, out: nn.Linear, own_norm, post_norm,
    label: str, m: int,
) -> tuple[Tensor, Frozen | None, Frozen | None]:  # fmt: skip
    """The stream (P, N, C) with one attention's heads added as parts (named label + head):
    writes (H, N, Dv) through each head's slice of `out`, its bias joining "bias"; own_norm
    on the attention's output (sublayer_norm), post_norm on the sum (a post-norm block), each
    frozen and returned (None where there is none)."""
    H, _, Dv = writes.shape
    W_o = out.weight.double().view(-1, H, Dv)  # (C, H, Dv)
    heads = torch.einsum("hnd,chd->hnc", writes, W_o)  # (H, N, C)
    bias = torch.zeros_like(stream[0])
    if out.bias is not None:
        bias = bias + out.bias.double()
    attended = heads.sum(0) + bias  # (N, C): the attention's output
    own = freeze(own_norm, attended, f"layer {m}'s attention output norm")
    if own is not None:  # Gemma 2 and 3, OLMo 2: the output normalized before the sum
        heads, bias = own(heads), own(bias)
        if own.shift is not None:
            bias = bias + own.shift
        attended = heads.sum(0) + bias
    before = stream.sum(0)
    names += [f"{label}{h}" for h in range(H)]
    stream = torch.cat([stream, heads])
    stream[1] = stream[1] + bias
    post = freeze(post_norm, before + attended, f"layer {m}'s attention norm")
    return _through(post, stream), own, post


def _through(frozen: Frozen | None, stream: Tensor) -> Tensor:
    """Parts (P, N, C) through a frozen norm of the whole stream (None: none): each part's
    linear image; the norm's shift joins the "bias" part (index 1)."""
    if frozen is None:
        return stream
    stream = frozen(stream)
    if frozen.shift is not None:
        stream[1] = stream[1] + frozen.shift
    return stream

"""A layer of linear attention: Qwen3.5's Gated DeltaNet and Kimi Linear's KDA.

The article's query, key and value matrices are here too, but the queries do not meet every
key in a softmax: each head writes every token's value into a running memory under its key
and reads it with its query (`qkv.attention.linear`). Around that rule:

- one matrix makes every head's query, key and value (`qkv`), then a short causal convolution
  over each of their channels mixes each token's with the few before it (`conv`, then SiLU);
- queries and keys are L2-normalized (so writing v under k replaces what k held, in full
  when the write strength is 1);
- the write strength beta = sigmoid(x W_b) (`write`), and the fade: the log of what every
  earlier memory keeps, -exp(A_log) * softplus(x W_a + dt_bias) (`fade`, `fade_bias`,
  `fade_log_rate`), one per head (Gated DeltaNet) or one per key channel (KDA, through a
  low-rank step);
- each head's read of the memory is RMS-normalized, multiplied by a gate made from x (SiLU in
  Qwen, a sigmoid in Kimi) and the heads are concatenated and projected (`out`).

Several value heads may read through one query/key head (Qwen3.5: linear_num_value_heads a
multiple of linear_num_key_heads): the layer repeats each key head's queries and keys for its
value heads, and its record keeps them so, one q and k per value head.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from qkv.attention.linear import FORMS, Memory, delta_rule
from qkv.nn.edit import Edit
from qkv.nn.linear import project
from qkv.nn.position import Rotation
from qkv.nn.record import AttentionRecord


@dataclass(frozen=True)
class DeltaConfig:
    """The sizes of one linear attention layer.

    heads: value heads (H, each with its own memory); key_heads: query/key heads (dividing H);
    key_size (Dk), value_size (Dv); conv: the causal convolution's width (tokens it reads,
    itself included); fade: "head" (one factor per head and token: Gated DeltaNet) or
    "channel" (one per key channel: KDA); fade_rank: the low-rank step of a per-channel fade
    (KDA: the head size), None for one matrix; gate: the output gate's function; gate_rank:
    its low-rank step (KDA), None for one matrix; norm_eps: of each head's RMS norm; l2_eps:
    of the queries' and keys' L2 norm, x / sqrt(sum(x^2) + l2_eps).
    form: the rule's form for more than a few tokens ("chunked" or, slower, "recurrent" or
    "loop"; qkv.attention.linear).
    """

    width: int
    heads: int
    key_heads: int
    key_size: int
    value_size: int
    conv: int = 4
    fade: Literal["head", "channel"] = "head"
    fade_rank: int | None = None
    gate: Literal["silu", "sigmoid"] = "silu"
    gate_rank: int | None = None
    norm_eps: float = 1e-6
    l2_eps: float = 1e-6
    form: Literal["auto", "loop", "recurrent", "chunked"] = "auto"

    def __post_init__(self):
        for name in ("width", "heads", "key_heads", "key_size", "value_size", "conv"):
            if type(getattr(self, name)) is not int or getattr(self, name) < 1:
                raise ValueError(f"linear attention's {name} must be a whole number >= 1")
        if self.heads % self.key_heads:
            raise ValueError(f"linear attention's {self.heads} value heads are not a multiple of "
                             f"its {self.key_heads} key heads")  # fmt: skip
        if self.fade not in ("head", "channel"):
            raise ValueError(f"fade is per 'head' or per 'channel', not {self.fade!r}")
        if self.gate not in ("silu", "sigmoid"):
            raise ValueError(f"the output gate is 'silu' or 'sigmoid', not {self.gate!r}")
        if self.form not in ("auto", *FORMS):
            raise ValueError(f"form is 'auto' or one of {', '.join(FORMS)}, not {self.form!r}")

    @property
    def key_width(self) -> int:
        return self.key_heads * self.key_size

    @property
    def value_width(self) -> int:
        return self.heads * self.value_size

    @property
    def conv_width(self) -> int:
        """Channels of the convolution: every query's, key's and value's."""
        return 2 * self.key_width + self.value_width

    @property
    def state_bytes(self) -> int:
        """Numbers a cache keeps for one sequence, whatever its length: every head's memory
        (Dk x Dv) and the convolution's last conv - 1 inputs."""
        return self.heads * self.key_size * self.value_size + self.conv_width * (self.conv - 1)


class MemoryCache:
    """What a linear layer keeps while decoding: not every token's key and value, but each
    head's memory (B, H, Dk, Dv) and the last conv - 1 tokens' inputs to the convolution. Its
    size does not grow with the text."""

    def __init__(self) -> None:
        self.state: Tensor | None = None  # (B, H, Dk, Dv), the compute dtype
        self.conv: Tensor | None = None  # (B, conv_width, conv - 1)
        self.length = 0

    def numel(self) -> int:
        return sum(t.numel() for t in (self.state, self.conv) if t is not None)


def _linear(width: int, out: int, rank: int | None) -> nn.Module:
    if rank is None:
        return nn.Linear(width, out, bias=False)
    return nn.Sequential(nn.Linear(width, rank, bias=False), nn.Linear(rank, out, bias=False))


class GatedDeltaNet(nn.Module):
    """Linear attention over x (B, T, C) -> (B, T, C), causal, with an `AttentionRecord` whose
    `weights()` are the effective weights (see `qkv.attention.linear`).

    >>> layer = GatedDeltaNet(DeltaConfig(width=16, heads=4, key_heads=2, key_size=4,
    ...                                   value_size=4))
    >>> out, record = layer(torch.randn(1, 5, 16), record=True)
    >>> out.shape, record.weights().shape
    (torch.Size([1, 5, 16]), torch.Size([1, 4, 5, 5]))
    """

    def __init__(self, config: DeltaConfig, backend: str = "auto"):
        super().__init__()
        c = config
        self.config = c
        self.backend = backend  # softmax backends do not run this layer; kept for the record
        self.qkv = nn.Linear(c.width, c.conv_width, bias=False)
        self.conv = nn.Parameter(torch.empty(c.conv_width, 1, c.conv))
        self.write = nn.Linear(c.width, c.heads, bias=False)
        fades = c.heads * (c.key_size if c.fade == "channel" else 1)
        self.fade = _linear(c.width, fades, c.fade_rank)
        self.fade_bias = nn.Parameter(torch.ones(fades))
        self.fade_log_rate = nn.Parameter(torch.zeros(c.heads))
        self.gate = _linear(c.width, c.value_width, c.gate_rank)
        self.norm_weight = nn.Parameter(torch.ones(c.value_size))
        self.out = nn.Linear(c.value_width, c.width, bias=False)
        nn.init.normal_(self.conv, std=c.conv**-0.5)

    def forward(
        self,
        x: Tensor,
        *,
        key_padding_mask: Tensor | None = None,
        cache: MemoryCache | None = None,
        edit: Edit | None = None,
        record: bool = False,
        causal: bool = True,
        mask: Tensor | None = None,
        positions: Tensor | None = None,
        rotation: Rotation | None = None,
        bias: Tensor | None = None,
        weights_into: Tensor | None = None,
    ) -> tuple[Tensor, AttentionRecord | None]:
        """Contextualize x; return (out (B, T, C), this call's AttentionRecord or None).

        key_padding_mask (B, Tk): True for real tokens; a padding token is zeroed before the
          layer reads it, so it writes nothing and a left-padded row is the row alone.
        cache: a `MemoryCache`: the memory and the convolution continue from it.
        edit: hidden pairs are not written into the memory the query reads (exact);
          head outputs replaced before the gated norm.
        A softmax layer's other arguments (mask, positions, rotation, bias, weights_into)
        change nothing here: no positions enter, and the record's weights are computed.
        """
        if not causal or mask is not None or bias is not None:
            raise ValueError("linear attention is causal, with no mask or score bias of its own")
        c = self.config
        B, T, _ = x.shape
        if key_padding_mask is not None:
            x = x * key_padding_mask[:, -T:, None].to(x.dtype)
        mixed = self._convolved(project(self.qkv, x), cache)  # (B, T, conv_width)
        q, k, v = mixed.split([c.key_width, c.key_width, c.value_width], dim=-1)
        group = c.heads // c.key_heads
        q, k = (_heads(t, c.key_size, c.l2_eps).repeat_interleave(group, 1) for t in (q, k))
        v = v.view(B, T, c.heads, c.value_size).transpose(1, 2)  # (B, H, T, Dv)
        beta = torch.sigmoid(project(self.write, x).float()).transpose(1, 2)  # (B, H, T)
        decay = self._decay(x)  # (B, H, T) or (B, H, T, Dk), float32
        if edit is not None:
            edit.refuse_per_head("a linear-attention layer (Gated DeltaNet)")
        allowed = None if edit is None else edit.mask(None)
        state = None if cache is None else cache.state
        remembered = delta_rule(q, k, v, beta=beta, decay=decay, state=state, mask=allowed,
                                form=c.form)  # fmt: skip
        out = remembered.out  # (B, H, T, Dv)
        kept = None
        if record:
            memory = Memory(beta, decay, None if state is None else state.clone())
            kept = AttentionRecord(q, k, v, out, allowed, True, c.key_size**-0.5, "linear",
                                   linear=memory)  # fmt: skip
        if cache is not None:
            cache.state = remembered.state
            cache.length += T
        if edit is not None:
            out = edit.head_outputs(out)
        return project(self.out, self.gated_read(out, x).reshape(B, T, c.value_width)), kept

    def _convolved(self, mixed: Tensor, cache: MemoryCache | None) -> Tensor:
        """Each channel's causal convolution over its last `conv` tokens, then SiLU; a cache's
        inputs from earlier tokens come first, and it keeps this call's last ones."""
        c, T = self.config, mixed.shape[1]
        mixed = mixed.transpose(1, 2)  # (B, conv_width, T)
        if cache is not None and cache.conv is not None:
            earlier = cache.conv.to(mixed.dtype)
        else:
            earlier = mixed.new_zeros(mixed.shape[0], mixed.shape[1], c.conv - 1)
        seen = torch.cat([earlier, mixed], dim=-1)  # (B, conv_width, conv - 1 + T)
        if cache is not None:
            cache.conv = seen[:, :, seen.shape[-1] - (c.conv - 1) :].clone()
        out = F.conv1d(seen, self.conv.to(mixed.dtype), groups=c.conv_width)[:, :, -T:]
        return F.silu(out).transpose(1, 2)

    def _decay(self, x: Tensor) -> Tensor:
        """The log of each token's fade, -exp(A_log) * softplus(x W_a + dt_bias), float32:
        (B, H, T) per head, (B, H, T, Dk) per key channel."""
        c, (B, T, _) = self.config, x.shape
        rate = self.fade_log_rate.float().exp()  # (H,)
        raw = project(self.fade, x).float() + self.fade_bias.float()  # (B, T, H[*Dk])
        if c.fade == "head":
            return (-rate * F.softplus(raw)).transpose(1, 2)
        raw = raw.view(B, T, c.heads, c.key_size)
        return (-rate[:, None] * F.softplus(raw)).permute(0, 2, 1, 3)

    def gated_read(self, out: Tensor, x: Tensor) -> Tensor:
        """Each head's read RMS-normalized (float32), times its weight and the gate of x:
        (B, H, T, Dv) -> (B, T, H, Dv)."""
        c, (B, T, _) = self.config, x.shape
        read = out.transpose(1, 2).float()  # (B, T, H, Dv)
        normed = read * torch.rsqrt(read.pow(2).mean(-1, keepdim=True) + c.norm_eps)
        gate = project(self.gate, x).view(B, T, c.heads, c.value_size).float()
        gate = F.silu(gate) if c.gate == "silu" else torch.sigmoid(gate)
        return (self.norm_weight.float() * normed * gate).to(x.dtype)


def _heads(t: Tensor, size: int, eps: float) -> Tensor:
    """(B, T, heads * size) -> (B, heads, T, size), each vector L2-normalized, in float32 (as
    the rule computes)."""
    B, T, _ = t.shape
    t = t.view(B, T, -1, size).transpose(1, 2).float()
    return t * torch.rsqrt(t.pow(2).sum(-1, keepdim=True) + eps)

"""One decoding step with few operations: the fed-back token of every sequence through a
plain decoder, its keys and values written into a cache allocated once.

Decoding reads every weight once per token, and on a CPU each operation torch runs costs
microseconds of its own besides: SmolLM2's 30 blocks through `Decoder.forward` are about
1,100 operations a token, and half its time went to them, not to the weights. `FastStep`
runs the same block modules' weights and arithmetic (norms, projections, MLPs, rotary
tables) but none of what a step of generation never needs: records, edits, resumes, hidden
states, the checks of `attend`, a cache that grows by doubling. The attention of one query
over its cached keys is torch's fused function, the `sdpa` backend that `auto` picks for it
on the CPU. Float32 matrices are read from a copy in oneDNN's blocked layout, made for the
generation (`_packed`), a block's q, k, v and its gate and up stacked into one product each:
the same products, summed in another order. An int4 model's 8-bit LM head rounds its
inputs to 8 bits too, where the CPU multiplies bytes fast (`head_of`). `fast_step_refusal`
names what it does not handle, and `decode_steps` then takes `Decoder.forward`, the trusted
path that the tests hold it to (tests/generate/test_fast_step.py).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from qkv.models.decoder import Decoder, DecoderCache
from qkv.nn.attention import MultiHeadAttention
from qkv.nn.mlps import MLP, GatedMLP
from qkv.nn.norms import RMSNorm
from qkv.nn.position import Rotation
from qkv.nn.quant_linear import QuantLinear
from qkv.nn.quantized import GROUP, Int4Linear, Int8Linear, choose_int8_inputs


def fast_step_refusal(model: Decoder, device: torch.device) -> str | None:
    """Why FastStep cannot run this model's steps exactly as Decoder.forward does, or None."""
    if device.type != "cpu":
        return "FastStep runs on the CPU (a GPU's own kernels choose the attention there)"
    if type(model) is not Decoder:
        return f"the model is a {type(model).__name__}, whose forward is its own"
    if model.config.cross_attention:
        return "the decoder has cross-attention"
    if model.relative is not None:
        return "the decoder adds relative position biases (T5)"
    if model.training:
        return "the model is in training mode (dropout)"
    for i, block in enumerate(model.blocks):
        attn = block.attn
        if block.position == "post":
            return f"block {i} normalizes after its residual sums (post-norm)"
        if not isinstance(attn, MultiHeadAttention):
            return f"block {i} attends through {type(attn).__name__}, not MultiHeadAttention"
        if attn.softcap is not None:
            return f"block {i} soft-caps its scores (torch's fused attention cannot)"
        late = {"learned sinks": attn.sinks is not None, "chunks": attn.chunk is not None,
                "a temperature per query": attn.temperature is not None,
                "an L2 QK-norm after rotary": attn.qk_norm == "l2",
                "an output gate": attn.gate is not None}  # fmt: skip
        for name, used in late.items():
            if used:
                return f"block {i} has {name}, which its plain step does not compute"
        if not isinstance(block.mlp, MLP | GatedMLP):
            return f"block {i}'s MLP is a {type(block.mlp).__name__} (experts), not a plain one"
        if attn.backend not in ("auto", "sdpa"):
            return f"block {i} attends with the {attn.backend!r} backend, as asked"
    return None


class FastStep:
    """The cache of a prompt already read (DecoderCache), then one token per call.

    capacity: the most tokens the cache will hold (the prompt's and every new one's), so
    that no step copies what is cached. attention_mask (B, P): the prompt's, 1 for real
    tokens (None when nothing is padded). Each call takes the next token of every row (B,)
    and their positions (B, 1) (None: the cache's length) and returns the final norm's
    output (B, C), which the caller turns into logits.

    Everything a step reads of a module (its weights, its sizes, which norm) is looked up
    once, here: a module's attribute costs a dictionary search on every read.
    """

    def __init__(self, model: Decoder, cache: DecoderCache, capacity: int,
                 attention_mask: Tensor | None = None):  # fmt: skip
        self.model = model
        self.length = cache.length
        if capacity < self.length:
            raise ValueError(f"capacity {capacity} is less than the {self.length} cached tokens")
        self.keys, self.values = [], []
        for layer in cache.layers:
            k, v = layer.stored()  # (B, Hkv, P, D)
            keys = k.new_empty(*k.shape[:2], capacity, k.shape[3])
            values = v.new_empty(*v.shape[:2], capacity, v.shape[3])
            keys[:, :, : self.length] = k
            values[:, :, : self.length] = v
            self.keys.append(keys)
            self.values.append(values)
        self.mask = None  # (B, 1, 1, capacity): True for real tokens
        if attention_mask is not None:
            B = attention_mask.shape[0]
            self.mask = torch.ones(B, 1, 1, capacity, dtype=torch.bool, device=k.device)
            self.mask[:, 0, 0, : self.length] = attention_mask.to(torch.bool)
        self.layers = [_Layer(block, model.rotary.for_layer(i)) for i, block in
                       enumerate(model.blocks)]  # fmt: skip
        self.norm = None if model.norm is None else _norm_of(model.norm)

    @torch.inference_mode()
    def __call__(self, token: Tensor, positions: Tensor | None = None) -> Tensor:
        model, at = self.model, self.length
        if at >= self.keys[0].shape[2]:
            raise ValueError(f"the cache holds {at} tokens, its capacity")
        if positions is None:
            positions = torch.full((1,), at, dtype=torch.long, device=token.device)
        x = model.embed(token[:, None], positions)[:, 0]  # (B, C)
        turns = {}  # each rotary embedding's turn of these positions, made once a step
        for rotary in {id(r): r for r in (model.rotary.full, model.rotary.local) if r}.values():
            cos, sin = rotary.cos_sin(positions, x.dtype)  # (1, d) or (B, 1, d)
            if cos.dim() == 3:  # (B, 1, 1, d), for queries and keys (B, H, 1, D)
                cos, sin = cos[:, None], sin[:, None]
            half = sin.shape[-1] // 2
            # rotate_half(x) * sin is roll(x) * [-sin | sin]: the same products, one operation
            signed = torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)
            whole = rotary.dims == rotary.head_dim  # roll turns whole heads only
            turns[id(rotary)] = _Turn(Rotation(cos, sin), signed if whole else None)
        where = torch.tensor([at], device=token.device)
        self.length = length = at + 1
        for i, layer in enumerate(self.layers):
            h = x if layer.attn_norm is None else layer.attn_norm(x)
            turn = None if layer.rotary is None else turns[id(layer.rotary)]
            out = self._attend(layer, h, i, where, length, turn)
            if layer.attn_out_norm is not None:
                out = layer.attn_out_norm(_widened(out, x.dtype))
            if layer.parallel:  # x + attention(norm(x)) + mlp(norm'(x)), as _Block does
                x = x + out + layer.mlp(layer.mlp_norm(x))
                continue
            x = x + out  # a bfloat16 `out` (an int4 product) is widened by the sum, exactly
            out = layer.mlp(x if layer.mlp_norm is None else layer.mlp_norm(x))
            if layer.mlp_out_norm is not None:
                out = layer.mlp_out_norm(_widened(out, x.dtype))
            x = x + out
        return x if self.norm is None else self.norm(x)

    def _attend(self, layer: _Layer, h: Tensor, i: int, where: Tensor, length: int, turn):
        """Attention's output (B, C) for h (B, C), its key and value cached at `where`; an
        int4 output projection's in bfloat16."""
        B = h.shape[0]
        H, Hkv, D = layer.heads, layer.kv_heads, layer.head_dim
        if layer.joint and turn is not None and turn.signed is not None:
            # q and k side by side in one projection's output: turned by one call
            qkv = layer.qkv(h)  # (B, (H + 2 Hkv) D)
            qk = qkv[:, : (H + Hkv) * D].view(B, H + Hkv, 1, D)
            qk = qk * turn.rotation.cos + qk.roll(D // 2, -1) * turn.signed  # (B, H + Hkv, 1, D)
            q, k, v = qk[:, :H], qk[:, H:], qkv[:, (H + Hkv) * D :]
        else:
            if layer.qkv is not None:
                q, k, v = layer.qkv(h).split(layer.sizes, dim=-1)
            else:
                q, k, v = (f(h) for f in layer.q_k_v)
            q, k = layer.attn._normed(q[:, None], k[:, None])  # (B, H, 1, D), (B, Hkv, 1, D)
            if turn is not None:
                q, k = turn.rotation.apply(q), turn.rotation.apply(k)
        keys, values = self.keys[i], self.values[i]
        keys.index_copy_(2, where, k)
        values.index_copy_(2, where, v.view(B, Hkv, 1, D))
        start = 0 if layer.window is None else max(0, length - layer.window)
        mask = None if self.mask is None else self.mask[..., start:length]
        out = F.scaled_dot_product_attention(
            q, keys[:, :, start:length], values[:, :, start:length], attn_mask=mask,
            scale=layer.scale, enable_gqa=layer.gqa,
        )  # fmt: skip
        return layer.out(out.view(B, H * D))


class _Turn(NamedTuple):
    """A rotary embedding's turn of one step's positions: its Rotation, and [-sin | sin]
    where it turns whole heads (None where it turns part of each)."""

    rotation: Rotation
    signed: Tensor | None


class _Layer:
    """What a step reads of one block, looked up once."""

    def __init__(self, block, rotary):
        attn = self.attn = block.attn
        self.heads, self.kv_heads, self.head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        self.scale, self.window, self.qk_norm = attn.scale, attn.window, attn.qk_norm
        self.rotary = rotary
        # one product for q, k and v: a fused matrix, or three float32 ones stacked
        fused = hasattr(attn, "qkv")
        self.qkv = _matmul(attn.qkv, widen=True) if fused else _stacked(attn.q, attn.k, attn.v)
        self.q_k_v = None if self.qkv else tuple(_matmul(m, widen=True) for m in
                                                 (attn.q, attn.k, attn.v))  # fmt: skip
        self.sizes, self.gqa = attn.sizes, self.heads != self.kv_heads
        self.joint = self.qkv is not None and self.qk_norm is None  # q, k turned as one
        self.out = _matmul(attn.out)
        self.parallel = block.parallel
        self.attn_norm, self.mlp_norm = _norm_of(block.attn_norm), _norm_of(block.mlp_norm)
        self.attn_out_norm = _norm_of(block.attn_out_norm)
        self.mlp_out_norm = _norm_of(block.mlp_out_norm)
        self.mlp = _mlp(block.mlp)


def _matmul(linear, widen: bool = False):
    """x (B, K) -> x @ W.T (+ bias): a Linear as one call (a float32 one on its weights in
    oneDNN's blocked layout, `_packed`), an Int4Linear as torch's kernel, its bfloat16 output
    widened to x's dtype where `widen` asks or it has a bias (a residual sum widens it,
    exactly, by itself); anything else as its module."""
    if type(linear) is torch.nn.Linear:
        weight, bias = linear.weight, linear.bias
        return _stacked(linear) or (lambda x: F.linear(x, weight, bias))
    if type(linear) is QuantLinear:  # the file's own blocks: qkv's native kernel, one call
        return linear.product()
    if type(linear) is Int4Linear:
        packed, scales, bias = linear.packed, linear.scales_and_zeros, linear.bias
        kernel = torch.ops.aten._weight_int4pack_mm_for_cpu
        if bias is not None:
            return lambda x: _widened(kernel(x.bfloat16(), packed, GROUP, scales), x.dtype) + bias
        if widen:
            return lambda x: _widened(kernel(x.bfloat16(), packed, GROUP, scales), x.dtype)
        return lambda x: kernel(x.bfloat16(), packed, GROUP, scales)
    return linear


def _packed(*weights: Tensor) -> Tensor | None:
    """float32 CPU matrices of one width, their rows stacked and copied into oneDNN's blocked
    layout for products with a few rows: read at 30-35 GB/s where F.linear read a matrix at
    15-20 (one token's matrix-vector products, on 2 cores of an AVX-512 EPYC), products
    summed in another order (float32 rounding apart). Made for each generation, never kept
    past it: a copy kept would not see a later write through `.data`, which no counter
    records (0.2 s for SmolLM2's 538 MB, saved back within its first 15 tokens). None where
    oneDNN is missing or a matrix is not float32 on the CPU."""
    if not torch.backends.mkldnn.is_available() or len({w.shape[1:] for w in weights}) != 1:
        return None
    if any(w.dtype != torch.float32 or w.device.type != "cpu" or w.dim() != 2 for w in weights):
        return None
    rows = [w.detach() for w in weights]
    return torch.ops.mkldnn._reorder_linear_weight(rows[0] if len(rows) == 1 else
                                                   torch.cat(rows), 1)  # fmt: skip


def _stacked(*linears):
    """Float32 Linears that read one x as one product on their packed, stacked rows: x (B, K)
    -> (B, their outputs side by side); None unless every one is such a Linear."""
    if not all(type(linear) is torch.nn.Linear for linear in linears):
        return None
    packed = _packed(*(linear.weight for linear in linears))
    if packed is None:
        return None
    bias = None
    if any(linear.bias is not None for linear in linears):
        bias = torch.cat([linear.weight.new_zeros(linear.out_features) if linear.bias is None
                          else linear.bias.detach() for linear in linears])  # fmt: skip
    kernel = torch.ops.mkldnn._linear_pointwise
    return lambda x: kernel(x, packed, bias, "none", [], "")


def head_of(model: Decoder, threads: int | None = None):
    """The LM head as FastStep runs it: hidden (B, C) -> logits (B, vocab) before any
    scale or cap: a float32 Linear without a bias on its packed matrix, an 8-bit one
    (an int4 model's) with its inputs in 8 bits too where `choose_int8_inputs` says so, a
    file's own blocks through the native kernel (on `threads`, 1 by default); None where
    the head runs as its module."""
    head = model.lm_head
    if type(head) is QuantLinear:
        return head.product(threads=threads)
    if type(head) is Int8Linear:
        return head.with_int8_inputs if choose_int8_inputs()[0] == "int8" else None
    if type(head) is not torch.nn.Linear or head.bias is not None:
        return None
    return _stacked(head)


def _widened(y: Tensor, dtype: torch.dtype) -> Tensor:
    """y in dtype; .float() costs a microsecond less than .to(torch.float32)."""
    return y.float() if dtype is torch.float32 else y.to(dtype)


def _mlp(mlp):
    """The MLP as calls of _matmul: the module's own arithmetic, in its order."""
    act = mlp.activation
    if type(mlp) is GatedMLP:
        down = _matmul(mlp.down)
        if hasattr(mlp, "gate_up"):
            gate_up = _matmul(mlp.gate_up, widen=True)

            def gated(x):
                gate, up = gate_up(x).chunk(2, dim=-1)
                return down(act(gate) * up)

            return gated
        both = _stacked(mlp.gate, mlp.up)  # float32 gate and up: one product
        if both is not None:

            def stacked(x):
                gate, up = both(x).chunk(2, dim=-1)
                return down(act(gate) * up)

            return stacked
        gate, up = _matmul(mlp.gate, widen=True), _matmul(mlp.up, widen=True)
        return lambda x: down(act(gate(x)) * up(x))
    if type(mlp) is MLP:
        fc_in, fc_out = _matmul(mlp.fc_in, widen=True), _matmul(mlp.fc_out)
        return lambda x: fc_out(act(fc_in(x)))
    return mlp


def _norm_of(norm):
    """norm as one call; an RMSNorm of float32 vectors as `torch.rms_norm`, which gives the
    module's numbers bit for bit (tests/generate/test_fast_step.py) in one call from Python
    where the module makes eight."""
    if norm is None:
        return None
    if type(norm) is RMSNorm and not norm.plus_one:
        weight, shape, eps = norm.weight, norm.weight.shape, norm.eps

        def rms(x):
            if x.dtype == torch.float32:
                return torch.rms_norm(x, shape, weight, eps)
            return norm(x)

        return rms
    return norm

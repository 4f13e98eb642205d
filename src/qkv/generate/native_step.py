"""One decoding step in one native call: a plain Llama-like decoder whose matrices are a GGUF
file's own blocks (QuantLinear), every block of it computed by qkv/generate/step.c.

FastStep (fast_step.py) runs a step as about 400 calls from Python: each product in C, and
torch's operations between them, whose threads and the kernels' own then contend for the same
cores. `NativeStep` makes one call a token: the norms, the products, rotary, the float16
cache's append, the split-K attention over the cache and the gated MLP, with the kernels'
thread pool as the only threads. Its arithmetic is FastStep's (the same products, bit for
bit); its cache holds keys and values in float16, as llama.cpp's does, where FastStep's holds
float32 (tests/generate/test_native_step.py holds the two together).

`native_step_refusal` names what it does not compute (a batch, padding, a QK-norm, a
fused projection, a float matrix...), and `decode_steps` then takes FastStep. Every size the
C code reads is checked here, before the first call.
"""

from __future__ import annotations

import ctypes
import functools

import torch
from torch import Tensor

from qkv import native
from qkv.models.decoder import Decoder, DecoderCache
from qkv.nn import quant_k
from qkv.nn.embeddings import Embeddings
from qkv.nn.mlps import ACTIVATIONS, GatedMLP
from qkv.nn.norms import RMSNorm
from qkv.nn.quant_linear import K_FORMATS, ROWS, QuantLinear, kernels, panel_block_bytes, variant

FMT_K = 16  # qkv_native.h's QKV_FMT_K: a qkv_qmat's format past it is quant_k.c's


class _Matrix(ctypes.Structure):  # qkv_qmat
    _fields_ = [("fmt", ctypes.c_int), ("parts", ctypes.c_int), ("N", ctypes.c_int64),
                ("K", ctypes.c_int64), ("panels", ctypes.c_void_p), ("scales", ctypes.c_void_p),
                ("mins", ctypes.c_void_p), ("bias", ctypes.c_void_p)]  # fmt: skip


class _Layer(ctypes.Structure):  # qkv_step_layer
    _fields_ = [("attn_norm", ctypes.c_void_p), ("mlp_norm", ctypes.c_void_p),
                *((name, _Matrix) for name in ("q", "k", "v", "o", "gate", "up", "down")),
                ("keys", ctypes.c_void_p), ("values", ctypes.c_void_p),
                ("window", ctypes.c_int64), ("scale", ctypes.c_float)]  # fmt: skip


class _Model(ctypes.Structure):  # qkv_step_model
    _fields_ = [("variant", ctypes.c_int), ("attn_variant", ctypes.c_int), ("nth", ctypes.c_int),
                *((name, ctypes.c_int64) for name in ("L", "C", "H", "Hkv", "D", "F", "cap")),
                ("eps", ctypes.c_float), ("final_eps", ctypes.c_float),
                ("layers", ctypes.POINTER(_Layer)), ("final_norm", ctypes.c_void_p),
                ("cos", ctypes.c_void_p), ("sin", ctypes.c_void_p)]  # fmt: skip


@functools.cache
def _typed(lib):
    i64 = ctypes.c_int64
    p = ctypes.c_void_p
    native.declare(lib, "qkv_step", ctypes.c_int, ctypes.POINTER(_Model), p, i64, i64, p)
    native.declare(lib, "qkv_step_work_floats", i64, i64, i64, i64, i64, i64, i64)
    return lib


def _plain_rms(norm, width: int) -> str | None:
    if type(norm) is not RMSNorm or norm.plus_one:
        return f"a {type(norm).__name__}{' (1 + weight)' if norm is not None else ''}, not RMSNorm"
    if norm.weight.shape != (width,) or norm.weight.dtype != torch.float32:
        return f"an RMSNorm of {tuple(norm.weight.shape)} {norm.weight.dtype}"
    return None


def _projections(module) -> tuple:
    """q, k, v of an attention or gate, up of a gated MLP: the fused Linear once, or the
    separate ones."""
    fused = getattr(module, "qkv", None) or getattr(module, "gate_up", None)
    if fused is not None:
        return (fused,)
    return (module.q, module.k, module.v) if hasattr(module, "q") else (module.gate, module.up)


def _first_eps(model: Decoder) -> float:
    return model.blocks[0].attn_norm.eps


def native_step_refusal(model: Decoder, batch: int, padded: bool) -> str | None:
    """Why NativeStep does not run this model's steps, or None. The caller has found FastStep
    able to (`fast_step_refusal`): a plain decoder on the CPU, in eval mode."""
    if kernels() is None:
        return f"no native kernels: {native.why_not()}"
    if batch != 1 or padded:
        return "it decodes one sequence without padding"
    C = model.config.block.width
    rotary = model.rotary.full
    if rotary is None or model.rotary.local is not None:
        return "its layers turn keys by one rotary embedding"
    if rotary.dims != rotary.head_dim or rotary.head_dim % 2:
        return "its rotary embedding turns part of each head"
    if rotary.scaling is not None and rotary.scaling.depends_on_length:
        return "its rotary frequencies depend on the text's length"
    first = model.blocks[0].attn
    for i, block in enumerate(model.blocks):
        attn, mlp = block.attn, block.mlp
        if block.parallel or block.attn_out_norm is not None or block.mlp_out_norm is not None:
            return f"block {i} is not a pre-norm block of one attention and one MLP"
        for name, norm in (("attention", block.attn_norm), ("MLP", block.mlp_norm)):
            wrong = _plain_rms(norm, C)
            if wrong:
                return f"block {i}'s {name} norm is {wrong}"
            if norm.eps != _first_eps(model):
                return f"block {i}'s norms differ in epsilon"
        if model.rotary.for_layer(i) is not rotary:
            return f"block {i} turns no keys (NoPE)"
        if attn.qk_norm is not None:
            return f"block {i} normalizes q and k"
        if (attn.num_heads, attn.num_kv_heads, attn.head_dim) != (
            first.num_heads,
            first.num_kv_heads,
            first.head_dim,
        ):
            return f"block {i}'s heads differ from block 0's"
        if type(mlp) is not GatedMLP or mlp.activation is not ACTIVATIONS["silu"]:
            return f"block {i}'s MLP is not one gated by SiLU (SwiGLU)"
        for linear in (*_projections(attn), attn.out, *_projections(mlp), mlp.down):
            if type(linear) is not QuantLinear:
                return f"block {i} multiplies a {type(linear).__name__}, not a file's blocks"
        for what, together in (
            ("q, k and v", _projections(attn)),
            ("gate and up", _projections(mlp)),
        ):
            if len({linear.parts for linear in together}) > 1:  # step.c rounds x once for all
                return f"block {i}'s {what} round their inputs in different parts"
        if mlp.down.in_features != model.blocks[0].mlp.down.in_features:
            return f"block {i}'s MLP is wider or narrower than block 0's"
        if any(n % ROWS for n in (attn.head_dim * attn.num_kv_heads, mlp.down.in_features)):
            return f"block {i}'s fused projections do not split at a panel's 16 rows"
    if model.norm is not None and _plain_rms(model.norm, C):
        return f"the final norm is {_plain_rms(model.norm, C)}"
    return None


def _plain_table(embed) -> Tensor | None:
    """The float32 token table where `embed` (an Embeddings) is its rows and nothing more: no
    positions, segments, norm, scale or dropout added; else None (the module computes)."""
    plain = (
        isinstance(embed, Embeddings)
        and embed.positions is None
        and embed.types is None
        and embed.norm is None
        and embed.scale == 1.0
        and not embed.round_scale
        and (embed.dropout.p == 0 or not embed.training)
        and embed.tokens.weight.dtype == torch.float32
    )
    return embed.tokens.weight.detach() if plain else None


class NativeStep:
    """The cache of a prompt already read (DecoderCache), or none, then one token per call: as
    FastStep, for one sequence. capacity: the most tokens the cache will hold. Each call
    takes the next token (1,) and returns the final norm's output (1, C); `read` takes a
    prompt, or a prompt's next tokens, in one call."""

    def __init__(self, model: Decoder, cache: DecoderCache | None, capacity: int):
        why = native_step_refusal(model, 1, False)
        if why:
            raise ValueError(f"NativeStep cannot run this model: {why}")
        self.model, self.length = model, 0 if cache is None else cache.length
        if capacity < self.length:
            raise ValueError(f"capacity {capacity} is less than the {self.length} cached tokens")
        lib = _typed(kernels())
        attn0 = model.blocks[0].attn
        H, Hkv, D = attn0.num_heads, attn0.num_kv_heads, attn0.head_dim
        C, F, L = model.config.block.width, model.blocks[0].mlp.down.in_features, len(model.blocks)
        self._keep = []  # every tensor whose memory the C side reads
        self.keys, self.values = [], []  # each layer's (Hkv, capacity, D) float16 cache
        layers = (_Layer * L)()
        for i, block in enumerate(model.blocks):
            attn, mlp = block.attn, block.mlp
            keys = torch.zeros(Hkv, capacity, D, dtype=torch.float16)
            values = torch.zeros(Hkv, capacity, D, dtype=torch.float16)
            if cache is not None:
                k, v = cache.layers[i].stored()  # (1, Hkv, P, D)
                keys[:, : self.length] = k[0]
                values[:, : self.length] = v[0]
            norms = (block.attn_norm.weight.detach(), block.mlp_norm.weight.detach())
            self.keys.append(keys)
            self.values.append(values)
            self._keep += [*norms]
            q_k_v = self._split(_projections(attn), (H * D, Hkv * D, Hkv * D))
            gate_up = self._split(_projections(mlp), (F, F))
            layers[i] = _Layer(
                norms[0].data_ptr(), norms[1].data_ptr(), *q_k_v, self._matrix(attn.out),
                *gate_up, self._matrix(mlp.down), keys.data_ptr(), values.data_ptr(),
                attn.window or 0, attn.scale,
            )  # fmt: skip
        with torch.inference_mode():
            turns = model.rotary.full.cos_sin(torch.arange(capacity), torch.float32)
            cos, sin = (t.contiguous() for t in turns)  # (capacity, D) each
        final = None if model.norm is None else model.norm.weight.detach()
        self._keep += [cos, sin, final, layers]
        self._sizes = (C, H, Hkv, D, F)
        self._work = self._memory(1)
        self._x = torch.empty(1, C)
        chosen = variant()
        attn_chosen = chosen if lib.qkv_decode_variants() >> chosen & 1 else 0
        self._model = _Model(
            chosen, attn_chosen, native.threads(), L, C, H, Hkv, D, F, capacity,
            _first_eps(model), model.norm.eps if model.norm is not None else 0.0,
            layers, None if final is None else final.data_ptr(), cos.data_ptr(), sin.data_ptr(),
        )  # fmt: skip
        self._step, self._capacity = lib.qkv_step, capacity
        self._table = _plain_table(model.embed)

    def _memory(self, rows: int) -> tuple[Tensor, int]:
        """The C side's working memory for `rows` tokens, and its address aligned to 64."""
        work = torch.empty(_typed(kernels()).qkv_step_work_floats(*self._sizes, rows) + 16)
        return work, (work.data_ptr() + 63) // 64 * 64

    def _matrix(self, linear: QuantLinear, first: int = 0, rows: int | None = None) -> _Matrix:
        """Rows [first, first + rows) of linear (all by default; first a multiple of the
        panels' 16 rows) as the C side reads a matrix."""
        rows = linear.out_features - first if rows is None else rows
        if first % ROWS or not 0 < first + rows <= linear.out_features:
            raise ValueError(f"rows {first}..{first + rows} of {linear} are not whole panels")
        bias = None if linear.bias is None else linear.bias.detach()
        self._keep += [linear.panels, linear.scales, linear.mins, bias]
        if linear.fmt in K_FORMATS:  # quant_k.c's panels, their scales inside
            before = quant_k.panel_bytes(linear.fmt, first, linear.in_features) if first else 0
            return _Matrix(FMT_K + linear.code, linear.parts, rows, linear.in_features,
                           linear.panels.data_ptr() + before, None, None,
                           None if bias is None else bias.data_ptr() + first * 4)  # fmt: skip
        panel = first // ROWS * (linear.in_features // 32)  # panel blocks before the first row
        block_bytes = panel_block_bytes(linear.fmt)  # one panel block's integers
        return _Matrix(linear.code, linear.parts, rows, linear.in_features,
                       linear.panels.data_ptr() + panel * block_bytes,
                       linear.scales.data_ptr() + panel * ROWS * 4,
                       linear.mins.data_ptr() + panel * ROWS * 4,
                       None if bias is None else bias.data_ptr() + first * 4)  # fmt: skip

    def _split(self, linears: tuple, sizes: tuple) -> list:
        """Matrices of `sizes` rows: the separate Linears, or one fused Linear's rows."""
        if len(linears) == len(sizes):
            if tuple(m.out_features for m in linears) != sizes:
                raise ValueError(f"projections of {[m.out_features for m in linears]} rows, "
                                 f"not {list(sizes)}")  # fmt: skip
            return [self._matrix(m) for m in linears]
        (fused,) = linears
        if fused.out_features != sum(sizes):
            raise ValueError(f"a fused projection of {fused.out_features} rows, not {sum(sizes)}")
        starts = [sum(sizes[:j]) for j in range(len(sizes))]
        return [self._matrix(fused, a, n) for a, n in zip(starts, sizes, strict=True)]

    @torch.inference_mode()
    def __call__(self, token: Tensor, positions: Tensor | None = None) -> Tensor:
        if token.shape != (1,):
            raise ValueError(f"NativeStep takes one token, (1,), got {tuple(token.shape)}")
        if positions is not None and int(positions.reshape(-1)[0]) != self.length:
            raise ValueError("NativeStep's positions are the cache's length")
        x = self._x
        self._run(token[None], x, self._work[1], one=True)
        return x.clone()

    @torch.inference_mode()
    def read(self, input_ids: Tensor) -> Tensor:
        """The next tokens of the sequence, input_ids (1, T), in one call: each row's keys and
        values appended, each row attending to the cache up to itself (as T steps would, with
        each matrix read once for all T). Returns the last row's final norm output (1, C)."""
        if input_ids.dim() != 2 or input_ids.shape[0] != 1 or input_ids.shape[1] < 1:
            raise ValueError(f"NativeStep reads input_ids (1, T), got {tuple(input_ids.shape)}")
        x = torch.empty(input_ids.shape[1], self._sizes[0])
        work, address = self._memory(input_ids.shape[1])
        self._run(input_ids, x, address)
        del work  # held until the call is done
        return x[-1:].clone()

    def _run(self, input_ids: Tensor, x: Tensor, work: int, one: bool = False) -> None:
        """input_ids (1, T) through the C side into x (T, C), the cache's length moved on;
        one: a single token, whose vector is its row of a plain token table where the model's
        embedding is no more than that (the module's checks and calls took 32 us a token)."""
        at, rows = self.length, input_ids.shape[1]
        if at + rows > self._capacity:
            raise ValueError(f"{rows} more tokens overflow the cache: it holds {at} of its "
                             f"capacity {self._capacity}")  # fmt: skip
        table = self._table if one else None
        if table is not None:
            token = int(input_ids[0, 0])
            if not 0 <= token < len(table):
                raise ValueError(f"token ids must be in 0-{len(table) - 1}, got {token}")
            x[0].copy_(table[token])
        else:
            where = torch.arange(at, at + rows)[None]
            x.copy_(self.model.embed(input_ids, where)[0])
        failed = self._step(ctypes.byref(self._model), x.data_ptr(), rows, at, work)
        if failed:
            raise RuntimeError(f"the native step failed ({failed})")
        self.length = at + rows

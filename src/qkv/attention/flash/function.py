"""The autograd function around the kernels, and the two public functions.

`flash_attention` takes padded batches, q (B, H, Tq, D), as `attend` does, and any
boolean mask; `flash_attention_varlen` takes packed batches, q (total tokens, H, D), with
cumulative sequence lengths, so sequences of different lengths cost only their own tokens.
Both return the log-sum-exp of every query's scores beside the output.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise

import torch
import triton
from torch import Tensor

from qkv.attention.flash import kernels
from qkv.attention.flash.limits import unsupported
from qkv.attention.inputs import check_inputs

DELTA_BLOCK = 64  # queries per program of the (memory-bound) delta kernel


@dataclass(frozen=True)
class Launch:
    """Everything about one call that is not q, k, v: sizes, mask, layout."""

    B: int
    H: int
    Hkv: int
    Tq: int  # the longest query sequence (all of them, padded)
    Tk: int
    D: int
    causal: bool
    scale: float
    mask: Tensor | None  # uint8 (B, H, Tq, Tk), broadcast dimensions with stride 0
    cu_seqlens_q: Tensor | None  # int32 (B + 1,): packed (varlen) layout when given
    cu_seqlens_k: Tensor | None

    @property
    def varlen(self) -> bool:
        return self.cu_seqlens_q is not None

    def strides(self, t: Tensor) -> tuple[int, int, int, int]:
        """(batch, head, token, feature) strides: packed (N, H, D) has no batch stride."""
        if self.varlen:
            return (0, t.stride(1), t.stride(0), t.stride(2))
        return tuple(t.stride())

    def lse_strides(self, lse: Tensor) -> tuple[int, int, int]:
        """(batch, head, token) strides of lse: (B, H, Tq) padded, (H, N) packed."""
        if self.varlen:
            return (0, lse.stride(0), lse.stride(1))
        return tuple(lse.stride())

    def mask_args(self, dummy: Tensor) -> tuple:
        if self.mask is None:
            return (dummy, 0, 0, 0, 0)
        return (self.mask, *self.mask.stride())

    def cu_args(self, dummy: Tensor) -> tuple:
        return (self.cu_seqlens_q, self.cu_seqlens_k) if self.varlen else (dummy, dummy)

    def constants(self, q: Tensor) -> dict:
        return dict(
            HEAD_DIM=self.D,
            BLOCK_D=max(kernels.MIN_BLOCK, triton.next_power_of_2(self.D)),
            CAUSAL=self.causal,
            HAS_MASK=self.mask is not None,
            VARLEN=self.varlen,
            # float32 inputs get true float32 products, not TF32's 10-bit mantissa
            DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        )

    def buckets(self) -> tuple[int, int]:
        """Autotuning keys: sequence lengths rounded up to a power of two, so that decoding
        (a new Tk every step) does not retune at every step."""
        return triton.next_power_of_2(self.Tq), triton.next_power_of_2(self.Tk)


def _forward(q: Tensor, k: Tensor, v: Tensor, launch: Launch) -> tuple[Tensor, Tensor]:
    out = torch.empty_like(q)
    lse_shape = (launch.H, q.shape[0]) if launch.varlen else (launch.B, launch.H, launch.Tq)
    lse = torch.empty(lse_shape, dtype=torch.float32, device=q.device)

    def grid(meta):
        return (triton.cdiv(launch.Tq, meta["BLOCK_M"]), launch.B * launch.H)

    mask, *mask_strides = launch.mask_args(q)
    kernels.forward_kernel[grid](
        q, k, v, out, lse, mask, *launch.cu_args(q),
        *launch.strides(q), *launch.strides(k), *launch.strides(v), *launch.strides(out),
        *launch.lse_strides(lse), *mask_strides,
        launch.H, launch.H // launch.Hkv, launch.Tq, launch.Tk,
        launch.scale * kernels.LOG2_E, *launch.buckets(), **launch.constants(q),
    )  # fmt: skip
    return out, lse


def _backward(dout, q, k, v, out, lse, launch: Launch) -> tuple[Tensor, Tensor, Tensor]:
    constants = launch.constants(q)
    delta = torch.empty_like(lse)
    block = kernels.MIN_BLOCK if kernels.interpreting() else DELTA_BLOCK
    kernels.backward_delta_kernel[(triton.cdiv(launch.Tq, block), launch.B * launch.H)](
        out, dout, delta, *launch.cu_args(q), *launch.strides(out), *launch.strides(dout),
        *launch.lse_strides(lse), launch.H, launch.Tq, HEAD_DIM=launch.D,
        BLOCK_D=constants["BLOCK_D"], BLOCK_M=block, VARLEN=launch.varlen,
    )  # fmt: skip
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    mask, *mask_strides = launch.mask_args(q)
    shared = (
        *launch.strides(q), *launch.strides(k), *launch.strides(v), *launch.strides(dout),
        *launch.lse_strides(lse), *mask_strides,
    )  # fmt: skip
    sizes = (launch.Tq, launch.Tk, launch.scale, launch.scale * kernels.LOG2_E, *launch.buckets())

    def key_tiles(meta):
        return (triton.cdiv(launch.Tk, meta["BLOCK_N"]), launch.B * launch.Hkv)

    kernels.backward_dkdv_kernel[key_tiles](
        q, k, v, dout, lse, delta, dk, dv, mask, *launch.cu_args(q), *shared,
        *launch.strides(dk), *launch.strides(dv), launch.Hkv, launch.H // launch.Hkv, *sizes,
        **constants,
    )  # fmt: skip

    def query_tiles(meta):
        return (triton.cdiv(launch.Tq, meta["BLOCK_M"]), launch.B * launch.H)

    kernels.backward_dq_kernel[query_tiles](
        q, k, v, dout, lse, delta, dq, mask, *launch.cu_args(q), *shared,
        *launch.strides(dq), launch.H, launch.H // launch.Hkv, *sizes, **constants,
    )  # fmt: skip
    return dq, dk, dv


class FlashAttention(torch.autograd.Function):
    """out, lse = FlashAttention.apply(q, k, v, launch); gradients flow to q, k and v."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, launch: Launch):
        with kernels.launching():  # the interpreter's fixes, for qkv's launches only
            out, lse = _forward(q, k, v, launch)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.launch = launch
        ctx.mark_non_differentiable(lse)  # returned to be looked at, not trained through
        return out, lse

    @staticmethod
    def backward(ctx, dout: Tensor, _dlse: Tensor | None):
        q, k, v, out, lse = ctx.saved_tensors
        with kernels.launching():
            dq, dk, dv = _backward(dout, q, k, v, out, lse, ctx.launch)
        return dq, dk, dv, None


def _check_runnable(q: Tensor, D: int) -> None:
    reason = unsupported(q, D)
    if reason is not None:
        raise ValueError(f"the flash kernel cannot run these inputs: {reason}")


def flash_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mask: Tensor | None = None,
    causal: bool = False,
    scale: float | None = None,
) -> tuple[Tensor, Tensor]:
    """Attention by qkv's Triton kernel; returns (out (B, H, Tq, D), lse (B, H, Tq) float32).

    Shapes, mask, causal and scale as in `qkv.attend`: k and v may have fewer heads (Hkv
    dividing H), the mask is boolean and broadcastable to (B, H, Tq, Tk), causal aligns the
    queries to the end of the keys. lse[b, h, i] = ln sum_j exp(scale * q_i . k_j) over the
    keys query i may see, -inf for a query that may see none (its output is zeros). Any
    strides are read as they are: no copy of q, k or v is made.
    """
    shape, scale = check_inputs(q, k, v, mask, scale)
    _check_runnable(q, shape.D)
    if mask is not None:
        mask = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))
        mask = mask.expand(shape.B, shape.H, shape.Tq, shape.Tk).view(torch.uint8)
    launch = Launch(shape.B, shape.H, shape.Hkv, shape.Tq, shape.Tk, shape.D, causal, scale,
                    mask, None, None)  # fmt: skip
    return FlashAttention.apply(q, k, v, launch)


def _check_cu_seqlens(name: str, cu: Tensor, total: int, q: Tensor) -> Tensor:
    if not isinstance(cu, Tensor) or cu.dim() != 1 or cu.numel() < 2:
        raise ValueError(f"{name} must be a 1-D tensor [0, n1, n1 + n2, ..., total] of B + 1 ints")
    if cu.dtype not in (torch.int32, torch.int64) or cu.device != q.device:
        raise ValueError(
            f"{name} must hold int32 or int64 on {q.device}, got {cu.dtype} on {cu.device}"
        )
    values = cu.tolist()
    if values[0] != 0 or values[-1] != total or any(b < a for a, b in pairwise(values)):
        raise ValueError(
            f"{name} must rise from 0 to the number of packed tokens ({total}), got {values[:8]}"
            + (" ..." if len(values) > 8 else "")
        )
    return cu.to(torch.int32)


def flash_attention_varlen(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor | None = None,
    *,
    causal: bool = False,
    scale: float | None = None,
) -> tuple[Tensor, Tensor]:
    """Attention over a packed batch of sequences of different lengths, with no padding.

    q: (Nq, H, D), the B sequences' queries one after another; k, v: (Nk, Hkv, D).
    cu_seqlens_q: (B + 1,) the cumulative lengths [0, n1, n1 + n2, ..., Nq]; sequence b is
    q[cu[b]:cu[b + 1]] and attends only to its own keys, k[cu_k[b]:cu_k[b + 1]]
    (cu_seqlens_k defaults to cu_seqlens_q: self-attention). Returns (out (Nq, H, D),
    lse (H, Nq) float32). E.g. two sentences of 3 and 5 tokens: cu_seqlens_q = [0, 3, 8].
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor) or t.dim() != 3:
            got = tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__
            raise ValueError(f"{name} must be packed as (tokens, heads, D), got {got}")
    cu_q = _check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.shape[0], q)
    cu_k = (
        cu_q
        if cu_seqlens_k is None
        else _check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, k.shape[0], q)
    )
    if cu_k.numel() != cu_q.numel():
        raise ValueError(
            f"cu_seqlens_q has {cu_q.numel() - 1} sequences but cu_seqlens_k has {cu_k.numel() - 1}"
        )
    # Check dtypes, devices, heads and D as attend does, on (1, heads, tokens, D) views.
    shape, scale = check_inputs(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                v.transpose(0, 1)[None], None, scale)  # fmt: skip
    _check_runnable(q, shape.D)
    lengths_q, lengths_k = cu_q.diff(), cu_k.diff()
    Tq, Tk = int(lengths_q.max()), max(int(lengths_k.max()), 1)  # the longest sequences
    launch = Launch(cu_q.numel() - 1, shape.H, shape.Hkv, Tq, Tk, shape.D, causal, scale,
                    None, cu_q, cu_k)  # fmt: skip
    return FlashAttention.apply(q, k, v, launch)


__all__ = ["FlashAttention", "flash_attention", "flash_attention_varlen"]

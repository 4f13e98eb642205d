"""The flash kernel's correctness checks, sized by a parameter.

The tests run them small, in Triton's interpreter on the CPU; benchmarks/flash_gpu.py runs
the same checks at full size on a GPU. Each check draws fresh random inputs, runs the
kernel forward and backward, and returns its largest errors against a float64 reference
(qkv's `eager` backend, itself checked against `loop`), relative to the reference's
largest entry.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import Tensor

from qkv.attention import attend
from qkv.attention.flash import flash_attention, flash_attention_varlen

# Largest error allowed, relative to the largest entry of the float64 reference, in each
# input dtype. The kernel rounds the weights to the input dtype before multiplying them
# with V (and dS before multiplying with K and Q), as every FlashAttention does.
TOLERANCE = {torch.float32: 2e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}
MASKS = ("none", "padding", "full", "blind")


@dataclass(frozen=True)
class Case:
    """One attention call: sizes, dtype, causal, and which mask.

    mask: "none"; "padding" (B, 1, 1, Tk) with the last keys of batch 0 hidden; "full"
    (B, H, Tq, Tk) random; "blind" like full, with some queries that may see no key.
    """

    B: int = 2
    H: int = 4
    Hkv: int = 2
    Tq: int = 37
    Tk: int = 37
    D: int = 64
    dtype: torch.dtype = torch.bfloat16
    causal: bool = False
    mask: str = "none"

    def __str__(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        return (
            f"B{self.B}-H{self.H}/{self.Hkv}-T{self.Tq}x{self.Tk}-D{self.D}-{dtype}"
            f"{'-causal' if self.causal else ''}-{self.mask}"
        )


# Each feature the kernel promises, at sizes that cross several 16-wide tiles and end
# inside one (odd T), in every dtype it computes in. `scaled` grows them for a GPU.
bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32
CASES = [
    Case(dtype=bf16, D=32),  # grouped KV heads: 4 query heads on 2 key/value heads
    Case(dtype=fp16, D=64, causal=True),
    Case(dtype=fp32, D=80, Tq=23, Tk=41, causal=True, mask="padding"),  # cached decoding
    Case(dtype=bf16, D=96, Tq=41, Tk=23, causal=True),  # Tq > Tk: the first queries see none
    Case(dtype=fp16, D=128, H=3, Hkv=1, mask="full"),  # multi-query attention
    Case(dtype=bf16, D=256, B=1, H=2, Hkv=2, Tq=17, Tk=29, mask="blind"),
    Case(dtype=fp32, D=64, Tq=1, Tk=50, causal=True),  # one new token against its cache
    Case(dtype=bf16, D=64, Tq=32, Tk=48, causal=True, mask="blind"),  # whole tiles only
    Case(dtype=fp16, D=8, H=6, Hkv=3, Tq=5, Tk=7),  # a head narrower than a tile
]


def scaled(case: Case, factor: int) -> Case:
    """The same case with factor times the tokens (a GPU's tiles are up to 128 wide)."""
    return replace(case, Tq=case.Tq * factor, Tk=case.Tk * factor)


def make_mask(case: Case, device) -> Tensor | None:
    if case.mask == "none":
        return None
    if case.mask == "padding":
        mask = torch.ones(case.B, 1, 1, case.Tk, dtype=torch.bool, device=device)
        mask[0, ..., case.Tk - case.Tk // 3 :] = False  # batch 0 is a third padding
        return mask
    mask = torch.rand(case.B, case.H, case.Tq, case.Tk, device=device) > 0.4
    mask[..., 0] = True  # every query sees a key ...
    if case.mask == "blind":
        mask[:, :, :: max(1, case.Tq // 3)] = False  # ... except every third query
    return mask


def make_inputs(case: Case, device) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    q = torch.randn(case.B, case.H, case.Tq, case.D, device=device, dtype=case.dtype)
    k = torch.randn(case.B, case.Hkv, case.Tk, case.D, device=device, dtype=case.dtype)
    v = torch.randn(case.B, case.Hkv, case.Tk, case.D, device=device, dtype=case.dtype)
    return q, k, v, make_mask(case, device)


def relative_error(got: Tensor, want: Tensor, floor: float = 0.0) -> float:
    """max |got - want| / max(floor, max |want|), in float64 (0 when both are all zeros).

    The lse's error is taken relative to at least 1: with one visible key it is a single
    scaled dot product, which can be as close to 0 as chance makes it.
    """
    error = (got.double() - want).abs().max().item()
    scale = max(floor, want.abs().max().item())
    return error / scale if scale > 0 else error


def reference(q, k, v, mask, causal, dout) -> tuple[Tensor, Tensor, list[Tensor]]:
    """The float64 output, log-sum-exp and gradients of q, k, v for `dout`."""
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    out = attend(q, k, v, mask=mask, causal=causal, backend="eager")
    out.backward(dout.double())
    group = q.shape[1] // k.shape[1]
    scores = q.detach() @ k.detach().repeat_interleave(group, 1).mT / q.shape[-1] ** 0.5
    allowed = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device)
    if causal:
        allowed = allowed.tril(k.shape[2] - q.shape[2])
    if mask is not None:
        allowed = allowed & mask
    lse = scores.masked_fill(~allowed, float("-inf")).logsumexp(-1)
    return out.detach(), lse, [q.grad, k.grad, v.grad]


def check(case: Case, device="cpu") -> dict[str, float]:
    """Run `case` through the kernel on fresh random inputs; its relative errors by name.

    Beside out, lse, dq, dk and dv, "blind" is the largest output or gradient entry of a
    query that may see no key (each must be exactly 0), and "lse_blind" is 0 when every
    such query's lse is -inf.
    """
    q, k, v, mask = make_inputs(case, device)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out, lse = flash_attention(q, k, v, mask=mask, causal=case.causal)
    dout = torch.randn_like(out)
    out.backward(dout)
    want_out, want_lse, want_grads = reference(q, k, v, mask, case.causal, dout)
    blind = torch.isinf(want_lse)  # (B, H, Tq): queries that may see no key
    seen = ~blind
    errors = {
        "out": relative_error(out, want_out),
        "lse": relative_error(lse[seen], want_lse[seen], floor=1.0) if seen.any() else 0.0,
        "blind": max(out[blind].abs().max().item(), q.grad[blind].abs().max().item())
        if blind.any()
        else 0.0,
        "lse_blind": float(not bool((lse[blind] == float("-inf")).all())),
    }
    for name, got, want in zip(
        ("dq", "dk", "dv"), (q.grad, k.grad, v.grad), want_grads, strict=True
    ):
        errors[name] = relative_error(got, want)
    return errors


def check_varlen(
    lengths_q: list[int], lengths_k: list[int], H=4, Hkv=2, D=64, dtype=torch.bfloat16,
    causal=False, device="cpu",
) -> dict[str, float]:  # fmt: skip
    """A packed batch against each of its sequences run alone in float64; errors by name."""

    def cumulative(lengths):
        return torch.tensor([0, *lengths], device=device).cumsum(0).to(torch.int32)

    cu_q, cu_k = cumulative(lengths_q), cumulative(lengths_k)
    q = torch.randn(sum(lengths_q), H, D, device=device, dtype=dtype, requires_grad=True)
    k = torch.randn(sum(lengths_k), Hkv, D, device=device, dtype=dtype, requires_grad=True)
    v = torch.randn(sum(lengths_k), Hkv, D, device=device, dtype=dtype, requires_grad=True)
    out, lse = flash_attention_varlen(q, k, v, cu_q, cu_k, causal=causal)  # (N, H, D), (H, N)
    dout = torch.randn_like(out)
    out.backward(dout)
    errors = dict.fromkeys(("out", "lse", "dq", "dk", "dv"), 0.0)
    for b, (nq, nk) in enumerate(zip(lengths_q, lengths_k, strict=True)):
        qs, ks = slice(cu_q[b], cu_q[b] + nq), slice(cu_k[b], cu_k[b] + nk)
        if nq == 0 or nk == 0:  # keys no query reads get no gradient
            errors["dk"] = max(errors["dk"], k.grad[ks].abs().max().item() if nk else 0.0)
            continue

        def alone(t):  # one sequence, as (1, heads, T, D)
            return t.transpose(0, 1)[None]

        want_out, want_lse, grads = reference(
            alone(q[qs]), alone(k[ks]), alone(v[ks]), None, causal, alone(dout[qs])
        )
        seen = torch.isfinite(want_lse[0])
        got = {"out": alone(out[qs]), "dq": alone(q.grad[qs]), "dk": alone(k.grad[ks]),
               "dv": alone(v.grad[ks])}  # fmt: skip
        for name, want in zip(("out", "dq", "dk", "dv"), (want_out, *grads), strict=True):
            errors[name] = max(errors[name], relative_error(got[name], want))
        lse_error = relative_error(lse[:, qs][seen], want_lse[0][seen], floor=1.0)
        errors["lse"] = max(errors["lse"], lse_error)
    return errors

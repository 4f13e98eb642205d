"""The products of qkv's Linear layers, on the CPU's faster float32 GEMM.

Every query, key, value, output, MLP and head matrix in qkv's layers multiplies through
`project(module, x)`. For a plain float32 `nn.Linear` on a CPU where `qkv.device.choose_gemm`
picks oneDNN (an AMD CPU, where torch's MKL takes its AVX2 path), the product runs through
oneDNN's linear, with the same weights, the same shapes and the same autograd; everywhere
else, and for any module that is not a plain Linear (int4, a parametrization, a module with
hooks), it is `module(x)`. The modules themselves stay `nn.Linear`: their state dicts,
optimizers and hooks are torch's.

The two libraries add a row's products in different orders, so their results differ by
float32 rounding (about 1e-7 of the output's size), never more.

>>> import torch
>>> layer = torch.nn.Linear(4, 3)
>>> x = torch.randn(2, 5, 4)
>>> torch.allclose(project(layer, x), layer(x), atol=1e-6)
True
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from qkv.device import choose_gemm


@functools.cache
def onednn_chosen() -> bool:
    """Whether float32 CPU products go to oneDNN on this machine (read once per process)."""
    return choose_gemm()[0] == "onednn"


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """F.linear(x, weight, bias): x (..., K), weight (N, K), bias (N,) -> (..., N), on oneDNN
    where `onednn_chosen` and every tensor is float32 on the CPU. Under torch.compile it is
    F.linear, which the compiler lowers itself (its own oneDNN linear needs packed weights),
    and under CPU autocast too, which runs F.linear in the autocast's dtype (bfloat16)."""
    if (x.dtype is torch.float32 and weight.dtype is torch.float32 and x.device.type == "cpu"
            and weight.device.type == "cpu" and (bias is None or bias.dtype is torch.float32)
            and not torch.compiler.is_compiling() and not torch.is_autocast_enabled("cpu")
            and onednn_chosen()):  # fmt: skip
        if torch.is_grad_enabled() and (
            x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
        ):
            return _OneDNNLinear.apply(x, weight, bias)
        return _onednn(x, weight, bias)
    return F.linear(x, weight, bias)


def project(module: nn.Module, x: Tensor) -> Tensor:
    """module(x), a plain nn.Linear's product through `linear`; any other module (int4, a
    subclass, a parametrized Linear) or a Linear with hooks is called as itself."""
    if type(module) is nn.Linear and not _hooked(module):
        return linear(x, module.weight, module.bias)
    return module(x)


def _hooked(module: nn.Module) -> bool:
    hooks = nn.modules.module  # torch's process-wide hooks, which a module call would run
    return bool(module._forward_hooks or module._forward_pre_hooks
                or hooks._global_forward_hooks or hooks._global_forward_pre_hooks)  # fmt: skip


def _onednn(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """x (..., K) @ weight (N, K).T + bias through torch's oneDNN linear (weights in their
    own layout, any strides: oneDNN reads them as they are)."""
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), weight, bias, "none", [], "")


class _OneDNNLinear(torch.autograd.Function):
    """`linear` with gradients: the input's gradient is a product by the weight, so it runs
    on oneDNN too; the weight's, a product over every row of the batch, stays on torch's mm,
    which was as fast there. A backward asked to build its own graph (create_graph=True, for
    a gradient of a gradient) runs on torch's differentiable ops instead."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return _onednn(x, weight, bias)

    @staticmethod
    def backward(ctx, grad: Tensor):
        x, weight = ctx.saved_tensors
        grad_x = grad_weight = grad_bias = None
        rows = grad.reshape(-1, grad.shape[-1])  # (B*T, N)
        # asked with create_graph (a gradient of this gradient): torch's differentiable ops
        twice = torch.is_grad_enabled()
        if ctx.needs_input_grad[0]:  # (..., K): grad @ weight
            grad_x = grad.matmul(weight) if twice else _onednn(grad, weight.t(), None)
        if ctx.needs_input_grad[1]:
            grad_weight = rows.t().mm(x.reshape(-1, x.shape[-1]))  # (N, K)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = rows.sum(0)  # (N,)
        return grad_x, grad_weight, grad_bias

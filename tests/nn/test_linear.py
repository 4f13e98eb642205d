"""qkv.nn.linear: the Linear layers' products on oneDNN where qkv.device chooses it, checked
against F.linear in float64 on fresh random inputs: the outputs, and every gradient.

The oneDNN path is run directly here, whatever this machine's CPU (the choice itself is
tested in test_cpu.py with CPUs written into the test); torch's CPU build for x86 always
carries oneDNN, so the test asks for it rather than skipping without it.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import qkv.nn.linear as qkv_linear
from qkv.nn.linear import linear, project


@pytest.fixture
def onednn(monkeypatch):
    """The oneDNN path taken on any CPU, as on one where qkv.device chooses it."""
    assert torch.backends.mkldnn.is_available(), "torch's CPU build lacks oneDNN"
    monkeypatch.setattr(qkv_linear, "onednn_chosen", lambda: True)
    calls = []
    real = qkv_linear._onednn

    def counted(*args):
        calls.append(args[0].shape)
        return real(*args)

    monkeypatch.setattr(qkv_linear, "_onednn", counted)
    return calls


def relative(got, want):
    return float((got.detach().double() - want.detach()).abs().max() / want.detach().abs().max())


@pytest.mark.parametrize("shape", [(7, 40), (3, 5, 40), (2, 3, 4, 40)])
@pytest.mark.parametrize("with_bias", [True, False])
def test_the_product_and_its_gradients_are_f_linears(onednn, shape, with_bias):
    torch.manual_seed(len(shape) + with_bias)
    x = torch.randn(shape, dtype=torch.float64)
    weight, bias = torch.randn(24, 40, dtype=torch.float64), torch.randn(24, dtype=torch.float64)
    bias = bias if with_bias else None
    ours = [t.float().requires_grad_() if t is not None else None for t in (x, weight, bias)]
    theirs = [t.clone().requires_grad_() if t is not None else None for t in (x, weight, bias)]
    out, want = linear(*ours), F.linear(*theirs)
    grad = torch.randn_like(want)
    out.backward(grad.float())
    want.backward(grad)
    assert out.shape == want.shape and out.dtype == torch.float32
    assert relative(out, want) < 1e-6
    for mine, reference in zip(ours, theirs, strict=True):
        if mine is not None:
            assert relative(mine.grad, reference.grad) < 1e-6
    assert len(onednn) == 2  # the product and the input's gradient went through oneDNN


def test_a_weight_that_needs_no_gradient_gets_none_and_inference_needs_no_graph(onednn):
    x, weight = torch.randn(4, 8, requires_grad=True), torch.randn(3, 8)
    linear(x, weight).sum().backward()
    assert weight.grad is None and x.grad is not None
    with torch.no_grad():
        assert linear(x, weight).grad_fn is None
    assert relative(x.grad, torch.ones(4, 3).double() @ weight.double()) < 1e-6


def test_other_dtypes_and_the_choice_of_blas_are_f_linear(monkeypatch):
    calls = []
    monkeypatch.setattr(qkv_linear, "_onednn", lambda *args: calls.append(args))
    x, weight = torch.randn(2, 8, dtype=torch.float64), torch.randn(3, 8, dtype=torch.float64)
    monkeypatch.setattr(qkv_linear, "onednn_chosen", lambda: True)
    assert torch.equal(linear(x, weight), F.linear(x, weight))  # float64: not oneDNN's
    monkeypatch.setattr(qkv_linear, "onednn_chosen", lambda: False)
    assert torch.equal(linear(x.float(), weight.float()), F.linear(x.float(), weight.float()))
    assert calls == []


def test_a_gradient_of_the_gradient_is_f_linears(onednn):
    torch.manual_seed(3)
    x, weight = torch.randn(5, 8, dtype=torch.float64), torch.randn(4, 8, dtype=torch.float64)

    def second(fn, x, weight):  # d/dweight of |d(out.sum())/dx|^2
        x, weight = x.clone().requires_grad_(), weight.clone().requires_grad_()
        (grad_x,) = torch.autograd.grad(fn(x, weight).pow(2).sum(), x, create_graph=True)
        return torch.autograd.grad(grad_x.pow(2).sum(), weight)[0]

    got, want = second(linear, x.float(), weight.float()), second(F.linear, x, weight)
    assert relative(got, want) < 1e-5


def test_under_autocast_the_product_is_f_linears_in_the_autocast_dtype(onednn):
    x, weight = torch.randn(6, 16), torch.randn(4, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, want = linear(x, weight), F.linear(x, weight)
    assert out.dtype == torch.bfloat16 and torch.equal(out, want) and onednn == []


def test_project_runs_a_linears_hooks_and_any_other_module_as_itself(onednn):
    torch.manual_seed(0)
    layer, x = nn.Linear(8, 5), torch.randn(3, 8)
    assert relative(project(layer, x), F.linear(x.double(), layer.weight.double(),
                                                layer.bias.double())) < 1e-6  # fmt: skip
    assert len(onednn) == 1
    seen = []
    handle = layer.register_forward_hook(lambda module, args, out: seen.append(out))
    out = project(layer, x)
    handle.remove()
    assert len(seen) == 1 and seen[0] is out and len(onednn) == 1  # called as itself
    other = nn.Sequential(nn.Linear(8, 5), nn.ReLU())
    assert torch.equal(project(other, x), other(x))
    assert len(onednn) == 1

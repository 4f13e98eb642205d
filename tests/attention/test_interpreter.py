"""qkv's fixes to Triton's interpreter stay around qkv's own launches (flash/interpreter.py).

The fixes replace attributes that every Triton kernel in the process uses, so these tests
look at those attributes themselves: Triton's own objects outside qkv's launches, qkv's
fixes inside them.
"""

from __future__ import annotations

import threading

import pytest
import torch

from qkv.attention.flash.limits import interpreter_on

pytestmark = pytest.mark.skipif(
    not interpreter_on(), reason="the fixes are for Triton's interpreter (TRITON_INTERPRET=1)"
)


def current():
    """The attributes the fixes replace, as they are now."""
    from qkv.attention.flash.interpreter import FIXES

    return [vars(owner)[name] for owner, name, _ in FIXES]


def tritons_own(attributes) -> bool:
    """Whether each is Triton's function, not a fix of qkv's wrapped around it (the fixes copy
    the name and module of what they wrap, but not its code)."""
    from triton.runtime import interpreter

    return all(a.__code__.co_filename == interpreter.__file__ for a in attributes)


def observe_launches(monkeypatch) -> list[list[object]]:
    """Record the attributes at each kernel launch: the interpreter's GridExecutor calls
    _patch_lang to set up every launch (and every call of a jitted helper)."""
    from triton.runtime import interpreter

    seen = []
    set_up = interpreter._patch_lang

    def recording(fn):
        seen.append(current())
        return set_up(fn)

    monkeypatch.setattr(interpreter, "_patch_lang", recording)
    return seen


def test_the_fixes_are_in_place_during_a_flash_call_and_gone_after(monkeypatch):
    from qkv.attention.flash import flash_attention

    before = current()
    assert tritons_own(before)
    seen = observe_launches(monkeypatch)
    q, k, v = (torch.randn(1, 2, 20, 16, requires_grad=True) for _ in range(3))
    out, _ = flash_attention(q, k, v, causal=True)
    out.sum().backward()  # the backward's three kernels too
    assert len(seen) >= 4, "the forward, delta, dK/dV and dQ kernels"
    for attributes in seen:
        assert all(a is not b for a, b in zip(attributes, before, strict=True))
        assert not tritons_own(attributes)
    after = current()
    assert all(a is b for a, b in zip(after, before, strict=True))


def test_another_kernel_in_the_process_runs_on_triton_as_it_is(monkeypatch):
    import triton
    import triton.language as tl

    from qkv.attention.flash import flash_attention

    @triton.jit
    def double(X, N: tl.constexpr):
        rows = tl.arange(0, N)
        tl.store(X + rows, tl.load(X + rows) * 2)

    x = torch.randn(1, 1, 16, 16)
    flash_attention(x, x, x)  # qkv's launch first: it must leave nothing behind
    seen = observe_launches(monkeypatch)
    y = torch.arange(16.0)
    double[(1,)](y, 16)
    assert torch.equal(y, torch.arange(16.0) * 2)
    assert len(seen) == 1 and tritons_own(seen[0])


def test_nested_blocks_keep_the_fixes_until_the_outer_one_closes():
    from qkv.attention.flash.interpreter import fixed_interpreter

    original = current()
    with fixed_interpreter():
        fixed = current()
        with fixed_interpreter():
            assert all(a is b for a, b in zip(current(), fixed, strict=True))
        assert all(a is b for a, b in zip(current(), fixed, strict=True)), "still inside one"
    assert all(a is b for a, b in zip(current(), original, strict=True))


def test_a_thread_that_ends_its_launch_leaves_the_fixes_to_one_still_launching():
    from qkv.attention.flash.interpreter import fixed_interpreter

    original = current()
    entered, release, done = threading.Event(), threading.Event(), threading.Event()
    inside_after_other_left = []

    def launching():
        with fixed_interpreter():
            entered.set()
            release.wait(timeout=30)
            inside_after_other_left.append(tritons_own(current()))
        done.set()

    thread = threading.Thread(target=launching)
    thread.start()
    assert entered.wait(timeout=30)
    with fixed_interpreter():  # this thread's launch begins and ends inside the other's
        pass
    assert not tritons_own(current()), "the other thread is still inside"
    release.set()
    thread.join(timeout=30)
    assert done.is_set() and inside_after_other_left == [False]
    assert all(a is b for a, b in zip(current(), original, strict=True))

"""What a compiled Triton kernel may read, checked on the CPU: a kernel run by the GPU's
compiler reads no module global that is not `tl.constexpr` (nor a function, a module or a
jitted helper), while Triton's interpreter, which runs every test here, reads any. A plain
float (`LN_2`) read inside the forward kernel passed every test and failed the kernel's first
compile on a GPU (an H200, 2026-12-04): this test finds such a read without one."""

from __future__ import annotations

import ast
import inspect
import textwrap
import types

import triton
import triton.language as tl

from qkv.attention.flash import kernels


def jitted() -> dict[str, object]:
    """Every jitted function of the kernels module (a JITFunction, or the interpreter's
    InterpretedFunction under TRITON_INTERPRET=1), autotuned ones unwrapped: each holds the
    Python function it was made from as `.fn`."""
    found = {}
    for name, value in vars(kernels).items():
        while hasattr(value, "fn") and not isinstance(value.fn, types.FunctionType):
            value = value.fn  # an Autotuner wraps the jitted function
        if isinstance(getattr(value, "fn", None), types.FunctionType):
            found[name] = value
    return found


def globals_read(function) -> set[str]:
    tree = ast.parse(textwrap.dedent(inspect.getsource(function.fn)))
    tree.body[0].decorator_list = []  # run on the host, where any global may be read
    local = {a.arg for a in ast.walk(tree) if isinstance(a, ast.arg)}
    local |= {
        n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)
    }
    loaded = {
        n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)
    }
    return {name for name in loaded - local if name in function.fn.__globals__}


def test_kernels_read_only_constexpr_globals():
    functions = jitted()
    assert {"forward_kernel", "_attend_key_tiles", "backward_delta_kernel"} <= set(functions)
    allowed = (tl.constexpr, types.ModuleType, types.FunctionType, type)
    wrong = {
        f"{name} reads {read} ({type(value).__name__})"
        for name, function in functions.items()
        for read in globals_read(function)
        if not isinstance(value := function.fn.__globals__[read], allowed)
        and not hasattr(value, "fn")
    }
    assert not wrong, f"make these tl.constexpr: {sorted(wrong)}"


def test_the_check_finds_a_plain_float():
    plain = 0.5

    @triton.jit
    def reads_plain(x_ptr):
        tl.store(x_ptr, tl.load(x_ptr) * plain)

    reads_plain.fn.__globals__["plain"] = plain  # as a module-level float would be
    try:
        assert "plain" in globals_read(reads_plain)
        assert not isinstance(reads_plain.fn.__globals__["plain"], tl.constexpr)
    finally:
        del reads_plain.fn.__globals__["plain"]

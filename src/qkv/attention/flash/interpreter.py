"""Three fixes to Triton's CPU interpreter (TRITON_INTERPRET=1), applied around qkv's launches.

The interpreter is how the kernels run without a GPU: in the tests, in CI, and for anyone
who wants to step through them. Triton 3.6's has three faults that the compiled
kernels do not share:
- with NumPy 2.4 or newer, a loop bound computed from `tl.program_id` fails to become a
  Python int ("only 0-dimensional arrays can be converted to Python scalars"), because
  every scalar is a 1-element array (Triton 3.9 squeezes it, as done here);
- `tl.dot` of bfloat16 tiles multiplies their raw 16-bit patterns as integers (bfloat16 is
  stored as uint16 in NumPy); here they are widened to float32 first, which is what a GPU's
  tensor cores compute with a float32 accumulator;
- `x.to(tl.bfloat16)` from float32 truncates the mantissa (half of all values land one
  step low, all towards zero) where a GPU rounds to the nearest even; done here as a GPU
  does, so that the tests see the kernel's real bfloat16 error, not twice it.

The fixes replace attributes of Triton's interpreter module, which the whole process shares:
they are in place only inside `fixed_interpreter()`, which qkv enters around each of its own
kernel launches, so that anyone else's Triton kernel in the same process runs on Triton as
it is.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterator

import numpy as np
import triton.language as tl
from triton.runtime import interpreter


def _patch_tensor(original):
    @functools.wraps(original)
    def patch(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    return patch


def _widen_bfloat16(handle):
    if handle.dtype.scalar != tl.bfloat16:
        return handle
    data = interpreter._convert_float(handle.data, tl.bfloat16, tl.float32, None)
    return interpreter.TensorHandle(data.view(np.float32), tl.float32)


def _round_to_bfloat16(data: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits (uint16), rounding to the nearest even as GPUs do."""
    bits = data.astype(np.float32).view(np.uint32)
    rounded = (bits + (0x7FFF + ((bits >> 16) & 1))) >> 16
    return np.where(np.isnan(data), 0x7FC0, rounded).astype(np.uint16)


def _patch_cast(original):
    @functools.wraps(original)
    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            return interpreter.TensorHandle(_round_to_bfloat16(src.data), tl.bfloat16)
        return original(self, src, dst_type)

    return cast_impl


def _patch_dot(original):
    @functools.wraps(original)
    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        a, b = _widen_bfloat16(a), _widen_bfloat16(b)
        return original(self, a, b, d, input_precision, max_num_imprecise_acc)

    return create_dot


# (owner, attribute, fix): what fixed_interpreter() replaces while it is entered
FIXES = [
    (interpreter, "_patch_lang_tensor", _patch_tensor),
    (interpreter.InterpreterBuilder, "create_dot", _patch_dot),
    (interpreter.InterpreterBuilder, "cast_impl", _patch_cast),
]

_lock = threading.Lock()
_entered = 0  # fixed_interpreter() blocks open now, in every thread
_originals: list[object] = []  # Triton's own attributes while the fixes are in place


@contextlib.contextmanager
def fixed_interpreter() -> Iterator[None]:
    """Triton's interpreter with the three fixes inside the block, and as it was after it.

    Re-entrant and shared by threads: the fixes go in when the first block opens and come
    out when the last one closes, so one thread's launch never loses them half-way because
    another's ended.
    """
    global _entered
    with _lock:
        if _entered == 0:
            _originals[:] = [vars(owner)[name] for owner, name, _ in FIXES]
            for (owner, name, fix), original in zip(FIXES, _originals, strict=True):
                setattr(owner, name, fix(original))
        _entered += 1
    try:
        yield
    finally:
        with _lock:
            _entered -= 1
            if _entered == 0:
                for (owner, name, _), original in zip(FIXES, _originals, strict=True):
                    setattr(owner, name, original)
                _originals.clear()

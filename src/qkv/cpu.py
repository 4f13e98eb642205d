"""What this CPU can do fast, and the precision qkv picks by it.

A fast path on one CPU is a slow one on another: matrix products in bfloat16 run about twice
as fast as float32 on a CPU with bfloat16 instructions (AVX512_BF16, AMX), and several times
slower on one without them (AVX2 only), where torch converts every number in software. So
where qkv's default is "auto", it asks the CPU's own feature flags (Linux's /proc/cpuinfo)
and takes bfloat16 only where the CPU has instructions for it. The choice depends on the
machine and nothing else (never on a timing), so a program computes the same numbers every
time it runs on one machine. `qkv backends --verbose` prints what was chosen and why.

>>> Capability(kernels="AVX2", flags=frozenset({"avx2", "fma"})).bfloat16
False
>>> choose_precision(Capability(kernels="AVX512", flags=frozenset({"avx512_bf16"})))[0]
'bfloat16'
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

BFLOAT16_FLAGS = ("avx512_bf16", "amx_bf16")  # the instructions that make bfloat16 fast
SHOWN_FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8")


@dataclass(frozen=True)
class Capability:
    """kernels: the instruction set torch's CPU kernels were dispatched to
    (`torch.backends.cpu.get_cpu_capability()`: DEFAULT, AVX2, AVX512, ...); flags: the
    CPU's feature flags (lower case, as /proc/cpuinfo lists them; empty where unknown)."""

    kernels: str
    flags: frozenset[str]

    @property
    def bfloat16(self) -> bool:
        """Whether the CPU has bfloat16 instructions (so bfloat16 matrix products are fast)."""
        return any(flag in self.flags for flag in BFLOAT16_FLAGS)

    def describe(self) -> str:
        shown = [flag for flag in SHOWN_FLAGS if flag in self.flags]
        return f"torch's kernels: {self.kernels}; {' '.join(shown) or 'no flags known'}"


def cpu_flags(cpuinfo: str) -> frozenset[str]:
    """The feature flags of the first processor in the text of /proc/cpuinfo.

    >>> sorted(cpu_flags("processor : 0\\nflags : fpu avx2 fma\\n"))
    ['avx2', 'fma', 'fpu']
    """
    for line in cpuinfo.splitlines():
        name, _, value = line.partition(":")
        if name.strip() in ("flags", "Features"):  # x86, and ARM's name for them
            return frozenset(value.split())
    return frozenset()


@functools.cache
def capability() -> Capability:
    """This machine's CPU, read once per process."""
    import torch

    try:
        flags = cpu_flags(Path("/proc/cpuinfo").read_text(errors="replace"))
    except OSError:  # not Linux: no flags known, so nothing beyond float32 is assumed
        flags = frozenset()
    return Capability(torch.backends.cpu.get_cpu_capability(), flags)


def choose_precision(cpu: Capability | None = None) -> tuple[str, str]:
    """("bfloat16" or "float32", why) for CPU matrix products where the caller said "auto"."""
    cpu = cpu or capability()
    if cpu.bfloat16:
        having = ", ".join(flag for flag in BFLOAT16_FLAGS if flag in cpu.flags)
        return "bfloat16", f"the CPU has bfloat16 instructions ({having})"
    return "float32", (
        "the CPU has no bfloat16 instructions (neither avx512_bf16 nor amx_bf16): bfloat16 "
        "would be converted in software, several times slower than float32"
    )

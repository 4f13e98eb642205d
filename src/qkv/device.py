"""What this CPU and torch can do fast (instruction sets, dtypes, kernels present), and the
choices qkv makes by it. The bottom floor: it imports torch and nothing of qkv.

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

import ctypes
import functools
import os
from dataclasses import dataclass
from pathlib import Path

import torch

BFLOAT16_FLAGS = ("avx512_bf16", "amx_bf16")  # the instructions that make bfloat16 fast
INT8_FLAGS = ("avx512_vnni", "avx_vnni", "amx_int8")  # 8-bit dot products summed in 32 bits
SHOWN_FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_bf16",
               "amx_int8")  # fmt: skip


@dataclass(frozen=True)
class Capability:
    """kernels: the instruction set torch's CPU kernels were dispatched to
    (`torch.backends.cpu.get_cpu_capability()`: DEFAULT, AVX2, AVX512, ...); flags: the
    CPU's feature flags (lower case, as /proc/cpuinfo lists them; empty where unknown)."""

    kernels: str
    flags: frozenset[str]
    vendor: str = ""  # /proc/cpuinfo's vendor_id: GenuineIntel, AuthenticAMD, ... ("" unknown)

    @property
    def bfloat16(self) -> bool:
        """Whether the CPU has bfloat16 instructions (so bfloat16 matrix products are fast)."""
        return any(flag in self.flags for flag in BFLOAT16_FLAGS)

    def describe(self) -> str:
        shown = [flag for flag in SHOWN_FLAGS if flag in self.flags]
        vendor = f"{self.vendor}; " if self.vendor else ""
        return f"{vendor}torch's kernels: {self.kernels}; {' '.join(shown) or 'no flags known'}"


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


def cpu_vendor(cpuinfo: str) -> str:
    """The vendor of the first processor in the text of /proc/cpuinfo ("" where none is said).

    >>> cpu_vendor("processor : 0\\nvendor_id : AuthenticAMD\\n")
    'AuthenticAMD'
    """
    for line in cpuinfo.splitlines():
        name, _, value = line.partition(":")
        if name.strip() == "vendor_id":
            return value.strip()
    return ""


@functools.cache
def capability() -> Capability:
    """This machine's CPU, read once per process."""
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:  # not Linux: no flags known, so nothing beyond float32 is assumed
        cpuinfo = ""
    return Capability(torch.backends.cpu.get_cpu_capability(), cpu_flags(cpuinfo),
                      cpu_vendor(cpuinfo))  # fmt: skip


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


def choose_gemm(cpu: Capability | None = None) -> tuple[str, str]:
    """("onednn" or "blas", why): the library that multiplies qkv's float32 Linear layers on
    the CPU (`qkv.nn.linear`).

    torch's CPU build hands F.linear's float32 products to its BLAS, Intel's MKL, which picks
    its kernels by the CPU's vendor: on any other x86 CPU it runs an AVX2 path, even where
    AVX-512 is there. oneDNN, also inside torch, picks by the instructions alone. On an
    AVX-512 AMD EPYC (2 cores, benchmarks/linear_cpu.py) it multiplied 512 rows by SmolLM2's
    matrices at 185-215 GFLOP/s where MKL reached 110-200 (1.07-1.5x, MKL the less steady),
    a training step's products 1.1-1.3x as fast, and the LM head 2.1-2.7x at 1 to 128 rows;
    held to AVX2 it was still 1.1-1.3x MKL. But on an AMD EPYC with AVX2 alone, MKL's AVX2
    path multiplied MiniLM's and SmolLM2's shapes at 173-182 GFLOP/s where oneDNN reached
    151-156 (2 cores, 2026-12-05), so such CPUs keep MKL. On Intel's own CPUs MKL is left to
    do its work.
    Like the precision, this depends on the machine alone, never on a timing.

    >>> choose_gemm(Capability("AVX512", frozenset(), "GenuineIntel"))[0]
    'blas'
    """
    cpu = cpu or capability()
    if not (torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_linear_pointwise")):  # fmt: skip
        return "blas", "this torch has no oneDNN linear"
    if not torch.backends.mkl.is_available():
        return "blas", "this torch's BLAS is not MKL, so nothing is known to be faster"
    if cpu.vendor != "AuthenticAMD":  # the vendor where MKL's path was measured slower
        return "blas", f"MKL's own kernels for this CPU ({cpu.vendor or 'vendor unknown'})"
    if "avx512f" not in cpu.flags:
        return "blas", (
            f"MKL's AVX2 path is this {cpu.vendor} CPU's best (it has no AVX-512): 1.13-1.2x "
            "oneDNN's float32 products where measured"
        )
    return "onednn", (
        f"MKL picks its kernels by vendor and takes an AVX2 path on this {cpu.vendor} CPU; "
        "oneDNN picks by the instructions (1.07-2.7x MKL's float32 products where measured)"
    )


# glibc's mallopt parameters (<malloc.h>)
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
MMAP_CEILING = 32 * 2**20  # the largest mmap threshold glibc takes on a 64-bit machine
KEPT_FREE = 2**30  # the most freed memory at the top of the heap kept for reuse


_FREED: list[str] = []  # what reuse_freed_memory did in this process, once it has


def freed_memory() -> str:
    """What this process's allocator does with freed memory, in words."""
    return _FREED[0] if _FREED else "the allocator as the system set it"


def reuse_freed_memory() -> str:
    """Have glibc's allocator keep freed memory for the next tensors: what was done, in words.
    For a program to call (the `qkv` command does, first thing); the library never does,
    since the allocator belongs to the whole process. Once a process; later calls say again
    what the first did.

    By default glibc gives each block of memory above a threshold (128 KB, rising to what was
    last freed) its own mapping and hands it back to the system when freed, so the next
    tensor of that size starts on fresh pages, each stopped at its first write for the
    system to map and zero it. A generation's packed float32 matrices (538 MB for SmolLM2)
    and a forward pass's activations are made and dropped again and again, and those stops
    were half the time of packing (40 ms without them, 130 ms with). So blocks up to 32 MB
    come from the heap (glibc's largest threshold), and up to 1 GiB freed at its top stays
    with the process: memory is reused, never more of it held than the most the process
    held at once. The numbers computed are the same either way.

    Left as it is off glibc, where MALLOC_MMAP_THRESHOLD_ or MALLOC_TRIM_THRESHOLD_ are set
    (the user's own choice), and with QKV_MALLOC=system.
    """
    if not _FREED:
        _FREED.append(_set_reuse())
    return _FREED[0]


def _set_reuse() -> str:
    if os.environ.get("QKV_MALLOC") == "system":
        return "the allocator as the system set it (QKV_MALLOC=system)"
    if any(name in os.environ for name in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")):
        return "the allocator as MALLOC_MMAP_THRESHOLD_ / MALLOC_TRIM_THRESHOLD_ set it"
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 (glibc's own symbol: this is glibc)
    except (OSError, AttributeError):
        return "the allocator as the system set it (not glibc)"
    if libc.mallopt(M_MMAP_THRESHOLD, MMAP_CEILING) != 1:
        return "the allocator as the system set it (glibc refused the settings)"
    libc.mallopt(M_TRIM_THRESHOLD, KEPT_FREE)
    return ("glibc keeps freed memory for reuse: blocks up to 32 MB from its heap, up to "
            "1 GiB of freed memory kept (QKV_MALLOC=system leaves it as it was)")  # fmt: skip

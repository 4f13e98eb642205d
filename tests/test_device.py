"""qkv.device: the precision "auto" takes is the CPU's, read from its feature flags.

The CPUs below are not this machine: their /proc/cpuinfo lines are written here (the flags of
an AMD EPYC with AVX2 only, and of an Intel Xeon with AVX-512 and AMX), since a test cannot
change the CPU it runs on. This machine's own choice is tested in test_pretrained.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import qkv
from qkv.device import (
    Capability,
    capability,
    choose_gemm,
    choose_precision,
    cpu_flags,
    cpu_vendor,
)
from qkv.nn.quant_linear import in_generation
from qkv.nn.quantized import choose_int8_inputs, int8_inputs_available

EPYC_AVX2 = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 7B13
flags\t\t: fpu vme de pse tsc msr sse sse2 ssse3 fma sse4_1 sse4_2 avx f16c avx2 bmi2
"""
XEON_AMX = """processor\t: 0
model name\t: Intel(R) Xeon(R) Platinum 8488C
flags\t\t: fpu sse2 avx avx2 fma avx512f avx512bw avx512_vnni avx512_bf16 amx_bf16 amx_tile
"""


@pytest.mark.parametrize(
    ("cpuinfo", "chosen", "says"),
    [
        (EPYC_AVX2, "float32", "no bfloat16 instructions"),
        (XEON_AMX, "bfloat16", "bfloat16 instructions (avx512_bf16, amx_bf16)"),
        ("", "float32", "no bfloat16 instructions"),  # flags unknown: nothing is assumed
    ],
)
def test_bfloat16_only_where_the_cpu_has_instructions_for_it(cpuinfo, chosen, says):
    cpu = Capability("AVX2", cpu_flags(cpuinfo))
    precision, why = choose_precision(cpu)
    assert precision == chosen and says in why


def test_flags_are_the_first_processors_and_arm_names_them_features():
    assert "amx_bf16" in cpu_flags(XEON_AMX) and "avx2" not in cpu_flags("flags : sse2\n")
    assert cpu_flags("Features\t: fp asimd bf16\n") == {"fp", "asimd", "bf16"}
    # ARM's bf16 feature is not one of the x86 instructions torch's kernels use here
    assert not Capability("DEFAULT", cpu_flags("Features : fp asimd bf16\n")).bfloat16


def test_float32_products_go_to_onednn_on_amd_cpus_with_avx512_and_stay_with_mkl_elsewhere():
    assert cpu_vendor(EPYC_AVX2) == "AuthenticAMD" and cpu_vendor(XEON_AMX) == ""
    intel = Capability("AVX512", cpu_flags(XEON_AMX), "GenuineIntel")
    assert choose_gemm(intel) == ("blas", "MKL's own kernels for this CPU (GenuineIntel)")
    assert choose_gemm(Capability("AVX2", frozenset()))[0] == "blas"  # vendor unknown
    has_both = torch.backends.mkldnn.is_available() and torch.backends.mkl.is_available()
    # with AVX-512 MKL takes its AVX2 path all the same; with AVX2 alone that path is the best
    avx512 = cpu_flags(EPYC_AVX2) | {"avx512f", "avx512bw"}
    library, why = choose_gemm(Capability("AVX512", avx512, "AuthenticAMD"))
    assert library == ("onednn" if has_both else "blas")
    assert ("AVX2 path on this AuthenticAMD CPU" in why) == has_both
    library, why = choose_gemm(Capability("AVX2", cpu_flags(EPYC_AVX2), "AuthenticAMD"))
    assert library == "blas"
    assert ("it has no AVX-512" in why) == has_both


@pytest.mark.parametrize(
    ("cpuinfo", "chosen", "says"),
    [
        (EPYC_AVX2, "bfloat16", "no 8-bit dot-product instructions"),
        (XEON_AMX, "int8", "8-bit dot-product instructions (avx512_vnni)"),
        ("flags : avx2 avx_vnni\n", "int8", "(avx_vnni)"),  # Alder Lake's 256-bit VNNI
        ("", "bfloat16", "no 8-bit dot-product instructions"),
    ],
)
def test_8_bit_head_inputs_only_where_the_cpu_sums_bytes_without_saturating(cpuinfo, chosen,
                                                                            says):  # fmt: skip
    inputs, why = choose_int8_inputs(Capability("AVX2", cpu_flags(cpuinfo)))
    if not int8_inputs_available():  # a torch without oneDNN's 8-bit products
        assert (inputs, why) == ("bfloat16", "this torch has no oneDNN 8-bit products")
    else:
        assert inputs == chosen and says in why


def test_backends_verbose_says_what_this_cpu_chose_and_why():
    done = subprocess.run([sys.executable, "-m", "qkv.cli", "backends", "--verbose"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    precision, why = choose_precision()
    assert f"embed(precision='auto'): {precision}, since {why}" in done.stdout
    library, why = choose_gemm()
    named = {"onednn": "oneDNN", "blas": "torch's BLAS"}[library]
    assert f"float32 Linear products: {named}, since {why}" in done.stdout
    assert f"this CPU: {capability().describe()}" in done.stdout
    if in_generation():  # the file's blocks on qkv's kernels, the head too
        assert "through NativeStep (one native call)" in done.stdout
        assert "its 8-bit LM head: the file's Q8_0 blocks" in done.stdout
    else:
        inputs, why = choose_int8_inputs()
        named = {"int8": "8-bit inputs (oneDNN)", "bfloat16": "bfloat16 inputs"}[inputs]
        assert f"its 8-bit LM head with {named}, since {why}" in done.stdout
    assert "sdpa" in done.stdout.splitlines()[1]
    native_off = subprocess.run([sys.executable, "-m", "qkv.cli", "backends", "--verbose"],
                                capture_output=True, text=True, check=True,
                                env={**os.environ, "QKV_NATIVE": "0"})  # fmt: skip
    assert "NativeStep" not in native_off.stdout and "8-bit LM head with" in native_off.stdout


# In a fresh process: a 24 MB tensor made and dropped, and where glibc kept it (its own
# counts, mallinfo2): in a mapping of its own, handed back when dropped (so the next tensor
# starts on fresh pages, each stopped at its first write), or in the heap, kept for reuse.
WHERE_KEPT = """
import ctypes, sys
import torch
from qkv.device import freed_memory, reuse_freed_memory

class Info(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks",
                "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL(None)
libc.mallinfo2.restype = Info
if sys.argv[1] == "program":
    reuse_freed_memory()
x = torch.empty(6 * 2**20).fill_(1.0)
mapped = libc.mallinfo2().hblkhd
del x
print(mapped >> 20, libc.mallinfo2().fordblks >> 20, freed_memory())
"""


def test_the_program_has_glibc_keep_freed_memory_for_reuse():
    found = {}
    for mode in ("as it was", "program"):
        done = subprocess.run([sys.executable, "-c", WHERE_KEPT, mode],
                              capture_output=True, text=True, check=True)  # fmt: skip
        mapped, free, says = done.stdout.strip().split(" ", 2)
        found[mode] = int(mapped), int(free), says
    assert found["as it was"][0] >= 24 and found["as it was"][1] < 24, found  # its own mapping
    assert found["as it was"][2] == "the allocator as the system set it"
    assert found["program"][0] < 24 and found["program"][1] >= 24, found  # the heap's, kept
    assert found["program"][2].startswith("glibc keeps freed memory for reuse")


def test_only_the_program_changes_the_allocator():
    """The allocator belongs to the whole process: the library never asks for its reuse."""
    src = Path(qkv.__file__).parent
    callers = sorted(
        str(path.relative_to(src))
        for path in src.rglob("*.py")
        if "reuse_freed_memory()" in path.read_text() and path.name != "device.py"
    )
    assert callers == ["cli/__init__.py"]
    done = subprocess.run([sys.executable, "-c", "import qkv; from qkv.device import freed_memory;"
                           " qkv.load('minilm'); print(freed_memory())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    assert done.stdout.strip() == "the allocator as the system set it"

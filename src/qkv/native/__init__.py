"""qkv's native CPU kernels: plain C, built with the system C compiler, loaded with ctypes.

Where the CPU needs a kernel torch does not have (a GGUF file's 4- and 8-bit matrices
multiplied by 8-bit activations, as llama.cpp multiplies them), qkv carries its own. The C
files live beside the Python that calls them (`qkv/nn/quant.c` beside `QuantLinear`); this
module builds all of them into one shared library and loads it once a process:

- **Built once, cached.** The library is compiled with the system compiler (`$CC`, else
  `cc` or `gcc`) into `$XDG_CACHE_HOME/qkv/native/` (or `~/.cache`), named by the hash of
  the sources, the flags and the compiler's version, and written atomically: a second
  process, or a second run, loads it in a millisecond. `make` builds it ahead
  (`python -m qkv.native`).
- **Or built at install.** `pip install .` (a wheel, not an editable install) compiles the
  same library into the package (`qkv/native/built/`), stamped with the hash of the sources
  and flags it came from (`prebuilt`): a process then loads it without a compiler. Built
  where the install runs, it is used wherever those sources are; a changed source makes the
  stamp wrong, and the cache's build is used instead.
- **Every instruction set in one build.** No `-march=native`: each kernel has a variant per
  instruction set (AVX2, AVX-VNNI, AVX-512 VNNI), compiled for that set alone
  (`__attribute__((target))`), and the CPU's own cpuid chooses among them at run time
  (`variants`). A library built on one machine runs on any x86-64 CPU; `QKV_NATIVE_ISA`
  forces a lower variant (`scalar`, `avx2`, `avx_vnni`).
- **The torch path stays.** Without a compiler, with a compiler that cannot build it, or with
  `QKV_NATIVE=0`, `library()` is None and `why_not()` says why; the callers then run torch's
  kernels as before. `qkv backends --verbose` names what was chosen and why.

This is a package of the bottom floor: it imports nothing of qkv.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1]  # src/qkv
# every C file under the qkv package is part of the library (a new kernel's file beside its
# caller is found by itself); headers are included from qkv/native
SOURCES = tuple(sorted(str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.c")))
HEADERS = tuple(sorted(str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.h")))
# -ffp-contract=off: no multiply-add is fused behind the code's back, so that every
# variant's float operations are the same ones, in the same order, and agree bit for bit
FLAGS = ("-O2", "-std=gnu11", "-fPIC", "-shared", "-ffp-contract=off", "-fno-math-errno",
         "-Wall", "-Wextra", "-Werror=implicit-function-declaration")  # fmt: skip
SANITIZE = ("-O1", "-g", "-fno-omit-frame-pointer", "-fsanitize=address,undefined",
            "-fno-sanitize-recover=undefined")  # fmt: skip
LIBS = ("-lm", "-lpthread")
VARIANTS = ("scalar", "avx2", "avx_vnni", "avx512_vnni")  # C's QKV_SCALAR.. order


MOST_THREADS = 256  # pool.c's


def threads() -> int:
    """How many threads the kernels' pool runs a parallel product or step on: QKV_THREADS
    where set, else every core this process may use."""
    asked = os.environ.get("QKV_THREADS", "").strip()
    if asked:
        if not asked.isdigit() or not 1 <= int(asked) <= MOST_THREADS:
            raise ValueError(f"QKV_THREADS={asked!r} is not a count of threads (1..256)")
        return int(asked)
    return max(1, min(len(os.sched_getaffinity(0)), MOST_THREADS))


def compiler() -> str | None:
    """The C compiler qkv builds with: $CC, else cc or gcc on the PATH (None: none)."""
    named = os.environ.get("CC")
    if named:
        return shutil.which(named) or named
    return shutil.which("cc") or shutil.which("gcc")


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "qkv" / "native"


PREBUILT = PACKAGE / "native" / "built"  # where a wheel's build puts the library
PREBUILT_NAME, STAMP_NAME = "libqkv.so", "libqkv.stamp"


def _sources_digest(flags: tuple[str, ...]) -> str:
    """The hash of every source and header under the package, and the flags."""
    digest = hashlib.sha256()
    for part in (*SOURCES, *HEADERS):
        digest.update(part.encode() + b"\0" + (PACKAGE / part).read_bytes() + b"\0")
    digest.update("|".join((platform.machine(), *flags, *LIBS)).encode())
    return digest.hexdigest()


def build_prebuilt(directory: Path = PREBUILT) -> Path:
    """The library compiled into `directory` with its stamp (the hash of what it was built
    from), for a wheel: `setup.py`'s build runs this. Raises OSError as `build` does."""
    built = build(directory)
    target, stamp = directory / PREBUILT_NAME, directory / STAMP_NAME
    stamp.unlink(missing_ok=True)  # no stamp of an earlier build beside the new library
    os.replace(built, target)
    stamp.write_text(_sources_digest(FLAGS) + "\n")  # last: a stamp cut short names nothing
    return target


def prebuilt(directory: Path = PREBUILT) -> Path | None:
    """The library built at install, where its stamp names these sources and flags; None
    where there is none or it was built from other sources."""
    target, stamp = directory / PREBUILT_NAME, directory / STAMP_NAME
    try:
        said = stamp.read_text().strip()
    except OSError:
        return None
    return target if target.is_file() and said == _sources_digest(FLAGS) else None


def build(directory: Path | None = None, sanitize: bool = False) -> Path:
    """The library compiled (or found compiled) in `directory` (default: `cache_dir()`);
    sanitize: with AddressSanitizer and UndefinedBehaviorSanitizer, for the tests. Raises
    OSError naming the compiler's complaint where it cannot be built."""
    cc = compiler()
    if cc is None:
        raise OSError("no C compiler found (set CC, or install gcc)")
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True,
                                 timeout=30, check=True).stdout.splitlines()[0]  # fmt: skip
    except (OSError, subprocess.SubprocessError, IndexError) as e:
        raise OSError(f"the C compiler {cc} does not run: {e}") from e
    flags = (*FLAGS, *(SANITIZE if sanitize else ()))
    digest = hashlib.sha256((_sources_digest(flags) + version).encode()).hexdigest()
    directory = directory or cache_dir()
    target = directory / f"libqkv-{'asan-' if sanitize else ''}{digest[:16]}.so"
    if target.exists():
        return target
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=directory, prefix=".building-") as scratch:
        made = Path(scratch) / target.name
        command = [cc, *flags, f"-I{PACKAGE / 'native'}",
                   *(str(PACKAGE / s) for s in SOURCES), "-o", str(made), *LIBS]  # fmt: skip
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=300)
        except (OSError, subprocess.SubprocessError) as e:
            raise OSError(f"{cc} could not build qkv's kernels: {e}") from e
        if done.returncode != 0:
            said = (done.stderr.strip().splitlines() or ["(it said nothing)"])[0]
            raise OSError(f"{cc} could not build qkv's kernels: {said}")
        os.replace(made, target)  # whole or not at all: another process may load it now
    return target


def _loaded() -> tuple[ctypes.CDLL | None, str]:
    """The library and "", or None and why not; QKV_NATIVE=0 is read at every call, so that a
    program (or a test) can turn the kernels off for the models it makes next."""
    if os.environ.get("QKV_NATIVE", "1").strip() == "0":
        return None, "QKV_NATIVE=0 asks for torch's kernels"
    return _built()


@functools.cache
def _built() -> tuple[ctypes.CDLL | None, str]:
    if platform.machine() not in ("x86_64", "AMD64"):
        return None, f"qkv's kernels are written for x86-64 CPUs; this is {platform.machine()}"
    try:
        lib = ctypes.CDLL(str(prebuilt() or build()))
    except OSError as e:
        return None, str(e)
    _declare(lib)
    return lib, ""


def library() -> ctypes.CDLL | None:
    """The loaded library, built on first use; None where it cannot be (`why_not`)."""
    return _loaded()[0]


def why_not() -> str | None:
    """Why there is no native library in this process (None: there is one)."""
    return _loaded()[1] or None


def _declare(lib: ctypes.CDLL) -> None:
    """The types of the functions every caller shares; each kernel's own module declares its
    own with `declare`."""
    declare(lib, "qkv_quant_variants", ctypes.c_int)
    declare(lib, "qkv_pool_check", ctypes.c_int, ctypes.c_void_p, ctypes.c_int)
    declare(lib, "qkv_pool_linger", ctypes.c_int, ctypes.c_int)
    declare(lib, "qkv_runs_check", ctypes.c_int, ctypes.c_int64, ctypes.c_int, ctypes.c_int,
            ctypes.c_void_p)  # fmt: skip


@contextlib.contextmanager
def lingering() -> Iterator[None]:
    """While this runs, the kernels' workers wait spinning 1 ms after each task before they
    sleep, not 50 us: a decoder's tokens come one after another, and Python's work between
    two of them is longer than 50 us, and a worker slept and was woken once a token.
    Nested and concurrent decoders count; nothing where there is no library."""
    lib = library()
    if lib is None:
        yield
        return
    lib.qkv_pool_linger(1)
    try:
        yield
    finally:
        lib.qkv_pool_linger(-1)


def declare(lib: ctypes.CDLL, name: str, result, *arguments) -> None:
    """Give the library's function `name` its C result and argument types (ctypes then
    converts and checks each call's arguments: pointers as c_void_p, sizes as c_int64)."""
    function = getattr(lib, name)
    function.restype = result
    function.argtypes = list(arguments)


def variants(lib: ctypes.CDLL | None = None) -> tuple[str, ...]:
    """The kernel variants this CPU runs, lowest first (by cpuid, in the library)."""
    lib = lib or library()
    if lib is None:
        return ()
    mask = lib.qkv_quant_variants()
    return tuple(name for i, name in enumerate(VARIANTS) if mask >> i & 1)


def chosen_variant(lib: ctypes.CDLL | None = None) -> tuple[int, str]:
    """(index, why) of the variant the kernels run: the best this CPU has, or the one
    `QKV_NATIVE_ISA` names (a ValueError where the CPU lacks it or it is no variant)."""
    having = variants(lib)
    asked = os.environ.get("QKV_NATIVE_ISA", "").strip().lower()
    if asked:
        if asked not in VARIANTS:
            raise ValueError(f"QKV_NATIVE_ISA={asked!r} is not a variant; one of {VARIANTS}")
        if asked not in having:
            raise ValueError(f"QKV_NATIVE_ISA={asked!r}: this CPU runs {', '.join(having)}")
        return VARIANTS.index(asked), f"{asked}, as QKV_NATIVE_ISA asks"
    best = having[-1]
    return VARIANTS.index(best), (
        f"{best}, the best of the variants this CPU runs ({', '.join(having)})"
    )


def describe() -> str:
    """One line for `qkv backends --verbose`: the library and the variant, or why none."""
    lib = library()
    if lib is None:
        return f"native kernels: off ({why_not()}); torch's kernels run instead"
    try:
        _, why = chosen_variant(lib)
    except ValueError as e:
        return f"native kernels: built, but {e}"
    installed = prebuilt()
    if installed:
        return f"native kernels: {why}; built at install ({installed})"
    return f"native kernels: {why}; built with {compiler()} in {build().parent}"

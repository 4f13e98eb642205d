"""Running a script of the native kernels under AddressSanitizer and UBSan: the sanitizers'
runtime preloaded into a fresh Python (numpy and ctypes, no torch), the library built with
`native.build(..., sanitize=True)`. Shared by the kernels' sanitizer tests."""

from __future__ import annotations

import subprocess
import sys


def run_sanitized(script: str, compiler: str = "gcc") -> None:
    """Run `script` (which prints "clean" at its end) under the sanitizers; an assertion
    error with the sanitizer's report where it finds anything or the script fails."""
    asan = subprocess.run([compiler, "-print-file-name=libasan.so"], capture_output=True,
                          text=True, check=True).stdout.strip()  # fmt: skip
    env = {"LD_PRELOAD": asan, "ASAN_OPTIONS": "detect_leaks=0", "PATH": "/usr/bin:/bin",
           "UBSAN_OPTIONS": "halt_on_error=1:print_stacktrace=1"}  # fmt: skip
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env=env, timeout=120)  # fmt: skip
    assert done.returncode == 0 and "clean" in done.stdout, done.stderr[-2000:]
    assert "runtime error" not in done.stderr

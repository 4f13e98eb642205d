"""Helpers for the hostile-input tests: the `qkv` command as a real process, under a memory
limit, and the one shape every refusal takes on the command line.

`run_qkv(..., memory_gb=4)` sets RLIMIT_AS (what `ulimit -v` sets) in the child before it
starts, so a case that would allocate without bound fails there, fast, with a MemoryError
or a killed process, instead of hurting the machine; the test then fails too, since it
asks for the one-line error.
"""

from __future__ import annotations

import ctypes
import os
import resource
import subprocess
import sys
from pathlib import Path

# importing torch and loading a small model maps about 2 GiB of address space
DEFAULT_MEMORY_GB = 4


def run_qkv(
    *args: str | os.PathLike,
    memory_gb: float | None = DEFAULT_MEMORY_GB,
    timeout: float = 120,
    cwd: str | os.PathLike | None = None,
    env: dict[str, str] | None = None,
    command: list[str] | None = None,
    as_user: bool = False,
) -> subprocess.CompletedProcess:
    """`python -m qkv.cli ARGS` (or `command`) in a child process, its address space capped
    at memory_gb; with as_user, as a user whom file modes bind (see `as_a_user`)."""

    def limit() -> None:
        if memory_gb is not None:
            size = int(memory_gb * 2**30)
            resource.setrlimit(resource.RLIMIT_AS, (size, size))
        if as_user:
            as_a_user()

    return subprocess.run(
        command or [sys.executable, "-m", "qkv.cli", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
        env={**os.environ, **(env or {})},
        preexec_fn=limit,
    )


def as_a_user() -> None:
    """In a child before it starts: for root, drop CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH
    from the capabilities every program it runs may have, so a chmod binds it as it binds
    any user (test machines often run as root, which reads and writes through any mode)."""
    if os.geteuid() == 0:
        libc = ctypes.CDLL(None, use_errno=True)
        for capability in (1, 2):  # PR_CAPBSET_DROP (24) of DAC_OVERRIDE, DAC_READ_SEARCH
            if libc.prctl(24, capability, 0, 0, 0) != 0:
                os._exit(99)


def assert_one_line_error(result: subprocess.CompletedProcess, *says: str) -> str:
    """The command refused: exit code 2, one line on stderr beginning 'error: ', containing
    each of `says`, and no traceback. Returns that line."""
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2, (result.returncode, result.stderr[-3000:])
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr[-3000:]
    for part in says:
        assert part in lines[0], (part, lines[0])
    return lines[0]


def leftovers(folder: str | os.PathLike) -> list[str]:
    """Every path under folder, relative, sorted: what a failed command left behind."""
    root = Path(folder)
    return sorted(str(path.relative_to(root)) for path in root.rglob("*"))

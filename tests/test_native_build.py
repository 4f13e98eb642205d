"""qkv's native kernels built into a wheel (`pip wheel .`, setup.py): the wheel carries the
library and its stamp, and a process that imports qkv from the wheel loads it with no
compiler at all; a stamp of other sources is not trusted."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from qkv import native

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(native.library() is None, reason="no native kernels here")


def test_a_wheel_carries_the_kernels_and_loads_them_without_a_compiler(tmp_path):
    made = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "--no-build-isolation",
         "--quiet", "-w", str(tmp_path / "wheel")],
        capture_output=True, text=True, timeout=600, cwd=tmp_path,
    )  # fmt: skip
    assert made.returncode == 0, made.stderr[-2000:]
    (wheel,) = (tmp_path / "wheel").glob("qkv-*.whl")
    site = tmp_path / "site"
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        assert "qkv/native/built/libqkv.so" in names and "qkv/native/built/libqkv.stamp" in names
        z.extractall(site)
    cache = tmp_path / "cache"
    script = (
        "from qkv import native\n"
        "print(native.prebuilt(), native.library() is not None, native.compiler())\n"
        "print(native.describe())\n"
    )
    env = {**os.environ, "PYTHONPATH": str(site), "XDG_CACHE_HOME": str(cache),
           "CC": str(tmp_path / "no-such-compiler")}  # fmt: skip
    env.pop("QKV_NATIVE", None)
    ran = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         env=env, timeout=120, check=True)  # fmt: skip
    first, described = ran.stdout.splitlines()[:2]
    assert first.startswith(str(site / "qkv" / "native" / "built" / "libqkv.so"))
    assert first.endswith(f"True {tmp_path / 'no-such-compiler'}")  # loaded, no compiler run
    assert "built at install" in described and not cache.exists()  # nothing built at run time
    # the stamp names the sources: a library stamped with other sources is not loaded
    built = site / "qkv" / "native" / "built"
    assert native.prebuilt(built) == built / "libqkv.so"
    (built / "libqkv.stamp").write_text("0" * 64 + "\n")
    assert native.prebuilt(built) is None
    (built / "libqkv.stamp").unlink()
    assert native.prebuilt(built) is None

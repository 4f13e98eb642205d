"""The wheel's build: setuptools' own, and qkv's native kernels compiled into the package
where a C compiler is there (`qkv.native.build_prebuilt`); the metadata is pyproject.toml's.

An editable install (`pip install -e .`, what `make` does) leaves the library to the first
use, which builds it into the user's cache (`make` runs `python -m qkv.native` for that). A
build that cannot compile it still makes the wheel: qkv then builds on first use, or runs
torch's kernels and says why.
"""

import importlib.util
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py


def _native():
    """qkv/native/__init__.py alone (it imports nothing of qkv, so no torch is needed here)."""
    path = Path(__file__).parent / "src" / "qkv" / "native" / "__init__.py"
    spec = importlib.util.spec_from_file_location("qkv_native_at_build", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class BuildWithKernels(build_py):
    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):
            return
        target = Path(self.build_lib) / "qkv" / "native" / "built"
        try:
            built = _native().build_prebuilt(target)
        except OSError as e:
            print(
                f"qkv: native kernels not built into the wheel ({e}); built on first use",
                file=sys.stderr,
            )
            return
        print(f"qkv: native kernels built into the wheel ({built.name})", file=sys.stderr)


setup(cmdclass={"build_py": BuildWithKernels})

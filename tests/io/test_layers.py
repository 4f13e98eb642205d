"""Data flows one way: nothing in qkv.io imports a layer above it (train, pretrained,
inspect, generate, viz, serve, cli) or beside it (data, which itself writes through io)."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import qkv.io

IO = Path(qkv.io.__file__).parent
ABOVE = ("data", "train", "pretrained", "inspect", "generate", "viz", "serve", "cli")
LAZY = ("load", "Pretrained", "trace")  # `from qkv import load` imports qkv.pretrained


def imported(tree: ast.AST) -> list[str]:
    """Every qkv module a file imports, at the top or inside a function."""
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
            if node.module == "qkv":
                names += [f"qkv.{alias.name}" for alias in node.names]
    return names


def is_above(module: str) -> bool:
    parts = module.split(".")
    return parts[0] == "qkv" and len(parts) > 1 and (parts[1] in ABOVE or parts[1] in LAZY)


def test_no_module_under_qkv_io_imports_a_layer_above():
    files = sorted(IO.rglob("*.py"))
    assert IO / "families" / "bert.py" in files and IO / "load.py" in files
    wrong = {
        str(path.relative_to(IO)): bad
        for path in files
        if (bad := [m for m in imported(ast.parse(path.read_text())) if is_above(m)])
    }
    assert wrong == {}


def test_the_check_sees_imports_inside_functions():
    tree = ast.parse(
        "def f():\n    from qkv.train.config import RunConfig\n    from qkv import load"
    )
    assert [m for m in imported(tree) if is_above(m)] == ["qkv.train.config", "qkv.load"]


def test_loading_a_run_folder_through_io_imports_nothing_above(tmp_path):
    """The run-time check: read a training run's checkpoint with qkv.io alone."""
    from qkv.data import word_tokenizer
    from qkv.io.hf_folder import save_folder
    from qkv.io.run_config import RunConfig
    from qkv.io.runs import CONFIG, checkpoint_folder
    from qkv.train.arch import build_model, hf_config

    config = RunConfig().updated({"model": {"layers": 1, "heads": 2, "width": 16}})
    tokenizer = word_tokenizer(["river", "bank", "money"], style="gpt")
    hf = hf_config(config, tokenizer)
    model, family, model_config = build_model(config, hf)
    save_folder(checkpoint_folder(tmp_path, 3), model, family, model_config, hf, tokenizer)
    (tmp_path / CONFIG).write_text(config.to_toml())
    code = (
        "import json, sys\n"
        "from qkv.io.load import load_source\n"
        f"loaded = load_source({str(tmp_path)!r})\n"
        "above = sorted(m for m in sys.modules if m.split('.')[:2][-1] in "
        f"{ABOVE!r} and m.startswith('qkv.'))\n"
        "print(json.dumps([loaded.family.name, str(loaded.run), above]))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(IO.parents[1])}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == ["gpt2", str(tmp_path), []]

"""The library changes nothing that belongs to the whole process: matplotlib's backend and
settings stay the program's own choice (qkv draws on Figures of its own, never pyplot), and
so does the garbage collector (the `qkv` program freezes what its imports made; a program
that imports the library keeps its collector as it was)."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

SRC = Path(__file__).parents[1] / "src"

# Run in a fresh process, since the point is what a program that chose its own backend
# (here "svg") finds after qkv has drawn: every plotting function of the library, once.
DRAW_EVERYTHING = """
import gc, json, sys
from pathlib import Path

import matplotlib
matplotlib.use("svg")
matplotlib.rcParams["lines.linewidth"] = 3.25
import numpy as np
import torch

from qkv.inspect.probe import Probe
from qkv.viz.plots import probe_plot
from qkv.train.plot import plot_run
from qkv.viz.heatmap import head_heatmap, model_view

out = Path(sys.argv[1])
settings = dict(matplotlib.rcParams)

run = out / "run"
run.mkdir()
lines = [{"step": s, "loss": 3.0 / s, "lr": 1e-3, **({"val_loss": 3.1 / s} if s % 2 else {})}
         for s in range(1, 6)]
(run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\\n" for r in lines))
drawn = [plot_run(run)]

vectors = torch.randn(3, 4, 8)
unit = torch.nn.functional.normalize(vectors, dim=-1)
probe = Probe(word="bank", sentences=["a bank", "the bank", "my bank", "our bank"],
              labels=["river", "money", "river", "money"],
              layers=["embeddings", "layer 0", "layer 1"],
              similarity=unit @ unit.transpose(1, 2), vectors=vectors,
              accuracy=[0.5, 0.75, 1.0], separation=[0.0, 0.1, 0.2])
drawn.append(probe_plot(probe, out / "probe.png"))

weights = np.random.default_rng(0).dirichlet(np.ones(5), size=(2, 3, 5))  # (L, H, T, T)
tokens = ["the", "bank", "of", "the", "river"]
drawn.append(head_heatmap(weights[0, 1], tokens, out / "head.png"))
drawn.append(model_view(weights, tokens, out / "all.png"))

assert all(p.stat().st_size > 0 and p.read_bytes()[:4] == b"\\x89PNG" for p in drawn), drawn
print(json.dumps({
    "backend": matplotlib.get_backend(),
    "settings_kept": dict(matplotlib.rcParams) == settings,
    "changed": sorted(k for k, v in matplotlib.rcParams.items() if settings[k] != v),
    "pyplot_imported": "matplotlib.pyplot" in sys.modules,
    "collector_kept": gc.isenabled() and gc.get_freeze_count() == 0,
}))
"""


def test_drawing_leaves_matplotlibs_backend_and_settings_as_they_were(tmp_path):
    environment = {k: v for k, v in os.environ.items() if k != "MPLBACKEND"}
    environment["PYTHONPATH"] = str(SRC)
    result = subprocess.run(
        [sys.executable, "-c", DRAW_EVERYTHING, str(tmp_path)], capture_output=True, text=True,
        timeout=300, env=environment,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    found = json.loads(result.stdout.splitlines()[-1])
    assert found == {
        "backend": "svg",
        "settings_kept": True,
        "changed": [],
        "pyplot_imported": False,
        "collector_kept": True,
    }


def test_the_qkv_program_freezes_what_its_imports_made():
    """`qkv.cli.main` is a program of its own: it moves its imports' objects out of the
    collector's full passes (gc.freeze), as `import qkv` alone never does."""
    program = (
        "import gc, sys\n"
        "import qkv.cli\n"
        "before = gc.get_freeze_count()\n"
        "sys.argv = ['qkv', 'version']\n"
        "try:\n"
        "    qkv.cli.main()\n"
        "except SystemExit:\n"
        "    pass\n"
        "print(before, gc.get_freeze_count() > 10_000, gc.isenabled())\n"
    )
    result = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True,
                            timeout=300, env=os.environ | {"PYTHONPATH": str(SRC)})  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1] == "0 True True"


def matplotlib_globals(tree: ast.AST) -> list[str]:
    """Where a module calls matplotlib.use or imports pyplot (by any spelling)."""
    found = []
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names if a.name.startswith("matplotlib.pyplot")]
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.module.startswith("matplotlib.pyplot"):
                names = [node.module]
            elif node.module == "matplotlib":
                names = [f"matplotlib.{a.name}" for a in node.names if a.name in ("pyplot", "use")]
        elif (
            isinstance(node, ast.Attribute)
            and node.attr in ("use", "pyplot")
            and isinstance(node.value, ast.Name)
            and node.value.id in ("matplotlib", "mpl")
        ):
            names = [f"{node.value.id}.{node.attr}"]
        found += [f"line {node.lineno}: {name}" for name in names]
    return found


def test_no_module_of_the_library_sets_a_backend_or_imports_pyplot():
    modules = sorted((SRC / "qkv").rglob("*.py"))
    assert len(modules) > 50
    offenders = {}
    for path in modules:
        found = matplotlib_globals(ast.parse(path.read_text(encoding="utf-8")))
        if found:
            offenders[str(path.relative_to(SRC))] = found
    assert offenders == {}


def test_the_check_finds_each_way_of_writing_it():
    for source in (
        "import matplotlib\nmatplotlib.use('Agg')",
        "import matplotlib as mpl\nmpl.use('Agg')",
        "from matplotlib import use\nuse('Agg')",
        "import matplotlib.pyplot as plt",
        "from matplotlib import pyplot",
        "from matplotlib.pyplot import subplots",
    ):
        assert matplotlib_globals(ast.parse(source)), source
    assert matplotlib_globals(ast.parse("from matplotlib.figure import Figure")) == []

"""Data flows one way, in the order docs/design.md states: no module of qkv imports a package
above its own floor, no two files of different packages import each other in a circle, an
import of qkv's own code inside a function says why on its line, and no file is over 500 lines.

The imports are read from the source with `ast`, at the top of a file and inside functions
alike; only the ones under `if TYPE_CHECKING:` (names for annotations, never run) are left out.
"""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

import qkv

SRC = Path(qkv.__file__).parent
DESIGN = SRC.parents[1] / "docs" / "design.md"

# Bottom to top. A package may import its own modules and those of the floors below it; two
# packages on one floor do not import each other. docs/design.md draws the same list.
FLOORS = (
    ("device", "version", "views", "native"),
    ("attention",),
    ("nn",),
    ("models",),
    ("io",),
    ("data",),
    ("generate", "embed"),
    ("inspect",),
    ("viz",),
    ("pretrained",),
    ("train",),
    ("hf", "serve"),
    ("cli",),
    ("",),  # the `qkv` package itself: `qkv.load`, `qkv.trace`... the public facade
)
FLOOR = {name: i for i, names in enumerate(FLOORS) for name in names}
LONGEST = 500


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package(module: str) -> str:
    """The part of qkv a module belongs to: 'attention' for qkv.attention.flash.kernels,
    '' for qkv itself."""
    return module.split(".")[1] if "." in module else ""


def checked_only(tree: ast.Module) -> set[int]:
    """ids of the nodes under `if TYPE_CHECKING:`."""
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            ids |= {id(sub) for stmt in node.body for sub in ast.walk(stmt)}
    return ids


def imports(path: Path, root: Path) -> list[tuple[str, int, bool]]:
    """(module of qkv imported, line, inside a function) for every import in one file."""
    here = module_name(path, root)
    tree = ast.parse(path.read_text())
    typing = checked_only(tree)
    inner = {
        id(sub)
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        for sub in ast.walk(node)
        if sub is not node
    }
    found = []
    for node in ast.walk(tree):
        if id(node) in typing:
            continue
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = here.split(".")[: (len(here.split(".")) - node.level + 1)]
                if path.name != "__init__.py":
                    parent = here.split(".")[: len(here.split(".")) - node.level]
                base = ".".join(parent + ([base] if base else []))
            names = [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            if name == root.name or name.startswith(root.name + "."):
                found.append((existing(name, root), node.lineno, id(node) in inner))
    return found


def existing(name: str, root: Path) -> str:
    """The module a name is imported from: `qkv.load` is the package `qkv`'s."""
    while "." in name:
        path = root.parent.joinpath(*name.split("."))
        if path.with_suffix(".py").is_file() or (path / "__init__.py").is_file():
            break
        name = name.rsplit(".", 1)[0]
    return name


def files(root: Path) -> list[Path]:
    return sorted(root.rglob("*.py"))


def upward(root: Path) -> list[str]:
    wrong = []
    for path in files(root):
        here = module_name(path, root)
        for name, line, _ in imports(path, root):
            mine, theirs = package(here), package(name)
            if mine == theirs:
                continue
            if theirs not in FLOOR or mine not in FLOOR:
                wrong.append(f"{path.relative_to(root)}:{line} {name}: a package not on a floor")
            elif FLOOR[theirs] >= FLOOR[mine]:
                wrong.append(f"{path.relative_to(root)}:{line} imports {name}, not below it")
    return wrong


def cycles_across_packages(root: Path) -> list[list[str]]:
    """Strongly connected sets of files that span more than one package."""
    modules = {module_name(path, root): path for path in files(root)}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for m, path in modules.items():
        for name, _, _ in imports(path, root):
            while name not in modules and "." in name:
                name = name.rsplit(".", 1)[0]
            if name in modules and name != m:
                graph[m].add(name)
    order, low, stack, on, found, count = {}, {}, [], set(), [], [0]

    def visit(node: str) -> None:  # Tarjan's strongly connected components
        order[node] = low[node] = count[0]
        count[0] += 1
        stack.append(node)
        on.add(node)
        for nxt in graph[node]:
            if nxt not in order:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on:
                low[node] = min(low[node], order[nxt])
        if low[node] == order[node]:
            group = []
            while True:
                top = stack.pop()
                on.discard(top)
                group.append(top)
                if top == node:
                    break
            if len({package(m) for m in group}) > 1:
                found.append(sorted(group))

    for node in graph:
        if node not in order:
            visit(node)
    return found


def unexplained_inner_imports(root: Path) -> list[str]:
    """Imports of qkv's own code inside a function, outside the CLI, with no `#` reason on
    their line or the line above."""
    wrong = []
    for path in files(root):
        if package(module_name(path, root)) == "cli":
            continue  # the CLI imports on use: `qkv --help` starts without torch's models
        lines = path.read_text().splitlines()
        for _, line, inner in imports(path, root):
            said = "#" in lines[line - 1] or lines[line - 2].strip().startswith("#")
            if inner and not said:
                wrong.append(f"{path.relative_to(root)}:{line} {lines[line - 1].strip()}")
    return sorted(set(wrong))


def test_every_package_sits_on_a_floor_of_the_design():
    present = {package(module_name(path, SRC)) for path in files(SRC)}
    assert present <= set(FLOOR), f"add {present - set(FLOOR)} to FLOORS and docs/design.md"


def test_no_module_imports_a_package_above_or_beside_its_own():
    assert upward(SRC) == []


def test_no_import_cycle_spans_two_packages():
    assert cycles_across_packages(SRC) == []


def test_an_import_inside_a_function_says_why():
    assert unexplained_inner_imports(SRC) == []


def test_no_file_is_longer_than_one_sitting():
    lines = {str(path.relative_to(SRC)): len(path.read_text().splitlines()) for path in files(SRC)}
    long = {name: n for name, n in lines.items() if n > LONGEST}
    assert long == {}


def test_the_design_document_draws_these_floors():
    """docs/design.md's table of floors is FLOORS, row by row."""
    rows = re.findall(r"^\| (\d+) \| ([^|]*) \|", DESIGN.read_text(), re.M)
    drawn = [
        tuple(sorted(name.strip("/").removesuffix(".py").replace("qkv/__init__", "")
                     for name in re.findall(r"`([^`]+)`", names)))
        for _, names in rows
    ]  # fmt: skip
    assert [int(number) for number, _ in rows] == list(range(len(FLOORS)))
    assert drawn == [tuple(sorted(names)) for names in FLOORS]


def test_what_the_design_document_names_is_there():
    """Every file and every module's name docs/design.md points to exists."""
    text = DESIGN.read_text()
    missing = []
    for path in re.findall(r"`((?:src/qkv/|tests/)?[\w/]+\.py)`", text):
        if "/" not in path:  # a file named in its package's row, e.g. `stacks.py` in models
            found = any(SRC.rglob(path))
        else:
            root = SRC.parents[1] if path.startswith(("src/", "tests/")) else SRC
            root = SRC.parent if path.startswith("qkv/") else root
            found = (root / path).is_file()
        if not found:
            missing.append(path)
    for module, name in re.findall(r"`(\w+(?:/\w+)*)\.(\w+)`", text):
        if name in ("c", "h"):  # a native source, e.g. `nn/quant.c`
            if not (SRC / f"{module}.{name}").is_file():
                missing.append(f"{module}.{name}")
            continue
        if name == "py" or not (SRC / f"{module}.py").is_file():
            continue  # a file, checked above, or a name that is not a module's
        if not hasattr(importlib.import_module("qkv." + module.replace("/", ".")), name):
            missing.append(f"{module}.{name}")
    assert missing == []


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """A small qkv whose floors are broken on purpose."""
    root = tmp_path / "qkv"
    for name, text in {
        "__init__.py": "",
        "attention/__init__.py": "",
        "attention/eager.py": "def f():\n    from qkv.viz import page\n",
        "viz/__init__.py": "",
        "viz/page.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
        "    from qkv.cli import app\nfrom . import helpers\nfrom qkv.attention.eager import f\n",
        "viz/helpers.py": "def g():\n    # matplotlib comes with it\n    from qkv.nn import x\n",
        "nn/__init__.py": "from ..inspect import y\n",
        "inspect/__init__.py": "",
        "toys/__init__.py": "import qkv.nn\n",
        "train.py": "from qkv import hf_folder\n",
    }.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_the_checks_see_what_they_are_for(tree: Path):
    assert upward(tree) == [
        "attention/eager.py:2 imports qkv.viz.page, not below it",
        "nn/__init__.py:1 imports qkv.inspect, not below it",
        "toys/__init__.py:1 qkv.nn: a package not on a floor",
        "train.py:1 imports qkv, not below it",
    ]
    assert cycles_across_packages(tree) == [["qkv.attention.eager", "qkv.viz.page"]]
    assert unexplained_inner_imports(tree) == ["attention/eager.py:2 from qkv.viz import page"]

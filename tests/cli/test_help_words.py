"""Every verb's --help reads as words: no literal {placeholder} (typer wrote a required
argument as "{text}"), each argument named in capitals. And `make demo`'s set-up says what it
installs before each pip step, with pip itself quiet."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import click
import pytest
import typer
from typer.testing import CliRunner

from qkv.cli import app

COMMAND = typer.main.get_command(app)
VERBS = [[]] + [
    [name, *([sub] if sub else [])]
    for name, verb in COMMAND.commands.items()
    for sub in (list(verb.commands) if isinstance(verb, click.Group) else [None])
]
PLACEHOLDER = re.compile(r"\{[A-Za-z_][A-Za-z_0-9]*\}")
REPO = Path(__file__).parents[2]


@pytest.mark.parametrize("verb", VERBS, ids=lambda v: " ".join(v) or "qkv")
def test_no_help_has_a_literal_placeholder(verb):
    done = CliRunner().invoke(app, [*verb, "--help"], env={"COLUMNS": "200"})
    assert done.exit_code == 0, done.output
    assert PLACEHOLDER.findall(done.output) == [], done.output


def test_the_required_arguments_are_named_in_capitals():
    for verb, name in (("explain", "TEXT"), ("probe", "WORD"), ("generate", "PROMPT"),
                       ("atlas", "CORPUS"), ("plot", "RUN")):  # fmt: skip
        usage = CliRunner().invoke(app, [verb, "--help"], env={"COLUMNS": "200"}).output
        assert re.search(rf"Usage: \S+ {verb} \[OPTIONS\] {name}\b", usage), usage


def test_the_set_up_says_what_it_installs_before_each_pip_step():
    dry = subprocess.run(["make", "-n", "-B", ".venv/.installed", ".venv/.installed-bench"],
                         cwd=REPO, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert dry.returncode == 0, dry.stderr
    lines = dry.stdout.splitlines()
    pips = [i for i, line in enumerate(lines) if "pip install" in line]
    assert len(pips) >= 3
    for i in pips:
        assert "--quiet" in lines[i]
        said = lines[i - 1]
        assert said.startswith("echo ") and "installing" in said, said
        # it names what the step installs: torch, a requirements file, or the packages
        named = re.findall(r"torch==\S+|-r \S+|[\w-]+==[\w.]+", lines[i])
        assert named and all(n.split("==")[0].removeprefix("-r ") in said for n in named), said
    makefile = (REPO / "Makefile").read_text()
    assert not re.search(r"^\t#", makefile, re.M)  # comments in a recipe are printed

"""Hostile input on the command line (issue 14): whatever a user gives, `qkv` answers in one
line on stderr and exit code 2, in bounded memory, or it does what was asked; never a
traceback for the user's mistake, never a wrong reading in silence.

Each case is the real `qkv` process under a memory limit (tests/hostile.py). The cases are
examples of classes each handled once: `qkv.cli.errors.user_errors` (a ValueError, a file
that cannot be read or written, memory that ran out), `check_out` (an --out that cannot be
written, refused before the model loads), `qkv.attention.index_text.parse_indices` (ranges
checked before they are listed) and `qkv.inspect.sentences_file.read_sentences` (one form of
line throughout a --sentences file).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hostile import assert_one_line_error, run_qkv
from qkv.io.embedded import embedded_path


def minilm_copy(folder: Path) -> Path:
    """The embedded MiniLM's folder, its files linked, not copied (90 MB)."""
    folder.mkdir()
    for file in embedded_path("minilm").iterdir():
        (folder / file.name).symlink_to(file)
    return folder


def model_config_is_a_folder(tmp: Path):
    model = minilm_copy(tmp / "model")
    (model / "config.json").unlink()
    (model / "config.json").mkdir()  # a file qkv must read that cannot be read, even by root
    return ["embed", "hi", "--model", model], ["cannot read", f"{model}/config.json", "directory"]


def model_folder_unreadable(tmp: Path):
    model = minilm_copy(tmp / "model")
    model.chmod(0)
    return ["embed", "hi", "--model", model], ["cannot read", str(model), "Permission denied"]


def out_folder_read_only(tmp: Path):
    (tmp / "ro").mkdir()
    (tmp / "ro").chmod(0o555)
    out = tmp / "ro" / "x.html"
    return ["show", "the river bank", "--out", out], ["cannot write", str(out)]


def out_in_proc(tmp: Path):  # /proc takes no new files, even from root
    return ["show", "the river bank", "--out", "/proc/qkv-x.html"], [
        "cannot write /proc/qkv-x.html"
    ]


def png_in_a_folder_that_cannot_be_made(tmp: Path):
    # qkv makes the folders an --out needs (as every writer of qkv does); where it cannot,
    # it says which folder
    return ["probe", "bank", "--out", "/proc/qkv-missing/x.png"], [
        "cannot", "/proc", "/proc/qkv-missing/x.png"
    ]  # fmt: skip


def png_under_a_file(tmp: Path):
    (tmp / "notes.txt").write_text("a file, not a folder\n")
    out = tmp / "notes.txt" / "x.png"
    return ["probe", "bank", "--out", out], ["cannot write", str(out), "not a folder"]


def why_png_under_a_file(tmp: Path):  # refused before the model loads: no work lost
    (tmp / "notes.txt").write_text("a file, not a folder\n")
    out = tmp / "notes.txt" / "x.png"
    args = ["why", "the river bank", "--query", "bank", "--key", "river", "--out", out]
    return args, ["cannot write", str(out), "not a folder"]


def why_word_twice(tmp: Path):
    args = ["why", "the bank by the bank", "--query", "bank", "--key", "the"]
    args += ["--out", tmp / "x.png"]
    return args, ["'bank' occurs 2 times in the text", "bank#1"]


def sentences_too_big_for_memory(tmp: Path):
    huge = tmp / "huge.txt"
    with open(huge, "wb") as file:
        file.truncate(8 * 2**30)  # sparse: 8 GiB to read, no disk used
    return ["probe", "bank", "--sentences", huge], ["out of memory"]


def model_too_big_for_memory(tmp: Path):
    # run under MEMORY_GB's limit: the start and 0.35 GiB, or 1 GiB if that is more
    return ["generate", "hi", "-n", "1", "--model", "smollm2"], ["out of memory", "allocate"]


def layers_range_of_a_billion(tmp: Path):
    args = ["show", "the river bank", "--out", tmp / "x.png", "--layers", "0-1000000000"]
    return args, ["layer 1000000000 is out of range", "6 layers"]


def heads_repeated(tmp: Path):  # was 3 copies of head 0 in each of 2 copies of layer 1
    args = ["hide", "the river bank", "--key", "river", "--heads", "0,0,0", "--layers", "1,1"]
    return args, ["layer 1 is asked for twice", "name each layer once"]


def layers_overlapping(tmp: Path):  # 3,000 parts of repeats were 18,000 rows
    args = ["show", "the river bank", "--out", tmp / "x.png", "--layers", ",".join(["0-5"] * 3000)]
    return args, ["layer 0 is asked for twice"]


def heads_range_backwards(tmp: Path):  # was "no heads chosen": 3-1 read as no heads at all
    args = ["show", "the river bank", "--out", tmp / "x.png", "--layers", "0", "--heads", "3-1"]
    return args, ["--heads 3-1 runs backwards", "1-3"]


def serve_without_its_extra(tmp: Path):
    # The shared environment has fastapi installed; a fastapi that cannot be imported, first on
    # the path, stands in for the missing package.
    fake = tmp / "no-fastapi" / "fastapi"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'fastapi'\", name='fastapi')\n"
    )
    path = os.pathsep.join(filter(None, [str(fake.parent), os.environ.get("PYTHONPATH")]))
    return ["serve"], ["fastapi", "pip install 'qkv[serve]'"], {"PYTHONPATH": path}


def generate_an_empty_prompt(tmp: Path):
    return ["generate", ""], ["the prompt is empty", "give the text to continue"]


def sentences_is_a_folder(tmp: Path):
    return ["probe", "bank", "--sentences", tmp], [str(tmp), "is a folder", "text file"]


def probe_occurrence_zero(tmp: Path):
    return ["probe", "bank#0"], ["'bank#0'", "occurrences count from 1"]


def seed_past_64_bits(tmp: Path):
    args = ["generate", "hi", "--temperature", "1", "--seed", "99999999999999999999"]
    return args, ["seed", "0 to 2**64-1", "99999999999999999999"]


def sentences_with_mixed_columns(tmp: Path):
    file = tmp / "senses.txt"
    file.write_text("river\tThe bank of the river\n\nThe bank lent me money\n")
    return ["probe", "bank", "--sentences", file], [str(file), "line 3", "line 1 has 2"]


def sentences_file_empty(tmp: Path):
    file = tmp / "senses.txt"
    file.write_text("\n  \n")
    return ["probe", "bank", "--sentences", file], [str(file), "is empty"]


CASES = {
    case.__name__: case
    for case in (
        model_config_is_a_folder, model_folder_unreadable, out_folder_read_only, out_in_proc,
        png_in_a_folder_that_cannot_be_made, png_under_a_file, why_png_under_a_file,
        why_word_twice, sentences_too_big_for_memory,
        model_too_big_for_memory, layers_range_of_a_billion, heads_range_backwards,
        heads_repeated, layers_overlapping,
        serve_without_its_extra, generate_an_empty_prompt, sentences_is_a_folder,
        probe_occurrence_zero, seed_past_64_bits, sentences_with_mixed_columns,
        sentences_file_empty,
    )
}  # fmt: skip


def _started_gb() -> float:
    """The address space of a started `qkv` (torch imported: about 0.65 GiB here), measured
    in a child, so the tight limit below leaves room for the start on any machine."""
    status = "open('/proc/self/status').read()"
    code = f"import qkv.cli, re; print(re.search(r'VmSize:\\s+(\\d+)', {status})[1])"
    done = run_qkv(command=[sys.executable, "-c", code], memory_gb=None)
    return int(done.stdout) / 2**20


# smollm2's weights, 0.5 GiB as float32, do not fit in 0.35 GiB past the start
MEMORY_GB = {"model_too_big_for_memory": lambda: max(1.0, _started_gb() + 0.35)}
# the modes these cases set bind the child (run_qkv drops root's override): shown first
CHMOD = {"model_folder_unreadable": ["ls", "model"], "out_folder_read_only": ["touch", "ro/x"]}


@pytest.mark.parametrize("name", CASES)
def test_hostile_input_is_one_line_and_exit_2(name, tmp_path):
    args, says, *env = CASES[name](tmp_path)
    try:
        if name in CHMOD:
            probe = run_qkv(command=CHMOD[name], cwd=tmp_path, as_user=True)
            assert probe.returncode != 0, "the mode does not bind the child"
        result = run_qkv(*args, memory_gb=MEMORY_GB.get(name, lambda: 4)(), cwd=tmp_path,
                         env=env[0] if env else None, as_user=name in CHMOD)  # fmt: skip
    finally:
        for folder in (tmp_path / "model", tmp_path / "ro"):  # let pytest clean up
            if folder.exists():
                folder.chmod(0o755)
    assert_one_line_error(result, *says)
    assert not (tmp_path / "x.png").exists()


def test_a_tiny_temperature_continues_or_is_refused_in_one_line(tmp_path):
    """1e-300 divides the logits into infinities; the sampler must either sample (the top
    token, in effect) or refuse the temperature, not fail inside torch."""
    result = run_qkv("generate", "The river bank", "-n", "3", "--temperature", "1e-300",
                     "--seed", "0", cwd=tmp_path)  # fmt: skip
    if result.returncode == 0:
        assert result.stdout.startswith("The river bank"), result.stdout
        assert len(result.stdout.rstrip("\n")) > len("The river bank"), "nothing was generated"
        assert "Traceback" not in result.stderr
    else:
        assert_one_line_error(result, "temperature")


def test_a_bug_in_qkv_keeps_its_traceback(tmp_path):
    """Not every RuntimeError is the user's: one that is not about memory is a bug in qkv
    and must show where it happened."""
    (tmp_path / "sitecustomize.py").write_text(
        "import qkv.pretrained\n"
        "def load(*args, **kwargs):\n"
        "    raise RuntimeError('a bug in qkv')\n"
        "qkv.pretrained.load = load\n"
    )
    path = os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))
    result = run_qkv("embed", "hi", cwd=tmp_path, env={"PYTHONPATH": path})
    assert result.returncode == 1, result.stderr[-2000:]
    assert "RuntimeError: a bug in qkv" in result.stderr
    assert not result.stderr.startswith("error: ")


def test_a_gpu_out_of_memory_is_one_line(capsys):
    """torch.OutOfMemoryError (CUDA's, multi-line) is worded as any allocation failure; made
    here, in the process, since no test machine is sure to have a GPU to fill."""
    import typer

    from qkv.cli.errors import user_errors

    message = ("CUDA out of memory. Tried to allocate 20.00 GiB. GPU 0 has a total capacity\n"
               "of 79.1 GiB of which 3.2 GiB is free.")  # fmt: skip
    with pytest.raises(typer.Exit) as exit_, user_errors():
        raise torch.OutOfMemoryError(message)
    assert exit_.value.exit_code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: out of memory: "), err
    assert "20.00 GiB" in err


def run(*args: str) -> subprocess.CompletedProcess:
    """`python -m qkv.cli ARGS`, as a user runs it, with no memory limit."""
    return subprocess.run(
        [sys.executable, "-m", "qkv.cli", *args], capture_output=True, text=True, timeout=120
    )


def test_bad_input_is_one_line_on_stderr_and_exit_2():
    result = run("generate", "hi", "--temperature", "-1")
    assert result.returncode == 2
    assert result.stderr.strip() == "error: temperature must be a finite number >= 0, got -1.0"
    result = run("embed", "hi", "--model", "./missing-model")
    assert result.returncode == 2 and result.stderr.startswith("error: ./missing-model does not")

"""`qkv generate`, run as a user runs it: a real process."""

from __future__ import annotations

import subprocess
import sys

import torch

import qkv


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "qkv.cli", *args], capture_output=True, text=True, timeout=120
    )


def test_generate_streams_the_greedy_continuation():
    result = run("generate", "The bank on the side of the river", "-n", "12")
    assert result.returncode == 0, result.stderr
    expected = qkv.load("smollm2").generate("The bank on the side of the river", 12)
    assert result.stdout == "The bank on the side of the river" + expected + "\n"


def test_generate_attention_of_a_chat_counts_the_template_in_the_prompt(smollm2, tmp_path):
    """--chat --attention sizes the page from the prompt wrapped in the chat template
    (`Pretrained.chat_prompt`), and writes the same page as generate with that record."""
    from qkv.inspect.generation import Recording
    from qkv.viz.generation import read_generation_page

    out = tmp_path / "chat.html"
    result = run("generate", "Where is the bank?", "--chat", "-n", "3", "--attention", str(out),
                 "--layers", "0", "--heads", "1")  # fmt: skip
    assert result.returncode == 0, result.stderr
    seen = smollm2.generate("Where is the bank?", 3, chat=True, record=Recording([0], [1]))
    assert result.stdout == f"{seen.text}\nwrote {out}\n"
    data = read_generation_page(out.read_text(encoding="utf-8"))
    assert (data["layers"], data["heads"]) == ([0], [1])
    assert data["prompt_length"] == seen.prompt_length  # the template's tokens, every one
    for j, row in enumerate(data["rows"]):
        torch.testing.assert_close(torch.from_numpy(row.copy()), seen.row(j), atol=1e-6, rtol=0)

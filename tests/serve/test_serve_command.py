"""`qkv serve` as a person runs it: it prints its loopback address, answers there, and stops
cleanly on Ctrl-C; bad options are one line on stderr and exit code 2."""

from __future__ import annotations

import queue
import signal
import subprocess
import sys
import threading

import httpx
from typer.testing import CliRunner

from qkv.cli import app

COMMAND = [sys.executable, "-m", "qkv.cli", "serve"]


def test_serve_prints_its_loopback_address_and_stops_on_ctrl_c():
    server = subprocess.Popen(
        [*COMMAND, "--model", "minilm", "--port", "0", "--quiet"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(
        target=lambda: [lines.put(line) for line in server.stdout], daemon=True
    ).start()
    try:
        first = lines.get(timeout=60)  # loading minilm and starting take a few seconds
        assert first.startswith("qkv serve: http://127.0.0.1:") and "(models: minilm)" in first
        url = first.split()[2]
        answer = httpx.get(url + "/api/models", timeout=10).json()
        assert [m["name"] for m in answer["models"]] == ["minilm"]  # only the one asked for
        assert "Self-attention, explored" in httpx.get(url + "/", timeout=10).text
        server.send_signal(signal.SIGINT)
        assert server.wait(timeout=30) == 0
        assert lines.get(timeout=10).strip() == "stopped"
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()


def test_bad_options_are_one_line_and_exit_2():
    runner = CliRunner()
    for options, says in (
        (["--port", "70000"], "port 70000 is out of range: 0-65535"),
        (["--model", "/no/such/folder", "--port", "0"], "/no/such/folder does not exist"),
        (
            ["--host", "no.such.host.invalid", "--port", "0"],
            "cannot bind to 'no.such.host.invalid'",
        ),
        (["--max-tokens", "0", "--port", "0"], "max_tokens must be an integer >= 1, got 0"),
        (["--max-long-tokens", "0", "--port", "0"], "max_long_tokens must be an integer >= 1"),
    ):
        done = runner.invoke(app, ["serve", *options])
        assert done.exit_code == 2, done.output
        errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and says in errors[0]

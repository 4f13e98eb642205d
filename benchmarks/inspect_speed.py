"""What a person waits for when inspecting attention with qkv, timed in one run for one tree.

For a checkout of qkv given by --tree (its code runs with PYTHONPATH=TREE/src, on this same
python), it times:
- `qkv demo` from a cold process to its end (the report folder written, in a temporary
  folder), the median of --runs runs, after a first run reported on its own (the first reads
  the model's files from disk; the others may find them in the OS file cache);
- `qkv show --model minilm SENTENCE --out X.html`, the same, and then to a .png;
- the server (`qkv serve --model minilm`, the real one, a subprocess on loopback) under
  --requests requests with --in-flight at once, alternating POST /api/attention (every layer
  and head) and POST /api/trace (the article's steps for "bank" and a word of the same
  sentence, at a layer and head that change from one trace to the next), over the article's
  sentence and the 16 "bank" sentences: median and 95th-percentile latency of each kind, and
  the throughput. Every answer must be 200 with sane content: each attention row sums to 1,
  and a trace's softmax row and weight are those of the same text, layer, head and pair in
  the server's own attention answer (fetched before the timed requests).

It uses only what both the tree before the inspection changes and the one after have (the
`demo`, `show` and `serve` commands, /api/attention and /api/trace as they are), so the two
can be compared: run it once with --tree at the old commit (a `git worktree add` of it) and
once at the new one, on a quiet machine, and compare the JSON files. Bounded: loopback only,
a fixed number of requests, a timeout on every command and request, and the server stopped
whatever happens. Two to three minutes at the defaults on 2 cores.

    python benchmarks/inspect_speed.py --tree PATH [--runs 3] [--requests 1000]
                                       [--in-flight 16] [--json FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent


def tree_environment(tree: Path) -> dict[str, str]:
    """This process's environment with the tree's code first; never a download."""
    return dict(os.environ, PYTHONPATH=str(tree / "src"), HF_HUB_OFFLINE="1", COLUMNS="100")


def qkv_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "qkv.cli", *args]


def cold_runs(
    command: list[str], env: dict, runs: int, check: Callable[[Path, str], str | None]
) -> dict:
    """Wall seconds of `command` in a fresh process, each run in an empty temporary folder:
    the first run, then `runs` more. `check(folder, stdout)` returns a problem or None."""
    seconds = []
    for _ in range(runs + 1):
        with tempfile.TemporaryDirectory(prefix="qkv-inspect-speed-") as folder:
            start = time.perf_counter()
            done = subprocess.run(
                command, cwd=folder, env=env, capture_output=True, text=True, timeout=600
            )
            seconds.append(time.perf_counter() - start)
            problem = (
                f"exit code {done.returncode}: {done.stderr.strip()[-500:]}"
                if done.returncode
                else check(Path(folder), done.stdout)
            )
            if problem:
                raise RuntimeError(f"{' '.join(command[2:])}: {problem}")
    return {"first_s": seconds[0], "median_s": statistics.median(seconds[1:]), "runs_s": seconds}


def wrote(name: str, start: bytes) -> Callable[[Path, str], str | None]:
    """A check that the command wrote `name` and that the file begins with `start`."""

    def check(folder: Path, stdout: str) -> str | None:
        path = folder / name
        if not path.is_file():
            return f"{name} was not written (it said {stdout.strip()[-200:]!r})"
        if not path.read_bytes()[:64].lstrip().lower().startswith(start):
            return f"{name} does not begin with {start!r}"
        return None

    return check


def demo_check(folder: Path, stdout: str) -> str | None:
    if "(sentence: " not in stdout:
        return "the demo did not reach its end"
    return wrote("report/index.html", b"<!doctype html")(folder, stdout)


def key_word(text: str) -> str:
    """The longest word of `text` (besides "bank") that occurs once, ignoring case: a word a
    trace can name without "#2".

    >>> key_word("The bank on the side of the river"), key_word("The bank approved my loan.")
    ('river', 'approved')
    """
    words = re.findall(r"[A-Za-z]+", text)
    counts = Counter(w.lower() for w in words)
    return max((w for w in words if counts[w.lower()] == 1 and w.lower() != "bank"), key=len)


def trace_call(serve_load, text: str, reference: dict, layer: int, head: int):
    """POST /api/trace for ("bank", key_word(text)) at `layer`, `head`, checked against the
    server's attention answer for the same text (`reference`)."""

    def check(body: dict) -> str | None:
        i, j = body["query_index"], body["key_index"]
        if (body["layer"], body["head"]) != (layer, head) or body["tokens"] != reference["tokens"]:
            return "the trace is not of the text, layer and head asked for"
        row = reference["weights"][layer][head][i]
        if abs(sum(body["weights"]) - 1) > 1e-4:
            return "the trace's softmax does not sum to 1"
        if max(abs(a - b) for a, b in zip(body["weights"], row, strict=True)) > 1e-5:
            return "the trace's softmax differs from the attention weights of its query"
        if abs(body["weight"] - row[j]) > 1e-5:
            return f"the trace's weight {body['weight']} is not the pair's attention {row[j]}"
        return None

    body = {"text": text, "query": "bank", "key": key_word(text), "layer": layer, "head": head}
    return serve_load.Call("trace", "/api/trace", body, check)


def mixed_calls(serve_load, references: dict, count: int, offset: int = 0) -> list:
    """`count` requests in turn: a text's attention, then a trace of it, then the next text."""
    calls = []
    for i in range(offset, offset + count):
        text = serve_load.TEXTS[(i // 2) % len(serve_load.TEXTS)]
        if i % 2 == 0:
            calls.append(serve_load.attention_call(text))
        else:
            L, H = references[text]["shape"][:2]
            n = i // 2  # the n-th trace: every layer and head in turn
            calls.append(trace_call(serve_load, text, references[text], n % L, (n // L) % H))
    return calls


def serve_mixed(serve_load, env: dict, requests: int, in_flight: int) -> dict:
    import httpx

    with serve_load.running_server(env) as (_, url):
        with httpx.Client(base_url=url, timeout=60) as client:
            references = {}
            for text in serve_load.TEXTS:
                answer = client.post("/api/attention", json={"text": text})
                answer.raise_for_status()
                references[text] = answer.json()
        # warm-up: the first requests start worker threads and fill allocator pools
        _, problems = asyncio.run(
            serve_load.load(url, mixed_calls(serve_load, references, 50), in_flight)
        )
        if problems:
            raise RuntimeError(f"warm-up failed: {problems[:3]}")
        calls = mixed_calls(serve_load, references, requests, offset=50)
        start = time.perf_counter()
        latencies, problems = asyncio.run(serve_load.load(url, calls, in_flight))
        wall = time.perf_counter() - start
    kinds = {}
    for kind, seconds in latencies.items():
        ms = [1000 * s for s in seconds]
        kinds[kind] = {
            "answered": len(ms),
            "median_ms": statistics.median(ms) if ms else None,
            "p95_ms": serve_load.percentile(ms, 0.95) if ms else None,
        }
    return {
        "requests": requests,
        "in_flight": in_flight,
        "wall_s": wall,
        "throughput_per_s": requests / wall,
        "kinds": kinds,
        "problems": problems,
    }


def commit_of(tree: Path) -> str | None:
    try:
        done = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, timeout=30)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() or None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tree", type=Path, required=True, help="a checkout of qkv")
    parser.add_argument("--runs", type=int, default=3, help="timed runs of each command")
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--in-flight", type=int, default=16)
    parser.add_argument("--json", type=Path, help="write the figures here too")
    args = parser.parse_args()
    tree = args.tree.resolve()
    cli = tree / "src" / "qkv" / "cli"  # a package since issue 33, one module before
    if not (cli.with_suffix(".py").is_file() or (cli / "__init__.py").is_file()):
        parser.error(f"{tree} is not a checkout of qkv (no src/qkv/cli)")
    if args.runs < 1 or args.requests < 2 or args.in_flight < 1:
        parser.error("--runs, --in-flight need at least 1, --requests at least 2")

    # the tree's qkv for the texts and the checks' shared code too, and this folder's
    # serve_load (the one with Call and load(calls)), whichever tree is measured
    sys.path[:0] = [str(tree / "src"), str(HERE)]
    import torch

    import qkv
    import serve_load
    from qkv.inspect.article import SENTENCE

    if not Path(qkv.__file__).resolve().is_relative_to(tree):
        parser.error(f"qkv was imported from {qkv.__file__}, not from {tree}")

    env = tree_environment(tree)
    cold = {
        "demo": cold_runs(qkv_command("demo", "--out", "report"), env, args.runs, demo_check),
        "show_html": cold_runs(
            qkv_command("show", "--model", "minilm", SENTENCE, "--out", "page.html"), env,
            args.runs, wrote("page.html", b"<!doctype html"),
        ),
        "show_png": cold_runs(
            qkv_command("show", "--model", "minilm", SENTENCE, "--out", "heads.png"), env,
            args.runs, wrote("heads.png", b"\x89png"),
        ),
    }  # fmt: skip
    serve = serve_mixed(serve_load, env, args.requests, args.in_flight)
    figures = {
        "tree": str(tree),
        "commit": commit_of(tree),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "runs": args.runs,
        "cold": cold,
        "serve": serve,
    }

    print(f"qkv at {tree} ({figures['commit']}); torch {torch.__version__}, "
          f"{figures['threads']} threads")  # fmt: skip
    print(f"{'a fresh process to its end':40} {'first run':>10} {f'median of {args.runs}':>12}")
    for name, shown in (("demo", "qkv demo"), ("show_html", "qkv show -> .html"),
                        ("show_png", "qkv show -> .png")):  # fmt: skip
        print(f"  {shown:38} {cold[name]['first_s']:9.2f}s {cold[name]['median_s']:11.2f}s")
    print(f"qkv serve: {args.requests} requests, attention and trace in turn, "
          f"{args.in_flight} in flight")  # fmt: skip
    for kind, k in serve["kinds"].items():
        median, p95 = (k[f] if k["answered"] else float("nan") for f in ("median_ms", "p95_ms"))
        print(f"  {kind:10} {k['answered']:5} answered; latency median {median:.1f} ms, "
              f"p95 {p95:.1f} ms")  # fmt: skip
    print(f"  throughput {serve['throughput_per_s']:.1f} requests/s ({serve['wall_s']:.2f} s); "
          f"problems: {len(serve['problems'])}")  # fmt: skip
    for problem in serve["problems"][:5]:
        print(f"    {problem}")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
        print(f"wrote {args.json}")
    sys.exit(1 if serve["problems"] else 0)


if __name__ == "__main__":
    main()

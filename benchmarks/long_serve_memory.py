"""The long-text server's resident memory over ten successive texts of 4,090 tokens (issue 32).

The real server process (uvicorn serving SmolLM2, started by this script with `--serve`, the
code path of `qkv serve`), and one client that reads ten different texts of 4,090 tokens one
after another as serve.md's protocol says (202: ask again after Retry-After), reading the
server's VmRSS (/proc) once it has started (the model's weights mapped from their cache file,
not yet read) and after each text's 200. Issue 32 measured 2.79, 4.94, 6.15, 6.80 GB after
four such texts, before the fix.

Runs: this checkout keeping one text (max_long_kept_bytes=1, as the server kept before), this
checkout with its default limits (up to 1.5 GiB of texts kept: three of 4,090 tokens), and,
with --before SRC, another checkout's src folder (e.g. `git archive` of the commit before the
fix) with its own defaults. The check: after ten texts, within 10% of after the first (for
the default limits: of after the third, once as many texts are kept as fit).

    python benchmarks/long_serve_memory.py [--texts 10] [--before SRC] [--runs one,default]

benchmarks/long_serve_memory.txt holds a run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import queue
import subprocess
import sys
import threading
import time

import httpx

from long_text import BASE  # the same sentences as the library's long-text benchmark
from serve_load import stop_server

T = 4_090


def texts(n: int) -> list[str]:
    """n different texts of T tokens of SmolLM2: BASE's sentences in another order each."""
    import qkv

    tokenizer = qkv.load("smollm2").tokenizer
    sentences = [s.strip() + "." for s in BASE.split(".") if s.strip()]
    out = []
    for i in range(n):
        turned = sentences[i % len(sentences) :] + sentences[: i % len(sentences)]
        body = f"Day {i + 1}. " + " ".join(turned * 60)
        ids = tokenizer.encode(body).ids[:T]
        out.append(tokenizer.decode(ids))
    return out


def rss_gb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 2**20
    raise RuntimeError(f"no VmRSS for process {pid}")


def serve(limits: dict) -> None:
    """The server process: SmolLM2 within `limits`, on a free loopback port, until Ctrl-C."""
    import qkv
    from qkv.serve import Limits, bind, create_app
    from qkv.serve import serve as run_server
    from qkv.serve.server import address

    app = create_app({"smollm2": qkv.load("smollm2")}, Limits(**limits))
    sock = bind("127.0.0.1", 0)
    print(f"qkv serve: {address(sock)}", flush=True)
    run_server(app, sock, quiet=True)


def measure(name: str, limits: dict, bodies: list[str], src: str | None) -> dict:
    env = dict(os.environ, **({"PYTHONPATH": src} if src else {}))
    command = [sys.executable, __file__, "--serve", json.dumps(limits)]
    server = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=env)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in server.stdout], daemon=True).start()
    try:
        url = lines.get(timeout=300).split()[2]
        loaded, after, seconds = rss_gb(server.pid), [], []
        with httpx.Client(base_url=url, timeout=120) as client:
            for body in bodies:
                start = time.perf_counter()
                while True:
                    answer = client.post("/api/long", json={"text": body})
                    if answer.status_code not in (202, 503):
                        break
                    time.sleep(float(answer.headers.get("retry-after", "1")))
                assert answer.status_code == 200, answer.text[:300]
                assert len(answer.json()["tokens"]) == T, len(answer.json()["tokens"])
                seconds.append(time.perf_counter() - start)
                after.append(rss_gb(server.pid))
                print(f"  {name}: text {len(after)}: {after[-1]:.2f} GB, {seconds[-1]:.1f} s",
                      flush=True)  # fmt: skip
    finally:
        stop_server(server)
    return {"name": name, "loaded": loaded, "after": after, "seconds": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--texts", type=int, default=10)
    parser.add_argument("--before", help="another checkout's src folder, measured first")
    parser.add_argument("--runs", default="one,default", help="this checkout's runs: one "
                        "(one text kept), default (its default limits), or both")  # fmt: skip
    parser.add_argument("--serve", help=argparse.SUPPRESS)  # the server process's own run
    args = parser.parse_args()
    if args.serve is not None:
        return serve(json.loads(args.serve))
    with open("/proc/cpuinfo") as info:
        cpu = next((line.split(":", 1)[1].strip() for line in info
                    if line.startswith("model name")), platform.processor())  # fmt: skip
    print(f"# {cpu}, {len(os.sched_getaffinity(0))} cores, load average "
          f"{os.getloadavg()[0]:.2f} at the start; {args.texts} texts of {T:,} tokens")  # fmt: skip
    bodies = texts(args.texts)
    runs = []
    if args.before:
        runs.append(measure("before the fix (one text kept)", {}, bodies, args.before))
    if "one" in args.runs.split(","):
        runs.append(measure("one text kept", {"max_long_kept_bytes": 1}, bodies, None))
    if "default" in args.runs.split(","):
        runs.append(measure("default limits (1.5 GiB kept)", {}, bodies, None))
    print("\n| run | started GB | after each text, GB | s per text (median) | "
          "last / first | last / third |\n|---|---|---|---|---|---|")  # fmt: skip
    for run in runs:
        after, seconds = run["after"], sorted(run["seconds"])
        print(f"| {run['name']} | {run['loaded']:.2f} | {', '.join(f'{x:.2f}' for x in after)} "
              f"| {seconds[len(seconds) // 2]:.1f} | {after[-1] / after[0]:.2f} "
              f"| {after[-1] / after[min(2, len(after) - 1)]:.2f} |")  # fmt: skip


if __name__ == "__main__":
    main()

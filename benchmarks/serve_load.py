"""A bounded load on `qkv serve`: 1,000 attention requests, 16 in flight, on loopback.

The real server (`qkv serve --model minilm --port 0`, uvicorn, a subprocess) answers
POST /api/attention for the article's sentence and the 16 "bank" sentences in turn (every
layer and head, as lists of floats). Checks: every answer is 200 and carries the weights of
its own text (its tokens, rows summing to 1), none is lost (1,000 sent, 1,000 answered),
and the server's memory (VmRSS from /proc) after the run is within 10% of what it was
after a warm-up of 50 requests (the first requests start the worker threads and fill
allocator pools; the idle figure is printed too). Prints the median and 95th-percentile
latency and the throughput.

The peer is the library without the server: the same 1,000 requests' work done in this
process, one after another, by the calls the server makes (`Pretrained.attentions`, the
weights as lists, `json.dumps`). The ratio is what HTTP, JSON and queueing cost, net of what
running several requests at once gains over one at a time (on 2 cores, small forwards
leave a core idle much of the time, so the server can come out ahead). The two are
interleaved in 10 rounds of 100 (the server's 100 with 16 in flight, then the library's
100), so that drift in the machine (other work on its 2 cores) falls on both alike.

Bounded: requests only go to 127.0.0.1, 1,000 of them, each with a 60 s timeout; the server
is stopped (Ctrl-C, then kill) whatever happens.

    python benchmarks/serve_load.py [--requests N] [--in-flight K]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import queue
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import httpx
import torch

from qkv.inspect.article import SENTENCE
from qkv.inspect.bank_sentences import SENTENCES

TEXTS = [SENTENCE, *SENTENCES]


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for process {pid}")


def start_server(env: dict[str, str] | None = None) -> tuple[subprocess.Popen, str]:
    """`qkv serve --model minilm` on a free loopback port: (the process, its URL). env: the
    server's environment (default: this one's), e.g. a PYTHONPATH naming another checkout."""
    command = [
        sys.executable,
        "-m",
        "qkv.cli",
        "serve",
        "--model",
        "minilm",
        "--port",
        "0",
        "--quiet",
    ]
    server = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=env)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in server.stdout], daemon=True).start()
    try:
        first = lines.get(timeout=120)
    except queue.Empty:
        stop_server(server)
        raise RuntimeError("the server did not start within 120 s") from None
    if not first.startswith("qkv serve: http://127.0.0.1:"):
        stop_server(server)
        raise RuntimeError(f"the server said {first!r}")
    return server, first.split()[2]


def stop_server(server: subprocess.Popen) -> None:
    """Ctrl-C, then kill if it has not stopped within 30 s."""
    server.send_signal(signal.SIGINT)
    try:
        server.wait(timeout=30)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()


@contextmanager
def running_server(env: dict[str, str] | None = None) -> Iterator[tuple[subprocess.Popen, str]]:
    """The server for the block, stopped whatever happens in it."""
    server, url = start_server(env)
    try:
        yield server, url
    finally:
        stop_server(server)


@dataclass(frozen=True)
class Call:
    """One request of a load: its kind (for the latency of each kind), the path and JSON
    body to POST, and a check of the answer's JSON that returns a problem or None."""

    kind: str
    path: str
    body: dict
    check: Callable[[dict], str | None]


def attention_call(text: str) -> Call:
    """POST /api/attention for every layer and head of `text`."""

    def check(body: dict) -> str | None:
        rows = torch.tensor(body["weights"]).sum(-1)  # (L, H, T)
        if body["text"] != text or not torch.allclose(rows, torch.ones_like(rows), atol=1e-4):
            return "the answer is not its text's weights"
        return None

    return Call("attention", "/api/attention", {"text": text}, check)


async def load(url: str, calls: list[Call], in_flight: int) -> tuple[dict[str, list], list]:
    """Every call, at most `in_flight` at once: (latencies in s by kind, problems)."""
    gate = asyncio.Semaphore(in_flight)
    latencies: dict[str, list[float]] = {call.kind: [] for call in calls}
    problems = []
    limits = httpx.Limits(max_connections=in_flight, max_keepalive_connections=in_flight)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as client:

        async def one(i: int, call: Call) -> None:
            async with gate:
                start = time.perf_counter()
                try:
                    answer = await client.post(call.path, json=call.body)
                except httpx.HTTPError as error:
                    problems.append(f"request {i} ({call.kind}): {type(error).__name__}")
                    return
                latencies[call.kind].append(time.perf_counter() - start)
            if answer.status_code != 200:
                problems.append(
                    f"request {i} ({call.kind}): {answer.status_code} {answer.text[:100]}"
                )
                return
            problem = call.check(answer.json())
            if problem:
                problems.append(f"request {i} ({call.kind}): {problem}")

        await asyncio.gather(*(one(i, call) for i, call in enumerate(calls)))
    return latencies, problems


def attention_calls(count: int, offset: int = 0) -> list[Call]:
    """`count` attention requests over the texts in turn, from text number `offset`."""
    return [attention_call(TEXTS[(offset + i) % len(TEXTS)]) for i in range(count)]


def percentile(values: list[float], share: float) -> float:
    """The nearest-rank percentile: percentile([1, 2, 3, 4], 0.95) == 4."""
    ordered = sorted(values)
    return ordered[max(0, round(share * len(ordered)) - 1)]


def in_process(minilm, count: int, offset: int) -> float:
    """Seconds for the same work by the library, one request after another."""
    start = time.perf_counter()
    for i in range(count):
        seen = minilm.attentions(TEXTS[(offset + i) % len(TEXTS)])
        json.dumps({"tokens": seen.tokens, "weights": seen.weights.tolist()})
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--in-flight", type=int, default=16)
    args = parser.parse_args()

    import qkv

    with running_server() as (server, url):
        idle = rss_kib(server.pid)
        _, problems = asyncio.run(load(url, attention_calls(50), args.in_flight))  # warm-up
        if problems:
            raise RuntimeError(f"warm-up failed: {problems[:3]}")
        before = rss_kib(server.pid)
        minilm = qkv.load("minilm")
        latencies, problems, wall, alone = [], [], 0.0, 0.0
        rounds = 10
        for r in range(rounds):
            count = args.requests // rounds + (r < args.requests % rounds)
            calls = attention_calls(count, offset=50 + r * count)
            start = time.perf_counter()
            got, bad = asyncio.run(load(url, calls, args.in_flight))
            wall += time.perf_counter() - start
            latencies, problems = latencies + got["attention"], problems + bad
            alone += in_process(minilm, count, offset=50 + r * count)
        after = rss_kib(server.pid)

    ms = sorted(1000 * t for t in latencies)
    p95 = percentile(ms, 0.95)
    lost = args.requests - len(latencies)  # no answer at all
    growth = after / before - 1
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; qkv serve --model "
        f"minilm (uvicorn) on {url}"
    )
    print(
        f"{args.requests} POST /api/attention (every layer and head as lists, texts of "
        f"{min(len(t.split()) for t in TEXTS)} to {max(len(t.split()) for t in TEXTS)} words), "
        f"{args.in_flight} in flight"
    )
    print(
        f"  answered 200 with their own text's weights: {args.requests - len(problems)} of "
        f"{args.requests}; lost: {lost}; other problems: {len(problems) - lost}"
    )
    for problem in problems[:5]:
        print(f"    {problem}")
    print(
        f"  latency: median {statistics.median(ms):.1f} ms, p95 {p95:.1f} ms, max {ms[-1]:.1f} ms"
    )
    print(f"  throughput: {args.requests / wall:.1f} requests/s ({wall:.2f} s)")
    print(
        f"  server RSS: idle {idle / 1024:.0f} MiB, after 50 warm-up requests "
        f"{before / 1024:.0f} MiB, after the run {after / 1024:.0f} MiB ({growth:+.1%}; "
        f"target within 10% -> {'PASS' if abs(growth) <= 0.10 else 'MISS'})"
    )
    print(
        f"in-process (the same work by the library, one request at a time): "
        f"{args.requests / alone:.1f} requests/s ({alone:.2f} s)"
    )
    print(f"server/in-process throughput: {alone / wall:.2f}x")
    ok = not problems and len(latencies) == args.requests and abs(growth) <= 0.10
    print("all answered, none lost: " + ("PASS" if ok else "FAIL"))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()

"""Greedy decoding speed of SmolLM2-135M (the embedded Q4_1 GGUF, float32), this checkout
against an earlier commit of qkv, in one run: did a change slow decoding down?

The earlier commit is checked out into a temporary git worktree. Each measurement is a
fresh process that imports one of the two versions (PYTHONPATH=<its src>), loads the model,
decodes once to warm up, then times `repeats` greedy decodes of N new tokens from the same
prompt and prints the median; the two versions alternate process by process so that drift
in the machine falls on both alike. Both must produce the same tokens.

    python benchmarks/decode_regression.py [--before REV] [--tokens N] [--rounds R]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "Once upon a time, in a small village by the sea, there lived"

CHILD = """
import json, statistics, sys, time, torch
import qkv
from qkv.generate import Sampling, decode_steps
torch.set_num_threads({threads})
model = qkv.load("smollm2")
ids = torch.tensor([model.tokenizer.encode({prompt!r}).ids])
def run():
    return [int(t) for t in decode_steps(model.model, ids, None, Sampling(), {tokens})]
tokens = run()
times = []
for _ in range({repeats}):
    start = time.perf_counter(); run(); times.append(time.perf_counter() - start)
print(json.dumps({{"seconds": statistics.median(times), "tokens": tokens}}))
"""


def measure(src: Path, tokens: int, repeats: int, threads: int) -> dict:
    code = CHILD.format(prompt=PROMPT, tokens=tokens, repeats=repeats, threads=threads)
    done = subprocess.run(
        [sys.executable, "-c", code], env=os.environ | {"PYTHONPATH": str(src)},
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--before", default="bf024d7", help="the earlier commit (default: "
                        "the last commit before issue 15's families)")  # fmt: skip
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3, help="processes per version")
    parser.add_argument("--repeats", type=int, default=3, help="timed decodes per process")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    import torch

    with tempfile.TemporaryDirectory() as scratch:
        before = Path(scratch) / "before"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q",
                        str(before), args.before], check=True)  # fmt: skip
        try:
            runs: dict[str, list[dict]] = {"before": [], "now": []}
            for _ in range(args.rounds):  # alternating, process by process
                runs["before"].append(measure(before / "src", args.tokens, args.repeats,
                                              args.threads))  # fmt: skip
                runs["now"].append(measure(ROOT / "src", args.tokens, args.repeats,
                                           args.threads))  # fmt: skip
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force",
                            str(before)], check=True)  # fmt: skip
    same = runs["before"][0]["tokens"] == runs["now"][0]["tokens"]
    rate = {name: args.tokens / statistics.median(r["seconds"] for r in found)
            for name, found in runs.items()}  # fmt: skip
    print(f"torch {torch.__version__}, {args.threads} threads, SmolLM2-135M Q4_1 as float32, "
          f"greedy, {args.tokens} new tokens, median of {args.rounds} processes x "
          f"{args.repeats} decodes, alternating")  # fmt: skip
    print(f"same tokens before and now: {same}")
    print(f"before ({args.before}): {rate['before']:7.2f} tokens/s")
    print(f"now:              {rate['now']:7.2f} tokens/s")
    ratio = rate["now"] / rate["before"]
    print(f"now / before: {ratio:.3f}x; target >= 0.97 (no regression) -> "
          f"{'PASS' if ratio >= 0.97 and same else 'MISS'}")  # fmt: skip


if __name__ == "__main__":
    main()

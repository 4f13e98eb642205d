"""qkv's chunked linear attention (`qkv.attention.linear.delta_rule(form="chunked")`) beside
transformers' own torch path, the fallback its models run without flash-linear-attention:
`torch_chunk_gated_delta_rule` (Qwen3.5's Gated DeltaNet, one fade per head) and
`chunk_kimi_delta_attention` (Kimi Linear's KDA, one fade per key channel).

Qwen3.5-like sizes: one sequence, 16 heads, Dk = Dv = 128, float32, at 1,024 and 4,096 tokens;
queries and keys L2-normalized, write strengths sigmoid(N(0, 1)), fades near 1 as trained
layers keep them (log fade -softplus(N(0, 1) - 4)). Each side gets its own layout, made
before timing ((B, H, T, D) for qkv, (B, T, H, D) for transformers).

- time: the median of `--repeats` rounds, the two sides alternating (benchmarks/timing.py);
- memory: the peak resident memory a call adds, each side in a process of its own: the
  process makes its inputs, runs the call once on 64 tokens (so libraries' one-time buffers
  are in the baseline), resets the kernel's high-water mark of its resident memory (writing
  5 to /proc/self/clear_refs), reads its resident size (VmRSS), runs the call once and reads
  the high-water mark (VmHWM); the difference is what the call needed at its peak (tensors
  and the allocator's slack alike: torch takes CPU memory from malloc, which no torch
  counter reports and tracemalloc does not see). Linux only;
- difference: the largest |qkv - transformers| over the outputs, and relative to the
  output's largest value.

Then qkv's `effective_weights` (every query's weight on every key, float64) at 1,024 tokens.

    python benchmarks/linear_attention.py [--repeats N] [--tokens 1024 4096]
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers.models.kimi_linear.modeling_kimi_linear import chunk_kimi_delta_attention
from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

from qkv.attention.linear import delta_rule, effective_weights
from timing import machine, time_peers

HEADS, SIZE = 16, 128


def inputs(tokens: int, per_channel: bool, seed: int = 0) -> dict[str, torch.Tensor]:
    """One sequence's q, k, v (1, H, T, D), beta (1, H, T) and log fade (1, H, T[, D])."""
    gen = torch.Generator().manual_seed(seed)
    shape = (1, HEADS, tokens, SIZE)

    def normal(*size):
        return torch.randn(*size, generator=gen)

    q, k = (F.normalize(normal(*shape), dim=-1) for _ in range(2))
    fade_shape = shape if per_channel else shape[:3]
    return {"q": q, "k": k, "v": normal(*shape), "beta": torch.sigmoid(normal(*shape[:3])),
            "g": -F.softplus(normal(*fade_shape) - 4.0)}  # fmt: skip


def sides(x: dict[str, torch.Tensor], per_channel: bool):
    """(qkv's call, transformers' call), each on inputs in its own layout, made here."""
    q, k, v, beta, g = x["q"], x["k"], x["v"], x["beta"], x["g"]
    theirs = [t.transpose(1, 2).contiguous() for t in (q, k, v, beta, g)]  # (B, T, H, ...)
    reference = chunk_kimi_delta_attention if per_channel else torch_chunk_gated_delta_rule

    def ours():
        return delta_rule(q, k, v, beta=beta, decay=g, form="chunked").out

    def transformers():
        return reference(*theirs[:3], g=theirs[4], beta=theirs[3])[0].transpose(1, 2)

    return ours, transformers


def peak_added(side: str, tokens: int, per_channel: bool) -> float:
    """MiB of peak resident memory one call of `side` adds, measured in a fresh process."""
    command = [sys.executable, __file__, "--memory-of", side, str(tokens), str(int(per_channel))]
    done = subprocess.run(command, capture_output=True, text=True, check=True,
                          cwd=Path(__file__).parent)  # fmt: skip
    return json.loads(done.stdout.strip().splitlines()[-1])["mib"]


def measure_here(side: str, tokens: int, per_channel: bool) -> None:
    """The child process of `peak_added`: prints {"mib": ...}."""
    if side == "weights":
        small = inputs(64, per_channel)
        effective_weights(small["q"], small["k"], beta=small["beta"], decay=small["g"])
        x = inputs(tokens, per_channel)
        before = _reset_peak()
        effective_weights(x["q"], x["k"], beta=x["beta"], decay=x["g"])
    else:
        dict(zip(("ours", "transformers"), sides(inputs(64, per_channel), per_channel),
                 strict=True))[side]()  # fmt: skip
        call = dict(zip(("ours", "transformers"), sides(inputs(tokens, per_channel), per_channel),
                        strict=True))[side]  # fmt: skip
        before = _reset_peak()
        call()
    print(json.dumps({"mib": (_status("VmHWM") - before) / 1024}))


def _reset_peak() -> int:
    """Reset this process's resident high-water mark; return its resident KiB now."""
    Path("/proc/self/clear_refs").write_text("5")
    return _status("VmRSS")


def _status(key: str) -> int:
    """A KiB figure of /proc/self/status (VmRSS, VmHWM)."""
    found = re.search(rf"^{key}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M)
    return int(found[1])


def row(name: str, tokens: int, per_channel: bool, repeats: int) -> str:
    ours, transformers = sides(inputs(tokens, per_channel), per_channel)
    a, b = ours(), transformers()
    difference = (a - b).abs().max().item()
    relative = difference / b.abs().max().item()
    times = time_peers({"qkv": ours, "transformers": transformers}, repeats, warmup=0)
    memory = {side: peak_added(side, tokens, per_channel) for side in ("ours", "transformers")}
    return (
        f"{name:<26}{tokens:>7,}{times['transformers'] * 1e3:>10.1f}{times['qkv'] * 1e3:>9.1f}"
        f"{times['transformers'] / times['qkv']:>7.2f}x{memory['transformers']:>10.0f}"
        f"{memory['ours']:>9.0f}{memory['transformers'] / max(memory['ours'], 1):>7.2f}x"
        f"{difference:>11.1e}{relative:>10.1e}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--memory-of", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.memory_of:
        side, tokens, per_channel = args.memory_of
        measure_here(side, int(tokens), bool(int(per_channel)))
        return
    print(machine())
    print(f"one sequence, {HEADS} heads, Dk = Dv = {SIZE}, float32; time: median of "
          f"{args.repeats} alternated rounds; memory: peak resident memory one call adds, in a "
          "process of its own (/proc high-water mark)")  # fmt: skip
    print()
    print(f"{'rule':<26}{'tokens':>7}{'hf ms':>10}{'qkv ms':>9}{'speed':>8}{'hf MiB':>10}"
          f"{'qkv MiB':>9}{'memory':>8}{'max diff':>11}{'relative':>10}")  # fmt: skip
    for name, per_channel in (("gated delta (per head)", False), ("KDA (per channel)", True)):
        for tokens in args.tokens:
            print(row(name, tokens, per_channel, args.repeats), flush=True)
    print()
    x = inputs(1024, per_channel=False)
    seconds = time_peers({"w": lambda: effective_weights(x["q"], x["k"], beta=x["beta"],
                                                         decay=x["g"])}, 3)["w"]  # fmt: skip
    check = effective_weights(x["q"], x["k"], beta=x["beta"], decay=x["g"])
    out = delta_rule(x["q"].double(), x["k"].double(), x["v"].double(), beta=x["beta"].double(),
                     decay=x["g"].double(), form="chunked").out  # fmt: skip
    gap = (check @ x["v"].double() - out).abs().max().item()
    print(f"effective_weights, 1,024 tokens, {HEADS} heads (float64, (1, {HEADS}, 1024, 1024)): "
          f"{seconds * 1e3:.0f} ms, peak memory added {peak_added('weights', 1024, False):.0f} "
          f"MiB; weights @ v against the rule's output: {gap:.1e}")  # fmt: skip


if __name__ == "__main__":
    main()

"""qkv's native K-quant products (`qkv.nn.quant_k`: a GGUF file's Q4_K / Q6_K blocks times
llama.cpp's Q8_K activations, in C) beside torch's F.linear on the same matrix dequantized to
float32, at SmolLM2-like shapes, one decode row and a 15-row prompt, on 1 and 2 threads.
SmolLM2's width, 576, is no multiple of a K-quant's 256 columns (llama.cpp's quantizer gives
such matrices a 32-column type instead): its 576 inputs become 768 here, its MLP's 1536 stay.
Each cell is the median of interleaved calls; each row also prints the
largest difference from F.linear relative to its largest value (the activations' 8-bit
rounding, not an error).

    python benchmarks/quant_k.py [--repeats N] [--formats Q4_K Q6_K]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from gguf import quants as gguf_quants

from qkv import native
from qkv.nn.quant_k import matmul_k, product_k, repack_k
from timing import machine, time_peers

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from kquant_blocks import random_blocks

SHAPES = [(576, 768), (1536, 768), (576, 1536)]  # (N, K): q/o, gate/up, down


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--formats", nargs="+", default=["Q4_K"])
    args = parser.parse_args()
    print(machine())
    print(native.describe())
    rng = np.random.default_rng(0)
    print(f"{'format':6} {'N x K':>11} {'rows':>4} {'thr':>3} {'F.linear us':>12} "
          f"{'qkv us':>8} {'speed-up':>8} {'rel diff':>9}")  # fmt: skip
    for fmt in args.formats:
        for N, K in SHAPES:
            raw = random_blocks(fmt, N, K, rng)
            weight = torch.from_numpy(
                gguf_quants.dequantize(raw, GGMLQuantizationType[fmt]).reshape(N, K).copy()
            )
            packed = repack_k(fmt, torch.from_numpy(raw), N, K)
            for rows in (1, 15):
                x = torch.randn(rows, K)
                for threads in (1, 2):
                    torch.set_num_threads(threads)
                    multiply = product_k(packed, threads=threads)  # checked once, as a layer
                    seconds = time_peers(
                        {"torch": lambda x=x, w=weight: F.linear(x, w),
                         "qkv": lambda x=x, f=multiply: f(x)},
                        args.repeats, warmup=5,
                    )  # fmt: skip
                    want = F.linear(x, weight)
                    diff = ((matmul_k(packed, x) - want).abs().max() / want.abs().max()).item()
                    print(f"{fmt:6} {N:>5} x {K:<5} {rows:>4} {threads:>3} "
                          f"{seconds['torch'] * 1e6:>12.1f} {seconds['qkv'] * 1e6:>8.1f} "
                          f"{seconds['torch'] / seconds['qkv']:>7.2f}x {diff:>9.2e}")  # fmt: skip


if __name__ == "__main__":
    main()

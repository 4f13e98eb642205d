"""qkv's float32 Linear products (`qkv.nn.linear`) beside torch's F.linear, on the shapes
qkv's models multiply: SmolLM2's matrices at 1, 15 and 512 rows (one decode step, a prompt,
a long text) and GPT-2's at 2,048 rows with the gradients a training step takes.

On a CPU where `qkv.device.choose_gemm` picks oneDNN (an AMD CPU, where torch's MKL takes its
AVX2 path), `linear` runs oneDNN's linear; elsewhere it is F.linear itself, and the ratios
are 1 but for noise. Each cell is the median of interleaved calls on fresh random inputs;
each row also prints the largest difference between the two, relative to the output's
largest value (float32 rounding: products summed in another order).

    python benchmarks/linear_cpu.py [--repeats N]
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from qkv.device import choose_gemm
from qkv.nn.linear import linear
from timing import CORES, machine, time_peers

# (what, rows, in, out): SmolLM2 (width 576, MLP 1536, 9 + 2 x 3 heads of 64, vocab 49,152)
# and the GPT-2 shape of benchmarks/train.py (width 384, MLP 1536, vocab 8,192)
SHAPES = [
    ("SmolLM2 gate, 1 row", 1, 576, 1536),
    ("SmolLM2 head, 1 row", 1, 576, 49152),
    ("SmolLM2 q+k+v, 15 rows", 15, 576, 960),
    ("SmolLM2 head, 15 rows", 15, 576, 49152),
    ("SmolLM2 gate, 512 rows", 512, 576, 1536),
    ("SmolLM2 down, 512 rows", 512, 1536, 576),
    ("GPT-2 MLP in, 2,048 rows", 2048, 384, 1536),
    ("GPT-2 MLP out, 2,048 rows", 2048, 1536, 384),
    ("GPT-2 head, 2,048 rows", 2048, 384, 8192),
]
TRAINED = 2048  # rows from which a row also times forward and backward, as training does


def cell(rows: int, width: int, out: int, repeats: int) -> tuple[float, float, float]:
    """(torch's seconds, qkv's seconds, relative difference) of one shape."""
    x, weight, bias = torch.randn(rows, width), torch.randn(out, width), torch.randn(out)
    if rows >= TRAINED:  # a training step's three products: forward, input's and weight's grads
        grad = torch.randn(rows, out)
        x.requires_grad_(), weight.requires_grad_(), bias.requires_grad_()

        def step(fn):
            def run():
                fn(x, weight, bias).backward(grad)
                x.grad = weight.grad = bias.grad = None

            return run

        fns = {"torch": step(F.linear), "qkv": step(linear)}
    else:
        fns = {"torch": lambda: F.linear(x, weight, bias), "qkv": lambda: linear(x, weight, bias)}
    seconds = time_peers(fns, repeats, warmup=2)
    with torch.no_grad():
        want = F.linear(x.double(), weight.double(), bias.double())
        got = linear(x, weight, bias).double()
    difference = float((got - want).abs().max() / want.abs().max())
    return seconds["torch"], seconds["qkv"], difference


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(CORES)
    torch.manual_seed(0)
    print(machine())
    library, why = choose_gemm()
    print(f"qkv.nn.linear here: {library}, since {why}")
    print(f"median of {args.repeats} interleaved calls; rows of {TRAINED:,} and more: forward "
          "and backward (the input's, weight's and bias's gradients)\n")  # fmt: skip
    print(f"{'shape':28} {'torch ms':>9} {'qkv ms':>8} {'speed':>6} {'GFLOP/s':>8}  difference")
    for name, rows, width, out in SHAPES:
        theirs, ours, difference = cell(rows, width, out, args.repeats)
        flops = 2 * rows * width * out * (3 if rows >= TRAINED else 1)
        print(f"{name:28} {theirs * 1e3:9.2f} {ours * 1e3:8.2f} {theirs / ours:5.2f}x "
              f"{flops / ours / 1e9:8.0f}  {difference:.1e}")  # fmt: skip


if __name__ == "__main__":
    main()

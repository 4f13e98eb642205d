"""Decode attention over a long cache: qkv's split-K kernel in C over a float16 (and an 8-bit)
cache against torch's F.scaled_dot_product_attention over the float32 cache, which is what
FastStep runs today (one query per head, grouped KV heads, a slice of a cache allocated once).

SmolLM2-135M's shape: 9 query heads sharing 3 KV heads of 64, 30 layers, each layer its own
cache (so that a layer's keys are not still in the cache from the last call). A peer's time is
one pass over the 30 layers, divided by 30: milliseconds per layer, the median of --repeats
interleaved passes (timing.time_peers), and the ratio of torch's time to each kernel's
(> 1: the kernel is faster).

    PYTHONPATH=src python benchmarks/decode_attention.py [--threads 2] [--repeats 30]
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F

from qkv import native
from qkv.attention import native_decode as nd
from timing import machine, time_peers

H, HKV, D, LAYERS = 9, 3, 64, 30


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 4096, 8192])
    parser.add_argument(
        "--best",
        action="store_true",
        help="the fastest pass, not the median (a machine shared with other work)",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(machine())
    print(f"native: {native.describe()}")
    print(f"SmolLM2's attention: H={H}, Hkv={HKV}, D={D}, {LAYERS} layers, {args.threads} "
          f"threads; ms per layer ({'best' if args.best else 'median'} of {args.repeats}); "
          "ratio = torch / kernel")  # fmt: skip
    print(f"{'tokens':>7} | {'torch f32':>9} | {'qkv f16':>8} {'ratio':>6} | "
          f"{'qkv int8':>8} {'ratio':>6}")  # fmt: skip
    for T in args.lengths:
        ms = per_layer(T, args.threads, args.repeats, min if args.best else statistics.median)
        print(f"{T:>7} | {ms['torch']:>9.3f} | {ms['f16']:>8.3f} {ms['torch'] / ms['f16']:>5.2f}x"
              f" | {ms['int8']:>8.3f} {ms['torch'] / ms['int8']:>5.2f}x")  # fmt: skip


def per_layer(T: int, threads: int, repeats: int, statistic) -> dict[str, float]:
    """Milliseconds per layer of each peer over T cached tokens."""
    scale = D**-0.5
    capacity = T + 64  # a slice of a longer cache, as FastStep attends
    q = torch.randn(1, H, D)
    keys = [torch.randn(1, HKV, capacity, D) for _ in range(LAYERS)]
    values = [torch.randn(1, HKV, capacity, D) for _ in range(LAYERS)]
    halves = [(k.half(), v.half()) for k, v in zip(keys, values, strict=True)]
    bytes_ = [_bytes(k, v, T) for k, v in zip(keys, values, strict=True)]

    def torch_pass():
        for k, v in zip(keys, values, strict=True):
            F.scaled_dot_product_attention(q[:, :, None], k[:, :, :T], v[:, :, :T], scale=scale,
                                           enable_gqa=True)  # fmt: skip

    def f16_pass():
        for k, v in halves:
            nd.decode_attention(q, k, v, length=T, scale=scale, threads=threads)

    def int8_pass():
        for k, v, ks, vs in bytes_:
            nd.decode_attention(q, k, v, length=T, scale=scale, key_scales=ks, value_scales=vs,
                                threads=threads)  # fmt: skip

    # the same numbers first: the kernel over the rounded cache is torch over it
    k16, v16 = halves[0]
    want = F.scaled_dot_product_attention(q[:, :, None], k16[:, :, :T].float(),
                                          v16[:, :, :T].float(), scale=scale,
                                          enable_gqa=True)[:, :, 0]  # fmt: skip
    got, _ = nd.decode_attention(q, k16, v16, length=T, scale=scale, threads=threads)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    with torch.inference_mode():
        seconds = time_peers({"torch": torch_pass, "f16": f16_pass, "int8": int8_pass}, repeats,
                             warmup=2, statistic=statistic)  # fmt: skip
    return {name: 1e3 * s / LAYERS for name, s in seconds.items()}


def _bytes(k, v, T):
    """An 8-bit cache of k, v (its first T positions written by the kernel's own append)."""
    keys, values = torch.zeros_like(k, dtype=torch.int8), torch.zeros_like(v, dtype=torch.int8)
    ks, vs = torch.zeros(k.shape[:3]), torch.zeros(v.shape[:3])
    for t in range(T):
        nd.append(keys, values, k[:, :, t].contiguous(), v[:, :, t].contiguous(), t,
                  key_scales=ks, value_scales=vs)  # fmt: skip
    return keys, values, ks, vs


if __name__ == "__main__":
    main()

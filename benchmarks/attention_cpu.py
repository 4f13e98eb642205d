"""CPU benchmark of qkv's attention against torch's own, float32, under inference_mode.

Three tables:
1. `qkv.attend` with each backend (eager, sdpa, auto) versus torch's
   `F.scaled_dot_product_attention` on the same q, k, v, in the same run: milliseconds and
   the ratio to torch. Includes a grouped-query shape (Hkv < H) and a causal one. The
   `loop` oracle is timed once on a tiny shape only (it is pure Python, float64).
2. `qkv.nn.MultiHeadAttention(C, H, fused_qkv=True, backend="sdpa")` versus
   `torch.nn.MultiheadAttention(C, H, batch_first=True)` in eval mode with
   need_weights=False, weights copied so both compute the same thing (checked first with
   assert_close). Target: qkv / torch <= 1.05 at every shape.
3. Peak memory of the eager and sdpa backends at long sequences (B=1, H=8, D=64).
   Target: sdpa's peak at T=8192 is under a quarter of eager's.

Timing: a few warm-up calls, then the median of --repeats calls timed with
time.perf_counter; the peers are interleaved call by call (in a rotating order) so drift
in the machine affects them all alike.

    python benchmarks/attention_cpu.py [--quick] [--repeats N]
"""

from __future__ import annotations

import argparse
import resource
import subprocess
import sys
from functools import partial

import torch
import torch.nn.functional as F

import qkv
from qkv.nn import MultiHeadAttention
from timing import CORES, time_peers

MB = 2**20


def time_ms(fns: dict, repeats: int, warmup: int = 3) -> dict[str, float]:
    """Median milliseconds per call of each fn, interleaved (see timing.time_peers)."""
    return {name: 1e3 * s for name, s in time_peers(fns, repeats, warmup).items()}


def bench_attend(quick: bool, repeats: int) -> None:
    # (B, H, Hkv, T, D, causal)
    shapes = [(1, 8, 8, 128, 64, False), (8, 12, 12, 128, 64, False)]
    if not quick:
        shapes += [
            (4, 12, 12, 512, 64, False),
            (1, 8, 8, 1024, 64, False),
            (2, 8, 2, 512, 64, False),  # grouped-query: 4 query heads per key/value head
            (2, 8, 8, 1024, 64, True),
        ]
    print("1. attend, per call (ratio = time / torch sdpa)")
    header = f"{'B':>2} {'H':>3} {'Hkv':>3} {'T':>5} {'D':>3} {'causal':>6} | {'torch ms':>9}"
    for name in ("eager", "sdpa", "auto"):
        header += f" | {name + ' ms':>9} {'ratio':>6}"
    print(header)
    print("-" * len(header))
    for B, H, Hkv, T, D, causal in shapes:
        q = torch.randn(B, H, T, D)
        k, v = torch.randn(B, Hkv, T, D), torch.randn(B, Hkv, T, D)
        flags = {"is_causal": causal, "enable_gqa": Hkv != H}
        fns = {"torch": partial(F.scaled_dot_product_attention, q, k, v, **flags)}
        for name in ("eager", "sdpa", "auto"):
            fns[name] = partial(qkv.attend, q, k, v, causal=causal, backend=name)
        ms = time_ms(fns, repeats)
        row = f"{B:>2} {H:>3} {Hkv:>3} {T:>5} {D:>3} {causal!s:>6} | {ms['torch']:>9.3f}"
        for name in ("eager", "sdpa", "auto"):
            row += f" | {ms[name]:>9.3f} {ms[name] / ms['torch']:>6.2f}"
        print(row)
    # The loop oracle: pure Python over every (query, key) pair, so one tiny shape only.
    q, k, v = (torch.randn(1, 2, 16, 16) for _ in range(3))
    ms = time_ms(
        {
            "torch": partial(F.scaled_dot_product_attention, q, k, v),
            "loop": partial(qkv.attend, q, k, v, backend="loop"),
        },
        repeats=3,
        warmup=1,
    )
    print(
        f"loop (float64 oracle) at B=1 H=2 T=16 D=16: {ms['loop']:.1f} ms, "
        f"{ms['loop'] / ms['torch']:.0f}x torch sdpa; not timed at the shapes above"
    )


def paired_mha(C: int, H: int) -> tuple[MultiHeadAttention, torch.nn.MultiheadAttention]:
    """A qkv layer and a torch layer with the same weights, both in eval mode."""
    ours = MultiHeadAttention(C, H, fused_qkv=True, backend="sdpa").eval()
    theirs = torch.nn.MultiheadAttention(C, H, batch_first=True).eval()
    with torch.no_grad():
        ours.qkv.weight.copy_(theirs.in_proj_weight)
        ours.qkv.bias.copy_(theirs.in_proj_bias)
        ours.out.weight.copy_(theirs.out_proj.weight)
        ours.out.bias.copy_(theirs.out_proj.bias)
    return ours, theirs


def bench_mha(quick: bool, repeats: int) -> None:
    shapes = [(8, 128, 512, 8)]
    if not quick:
        shapes += [(4, 512, 768, 12), (1, 1024, 768, 12)]
    print("\n2. MultiHeadAttention, fused qkv, backend='sdpa', vs torch.nn.MultiheadAttention")
    header = (
        f"{'B':>2} {'T':>5} {'C':>4} {'H':>3} | {'qkv ms':>8} | {'torch ms':>8} | "
        f"{'qkv/torch':>9} | target <= 1.05"
    )
    print(header)
    print("-" * len(header))
    for B, T, C, H in shapes:
        ours, theirs = paired_mha(C, H)
        x = torch.randn(B, T, C)
        run_ours, run_theirs = partial(ours, x), partial(theirs, x, x, x, need_weights=False)
        # The same work: both layers must give the same output before they are timed.
        torch.testing.assert_close(run_ours()[0], run_theirs()[0], atol=1e-5, rtol=1e-5)
        ms = time_ms({"qkv": run_ours, "torch": run_theirs}, repeats)
        ratio = ms["qkv"] / ms["torch"]
        print(
            f"{B:>2} {T:>5} {C:>4} {H:>3} | {ms['qkv']:>8.3f} | {ms['torch']:>8.3f} | "
            f"{ratio:>9.3f} | {'PASS' if ratio <= 1.05 else 'MISS'}"
        )


def peak_child(backend: str, T: int) -> None:
    """Run in a fresh process: print how many bytes one forward raised the peak RSS by.

    Method: a fresh process per measurement, so nothing allocated or cached by earlier work
    hides or inflates the peak. Inputs are allocated and the kernels warmed up on a tiny
    shape first; then the process's high-water mark of resident memory is reset to the
    current RSS (Linux: writing 5 to /proc/self/clear_refs resets VmHWM), and the growth of
    VmHWM across the one measured call is what that call needed at its peak: temporaries
    plus output. getrusage's ru_maxrss alone is not enough on Linux: after fork and exec it
    still carries the parent's high-water mark, which hides any smaller peak; it is only the
    fallback where /proc is missing (then the numbers may read low).
    """
    torch.set_num_threads(CORES)
    with torch.inference_mode():
        small = torch.randn(1, 8, 64, 64)
        qkv.attend(small, small, small, backend=backend)
        q, k, v = (torch.randn(1, 8, T, 64) for _ in range(3))
        before = reset_peak()
        out = qkv.attend(q, k, v, backend=backend)
        print(read_peak() - before)
        del out


def _vm(field: str) -> int:
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith(field + ":"))
    return int(line.split()[1]) * 1024  # kB


def reset_peak() -> int:
    """Reset the peak RSS to the current RSS where possible; return the baseline, bytes."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return _vm("VmRSS")
    except OSError:
        return read_peak()


def read_peak() -> int:
    try:
        return _vm("VmHWM")
    except OSError:
        kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return kib if sys.platform == "darwin" else kib * 1024  # macOS reports bytes


def bench_memory(quick: bool) -> None:
    lengths = (1024, 2048) if quick else (4096, 8192)
    print("\n3. Peak memory of one forward, B=1 H=8 D=64 float32, a fresh process per cell")
    header = f"{'T':>5} | {'eager MB':>9} | {'sdpa MB':>9} | {'sdpa/eager':>10} | {'scores MB':>9}"
    print(header)
    print("-" * len(header))
    ratio = float("nan")
    for T in lengths:
        peak = {}
        for backend in ("eager", "sdpa"):
            cmd = [sys.executable, __file__, "--peak-child", backend, str(T)]
            result = subprocess.run(cmd, capture_output=True, text=True, check=True)
            peak[backend] = int(result.stdout.strip()) / MB
        ratio = peak["sdpa"] / peak["eager"]
        scores = 8 * T * T * 4 / MB  # the (B, H, T, T) float32 matrix eager materializes
        print(
            f"{T:>5} | {peak['eager']:>9.1f} | {peak['sdpa']:>9.1f} | {ratio:>10.4f} | "
            f"{scores:>9.0f}"
        )
    verdict = "PASS" if ratio < 0.25 else "MISS"
    print(f"target at T={lengths[-1]}: sdpa peak < 1/4 of eager's -> {verdict}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few small shapes: a smoke run")
    parser.add_argument("--repeats", type=int, default=None, help="timed calls per cell")
    parser.add_argument("--peak-child", nargs=2, metavar=("BACKEND", "T"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.peak_child:
        peak_child(args.peak_child[0], int(args.peak_child[1]))
        return
    repeats = args.repeats or (5 if args.quick else 20)
    torch.set_num_threads(CORES)
    torch.manual_seed(0)
    print(
        f"torch {torch.__version__}, qkv {qkv.__version__}, {torch.get_num_threads()} threads, "
        f"float32, inference_mode, median of {repeats} interleaved calls"
    )
    with torch.inference_mode():
        bench_attend(args.quick, repeats)
        bench_mha(args.quick, repeats)
    bench_memory(args.quick)


if __name__ == "__main__":
    main()

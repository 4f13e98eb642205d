"""qkv's `flash` kernel on a CUDA GPU: checked at full size, then timed beside torch's own.

1. Correctness, before any timing.
   - The tests' cases (tests/attention/flash_cases.py: every dtype, head size, mask, grouped
     KV heads, Tq != Tk, blind queries, packed sequences) at 32 times the tests' tokens,
     forward and gradients against float64.
   - Every benchmark shape at full size: qkv's output and gradients against torch's
     memory-efficient kernel run on the same inputs upcast to float32. qkv's relative error
     (||got - ref|| / ||ref||, the worst of out, dq, dk, dv) must be under 1e-2, where bf16
     operands land, or under twice the worst of torch's own bf16 kernels if that is more.
2. Speed. bf16, B x T = 16384 tokens, H x D = 2048, head size D = 64 and 128, T = 512 to
   16384, causal and not; forward and forward+backward of qkv's `flash` beside torch's
   scaled_dot_product_attention forced to each of its backends (FlashAttention-2, cuDNN,
   memory-efficient). Each time is the median of `triton.testing.do_bench` (CUDA events)
   after a warm-up that includes autotuning. TFLOP/s uses the FlashAttention papers'
   count: 4 B H T^2 D for the forward, 2.5 times that for the backward (so 3.5 times for
   forward+backward), halved when causal.

It prints one table and writes the full numbers as JSON (default
benchmarks/results/flash_gpu_<device>.json), with the shapes where qkv beat every torch
backend in both directions as `Measured(...)` lines for qkv.attention.flash.backend.

    PYTHONPATH=src python benchmarks/flash_gpu.py [--quick] [--out FILE]
    python benchmarks/flash_gpu.py --dry-run   # the same flow on the CPU, tiny, interpreted

Runs on torch 2.11 with triton 3.6 (the GPU image) and on this repository's pins.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if "--dry-run" in sys.argv:  # before anything imports triton: it reads this at import
    os.environ["TRITON_INTERPRET"] = "1"
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "tests" / "attention")]

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from flash_cases import CASES, TOLERANCE, check, check_varlen, scaled  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

from qkv.attention.flash import flash_attention  # noqa: E402

# (B x T tokens, H x D width, head sizes D, lengths T, how many times the tests' tokens
# the checks of flash_cases.py run at)
SIZES = {
    "full": (16384, 2048, [64, 128], [512, 1024, 2048, 4096, 8192, 16384], 32),
    "quick": (16384, 2048, [128], [4096, 16384], 32),
    "dry-run": (64, 128, [64], [32, 64], 1),
}
BF16_ERROR = 1e-2  # ||got - ref|| / ||ref|| of a bf16 computation, at most (METHOD.md)
TORCH_BACKENDS = {
    "torch-flash": SDPBackend.FLASH_ATTENTION,
    "torch-cudnn": SDPBackend.CUDNN_ATTENTION,
    "torch-efficient": SDPBackend.EFFICIENT_ATTENTION,
}


def flops(B: int, H: int, T: int, D: int, causal: bool, mode: str) -> float:
    """The FlashAttention papers' count: 4 B H T^2 D forward, 2.5x that backward."""
    forward = 4 * B * H * T * T * D / (2 if causal else 1)
    return forward * (3.5 if mode == "fwd+bwd" else 1.0)


def run_qkv(q, k, v, causal):
    return flash_attention(q, k, v, causal=causal)[0]


def run_torch(backend):
    def run(q, k, v, causal):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    return run


def peers(device: str) -> dict:
    runs = {"qkv-flash": run_qkv}
    if device == "cuda":
        runs |= {name: run_torch(backend) for name, backend in TORCH_BACKENDS.items()}
    else:  # the dry run: torch's fused backends are CUDA-only; its math backend stands in
        runs["torch-math"] = run_torch(SDPBackend.MATH)
    return runs


def shapes(args) -> list[tuple[int, int, int, int, bool]]:
    """(B, H, T, D, causal) with B x T = args.tokens and H x D = args.width."""
    out = []
    for D in args.head_dims:
        for T in args.lengths:
            for causal in (False, True):
                out.append((args.tokens // T, args.width // D, T, D, causal))
    return out


def inputs(B, H, T, D, device, dtype=torch.bfloat16, grad=False):
    return [
        torch.randn(B, H, T, D, device=device, dtype=dtype).requires_grad_(grad) for _ in range(3)
    ]


def forward_backward(run, q, k, v, causal, dout):
    for t in (q, k, v):
        t.grad = None
    out = run(q, k, v, causal)
    out.backward(dout)
    return out.detach(), [t.grad for t in (q, k, v)]


def norm_error(got, want) -> float:
    return ((got.float() - want).norm() / want.norm()).item()


def check_full_size(shape, device, runs) -> dict:
    """qkv and each torch backend against torch's float32 fused kernel, same inputs."""
    B, H, T, D, causal = shape
    q, k, v = inputs(B, H, T, D, device, grad=True)
    dout = torch.randn_like(q)
    up = [t.detach().float().requires_grad_() for t in (q, k, v)]
    reference = run_torch(SDPBackend.EFFICIENT_ATTENTION if device == "cuda" else SDPBackend.MATH)
    ref_out, ref_grads = forward_backward(reference, *up, causal, dout.float())
    errors = {}
    for name, run in runs.items():
        try:
            out, grads = forward_backward(run, q, k, v, causal, dout)
        except RuntimeError as e:  # a torch backend that does not take this shape
            errors[name] = f"unsupported: {str(e).splitlines()[0][:80]}"
            continue
        errors[name] = max(
            norm_error(got, want)
            for got, want in zip([out, *grads], [ref_out, *ref_grads], strict=True)
        )
    theirs = [e for name, e in errors.items() if name != "qkv-flash" and isinstance(e, float)]
    bar = max(BF16_ERROR, 2 * max(theirs, default=0.0))
    ok = isinstance(errors["qkv-flash"], float) and errors["qkv-flash"] < bar
    return {"shape": shape, "errors": errors, "bar": bar, "pass": ok}


def time_call(fn, device) -> float:
    """Median milliseconds of fn()."""
    if device == "cuda":
        import triton

        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
    times = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return sorted(times)[1]


def time_shape(shape, device, runs) -> dict:
    B, H, T, D, causal = shape
    q, k, v = inputs(B, H, T, D, device, grad=True)
    dout = torch.randn_like(q)
    row = {"B": B, "H": H, "T": T, "D": D, "causal": causal, "ms": {}, "tflops": {}}
    for name, run in runs.items():
        for mode in ("fwd", "fwd+bwd"):
            if mode == "fwd":

                def fn(run=run):
                    with torch.no_grad():
                        run(q, k, v, causal)
            else:

                def fn(run=run):
                    forward_backward(run, q, k, v, causal, dout)

            try:
                fn()  # compile and autotune outside the timing
                ms = time_call(fn, device)
            except RuntimeError:
                ms = None
            row["ms"][f"{name} {mode}"] = ms
            row["tflops"][f"{name} {mode}"] = (
                None if ms is None else flops(B, H, T, D, causal, mode) / (ms * 1e-3) / 1e12
            )
    return row


def fastest_regions(rows, device_name) -> list[str]:
    """Measured(...) lines for the shapes where qkv beat every torch backend both ways."""
    lines = []
    for row in rows:
        wins = []
        for mode in ("fwd", "fwd+bwd"):
            ours = row["tflops"][f"qkv-flash {mode}"]
            theirs = [v for k, v in row["tflops"].items() if k.endswith(f" {mode}") and
                      not k.startswith("qkv") and v is not None]  # fmt: skip
            wins.append(ours is not None and all(ours > t for t in theirs))
        if all(wins):
            lines.append(
                f'Measured("{device_name}", head_dim={row["D"]}, causal={row["causal"]}, '
                f"min_tokens={row['T']}, max_tokens={row['T']})"
            )
    return lines


def table(rows, names) -> str:
    head = f"{'D':>4} {'T':>6} {'causal':>6}  " + "  ".join(
        f"{name + ' ' + mode:>22}" for mode in ("fwd", "fwd+bwd") for name in names
    )
    lines = [head + "   qkv/best fwd  qkv/best f+b"]
    for row in rows:
        cells, ratios = [], []
        for mode in ("fwd", "fwd+bwd"):
            for name in names:
                t = row["tflops"][f"{name} {mode}"]
                cells.append(f"{'-' if t is None else f'{t:.1f}':>22}")
            theirs = [row["tflops"][f"{n} {mode}"] for n in names if n != "qkv-flash"]
            theirs = [t for t in theirs if t is not None]
            ours = row["tflops"][f"qkv-flash {mode}"]
            ratios.append(f"{ours / max(theirs):.2f}x" if theirs and ours else "-")
        lines.append(f"{row['D']:>4} {row['T']:>6} {row['causal']!s:>6}  " + "  ".join(cells) +
                     f"   {ratios[0]:>12}  {ratios[1]:>12}")  # fmt: skip
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="D=128 and T=4096, 16384 only")
    parser.add_argument("--dry-run", action="store_true", help="CPU, interpreter, tiny sizes")
    parser.add_argument("--out", type=Path, help="the JSON table (default under results/)")
    args = parser.parse_args()
    device = "cpu" if args.dry_run else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("flash_gpu.py needs a CUDA GPU (--dry-run runs its flow on the CPU)", file=sys.stderr)
        return 2
    size = "dry-run" if args.dry_run else "quick" if args.quick else "full"
    args.tokens, args.width, args.head_dims, args.lengths, factor = SIZES[size]
    device_name = torch.cuda.get_device_name() if device == "cuda" else "cpu (interpreter)"
    versions = {"torch": torch.__version__, "triton": __import__("triton").__version__}
    print(f"{device_name}; torch {versions['torch']}, triton {versions['triton']}", flush=True)

    torch.manual_seed(0)
    case_checks = []
    for case in CASES:
        big = scaled(case, factor)
        errors = check(big, device)
        worst = max(errors[n] for n in ("out", "dq", "dk", "dv"))
        ok = worst < TOLERANCE[case.dtype] and errors["blind"] == 0 and errors["lse"] < 1e-5
        case_checks.append({"case": str(big), "errors": errors, "pass": ok})
        print(f"check {big}: worst {worst:.1e} {'ok' if ok else 'FAILED'}", flush=True)
    lengths = [n * factor for n in (5, 0, 23, 17)], [n * factor for n in (9, 4, 23, 30)]
    errors = check_varlen(*lengths, device=device)
    ok = max(errors[n] for n in ("out", "dq", "dk", "dv")) < TOLERANCE[torch.bfloat16]
    case_checks.append({"case": f"varlen {lengths}", "errors": errors, "pass": ok})
    print(f"check varlen: {'ok' if ok else 'FAILED'}", flush=True)

    runs = peers(device)
    full_checks = []
    for shape in shapes(args):
        result = check_full_size(shape, device, runs)
        full_checks.append(result)
        print(f"check full size {shape}: {result['errors']} {'ok' if result['pass'] else 'FAILED'}",
              flush=True)  # fmt: skip
    passed = all(c["pass"] for c in case_checks + full_checks)
    if not passed:
        print("correctness checks FAILED: not timing", file=sys.stderr)

    slug = re.sub(r"[^a-z0-9]+", "-", device_name.lower()).strip("-")
    out = args.out or (
        None if args.dry_run else ROOT / "benchmarks" / "results" / f"flash_gpu_{slug}.json"
    )

    def save(rows: list, regions: list) -> None:
        """The JSON so far: written after every timed shape, so a run cut off by a lease's
        end keeps what it measured."""
        if out is None:
            return
        out.parent.mkdir(parents=True, exist_ok=True)
        result = {"device": device_name, **versions, "checks": case_checks}
        result |= {"full_size": full_checks, "rows": rows, "fastest": regions, "passed": passed}
        out.write_text(json.dumps(result, indent=1, default=str) + "\n")

    rows: list[dict] = []
    for shape in shapes(args) if passed else []:
        rows.append(time_shape(shape, device, runs))
        print(table(rows[-1:], list(runs)).splitlines()[-1], flush=True)
        save(rows, [])
    if rows:
        print(table(rows, list(runs)))
    regions = fastest_regions(rows, device_name)
    print("qkv fastest both ways at:" if regions else "qkv fastest both ways at: no shape")
    for line in regions:
        print("  " + line)
    save(rows, regions)
    if out is not None:
        print(f"wrote {out}")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())

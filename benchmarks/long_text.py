"""Long texts on SmolLM2: qkv's per-head summaries beside transformers' output_attentions.

At T = 1,024, 2,048 and 4,096 tokens of the same text, each side reads the text once and
gives the same per-head summaries (entropy and first-token mass of each query, its top 5
keys, the attention each key receives, a 256 x 256 max-downsampled heatmap):
- qkv: `Pretrained.attentions` (one forward pass, every layer's record) then
  `qkv.inspect.summaries.summarize`, which recomputes the weights 256 queries at a time;
- transformers: SmolLM2 loaded from the same GGUF file (as the `smollm2_hf` test fixture),
  eager attention, `output_attentions=True` (every layer's (H, T, T) float32 weights, the
  way bertviz and most notebooks get them), then the same summaries from those weights, a
  layer at a time (so that the peer's memory is its weights, not copies of them).

Each measurement runs in its own process (so that one's memory never counts in another's):
it loads the model, runs the whole thing once at 128 tokens (warm-up), then twice at T, timed
with time.perf_counter (the faster run counts: others share this machine); peak memory is
the process's maximum resident set (getrusage ru_maxrss), shown whole and above what the
loaded model already held. Each process runs with glibc's mmap threshold fixed at 1 MiB
(`ALLOCATOR`): glibc otherwise raises it as large blocks are freed, up to 32 MiB, and then
keeps freed blocks resident or not by the order of earlier allocations, which moved the same
forward's peak by up to 80 MB from one process to the next; fixed, a freed tensor leaves the
resident set at once, and the peak is what was alive (the same to 1 MB from one run to the
next). Where the peer's weights alone would not fit in the machine's
available memory, it is not run (it would only be killed, or swap), and the table says so.

Targets (issue 17): at T = 2,048, qkv's peak above the model < 1/4 of the peer's, and its time
no more than the peer's; at T = 4,096 qkv runs.

    python benchmarks/long_text.py [--lengths 1024,2048,4096]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

import torch

from timing import CORES

BASE = (
    "We walked for hours along the old towpath, past the mill, the lock and the row of "
    "cottages where the boatmen once lived. The water was high after a week of rain, brown "
    "and fast, carrying branches and leaves down towards the town. By the afternoon the "
    "clouds had cleared, and the river had begun to fall again, leaving a line of mud and "
    "reeds along the bank. "
)
TOP_K, BINS = 5, 256
REPEATS = 2  # runs at T in each process; the faster counts (the machine is shared)
ALLOCATOR = "glibc.malloc.mmap_threshold=1048576"  # each measured process's (see above)


def token_ids(T: int) -> list[int]:
    """The first T tokens of BASE repeated, by SmolLM2's tokenizer: the same on both sides."""
    import qkv

    tokenizer = qkv.load("smollm2").tokenizer
    ids = tokenizer.encode(BASE * (T // 40 + 1)).ids
    assert len(ids) >= T
    return ids[:T]


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


# ------------------------------------------------------------------ one measurement, in-process


def run_qkv(T: int) -> dict:
    import qkv
    from qkv.inspect.summaries import summarize

    model = qkv.load("smollm2")
    text = {n: model.tokenizer.decode(token_ids(n)) for n in (128, T)}

    def once(n: int):
        start = time.perf_counter()
        seen = model.attentions(text[n])
        middle = time.perf_counter()
        summary = summarize(seen, top_k=TOP_K, bins=BINS)
        return len(seen.tokens), middle - start, time.perf_counter() - middle, summary

    once(128)
    loaded = rss_mb()
    runs = [once(T) for _ in range(REPEATS)]
    tokens, forward, summaries, summary = min(runs, key=lambda run: run[1] + run[2])
    return {"tokens": tokens, "seconds": forward + summaries, "forward_s": forward,
            "summaries_s": summaries, "peak_mb": peak_mb(), "model_mb": loaded,
            "check": float(summary.entropy[-1, 0].mean())}  # fmt: skip


def eager_peer():
    """transformers' SmolLM2 from the embedded GGUF file, eager attention (the one that
    returns weights), float32: the peer of this file and of attentions.py."""
    import transformers

    from qkv.io.embedded import embedded_path

    path = embedded_path("smollm2")
    return transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32, attn_implementation="eager"
    ).eval()


def run_peer(T: int) -> dict:
    model = eager_peer()
    ids = {n: torch.tensor([token_ids(n)]) for n in (128, T)}

    def once(n: int):
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.model(ids[n], output_attentions=True)  # L x (1, H, T, T) float32
            summary = peer_summaries(out.attentions)
        return time.perf_counter() - start, summary

    once(128)
    loaded = rss_mb()
    seconds, summary = min((once(T) for _ in range(REPEATS)), key=lambda run: run[0])
    return {"tokens": T, "seconds": seconds, "peak_mb": peak_mb(), "model_mb": loaded,
            "check": float(summary["entropy"][-1, 0].mean())}  # fmt: skip


def peer_summaries(attentions) -> dict:
    """The same summaries, the direct way, from each layer's whole (H, T, T) weights."""
    summaries = [layer_summaries(a[0]) for a in attentions]
    return {name: torch.stack([s[name] for s in summaries]) for name in summaries[0]}


def layer_summaries(w: torch.Tensor) -> dict:
    H, T, _ = w.shape
    f = -(-T // BINS)
    padded = torch.nn.functional.pad(w, (0, -T % f, 0, -T % f)) if T % f else w
    R = padded.shape[-1] // f
    top = w.topk(TOP_K, dim=-1)
    return {
        "entropy": torch.special.entr(w).sum(-1),
        "first_token_mass": w[..., 0],
        "top_keys": top.indices,
        "top_weights": top.values,
        "received": w.sum(1, dtype=torch.float64),
        "heatmap": padded.reshape(H, R, f, R, f).amax(dim=(2, 4)),
    }


# ------------------------------------------------------------------ the table


def available_gb() -> float:
    with open("/proc/meminfo") as f:
        info = dict(line.split(":", 1) for line in f)
    return int(info["MemAvailable"].split()[0]) / 2**20


def measure(side: str, T: int, script: str = __file__) -> dict:
    """`script --one side --length T` in a fresh process: the JSON it printed last, or why
    it failed (attentions.py measures its cells this way too)."""
    tunables = ":".join(filter(None, [os.environ.get("GLIBC_TUNABLES"), ALLOCATOR]))
    found = subprocess.run(
        [sys.executable, script, "--one", side, "--length", str(T)],
        capture_output=True, text=True, check=False,
        env=os.environ | {"GLIBC_TUNABLES": tunables},
    )  # fmt: skip
    if found.returncode != 0:
        last = (found.stderr.strip().splitlines() or ["killed"])[-1]
        return {"error": f"failed (exit {found.returncode}): {last[:160]}"}
    return json.loads(found.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="1024,2048,4096")
    parser.add_argument("--one", choices=["qkv", "peer"], help=argparse.SUPPRESS)
    parser.add_argument("--length", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        result = (run_qkv if args.one == "qkv" else run_peer)(args.length)
        print(json.dumps(result))
        return
    lengths = [int(n) for n in args.lengths.split(",")]
    print(f"SmolLM2-135M (30 layers x 9 heads), float32, CPU, {CORES} cores, torch "
          f"{torch.__version__}; load average {os.getloadavg()[0]:.2f} at the start")  # fmt: skip
    print(f"each cell: the faster of {REPEATS} runs in a fresh process after a 128-token "
          "warm-up; peak = max RSS, "
          "'above model' = peak less the RSS of the loaded, warmed-up model\n")  # fmt: skip
    header = (f"{'T':>5}  {'qkv s':>7} {'(fwd + summ.)':>15} {'peer s':>8} {'time ratio':>10}  "
              f"{'qkv peak MB':>11} {'above model':>11} {'peer peak MB':>12} {'above model':>11}"
              f" {'memory ratio':>12}")  # fmt: skip
    print(header)
    for T in lengths:
        ours = measure("qkv", T)
        need = 30 * 9 * T * T * 4 / 2**30
        if need > 0.6 * available_gb():
            theirs = {"error": f"not run: its (L, H, T, T) float32 weights alone are "
                      f"{need:.1f} GiB, over 60% of the {available_gb():.1f} GiB free on "
                      "this shared machine, before the model and the forward's copies"}  # fmt: skip
        else:
            theirs = measure("peer", T)
        if "error" in ours:
            print(f"{T:>5}  qkv {ours['error']}")
            continue
        split = f"({ours['forward_s']:.1f} + {ours['summaries_s']:.1f})"
        mine_above = ours["peak_mb"] - ours["model_mb"]
        row = f"{T:>5}  {ours['seconds']:>7.1f} {split:>15} "
        if "error" in theirs:
            row += (f"{'-':>8} {'-':>10}  {ours['peak_mb']:>11.0f} {mine_above:>11.0f}"
                    f"   peer: {theirs['error']}")  # fmt: skip
        else:
            peer_above = theirs["peak_mb"] - theirs["model_mb"]
            row += (f"{theirs['seconds']:>8.1f} {ours['seconds'] / theirs['seconds']:>9.2f}x  "
                    f"{ours['peak_mb']:>11.0f} {mine_above:>11.0f} {theirs['peak_mb']:>12.0f} "
                    f"{peer_above:>11.0f} {mine_above / peer_above:>11.3f}x")  # fmt: skip
            if abs(ours["check"] - theirs["check"]) > 1e-3:
                row += f"  (mean entropies differ: {ours['check']} vs {theirs['check']})"
        print(row, flush=True)
    print(f"\nload average {os.getloadavg()[0]:.2f} at the end")
    print("ratios are qkv / peer: below 1 is qkv faster or smaller. Targets at T = 2,048: "
          "memory ratio < 0.25, time ratio <= 1; at 4,096 qkv runs.")  # fmt: skip


if __name__ == "__main__":
    main()

"""CPU benchmark of activation patching's full (layer, head) grid over a set of IOI-style pairs,
qkv vs TransformerLens.

The question: which heads carry the indirect object's name? 32 pairs "When Mary and John went
to the store, John gave a drink to" (clean: the answer is " Mary") and the same text with the
second name swapped ("..., Mary gave a drink to", corrupted), each pair with its own names, all
14 tokens long. The metric is each pair's logit difference at the last token, logit(IO) -
logit(S) (qkv's "diff: IO, S", log p(IO) - log p(S): the normalizer cancels), averaged over
the pairs. The grid: every (layer, head) of SmolLM2 (30 x 9), that head's output (before the
output projection, every position) patched from the clean run into the corrupted one.

- qkv: `qkv.patch(smollm2, cleans, corrupts, metrics, what="heads")` on the embedded GGUF,
  loaded by qkv: one clean and one corrupted forward over the batch of pairs, then for each
  layer one batched run of its heads x pairs, resumed from the corrupted stream at that layer.
- TransformerLens 4.3.0: `TransformerBridge.boot_transformers` on transformers' own load of
  the same GGUF file (float32, eager attention; the bridge keeps the Hugging Face weights as
  they are, no folding), offline (HF_HUB_OFFLINE=1, the model passed in as `hf_model`); then
  `run_with_cache` on the clean batch and `patching.get_act_patch_attn_head_out_all_pos`
  (hook_z of one head replaced per forward: 270 forwards of the corrupted batch).

Both read the same token ids (qkv's tokenizer). qkv and transformers each dequantize the GGUF
file themselves and sum in other orders, so the grids agree to float rounding, not bit for bit.
Timing: every call is timed (qkv after an untimed warm-up on one pair): qkv, TransformerLens,
qkv (with --rounds 2: qkv, TL, qkv, TL, qkv), so that drift in the machine falls on both; the
best call of each is compared, and each call's seconds are printed. The grids compared are
each peer's first. Float32, one process.

    HF_HUB_OFFLINE=1 python benchmarks/patch_tl.py [--rounds N] [--pairs N]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # TransformerLens asks the hub for nothing here
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch

import qkv
from qkv.io.embedded import embedded_path
from timing import CORES

NAMES = ["Mary", "John", "Tom", "James", "Anna", "Sarah", "David", "Paul", "Lisa", "Mark",
         "Emma", "Peter", "Kate", "Mike", "Alice", "Bob"]  # fmt: skip
PLACES = ["store", "park", "school", "office", "beach", "market", "station", "garden"]
THINGS = ["drink", "book", "ring", "letter", "bag", "gift"]
BOUND = 1e-3  # largest allowed |qkv - TransformerLens| in the mean grid


def ioi_pairs(count: int) -> list[tuple[str, str, str, str]]:
    """(clean, corrupt, IO, S): each pair its own two names, place and thing."""
    found = []
    for n in range(count):
        io_name, s_name = NAMES[n % len(NAMES)], NAMES[(3 * n + 1) % len(NAMES)]
        if io_name == s_name:
            s_name = NAMES[(n + 5) % len(NAMES)]
        place, thing = PLACES[n % len(PLACES)], THINGS[n % len(THINGS)]
        start = f"When {io_name} and {s_name} went to the {place},"
        found.append((f"{start} {s_name} gave a {thing} to",
                      f"{start} {io_name} gave a {thing} to", io_name, s_name))  # fmt: skip
    return found


def load_bridge():
    """TransformerLens's bridge on transformers' load of the embedded GGUF, offline."""
    import transformers
    from transformer_lens.model_bridge import TransformerBridge

    transformers.logging.set_verbosity_error()
    path = embedded_path("smollm2")
    with contextlib.redirect_stderr(io.StringIO()):  # loading progress bars
        hf = transformers.AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=torch.float32, attn_implementation="eager"
        ).eval()
        tokenizer = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        bridge = TransformerBridge.boot_transformers(
            "HuggingFaceTB/SmolLM2-135M-Instruct", hf_model=hf, tokenizer=tokenizer,
            device="cpu", dtype=torch.float32,
        )  # fmt: skip
    return bridge.eval()


def tl_grid(bridge, clean: torch.Tensor, corrupt: torch.Tensor, io_ids, s_ids) -> torch.Tensor:
    """The (L, H) grid the TransformerLens way: the mean logit difference over the pairs."""
    from transformer_lens import patching

    rows = torch.arange(clean.shape[0])
    io_ids, s_ids = torch.tensor(io_ids), torch.tensor(s_ids)

    def metric(logits: torch.Tensor) -> torch.Tensor:  # (B, T, vocab) -> ()
        last = logits[:, -1].double()
        return (last[rows, io_ids] - last[rows, s_ids]).mean()

    with torch.inference_mode(), contextlib.redirect_stderr(io.StringIO()):  # its tqdm bar
        _, cache = bridge.run_with_cache(clean)
        return patching.get_act_patch_attn_head_out_all_pos(bridge, corrupt, cache, metric)


def cpu_name() -> str:
    with contextlib.suppress(OSError), open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
        for line in cpuinfo:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return "unknown CPU"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=1, help="TransformerLens calls (1)")
    parser.add_argument("--pairs", type=int, default=32, help="IOI-style pairs (32)")
    args = parser.parse_args()
    torch.set_num_threads(CORES)
    from importlib.metadata import version

    import transformers

    print(f"torch {torch.__version__}, transformers {transformers.__version__}, "
          f"transformer-lens {version('transformer-lens')}, qkv {qkv.__version__}, "
          f"{torch.get_num_threads()} threads, float32")  # fmt: skip
    print(f"{cpu_name()}, {os.cpu_count()} cores; load average at start: "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")  # fmt: skip
    smollm2 = qkv.load("smollm2")
    bridge = load_bridge()
    pairs = ioi_pairs(args.pairs)
    cleans, corrupts = [p[0] for p in pairs], [p[1] for p in pairs]
    metrics = [f"diff: {io_name}, {s_name}" for _, _, io_name, s_name in pairs]
    clean_ids = torch.tensor([smollm2.encode(text).ids for text in cleans])  # (N, T)
    corrupt_ids = torch.tensor([smollm2.encode(text).ids for text in corrupts])
    io_ids = [smollm2.tokenizer.encode(" " + p[2], add_special_tokens=False).ids[0] for p in pairs]
    s_ids = [smollm2.tokenizer.encode(" " + p[3], add_special_tokens=False).ids[0] for p in pairs]
    L, H = 30, 9
    print(
        f"{len(pairs)} IOI-style pairs of {clean_ids.shape[1]} tokens; the full {L} x {H} grid "
        "of head outputs patched; metric: the mean logit difference logit(IO) - logit(S)"
    )

    def ours() -> torch.Tensor:
        return qkv.patch(smollm2, cleans, corrupts, metrics, what="heads").heads

    def theirs() -> torch.Tensor:
        return tl_grid(bridge, clean_ids, corrupt_ids, io_ids, s_ids)

    peers = {"qkv": ours, "TransformerLens": theirs}
    qkv.patch(smollm2, cleans[:1], corrupts[:1], metrics[:1], what="heads")  # warm-up, untimed
    order = ["qkv", "TransformerLens"] * args.rounds + ["qkv"]  # each round starts with the
    # other peer; qkv also last: the slow peer's calls sit between two of qkv's
    times: dict[str, list[float]] = {name: [] for name in peers}
    grids = {}
    for name in order:
        start = time.perf_counter()
        grid = peers[name]()
        times[name].append(time.perf_counter() - start)
        grids.setdefault(name, grid.double())
        print(f"  {name}: {times[name][-1]:.1f} s", file=sys.stderr, flush=True)
    gap = float((grids["qkv"] - grids["TransformerLens"]).abs().max())
    names = list(peers)
    ours_s, theirs_s = min(times["qkv"]), min(times["TransformerLens"])
    print(f"{'peer':>16} | {'seconds (best)':>14} | every round")
    for name in names:
        print(
            f"{name:>16} | {min(times[name]):>14.2f} | "
            + ", ".join(f"{t:.2f}" for t in times[name])
        )
    print(f"speedup: {theirs_s / ours_s:.1f}x (TransformerLens seconds / qkv seconds; target 10x)")
    print(
        f"grids agree: max |qkv - TransformerLens| = {gap:.1e} (bound {BOUND:g}): "
        f"{'PASS' if gap < BOUND else 'FAIL'}"
    )
    print(f"load average at end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return 0 if gap < BOUND else 1


if __name__ == "__main__":
    sys.exit(main())

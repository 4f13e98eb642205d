"""The atlas of heads over 100,000 tokens of text on SmolLM2-135M (embedded, no network):
how long `qkv.atlas` takes, where the time goes (the first pass that reads and checks the
corpus, the forward passes and statistics, the files), and the process's peak memory
(resource.getrusage's maxrss).

Targets (docs/atlas.md): under 15 minutes and under 4 GB on a 2-core CPU.

The text, all of it on this machine: the project's own pages (docs/*.md, README.md) and the
article qkv grew from (/work/shared/seed/self-attention-article.txt, or
src/qkv/inspect/article.py's copy where that file is absent), taken in turn and repeated until
the corpus holds --tokens tokens, written to a temporary text file.

    python benchmarks/atlas.py [--tokens 100000] [--window 256] [--batch 8]
"""

from __future__ import annotations

import argparse
import resource
import sys
import tempfile
import time
from pathlib import Path

import torch

import qkv
from qkv.viz.atlas import atlas

ROOT = Path(__file__).resolve().parent.parent
ARTICLE = Path("/work/shared/seed/self-attention-article.txt")


def texts() -> list[str]:
    pages = [path.read_text(encoding="utf-8") for path in sorted((ROOT / "docs").glob("*.md"))]
    pages.append((ROOT / "README.md").read_text(encoding="utf-8"))
    if ARTICLE.exists():
        pages.append(ARTICLE.read_text(encoding="utf-8"))
    return pages


def corpus(path: Path, tokenizer, tokens: int) -> int:
    """Write the pages in turn, repeated, until they hold `tokens` tokens; returns how many."""
    pages, held, parts = texts(), 0, []
    while held < tokens:
        for page in pages:
            parts.append(page.rstrip() + "\n\n")
            held += len(tokenizer.encode(page, add_special_tokens=False).ids)
            if held >= tokens:
                break
    path.write_text("".join(parts), encoding="utf-8")
    return held


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=100_000)
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args()
    start = time.perf_counter()
    smollm2 = qkv.load("smollm2")
    loaded = time.perf_counter() - start
    with tempfile.TemporaryDirectory() as folder:
        text = Path(folder, "corpus.txt")
        written = corpus(text, smollm2.tokenizer, args.tokens)
        seen = []

        def progress(done: int, total: int) -> None:
            seen.append((time.perf_counter(), done))

        start = time.perf_counter()
        found = atlas(smollm2, text, Path(folder, "atlas"), window=args.window,
                      batch=args.batch, max_tokens=args.tokens, progress=progress)  # fmt: skip
        took = time.perf_counter() - start
        first = seen[0][0] - start if seen else 0.0
        out = Path(folder, "atlas")
        size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
        pages = len(list((out / "examples").iterdir()))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB
    rows = [
        ("machine", f"{torch.get_num_threads()} threads, torch {torch.__version__}"),
        ("corpus", f"{written:,} tokens written (docs/*.md, README.md, the article, repeated)"),
        (
            "atlas read",
            f"{found.tokens:,} tokens in {found.windows:,} windows of "
            f"{args.window}, {args.batch} windows a batch",
        ),
        ("model load", f"{loaded:.1f} s"),
        ("atlas, all", f"{took:.1f} s ({took / 60:.1f} min); target < 15 min"),
        ("  first batch done", f"{first:.1f} s after the start (corpus read and checked)"),
        ("  tokens per second", f"{found.tokens / took:,.0f}"),
        ("output", f"{size / 2**20:.1f} MiB, {pages:,} example pages"),
        ("peak memory (maxrss)", f"{peak:.2f} GiB; target < 4 GB"),
    ]
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()

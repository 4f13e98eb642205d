"""CPU benchmark of sentence embeddings with all-MiniLM-L6-v2, qkv vs sentence-transformers.

`qkv.load("minilm").embed(sentences, batch_size=B)` versus
`SentenceTransformer(folder, device="cpu").encode(sentences, batch_size=B,
convert_to_tensor=True)` on the same embedded model folder, float32, 1,000 sentences of
mixed length (200 with --quick). Both sort the sentences by length before batching, pool by
the mean over real tokens and normalize.

The sentences are made deterministically: words drawn with a seeded random generator from the
model's own vocabulary (whole alphabetic words only), 3 to 120 words each, so every sentence
stays under sentence-transformers' max_seq_length of 256 tokens and neither side truncates.

qkv runs twice: in float32 (the same arithmetic as the peer) and with precision="bfloat16"
(matrix products in bfloat16; norms, softmax and pooling in float32), which is faster on CPUs
with bfloat16 instructions. Targets, for qkv's faster setting: sentences/s >= 1.2x
sentence-transformers' (float32, its default), with the smallest cosine similarity between
the two embeddings of a sentence > 0.9999.

Timing: one untimed call each (the one whose embeddings are compared) as warm-up, then the
median of --repeats calls timed with time.perf_counter; the peers are interleaved call by
call (in a rotating order) so drift in the machine affects them alike.

    python benchmarks/encode.py [--quick] [--repeats N] [--batch-size B]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import random
import statistics
from functools import partial

import torch
import torch.nn.functional as F

import qkv
from qkv.io.embedded import embedded_path
from timing import CORES, time_peers


def make_sentences(n: int, seed: int = 0, shortest: int = 3, longest: int = 120) -> list[str]:
    """n sentences of shortest..longest words from MiniLM's vocabulary, the same every run.

    >>> [len(s.split()) for s in make_sentences(2)]
    [111, 66]
    >>> make_sentences(1)[0].split()[:3]
    ['Undoubtedly', 'vent', 'follow']
    """
    vocab = (embedded_path("minilm") / "vocab.txt").read_text(encoding="utf-8").split()
    words = [w for w in vocab if w.isascii() and w.isalpha() and len(w) > 2]  # no ##pieces
    rng = random.Random(seed)
    sentences = []
    for _ in range(n):
        length = rng.randint(shortest, longest)
        sentences.append(" ".join(rng.choice(words) for _ in range(length)).capitalize() + ".")
    return sentences


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="200 sentences: a smoke run")
    parser.add_argument("--repeats", type=int, default=None, help="timed calls each")
    parser.add_argument("--batch-size", type=int, default=64, help="sentences per forward")
    args = parser.parse_args()
    repeats = args.repeats or (2 if args.quick else 5)
    torch.set_num_threads(CORES)

    import sentence_transformers
    from sentence_transformers import SentenceTransformer

    print(
        f"torch {torch.__version__}, sentence-transformers {sentence_transformers.__version__}, "
        f"qkv {qkv.__version__}, {torch.get_num_threads()} threads, float32, "
        f"median of {repeats} interleaved calls"
    )
    sentences = make_sentences(200 if args.quick else 1000)
    ours = qkv.load("minilm")
    with contextlib.redirect_stderr(io.StringIO()):  # transformers' loading progress bar
        theirs = SentenceTransformer(str(embedded_path("minilm")), device="cpu")
    lengths = [len(ours.tokenizer.encode(s).ids) for s in sentences]
    print(
        f"{len(sentences)} sentences, {min(lengths)} to {max(lengths)} tokens "
        f"(median {statistics.median(lengths):.0f}), batch size {args.batch_size}"
    )

    fns = {
        "qkv float32": partial(ours.embed, sentences, batch_size=args.batch_size),
        "qkv bfloat16": partial(
            ours.embed, sentences, batch_size=args.batch_size, precision="bfloat16"
        ),
        "sentence-transformers": partial(
            theirs.encode,
            sentences,
            batch_size=args.batch_size,
            convert_to_tensor=True,
            show_progress_bar=False,
        ),
    }
    # The same work: the embeddings are compared first, and these calls are the warm-up.
    reference = fns["sentence-transformers"]()
    lowest = {
        name: F.cosine_similarity(fns[name](), reference, dim=-1).min().item()
        for name in ("qkv float32", "qkv bfloat16")
    }
    seconds = time_peers(fns, repeats, warmup=0)

    rate = {name: len(sentences) / s for name, s in seconds.items()}
    for name, r in rate.items():
        print(f"{name:>21}: {r:7.1f} sentences/s  ({seconds[name]:6.2f} s per call)")
    for name in lowest:
        ratio = rate[name] / rate["sentence-transformers"]
        ok = ratio >= 1.2 and lowest[name] > 0.9999
        print(
            f"{name}/sentence-transformers: {ratio:.2f}x, lowest cosine {lowest[name]:.7f}; "
            f"target >= 1.2x with cosine > 0.9999 -> {'PASS' if ok else 'MISS'}"
        )


if __name__ == "__main__":
    main()

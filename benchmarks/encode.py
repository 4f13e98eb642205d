"""CPU benchmark of sentence embeddings with all-MiniLM-L6-v2, qkv vs sentence-transformers.

`qkv.load("minilm").embed(sentences, batch_size=B)` versus
`SentenceTransformer(folder, device="cpu").encode(sentences, batch_size=B,
convert_to_tensor=True)` on the same embedded model folder, float32, 1,000 sentences of
mixed length (200 with --quick). Both sort the sentences by length before batching, pool by
the mean over real tokens and normalize.

The sentences are made deterministically: words drawn with a seeded random generator from the
model's own vocabulary (whole alphabetic words only), 3 to 120 words each, so every sentence
stays under sentence-transformers' max_seq_length of 256 tokens and neither side truncates.

qkv runs three times: as called by default (precision "auto": bfloat16 where the CPU has
bfloat16 instructions, float32 elsewhere; `qkv backends --verbose` says which), in float32
(the same arithmetic as the peers) and with precision="bfloat16" (matrix products in
bfloat16; norms, softmax and pooling in float32). The second peer is ONNX Runtime on the same
model, exported here from transformers' BertModel (sentence-transformers' own ONNX backend
needs an older transformers), tokenized, cut at 256 tokens and pooled as
sentence-transformers does. Targets, for qkv's default: sentences/s >= 1.2x
sentence-transformers' (float32, its default) and >= 1.0x ONNX Runtime's, with the smallest
cosine similarity to sentence-transformers' embedding of a sentence > 0.9999.

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
import tempfile
import warnings
from functools import partial

import torch
import torch.nn.functional as F

import qkv
from qkv.io.embedded import embedded_path
from timing import CORES, machine, time_peers


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


def onnx_runtime_encoder(folder, batch_size: int, work: str):
    """(encode(sentences) -> (N, C) normalized mean-pooled embeddings, onnxruntime's version):
    the model exported here to ONNX (transformers' BertModel, dynamic batch and length) and
    run by ONNX Runtime with every graph optimization, on CORES threads; tokenized, sorted by
    length, cut at 256 tokens and pooled as sentence-transformers does. None where
    onnxruntime (or onnx, for the export) is not installed."""
    try:
        import onnxruntime
    except ImportError:
        return None
    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    with contextlib.redirect_stderr(io.StringIO()):  # transformers' loading progress bar
        model = AutoModel.from_pretrained(folder).eval()
    path = f"{work}/minilm.onnx"
    sample = tokenizer(["a b c", "d"], padding=True, return_tensors="pt")
    names = ["input_ids", "attention_mask", "token_type_ids"]
    axes = {name: {0: "batch", 1: "tokens"} for name in names}

    class ByName(torch.nn.Module):  # the inputs by name: BertModel's order is not ours
        def __init__(self):
            super().__init__()
            self.bert = model

        def forward(self, input_ids, attention_mask, token_type_ids):
            return self.bert(input_ids=input_ids, attention_mask=attention_mask,
                             token_type_ids=token_type_ids).last_hidden_state  # fmt: skip

    with torch.no_grad(), contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the exporter's notes on transformers' Python code
        torch.onnx.export(ByName(), tuple(sample[n] for n in names), path, input_names=names,
                          output_names=["last_hidden_state"], dynamic_axes=axes,
                          opset_version=17, dynamo=False)  # fmt: skip
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = CORES
    options.inter_op_num_threads = 1
    options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_ENABLE_ALL
    session = onnxruntime.InferenceSession(path, options, providers=["CPUExecutionProvider"])

    def encode(sentences: list[str]) -> torch.Tensor:
        order = sorted(range(len(sentences)), key=lambda i: -len(sentences[i]))
        out = torch.empty(len(sentences), model.config.hidden_size)
        for start in range(0, len(order), batch_size):
            rows = order[start : start + batch_size]
            batch = tokenizer([sentences[i] for i in rows], padding=True, truncation=True,
                              max_length=256, return_tensors="np")  # fmt: skip
            (hidden,) = session.run(None, {n: batch[n] for n in names})
            mask = torch.from_numpy(batch["attention_mask"])[..., None].float()
            pooled = (torch.from_numpy(hidden) * mask).sum(1) / mask.sum(1)
            out[rows] = F.normalize(pooled, dim=-1)
        return out

    return encode, onnxruntime.__version__


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

    print(machine())
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

    from qkv.device import choose_precision

    default = f"qkv default ({choose_precision()[0]})"
    fns = {
        default: partial(ours.embed, sentences, batch_size=args.batch_size),
        "qkv float32": partial(
            ours.embed, sentences, batch_size=args.batch_size, precision="float32"
        ),
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
    with tempfile.TemporaryDirectory() as work:
        onnx = onnx_runtime_encoder(str(embedded_path("minilm")), args.batch_size, work)
        if onnx is None:
            print("ONNX Runtime: onnxruntime is not installed (make bench installs it)")
        else:
            fns["ONNX Runtime"] = partial(onnx[0], sentences)
            print(f"ONNX Runtime {onnx[1]}: transformers' BertModel exported here, opset 17")
        # The same work: the embeddings are compared first, and these calls are the warm-up.
        reference = fns["sentence-transformers"]()
        lowest = {
            name: F.cosine_similarity(fns[name](), reference, dim=-1).min().item()
            for name in fns
            if name != "sentence-transformers"
        }
        seconds = time_peers(fns, repeats, warmup=0)

    rate = {name: len(sentences) / s for name, s in seconds.items()}
    for name, r in rate.items():
        print(f"{name:>26}: {r:7.1f} sentences/s  ({seconds[name]:6.2f} s per call)")
    for name in (default, "qkv float32", "qkv bfloat16"):
        for peer, target in (("sentence-transformers", 1.2), ("ONNX Runtime", 1.0)):
            if peer not in rate:
                continue
            ratio = rate[name] / rate[peer]
            ok = ratio >= target and lowest[name] > 0.9999
            print(
                f"{name}/{peer}: {ratio:.2f}x, lowest cosine to sentence-transformers "
                f"{lowest[name]:.7f}; target >= {target}x with cosine > 0.9999 -> "
                f"{'PASS' if ok else 'MISS'}"
            )
    if "ONNX Runtime" in lowest:
        print(
            f"ONNX Runtime's lowest cosine to sentence-transformers: {lowest['ONNX Runtime']:.7f}"
        )


if __name__ == "__main__":
    main()

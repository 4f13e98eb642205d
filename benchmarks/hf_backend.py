"""Every layer's attention weights of SmolLM2 inside transformers: attn_implementation="qkv"
(qkv.hf) beside "eager", the one transformers returns weights from.

Both sides are the same transformers model, SmolLM2 loaded from the embedded GGUF file in
float32 (long_text.py's `eager_peer`); the qkv side then switches to qkv's attention with
`set_attn_implementation("qkv")`. At T = 512 and 1,024 tokens of the same text, each side
runs `model.model(ids, output_attentions=True)` and hands back every layer's (1, H, T, T)
weights: eager's from its matmul - softmax - matmul, qkv's made with each layer's output
(`qkv.attention.eager.attend_into`: eager's arithmetic, a block of queries at a time). Both
are checked to agree (the largest difference of any weight of the last rows is printed).
Each measurement runs in its own process (long_text.py's way): a warm-up at 128 tokens, then
the faster of 2 runs at T; peak memory is the process's maximum resident set, shown whole
and above what the loaded model held before any pass (glibc's mmap threshold fixed: see
long_text.py; attentions.py says why before the warm-up). The qkv side also times the same
forward without output_attentions ('alone', one `qkv.attend` a layer: sdpa's kernel):
eager's time over it ('bound') is the most speed any attention that returns weights could
reach in this model.

Target (issue 20): qkv at least 1.5x faster at both lengths, its memory no more than eager's.

    python benchmarks/hf_backend.py [--lengths 512,1024]
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from attentions import REPEATS, alone, output_attentions, table
from long_text import eager_peer, token_ids
from timing import CORES, machine


def run(side: str, T: int) -> dict:
    model = eager_peer()
    if side == "qkv":
        import qkv.hf

        model.set_attn_implementation(qkv.hf.NAME)
        qkv.hf.check(model)
    found, last = output_attentions(model, T)
    path = f"/tmp/qkv-hf-backend-{T}.pt"
    if side == "qkv":
        torch.save(last, path)
        ids = torch.tensor([token_ids(T)])
        found["alone"] = alone(lambda: model.model(ids))  # one qkv.attend a layer: sdpa's
    else:
        found["max_difference"] = float((torch.load(path) - last).abs().max())
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="512,1024")
    parser.add_argument("--one", choices=["qkv", "peer"], help=argparse.SUPPRESS)
    parser.add_argument("--length", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        torch.set_num_threads(CORES)
        print(json.dumps(run(args.one, args.length)))
        return
    import transformers

    print(machine())
    print(
        f"SmolLM2-135M (30 layers x 9 heads) in transformers {transformers.__version__}, "
        f"float32, torch {torch.__version__}: attn_implementation 'qkv' against 'eager', "
        f"output_attentions=True; load average {os.getloadavg()[0]:.2f}"
    )
    print(f"each cell the faster of {REPEATS} runs in a fresh process after a 128-token "
          "warm-up; peak = max RSS, 'above' = peak less the RSS of the model loaded, before "
          "any pass; 'alone' = the qkv side without output_attentions, 'bound' = eager s / "
          "alone s\n")  # fmt: skip
    table([int(n) for n in args.lengths.split(",")], __file__, "eager")


if __name__ == "__main__":
    main()

"""CPU benchmark of greedy decoding from a Q4_K_M GGUF, the kind most downloads are: qkv
against llama.cpp on the same file, the same prompt ids and thread count.

The file is made here from the embedded SmolLM2-135M-Instruct Q4_1 by llama.cpp's own
quantizer (`llama_model_quantize`, Q4_K_M, requantizing: the numbers are not the model's best,
the work is what a Q4_K_M file asks). SmolLM2's 576 columns are no whole K-quant super-blocks
(256), so llama.cpp keeps most of its matrices in Q5_0 and its v in Q8_0, and only the MLPs'
down projections in Q4_K and Q6_K: the benchmark prints the mixture. qkv decodes the file's
own blocks (5-bit, 8-bit and K-quant products of 8-bit activations), each token in one native
call (`NativeStep`). Both read the prompt on every call; each new token's time after the
prompt is given apart, as in benchmarks/generate.py. Target (issue 39): >= 1.3x llama.cpp.

    python benchmarks/generate_q4_k_m.py [--repeats N] [--new N]
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import tempfile
from pathlib import Path

import qkv
from generate import PROMPT, llama_cpp_decode
from qkv import native
from qkv.generate import Sampling, decode_steps
from qkv.generate.native_step import native_step_refusal
from qkv.io.embedded import embedded_path
from qkv.io.gguf import _map
from qkv.io.gguf_header import read_header
from timing import CORES, machine, time_peers


def q4_k_m(folder: Path) -> Path:
    """The embedded SmolLM2 requantized to Q4_K_M by llama.cpp's quantizer."""
    import llama_cpp

    target = folder / "smollm2-q4_k_m.gguf"
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M
    params.allow_requantize = True
    params.nthread = CORES
    source = str(embedded_path("smollm2")).encode()
    if llama_cpp.llama_model_quantize(source, str(target).encode(), ctypes.byref(params)):
        raise RuntimeError("llama.cpp's quantizer failed")
    return target


def mixture(path: Path) -> str:
    header = read_header(_map(path), path)
    kinds = collections.Counter(i.ggml_type.name for i in header.tensors if len(i.shape) == 2)
    return ", ".join(f"{n} {kind}" for kind, n in kinds.most_common())


def decode_against_llama(path: Path, repeats: int, N: int) -> None:
    """qkv's greedy decoding of the file at `path` against llama.cpp's, the same prompt ids,
    N new tokens, calls interleaved: tokens a second, the ratio, each token after the prompt
    and the prompt with the first token apart."""
    ours = qkv.load(str(path))
    model, why = ours.generation_model()
    print(f"qkv: {why}; NativeStep: {native_step_refusal(model, 1, False) or 'runs it'}")
    ids, _ = ours.tokenizer.encode_batch([PROMPT], padding_side="left")
    T = ids.shape[1]
    mine = [int(t) for t in decode_steps(model, ids, None, Sampling(), N)]
    llama, (theirs, version) = llama_cpp_decode(ids[0].tolist(), N, path)
    same = next((i for i, (a, b) in enumerate(zip(mine, theirs, strict=True)) if a != b), N)
    print(f"llama.cpp (llama-cpp-python {version}): the same greedy tokens as qkv's for the "
          f"first {same} of {N}")  # fmt: skip

    def qkv_decode(n: int):
        return lambda: list(decode_steps(model, ids, None, Sampling(), n))

    fns = {"qkv": qkv_decode(N), "llama.cpp": llama}
    seconds = time_peers(fns, repeats)
    print(f"Greedy decoding, prompt of {T} tokens, {N} new tokens, {CORES} threads, median "
          f"of {repeats} interleaved calls:")  # fmt: skip
    for name, s in seconds.items():
        print(f"{name:>10}: {N / s:7.1f} tokens/s  ({1e3 * s / N:5.2f} ms a token, prompt "
              f"included)")  # fmt: skip
    ratio = seconds["llama.cpp"] / seconds["qkv"]
    print(f"qkv/llama.cpp: {ratio:.2f}x; target >= 1.3x -> "
          f"{'PASS' if ratio >= 1.3 else 'MISS'}")  # fmt: skip
    one_llama, _ = llama_cpp_decode(ids[0].tolist(), 1, path)
    first = time_peers({"qkv": qkv_decode(1), "llama.cpp": one_llama}, repeats)
    each = {k: (seconds[k] - first[k]) / (N - 1) for k in seconds}
    print(f"each token after the prompt: qkv {1e3 * each['qkv']:.2f} ms, llama.cpp "
          f"{1e3 * each['llama.cpp']:.2f} ms ({each['llama.cpp'] / each['qkv']:.2f}x); "
          f"the prompt and the first token: qkv {1e3 * first['qkv']:.1f} ms, llama.cpp "
          f"{1e3 * first['llama.cpp']:.1f} ms")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--new", type=int, default=64, help="new tokens a call")
    args = parser.parse_args()
    N = args.new
    try:
        import llama_cpp  # noqa: F401  (its quantizer makes the file; it is the peer)
    except ImportError:
        print("llama-cpp-python is not installed (make bench installs it): nothing to measure")
        return
    print(machine())
    print(native.describe())
    with tempfile.TemporaryDirectory() as folder:
        path = q4_k_m(Path(folder))
        print(f"{path.name} ({path.stat().st_size / 2**20:.1f} MiB), its matrices: "
              f"{mixture(path)}")  # fmt: skip
        decode_against_llama(path, args.repeats, N)


if __name__ == "__main__":
    main()

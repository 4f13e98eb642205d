"""CPU benchmark of greedy decoding from a GGUF whose matrices are K-quants (Q4_K, Q6_K): qkv
against llama.cpp on the same file, the same prompt ids and thread count.

benchmarks/generate_q4_k_m.py requantizes SmolLM2, whose 576 columns are no whole K-quant
super-blocks (256), so llama.cpp keeps it mostly in Q5_0. A model whose widths are whole
super-blocks (Llama 3.2, Qwen3, Gemma) is Q4_K and Q6_K through and through; this benchmark
makes one of SmolLM2's size here: a Llama of 768 wide, 16 blocks of 12 heads (4 key-value
heads) of 64 and an MLP 2048 wide, SmolLM2's vocabulary, random weights (std 0.02), written
in float16 with gguf-py and quantized to Q4_K_M by llama.cpp's own quantizer
(`llama_model_quantize`). The tokens are meaningless; the work is a real Q4_K_M file's.
qkv decodes the file's own blocks (K-quant products of 8-bit activations, `NativeStep`).
Target (issue 39): >= 1.3x llama.cpp.

    python benchmarks/generate_kquants.py [--repeats N] [--new N] [--ftype Q4_K_M]
"""

from __future__ import annotations

import argparse
import ctypes
import os
import tempfile
from pathlib import Path

import gguf
import numpy as np

from generate_q4_k_m import decode_against_llama, mixture
from qkv import native
from qkv.io.embedded import embedded_path
from qkv.io.gguf import _map
from qkv.io.gguf_header import read_header
from timing import CORES, machine

WIDTH, LAYERS, HEADS, KV_HEADS, HEAD, MLP = 768, 16, 12, 4, 64, 2048
TOKENIZER_KEYS = ("tokens", "token_type", "merges", "bos_token_id", "eos_token_id",
                  "padding_token_id", "unknown_token_id", "add_bos_token")  # fmt: skip


def float16_file(path: Path, seed: int = 0) -> None:
    """A random Llama of WIDTH x LAYERS in float16, with the embedded SmolLM2's tokenizer."""
    source = embedded_path("smollm2")
    meta = read_header(_map(source), source).metadata
    tokens = meta["tokenizer.ggml.tokens"]
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(LAYERS)
    writer.add_context_length(8192)
    writer.add_embedding_length(WIDTH)
    writer.add_feed_forward_length(MLP)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(100000.0)
    writer.add_rope_dimension_count(HEAD)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    writer.add_tokenizer_model(meta["tokenizer.ggml.model"])
    writer.add_tokenizer_pre(meta.get("tokenizer.ggml.pre", "default"))
    writer.add_token_list(tokens)
    writer.add_token_types(meta["tokenizer.ggml.token_type"])
    writer.add_token_merges(meta["tokenizer.ggml.merges"])
    writer.add_bos_token_id(meta["tokenizer.ggml.bos_token_id"])
    writer.add_eos_token_id(meta["tokenizer.ggml.eos_token_id"])
    writer.add_vocab_size(len(tokens))
    rng = np.random.default_rng(seed)

    def matrix(rows: int, columns: int) -> np.ndarray:
        return (rng.standard_normal((rows, columns), np.float32) * 0.02).astype(np.float16)

    writer.add_tensor("token_embd.weight", matrix(len(tokens), WIDTH))
    writer.add_tensor("output_norm.weight", np.ones(WIDTH, np.float32))
    for i in range(LAYERS):
        for name, (rows, columns) in {
            "attn_q": (HEADS * HEAD, WIDTH),
            "attn_k": (KV_HEADS * HEAD, WIDTH),
            "attn_v": (KV_HEADS * HEAD, WIDTH),
            "attn_output": (WIDTH, HEADS * HEAD),
            "ffn_gate": (MLP, WIDTH),
            "ffn_up": (MLP, WIDTH),
            "ffn_down": (WIDTH, MLP),
        }.items():
            writer.add_tensor(f"blk.{i}.{name}.weight", matrix(rows, columns))
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(WIDTH, np.float32))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(WIDTH, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def quantized(source: Path, target: Path, ftype: str) -> Path:
    """`source` quantized to `ftype` (e.g. Q4_K_M) by llama.cpp's quantizer."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
    params.nthread = CORES
    if llama_cpp.llama_model_quantize(str(source).encode(), str(target).encode(),
                                      ctypes.byref(params)):  # fmt: skip
        raise RuntimeError("llama.cpp's quantizer failed")
    return target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--new", type=int, default=64, help="new tokens a call")
    parser.add_argument("--ftype", default="Q4_K_M", help="llama.cpp's file type, e.g. Q4_K_S")
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
        wide = Path(folder) / "wide-f16.gguf"
        float16_file(wide)
        path = quantized(wide, Path(folder) / f"wide-{args.ftype.lower()}.gguf", args.ftype)
        size = path.stat().st_size / 2**20
        print(f"{path.name}: a random Llama {WIDTH} wide, {LAYERS} blocks, MLP {MLP} "
              f"({size:.1f} MiB), its matrices: {mixture(path)}")  # fmt: skip
        # the dequantized weights' cache (560 MB) goes with the file; the kernels are loaded
        os.environ["XDG_CACHE_HOME"] = str(Path(folder) / "cache")
        decode_against_llama(path, args.repeats, N)


if __name__ == "__main__":
    main()

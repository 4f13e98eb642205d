"""A .gguf file of K-quant matrices (Q4_K and Q6_K, as llama-quantize's Q4_K_M mixes them),
written here: loaded with int4=True, its blocks stay as they are (QuantLinear, qkv's
kernels) and its logits follow the file's float32 load (the same blocks, dequantized) to the
rounding of the inputs; generate decodes with them, through FastStep."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers as hf
from test_gguf_arches import TOKENS, convert

import qkv
from kquant_blocks import random_blocks
from qkv.generate import precision
from qkv.generate.native_step import native_step_refusal
from qkv.nn.quant_linear import QuantLinear, kernels

pytestmark = pytest.mark.skipif(kernels() is None, reason="no native kernels")


def k_blocks(shape: tuple[int, int], fmt: str, rng) -> np.ndarray:
    """Random K-quant blocks of a matrix of `shape`, with super-block scales small enough
    (about 0.002) that the model's activations stay of a usual size."""
    N, K = shape
    raw = random_blocks(fmt, N, K, rng).reshape(N, K // 256, -1)
    scale = (rng.uniform(0.5, 1.0, (N, K // 256, 2)) * 2e-3).astype(np.float16)
    at = slice(208, 210) if fmt == "Q6_K" else slice(0, 4)
    raw[:, :, at] = scale[..., : 1 if fmt == "Q6_K" else 2].view(np.uint8).reshape(N, K // 256, -1)
    return raw.reshape(N, -1)


def test_a_k_quant_file_keeps_its_blocks_and_follows_its_float32_load(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    config = hf.LlamaConfig(vocab_size=len(TOKENS), hidden_size=256, intermediate_size=512,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                            max_position_embeddings=256, rms_norm_eps=1e-5,
                            tie_word_embeddings=False)  # fmt: skip
    torch.manual_seed(0)
    model = hf.LlamaForCausalLM(config).eval()
    rng = np.random.default_rng(0)
    raw = {}
    # the file's block matrices are random K-quant blocks (gguf-py writes no K-quants); both
    # loads read them from the file, so the model's own float matrices are not written
    for i, layer in enumerate(model.model.layers):
        mats = {"attn_q": layer.self_attn.q_proj, "attn_k": layer.self_attn.k_proj,
                "attn_v": layer.self_attn.v_proj, "attn_output": layer.self_attn.o_proj,
                "ffn_gate": layer.mlp.gate_proj, "ffn_up": layer.mlp.up_proj,
                "ffn_down": layer.mlp.down_proj}  # fmt: skip
        for name, linear in mats.items():
            fmt = "Q6_K" if name in ("attn_v", "ffn_down") else "Q4_K"  # Q4_K_M's mix
            raw[f"blk.{i}.{name}.weight"] = (fmt, k_blocks(tuple(linear.weight.shape), fmt, rng))
    path = tmp_path / "q4_k_m.gguf"
    convert(model, "llama", path, raw=raw)
    dense = qkv.load(str(path))
    packed = qkv.load(str(path), int4=True)
    layers = {m.fmt for m in packed.model.modules() if type(m) is QuantLinear}
    assert layers == {"Q4_K", "Q6_K"}
    ids = torch.tensor([[1, 5, 9, 3, 7, 11, 2, 4]]) % len(TOKENS)
    with torch.inference_mode():
        want, got = dense.model(ids).logits, packed.model(ids).logits
    spread = float(want.max() - want.min())
    off = float((got - want).abs().max()) / spread
    assert off < 0.03, f"the K-quant products are {off:.1%} of the logits' spread off"
    # generate keeps the blocks too, and decodes them in the native step
    gen, why = dense.generation_model("auto")
    assert why.endswith("own blocks (Q4_K, Q6_K), as the file holds them"), why
    assert {m.fmt for m in gen.modules() if type(m) is QuantLinear} == layers
    assert native_step_refusal(gen, 1, False) is None
    assert dense.generate("a b", 4, precision="auto") == packed.generate("a b", 4)
    # without qkv's kernels (no compiler, QKV_NATIVE=0) no kernel holds K-quants: the model
    # as loaded decodes, and says why (it had raised from torch's int4 path)
    fresh = qkv.load(str(path))
    monkeypatch.setattr(precision, "in_generation", lambda: False)
    model, why = fresh.generation_model("auto")
    assert model is fresh.model and "no Q4_0 or Q4_1 matrices" in why, why
    with pytest.raises(ValueError, match="no Q4_0 or Q4_1 matrices"):
        fresh.generation_model("int4")

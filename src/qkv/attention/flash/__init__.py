"""`flash`: qkv's own fused attention kernel, written in Triton (FlashAttention-2).

Tiles of queries against tiles of keys with an online softmax in float32, so the T x T
weights never sit in memory; a backward that recomputes them from the saved log-sum-exp;
grouped KV heads read in place; boolean masks; packed variable-length batches. It runs on
CUDA GPUs, and on the CPU under `TRITON_INTERPRET=1` (how the tests check it).

    out, lse = flash_attention(q, k, v, causal=True)        # (B, H, T, D), (B, H, T)
    weights = attention_weights_from_lse(q, k, lse, heads=[3], causal=True)

`flash_attention` and `flash_attention_varlen` import triton when first used; the rest
of this package does not need it.
"""

from __future__ import annotations

from qkv.attention.flash.weights import attention_weights_from_lse

__all__ = ["attention_weights_from_lse", "flash_attention", "flash_attention_varlen"]


def __getattr__(name: str):
    if name in ("flash_attention", "flash_attention_varlen"):
        from qkv.attention.flash import function  # imports triton: only when the kernel is used

        return getattr(function, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

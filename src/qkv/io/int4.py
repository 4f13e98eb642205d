"""A .gguf file's 4-bit matrices kept as 4-bit in the model: each Linear they fill becomes
an `Int4Linear` of the file's own bits (`use_int4`), the LM head an `Int8Linear`.

`qkv.io.int4_cache` keeps what this makes on disk between processes.
"""

from __future__ import annotations

import torch
from torch import nn

from qkv.io.families import Family
from qkv.nn.quantized import Int4Linear, Int8Linear, int4_available, int8_available

# The Linears that read the same input and become one Int4Linear, and the parts each fuses
FUSED = {"qkv": ("q", "k", "v"), "gate_up": ("gate", "up")}


def use_int4(model: nn.Module, family: Family, config, groups: dict, name: str) -> None:
    """Swap each Linear whose checkpoint matrix is 4-bit for an Int4Linear of its bits (its
    bias kept). A block's query, key and value matrices become one Int4Linear (`attn.qkv`),
    and its gate and up matrices one (`mlp.gate_up`), where all of them are 4-bit: at one
    token a kernel call costs about as much as reading a small matrix, so 4 calls a block
    instead of 7 make a faster token, with the same numbers (each output row is its own).
    The LM head runs in 8 bits (`Int8Linear`: a scale per row)."""
    if not int4_available():
        raise ValueError(f"int4 needs torch >= 2.6 (this is {torch.__version__})")
    weight_of = {weight.names[0]: weight for weight in family.weights(config) if weight.names}
    four_bit = {}  # the module path of each Linear held in 4 bits: (q, scale, zero, bias)
    for hf_name, (q, scale, zero) in groups.items():
        weight = weight_of.get(hf_name)
        owner, _, attribute = weight.qkv.rpartition(".") if weight else ("", "", "")
        linear = model.get_submodule(owner) if attribute == "weight" else None  # blocks.0.attn.q
        if not isinstance(linear, nn.Linear):
            continue
        # the checkpoint's rows in qkv's order (DeepSeek's interleaved rope rows, permuted):
        # a matrix's layout, a permutation of its rows, is its bits', scales' and zeros'
        q, scale, zero = (weight.load(t) for t in (q, scale, zero))
        if q.shape[0] == scale.shape[0] == linear.out_features:  # else it stays float32
            four_bit[owner] = (q, scale, zero, linear.bias)
    if not four_bit:
        raise ValueError(f"{name} has no Q4_0 or Q4_1 matrices to keep in 4 bits")
    for path, module in list(model.named_modules()):
        for fused, parts in FUSED.items():
            names = [f"{path}.{part}" for part in parts]
            # self-attention's q, k, v read one x; cross-attention's k, v read the context
            if not all(n in four_bit for n in names) or hasattr(module, fused):
                continue
            if len({four_bit[n][0].shape[1] for n in names}) != 1:
                continue
            q, scale, zero, biases = zip(*(four_bit.pop(n) for n in names), strict=True)
            bias = None
            if any(b is not None for b in biases):
                bias = torch.cat([torch.zeros(len(rows)) if b is None else b.detach()
                                  for b, rows in zip(biases, q, strict=True)])  # fmt: skip
            setattr(module, fused, Int4Linear(torch.cat(q), torch.cat(scale), torch.cat(zero),
                                              bias))  # fmt: skip
            for part in parts:  # MultiHeadAttention keeps its sizes; chunk(2) splits gate_up
                delattr(module, part)
    for owner, (q, scale, zero, bias) in four_bit.items():
        parent, _, child = owner.rpartition(".")
        setattr(model.get_submodule(parent), child, Int4Linear(q, scale, zero, bias))
    head = getattr(model, "lm_head", None)
    if isinstance(head, nn.Linear) and int8_available():
        # the head in 8 bits, as llama.cpp's files keep it (Q8_0): a tied token matrix stays
        # float32 for the embedding lookup, which reads one row a token
        model.lm_head = Int8Linear(head.weight, head.bias)

"""A .gguf file's 4-bit matrices kept as 4-bit in the model.

Where qkv's native kernels are built (`qkv.native`), each Linear that a Q4_0, Q4_1 or Q8_0
matrix fills becomes a `QuantLinear` of the file's own blocks, the LM head too, multiplied
as llama.cpp multiplies them (`use_blocks`). Without them, each Linear of a 4-bit matrix
becomes an `Int4Linear` of the file's bits for torch's int4 kernel and the LM head an
`Int8Linear` (`use_int4`); `qkv.io.int4_cache` keeps what that makes on disk between
processes.
"""

from __future__ import annotations

import torch
from torch import nn

from qkv.io.families import Family
from qkv.nn.attention import MultiHeadAttention
from qkv.nn.quant_linear import QuantLinear
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


# the blocks QuantLinear multiplies: every layer's 4-bit matrices, and 8-bit ones (LM heads)
BLOCK_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")  # QuantLinear's
# a file of these is one to keep in its own blocks (4 or 5 bits a weight, with their scales)
FOUR_BIT = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K")


def use_blocks(model: nn.Module, family: Family, config, blocks: dict, name: str) -> None:
    """Swap each Linear whose checkpoint matrix is a block type QuantLinear holds (`blocks`:
    `gguf.read_blocks`) for a QuantLinear of the file's own blocks, its bias kept, and the LM
    head too where the file holds it so (SmolLM2's tied token matrix is Q8_0). As in
    `use_int4`, a block's q, k and v become one layer (`attn.qkv`), gate and up one
    (`mlp.gate_up`), where they share a format: the same rows, fewer calls."""
    held = {}  # module path -> (format, raw rows in qkv's order, bias)
    for weight in family.weights(config):
        found = next((n for n in weight.names if n in blocks), None)
        owner, _, attribute = weight.qkv.rpartition(".")
        linear = model.get_submodule(owner) if found and attribute == "weight" else None
        if not isinstance(linear, nn.Linear):
            continue
        kind, raw = blocks[found]
        raw = _rows_in_order(weight, raw, linear.in_features)
        if raw is not None and raw.shape[0] == linear.out_features:
            held[owner] = (kind, raw, linear.bias)
    layers = [path for path in held if path.rpartition(".")[2] != "lm_head"]
    if not any(held[path][0] in FOUR_BIT for path in layers):
        raise ValueError(f"{name} has no {', '.join(FOUR_BIT)} matrices to keep in 4 bits")
    head = getattr(model, "lm_head", None)
    if isinstance(head, nn.Linear) and "lm_head" not in held:
        tied = next((raw for weight in family.weights(config) for n in weight.names
                     if n in blocks and _is(model, weight.qkv, head.weight)
                     for raw in [blocks[n]]), None)  # fmt: skip
        if tied is not None and tied[0] in BLOCK_TYPES and tied[1].shape[0] == head.out_features:
            held["lm_head"] = (tied[0], tied[1], head.bias)
    for path, module in list(model.named_modules()):
        for fused, parts in FUSED.items():
            names = [f"{path}.{part}" for part in parts]
            if not all(n in held for n in names) or hasattr(module, fused):
                continue
            if len({held[n][0] for n in names}) != 1:  # one format a layer
                continue
            kinds, raws, biases = zip(*(held.pop(n) for n in names), strict=True)
            bias = None
            if any(b is not None for b in biases):
                bias = torch.cat([torch.zeros(len(r)) if b is None else b.detach()
                                  for b, r in zip(biases, raws, strict=True)])  # fmt: skip
            in_features = getattr(module, parts[0]).in_features
            setattr(module, fused, QuantLinear(kinds[0], torch.cat(raws), in_features, bias))
            for part in parts:
                delattr(module, part)
    for owner, (kind, raw, bias) in held.items():
        parent, _, child = owner.rpartition(".")
        linear = model.get_submodule(owner)
        holder = model.get_submodule(parent) if parent else model
        setattr(holder, child, QuantLinear(kind, raw, linear.in_features, bias))
    # Attention's projections read their inputs in two 8-bit parts (QuantLinear's `parts`):
    # with llama.cpp's one part everywhere, SmolLM2's greedy tokens followed float32's at 120 of
    # 128 teacher-forced positions (tests/test_pretrained.py's 8 prompts), with q, k, v and the
    # output projection in two parts at 126, for a quarter of the weights' integer work doubled
    for module in model.modules():
        if isinstance(module, MultiHeadAttention):
            for child in module.children():
                if type(child) is QuantLinear:
                    child.parts = 2


def _is(model: nn.Module, path: str, tensor) -> bool:
    """Whether the parameter at `path` is `tensor` itself (a tied matrix)."""
    try:
        return model.get_parameter(path) is tensor
    except AttributeError:
        return False


def _rows_in_order(weight, raw, columns: int):
    """raw (N, bytes) with its rows in qkv's order: `weight.load` moves whole rows (a layout
    of the checkpoint's rows, such as DeepSeek's interleaved rotary rows), found by loading
    the row numbers; None where it does more than move rows."""
    N = raw.shape[0]
    numbers = torch.arange(N, dtype=torch.float64)[:, None].expand(N, columns // 32)
    moved = weight.load(numbers.contiguous())
    if moved.shape != numbers.shape or not bool((moved == moved[:, :1]).all()):
        return None
    order = moved[:, 0].long()
    return raw if bool((order == torch.arange(N)).all()) else raw[order].contiguous()

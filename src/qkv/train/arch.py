"""The model a run trains: a qkv config built from the run's `ModelSpec`, written as the
config.json of its Hugging Face family.

A run's model is always one a Hugging Face family can hold (GPT-2, Llama, BERT with its
masked-LM head, BART), so every checkpoint is a Hugging Face folder: `qkv.load` reads it
like any other, and `transformers` loads its export with equal logits. The config.json
comes from the family itself (`Family.hf_config`), so it cannot drift from what loading
reads back.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch
from torch import nn

from qkv.io.families import Family, family_for, family_named
from qkv.io.linear_layers import linear_family, with_linear_layers
from qkv.io.run_config import RunConfig
from qkv.models import DecoderConfig, EncoderConfig, EncoderDecoderConfig
from qkv.nn import BlockConfig
from qkv.nn.delta import DeltaConfig, GatedDeltaNet


def model_config(config: RunConfig, vocab_size: int):
    """The qkv config of the run's model for a vocabulary of `vocab_size` tokens, with layers
    of linear attention where model.layer_types names them (each head a Gated DeltaNet memory
    of the softmax heads' sizes).

    >>> from qkv.train import preset
    >>> cfg = model_config(preset("bank"), 100)
    >>> type(cfg).__name__, cfg.mlm_head, cfg.block.norm_position
    ('EncoderConfig', True, 'post')
    >>> two = preset("bank").override(["model.layer_types=['linear', 'full']"])
    >>> hybrid = model_config(two, 100)
    >>> hybrid.layer_types, hybrid.block.linear.key_size
    (('linear', 'full'), 16)
    """
    model = _softmax_config(config, vocab_size)
    types = config.model.layer_types
    if types is None or "linear" not in types:
        return model
    m = config.model
    size = m.width // m.heads
    linear = DeltaConfig(width=m.width, heads=m.heads, key_heads=m.heads, key_size=size,
                         value_size=size)  # fmt: skip
    return replace(model, layer_types=tuple(types), block=replace(model.block, linear=linear))


def _softmax_config(config: RunConfig, vocab_size: int):
    """The run's model with every layer's attention a softmax."""
    m = config.model
    shared = {"width": m.width, "num_heads": m.heads, "mlp_hidden": m.mlp or 4 * m.width,
              "dropout": m.dropout, "backend": m.backend}  # fmt: skip
    if m.arch == "gpt2":
        return DecoderConfig(
            vocab_size=vocab_size, num_layers=m.layers, max_positions=m.context,
            position="learned", tie_embeddings=True,
            block=BlockConfig(**shared, mlp="gelu_tanh", norm_eps=1e-5, fused_qkv=True),
        )  # fmt: skip
    if m.arch == "llama":
        return DecoderConfig(
            vocab_size=vocab_size, num_layers=m.layers, max_positions=m.context,
            position="rotary", rope_base=10000.0, tie_embeddings=True,
            block=BlockConfig(**shared, num_kv_heads=m.kv_heads or m.heads,
                              head_dim=m.width // m.heads, mlp="swiglu", norm="rmsnorm",
                              norm_eps=1e-5, bias=False),
        )  # fmt: skip
    if m.arch == "bert":
        return EncoderConfig(
            vocab_size=vocab_size, num_layers=m.layers, max_positions=m.context,
            position="learned", type_vocab_size=2, embed_norm=True, final_norm=False,
            mlm_head=True,
            block=BlockConfig(**shared, mlp="gelu", norm_eps=1e-12, norm_position="post"),
        )  # fmt: skip
    return EncoderDecoderConfig(  # bart
        vocab_size=vocab_size, encoder_layers=m.layers, decoder_layers=m.layers,
        max_positions=m.context, position="learned", embed_norm=True, embed_scale=False,
        final_norm=False, tie_embeddings=True, lm_head_bias=True,
        block=BlockConfig(**shared, mlp="gelu", norm_eps=1e-5, norm_position="post"),
    )  # fmt: skip


def hf_config(config: RunConfig, tokenizer) -> dict:
    """The config.json of the run's model, for a tokenizer of `tokenizer.vocab_size`: the
    family's, with the tokenizer's special ids (BERT's pad only; BART starts decoding at
    its end-of-sequence token)."""
    family = linear_family(family_named(config.model.arch))
    hf = family.hf_config(model_config(config, tokenizer.vocab_size))
    if config.model.arch == "bert":
        return {**hf, "pad_token_id": tokenizer.pad_id}
    hf.update(bos_token_id=tokenizer.bos_id, eos_token_id=tokenizer.eos_id,
              pad_token_id=tokenizer.pad_id)  # fmt: skip
    if config.model.arch == "bart":
        hf.update(decoder_start_token_id=tokenizer.eos_id, forced_eos_token_id=tokenizer.eos_id)
    return hf


def build_model(config: RunConfig, hf: dict) -> tuple[nn.Module, Family, object]:
    """A freshly initialized model (seeded by train.seed), its family and qkv config, read
    back from `hf` as `qkv.load` will read the checkpoints; dropout and the attention
    backend are the run's (config.json does not decide them)."""
    family = with_linear_layers(family_for(hf), hf)
    model_config = family.config(hf)
    block = replace(model_config.block, dropout=config.model.dropout, backend=config.model.backend)
    model_config = replace(model_config, block=block)
    torch.manual_seed(config.train.seed)
    model = family.model(model_config)
    for module in model.modules():
        if isinstance(module, GatedDeltaNet):
            init_memory(module)
    return model, family, model_config


def init_memory(layer: GatedDeltaNet) -> None:
    """A linear layer's fade as flash-linear-attention's Gated DeltaNet starts it (Mamba's
    initialization): each head's rate A uniform in [1, 16] and its step dt log-uniform in
    [0.001, 0.1] (the bias is softplus's inverse of dt), so that at first every head fades by
    about exp(-A dt) per word, 0.85 to 0.999, and remembers many words back. (qkv's layer
    starts at A = 1 and dt = softplus(1), a fade of 0.27 a word: a memory of two words.)"""
    with torch.no_grad():
        heads = layer.fade_log_rate.shape[0]
        layer.fade_log_rate.copy_(torch.empty(heads).uniform_(1, 16).log())
        low, high = math.log(1e-3), math.log(1e-1)
        step = torch.empty(layer.fade_bias.shape).uniform_(low, high).exp()
        layer.fade_bias.copy_(step + torch.log(-torch.expm1(-step)))

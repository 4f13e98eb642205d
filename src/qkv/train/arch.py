"""The model a run trains, described as a Hugging Face config.json of its family.

A run's model is always one a Hugging Face family can hold (GPT-2, Llama, BERT with its
masked-LM head, BART), so every checkpoint is a Hugging Face folder: `qkv.load` reads it
like any other, and `transformers` loads its export with equal logits.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from qkv.io.families import Family, family_for
from qkv.train.config import RunConfig


def hf_config(config: RunConfig, tokenizer) -> dict:
    """The config.json of the run's model, for a tokenizer of `tokenizer.vocab_size`."""
    m = config.model
    mlp = m.mlp or 4 * m.width
    vocab = tokenizer.vocab_size
    ids = {
        "bos_token_id": tokenizer.bos_id,
        "eos_token_id": tokenizer.eos_id,
        "pad_token_id": tokenizer.pad_id,
    }
    if m.arch == "gpt2":
        return {
            "model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "vocab_size": vocab,
            "n_layer": m.layers, "n_head": m.heads, "n_embd": m.width, "n_inner": mlp,
            "n_positions": m.context, "activation_function": "gelu_new",
            "layer_norm_epsilon": 1e-5, "tie_word_embeddings": True, **ids,
            "resid_pdrop": m.dropout, "embd_pdrop": m.dropout, "attn_pdrop": 0.0,
        }  # fmt: skip
    if m.arch == "llama":
        return {
            "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": vocab,
            "num_hidden_layers": m.layers, "num_attention_heads": m.heads,
            "num_key_value_heads": m.kv_heads or m.heads, "hidden_size": m.width,
            "intermediate_size": mlp, "max_position_embeddings": m.context,
            "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu",
            "tie_word_embeddings": True, "attention_bias": False, "mlp_bias": False, **ids,
        }  # fmt: skip
    if m.arch == "bert":
        return {
            "model_type": "bert", "architectures": ["BertForMaskedLM"], "vocab_size": vocab,
            "num_hidden_layers": m.layers, "num_attention_heads": m.heads,
            "hidden_size": m.width, "intermediate_size": mlp, "hidden_act": "gelu",
            "max_position_embeddings": m.context, "type_vocab_size": 2,
            "layer_norm_eps": 1e-12, "position_embedding_type": "absolute",
            "hidden_dropout_prob": m.dropout, "attention_probs_dropout_prob": 0.0,
            "pad_token_id": tokenizer.pad_id,
        }  # fmt: skip
    return {  # bart
        "model_type": "bart", "architectures": ["BartForConditionalGeneration"],
        "vocab_size": vocab, "d_model": m.width, "encoder_layers": m.layers,
        "decoder_layers": m.layers, "encoder_attention_heads": m.heads,
        "decoder_attention_heads": m.heads, "encoder_ffn_dim": mlp, "decoder_ffn_dim": mlp,
        "activation_function": "gelu", "max_position_embeddings": m.context,
        "scale_embedding": False, "dropout": m.dropout, "attention_dropout": 0.0,
        "activation_dropout": 0.0, **ids, "decoder_start_token_id": tokenizer.eos_id,
        "forced_eos_token_id": tokenizer.eos_id, "is_encoder_decoder": True,
    }  # fmt: skip


def build_model(config: RunConfig, hf: dict) -> tuple[nn.Module, Family, object]:
    """A freshly initialized model (seeded by train.seed), its family and qkv config."""
    family = family_for(hf)
    model_config = family.config(hf)
    block = replace(model_config.block, dropout=config.model.dropout, backend=config.model.backend)
    model_config = replace(model_config, block=block)
    torch.manual_seed(config.train.seed)
    return family.model(model_config), family, model_config

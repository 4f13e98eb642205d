"""Tiny random models of every supported family, built and saved by `transformers`."""

from __future__ import annotations

import torch
import transformers as hf

TINY = {
    "bert": (
        hf.BertModel,
        hf.BertConfig(
            vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            intermediate_size=37, max_position_embeddings=64,
        ),
    ),
    "gpt2": (
        hf.GPT2LMHeadModel,
        hf.GPT2Config(vocab_size=99, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                      bos_token_id=0, eos_token_id=0),
    ),
    "llama": (
        hf.LlamaForCausalLM,
        hf.LlamaConfig(
            vocab_size=99, hidden_size=48, num_hidden_layers=2, num_attention_heads=6,
            num_key_value_heads=2, intermediate_size=37, rope_theta=500.0,
            max_position_embeddings=64,
        ),
    ),
    "llama-tied": (
        hf.LlamaForCausalLM,
        hf.LlamaConfig(
            vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=1, intermediate_size=37, tie_word_embeddings=True,
        ),
    ),
    "bart": (
        hf.BartForConditionalGeneration,
        hf.BartConfig(
            vocab_size=99, d_model=32, encoder_layers=2, decoder_layers=2,
            encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=37,
            decoder_ffn_dim=37, max_position_embeddings=64, scale_embedding=True,
        ),
    ),
}  # fmt: skip


def save_tiny(name: str, folder):
    cls, config = TINY[name]
    torch.manual_seed(1)
    model = cls(config).eval()
    with torch.no_grad():  # random, not zero, biases: a mapping error must show
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
        if name == "bart":
            model.final_logits_bias.normal_()
    model.save_pretrained(folder)
    return cls.from_pretrained(folder, attn_implementation="eager").eval()

"""A tiny random DeepSeek-V4, built by `transformers`, saved with a word-level tokenizer and
loaded by `qkv.load`: for the tests of every view on compressed attention's records.

Layer 0 slides a window of 4 words; layer 1 is CSA (entries of 4 words, overlapping, an
indexer keeping 2); layer 2 is HCA (entries of 8 words). The text is long enough (27 words)
that most words are outside the window and reached only through entries, and the indexer
leaves some out.
"""

from __future__ import annotations

from pathlib import Path

import torch
import transformers as hf
from tokenizers import Tokenizer as Backend
from tokenizers import models, pre_tokenizers

import qkv
from variant_models import WORDS

CSA, HCA, SLIDING = (
    "compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention")  # fmt: skip
CONFIG = dict(
    vocab_size=len(WORDS), hidden_size=32, moe_intermediate_size=16, num_attention_heads=4,
    head_dim=16, q_lora_rank=24, num_experts_per_tok=2, n_routed_experts=4,
    partial_rotary_factor=0.5, o_groups=2, o_lora_rank=8, index_n_heads=8, index_head_dim=12,
    index_topk=2, sliding_window=4, max_position_embeddings=256, num_hidden_layers=3,
    layer_types=[SLIDING, CSA, HCA], compress_rates={CSA: 4, HCA: 8}, hc_mult=2,
    mlp_layer_types=["hash_moe", "moe", "moe"],
)  # fmt: skip
# 27 words: "deep" at 26 (its last), "bank" at 1, "river" at 4, 13 and 22
TEXT = " ".join(["the bank of the river was wide and deep"] * 3)


def deepseek_v4_folder(folder: Path) -> Path:
    """Save the tiny model (random, norms far from 1, sinks far from 0) and its tokenizer."""
    torch.manual_seed(3)
    model = hf.DeepseekV4ForCausalLM(hf.DeepseekV4Config(**CONFIG)).eval()
    E, k = model.config.n_routed_experts, model.config.num_experts_per_tok
    with torch.no_grad():
        for key, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(key.endswith("weight") + 0.3 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * 0.8 * p.shape[-1] ** -0.5)
        for key, b in model.named_buffers():
            if key.endswith("tid2eid"):
                b.copy_(torch.stack([torch.randperm(E)[:k] for _ in range(len(b))]))
    model.save_pretrained(folder)
    backend = Backend(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    hf.PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]").save_pretrained(folder)
    return folder


def deepseek_v4(folder: Path) -> qkv.Pretrained:
    return qkv.load(deepseek_v4_folder(folder))

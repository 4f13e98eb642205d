"""Tiny random qkv models built straight from configs, with a word-level tokenizer: for the
tests of what `qkv explain` and the pages tell about a model's departures from the article."""

from __future__ import annotations

import torch
from tokenizers import Tokenizer as Backend
from tokenizers import models, pre_tokenizers

import qkv
from qkv.io.families import FAMILIES
from qkv.io.tokenizer import Tokenizer
from qkv.models import Decoder, DecoderConfig, Encoder, EncoderConfig
from qkv.nn import BlockConfig

WORDS = ["[UNK]", "the", "bank", "of", "river", "was", "wide", "and", "deep"]
TEXT = "the bank of the river was wide and deep"  # "deep" is token 8, "bank" token 1


def tiny(config) -> qkv.Pretrained:
    """A random model of `config` with a word-level tokenizer of WORDS."""
    torch.manual_seed(0)
    model = (Encoder if isinstance(config, EncoderConfig) else Decoder)(config).eval()
    with torch.no_grad():  # larger weights than the init's, so a cap or a scale shows
        for p in model.parameters():
            p.mul_(8.0)
    backend = Backend(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return qkv.Pretrained(model, Tokenizer(backend), config, family=FAMILIES[0],
                          hf_config={}, source="tiny")  # fmt: skip


def decoder(layer_types=None, logit_softcap=None, **block) -> DecoderConfig:
    return DecoderConfig(
        vocab_size=len(WORDS), num_layers=2, position="rotary", layer_types=layer_types,
        logit_softcap=logit_softcap,
        block=BlockConfig(**{"width": 32, "num_heads": 2, "bias": False, **block}),
    )  # fmt: skip


def gemma2_like() -> DecoderConfig:
    """Gemma 2's departures, small: its own scale, a soft-cap (small, so that it acts on these
    scores), a window on the first of two layers, norms on sub-layer outputs, capped logits."""
    return decoder(layer_types=("sliding", "full"), logit_softcap=30.0, head_dim=16,
                   num_kv_heads=1, attn_scale=144**-0.5, softcap=0.02, window=3,
                   norm="rmsnorm_plus1", sublayer_norm=True, mlp="geglu_tanh")  # fmt: skip

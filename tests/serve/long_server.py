"""A tiny random decoder for the tests of the long-text server's turns and memory, and (run as
a script) a real `qkv serve` process of it, for measuring that process's resident memory.

    python tests/serve/long_server.py '{"max_tokens": 16}'   # prints its address, serves
                                                             # until its stdin closes

The model reads a word-level vocabulary of WORDS, so `words(n)` is a text of exactly n tokens:
texts of a few hundred to a few thousand tokens are read in a fraction of a second, and each
one's reading still allocates tens of MB (its summaries' chunks of weights).
"""

from __future__ import annotations

import json
import sys

import torch

WORDS = ["[UNK]"] + [f"w{i}" for i in range(500)]


def tiny_decoder(layers: int = 2, heads: int = 4, width: int = 64, max_positions: int = 4096):
    """A random decoder (rotary positions) of WORDS, as a `qkv.Pretrained`."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import models, pre_tokenizers

    import qkv
    from qkv.io.families import FAMILIES
    from qkv.io.tokenizer import Tokenizer
    from qkv.models import Decoder, DecoderConfig
    from qkv.nn import BlockConfig

    torch.manual_seed(0)
    config = DecoderConfig(
        vocab_size=len(WORDS), num_layers=layers, position="rotary", max_positions=max_positions,
        block=BlockConfig(width=width, num_heads=heads, bias=False),
    )  # fmt: skip
    backend = Backend(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return qkv.Pretrained(Decoder(config).eval(), Tokenizer(backend), config,
                          family=FAMILIES[0], hf_config={}, source="tiny")  # fmt: skip


def words(n: int, seed: int = 0) -> str:
    """A text of exactly n tokens of the tiny decoder, a different one for each seed."""
    return " ".join(f"w{(7 * i + 13 * seed) % (len(WORDS) - 1)}" for i in range(n))


def main() -> None:
    from qkv.serve import Limits, create_app, running

    limits = Limits(**json.loads(sys.argv[1] if len(sys.argv) > 1 else "{}"))
    model = json.loads(sys.argv[2] if len(sys.argv) > 2 else "{}")
    with running(create_app({"tiny": tiny_decoder(**model)}, limits)) as url:
        print(url, flush=True)
        sys.stdin.read()  # served until the test closes this process's stdin


if __name__ == "__main__":
    main()

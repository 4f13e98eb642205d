"""Named configs: `qkv train --preset NAME` (any key can still be changed with --set)."""

from __future__ import annotations

from qkv.io.run_config import DataSpec, ModelSpec, RunConfig, TrainSpec

PRESETS: dict[str, RunConfig] = {
    # A small BERT on the generated bank sentences: about a minute on a 2-core CPU, after
    # which "bank"'s last-layer vector tells the senses apart on sentence frames it never saw.
    "bank": RunConfig(
        model=ModelSpec(arch="bert", layers=2, heads=4, width=64, context=32),
        data=DataSpec(kind="bank", examples=20000, heldout=256, mask_prob=0.05, untold=0.25),
        train=TrainSpec(
            steps=1500,
            batch_size=32,
            lr=1e-3,
            min_lr=1e-4,
            warmup=100,
            weight_decay=0.01,
            eval_every=250,
            checkpoint_every=500,
        ),
    ),
    # The original transformer learning to reverse a sequence of symbols: its cross-attention
    # becomes the anti-diagonal.
    "reverse": RunConfig(
        model=ModelSpec(arch="bart", layers=2, heads=4, width=128, context=32),
        data=DataSpec(kind="reverse", examples=50000, heldout=512),
        train=TrainSpec(
            steps=1200,
            batch_size=64,
            lr=1e-3,
            min_lr=5e-5,
            warmup=100,
            weight_decay=0.01,
            eval_every=200,
            checkpoint_every=400,
        ),
    ),
    # GPT-2 shaped, for text files: 6 layers, 6 heads, 384 wide, 256 tokens of context.
    "gpt": RunConfig(
        model=ModelSpec(arch="gpt2", layers=6, heads=6, width=384, context=256),
        data=DataSpec(kind="text", tokenizer="bpe", vocab_size=8192),
        train=TrainSpec(steps=2000, batch_size=8, lr=6e-4, min_lr=6e-5, warmup=100),
    ),
}


def preset(name: str) -> RunConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; presets: {', '.join(PRESETS)}")
    return PRESETS[name]

"""Which stack's self-attention a question is about: the one rule every reader of a model uses.

An encoder and a decoder are one stack of blocks. An encoder-decoder has two; without a target
text, what is read is its encoder's self-attention (the whole source at once), as
`Pretrained.attentions` shows it. Anything else is refused by name.
"""

from __future__ import annotations

from torch import nn

from qkv.models.decoder import Decoder
from qkv.models.encoder import Encoder
from qkv.models.encoder_decoder import EncoderDecoder


def self_attention_stack(model: nn.Module, reader: str, source: str) -> Encoder | Decoder:
    """The stack whose self-attention `reader` reads: `model` itself when it is an encoder or a
    decoder, an encoder-decoder's encoder; otherwise a ValueError that names `reader`, what it
    reads and what `source` is.

    >>> self_attention_stack(nn.Linear(2, 2), "the probe", "x")
    Traceback (most recent call last):
    ...
    ValueError: the probe reads encoders, decoders and an encoder-decoder's encoder; x is a Linear
    """
    if isinstance(model, EncoderDecoder):
        return model.encoder
    if not isinstance(model, Encoder | Decoder):
        raise ValueError(
            f"{reader} reads encoders, decoders and an encoder-decoder's encoder; {source} is a "
            f"{type(model).__name__}"
        )
    return model


def stack_shape(stack: Encoder | Decoder) -> tuple[int, int]:
    """(layers, heads) of one stack."""
    return stack.config.num_layers, stack.config.block.num_heads

"""The three shapes of the transformer, each built from one frozen config."""

from qkv.models.config import DecoderConfig, EncoderConfig, EncoderDecoderConfig
from qkv.models.decoder import Decoder, DecoderCache, DecoderOutput
from qkv.models.encoder import Encoder, EncoderOutput
from qkv.models.encoder_decoder import EncoderDecoder, Seq2SeqOutput
from qkv.models.stacks import self_attention_stack, stack_shape

__all__ = [
    "Decoder",
    "DecoderCache",
    "DecoderConfig",
    "DecoderOutput",
    "Encoder",
    "EncoderConfig",
    "EncoderDecoder",
    "EncoderDecoderConfig",
    "EncoderOutput",
    "Seq2SeqOutput",
    "self_attention_stack",
    "stack_shape",
]

"""EncoderDecoder: the original transformer, where the decoder cross-attends to the encoder.

The article's cross-attention: "the query words can come from one sequence (the
decoder), while the key and value words come from a second sequence (the encoder)".
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from torch import Tensor, nn

from qkv.models.config import EncoderDecoderConfig
from qkv.models.decoder import Decoder, DecoderCache
from qkv.models.encoder import Encoder, EncoderOutput


@dataclass
class Seq2SeqOutput:
    logits: Tensor  # (B, T, vocab) for the target tokens
    encoder_hidden: Tensor  # (B, S, C)
    encoder_attentions: dict[tuple[int, int], Tensor] = field(default_factory=dict)  # (B, S, S)
    decoder_attentions: dict[tuple[int, int], Tensor] = field(default_factory=dict)  # (B, T, T)
    cross_attentions: dict[tuple[int, int], Tensor] = field(default_factory=dict)  # (B, T, S)


class EncoderDecoder(nn.Module):
    """Source ids (B, S) and target ids (B, T) -> logits (B, T, vocab) for the target.

    >>> import torch
    >>> from qkv.nn import BlockConfig
    >>> cfg = EncoderDecoderConfig(vocab_size=50, encoder_layers=2, decoder_layers=2,
    ...                            block=BlockConfig(width=16, num_heads=4))
    >>> EncoderDecoder(cfg)(torch.tensor([[1, 2, 3]]), torch.tensor([[4, 5]])).logits.shape
    torch.Size([1, 2, 50])
    """

    def __init__(self, config: EncoderDecoderConfig):
        super().__init__()
        self.config = config
        self.encoder = Encoder(config.encoder())
        self.decoder = Decoder(config.decoder())
        self.tie_weights()

    def tie_weights(self) -> None:
        """One token matrix for the encoder, the decoder and the LM head, if so configured."""
        if self.config.tie_embeddings:
            self.decoder.embed.tokens.weight = self.encoder.embed.tokens.weight
            self.decoder.lm_head.weight = self.encoder.embed.tokens.weight

    def encode(
        self,
        source_ids: Tensor,
        *,
        source_mask: Tensor | None = None,
        record: Iterable[tuple[int, int]] | None = None,
    ) -> EncoderOutput:
        return self.encoder(source_ids, attention_mask=source_mask, record=record)

    def new_cache(self) -> DecoderCache:
        return self.decoder.new_cache()

    def forward(
        self,
        source_ids: Tensor,
        target_ids: Tensor,
        *,
        source_mask: Tensor | None = None,
        target_mask: Tensor | None = None,
        encoded: EncoderOutput | None = None,
        cache: DecoderCache | None = None,
        record_encoder: Iterable[tuple[int, int]] | None = None,
        record_decoder: Iterable[tuple[int, int]] | None = None,
        record_cross: Iterable[tuple[int, int]] | None = None,
    ) -> Seq2SeqOutput:
        """source_mask (B, S), target_mask (B, T): 1 for real tokens, 0 for padding.

        encoded: the encoder's output from an earlier call (decoding step by step), so the
        source is encoded once; cache: the decoder's KV cache for that decoding.
        """
        if encoded is None:
            encoded = self.encode(source_ids, source_mask=source_mask, record=record_encoder)
        decoded = self.decoder(
            target_ids,
            attention_mask=target_mask,
            cache=cache,
            context=encoded.hidden,
            context_mask=source_mask,
            record=record_decoder,
            record_cross=record_cross,
        )
        return Seq2SeqOutput(
            decoded.logits,
            encoded.hidden,
            encoded.attentions,
            decoded.attentions,
            decoded.cross_attentions,
        )

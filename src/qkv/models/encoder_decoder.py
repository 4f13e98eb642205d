"""EncoderDecoder: the original transformer, where the decoder cross-attends to the encoder.

The article's cross-attention: "the query words can come from one sequence (the
decoder), while the key and value words come from a second sequence (the encoder)".
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import Tensor, nn

from qkv.models.config import EncoderDecoderConfig, Layers
from qkv.models.decoder import Decoder, DecoderCache
from qkv.models.encoder import Encoder, EncoderOutput
from qkv.nn import AttentionRecord


@dataclass
class Seq2SeqOutput:
    logits: Tensor  # (B, T, vocab) for the target tokens
    encoder_hidden: Tensor  # (B, S, C)
    # the AttentionRecords of the layers asked: the encoder's, the decoder's self-attention
    # (T queries over T keys) and its cross-attention (T queries over the S source tokens)
    encoder_records: dict[int, AttentionRecord] = field(default_factory=dict)
    decoder_records: dict[int, AttentionRecord] = field(default_factory=dict)
    cross_records: dict[int, AttentionRecord] = field(default_factory=dict)


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
        """One token matrix for the encoder, the decoder and (unless tie_lm_head is False)
        the LM head, if so configured."""
        if self.config.tie_embeddings:
            self.decoder.embed.tokens.weight = self.encoder.embed.tokens.weight
            if self.config.tie_lm_head:
                self.decoder.lm_head.weight = self.encoder.embed.tokens.weight

    def read_source(
        self, source_ids: Tensor, *, source_mask: Tensor | None = None, layers: Layers = None
    ) -> EncoderOutput:
        """The encoder's pass over the source (B, S), which every decoding step reads."""
        return self.encoder(source_ids, attention_mask=source_mask, layers=layers)

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
        encoder_layers: Layers = None,
        layers: Layers = None,
        cross_layers: Layers = None,
    ) -> Seq2SeqOutput:
        """source_mask (B, S), target_mask (B, T): 1 for real tokens, 0 for padding.

        encoder_layers, layers, cross_layers: the layers whose AttentionRecord to return, of
        the encoder, the decoder's self-attention and its cross-attention (indices, or "all").

        encoded: the encoder's output from an earlier call (decoding step by step), so the
        source is encoded once; cache: the decoder's KV cache for that decoding.
        """
        if encoded is None:
            encoded = self.read_source(source_ids, source_mask=source_mask, layers=encoder_layers)
        decoded = self.decoder(
            target_ids,
            attention_mask=target_mask,
            cache=cache,
            context=encoded.hidden,
            context_mask=source_mask,
            layers=layers,
            cross_layers=cross_layers,
        )
        return Seq2SeqOutput(
            decoded.logits, encoded.hidden, encoded.records, decoded.records, decoded.cross_records
        )

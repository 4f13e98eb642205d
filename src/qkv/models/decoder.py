"""Decoder: the GPT/Llama-like stack, where each token attends to itself and earlier ones."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from torch import Tensor, nn

from qkv.models.config import (
    DecoderConfig,
    heads_by_layer,
    init_weights,
    key_padding,
    store_weights,
)
from qkv.nn import DecoderBlock, KVCache
from qkv.nn.position import positions_for


@dataclass
class DecoderOutput:
    logits: Tensor | None  # (B, T, vocab) scores for the next token after each position
    hidden: Tensor  # (B, T, C) the last block's output (after the final norm)
    attentions: dict[tuple[int, int], Tensor] = field(default_factory=dict)  # (B, T, Tk)
    cross_attentions: dict[tuple[int, int], Tensor] = field(default_factory=dict)  # (B, T, S)
    # with hidden_states=True: the embeddings, then each block's output, (B, T, C) each
    hidden_states: list[Tensor] = field(default_factory=list)


class DecoderCache:
    """Every layer's KV cache: self-attention's grows a token at a time, cross's is fixed."""

    def __init__(self, num_layers: int, cross_attention: bool = False):
        self.layers = [KVCache() for _ in range(num_layers)]
        self.cross = [KVCache() for _ in range(num_layers)] if cross_attention else None

    @property
    def length(self) -> int:
        """How many tokens are cached."""
        return self.layers[0].length


class Decoder(nn.Module):
    """Token ids (B, T) -> next-token logits (B, T, vocab), each position seeing only the past.

    >>> import torch
    >>> from qkv.nn import BlockConfig
    >>> cfg = DecoderConfig(vocab_size=50, num_layers=2, block=BlockConfig(width=16, num_heads=4))
    >>> Decoder(cfg)(torch.tensor([[1, 2, 3]])).logits.shape
    torch.Size([1, 3, 50])
    """

    def __init__(self, config: DecoderConfig):
        super().__init__()
        self.config = config
        self.embed = config.embeddings()
        rotary = config.rotary()
        self.blocks = nn.ModuleList(
            DecoderBlock(config.block, rotary, config.cross_attention)
            for _ in range(config.num_layers)
        )
        self.norm = config.block.make_norm() if config.has_final_norm else None
        self.lm_head = nn.Linear(config.block.width, config.vocab_size, bias=config.lm_head_bias)
        self.apply(init_weights)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the token matrix with the LM head when the config says so."""
        if self.config.tie_embeddings:
            self.lm_head.weight = self.embed.tokens.weight

    def new_cache(self) -> DecoderCache:
        return DecoderCache(self.config.num_layers, self.config.cross_attention)

    def forward(
        self,
        input_ids: Tensor,
        *,
        attention_mask: Tensor | None = None,
        positions: Tensor | None = None,
        cache: DecoderCache | None = None,
        context: Tensor | None = None,
        context_mask: Tensor | None = None,
        record: Iterable[tuple[int, int]] | None = None,
        record_cross: Iterable[tuple[int, int]] | None = None,
        logits: bool = True,
        hidden_states: bool = False,
    ) -> DecoderOutput:
        """input_ids (B, T): the new tokens (after the cached ones, if a cache is given).

        attention_mask (B, Tk): 1 for real tokens, 0 for padding, over the cached and the
          new tokens together.
        positions (T,) or (B, T): defaults to the positions after the cached tokens.
        context (B, S, C), context_mask (B, S): the encoder's output, for cross-attention.
        record, record_cross: (layer, head) pairs whose weights to return.
        logits: False skips the LM head (the caller applies it to the positions it needs).
        hidden_states: also return every layer's input and the last one's output.
        """
        cfg = self.config
        wanted = heads_by_layer(record, cfg.num_layers, cfg.block.num_heads)
        wanted_cross = heads_by_layer(record_cross, cfg.num_layers, cfg.block.num_heads)
        if wanted_cross and not cfg.cross_attention:
            raise ValueError("record_cross needs a decoder with cross-attention")
        if positions is None:
            offset = cache.length if cache is not None else 0
            positions = positions_for(input_ids.shape[1], offset, input_ids.device)
        x = self.embed(input_ids, positions)  # (B, T, C)
        padding = key_padding(attention_mask)
        context_padding = key_padding(context_mask)
        attentions: dict[tuple[int, int], Tensor] = {}
        cross_attentions: dict[tuple[int, int], Tensor] = {}
        states = [x] if hidden_states else []
        for layer, block in enumerate(self.blocks):
            x, weights, cross_weights = block(
                x,
                context,
                key_padding_mask=padding,
                context_mask=context_padding,
                positions=positions,
                cache=cache.layers[layer] if cache is not None else None,
                cross_cache=cache.cross[layer] if cache is not None and cache.cross else None,
                heads=wanted.get(layer),
                cross_heads=wanted_cross.get(layer),
            )
            store_weights(attentions, layer, wanted.get(layer), weights)
            store_weights(cross_attentions, layer, wanted_cross.get(layer), cross_weights)
            if hidden_states:
                states.append(x)
        if self.norm is not None:
            x = self.norm(x)
        scores = self.lm_head(x) if logits else None
        return DecoderOutput(scores, x, attentions, cross_attentions, states)

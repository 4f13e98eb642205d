"""Decoder: the GPT/Llama-like stack, where each token attends to itself and earlier ones."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from qkv.models.config import (
    DecoderConfig,
    Layers,
    Rotaries,
    check_resume,
    check_stop,
    init_weights,
    key_padding,
    mask_positions,
    recorded_layers,
)
from qkv.nn import (
    AttentionRecord,
    DecoderBlock,
    ExpertRecord,
    KVCache,
    LatentAttention,
    LatentCache,
)
from qkv.nn.delta import GatedDeltaNet, MemoryCache
from qkv.nn.edit import Edits, check_edits
from qkv.nn.linear import project
from qkv.nn.position import positions_for


@dataclass
class DecoderOutput:
    logits: Tensor | None  # (B, T, vocab) scores for the next token after each position
    hidden: Tensor  # (B, T, C) the last block's output (after the final norm)
    records: dict[int, AttentionRecord] = field(default_factory=dict)  # the layers asked
    cross_records: dict[int, AttentionRecord] = field(default_factory=dict)  # cross-attention
    # with hidden_states=True: the embeddings, then each block's output, (B, T, C) each
    hidden_states: list[Tensor] = field(default_factory=list)
    # the recorded layers' mixtures of experts: which experts each token went to, and why
    experts: dict[int, ExpertRecord] = field(default_factory=dict)


class DecoderCache:
    """Every layer's KV cache: self-attention's grows a token at a time, cross's is fixed. A
    layer of latent attention (`latent`) caches its compressed vectors instead (LatentCache), a
    layer of linear attention (`linear`) its memory, which does not grow (MemoryCache)."""

    def __init__(
        self,
        num_layers: int,
        cross_attention: bool = False,
        latent: frozenset[int] = frozenset(),
        linear: frozenset[int] = frozenset(),
    ):
        self.layers = [
            LatentCache() if i in latent else MemoryCache() if i in linear else KVCache()
            for i in range(num_layers)
        ]
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
        self.rotary = Rotaries(config)  # shared by every block: one rotation per forward
        self.relative = config.relative_bias(bidirectional=False)  # T5's, shared likewise
        self.blocks = nn.ModuleList(
            DecoderBlock(config.block_for(i), self.rotary.for_layer(i), config.cross_attention)
            for i in range(config.num_layers)
        )
        self.norm = config.block.make_norm() if config.has_final_norm else None
        self.lm_head = nn.Linear(config.block.width, config.vocab_size, bias=config.lm_head_bias)
        self.apply(init_weights)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the token matrix with the LM head when the config says so."""
        if self.config.tie_embeddings:
            self.lm_head.weight = self.embed.tokens.weight

    def project(self, hidden: Tensor) -> Tensor:
        """The LM head: hidden vectors (…, C) -> logits (…, vocab), scaled first where the
        model scales them (T5) and soft-capped where it caps them (Gemma 2)."""
        if self.config.head_scale is not None:
            hidden = hidden * self.config.head_scale
        return cap_logits(project(self.lm_head, hidden), self.config.logit_softcap)

    def resume_from(self, layer: int) -> int:
        """The block a run that changes `layer` and later ones must start from, with no cache:
        `layer` itself (Gemma 4's layers that share earlier keys start earlier)."""
        return layer

    def new_cache(self) -> DecoderCache:
        def layers(kind) -> frozenset[int]:
            return frozenset(i for i, b in enumerate(self.blocks) if isinstance(b.attn, kind))

        return DecoderCache(self.config.num_layers, self.config.cross_attention,
                            layers(LatentAttention), layers(GatedDeltaNet))  # fmt: skip

    def forward(
        self,
        input_ids: Tensor,
        *,
        attention_mask: Tensor | None = None,
        positions: Tensor | None = None,
        cache: DecoderCache | None = None,
        context: Tensor | None = None,
        context_mask: Tensor | None = None,
        layers: Layers = None,
        cross_layers: Layers = None,
        logits: bool = True,
        hidden_states: bool = False,
        edits: Edits | None = None,
        resume: tuple[int, Tensor] | None = None,
        weights: Tensor | None = None,
        stop: int | None = None,
    ) -> DecoderOutput:
        """input_ids (B, T): the new tokens (after the cached ones, if a cache is given).

        attention_mask (B, Tk): 1 for real tokens, 0 for padding, over the cached and the
          new tokens together.
        positions (T,) or (B, T): defaults to the positions after the cached tokens, counted
          in each row from its first real token when attention_mask is given (so a
          left-padded row is computed as if alone).
        context (B, S, C), context_mask (B, S): the encoder's output, for cross-attention.
        layers, cross_layers: the layers whose self- and cross-attention AttentionRecord to
          return (indices, or "all").
        logits: False skips the LM head (the caller applies it to the positions it needs).
        hidden_states: also return every layer's input and the last one's output.
        edits: {layer: Edit}, interventions in those layers' self-attention and outputs
          (`qkv.nn.edit`).
        resume: (layer, x): start at that block with x (B, T, C) as its input, the blocks
          before it skipped (x is their output, e.g. an earlier run's hidden_states[layer]);
          hidden_states then starts at x. With a cache, every layer's cache already holds
          the tokens before input_ids (an earlier run's keys and values, `KVCache.holding`).
        weights (len(layers), H, T, Tk): where the layers' weights are wanted anyway, each
          recorded layer makes them in weights[j] (j: its place among `layers`, in order)
          with its output, in one pass over the scores, where its attention allows (one
          sequence of plain causal scores: see MultiHeadAttention's `weights_into`); its record's
          `made` says whether it did.
        stop: run the blocks before this one only (a reader of one layer's record needs
          none after it); `hidden` is then the last one's output, with no final norm and no
          logits.
        """
        cfg = self.config
        wanted = recorded_layers(layers, cfg.num_layers)
        wanted_cross = recorded_layers(cross_layers, cfg.num_layers)
        if wanted_cross and not cfg.cross_attention:
            raise ValueError("cross_layers needs a decoder with cross-attention")
        edits = check_edits(edits, cfg.num_layers)
        first, x = check_resume(resume, input_ids, cfg)
        last = check_stop(stop, first, cfg.num_layers)
        if positions is None and attention_mask is not None and not bool(attention_mask.all()):
            positions = mask_positions(attention_mask, input_ids.shape[1])
        offset = cache.length if cache is not None else 0
        if positions is None:
            positions = positions_for(input_ids.shape[1], offset, input_ids.device)
        if x is None:
            x = self.embed(input_ids, positions)  # (B, T, C)
        rotations = self.rotary.rotations(positions, x.dtype)
        bias = None  # T5's relative positions: the new tokens' queries over every key so far
        if self.relative is not None:
            T = input_ids.shape[1]
            bias = self.relative(T, offset + T, offset).to(x.dtype)  # (1, H, T, Tk)
        padding = key_padding(attention_mask)
        context_padding = key_padding(context_mask)
        place = {layer: j for j, layer in enumerate(sorted(wanted))}
        if weights is not None and len(weights) != len(place):
            raise ValueError(f"weights holds {len(weights)} layers' weights; {len(place)} are "
                             "recorded")  # fmt: skip
        out = DecoderOutput(None, x, hidden_states=[x] if hidden_states else [])
        for layer in range(first, last):
            x, kept, kept_cross, experts = self.blocks[layer](
                x,
                context,
                key_padding_mask=padding,
                context_mask=context_padding,
                rotation=self.rotary.rotation_for(rotations, layer),
                positions=positions,
                cache=cache.layers[layer] if cache is not None else None,
                cross_cache=cache.cross[layer] if cache is not None and cache.cross else None,
                bias=bias,
                edit=edits.get(layer),
                record=layer in wanted,
                weights_into=_made_in(weights, place, layer),
                record_cross=layer in wanted_cross,
            )
            if kept is not None:
                out.records[layer] = kept
            if kept_cross is not None:
                out.cross_records[layer] = kept_cross
            if experts is not None:
                out.experts[layer] = experts
            if hidden_states:
                out.hidden_states.append(x)
        if stop is not None:
            out.hidden = x
            return out
        out.hidden = x if self.norm is None else self.norm(x)
        out.logits = self.project(out.hidden) if logits else None
        return out


def _made_in(weights: Tensor | None, place: dict[int, int], layer: int) -> Tensor | None:
    """A recorded layer's share of `weights` (its weights_into=), or None: no weights given, or
    a layer not recorded."""
    return weights[place[layer]] if weights is not None and layer in place else None


def cap_logits(logits: Tensor, cap: float | None) -> Tensor:
    """cap * tanh(logits / cap): Gemma 2's final soft-cap; the logits themselves if None."""
    return logits if cap is None else torch.tanh(logits / cap) * cap

"""Gemma 4's decoder: a Decoder whose layers differ from each other (see `qkv.nn.gemma4`).

`Gemma4Config` is a DecoderConfig whose `block` is the sliding layers' block; the full
layers take their own head size and key/value heads, their own rotary positions
("proportional"), and may have no value matrix. The last `kv_shared_layers` layers have no
keys or values of their own: each attends over the keys and values of the last earlier layer
of its type (its cache, read and never written), and may have an MLP twice as wide. Every
layer may have a mixture of experts beside its dense MLP, and an input of its own per token.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from torch import Tensor, nn

from qkv.models.config import (
    DecoderConfig,
    Layers,
    Rotaries,
    check_resume,
    init_weights,
    key_padding,
    mask_positions,
    recorded_layers,
)
from qkv.models.decoder import Decoder, DecoderCache, DecoderOutput, _made_in
from qkv.nn import BlockConfig, KVCache
from qkv.nn.edit import Edits, check_edits
from qkv.nn.experts import Experts
from qkv.nn.gemma4 import Gemma4Block, Gemma4Layer, PerLayerInputs, ProportionalRotary
from qkv.nn.position import positions_for


@dataclass(frozen=True, kw_only=True)
class Gemma4Config(DecoderConfig):
    """A Gemma 4 decoder: rope_base is the full layers' base, local_rope_base the sliding
    layers' (unscaled, every dimension turns)."""

    full_head_dim: int | None = None  # the full layers' head size; None: the block's
    full_kv_heads: int | None = None  # the full layers' key/value heads; None: the block's
    # the full layers' proportional rotary: the share of a head's pairs that turn, and the
    # divisor of every frequency
    full_rope_fraction: float = 1.0
    full_rope_factor: float = 1.0
    values_from_keys: bool = False  # full layers: values are the raw key projection
    kv_shared_layers: int = 0  # the last layers attend over an earlier layer's keys
    double_wide_mlp: bool = False  # those layers' MLP is twice as wide
    per_layer_input: int = 0  # P, each layer's own input per token; 0: none
    per_layer_vocab: int = 0  # rows of the per-layer token table
    experts: Experts | None = None  # a mixture of experts beside every layer's dense MLP

    def __post_init__(self):
        super().__post_init__()
        if self.layer_types is None or self.local_rope_base is None:
            raise ValueError("a Gemma 4 config names each layer's type and local_rope_base")
        if "chunked" in self.layer_types or self.block.experts is not None:
            raise ValueError("Gemma 4 layers are sliding or full; experts go in `experts`")
        first = self.num_layers - self.kv_shared_layers
        if not 0 <= self.kv_shared_layers < self.num_layers:
            raise ValueError(f"kv_shared_layers must be in [0, {self.num_layers}), got "
                             f"{self.kv_shared_layers}")  # fmt: skip
        missing = set(self.layer_types[first:]) - set(self.layer_types[:first])
        if missing:
            raise ValueError(f"layers sharing keys of type {sorted(missing)} have no earlier "
                             "layer of their type to share with")  # fmt: skip
        if self.per_layer_input and self.per_layer_vocab < 1:
            raise ValueError("per-layer inputs need per_layer_vocab, the rows of their table")
        if not 0 < self.full_rope_fraction <= 1 or not self.full_rope_factor > 0:
            raise ValueError("full_rope_fraction must be in (0, 1], full_rope_factor positive")

    def shares_with(self, layer: int) -> int | None:
        """The layer whose keys and values `layer` attends over: the last layer of its type
        before the shared ones; None for a layer with keys of its own."""
        first = self.num_layers - self.kv_shared_layers
        if layer < first:
            return None
        kind = self.layer_type(layer)
        return max(i for i in range(first) if self.layer_type(i) == kind)

    def layer(self, layer: int) -> Gemma4Layer:
        full = self.layer_type(layer) == "full"
        return Gemma4Layer(
            values_from_keys=self.values_from_keys and full,
            shares_keys=self.shares_with(layer) is not None,
            experts=self.experts,
            per_layer_input=self.per_layer_input,
        )

    def block_for(self, layer: int) -> BlockConfig:
        """The layer's block: the full layers' head size and key/value heads, a doubled MLP
        on a layer that shares keys where double_wide_mlp."""
        block = super().block_for(layer)
        changes: dict = {}
        if self.layer_type(layer) == "full":
            changes["head_dim"] = self.full_head_dim or block.head_size
            changes["num_kv_heads"] = self.full_kv_heads or block.kv_heads
        if self.double_wide_mlp and self.shares_with(layer) is not None:
            changes["mlp_hidden"] = 2 * (block.mlp_hidden or 4 * block.width)
        return replace(block, **changes) if changes else block

    def rotary(self) -> ProportionalRotary:
        head = self.full_head_dim or self.block.head_size
        return ProportionalRotary(head, self.rope_base, self.full_rope_fraction,
                                  self.full_rope_factor)  # fmt: skip


class Gemma4Decoder(Decoder):
    """Token ids (B, T) -> next-token logits (B, T, vocab), through Gemma 4's layers.

    Its forward takes Decoder's arguments. A layer that shares keys records the keys and
    values it attended over (the other layer's) and says whose in its record's shared_from.
    """

    def __init__(self, config: Gemma4Config):
        nn.Module.__init__(self)
        self.config = config
        self.embed = config.embeddings()
        self.rotary = Rotaries(config)
        self.relative = None
        self.blocks = nn.ModuleList(
            Gemma4Block(config.block_for(i), self.rotary.for_layer(i), config.layer(i))
            for i in range(config.num_layers)
        )
        self.per_layer = None
        if config.per_layer_input:
            self.per_layer = PerLayerInputs(
                config.per_layer_vocab, config.block.width, config.num_layers,
                config.per_layer_input, config.block.norm_eps,
            )  # fmt: skip
        self.norm = config.block.make_norm()
        self.lm_head = nn.Linear(config.block.width, config.vocab_size, bias=False)
        self.apply(init_weights)
        self.tie_weights()

    def resume_from(self, layer: int) -> int:
        """The first layer whose keys `layer` or a later layer shares, where it is earlier:
        without a cache, a run resumed there makes them again."""
        shared = [self.config.shares_with(i) for i in range(layer, self.config.num_layers)]
        return min([layer, *(j for j in shared if j is not None)])

    def new_cache(self) -> DecoderCache:
        """Every layer's cache; a layer that shares keys leaves its own empty."""
        return DecoderCache(self.config.num_layers)

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
    ) -> DecoderOutput:
        """As Decoder's (no cross-attention). Without a cache, the layers whose keys others
        share keep them in a cache of this call's own."""
        cfg = self.config
        if context is not None or cross_layers:
            raise ValueError("a Gemma 4 decoder has no cross-attention")
        wanted = recorded_layers(layers, cfg.num_layers)
        edits = check_edits(edits, cfg.num_layers)
        first, x = check_resume(resume, input_ids, cfg)
        sharing = {i: cfg.shares_with(i) for i in range(cfg.num_layers)}
        if cache is None:  # this call's own caches for the layers whose keys are shared
            held = {j for j in sharing.values() if j is not None}
            if any(j < first for j in held):
                raise ValueError("resuming past a layer whose keys later layers share needs "
                                 "a cache holding them")  # fmt: skip
            caches = [KVCache() if i in held else None for i in range(cfg.num_layers)]
        else:
            caches = list(cache.layers)
        if positions is None and attention_mask is not None and not bool(attention_mask.all()):
            positions = mask_positions(attention_mask, input_ids.shape[1])
        offset = cache.length if cache is not None else 0
        if positions is None:
            positions = positions_for(input_ids.shape[1], offset, input_ids.device)
        per_layer = None
        if x is None or self.per_layer is not None:
            embedded = self.embed(input_ids, positions)  # (B, T, C)
            x = embedded if x is None else x
            if self.per_layer is not None:
                per_layer = self.per_layer(input_ids, embedded)  # (B, T, L, P)
        rotations = self.rotary.rotations(positions, x.dtype)
        padding = key_padding(attention_mask)
        place = {layer: j for j, layer in enumerate(sorted(wanted))}
        if weights is not None and len(weights) != len(place):
            raise ValueError(f"weights holds {len(weights)} layers' weights; {len(place)} are "
                             "recorded")  # fmt: skip
        out = DecoderOutput(None, x, hidden_states=[x] if hidden_states else [])
        for layer in range(first, cfg.num_layers):
            source = sharing[layer]
            x, kept, _, experts = self.blocks[layer](
                x,
                key_padding_mask=padding,
                rotation=self.rotary.rotation_for(rotations, layer),
                positions=positions,
                cache=caches[layer] if source is None else None,
                shared=None if source is None else caches[source],
                shared_from=source,
                per_layer_input=None if per_layer is None else per_layer[:, :, layer],
                edit=edits.get(layer),
                record=layer in wanted,
                weights_into=_made_in(weights, place, layer),
            )
            if kept is not None:
                out.records[layer] = kept
            if experts is not None:
                out.experts[layer] = experts
            if hidden_states:
                out.hidden_states.append(x)
        out.hidden = self.norm(x)
        out.logits = self.project(out.hidden) if logits else None
        return out

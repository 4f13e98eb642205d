"""DeepSeek-V4's decoder: compressed attention, hyper-connections and hashed experts.

Each token's vector is copied into n streams (`qkv.nn.hyper`); each layer's attention
(`qkv.nn.compressed`: a sliding window, and on CSA and HCA layers compressed entries) and then
its mixture of experts (`qkv.nn.hash_moe`) each read a mix of the streams and write back into
them. A last mix collapses the streams, then the final norm and the LM head. The first layers
choose experts by token id (hashed), the others by the router's top k.

The multi-token-prediction layers of a checkpoint (num_nextn_predict_layers) are not part of
the forward pass, as in transformers' model: `mtp_layers` is kept, and their weights skipped.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from torch import Tensor, nn

from qkv.models.config import DecoderConfig, Layers, init_weights, recorded_layers
from qkv.models.decoder import Decoder, DecoderOutput
from qkv.nn.compressed import (
    CompressedAttention,
    CompressedCache,
    Compression,
    InterleavedRotary,
    Norm,
)
from qkv.nn.hash_moe import HashMoE, Score
from qkv.nn.hyper import HyperConnection, HyperHead
from qkv.nn.position import positions_for
from qkv.nn.rope import RopeScaling

AttentionType = Literal["sliding", "csa", "hca"]


@dataclass(frozen=True, kw_only=True)
class DeepseekV4Config(DecoderConfig):
    """A DeepSeek-V4 decoder. The block holds the width, heads (one key/value head), head
    size, norm eps and the window; rope_base and rope_dims are the sliding layers' rotary
    (the last rope_dims channels of a head turn), compress_rope_base and
    compress_rope_scaling the compressed layers' (their compressors' and indexers' too)."""

    attention_types: tuple[AttentionType, ...]
    q_rank: int
    out_groups: int
    out_rank: int
    csa_rate: int = 4
    hca_rate: int = 128
    index_heads: int = 64
    index_head_dim: int = 128
    index_top_k: int = 512
    compress_rope_base: float = 160000.0
    compress_rope_scaling: RopeScaling | None = None
    streams: int = 4  # hc_mult: the residual's parallel streams
    hc_iterations: int = 20  # Sinkhorn's
    hc_eps: float = 1e-6
    num_experts: int = 256
    experts_per_token: int = 6
    expert_hidden: int = 2048
    hashed_layers: tuple[bool, ...] = field(default=())  # per layer: experts by token id
    expert_score: Score = "sqrtsoftplus"
    expert_scaling: float = 1.5
    swiglu_limit: float = 10.0
    mtp_layers: int = 0  # the checkpoint's multi-token-prediction layers, not computed

    def __post_init__(self):
        super().__post_init__()
        n = self.num_layers
        if len(self.attention_types) != n or len(self.hashed_layers) != n:
            raise ValueError(f"attention_types and hashed_layers must name the {n} layers")
        odd = sorted(set(self.attention_types) - {"sliding", "csa", "hca"})
        if odd:
            raise ValueError(f"attention types are 'sliding', 'csa' or 'hca', got {odd}")
        if self.block.window is None or self.rope_dims is None:
            raise ValueError("a DeepSeek-V4 block has a window and rope_dims")
        if "csa" in self.attention_types and self.rope_dims > self.index_head_dim:
            raise ValueError(f"the indexer's heads ({self.index_head_dim}) are narrower than "
                             f"the rotary channels ({self.rope_dims})")  # fmt: skip

    def compression(self, layer: int) -> Compression | None:
        kind = self.attention_types[layer]
        if kind == "sliding":
            return None
        if kind == "hca":
            return Compression(self.hca_rate)
        return Compression(self.csa_rate, self.index_top_k, self.index_heads,
                           self.index_head_dim)  # fmt: skip


class DeepseekV4Block(nn.Module):
    """One layer: attention, then experts, each between two hyper-connection mixes."""

    def __init__(self, config: DeepseekV4Config, layer: int):
        super().__init__()
        b, c = config.block, config
        eps = b.norm_eps
        self.attn_hc = HyperConnection(b.width, c.streams, c.hc_iterations, c.hc_eps, eps)
        self.attn_norm = Norm(b.width, eps)
        self.attn = CompressedAttention(
            b.width, b.num_heads, b.head_size, c.q_rank, c.out_groups, c.out_rank, b.window,
            eps, c.compression(layer), b.backend,
        )  # fmt: skip
        self.mlp_hc = HyperConnection(b.width, c.streams, c.hc_iterations, c.hc_eps, eps)
        self.mlp_norm = Norm(b.width, eps)
        self.moe = HashMoE(
            b.width, c.num_experts, c.experts_per_token, c.expert_hidden,
            hashed=c.hashed_layers[layer], vocab_size=c.vocab_size, score=c.expert_score,
            scaling=c.expert_scaling, limit=c.swiglu_limit,
        )  # fmt: skip

    def forward(self, streams: Tensor, input_ids: Tensor, rotary: InterleavedRotary,
                positions: Tensor, cache: CompressedCache | None, record: bool):  # fmt: skip
        post, comb, x = self.attn_hc(streams)
        out, kept = self.attn(self.attn_norm(x), rotary, positions, cache, record)
        streams = HyperConnection.merge(streams, post, comb, out)
        post, comb, x = self.mlp_hc(streams)
        out = self.moe(self.mlp_norm(x), input_ids)
        return HyperConnection.merge(streams, post, comb, out), kept


class DeepseekV4Cache:
    """Every layer's `CompressedCache`: the window's keys and the compressors' states."""

    def __init__(self, num_layers: int):
        self.layers = [CompressedCache() for _ in range(num_layers)]
        self.cross = None

    @property
    def length(self) -> int:
        """How many tokens are cached."""
        return self.layers[0].length


NOT_TAKEN = ("context", "context_mask", "cross_layers", "edits", "resume", "weights")


class DeepseekV4Decoder(Decoder):
    """Token ids (B, T) -> next-token logits (B, T, vocab), through DeepSeek-V4's layers.

    >>> import torch
    >>> from qkv.nn import BlockConfig
    >>> cfg = DeepseekV4Config(vocab_size=50, num_layers=2, position="rotary", rope_dims=4,
    ...     attention_types=("csa", "hca"), hashed_layers=(True, False), q_rank=8,
    ...     out_groups=2, out_rank=4, hca_rate=8, index_heads=2, index_head_dim=8, index_top_k=2,
    ...     num_experts=4, experts_per_token=2, expert_hidden=8, streams=2,
    ...     block=BlockConfig(width=16, num_heads=4, num_kv_heads=1, head_dim=8, window=4))
    >>> out = DeepseekV4Decoder(cfg)(torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8, 9]]), layers=[0])
    >>> out.logits.shape, out.records[0].compressed.chosen.shape  # (B, T, entries)
    (torch.Size([1, 9, 50]), torch.Size([1, 9, 2]))
    """

    def __init__(self, config: DeepseekV4Config):
        nn.Module.__init__(self)
        self.config = config
        self.embed = config.embeddings()
        self.rotary = InterleavedRotary(config.rope_dims, config.rope_base)
        self.compress_rotary = InterleavedRotary(config.rope_dims, config.compress_rope_base,
                                                 config.compress_rope_scaling)  # fmt: skip
        self.blocks = nn.ModuleList(DeepseekV4Block(config, i) for i in range(config.num_layers))
        eps = config.block.norm_eps
        self.head = HyperHead(config.block.width, config.streams, config.hc_eps, eps)
        self.norm = Norm(config.block.width, eps)
        self.lm_head = nn.Linear(config.block.width, config.vocab_size, bias=False)
        self.apply(init_weights)
        self.tie_weights()

    def new_cache(self) -> DeepseekV4Cache:
        return DeepseekV4Cache(self.config.num_layers)

    def forward(
        self,
        input_ids: Tensor,
        *,
        attention_mask: Tensor | None = None,
        positions: Tensor | None = None,
        cache: DeepseekV4Cache | None = None,
        layers: Layers = None,
        logits: bool = True,
        hidden_states: bool = False,
        **others,
    ) -> DecoderOutput:
        """As Decoder's, for one text or texts of one length: no padding (the compressors
        pool blocks at absolute positions, padding included, so a padded row is not the row
        alone), no positions of the caller's own, no hidden_states (between layers a token
        is n streams, not one vector)."""
        cfg = self.config
        given = sorted(k for k, v in others.items() if v is not None and k in NOT_TAKEN)
        unknown = sorted(set(others) - set(NOT_TAKEN))
        if unknown:
            raise TypeError(f"unexpected arguments {unknown}")
        if given:
            raise ValueError(f"a DeepSeek-V4 decoder does not take {', '.join(given)}")
        if attention_mask is not None and not bool(attention_mask.all()):
            raise ValueError(
                "a DeepSeek-V4 decoder does not take a padded batch: its compressors pool "
                "blocks of tokens at absolute positions, padding included, so a padded row "
                "is not computed as the row alone; run each text on its own"
            )
        if hidden_states:
            raise ValueError("a DeepSeek-V4 decoder keeps n streams per token between layers "
                             "(hyper-connections), not one vector: hidden_states are not "
                             "given")  # fmt: skip
        offset = cache.length if cache is not None else 0
        if positions is not None:
            raise ValueError("a DeepSeek-V4 decoder places tokens after its cache itself; "
                             "positions are not taken")  # fmt: skip
        positions = positions_for(input_ids.shape[1], offset, input_ids.device)  # (T,)
        wanted = recorded_layers(layers, cfg.num_layers)
        x = self.embed(input_ids, positions)  # (B, T, C)
        streams = x.unsqueeze(2).expand(-1, -1, cfg.streams, -1).contiguous()  # (B, T, n, C)
        out = DecoderOutput(None, x)
        for i, block in enumerate(self.blocks):
            rotary = self.rotary if cfg.attention_types[i] == "sliding" else self.compress_rotary
            streams, kept = block(streams, input_ids, rotary, positions,
                                  cache.layers[i] if cache is not None else None,
                                  i in wanted)  # fmt: skip
            if kept is not None:
                out.records[i] = kept
        out.hidden = self.norm(self.head(streams))
        out.logits = self.project(out.hidden) if logits else None
        return out

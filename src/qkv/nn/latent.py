"""Multi-head latent attention (DeepSeek-V2 and V3): keys and values from one small vector.

Each token's keys and values for every head are made from one compressed vector c
(kv_lora_rank numbers, normed) and one rotary key k_pe (qk_rope_head_dim numbers) that all
heads share. A head's key is [k_nope, k_pe], with k_nope = W_uk_h c; its value is W_uv_h c.
Its query is [q_nope, q_pe], from x directly or through a low-rank step of its own. Only
q_pe and k_pe are turned by rotary positions, so a cache need keep only c and k_pe per token
(`LatentCache`), far less than every head's keys and values.

With absorption the key half of the expansion is folded into the query instead:
q_nope . (W_uk_h c) = (q_nope W_uk_h) . c, so attention runs over the cached vectors
themselves, with one key head [c, k_pe] and one value head c shared by every query head, and
each head's output is then W_uv_h times its attended latent vector. The scores, and so the
weights, are the same numbers; the vectors attention saw are the latent ones.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from qkv.attention import attend_for_record, backend_names
from qkv.nn.attention import KVCache
from qkv.nn.edit import Edit
from qkv.nn.linear import project
from qkv.nn.norms import RMSNorm
from qkv.nn.position import RotaryEmbedding, Rotation, positions_for
from qkv.nn.record import AttentionRecord
from qkv.nn.rope import RopeScaling


@dataclass(frozen=True)
class LatentConfig:
    """The sizes of one latent attention layer, named as in DeepSeek's config.

    width: hidden_size. q_lora_rank: the queries' low-rank step (None: one plain matrix).
    kv_lora_rank: the size of c. qk_nope_head_dim + qk_rope_head_dim: a query's and key's head
    size; v_head_dim: a value's. bias: attention_bias (on q_a, kv_a and out). norm_eps: of the
    two RMSNorms (1e-6 in DeepSeek's reference code, whatever rms_norm_eps says). scale: on
    every dot product; None for `softmax_scale` of the layer's rotary scaling.
    rope_interleave: how a checkpoint lays out the rotary rows of q (or q_b) and kv_a, not
    what this layer computes: in interleaved pairs (DeepSeek's rope_interleave, its default),
    which a loader reorders to the halves this layer turns (and back on export); False: in
    halves already.
    """

    width: int
    num_heads: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None
    bias: bool = False
    norm_eps: float = 1e-6
    scale: float | None = None
    rope_interleave: bool = False

    def __post_init__(self):
        sizes = ("width", "num_heads", "kv_lora_rank", "qk_nope_head_dim", "v_head_dim")
        for name in (*sizes, "qk_rope_head_dim"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ValueError(f"LatentConfig.{name} must be a whole number >= 1, got {value!r}")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim must be even, got {self.qk_rope_head_dim}")
        rank = self.q_lora_rank
        if rank is not None and (type(rank) is not int or rank < 1):
            raise ValueError(f"q_lora_rank must be a whole number >= 1 or None, got {rank!r}")

    @property
    def qk_head_dim(self) -> int:
        """A query's and a key's head size: the unturned part and the rotary part."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def cache_bytes_per_token(self, dtype: torch.dtype) -> int:
        """What `LatentCache` keeps per token and layer: c and k_pe."""
        return (self.kv_lora_rank + self.qk_rope_head_dim) * _size(dtype)

    def expanded_bytes_per_token(self, dtype: torch.dtype) -> int:
        """What a `KVCache` of every head's keys and values would keep per token and layer."""
        return self.num_heads * (self.qk_head_dim + self.v_head_dim) * _size(dtype)


def softmax_scale(qk_head_dim: int, scaling: RopeScaling | None = None) -> float:
    """DeepSeek's scale on every dot product: qk_head_dim**-0.5, times mscale**2 where the
    rotary scaling names mscale_all_dim (YaRN), mscale = 0.1 * mscale_all_dim * ln(factor) + 1
    (1 for a factor <= 1)."""
    scale = qk_head_dim**-0.5
    if scaling is not None and scaling.mscale_all_dim:
        factor = scaling.factor
        mscale = 1.0 if factor <= 1 else 0.1 * scaling.mscale_all_dim * math.log(factor) + 1.0
        scale = scale * mscale * mscale
    return scale


class LatentCache:
    """The compressed vectors of tokens already seen by one latent attention layer.

    Per token, one row [c, k_pe]: the normed c (kv_lora_rank) and the rotated k_pe
    (qk_rope_head_dim), kept as one head (B, 1, capacity, kv_lora_rank + rope), never every
    head's keys and values. Each step expands them again through kv_b (or, with absorption,
    attends to them as they are). Storage grows by doubling, as `KVCache`'s. Inference only.
    """

    def __init__(self) -> None:
        self.entries: Tensor | None = None  # (B, 1, capacity, kv_lora_rank + rope)
        self.rank = 0  # kv_lora_rank: where c ends and k_pe begins in a row
        self.length = 0

    @classmethod
    def holding(cls, latents: Tensor, rotary_keys: Tensor) -> LatentCache:
        """A cache that already holds these c (B, 1, T, kv_lora_rank) and k_pe (B, 1, T, rope)
        of tokens run before, copied into storage of its own."""
        cache = cls()
        cache.update(latents, rotary_keys)
        return cache

    def update(self, latents: Tensor, rotary_keys: Tensor) -> tuple[Tensor, Tensor]:
        """Append c (B, 1, T, kv_lora_rank) and k_pe (B, 1, T, rope); return all so far."""
        T, width = latents.shape[2], latents.shape[3] + rotary_keys.shape[3]
        if self.entries is None or self.length + T > self.entries.shape[2]:
            capacity = max(16, 2 * (self.length + T))
            entries = latents.new_empty(latents.shape[0], 1, capacity, width)
            if self.entries is not None:
                entries[:, :, : self.length] = self.entries[:, :, : self.length]
            self.entries, self.rank = entries, latents.shape[3]
        new = self.entries[:, :, self.length : self.length + T]
        new[..., : self.rank], new[..., self.rank :] = latents, rotary_keys
        self.length += T
        return self.stored()

    def joined(self) -> Tensor:
        """Every cached row [c, k_pe], (B, 1, length, kv_lora_rank + rope): absorbed keys."""
        assert self.entries is not None
        return self.entries[:, :, : self.length]

    def stored(self) -> tuple[Tensor, Tensor]:
        """c (B, 1, length, kv_lora_rank) and k_pe (B, 1, length, rope), without appending."""
        rows = self.joined()
        return rows[..., : self.rank], rows[..., self.rank :]

    def bytes_per_token(self) -> int:
        """Bytes kept per token of one text: (kv_lora_rank + rope) numbers of the cache's dtype."""
        assert self.entries is not None, "an empty cache has no dtype yet"
        return self.entries.shape[3] * self.entries.element_size()


class LatentAttention(nn.Module):
    """DeepSeek-V3's multi-head latent attention; x (B, T, C) -> (B, T, C).

    Parameters, each an nn.Linear or RMSNorm (transformers' DeepseekV3Attention name first):
    q_proj -> q (without q_lora_rank); q_a_proj -> q_a, q_a_layernorm -> q_a_norm,
    q_b_proj -> q_b; kv_a_proj_with_mqa -> kv_a (rows [c; k_pe]); kv_a_layernorm -> kv_a_norm;
    kv_b_proj -> kv_b (per head, rows [k_nope; v]); o_proj -> out. Rotary turns q_pe and k_pe
    in the half-rotation layout only: a checkpoint whose rope dimensions come in interleaved
    pairs (rope_interleave, DeepSeek's default) has its rows reordered once, at load time, by
    `from_transformers`, which is exact (a permutation of a product's rows).

    rotary: a RotaryEmbedding of qk_rope_head_dim dimensions, or None for a layer without
    positions (Kimi Linear's): q_pe and k_pe then stay as made, k_pe one more part of every
    head's key that all heads share, and the scale is qk_head_dim**-0.5. absorb: attend over
    the latent vectors (see the module's text); forward's absorb overrides it for one call.

    >>> config = LatentConfig(16, 2, kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=2,
    ...                       v_head_dim=3)
    >>> mla = LatentAttention(config, RotaryEmbedding(2))
    >>> out, record = mla(torch.randn(1, 5, 16), record=True)
    >>> out.shape, record.k.shape, record.v.shape
    (torch.Size([1, 5, 16]), torch.Size([1, 2, 5, 6]), torch.Size([1, 2, 5, 3]))
    """

    def __init__(
        self,
        config: LatentConfig,
        rotary: RotaryEmbedding | None,
        *,
        backend: str = "auto",
        absorb: bool = False,
    ):
        super().__init__()
        cfg = config
        if backend not in backend_names():
            raise ValueError(f"unknown attention backend {backend!r}; allowed: {backend_names()}")
        if rotary is not None and (
            rotary.head_dim != cfg.qk_rope_head_dim or rotary.dims != rotary.head_dim
        ):
            raise ValueError(
                f"the rotary embedding must turn all of qk_rope_head_dim={cfg.qk_rope_head_dim} "
                f"dimensions, got head_dim={rotary.head_dim}, dims={rotary.dims}"
            )
        self.config, self.rotary, self.backend, self.absorb = cfg, rotary, backend, absorb
        self.scale = cfg.scale
        if self.scale is None:  # DeepSeek's: with YaRN's mscale**2 where the rotary has one
            self.scale = softmax_scale(cfg.qk_head_dim, None if rotary is None else rotary.scaling)
        H = cfg.num_heads
        if cfg.q_lora_rank is None:
            self.q = nn.Linear(cfg.width, H * cfg.qk_head_dim, bias=False)
        else:
            self.q_a = nn.Linear(cfg.width, cfg.q_lora_rank, bias=cfg.bias)
            self.q_a_norm = RMSNorm(cfg.q_lora_rank, cfg.norm_eps)
            self.q_b = nn.Linear(cfg.q_lora_rank, H * cfg.qk_head_dim, bias=False)
        self.kv_a = nn.Linear(cfg.width, cfg.kv_lora_rank + cfg.qk_rope_head_dim, bias=cfg.bias)
        self.kv_a_norm = RMSNorm(cfg.kv_lora_rank, cfg.norm_eps)
        kv_b_rows = H * (cfg.qk_nope_head_dim + cfg.v_head_dim)  # per head [k_nope; v]
        self.kv_b = nn.Linear(cfg.kv_lora_rank, kv_b_rows, bias=False)
        self.out = nn.Linear(H * cfg.v_head_dim, cfg.width, bias=cfg.bias)

    @property
    def num_heads(self) -> int:
        return self.config.num_heads

    @property
    def value_size(self) -> int:
        """The size of each head's output, where an edit replaces it: its values', v_head_dim."""
        return self.config.v_head_dim

    def queries(self, x: Tensor) -> Tensor:
        """Every head's query (B, H, T, nope + rope), before rotary positions."""
        cfg, (B, T, _) = self.config, x.shape
        if cfg.q_lora_rank is None:
            q = project(self.q, x)
        else:
            q = project(self.q_b, self.q_a_norm(project(self.q_a, x)))
        return q.view(B, T, cfg.num_heads, cfg.qk_head_dim).transpose(1, 2)

    def latents(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Each token's normed c (B, 1, T, kv_lora_rank) and k_pe (B, 1, T, rope), unturned."""
        compressed = project(self.kv_a, x)[:, None]  # (B, 1, T, kv_lora_rank + rope)
        c, k_pe = compressed.split([self.config.kv_lora_rank, self.config.qk_rope_head_dim], -1)
        return self.kv_a_norm(c), k_pe

    def expand(self, latents: Tensor) -> tuple[Tensor, Tensor]:
        """c (B, 1, Tk, kv_lora_rank) -> every head's k_nope (B, H, Tk, nope), v (B, H, Tk, Dv)."""
        cfg, (B, _, Tk, _) = self.config, latents.shape
        kv = project(self.kv_b, latents).view(B, Tk, cfg.num_heads, -1).transpose(1, 2)
        return kv.split([cfg.qk_nope_head_dim, cfg.v_head_dim], dim=-1)

    def _kv_b_halves(self) -> tuple[Tensor, Tensor]:
        """kv_b's matrix per head: W_uk (H, nope, kv_lora_rank) and W_uv (H, Dv, kv_lora_rank)."""
        cfg = self.config
        weight = self.kv_b.weight.view(cfg.num_heads, cfg.qk_nope_head_dim + cfg.v_head_dim, -1)
        return weight.split([cfg.qk_nope_head_dim, cfg.v_head_dim], dim=1)

    def forward(
        self,
        x: Tensor,
        *,
        mask: Tensor | None = None,
        key_padding_mask: Tensor | None = None,
        causal: bool = True,
        positions: Tensor | None = None,
        rotation: Rotation | None = None,
        cache: LatentCache | KVCache | None = None,
        bias: Tensor | None = None,
        edit: Edit | None = None,
        record: bool = False,
        weights_into: Tensor | None = None,
        absorb: bool | None = None,
    ) -> tuple[Tensor, AttentionRecord | None]:
        """Contextualize x; return (out (B, T, C), this call's AttentionRecord or None).

        mask, key_padding_mask, positions, rotation, bias, edit, record, weights_into: as
        `MultiHeadAttention.forward`'s (self-attention; causal by default, as DeepSeek is).
          eager's one-pass weights take values of the keys' size only, so weights_into is
          left alone here (the record's `made` is None; `weights()` computes them).
        cache: a `LatentCache`; this step's c and k_pe are appended and all of them attended.
          A `KVCache` instead holds what attention attends to, as a record keeps it (every
          head's keys and values; with absorption the rows [c, k_pe] and c): so a cache made
          of an earlier run's records (`KVCache.holding(record.k, record.v)`) serves too.
        absorb: this call with absorption (None: the layer's `absorb`). The record then holds
          q' = [q_nope W_uk_h, q_pe] (B, H, T, kv_lora_rank + rope), k' = [c, k_pe] and
          v' = c, one head shared by all (B, 1, Tk, ...), and out, the attended latent vectors
          (B, H, T, kv_lora_rank) before W_uv; its weights and steps are the model's.
        """
        if weights_into is not None and not record:
            raise ValueError("weights_into makes the weights a record keeps: pass record=True")
        absorb = self.absorb if absorb is None else absorb
        cfg, (B, T, _) = self.config, x.shape
        q_plain = self.queries(x)  # (B, H, T, nope + rope)
        q_nope, q_pe = q_plain.split([cfg.qk_nope_head_dim, cfg.qk_rope_head_dim], dim=-1)
        latents, k_pe = self.latents(x)
        if self.rotary is None and rotation is None:  # no positions (Kimi): nothing turns
            q_pe_turned, k_pe_turned = q_pe, k_pe
        else:
            if rotation is None:
                if positions is None:
                    positions = positions_for(T, cache.length if cache else 0, x.device)
                rotation = self.rotary.rotation(positions, q_plain.dtype)
            elif rotation.cos.shape[-1] != cfg.qk_rope_head_dim:
                raise ValueError(
                    f"the rotation turns {rotation.cos.shape[-1]} dimensions; this layer's "
                    f"rotary part has qk_rope_head_dim={cfg.qk_rope_head_dim}"
                )
            q_pe_turned, k_pe_turned = rotation.apply(q_pe), rotation.apply(k_pe)
        if absorb:
            w_uk, w_uv = self._kv_b_halves()
            q_latent = q_nope @ w_uk  # (B, H, T, kv_lora_rank): the query in c's space
            q = torch.cat([q_latent, q_pe_turned], dim=-1)
            q_plain = torch.cat([q_latent, q_pe], dim=-1)
            k_plain = torch.cat([latents, k_pe], dim=-1)
            if isinstance(cache, LatentCache):
                v = cache.update(latents, k_pe_turned)[0]  # (B, 1, Tk, kv_lora_rank)
                k = cache.joined()  # (B, 1, Tk, kv_lora_rank + rope)
            else:
                k, v = torch.cat([latents, k_pe_turned], dim=-1), latents
                if cache is not None:
                    k, v = cache.update(k, v)
        else:
            q = torch.cat([q_nope, q_pe_turned], dim=-1)
            H = cfg.num_heads
            if isinstance(cache, LatentCache):
                all_latents, all_k_pe = cache.update(latents, k_pe_turned)
                k_nope, v = self.expand(all_latents)  # (B, H, Tk, nope), (B, H, Tk, Dv)
                k = torch.cat([k_nope, all_k_pe.expand(-1, H, -1, -1)], dim=-1)
                k_plain = torch.cat([k_nope[:, :, -T:], k_pe.expand(-1, H, -1, -1)], -1)
            else:
                k_nope, v = self.expand(latents)  # (B, H, T, nope), (B, H, T, Dv)
                k = torch.cat([k_nope, k_pe_turned.expand(-1, H, -1, -1)], dim=-1)
                k_plain = torch.cat([k_nope, k_pe.expand(-1, H, -1, -1)], dim=-1)
                if cache is not None:
                    k, v = cache.update(k, v)
        if key_padding_mask is not None:
            padding = key_padding_mask.to(torch.bool)[:, None, None, :]  # (B, 1, 1, Tk)
            mask = padding if mask is None else mask & padding
        if edit is not None:
            edit.refuse_per_head("latent attention (LatentAttention)")
            mask = edit.mask(mask)
        attended = attend_for_record(
            q, k, v, mask=mask, causal=causal, scale=self.scale, bias=bias, backend=self.backend,
            weights=weights_into,
        )  # fmt: skip
        out = attended.out
        kept = None
        if record:
            kept = AttentionRecord(
                q, k, v, out, mask, causal, self.scale, self.backend, attended.lse, q_plain,
                k_plain, bias=bias, made=attended.made, absorbed=absorb,
            )  # fmt: skip
        if absorb:
            out = out @ w_uv.transpose(1, 2)  # each head's W_uv: (B, H, T, Dv)
        if edit is not None:
            out = edit.head_outputs(out)
        concatenated = out.transpose(1, 2).reshape(B, T, -1)  # heads side by side (B, T, H*Dv)
        return project(self.out, concatenated), kept


def from_transformers(
    state: Mapping[str, Tensor], config: LatentConfig, *, interleaved: bool = True
) -> dict[str, Tensor]:
    """One DeepseekV3Attention's state dict (keys relative to it: "q_a_proj.weight", ...) as
    `LatentAttention`'s: each key renamed (see `TRANSFORMERS_NAMES`) and, where the checkpoint
    lays its rope dimensions out in interleaved pairs (rope_interleave), the rows that make
    q_pe (of every head) and k_pe reordered to halves: pair (2i, 2i+1) -> (i, i + rope/2)."""
    rope, nope, rank = config.qk_rope_head_dim, config.qk_nope_head_dim, config.kv_lora_rank
    halves = torch.cat([torch.arange(0, rope, 2), torch.arange(1, rope, 2)])
    ours = {}
    for key, value in state.items():
        module, _, kind = key.rpartition(".")
        if module not in TRANSFORMERS_NAMES:
            raise ValueError(f"{key!r} is not a parameter of DeepseekV3Attention")
        name = TRANSFORMERS_NAMES[module]
        if interleaved and name in ("q", "q_b"):
            heads = value.view(config.num_heads, config.qk_head_dim, *value.shape[1:])
            order = torch.cat([torch.arange(nope), nope + halves])
            value = heads[:, order].reshape(value.shape)
        elif interleaved and name == "kv_a":
            value = value[torch.cat([torch.arange(rank), rank + halves])]
        ours[f"{name}.{kind}"] = value
    return ours


# transformers' DeepseekV3Attention module names -> LatentAttention's
TRANSFORMERS_NAMES = {
    "q_proj": "q",
    "q_a_proj": "q_a",
    "q_a_layernorm": "q_a_norm",
    "q_b_proj": "q_b",
    "kv_a_proj_with_mqa": "kv_a",
    "kv_a_layernorm": "kv_a_norm",
    "kv_b_proj": "kv_b",
    "o_proj": "out",
}


def _size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()

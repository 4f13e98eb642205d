"""Layers built on `attend`: multi-head attention, positions, norms, MLPs and blocks."""

from qkv.nn.attention import KVCache, MultiHeadAttention
from qkv.nn.blocks import BlockConfig, DecoderBlock, EncoderBlock
from qkv.nn.edit import Edit, Edits
from qkv.nn.embeddings import Embeddings
from qkv.nn.experts import ExpertRecord, MoE, Routing
from qkv.nn.latent import LatentAttention, LatentCache, LatentConfig
from qkv.nn.mlps import MLP, SwiGLU
from qkv.nn.norms import RMSNorm, make_norm
from qkv.nn.position import (
    LearnedPositions,
    RotaryEmbedding,
    Rotation,
    SinusoidalPositions,
    rotate_half,
)
from qkv.nn.record import AttentionRecord

__all__ = [
    "MLP",
    "AttentionRecord",
    "BlockConfig",
    "DecoderBlock",
    "Edit",
    "Edits",
    "Embeddings",
    "EncoderBlock",
    "ExpertRecord",
    "KVCache",
    "LatentAttention",
    "LatentCache",
    "LatentConfig",
    "LearnedPositions",
    "MoE",
    "MultiHeadAttention",
    "RMSNorm",
    "RotaryEmbedding",
    "Rotation",
    "Routing",
    "SinusoidalPositions",
    "SwiGLU",
    "make_norm",
    "rotate_half",
]

"""Position embeddings, norms and MLPs against their definitions and torch's own layers."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from qkv.nn import (
    MLP,
    Embeddings,
    LearnedPositions,
    RMSNorm,
    RotaryEmbedding,
    SinusoidalPositions,
    SwiGLU,
)


def test_sinusoidal_follows_the_papers_formula():
    C, positions = 10, torch.arange(7)
    table = SinusoidalPositions(C)(positions)
    for pos in range(7):
        for i in range(C // 2):
            angle = pos / 10000 ** (2 * i / C)
            assert math.isclose(table[pos, 2 * i].item(), math.sin(angle), abs_tol=1e-6)
            assert math.isclose(table[pos, 2 * i + 1].item(), math.cos(angle), abs_tol=1e-6)


def test_rotary_is_the_half_split_complex_rotation():
    """Llama's layout: dimension i pairs with i + D/2 and turns by pos * base^(-2i/D)."""
    D, base = 8, 500.0
    rotary = RotaryEmbedding(D, base=base)
    x = torch.randn(1, 2, 5, D, dtype=torch.float64)
    positions = torch.arange(3, 8)
    got = rotary(x, positions)
    theta = base ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
    z = torch.complex(x[..., : D // 2], x[..., D // 2 :])
    turned = z * torch.polar(torch.ones(5, D // 2).double(), positions[:, None] * theta)
    torch.testing.assert_close(got, torch.cat([turned.real, turned.imag], -1), atol=1e-6, rtol=0)


def test_rotary_scores_depend_only_on_the_distance_between_words():
    rotary = RotaryEmbedding(16)
    q, k = torch.randn(1, 1, 1, 16).double(), torch.randn(1, 1, 1, 16).double()

    def score(m, n):
        return (rotary(q, torch.tensor([m])) * rotary(k, torch.tensor([n]))).sum().item()

    assert math.isclose(score(3, 1), score(12, 10), rel_tol=1e-6)
    assert not math.isclose(score(3, 1), score(3, 2), rel_tol=1e-3)


def test_rotary_takes_a_row_of_positions_per_sequence():
    rotary = RotaryEmbedding(4)
    x = torch.randn(2, 3, 5, 4)
    positions = torch.tensor([[0, 1, 2, 3, 4], [2, 3, 4, 5, 6]])
    got = rotary(x, positions)
    torch.testing.assert_close(got[1], rotary(x[1:], torch.arange(2, 7))[0])


def test_learned_positions_refuse_positions_past_the_table():
    with pytest.raises(ValueError, match="position 8 is past this model's 8 learned positions"):
        LearnedPositions(8, 4)(torch.arange(9))


def test_rmsnorm_matches_torch():
    ours, theirs = RMSNorm(12, eps=1e-6), nn.RMSNorm(12, eps=1e-6)
    with torch.no_grad():
        ours.weight.normal_()
        theirs.weight.copy_(ours.weight)
    x = torch.randn(3, 5, 12)
    torch.testing.assert_close(ours(x), theirs(x))


def test_mlp_and_swiglu_compute_their_formulas():
    x = torch.randn(2, 3, 8)
    mlp = MLP(8, 16, "gelu_tanh")
    expected = mlp.fc_out(F.gelu(mlp.fc_in(x), approximate="tanh"))
    torch.testing.assert_close(mlp(x), expected)
    glu = SwiGLU(8, 16)
    gate, up = glu.gate(x), glu.up(x)
    torch.testing.assert_close(glu(x), glu.down(gate * torch.sigmoid(gate) * up))


def test_embeddings_add_positions_rather_than_concatenate():
    emb = Embeddings(20, 6, position="learned", max_positions=10, type_vocab_size=2)
    ids, positions = torch.tensor([[3, 4, 5]]), torch.arange(3)
    types = torch.tensor([[0, 1, 1]])
    got = emb(ids, positions, types)
    expected = emb.tokens(ids) + emb.positions(positions) + emb.types(types)
    assert got.shape == (1, 3, 6)
    torch.testing.assert_close(got, expected)
    with pytest.raises(ValueError, match="token ids must be in 0-19"):
        emb(torch.tensor([[20]]), torch.arange(1))

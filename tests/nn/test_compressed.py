"""DeepSeek-V4's layers on their own: the compressor, the indexer's mask, the record of
compressed attention, hyper-connections and hashed experts (against transformers in
tests/io/test_family_deepseek_v4.py)."""

from __future__ import annotations

import pytest
import torch

from qkv.nn.compressed import (
    CompressedAttention,
    CompressedCache,
    Compression,
    Compressor,
    CompressorState,
    InterleavedRotary,
)
from qkv.nn.hash_moe import HashMoE
from qkv.nn.hyper import HyperConnection


def _randomized(module: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn_like(p) * (0.5 if p.dim() > 1 else 1.0))
    return module.double().eval()


@pytest.mark.parametrize("overlap", [True, False], ids=["csa", "hca"])
def test_entries_made_a_token_at_a_time_equal_those_made_at_once(overlap):
    compressor = _randomized(Compressor(16, 8, rate=4, overlap=overlap, eps=1e-6))
    rotary = InterleavedRotary(4, 1000.0)
    x = torch.randn(2, 23, 16, dtype=torch.float64)
    at_once = CompressorState()
    entries = compressor(x, rotary, at_once)
    one_by_one = CompressorState()
    for t in range(23):
        compressor(x[:, t : t + 1], rotary, one_by_one)
    assert entries.shape == (2, 5, 8) and one_by_one.count == 5
    torch.testing.assert_close(one_by_one.entries, entries)
    torch.testing.assert_close(one_by_one.coefficients, at_once.coefficients)
    coefficients = at_once.coefficients  # (B, N, S): a softmax over the slots, channel-averaged
    torch.testing.assert_close(coefficients.sum(-1), torch.ones(2, 5, dtype=torch.float64))
    blocks = compressor.blocks(5)
    if overlap:  # entry n pools the block before it and its own; entry 0 has nothing before
        assert blocks[1].tolist() == list(range(0, 8))
        assert (blocks[0, :4] == -1).all() and (coefficients[:, 0, :4] == 0).all()
    else:
        assert blocks[1].tolist() == list(range(4, 8))


def _attention(top_k: int | None) -> CompressedAttention:
    compression = Compression(4, top_k, 4, 8) if top_k else Compression(4)
    return _randomized(CompressedAttention(16, 4, 8, 12, 2, 4, window=6, eps=1e-6,
                                           compression=compression))  # fmt: skip


@pytest.mark.parametrize("top_k", [2, None], ids=["csa", "hca"])
def test_the_record_is_what_the_softmax_ran_over(top_k):
    attention, rotary = _attention(top_k), InterleavedRotary(4, 1000.0)
    x = torch.randn(1, 30, 16, dtype=torch.float64)
    _, record = attention(x, rotary, torch.arange(30), record=True)
    weights = record.weights()  # (B, H, Tq, 30 words + 7 entries)
    assert weights.shape == (1, 4, 30, 37)
    torch.testing.assert_close(weights @ record.v.expand(-1, 4, -1, -1), record.out)
    keys = record.compressed
    entries = weights[..., 30:]
    if top_k:  # an entry the indexer did not choose has no weight, one it chose has some
        chosen = keys.chosen[:, None].expand_as(entries)
        assert (entries[~chosen] == 0).all() and (entries[chosen] > 0).all()
        assert int(keys.chosen.sum(-1).max()) == top_k
    else:  # every complete entry, and only those
        ready = keys.ready[None, None].expand_as(entries)
        assert (entries[~ready] == 0).all() and (entries[ready] > 0).all()
    words = keys.on_words(weights)
    torch.testing.assert_close(words.sum(-1), weights.sum(-1))


def test_a_block_not_complete_at_the_query_is_the_reason():
    attention = _randomized(CompressedAttention(16, 4, 8, 12, 2, 4, window=6, eps=1e-6,
                                                compression=Compression(16)))  # fmt: skip
    x = torch.randn(1, 40, 16, dtype=torch.float64)
    record = attention(x, InterleavedRotary(4, 1000.0), torch.arange(40), record=True)[1]
    keys = record.compressed
    words = keys.on_words(record.weights())[0].sum(0)  # (Tq, T)
    assert keys.why_zero(query=24, word=16) == (
        "word 16 is outside the window of 6 words before 24; entry 1 (words 16..31) is not "
        "complete at the query"
    )
    assert keys.why_zero(query=24, word=3) is None  # in entry 0, complete at 15
    assert keys.why_zero(query=24, word=20) is None  # in the window (19..24)
    assert keys.why_zero(query=29, word=30) == "word 30 comes after the query (position 29)"
    for query, word in [(24, 16), (24, 3), (24, 20), (29, 30)]:
        assert (keys.why_zero(query, word) is None) == bool(words[query, word] > 0)


def test_cached_calls_equal_one_call():
    attention, rotary = _attention(2), InterleavedRotary(4, 1000.0)
    x = torch.randn(1, 21, 16, dtype=torch.float64)
    whole, _ = attention(x, rotary, torch.arange(21))
    cache = CompressedCache()
    parts = [attention(x[:, :3], rotary, torch.arange(3), cache)[0]]
    parts += [attention(x[:, t : t + 1], rotary, torch.arange(t, t + 1), cache)[0]
              for t in range(3, 21)]  # fmt: skip
    torch.testing.assert_close(torch.cat(parts, 1), whole)
    assert cache.length == 21 and cache.keys.shape[2] == 5  # the window's last 5 keys


def test_sinkhorn_makes_the_stream_mix_doubly_stochastic():
    mix = _randomized(HyperConnection(8, 3, iterations=50, eps=1e-9, norm_eps=1e-6))
    streams = torch.randn(2, 5, 3, 8, dtype=torch.float64)
    post, comb, collapsed = mix(streams)
    ones = torch.ones(2, 5, 3, dtype=torch.float64)
    torch.testing.assert_close(comb.sum(-1), ones, atol=1e-6, rtol=0)
    torch.testing.assert_close(comb.sum(-2), ones, atol=1e-6, rtol=0)
    assert post.shape == (2, 5, 3) and collapsed.shape == (2, 5, 8)
    merged = HyperConnection.merge(streams, post, comb, torch.zeros(2, 5, 8, dtype=torch.float64))
    torch.testing.assert_close(merged.sum(2), streams.sum(2))  # columns of comb sum to 1


def test_hashed_experts_are_the_tables_and_the_weights_sum_to_the_scaling():
    moe = HashMoE(8, 4, 2, 6, hashed=True, vocab_size=10, scaling=1.5).double()
    torch.manual_seed(0)
    with torch.no_grad():
        moe.router.normal_()
        moe.token_experts.copy_(torch.stack([torch.randperm(4)[:2] for _ in range(10)]))
    ids = torch.tensor([3, 7, 3])
    experts, weights = moe.route(torch.randn(3, 8, dtype=torch.float64), ids)
    assert torch.equal(experts, moe.token_experts[ids])
    torch.testing.assert_close(weights.sum(-1), torch.full((3,), 1.5, dtype=torch.float64))

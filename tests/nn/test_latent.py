"""LatentAttention against transformers' DeepseekV3Attention with the same weights."""

from __future__ import annotations

import pytest
import torch
from transformers import DeepseekV3Config
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
    DeepseekV3Attention,
    DeepseekV3RotaryEmbedding,
)

from qkv.nn import Edit, RotaryEmbedding
from qkv.nn.latent import (
    LatentAttention,
    LatentCache,
    LatentConfig,
    from_transformers,
)
from qkv.nn.rope import RopeScaling

YARN = dict(factor=4.0, original_max_position_embeddings=64, beta_fast=32, beta_slow=1,
            mscale=0.707, mscale_all_dim=1.0)  # fmt: skip
SIZES = dict(kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6)


def pair(q_lora_rank=16, yarn=False, bias=False, interleave=True, backend="auto", seed=0):
    """transformers' layer with noise on every parameter, and LatentAttention loaded from it."""
    torch.manual_seed(seed)
    rope = dict(rope_type="yarn", rope_theta=10000.0, **YARN) if yarn else None
    hf = DeepseekV3Config(
        hidden_size=32, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=q_lora_rank,
        num_hidden_layers=1, vocab_size=8, max_position_embeddings=256, attention_bias=bias,
        rope_parameters=rope, rope_interleave=interleave, attn_implementation="eager", **SIZES,
    )  # fmt: skip
    theirs = DeepseekV3Attention(hf, layer_idx=0).eval()
    with torch.no_grad():
        for name, p in theirs.named_parameters():
            if "layernorm" in name:
                p.copy_(1 + 0.3 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.3 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * p.shape[1] ** -0.5)
    config = LatentConfig(32, 4, q_lora_rank=q_lora_rank, bias=bias, **SIZES)
    scaling = RopeScaling("yarn", original_max_positions=64, **{
        k: v for k, v in YARN.items() if k != "original_max_position_embeddings"
    }) if yarn else None  # fmt: skip
    ours = LatentAttention(config, RotaryEmbedding(4, 10000.0, scaling=scaling), backend=backend)
    ours.load_state_dict(from_transformers(theirs.state_dict(), config, interleaved=interleave))
    return ours, theirs, DeepseekV3RotaryEmbedding(hf)


def reference(theirs, rotary, x, real=None):
    """transformers' output and eager weights: causal, with key padding where `real` is False."""
    B, T, _ = x.shape
    position_ids = torch.arange(T)[None].expand(B, T)
    allowed = torch.ones(T, T, dtype=torch.bool).tril()[None, None].expand(B, 1, T, T)
    if real is not None:
        allowed = allowed & real[:, None, None, :]
    mask = torch.zeros(B, 1, T, T).masked_fill(~allowed, torch.finfo(torch.float32).min)
    with torch.no_grad():
        return theirs(x, rotary(x, position_ids), mask)


CASES = {
    "q_lora": dict(q_lora_rank=16),
    "q_plain_bias": dict(q_lora_rank=None, bias=True),
    "yarn_bias": dict(q_lora_rank=16, yarn=True, bias=True),
    "halves_yarn": dict(q_lora_rank=None, yarn=True, interleave=False),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("absorb", [False, True])
def test_matches_deepseek_v3_attention(case, absorb):
    ours, theirs, rotary = pair(**CASES[case])
    x = torch.randn(2, 10, 32)
    want, want_weights = reference(theirs, rotary, x)
    with torch.no_grad():
        got, record = ours(x, record=True, absorb=absorb)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    torch.testing.assert_close(record.weights(), want_weights, atol=1e-6, rtol=0)
    if CASES[case].get("yarn"):  # the softmax scale carries mscale(4, 1)**2
        assert ours.scale == pytest.approx(theirs.scaling) and ours.scale > 12**-0.5


def test_the_record_holds_the_vectors_attention_saw():
    ours, _, _ = pair()
    x = torch.randn(1, 7, 32)
    with torch.no_grad():
        _, plain = ours(x, record=True)
        _, absorbed = ours(x, record=True, absorb=True)
    assert plain.q.shape == plain.k.shape == (1, 4, 7, 12) and plain.v.shape == (1, 4, 7, 6)
    # absorbed: q' = [q_nope W_uk, q_pe], k' = [c, k_pe] and v' = c, one key head for all
    assert absorbed.q.shape == (1, 4, 7, 16) and absorbed.k.shape == (1, 1, 7, 16)
    assert absorbed.v.shape == (1, 1, 7, 12) and absorbed.out.shape == (1, 4, 7, 12)
    torch.testing.assert_close(absorbed.weights(), plain.weights(), atol=1e-6, rtol=0)
    # the rotary part of q' is the model's own q_pe; only the unturned part moved to c's space
    torch.testing.assert_close(absorbed.q[..., 12:], plain.q[..., 8:])
    torch.testing.assert_close(absorbed.q_before_rotary[..., 12:], plain.q_before_rotary[..., 8:])
    assert not torch.allclose(absorbed.q[..., 12:], absorbed.q_before_rotary[..., 12:])


@pytest.mark.parametrize("absorb", [False, True])
def test_decoding_token_by_token_with_the_latent_cache_matches_the_full_pass(absorb):
    ours, _, _ = pair(yarn=True)
    x = torch.randn(2, 10, 32)
    cache = LatentCache()
    with torch.no_grad():
        full, _ = ours(x)
        prefix, _ = ours(x[:, :3], cache=cache, absorb=absorb)
        steps = [ours(x[:, t : t + 1], cache=cache, absorb=absorb)[0] for t in range(3, 10)]
    torch.testing.assert_close(torch.cat([prefix, *steps], dim=1), full, atol=1e-5, rtol=0)
    # it keeps c and k_pe per token, one head, and nothing else
    c, k_pe = cache.stored()
    assert cache.length == 10 and c.shape == (2, 1, 10, 12) and k_pe.shape == (2, 1, 10, 4)
    assert cache.entries.shape[:2] == (2, 1) and cache.entries.shape[3] == 12 + 4
    assert cache.bytes_per_token() == (12 + 4) * 4
    assert ours.config.cache_bytes_per_token(torch.float32) == (12 + 4) * 4
    assert ours.config.expanded_bytes_per_token(torch.float32) == 4 * (12 + 6) * 4
    with torch.no_grad():  # the cached c is the normed one, the cached k_pe the turned one
        latents, _ = ours.latents(x)
    torch.testing.assert_close(c, latents)


def test_a_cache_holding_a_prefix_decodes_as_one_that_ran_it():
    ours, _, _ = pair()
    x = torch.randn(1, 6, 32)
    ran = LatentCache()
    with torch.no_grad():
        ours(x[:, :5], cache=ran)
        held = LatentCache.holding(*ran.stored())
        want, _ = ours(x[:, 5:], cache=ran)
        got, _ = ours(x[:, 5:], cache=held)
    torch.testing.assert_close(got, want)
    assert held.length == ran.length == 6


@pytest.mark.parametrize("absorb", [False, True])
def test_a_left_padded_row_equals_the_row_alone(absorb):
    ours, theirs, rotary = pair(q_lora_rank=None, bias=True)
    x = torch.randn(1, 6, 32)
    padded = torch.cat([torch.randn(1, 3, 32), x], dim=1)
    real = torch.tensor([[False] * 3 + [True] * 6])
    positions = (real.long().cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        alone, _ = ours(x, absorb=absorb)
        got, record = ours(padded, key_padding_mask=real, positions=positions, record=True,
                           absorb=absorb)  # fmt: skip
    torch.testing.assert_close(got[:, 3:], alone, atol=1e-5, rtol=0)
    assert (record.weights()[..., :3] == 0).all(), "padding gets no attention"
    # transformers, asked the same with its own mask, agrees on the real queries' weights
    _, want_weights = reference(theirs, rotary, padded, real)
    torch.testing.assert_close(record.weights()[..., 3:, :], want_weights[..., 3:, :],
                               atol=1e-5, rtol=0)  # fmt: skip


@pytest.mark.parametrize("absorb", [False, True])
def test_steps_reproduce_the_records_output(absorb):
    ours, _, _ = pair(yarn=True)
    with torch.no_grad():
        _, record = ours(torch.randn(1, 8, 32), record=True, absorb=absorb)
    steps = record.steps(head=2, query=6)
    torch.testing.assert_close(steps.contextualized.float(), record.out[0, 2, 6], atol=1e-6,
                               rtol=0)  # fmt: skip
    assert not steps.pairs[7].allowed and steps.pairs[6].allowed  # causal
    weights = torch.stack([step.normalized_weight for step in steps.pairs])
    torch.testing.assert_close(weights.float(), record.weights()[0, 2, 6], atol=1e-6, rtol=0)


@pytest.mark.parametrize("absorb", [False, True])
def test_eager_and_sdpa_agree_and_flash_is_refused_by_name(absorb):
    eager, _, _ = pair(backend="eager")
    sdpa, _, _ = pair(backend="sdpa")
    x = torch.randn(2, 9, 32)
    with torch.no_grad():
        want, _ = eager(x, absorb=absorb)
        got, _ = sdpa(x, absorb=absorb)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    flash, _, _ = pair(backend="flash")
    with pytest.raises(ValueError, match="'flash' cannot run these inputs.*values of the keys'"):
        flash(x, absorb=absorb)


def test_weights_into_is_left_alone_and_edits_act_on_the_model_heads():
    ours, _, _ = pair()
    x = torch.randn(1, 7, 32)
    made = torch.full((4, 7, 7), 5.0)
    hide = torch.zeros(1, 4, 7, 7, dtype=torch.bool)
    hide[:, 1, 5, 2] = True
    heads = torch.zeros(1, 4, 1, 1, dtype=torch.bool)
    heads[:, 3] = True
    edit = Edit(hide=hide, heads=heads)
    with torch.no_grad():
        out, record = ours(x, record=True, weights_into=made)
        edited, _ = ours(x, edit=edit)
        absorbed, edited_record = ours(x, edit=edit, record=True, absorb=True)
    # eager's attend_into takes values of the keys' size only: the tensor is left alone
    assert record.made is None and (made == 5).all()
    torch.testing.assert_close(record.weights().sum(-1), torch.ones(1, 4, 7))
    torch.testing.assert_close(absorbed, edited, atol=1e-5, rtol=0)
    assert edited_record.weights()[0, 1, 5, 2] == 0 and edited_record.weights()[0, 0, 5, 2] > 0
    assert not torch.allclose(edited, out)


@pytest.mark.parametrize("absorb", [False, True])
def test_without_rotary_nothing_turns(absorb):
    """A layer without positions (Kimi Linear's): what a rotary layer computes with every
    token at position 0 (no turn), its scale qk_head_dim**-0.5, its cache the same."""
    ours, _, _ = pair()
    plain = LatentAttention(ours.config, None, absorb=absorb)
    plain.load_state_dict(ours.state_dict())
    x = torch.randn(2, 7, 32)
    cache = LatentCache()
    with torch.no_grad():
        want, _ = ours(x, positions=torch.zeros(7, dtype=torch.long), absorb=absorb)
        got, record = plain(x, record=True)
        stepped = [plain(x[:, t : t + 1], cache=cache)[0] for t in range(7)]
        turned, _ = ours(x, absorb=absorb)
    assert plain.scale == 12**-0.5 and record.q.shape[-1] == (12 + 4 if absorb else 8 + 4)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    torch.testing.assert_close(torch.cat(stepped, 1), got, atol=1e-5, rtol=0)
    assert not torch.allclose(got, turned, atol=1e-3)


def test_bad_layers_are_refused():
    config = LatentConfig(32, 4, **SIZES)
    with pytest.raises(ValueError, match="qk_rope_head_dim=4"):
        LatentAttention(config, RotaryEmbedding(8))
    with pytest.raises(ValueError, match="unknown attention backend"):
        LatentAttention(config, RotaryEmbedding(4), backend="fast")
    with pytest.raises(ValueError, match="even"):
        LatentConfig(32, 4, kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=3, v_head_dim=6)
    with pytest.raises(ValueError, match="not a parameter"):
        from_transformers({"q_norm.weight": torch.ones(3)}, config)

"""Scaled and partial rotary embeddings against transformers' own rope functions: the same
config.json gives the same frequencies, the same factor on cos and sin, the same rotation."""

from __future__ import annotations

import pytest
import torch
import transformers as hf
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from qkv.io.families.rotary import hf_rope, read_rope
from qkv.nn import RotaryEmbedding
from qkv.nn.rope import RopeScaling, inv_freq

SCALINGS = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
    "yarn-mscale": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                    "mscale": 0.707, "mscale_all_dim": 0.707, "beta_fast": 16.0},
    "longrope": {"rope_type": "longrope", "short_factor": [1.0, 1.1, 1.5, 2.0],
                 "long_factor": [1.0, 3.0, 5.0, 9.0], "original_max_position_embeddings": 16},
}  # fmt: skip


def _config(name: str, **extra) -> hf.LlamaConfig:
    return hf.LlamaConfig(
        hidden_size=32, num_attention_heads=4, max_position_embeddings=64, rope_theta=500.0,
        rope_scaling=dict(SCALINGS[name]), **extra,
    )  # fmt: skip


@pytest.mark.parametrize("name", list(SCALINGS))
@pytest.mark.parametrize("length", [10, 40])
def test_each_scaling_gives_transformers_frequencies_and_attention_factor(name, length):
    config = _config(name)
    kind = config.rope_parameters["rope_type"]
    want, want_factor = ROPE_INIT_FUNCTIONS[kind](config, "cpu", seq_len=length)
    fields = read_rope(config.to_dict(), head_dim=8)
    got, factor = inv_freq(8, fields["rope_base"], fields["rope_scaling"], length)
    torch.testing.assert_close(got, want.float(), atol=0, rtol=1e-6)
    assert factor == pytest.approx(want_factor, rel=1e-12)


def test_the_older_spelling_reads_the_same_as_transformers_5s():
    old = {"rope_theta": 500.0, "max_position_embeddings": 64, "rope_scaling": SCALINGS["llama3"]}
    new = _config("llama3").to_dict()
    assert "rope_parameters" in new and "rope_scaling" not in new
    assert read_rope(old, 8) == read_rope(new, 8)


@pytest.mark.parametrize("name", list(SCALINGS))
def test_the_settings_written_back_read_back_equal(name):
    fields = read_rope(_config(name).to_dict(), head_dim=8)
    written = {"max_position_embeddings": 64, **hf_rope(_Fields(**fields), 8)}
    assert read_rope(written, 8) == fields
    # and transformers reads what was written as the same settings
    assert read_rope(hf.LlamaConfig(hidden_size=32, num_attention_heads=4, **written).to_dict(),
                     8) == fields  # fmt: skip


class _Fields:
    def __init__(self, rope_base, rope_dims, rope_scaling):
        self.rope_base, self.rope_dims, self.rope_scaling = rope_base, rope_dims, rope_scaling


def test_a_scaling_qkv_does_not_compute_is_refused_by_name():
    with pytest.raises(ValueError, match="rope_scaling type 'mrope' is not supported; supported"):
        read_rope({"rope_scaling": {"rope_type": "mrope"}}, 8)
    with pytest.raises(ValueError, match="short_factor must be a list of 4 numbers"):
        read_rope({"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0],
                                    "long_factor": [1.0] * 4}}, 8)  # fmt: skip
    with pytest.raises(ValueError, match=r"partial_rotary_factor \(0.1\) of head_dim 8 turns 0"):
        read_rope({"partial_rotary_factor": 0.1}, 8)


def test_partial_rotary_turns_the_first_dims_and_passes_the_rest_as_transformers_does():
    from transformers.models.gpt_neox.modeling_gpt_neox import apply_rotary_pos_emb

    rotary = RotaryEmbedding(8, base=10000.0, dims=4)
    x = torch.randn(2, 3, 5, 8)
    positions = torch.arange(5)
    cos, sin = rotary.cos_sin(positions, torch.float32)
    want, _ = apply_rotary_pos_emb(x, x, cos[None], sin[None])
    got = rotary(x, positions)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    assert torch.equal(got[..., 4:], x[..., 4:])


def test_longrope_and_dynamic_choose_their_frequencies_by_the_texts_length():
    scaling = RopeScaling("longrope", factor=4.0, original_max_positions=16,
                          short_factor=(1.0, 1.0), long_factor=(4.0, 4.0))  # fmt: skip
    rotary = RotaryEmbedding(4, scaling=scaling)
    short, _ = rotary.cos_sin(torch.arange(16), torch.float32)
    long, _ = rotary.cos_sin(torch.arange(17), torch.float32)
    assert not torch.allclose(short[:16], long[:16])  # 17 tokens: past the trained 16
    assert rotary.attention_factor > 1.0

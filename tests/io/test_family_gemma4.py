"""Gemma 4 (text): tiny random checkpoints built by `transformers`, loaded by qkv, equal to
transformers' eager model in logits, attention weights, padding, cached decoding, experts and
export; the config.json both ways, and what qkv refuses by name.

Three tiny models: "plain" (per-layer head sizes and proportional rotary only, untied),
"kev" (keys equal values on full layers, per-layer inputs) and "all" (every feature: shared
keys and values with double-wide MLPs, per-layer inputs, experts beside the MLP, tied).
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
import transformers as hf
from safetensors.torch import save_file

import qkv.nn.linear
from qkv.io.checkpoint import export
from qkv.io.families import family_for
from qkv.io.families.gemma4 import FAMILY
from qkv.io.hf_folder import load_folder

S, F = "sliding_attention", "full_attention"
T = 12  # past the sliding window (4)
ROPE = {S: {"rope_type": "default", "rope_theta": 100.0},
        F: {"rope_type": "proportional", "partial_rotary_factor": 0.5, "rope_theta": 1e4,
            "factor": 2.0}}  # fmt: skip


def tiny(**keys) -> hf.Gemma4TextConfig:
    base = dict(vocab_size=100, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, head_dim=8, global_head_dim=16,
                sliding_window=4, layer_types=[S, F, S, F], hidden_size_per_layer_input=0,
                final_logit_softcapping=5.0, max_position_embeddings=64,
                tie_word_embeddings=False, rope_parameters=ROPE)  # fmt: skip
    return hf.Gemma4TextConfig(**{**base, **keys})


MOE = dict(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=16)
PLE = dict(hidden_size_per_layer_input=8, vocab_size_per_layer_input=90)
TINY = {
    "plain": tiny(),
    "kev": tiny(attention_k_eq_v=True, num_global_key_value_heads=1, **PLE),
    "all": tiny(num_hidden_layers=6, layer_types=[S, S, F, S, S, F], num_kv_shared_layers=2,
                use_double_wide_mlp=True, attention_k_eq_v=True, num_global_key_value_heads=1,
                tie_word_embeddings=True, **PLE, **MOE),
}  # fmt: skip


@pytest.fixture(autouse=True)
def torch_products(monkeypatch):
    """qkv's products on torch's own float32 GEMM, as transformers runs them, and
    transformers' experts one at a time, as qkv runs them: then qkv's Gemma 4 is transformers'
    arithmetic op for op, equal to the last bit in practice. (On a CPU where qkv picks
    oneDNN, its products round differently, by 1e-7, which Gemma 4's unscaled scores, up to
    D in size, sharpen past these tolerances; tests/nn holds oneDNN to torch's products.)"""
    monkeypatch.setattr(qkv.nn.linear, "onednn_chosen", lambda: False)


def eager(folder, attention: str = "eager"):
    return hf.Gemma4ForCausalLM.from_pretrained(
        folder, attn_implementation=attention, experts_implementation="eager"
    ).eval()


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """name -> (folder of a tiny random checkpoint, transformers' eager model of it)."""
    made = {}
    for name, config in TINY.items():
        torch.manual_seed(3)
        model = hf.Gemma4ForCausalLM(config).eval()
        with torch.no_grad():  # norm gains, scalars and router scales far from 1
            for key, p in [*model.named_parameters(), *model.named_buffers()]:
                if p.is_floating_point() and "inv_freq" not in key and "embed_scale" not in key:
                    p.add_(torch.randn_like(p) * 0.1)
        folder = tmp_path_factory.mktemp(name)
        model.save_pretrained(folder)
        made[name] = folder, eager(folder)
    return made


def ids_of(batch: int, length: int = T) -> torch.Tensor:
    return torch.randint(0, 90, (batch, length))


@pytest.mark.parametrize("name, backend", [(n, b) for n in TINY for b in ("eager", "sdpa")])
def test_logits_equal_transformers(name, backend, folders):
    folder, theirs = folders[name]
    if backend == "sdpa":
        theirs = eager(folder, "sdpa")
    ours, family, *_ = load_folder(folder, torch.float32, backend)
    assert family is FAMILY
    ids = ids_of(2)
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, theirs(ids).logits, atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", list(TINY))
def test_recorded_weights_equal_transformers_attentions(name, folders):
    folder, theirs = folders[name]
    ours, _, config, _ = load_folder(folder, torch.float32, "eager")
    ids = ids_of(2)
    with torch.no_grad():
        want = theirs(ids, output_attentions=True).attentions
        got = ours(ids, layers="all").records
    for layer in range(config.num_layers):
        torch.testing.assert_close(got[layer].weights(), want[layer], atol=1e-6, rtol=0)
        assert got[layer].shared_from == config.shares_with(layer)
        for head, query in [(0, 3), (3, T - 1)]:
            step = got[layer].steps(head, query).contextualized
            torch.testing.assert_close(step.float(), got[layer].out[0, head, query],
                                       atol=1e-6, rtol=0)  # fmt: skip


def test_layers_that_share_keys_attend_over_the_earlier_layers_own(folders):
    """Layers 4 (sliding) and 5 (full) read layers 3's and 2's keys and values."""
    ours, _, config, _ = load_folder(folders["all"][0], torch.float32, "eager")
    assert [config.shares_with(i) for i in range(6)] == [None, None, None, None, 3, 2]
    with torch.no_grad():
        records = ours(ids_of(1), layers="all").records
    for reader, source in [(4, 3), (5, 2)]:
        assert torch.equal(records[reader].k, records[source].k)
        assert torch.equal(records[reader].v, records[source].v)
        assert records[reader].k_before_rotary is None
    assert not hasattr(ours.blocks[4].attn, "k") and ours.blocks[4].mlp.up.out_features == 96


@pytest.mark.parametrize("name", list(TINY))
def test_a_left_padded_row_equals_the_row_alone(name, folders):
    ours, *_ = load_folder(folders[name][0], torch.float32, "eager")
    ids, pad = ids_of(2), 5
    mask = torch.ones(2, T, dtype=torch.long)
    mask[1, :pad] = 0
    with torch.no_grad():
        together = ours(ids, attention_mask=mask).logits
        # float32's rounding apart (a batch of 2 sums in another order than a row alone:
        # 1.13e-5 measured on an AVX2 EPYC)
        torch.testing.assert_close(together[0], ours(ids[:1]).logits[0], atol=3e-5, rtol=0)
        alone = ours(ids[1:, pad:]).logits[0]
        torch.testing.assert_close(together[1, pad:], alone, atol=3e-5, rtol=0)


@pytest.mark.parametrize("name", list(TINY))
def test_cached_decoding_token_by_token_equals_the_full_forward(name, folders):
    """A left-padded batch, as generation runs it: a prompt, then one token at a time; the
    layers that share keys read the earlier layers' caches."""
    ours, *_ = load_folder(folders[name][0], torch.float32, "eager")
    ids, prompt = ids_of(2), 4
    mask = torch.ones(2, T, dtype=torch.long)
    mask[1, :3] = 0
    with torch.no_grad():
        full = ours(ids, attention_mask=mask).logits
        cache = ours.new_cache()
        steps = [ours(ids[:, :prompt], attention_mask=mask[:, :prompt], cache=cache).logits]
        for t in range(prompt, T):
            steps.append(
                ours(ids[:, t : t + 1], attention_mask=mask[:, : t + 1], cache=cache).logits
            )
    got = torch.cat(steps, dim=1)
    torch.testing.assert_close(got[0], full[0], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(got[1, 3:], full[1, 3:], atol=1e-5, rtol=1e-4)


def test_the_experts_chosen_are_transformers_routers(folders):
    folder, theirs = folders["all"]
    ours, *_ = load_folder(folder, torch.float32, "eager")
    chosen = {}
    for i, layer in enumerate(theirs.model.layers):
        layer.router.register_forward_hook(
            lambda _m, _in, out, i=i: chosen.__setitem__(i, out[-1])
        )  # top-k indices
    ids = ids_of(2)
    with torch.no_grad():
        theirs(ids)
        experts = ours(ids, layers="all").experts
    assert set(experts) == set(range(6))
    for i, record in experts.items():
        want = chosen[i].reshape(2, T, -1).sort(-1).values
        assert torch.equal(record.experts.sort(-1).values, want), i


@pytest.mark.parametrize("name", list(TINY))
def test_export_loads_in_transformers_with_equal_logits(name, folders, tmp_path):
    ours, family, config, _ = load_folder(folders[name][0], torch.float32, "eager")
    save_file(export(ours, family, config), tmp_path / "model.safetensors", {"format": "pt"})
    (tmp_path / "config.json").write_text(json.dumps(family.hf_config(config)))
    assert hf.AutoConfig.from_pretrained(tmp_path).architectures == ["Gemma4ForCausalLM"]
    theirs = eager(tmp_path)
    ids = ids_of(2)
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, theirs(ids).logits, atol=1e-5, rtol=0)


# ---- what the tiny models exercise ---------------------------------------------------------


def _loose(ours, config):
    """A model of `config` holding ours' weights where it has the same ones."""
    other = type(ours)(config).eval()
    mine = other.state_dict()
    same = {k: v for k, v in ours.state_dict().items() if k in mine and mine[k].shape == v.shape}
    other.load_state_dict(same, strict=False)
    return other


EXERCISED = [
    ("plain", "proportional rotary", lambda c: replace(c, full_rope_fraction=1.0)),
    ("plain", "rotary factor", lambda c: replace(c, full_rope_factor=1.0)),
    ("plain", "window", lambda c: replace(c, block=replace(c.block, window=64))),
    ("plain", "score scale 1", lambda c: replace(c, block=replace(c.block, attn_scale=None))),
    ("plain", "final soft-cap", lambda c: replace(c, logit_softcap=None)),
    ("kev", "per-layer inputs", lambda c: replace(c, per_layer_input=0, per_layer_vocab=0)),
    ("all", "experts", lambda c: replace(c, experts=None)),
]


@pytest.mark.parametrize("name, what, without", EXERCISED, ids=[w for _, w, _ in EXERCISED])
def test_the_tiny_models_exercise_what_they_map(name, what, without, folders):
    ours, _, config, _ = load_folder(folders[name][0], torch.float32, "eager")
    other = _loose(ours, without(config))
    ids = ids_of(1)
    with torch.no_grad():
        assert (other(ids).logits - ours(ids).logits).abs().max() > 1e-2, what


def test_keys_equal_values_is_a_value_matrix_equal_to_the_key_matrix(folders):
    """Without attention_k_eq_v and with v = k's matrix, the same logits; with another v,
    others: the full layers' values are their raw key projections."""
    ours, _, config, _ = load_folder(folders["kev"][0], torch.float32, "eager")
    other = _loose(ours, replace(config, values_from_keys=False))
    ids = ids_of(1)
    with torch.no_grad():
        assert (other(ids).logits - ours(ids).logits).abs().max() > 1e-2
        for i in (1, 3):
            other.blocks[i].attn.v.weight.copy_(ours.blocks[i].attn.k.weight)
        torch.testing.assert_close(other(ids).logits, ours(ids).logits, atol=1e-6, rtol=0)


def test_shared_keys_are_used(folders):
    """The same weights with no sharing (the sharing layers' keys random) differ."""
    ours, _, config, _ = load_folder(folders["all"][0], torch.float32, "eager")
    other = _loose(ours, replace(config, kv_shared_layers=0))
    ids = ids_of(1)
    with torch.no_grad():
        assert (other(ids).logits - ours(ids).logits).abs().max() > 1e-2


# ---- config.json both ways -----------------------------------------------------------------


@pytest.mark.parametrize("name", list(TINY))
def test_a_transformers_config_round_trips_through_qkv(name):
    config_json = TINY[name].to_dict()
    config = FAMILY.config(config_json)
    written = FAMILY.hf_config(config)
    assert family_for(written) is FAMILY and FAMILY.config(written) == config
    assert FAMILY.config(hf.Gemma4TextConfig.from_dict(written).to_dict()) == config


def test_what_the_tiny_configs_read_as():
    config = FAMILY.config(TINY["all"].to_dict())
    assert config.layer_types == ("sliding", "sliding", "full", "sliding", "sliding", "full")
    assert (config.full_head_dim, config.full_kv_heads, config.block.head_size) == (16, 1, 8)
    assert (config.rope_base, config.local_rope_base) == (1e4, 100.0)
    assert (config.full_rope_fraction, config.full_rope_factor) == (0.5, 2.0)
    assert config.values_from_keys and config.kv_shared_layers == 2 and config.double_wide_mlp
    assert (config.per_layer_input, config.per_layer_vocab) == (8, 90)
    assert config.experts.routing.top_k == 2 and config.block.attn_scale == 1.0
    assert [config.block_for(i).mlp_hidden for i in range(6)] == [48] * 4 + [96] * 2


def test_missing_keys_mean_transformers_defaults():
    """A config.json of nothing but its model_type is transformers' default model: full
    layers 512 wide, the last layer full whatever layer_types says."""
    bare = {"model_type": "gemma4_text"}
    assert FAMILY.config(bare) == FAMILY.config(hf.Gemma4TextConfig().to_dict())
    assert FAMILY.config(bare).full_head_dim == 512
    four = {**bare, "num_hidden_layers": 4, "layer_types": [S, F, S, S]}
    assert FAMILY.config(four).layer_types == ("sliding", "full", "sliding", "full")


def with_keys(**keys) -> dict:
    return {**TINY["plain"].to_dict(), **keys}


REFUSED = [
    (with_keys(attention_bias=True), "Gemma 4 checkpoints with attention_bias=True"),
    (with_keys(use_bidirectional_attention="all"), "use_bidirectional_attention='all'"),
    ({"model_type": "gemma4", "text_config": {}}, "multimodal Gemma 4 checkpoints"),
    (with_keys(num_kv_shared_layers=4), "every layer shares keys"),
    (with_keys(rope_parameters={**ROPE, F: {"rope_type": "yarn", "rope_theta": 1e4}}),
     "rope types 'default' .sliding. / 'yarn' .full. are not supported"),
    (with_keys(rope_parameters={S: ROPE[S]}), "rope_parameters has no full_attention entry"),
    (with_keys(rope_parameters={**ROPE, S: {"rope_type": "default"}}), "rope_theta must be"),
    (with_keys(per_layer_config={"1": {"head_dim": 16, "sliding_window": 2}}),
     "per_layer_config 1: .* are not supported"),
    (with_keys(per_layer_config={"1": {"head_dim": 16}, "3": {"head_dim": 32}}),
     "per_layer_config differs between layers of one type"),
    (with_keys(hidden_activation="silu"), "hidden_activation 'silu' is not supported"),
    (with_keys(layer_types=[S, "chunked_attention", S, F]), r"layer_types holds"),
]  # fmt: skip


@pytest.mark.parametrize("config_json, message", REFUSED)
def test_a_config_json_qkv_does_not_compute_is_refused_by_name(config_json, message):
    with pytest.raises(ValueError, match=message):
        family_for(config_json).config(config_json)


def test_a_qkv_config_a_gemma4_config_json_cannot_hold_is_refused_by_name():
    config = FAMILY.config(TINY["plain"].to_dict())
    with pytest.raises(ValueError, match=r"block.attn_scale=None \(it has 1.0\)"):
        FAMILY.hf_config(replace(config, block=replace(config.block, attn_scale=None)))


def test_the_familys_keys_are_read_or_inert():
    common = set(hf.PretrainedConfig().to_dict())
    keys = set(hf.Gemma4TextConfig().to_dict()) - common
    assert keys <= set(FAMILY.reads) | set(FAMILY.inert), keys - set(FAMILY.reads)

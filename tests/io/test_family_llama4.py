"""Llama 4 (text): a tiny random checkpoint built by `transformers`, loaded by qkv, equal to
transformers' eager model in logits, attention weights, the experts each token goes to,
padding, cached decoding and export; its config.json both ways, and what qkv refuses by name.

The tiny model is made to exercise what it maps: 14 tokens, past three chunks of 4; a
temperature that changes every 3 positions (floor_scale 3), so it is not 1 past the second
token; layers 0-2 chunked with rotary positions and L2 QK-norm, layer 3 full and without
positions (NoPE); layers 1 and 3 mixtures of 4 experts (2 per token) with a shared expert,
layers 0 and 2 dense; llama3 rotary scaling with low_freq_factor == high_freq_factor.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
import transformers as hf
from safetensors.torch import save_file

from qkv.io.checkpoint import export
from qkv.io.families import family_for
from qkv.io.families.llama4 import FAMILY, interleaved_to_halves, routing
from qkv.io.hf_folder import load_folder
from qkv.nn.experts import Experts
from qkv.nn.position import Temperature

T = 14  # past three chunks of 4
TINY = hf.Llama4TextConfig(
    vocab_size=100, hidden_size=32, intermediate_size=24, intermediate_size_mlp=40,
    num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
    num_local_experts=4, num_experts_per_tok=2, interleave_moe_layer_step=2,
    no_rope_layer_interval=4, attention_chunk_size=4, floor_scale=3, attn_scale=0.5,
    attn_temperature_tuning=True, use_qk_norm=True, max_position_embeddings=256,
    rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 16.0,
                     "low_freq_factor": 1.0, "high_freq_factor": 1.0,
                     "original_max_position_embeddings": 8},
)  # fmt: skip
CHUNKED = [0, 1, 2]  # the layers with rotary positions and chunks; layer 3 is NoPE and full
MOE = [1, 3]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A tiny random checkpoint: norms' gains far from 1, every matrix noisy."""
    torch.manual_seed(0)
    model = hf.Llama4ForCausalLM(TINY).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_(torch.randn_like(p) * (0.5 if "norm" in name else 0.1))
    made = tmp_path_factory.mktemp("llama4")
    model.save_pretrained(made)
    return made


@pytest.fixture(scope="module")
def theirs(folder):
    return hf.Llama4ForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()


def ours(folder, backend="eager"):
    model, family, config, _ = load_folder(folder, torch.float32, backend)
    assert family is FAMILY
    return model, config


def ids_of(batch: int, length: int = T) -> torch.Tensor:
    return torch.randint(0, 100, (batch, length), generator=torch.Generator().manual_seed(batch))


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_logits_equal_transformers(backend, folder, theirs):
    model, _ = ours(folder, backend)
    ids = ids_of(2)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, theirs(ids).logits, atol=1e-5, rtol=0)


def test_recorded_weights_equal_transformers_attentions(folder, theirs):
    """Every layer's, chunked and full; the article's steps give each head's own output."""
    model, _ = ours(folder)
    ids = ids_of(2)
    with torch.no_grad():
        want = theirs(ids, output_attentions=True).attentions
        records = model(ids, layers="all").records
    for layer in range(TINY.num_hidden_layers):
        torch.testing.assert_close(records[layer].weights(), want[layer], atol=1e-6, rtol=0)
        for head, query in [(0, 5), (3, T - 1)]:
            got = records[layer].steps(head, query).contextualized
            torch.testing.assert_close(got.float(), records[layer].out[0, head, query],
                                       atol=1e-6, rtol=0)  # fmt: skip
    assert records[0].weights()[0, 0, 5, :4].sum() == 0  # query 5 sees only its chunk, 4-7


def test_left_padded_chunks_are_transformers(folder, theirs):
    """With left padding, the chunked layers (0-2, before the NoPE layer) weigh the words as
    transformers does: both count chunks from each row's first real token. (The NoPE layer's
    temperature differs there by design: transformers evaluates it at the token's index, qkv
    at the row's own position, so that a padded row equals the row alone.)"""
    model, _ = ours(folder)
    ids, pad = ids_of(2), 3
    mask = torch.ones(2, T, dtype=torch.long)
    mask[1, :pad] = 0
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        want = theirs(ids, attention_mask=mask, position_ids=positions,
                      output_attentions=True).attentions  # fmt: skip
        records = model(ids, attention_mask=mask, layers=CHUNKED).records
    for layer in CHUNKED:
        got = records[layer].weights()
        torch.testing.assert_close(got[0], want[layer][0], atol=1e-6, rtol=0)
        torch.testing.assert_close(got[1, :, pad:], want[layer][1, :, pad:], atol=1e-6, rtol=0)


def test_a_left_padded_row_equals_the_row_alone(folder):
    model, _ = ours(folder)
    ids, pad = ids_of(2), 5
    mask = torch.ones(2, T, dtype=torch.long)
    mask[1, :pad] = 0
    with torch.no_grad():
        together = model(ids, attention_mask=mask).logits
        torch.testing.assert_close(together[0], model(ids[:1]).logits[0], atol=1e-5, rtol=0)
        alone = model(ids[1:, pad:]).logits[0]
        torch.testing.assert_close(together[1, pad:], alone, atol=1e-5, rtol=0)


def test_cached_decoding_token_by_token_equals_the_full_forward(folder):
    """A left-padded batch, as generation runs it: a prompt, then one token at a time."""
    model, _ = ours(folder)
    ids, prompt = ids_of(2), 3
    mask = torch.ones(2, T, dtype=torch.long)
    mask[1, :3] = 0
    with torch.no_grad():
        full = model(ids, attention_mask=mask).logits
        cache = model.new_cache()
        steps = [model(ids[:, :prompt], attention_mask=mask[:, :prompt], cache=cache).logits]
        for t in range(prompt, T):
            steps.append(
                model(ids[:, t : t + 1], attention_mask=mask[:, : t + 1], cache=cache).logits
            )
    got = torch.cat(steps, dim=1)
    torch.testing.assert_close(got[0], full[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[1, 3:], full[1, 3:], atol=1e-5, rtol=1e-5)


def test_each_token_goes_to_the_experts_transformers_router_chooses(folder, theirs):
    model, _ = ours(folder)
    ids = ids_of(2)
    logits = {}
    hooks = [
        theirs.model.layers[layer].feed_forward.router.register_forward_hook(
            lambda module, args, out, layer=layer: logits.__setitem__(layer, out[1])
        )
        for layer in MOE
    ]
    try:
        with torch.no_grad():
            theirs(ids)
            got = model(ids, layers=MOE).experts
    finally:
        for hook in hooks:
            hook.remove()
    for layer in MOE:
        top, chosen = torch.topk(logits[layer], TINY.num_experts_per_tok, dim=-1)  # (N, k)
        record = got[layer]
        assert torch.equal(record.experts.reshape(-1, 2), chosen)  # largest weight first
        torch.testing.assert_close(record.weights.reshape(-1, 2), torch.sigmoid(top),
                                   atol=1e-6, rtol=0)  # fmt: skip
    assert "multiplies its expert's input" in got[1].describe(0, 0)


def test_export_loads_in_transformers_with_equal_logits(folder, theirs, tmp_path):
    """The weights under their checkpoint names (q and k rows back in interleaved pairs,
    experts back to (E, C, 2I) and (E, I, C)), beside the config.json qkv writes."""
    model, config = ours(folder)
    exported = export(model, FAMILY, config)
    with torch.no_grad():
        for name, tensor in theirs.state_dict().items():
            assert torch.equal(exported[name], tensor), name
    save_file(exported, tmp_path / "model.safetensors", {"format": "pt"})
    (tmp_path / "config.json").write_text(json.dumps(FAMILY.hf_config(config)))
    again = hf.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager")
    assert type(again) is hf.Llama4ForCausalLM
    ids = ids_of(2)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, again(ids).logits, atol=1e-5, rtol=0)


def test_rotary_layers_query_and_key_rows_are_reordered_to_halves(folder, theirs):
    """Layer 0 turns its queries and keys: each head's rows (2i, 2i + 1) become (i, i + D/2).
    Layer 3 has no positions and keeps transformers' rows (its records' q and k are theirs)."""
    model, _ = ours(folder)
    want = theirs.model.layers[0].self_attn.q_proj.weight.detach()
    got = model.blocks[0].attn.q.weight.detach()
    D = TINY.head_dim
    for head in range(TINY.num_attention_heads):
        rows = want[head * D : (head + 1) * D]
        torch.testing.assert_close(got[head * D : head * D + D // 2], rows[0::2])
        torch.testing.assert_close(got[head * D + D // 2 : (head + 1) * D], rows[1::2])
    nope = theirs.model.layers[3].self_attn.k_proj.weight.detach()
    assert torch.equal(model.blocks[3].attn.k.weight.detach(), nope)
    layout = interleaved_to_halves(D)
    assert torch.equal(layout.save(layout.load(want)), want)


def _block(config, **changes):
    return replace(config, block=replace(config.block, **changes))


def _routing(config, **changes):
    experts = config.block.experts
    return _block(config, experts=replace(experts, routing=replace(experts.routing, **changes)))


EXERCISED = [
    ("chunk", lambda c: replace(c, layer_types=None, block=replace(c.block, chunk=None))),
    ("temperature", lambda c: _block(c, temperature=None)),
    ("L2 QK-norm", lambda c: _block(c, qk_norm=None)),
    ("NoPE layers", lambda c: replace(c, rope_layers=None)),
    ("expert weights on the input", lambda c: _routing(c, scale_input=False)),
]


@pytest.mark.parametrize("what, without", EXERCISED, ids=[w for w, _ in EXERCISED])
def test_the_tiny_model_exercises_what_it_maps(what, without, folder):
    """Each of Llama 4's choices changes these logits: a mapping that dropped one fails."""
    model, config = ours(folder)
    other = type(model)(without(config)).eval()
    other.load_state_dict(model.state_dict())
    ids = ids_of(1)
    with torch.no_grad():
        assert (other(ids).logits - model(ids).logits).abs().max() > 1e-2, what


def test_the_temperatures_of_the_tiny_text_differ_from_one(folder):
    _, config = ours(folder)
    temperatures = config.block.temperature.of(torch.arange(T))
    assert temperatures[:2].eq(1).all() and len(set(temperatures[2:].tolist())) == 4


# ---- config.json both ways -----------------------------------------------------------------


def test_what_the_tiny_config_reads_as():
    config = FAMILY.config(TINY.to_dict())
    block = config.block
    assert config.layer_types == ("chunked", "chunked", "chunked", "full")
    assert config.rope_layers == (True, True, True, False)
    assert config.moe_layers == (False, True, False, True) and config.dense_mlp_hidden == 40
    assert (block.chunk, block.qk_norm, block.temperature_where) == (4, "l2", "nope")
    assert block.temperature == Temperature(0.5, 3.0, 1.0)
    assert block.experts == Experts(routing(4, 2), 24, shared_hidden=24)
    assert (block.head_size, block.norm_eps, config.rope_scaling.kind) == (8, 1e-5, "llama3")
    assert [config.block_for(i).mlp_hidden for i in (0, 2)] == [40, 40]


def test_a_transformers_config_round_trips_through_qkv():
    """transformers' config.json -> qkv -> config.json (read by transformers itself) -> qkv."""
    config = FAMILY.config(TINY.to_dict())
    written = FAMILY.hf_config(config)
    assert family_for(written) is FAMILY and FAMILY.config(written) == config
    reread = hf.Llama4TextConfig.from_dict(written).to_dict()
    assert FAMILY.config(reread) == config


@pytest.mark.parametrize(
    "keys",
    [{}, {"interleave_moe_layer_step": 2}, {"attention_chunk_size": None},
     {"attn_temperature_tuning": False, "use_qk_norm": False},
     {"no_rope_layers": [], "no_rope_layer_interval": 2}],
)  # fmt: skip
def test_missing_keys_mean_transformers_defaults(keys):
    """A config.json of a few keys is transformers' model of them, and round-trips."""
    bare = {"model_type": "llama4_text", **keys}
    config = FAMILY.config(bare)
    assert config == FAMILY.config(hf.Llama4TextConfig(**keys).to_dict())
    assert FAMILY.config(FAMILY.hf_config(config)) == config


def test_transformers_layer_derivations_are_followed():
    small = {"model_type": "llama4_text", "num_hidden_layers": 4}
    scout = FAMILY.config(small)
    assert scout.moe_layers is None and scout.rope_layers == (True, True, True, False)
    assert scout.layer_types == ("chunked", "chunked", "chunked", "full")
    maverick = FAMILY.config({**small, "interleave_moe_layer_step": 2, "moe_layers": None})
    assert maverick.moe_layers == (False, True, False, True)
    unchunked = FAMILY.config({**small, "attention_chunk_size": None})
    assert unchunked.layer_types is None and unchunked.block.chunk is None
    listed = FAMILY.config({**small, "moe_layers": [0], "no_rope_layers": [0, 1, 1, 1]})
    assert listed.moe_layers == (True, False, False, False)
    assert listed.layer_types == ("full", "chunked", "chunked", "chunked")


def with_keys(**keys) -> dict:
    return {**TINY.to_dict(), **keys}


REFUSED = [
    (with_keys(attn_temperature_tuning=4), "attn_temperature_tuning must be true or false, got 4"),
    (with_keys(attention_bias=True), "Llama 4 checkpoints with attention_bias=True"),
    ({"model_type": "llama4", "text_config": {}}, "multimodal Llama 4 checkpoints"),
    (with_keys(layer_types=["sliding_attention"] * 4),
     r"layer_types holds \['sliding_attention'\]"),
    (with_keys(attention_chunk_size=None), "attention_chunk_size must be set: layer_types has"),
    (with_keys(moe_layers=[1, 4]), r"moe_layers must list layer indices below 4, got \[1, 4\]"),
    (with_keys(no_rope_layers=[1, 0]), "no_rope_layers must list 4 values 0 or 1"),
    (with_keys(rope_parameters={"rope_type": "llama3", "factor": 8.0}),
     "rope_parameters of type llama3 needs low_freq_factor, high_freq_factor"),
    (with_keys(hidden_act="gelu"), "Llama 4 checkpoints with hidden_act='gelu'"),
    (with_keys(floor_scale=0), "floor_scale must be a number > 0"),
]  # fmt: skip


@pytest.mark.parametrize("hf_config, message", REFUSED)
def test_a_config_json_qkv_does_not_compute_is_refused_by_name(hf_config, message):
    with pytest.raises(ValueError, match=message):
        family_for(hf_config).config(hf_config)


def qkv_config():
    return FAMILY.config(TINY.to_dict())


NOT_HELD = [
    (replace(qkv_config(), moe_layers=None, block=replace(qkv_config().block, experts=None)),
     "needs block.experts"),
    (_routing(qkv_config(), scale_input=False), "cannot hold block.experts="),
    (_block(qkv_config(), temperature=Temperature(0.5, 3.0, 0.0)), "cannot hold temperature="),
    (_block(qkv_config(), temperature=Temperature(0.5, 2.5, 1.0)), "floor_scale"),
    (_block(qkv_config(), temperature_where="all"), "on 'all' layers"),
    (replace(qkv_config(), layer_types=("chunked", "sliding", "chunked", "full"),
             block=replace(qkv_config().block, window=4)), r"cannot hold \['sliding'\] layers"),
    (_block(qkv_config(), qk_norm="head"), "cannot hold qk_norm='head'"),
    (_block(qkv_config(), sinks=True), r"block.sinks=True \(it has False\)"),
]  # fmt: skip


@pytest.mark.parametrize("config, message", NOT_HELD)
def test_a_qkv_config_a_llama4_config_json_cannot_hold_is_refused_by_name(config, message):
    with pytest.raises(ValueError, match=message):
        FAMILY.hf_config(config)

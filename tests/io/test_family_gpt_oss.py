"""gpt-oss: tiny random checkpoints built by `transformers`, loaded by qkv, exact.

The tiny models are made to exercise what gpt-oss adds to Llama: sinks large enough to take
most of some heads' weight, texts of 20 tokens past a sliding window of 4, a YaRN rotary whose
unrounded ramp (truncate false) differs from the rounded one, expert weights large enough
that the SwiGLU's clamp bites, and the router's bias."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
import transformers as hf
from safetensors.torch import save_file
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRotaryEmbedding

from qkv.io.checkpoint import export
from qkv.io.families import family_for
from qkv.io.families.gpt_oss import FAMILY, GATE_UP, GATE_UP_BIAS
from qkv.io.hf_folder import load_folder
from qkv.models import Decoder
from qkv.nn.rope import RopeScaling

T = 20  # past the sliding window (4) five times
SINKS = torch.tensor([-2.0, 0.5, 2.0, 8.0])  # per head: the last takes most of the weight
CASES = {
    # GptOssConfig's own shape: even layers slide, biases, YaRN (truncate false), top 2 of 4
    "oss": hf.GptOssConfig(
        vocab_size=100, hidden_size=32, intermediate_size=24, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
        num_experts_per_tok=2, sliding_window=4, max_position_embeddings=2048,
        rope_parameters={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False,
                         "original_max_position_embeddings": 64, "rope_theta": 150000.0}),
    # every other choice: no attention biases, tied embeddings, layer types of its own, plain
    # rotary, one expert of three per token, a clamp and a gain of its own, one kv head
    "oss-other": hf.GptOssConfig(
        vocab_size=100, hidden_size=32, intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=1, head_dim=8, num_local_experts=3,
        num_experts_per_tok=1, sliding_window=5, max_position_embeddings=64,
        layer_types=["full_attention", "sliding_attention"],
        attention_bias=False, tie_word_embeddings=True, swiglu_limit=3.0, swiglu_alpha=1.2,
        rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 500.0}),
}  # fmt: skip
NAMES = list(CASES)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """name -> (folder of a tiny random checkpoint, transformers' eager model of it)."""
    made = {}
    for name, config in CASES.items():
        torch.manual_seed(3)
        model = hf.GptOssForCausalLM(config).eval()
        with torch.no_grad():
            for key, p in model.named_parameters():  # norms and biases far from 1 and 0
                big = p.dim() == 1 or "embed" in key  # matrices smaller: rounding stays small
                sharp = "q_proj" in key or "k_proj" in key  # scores that positions move
                p.add_(torch.randn_like(p) * (0.3 if big else 0.2 if sharp else 0.05))
            for layer in model.model.layers:
                layer.self_attn.sinks.copy_(SINKS)
                layer.mlp.experts.gate_up_proj.mul_(16)  # past the clamp for 10-30% of gates
        folder = tmp_path_factory.mktemp(name)
        model.save_pretrained(folder)
        made[name] = folder, theirs(folder)
    return made


def theirs(folder):
    """transformers' reference: eager attention, and its experts one by one (from_pretrained
    would otherwise pick its grouped matmul, which sums in another order)."""
    return hf.GptOssForCausalLM.from_pretrained(
        folder, attn_implementation="eager", experts_implementation="eager"
    ).eval()


def ours(folder, backend="eager"):
    return load_folder(folder, torch.float32, backend)


def ids_of(batch: int, length: int = T) -> torch.Tensor:
    return torch.randint(0, 100, (batch, length), generator=torch.Generator().manual_seed(batch))


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_logits_equal_transformers_past_the_window(name, backend, folders):
    folder, model = folders[name]
    mine, family, *_ = ours(folder, backend)
    assert family is FAMILY
    ids = ids_of(2)
    with torch.no_grad():
        torch.testing.assert_close(mine(ids).logits, model(ids).logits, atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", NAMES)
def test_records_hold_transformers_weights_and_trace_each_head_exactly(name, folders):
    folder, model = folders[name]
    mine, _, cfg, _ = ours(folder)
    ids, layers = ids_of(1), list(range(cfg.num_layers))
    with torch.no_grad():
        want = model(ids, output_attentions=True).attentions
        records = mine(ids, layers=layers).records
    for layer in layers:
        record = records[layer]
        torch.testing.assert_close(record.weights(), want[layer], atol=1e-6, rtol=0)
        for head, query in [(0, T - 1), (3, T // 2), (2, 1)]:
            step = record.steps(head, query)
            torch.testing.assert_close(step.contextualized.float(), record.out[0, head, query],
                                       atol=1e-6, rtol=0)  # fmt: skip


def test_each_querys_sink_takes_what_its_words_weights_leave(folders):
    """The words' weights and the sink's share sum to 1, for every query and head; the head
    with the largest sink gives it most of every query's weight."""
    mine, _, cfg, _ = ours(folders["oss"][0])
    layers = list(range(cfg.num_layers))
    with torch.no_grad():
        records = mine(ids_of(2), layers=layers).records
    for layer in layers:
        record = records[layer]
        sinks = record.sink_weights()  # (B, H, T)
        total = record.weights().sum(-1) + sinks
        torch.testing.assert_close(total, torch.ones_like(total), atol=1e-6, rtol=0)
        assert sinks[:, 3].mean() > 0.5, f"layer {layer}: head 3's sink shares {sinks[:, 3]}"
        assert sinks[:, 0].mean() < sinks[:, 3].mean()


@pytest.mark.parametrize("name", NAMES)
def test_the_experts_chosen_are_those_of_transformers_router(name, folders):
    folder, model = folders[name]
    mine, _, cfg, _ = ours(folder)
    chosen: dict[int, tuple] = {}
    hooks = [
        layer.mlp.router.register_forward_hook(
            lambda _, __, out, i=i: chosen.__setitem__(i, out)  # (logits, scores, indices)
        )
        for i, layer in enumerate(model.model.layers)
    ]
    ids, layers = ids_of(2), list(range(cfg.num_layers))
    try:
        with torch.no_grad():
            model(ids)
            records = mine(ids, layers=layers).experts
    finally:
        for hook in hooks:
            hook.remove()
    for layer in layers:
        logits, scores, indices = chosen[layer]
        record = records[layer]
        k = cfg.block.experts.routing.top_k
        assert torch.equal(record.experts.reshape(-1, k), indices)  # both largest first
        torch.testing.assert_close(record.weights.reshape(-1, k), scores, atol=1e-6, rtol=0)
        torch.testing.assert_close(record.logits.reshape(logits.shape), logits, atol=1e-5,
                                   rtol=0)  # fmt: skip
    spread = torch.cat([r.experts.flatten() for r in records.values()]).unique()
    assert len(spread) == cfg.block.experts.routing.num_experts  # every expert was used


@pytest.mark.parametrize("name", NAMES)
def test_a_left_padded_row_equals_the_row_alone(name, folders):
    mine, *_ = ours(folders[name][0])
    ids, pad = ids_of(2), 5
    mask = torch.ones(2, T, dtype=torch.long)
    mask[1, :pad] = 0
    with torch.no_grad():
        together = mine(ids, attention_mask=mask).logits
        torch.testing.assert_close(together[0], mine(ids[:1]).logits[0], atol=1e-5, rtol=0)
        alone = mine(ids[1:, pad:]).logits[0]
        torch.testing.assert_close(together[1, pad:], alone, atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", NAMES)
def test_cached_decoding_token_by_token_equals_the_full_forward(name, folders):
    """A left-padded batch, as generation runs it: a prompt, then one token at a time."""
    mine, *_ = ours(folders[name][0])
    ids, prompt, pad = ids_of(2), 4, 3
    mask = torch.ones(2, T, dtype=torch.long)
    mask[1, :pad] = 0
    with torch.no_grad():
        full = mine(ids, attention_mask=mask).logits
        cache = mine.new_cache()
        steps = [mine(ids[:, :prompt], attention_mask=mask[:, :prompt], cache=cache).logits]
        for t in range(prompt, T):
            steps.append(
                mine(ids[:, t : t + 1], attention_mask=mask[:, : t + 1], cache=cache).logits
            )
    got = torch.cat(steps, dim=1)
    torch.testing.assert_close(got[0], full[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(got[1, pad:], full[1, pad:], atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", NAMES)
def test_an_export_loads_in_transformers_with_equal_logits(name, folders, tmp_path):
    mine, family, cfg, _ = ours(folders[name][0])
    exported = export(mine, family, cfg)
    original = dict(hf.GptOssForCausalLM.from_pretrained(folders[name][0]).state_dict())
    for key, tensor in exported.items():  # the interleaved layouts written back as they were
        assert torch.equal(tensor, original[key]), key
    save_file(exported, tmp_path / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "config.json").write_text(json.dumps(family.hf_config(cfg)))
    ids = ids_of(2)
    with torch.no_grad():
        torch.testing.assert_close(theirs(tmp_path)(ids).logits, mine(ids).logits, atol=1e-5,
                                   rtol=0)  # fmt: skip


def test_gate_and_up_are_interleaved_in_the_checkpoint_and_stacked_in_qkv():
    E, C, hidden = 2, 3, 2
    interleaved = torch.arange(E * C * 2 * hidden, dtype=torch.float32).reshape(E, C, -1)
    stacked = GATE_UP.load(interleaved)  # (E, 2I, C): gate rows, then up rows
    assert stacked.shape == (E, 2 * hidden, C)
    assert torch.equal(stacked[:, :hidden], interleaved[..., 0::2].transpose(1, 2))
    assert torch.equal(stacked[:, hidden:], interleaved[..., 1::2].transpose(1, 2))
    assert torch.equal(GATE_UP.save(stacked), interleaved)
    bias = torch.tensor([[0.0, 1.0, 2.0, 3.0]])  # gate, up, gate, up
    assert GATE_UP_BIAS.load(bias).tolist() == [[0.0, 2.0, 1.0, 3.0]]
    assert torch.equal(GATE_UP_BIAS.save(GATE_UP_BIAS.load(bias)), bias)


# ---- each feature changes the tiny models' logits -------------------------------------------


def _block(config, **changes):
    return replace(config, block=replace(config.block, **changes))


def _experts(config, **changes):
    return _block(config, experts=replace(config.block.experts, **changes))


def _routing(config, **changes):
    routing = replace(config.block.experts.routing, **changes)
    return _experts(config, routing=routing)


EXERCISED = [
    ("oss", "sinks", lambda c: _block(c, sinks=False)),
    ("oss", "window", lambda c: replace(c, layer_types=None, block=replace(c.block, window=None))),
    ("oss-other", "window", lambda c: replace(c, layer_types=("full", "full"))),
    ("oss", "attention biases", lambda c: _block(c, bias=False)),
    ("oss", "yarn", lambda c: replace(c, rope_scaling=None)),
    ("oss", "yarn unrounded", lambda c: replace(c, rope_scaling=replace(c.rope_scaling,
                                                                          truncate=True))),
    ("oss", "router bias", lambda c: _routing(c, router_bias=False)),
    ("oss", "softmax over the k chosen", lambda c: _routing(c, choose_by="scores")),
    ("oss", "top k", lambda c: _routing(c, top_k=1)),
    ("oss", "expert biases", lambda c: _experts(c, bias=False)),
    ("oss", "clamped swiglu", lambda c: _experts(c, activation="silu")),
    ("oss", "clamp", lambda c: _experts(c, limit=1e6)),
    ("oss-other", "clamp", lambda c: _experts(c, limit=7.0)),
    ("oss-other", "gain", lambda c: _experts(c, alpha=1.702)),
]  # fmt: skip


@pytest.mark.parametrize(
    "name, what, without", EXERCISED, ids=[f"{n}-{w}" for n, w, _ in EXERCISED]
)
def test_the_tiny_models_exercise_what_they_map(name, what, without, folders):
    """Each of gpt-oss's choices changes these logits: a mapping that dropped one fails."""
    mine, _, cfg, _ = ours(folders[name][0])
    other = Decoder(without(cfg)).eval()
    missing, _ = other.load_state_dict(mine.state_dict(), strict=False)
    assert not missing  # only the feature's own tensors are left out
    ids = ids_of(1)
    with torch.no_grad():
        assert (other(ids).logits - mine(ids).logits).abs().max() > 1e-2, what


# ---- config.json both ways ------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_a_transformers_config_round_trips_through_qkv(name):
    """transformers' config.json -> qkv -> config.json (read by transformers itself) -> qkv."""
    config = CASES[name].to_dict()
    family = family_for(config)
    cfg = family.config(config)
    written = family.hf_config(cfg)
    assert family_for(written) is family and family.config(written) == cfg
    assert family.config(hf.GptOssConfig.from_dict(written).to_dict()) == cfg


def test_what_the_tiny_configs_read_as():
    oss = FAMILY.config(CASES["oss"].to_dict())
    assert oss.layer_types == ("sliding", "full", "sliding", "full") and oss.block.window == 4
    assert oss.block.sinks and oss.block.bias and oss.block.qkv_bias is None
    assert oss.rope_scaling == RopeScaling("yarn", 32.0, 64, truncate=False, max_positions=2048)
    experts = oss.block.experts
    assert (experts.hidden, experts.activation, experts.bias) == (24, "clamped_swiglu", True)
    assert (experts.limit, experts.alpha) == (7.0, 1.702)
    assert (experts.routing.num_experts, experts.routing.top_k) == (4, 2)
    other = FAMILY.config(CASES["oss-other"].to_dict())
    assert other.layer_types == ("full", "sliding") and other.tie_embeddings
    assert other.rope_scaling is None and not other.block.bias
    assert (other.block.experts.limit, other.block.experts.alpha) == (3.0, 1.2)


BASE = FAMILY.config(CASES["oss"].to_dict())
ROUND_TRIPS = {
    "no sliding layer": replace(BASE, layer_types=None, block=replace(BASE.block, window=None)),
    "every layer sliding": replace(BASE, layer_types=None),
    "plain rotary, tied, no attention biases": replace(
        BASE, rope_scaling=None, tie_embeddings=True, block=replace(BASE.block, bias=False)
    ),
}


@pytest.mark.parametrize("cfg", ROUND_TRIPS.values(), ids=list(ROUND_TRIPS))
def test_a_qkv_config_written_as_config_json_reads_back_equal_and_runs_in_transformers(cfg):
    written = FAMILY.hf_config(cfg)
    assert family_for(written) is FAMILY and FAMILY.config(written) == cfg
    parsed = hf.GptOssConfig.from_dict(written)
    assert FAMILY.config(parsed.to_dict()) == cfg
    with torch.no_grad():  # a window is written even where no layer slides: transformers needs it
        assert hf.GptOssForCausalLM(parsed)(ids_of(1, 6)).logits.isfinite().all()


def _bare(**changes) -> dict:
    """A config.json with the rotary keys left out, as an older file might be written."""
    config = CASES["oss"].to_dict() | changes
    return {k: v for k, v in config.items() if k not in ("rope_parameters", "rope_theta")}


@pytest.mark.parametrize("given", [{}, {"rope_scaling": {"rope_type": "linear", "factor": 2.0},
                                        "rope_theta": 1000.0}])  # fmt: skip
def test_a_file_without_rotary_settings_means_what_transformers_reads(given):
    """No rope keys: GptOssConfig's YaRN, 32 times 4096 positions, unrounded, base 150000; a
    rope_scaling (transformers 4's spelling) replaces it."""
    config = _bare(**given)
    want = hf.GptOssConfig.from_dict(config).rope_parameters
    cfg = FAMILY.config(config)
    assert cfg.rope_base == want["rope_theta"]
    if not given:
        assert cfg.rope_scaling == RopeScaling("yarn", 32.0, 4096, truncate=False,
                                               max_positions=2048)  # fmt: skip
        assert want["rope_type"] == "yarn" and want["truncate"] is False
    else:
        assert (cfg.rope_scaling.kind, cfg.rope_scaling.factor) == ("linear", 2.0)
        assert (want["rope_type"], want["factor"]) == ("linear", 2.0)


@pytest.mark.parametrize("truncate", [None, False, True])
def test_yarn_frequencies_equal_transformers_with_truncate_absent_false_or_true(truncate):
    """truncate absent means true (transformers' default for YaRN); gpt-oss's own is false."""
    rope = {k: v for k, v in CASES["oss"].rope_parameters.items() if k != "truncate"}
    rope |= {} if truncate is None else {"truncate": truncate}
    config = CASES["oss"].to_dict() | {"rope_parameters": rope}
    cfg = FAMILY.config(config)
    assert cfg.rope_scaling.truncate is (truncate is not False)
    want = GptOssRotaryEmbedding(hf.GptOssConfig.from_dict(config))
    got = cfg.rotary()
    assert torch.equal(got.inv_freq, want.inv_freq)
    assert got.attention_factor == want.attention_scaling


def test_layer_types_default_to_even_layers_sliding():
    config = CASES["oss"].to_dict() | {"layer_types": None, "num_hidden_layers": 3}
    assert FAMILY.config(config).layer_types == ("sliding", "full", "sliding")
    assert hf.GptOssConfig.from_dict(config).layer_types[0] == "sliding_attention"


@pytest.mark.parametrize("drop", [False, True])
def test_num_experts_is_read_as_transformers_reads_it_beside_num_local_experts(drop):
    config = CASES["oss"].to_dict() | {"num_experts": 3}
    if drop:
        del config["num_local_experts"]
    assert hf.GptOssConfig.from_dict(config).num_local_experts == 3
    assert FAMILY.config(config).block.experts.routing.num_experts == 3


REFUSED_CONFIGS = [
    ({"quantization_config": {"quant_method": "mxfp4"}},
     r"quantization_config \('mxfp4'\) is not supported"),
    ({"sliding_window": None}, "sliding_window must be set: layer_types has sliding layers"),
    ({"layer_types": ["chunked_attention"] * 4}, r"layer_types holds \['chunked_attention'\]"),
    ({"num_experts_per_tok": 5}, r"num_experts_per_tok \(5\) must be at most num_local_experts"),
    ({"swiglu_limit": "7"}, "swiglu_limit must be a number"),
    ({"rope_parameters": {"rope_type": "yarn", "partial_rotary_factor": 0.5}},
     "partial_rotary_factor must be 1 in a gpt-oss checkpoint"),
    ({"rope_parameters": {"rope_type": "su"}}, "type 'su' is not supported"),
]  # fmt: skip


@pytest.mark.parametrize("change, message", REFUSED_CONFIGS)
def test_a_config_json_value_qkv_does_not_compute_is_refused_by_name(change, message):
    config = CASES["oss"].to_dict() | change
    with pytest.raises(ValueError, match=message) as error:
        family_for(config).config(config)
    assert "\n" not in str(error.value)


REFUSED_EXPORTS = [
    (_block(BASE, sinks=False), r"block.sinks=False \(it has True\)"),
    (_block(BASE, experts=None), "its MLP has no experts"),
    (_experts(BASE, shared_hidden=8), r"block.experts.shared_hidden=8 \(it has None\)"),
    (_routing(BASE, router_bias=False), "block.experts.routing=Routing"),
    (_experts(BASE, activation="silu"), r"block.experts.activation='silu'"),
    (_block(BASE, qkv_bias=False), r"block.qkv_bias=False \(it has None\)"),
    (_block(BASE, mlp_hidden=8), r"block.mlp_hidden=8 \(it has 24\)"),
]  # fmt: skip


@pytest.mark.parametrize("cfg, message", REFUSED_EXPORTS)
def test_a_config_gpt_oss_cannot_hold_is_refused_by_name(cfg, message):
    with pytest.raises(ValueError, match=message):
        FAMILY.hf_config(cfg)

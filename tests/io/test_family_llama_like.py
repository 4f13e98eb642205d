"""The Llama-shaped decoders (Llama 1-3 with every rope scaling, SmolLM2, SmolLM3, Mistral,
Qwen2, Qwen3): tiny random checkpoints built by `transformers`, loaded by qkv, exact.

Each case is compared at a length past what makes it differ from plain Llama: past the
sliding window (three windows), past the trained context of a scaled rotary."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
import transformers as hf
from safetensors.torch import save_file

from qkv.io.checkpoint import export
from qkv.io.families import FAMILIES, family_for, family_named
from qkv.io.hf_folder import load_folder
from qkv.models import DecoderConfig
from qkv.nn import BlockConfig
from qkv.nn.rope import RopeScaling

SMALL = dict(vocab_size=99, hidden_size=48, num_hidden_layers=2, num_attention_heads=6,
             num_key_value_heads=2, intermediate_size=37, max_position_embeddings=64)  # fmt: skip
WINDOW = 4


def rope(kind: str, **values) -> dict:
    return {"rope_type": kind, "rope_theta": 500.0, **values}


# name: (transformers class, its config, the length logits are compared at)
CASES = {
    "llama": (hf.LlamaForCausalLM, hf.LlamaConfig(**SMALL, rope_parameters=rope("default")), 20),
    "llama-bias": (hf.LlamaForCausalLM,
                   hf.LlamaConfig(**SMALL, attention_bias=True, mlp_bias=True), 20),
    # SmolLM2 is Llama: tied embeddings, three query heads per key/value head, its own base
    "smollm2": (hf.LlamaForCausalLM,
                hf.LlamaConfig(**SMALL | {"num_attention_heads": 12, "num_key_value_heads": 4},
                               tie_word_embeddings=True,
                               rope_parameters={"rope_type": "default", "rope_theta": 1e5}), 20),
    "linear": (hf.LlamaForCausalLM,
               hf.LlamaConfig(**SMALL, rope_parameters=rope("linear", factor=2.0)), 40),
    # the original context is 16 positions; the text is 40 long
    "dynamic": (hf.LlamaForCausalLM,
                hf.LlamaConfig(**SMALL | {"max_position_embeddings": 16},
                               rope_parameters=rope("dynamic", factor=2.0)), 40),
    "llama3": (hf.LlamaForCausalLM, hf.LlamaConfig(**SMALL, head_dim=16, rope_parameters=rope(
        "llama3", factor=4.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=16) | {"rope_theta": 500000.0}), 40),
    "yarn": (hf.LlamaForCausalLM, hf.LlamaConfig(**SMALL, rope_parameters=rope(
        "yarn", factor=4.0, original_max_position_embeddings=16, beta_fast=8.0, beta_slow=1.0)),
        40),
    "longrope": (hf.LlamaForCausalLM, hf.LlamaConfig(**SMALL, rope_parameters=rope(
        "longrope", factor=4.0, original_max_position_embeddings=16,
        short_factor=[1.0, 1.1, 1.3, 1.6], long_factor=[1.0, 2.0, 3.0, 4.0])), 40),
    "mistral": (hf.MistralForCausalLM,
                hf.MistralConfig(**SMALL, sliding_window=WINDOW, rope_parameters=rope("default")),
                3 * WINDOW + 2),
    # layer 0 full, layer 1 sliding (max_window_layers=1)
    "qwen2": (hf.Qwen2ForCausalLM,
              hf.Qwen2Config(**SMALL, use_sliding_window=True, sliding_window=WINDOW,
                             max_window_layers=1), 3 * WINDOW + 2),
    "qwen2.5-tied": (hf.Qwen2ForCausalLM,
                     hf.Qwen2Config(**SMALL, tie_word_embeddings=True, sliding_window=WINDOW,
                                    rope_parameters=rope("yarn", factor=4.0,
                                                         original_max_position_embeddings=16)),
                     40),
    # head_dim 16, not 48 / 6; the first layer slides, the second does not
    "qwen3": (hf.Qwen3ForCausalLM,
              hf.Qwen3Config(**SMALL, head_dim=16, use_sliding_window=True,
                             sliding_window=WINDOW,
                             layer_types=["sliding_attention", "full_attention"]),
              3 * WINDOW + 2),
    # layers 1 and 3 have no rotary positions and slide; biases everywhere
    "smollm3": (hf.SmolLM3ForCausalLM,
                hf.SmolLM3Config(**SMALL | {"num_hidden_layers": 4}, no_rope_layer_interval=2,
                                 use_sliding_window=True, sliding_window=WINDOW,
                                 attention_bias=True, mlp_bias=True, pad_token_id=None,
                                 bos_token_id=0, eos_token_id=0), 3 * WINDOW + 2),
}  # fmt: skip
NAMES = list(CASES)
# dynamic and longrope pick their frequencies by the text's length on each forward pass (as
# transformers does), so decoding one token at a time past the trained context (the cached
# keys turned by the shorter text's frequencies) cannot equal one pass over the whole text:
# transformers has the same property. Their cached decoding is compared within it.
BY_LENGTH = {"dynamic": 16, "longrope": 16}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    made = {}

    def folder(name: str):
        if name not in made:
            cls, config = CASES[name][:2]
            torch.manual_seed(1)
            model = cls(config).eval()
            with torch.no_grad():  # random, not zero or one, biases and norms
                for p in model.parameters():
                    p.add_(torch.randn_like(p) * 0.05)
            made[name] = tmp_path_factory.mktemp(name)
            model.save_pretrained(made[name])
        return made[name]

    return folder


def theirs(folder):
    return hf.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()


def ours(folder, backend="eager"):
    return load_folder(folder, torch.float32, backend)


def tokens(T: int, B: int = 1) -> torch.Tensor:
    return torch.randint(0, 99, (B, T), generator=torch.Generator().manual_seed(T + B))


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_logits_equal_transformers_past_the_window_and_the_trained_context(name, backend, folders):
    folder, T = folders(name), CASES[name][2]
    model, family, *_ = ours(folder, backend)
    assert family is family_for(json.loads((folder / "config.json").read_text()))
    ids = tokens(T, 2)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, theirs(folder)(ids).logits, atol=1e-5,
                                   rtol=0)  # fmt: skip


@pytest.mark.parametrize("name", NAMES)
def test_a_left_padded_row_equals_the_row_alone(name, folders):
    model, *_ = ours(folders(name))
    # dynamic and longrope: the batch's longest row picks the frequencies (as in transformers)
    T, pad = BY_LENGTH.get(name, CASES[name][2]), 5
    ids = tokens(T, 2)
    mask = torch.ones(2, T, dtype=torch.long)
    mask[1, :pad] = 0
    with torch.no_grad():
        batch = model(ids, attention_mask=mask).logits
        alone = model(ids[1:, pad:]).logits
        torch.testing.assert_close(batch[1, pad:], alone[0], atol=1e-5, rtol=0)
        torch.testing.assert_close(batch[0], model(ids[:1]).logits[0], atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", NAMES)
def test_decoding_token_by_token_equals_the_full_forward(name, folders):
    model, *_ = ours(folders(name))
    ids = tokens(BY_LENGTH.get(name, CASES[name][2]))
    cache = model.new_cache()
    with torch.no_grad():
        steps = [model(ids[:, t : t + 1], cache=cache).logits for t in range(ids.shape[1])]
        torch.testing.assert_close(torch.cat(steps, 1), model(ids).logits, atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", ["mistral", "qwen2", "qwen3", "smollm3"])
def test_a_left_padded_batch_decoded_past_the_window_equals_each_row_alone(name, folders):
    model, *_ = ours(folders(name))
    T, prompt, pad = CASES[name][2], 6, 3
    ids = tokens(T, 2)
    mask = torch.ones(2, T, dtype=torch.long)
    mask[1, :pad] = 0
    cache = model.new_cache()
    with torch.no_grad():
        out = [model(ids[:, :prompt], attention_mask=mask[:, :prompt], cache=cache).logits]
        for t in range(prompt, T):
            out.append(model(ids[:, t : t + 1], attention_mask=mask[:, : t + 1],
                             cache=cache).logits)  # fmt: skip
        decoded = torch.cat(out, 1)
        torch.testing.assert_close(decoded[0], model(ids[:1]).logits[0], atol=1e-5, rtol=0)
        alone = model(ids[1:, pad:]).logits[0]
        torch.testing.assert_close(decoded[1, pad:], alone, atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", NAMES)
def test_records_hold_transformers_weights_and_trace_each_head_exactly(name, folders):
    folder, T = folders(name), CASES[name][2]
    model, _, cfg, _ = ours(folder)
    ids = tokens(T)
    layers = list(range(cfg.num_layers))
    with torch.no_grad():
        want = theirs(folder)(ids, output_attentions=True).attentions
        records = model(ids, layers=layers).records
    for layer in layers:
        record = records[layer]
        torch.testing.assert_close(record.weights(), want[layer], atol=1e-6, rtol=0)
        for head, query in [(0, T - 1), (cfg.block.num_heads - 1, T // 2)]:
            step = record.steps(head, query)
            torch.testing.assert_close(step.contextualized.float(), record.out[0, head, query],
                                       atol=1e-6, rtol=0)  # fmt: skip


@pytest.mark.parametrize("name", NAMES)
def test_an_export_loads_in_transformers_with_equal_logits(name, folders, tmp_path):
    model, family, cfg, _ = ours(folders(name))
    save_file(export(model, family, cfg), tmp_path / "model.safetensors",
              metadata={"format": "pt"})  # fmt: skip
    original = json.loads((folders(name) / "config.json").read_text())
    ids_of_tokens = {k: original[k] for k in ("pad_token_id", "bos_token_id", "eos_token_id")}
    written = family.hf_config(cfg) | ids_of_tokens  # SmolLM3's default pad id is past 99
    (tmp_path / "config.json").write_text(json.dumps(written))
    ids = tokens(CASES[name][2], 2)
    with torch.no_grad():
        torch.testing.assert_close(theirs(tmp_path)(ids).logits, model(ids).logits, atol=1e-5,
                                   rtol=0)  # fmt: skip


# ---- config.json both ways ----------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_a_transformers_config_json_round_trips_through_qkv(name):
    config = CASES[name][1].to_dict()
    family = family_for(config)
    cfg = family.config(config)
    assert family.config(family.hf_config(cfg)) == cfg


def transformers4(config: dict) -> dict:
    """The same config.json in transformers 4's spelling: rope_theta and rope_scaling."""
    old = {k: v for k, v in config.items() if k != "rope_parameters"}
    params = dict(config["rope_parameters"])
    old["rope_theta"] = params.pop("rope_theta")
    if params.pop("rope_type") != "default":
        old["rope_scaling"] = {"type": config["rope_parameters"]["rope_type"], **params}
    return old


@pytest.mark.parametrize("name", ["llama", "linear", "dynamic", "llama3", "yarn", "longrope"])
def test_both_spellings_of_the_rotary_settings_read_the_same(name):
    config = CASES[name][1].to_dict()
    old = transformers4(config)
    assert "rope_parameters" not in old
    assert family_for(old).config(old) == family_for(config).config(config)
    assert family_for(config).config(config).rope_scaling == (
        None if name == "llama" else RopeScaling(**_scaling(name))
    )


def _scaling(name: str) -> dict:
    trained = 16 if name != "linear" else 64
    common = {"kind": name, "original_max_positions": trained,
              "max_positions": 16 if name == "dynamic" else 64}  # fmt: skip
    return common | {
        "linear": {"factor": 2.0},
        "dynamic": {"factor": 2.0},
        "llama3": {"factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0},
        "yarn": {"factor": 4.0, "beta_fast": 8.0, "beta_slow": 1.0},
        "longrope": {"factor": 4.0, "short_factor": (1.0, 1.1, 1.3, 1.6),
                     "long_factor": (1.0, 2.0, 3.0, 4.0)},
    }[name]  # fmt: skip


def test_sliding_layers_are_read_from_layer_types_or_derived_from_the_older_keys():
    qwen2 = CASES["qwen2"][1].to_dict()
    cfg = family_for(qwen2).config(qwen2)
    assert (cfg.block.window, cfg.layer_types) == (WINDOW, ("full", "sliding"))
    older = {k: v for k, v in qwen2.items() if k != "layer_types"}  # transformers 4
    assert family_for(older).config(older) == cfg
    off = qwen2 | {"use_sliding_window": False, "layer_types": None}  # Qwen2.5's files
    assert family_for(off).config(off).block.window is None
    qwen3 = CASES["qwen3"][1].to_dict()
    assert family_for(qwen3).config(qwen3).layer_types == ("sliding", "full")
    smollm3 = family_for(CASES["smollm3"][1].to_dict()).config(CASES["smollm3"][1].to_dict())
    assert smollm3.rope_layers == (True, False, True, False)
    assert smollm3.layer_types == ("full", "sliding", "full", "sliding")
    mistral = CASES["mistral"][1].to_dict()
    assert family_for(mistral).config(mistral | {"sliding_window": None}).block.window is None
    missing = {k: v for k, v in mistral.items() if k != "sliding_window"}
    assert family_for(missing).config(missing).block.window == 4096  # MistralConfig's default


BASE = DecoderConfig(
    vocab_size=50, num_layers=2, max_positions=64, position="rotary", rope_base=500.0,
    tie_embeddings=False,
    block=BlockConfig(width=16, num_heads=4, num_kv_heads=2, head_dim=4, mlp_hidden=24,
                      mlp="swiglu", norm="rmsnorm", norm_eps=1e-6, bias=False),
)  # fmt: skip
SLIDING = replace(BASE, block=replace(BASE.block, window=3), layer_types=("sliding", "full"))
ROUND_TRIPS = [
    ("llama", replace(BASE, block=replace(BASE.block, bias=True))),
    ("llama", replace(BASE, rope_scaling=RopeScaling("llama3", factor=8.0,
                                                     original_max_positions=16, max_positions=64))),
    ("mistral", replace(BASE, block=replace(BASE.block, window=5), tie_embeddings=True)),
    ("mistral", BASE),
    ("smollm3", replace(SLIDING, rope_layers=(False, True), block=replace(SLIDING.block,
                                                                          bias=True))),
    ("qwen2", replace(SLIDING, block=replace(SLIDING.block, qkv_bias=True))),
    ("qwen2", replace(BASE, block=replace(BASE.block, qkv_bias=True, window=7))),
    ("qwen3", replace(SLIDING, block=replace(SLIDING.block, qk_norm="head", head_dim=8))),
]  # fmt: skip


@pytest.mark.parametrize("name, cfg", ROUND_TRIPS)
def test_a_qkv_config_written_as_config_json_reads_back_equal(name, cfg):
    family = family_named(name)
    written = family.hf_config(cfg)
    assert family_for(written) is family
    assert family.config(written) == cfg


REFUSED_CONFIGS = [
    ("llama", {"attention_bias": True}, "attention_bias=True and mlp_bias=False are not"),
    ("llama", {"hidden_act": "gelu"}, "Llama checkpoints with hidden_act='gelu' are not"),
    ("llama", {"rope_parameters": rope("default", partial_rotary_factor=0.5)},
     "partial_rotary_factor must be 1 in a Llama checkpoint"),
    ("llama", {"rope_parameters": rope("su")}, "type 'su' is not supported"),
    ("qwen2", {"layer_types": ["full_attention", "chunked_attention"]},
     r"layer_types holds \['chunked_attention'\]"),
    ("qwen2", {"use_sliding_window": False},  # its layer_types still names a sliding layer
     "sliding_window must be set: layer_types has sliding layers"),
    ("qwen2", {"layer_types": ["full_attention"]}, "layer_types must list 2 layer types"),
    ("qwen3", {"attention_bias": True}, "Qwen3 checkpoints with attention_bias=True"),
    ("smollm3", {"use_sliding_window": False}, "use_sliding_window must be true where"),
    ("smollm3", {"no_rope_layers": [1, 0]}, "no_rope_layers must list 4 values 0 or 1"),
    ("mistral", {"sliding_window": 0}, "sliding_window must be a whole number >= 1"),
]  # fmt: skip


@pytest.mark.parametrize("name, change, message", REFUSED_CONFIGS)
def test_a_config_json_value_qkv_does_not_compute_is_refused_by_name(name, change, message):
    config = CASES[name][1].to_dict() | change
    with pytest.raises(ValueError, match=message) as error:
        family_for(config).config(config)
    assert "\n" not in str(error.value)


REFUSED_EXPORTS = [
    ("llama", replace(BASE, block=replace(BASE.block, window=4)),
     r"a Llama config.json cannot hold this model: block.window=4 \(it has None\)"),
    ("llama", replace(BASE, block=replace(BASE.block, qkv_bias=True)),
     "cannot hold qkv_bias=True with bias=False"),
    ("mistral", SLIDING, r"layer_types=\('sliding', 'full'\) \(it has None\)"),
    ("qwen2", BASE, r"block.qkv_bias=None \(it has True\)"),
    ("qwen3", replace(BASE, block=replace(BASE.block, qk_norm="full")),
     r"block.qk_norm='full' \(it has 'head'\)"),
    ("smollm3", replace(BASE, rope_dims=2), r"rope_dims=2 \(it has None\)"),
    ("mistral", replace(BASE, rope_scaling=RopeScaling("dynamic", 2.0, max_positions=16)),
     "cannot hold dynamic rope scaling from 16 positions with max_positions=64"),
]  # fmt: skip


@pytest.mark.parametrize("name, cfg, message", REFUSED_EXPORTS)
def test_a_config_the_family_cannot_hold_is_refused_by_name(name, cfg, message):
    with pytest.raises(ValueError, match=message):
        family_named(name).hf_config(cfg)


@pytest.mark.parametrize("family", [f for f in FAMILIES if f.name in
                                    ("llama", "mistral", "smollm3", "qwen2", "qwen3")])  # fmt: skip
def test_every_key_of_the_config_classes_is_read_or_inert(family):
    common = set(hf.PretrainedConfig().to_dict())
    for name in family.config_classes:
        keys = set(getattr(hf, name)().to_dict()) - common
        assert keys <= set(family.reads) | set(family.inert), name


def test_rope_layers_name_every_layer_of_a_rotary_model():
    with pytest.raises(ValueError, match="rope_layers names 3 layers, the model has 2"):
        replace(BASE, rope_layers=(True, False, True))
    with pytest.raises(ValueError, match="rope_layers needs rotary positions"):
        replace(BASE, position="learned", rope_layers=(True, False))

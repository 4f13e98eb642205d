"""OLMo 3, Ministral and Ministral 3: tiny random checkpoints built by `transformers`, loaded by
qkv, equal to transformers' eager model in logits, attention weights, padding, cached
decoding and export; their config.json both ways, transformers' rotary quirks, and what qkv
refuses by name.

The tiny models exercise what they map: texts of 24 tokens, past every sliding window (4)
and past the 8 positions their rotary scaling was trained on, where Ministral 3's query
temperature first grows (at 8, then 16)."""

from __future__ import annotations

import json
from copy import deepcopy
from dataclasses import replace

import pytest
import torch
import transformers as hf
from safetensors.torch import save_file

from qkv.io.checkpoint import export
from qkv.io.families import family_for
from qkv.io.families.ministral import MINISTRAL, MINISTRAL3
from qkv.io.families.olmo3 import FAMILY as OLMO3
from qkv.io.hf_folder import load_folder
from qkv.nn.position import Temperature
from qkv.nn.rope import RopeScaling

T = 24
SHARED = dict(vocab_size=99, hidden_size=32, intermediate_size=48, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, sliding_window=4,
              pad_token_id=0, bos_token_id=0, eos_token_id=0)  # fmt: skip
YARN = {"rope_type": "yarn", "rope_theta": 50000.0, "factor": 8.0,
        "original_max_position_embeddings": 8, "beta_fast": 32.0, "beta_slow": 1.0}  # fmt: skip
OLMO3_ROPE = {"full_attention": YARN | {"attention_factor": 1.2079441541679836},
              "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}}  # fmt: skip
M3_ROPE = YARN | {"rope_theta": 1e6, "factor": 16.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                  "llama_4_scaling_beta": 0.5}  # fmt: skip
UNTRUNCATED = YARN | {"beta_fast": 1.0, "beta_slow": 0.05}  # truncating moves its ramp
TINY = {
    # three sliding layers, then a full one: YaRN on the full layer, plain rotary on the others
    "olmo3": (hf.Olmo3ForCausalLM, hf.Olmo3Config(
        **SHARED, num_hidden_layers=4, rope_parameters=deepcopy(OLMO3_ROPE))),
    # full, sliding; YaRN untruncated by the key beside the nested objects (where transformers
    # reads it), one key and value head per query head, tied head
    "olmo3-untruncated": (hf.Olmo3ForCausalLM, hf.Olmo3Config(
        **SHARED | {"num_key_value_heads": 4}, num_hidden_layers=2, tie_word_embeddings=True,
        layer_types=["full_attention", "sliding_attention"],
        rope_parameters=deepcopy(OLMO3_ROPE) | {"truncate": False,
                                                "full_attention": dict(UNTRUNCATED)})),
    "ministral": (hf.MinistralForCausalLM, hf.MinistralConfig(
        **SHARED, num_hidden_layers=2, head_dim=16, rope_parameters=deepcopy(YARN),
        layer_types=["sliding_attention", "full_attention"])),
    # a sliding window on every layer; YaRN and the temperature from 8 positions on
    "ministral3": (hf.Ministral3ForCausalLM, hf.Ministral3Config(
        **SHARED, num_hidden_layers=2, head_dim=16, rope_parameters=deepcopy(M3_ROPE))),
    # no window, plain rotary with a temperature every 6 positions, tied head
    "ministral3-plain": (hf.Ministral3ForCausalLM, hf.Ministral3Config(
        **SHARED | {"sliding_window": None}, num_hidden_layers=2, head_dim=8,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1000.0,
                         "original_max_position_embeddings": 6, "llama_4_scaling_beta": 0.7})),
}  # fmt: skip
FAMILY = {"olmo3": OLMO3, "olmo3-untruncated": OLMO3, "ministral": MINISTRAL,
          "ministral3": MINISTRAL3, "ministral3-plain": MINISTRAL3}  # fmt: skip
NAMES = list(TINY)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """name -> (folder of a tiny random checkpoint, transformers' eager model of it)."""
    made = {}
    for name, (cls, config) in TINY.items():
        torch.manual_seed(3)
        model = cls(config).eval()
        with torch.no_grad():  # norm gains off 1 and weights large enough for the positions to tell
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.2)
        folder = tmp_path_factory.mktemp(name)
        model.save_pretrained(folder)
        made[name] = folder, cls.from_pretrained(folder, attn_implementation="eager").eval()
    return made


def ids_of(batch: int, length: int = T) -> torch.Tensor:
    return torch.randint(1, 99, (batch, length), generator=torch.Generator().manual_seed(batch))


def ours(folders, name: str, backend: str = "eager"):
    return load_folder(folders[name][0], torch.float32, backend)


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
@pytest.mark.parametrize("name", NAMES)
def test_logits_equal_transformers_past_the_window_and_the_trained_context(name, backend, folders):
    model, family, *_ = ours(folders, name, backend)
    assert family is FAMILY[name]
    ids = ids_of(2)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, folders[name][1](ids).logits, atol=1e-5,
                                   rtol=0)  # fmt: skip


@pytest.mark.parametrize("name", NAMES)
def test_records_hold_transformers_weights_and_trace_each_head(name, folders):
    model, _, config, _ = ours(folders, name)
    ids = ids_of(1)
    layers = list(range(config.num_layers))
    with torch.no_grad():
        want = folders[name][1](ids, output_attentions=True).attentions
        records = model(ids, layers=layers).records
    for layer in layers:
        record = records[layer]
        torch.testing.assert_close(record.weights(), want[layer], atol=1e-6, rtol=0)
        for head, query in [(0, T - 1), (config.block.num_heads - 1, 17), (1, 3)]:
            step = record.steps(head, query)
            torch.testing.assert_close(step.contextualized.float(), record.out[0, head, query],
                                       atol=1e-6, rtol=0)  # fmt: skip


@pytest.mark.parametrize("name", NAMES)
def test_a_left_padded_row_equals_the_row_alone(name, folders):
    """Positions count from each row's first real token: the rotary's and the temperature's."""
    model, *_ = ours(folders, name)
    ids, pad = ids_of(2), 5
    mask = torch.ones(2, T, dtype=torch.long)
    mask[1, :pad] = 0
    with torch.no_grad():
        together = model(ids, attention_mask=mask).logits
        torch.testing.assert_close(together[0], model(ids[:1]).logits[0], atol=1e-5, rtol=0)
        alone = model(ids[1:, pad:]).logits[0]
        torch.testing.assert_close(together[1, pad:], alone, atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", NAMES)
def test_cached_decoding_token_by_token_equals_the_full_forward(name, folders):
    """A left-padded batch, as generation runs it: a prompt, then one token at a time."""
    model, *_ = ours(folders, name)
    ids, prompt, pad = ids_of(2), 3, 3
    mask = torch.ones(2, T, dtype=torch.long)
    mask[1, :pad] = 0
    cache = model.new_cache()
    with torch.no_grad():
        full = model(ids, attention_mask=mask).logits
        steps = [model(ids[:, :prompt], attention_mask=mask[:, :prompt], cache=cache).logits]
        for t in range(prompt, T):
            steps.append(model(ids[:, t : t + 1], attention_mask=mask[:, : t + 1],
                               cache=cache).logits)  # fmt: skip
    got = torch.cat(steps, dim=1)
    torch.testing.assert_close(got[0], full[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(got[1, pad:], full[1, pad:], atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", NAMES)
def test_an_export_loads_in_transformers_with_equal_logits(name, folders, tmp_path):
    model, family, config, _ = ours(folders, name)
    save_file(export(model, family, config), tmp_path / "model.safetensors", {"format": "pt"})
    ids_of_tokens = {"pad_token_id": 0, "bos_token_id": 0, "eos_token_id": 0}
    (tmp_path / "config.json").write_text(json.dumps(family.hf_config(config) | ids_of_tokens))
    theirs = hf.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager")
    assert type(theirs) is TINY[name][0]
    ids = ids_of(2)
    with torch.no_grad():
        torch.testing.assert_close(theirs(ids).logits, model(ids).logits, atol=1e-5, rtol=0)


def _block(config, **changes):
    return replace(config, block=replace(config.block, **changes))


def _all_full(config):
    return replace(config, layer_types=("full",) * config.num_layers)


EXERCISED = [
    ("olmo3", "sliding window", _all_full),
    ("olmo3", "YaRN on the full layer", lambda c: replace(c, rope_scaling=None)),
    ("olmo3", "the sliding layers' own rotary", lambda c: replace(c, local_rope_base=None)),
    ("olmo3-untruncated", "untruncated YaRN",
     lambda c: replace(c, rope_scaling=replace(c.rope_scaling, truncate=True))),
    ("ministral", "sliding window", lambda c: replace(c, layer_types=None,
                                                      block=replace(c.block, window=None))),
    ("ministral3", "temperature", lambda c: _block(c, temperature=None)),
    ("ministral3", "sliding window", lambda c: _block(c, window=None)),
    ("ministral3", "YaRN", lambda c: replace(c, rope_scaling=None)),
    ("ministral3-plain", "temperature", lambda c: _block(c, temperature=None)),
]  # fmt: skip


@pytest.mark.parametrize("name, what, without", EXERCISED,
                         ids=[f"{n}-{w}" for n, w, _ in EXERCISED])  # fmt: skip
def test_the_tiny_models_exercise_what_they_map(name, what, without, folders):
    """Each choice changes these logits: a mapping that dropped one would fail above."""
    model, _, config, _ = ours(folders, name)
    other = type(model)(without(config)).eval()
    other.load_state_dict(model.state_dict())
    ids = ids_of(1)
    with torch.no_grad():
        assert (other(ids).logits - model(ids).logits).abs().max() > 1e-2, what


# ---- config.json both ways -----------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_a_transformers_config_round_trips_through_qkv(name):
    """transformers' config.json -> qkv -> config.json (read by transformers itself) -> qkv."""
    config_class = type(TINY[name][1])
    family = family_for(TINY[name][1].to_dict())
    config = family.config(TINY[name][1].to_dict())
    written = family.hf_config(config)
    assert family_for(written) is family and family.config(written) == config
    assert family.config(config_class.from_dict(written).to_dict()) == config


def test_what_the_tiny_configs_read_as():
    olmo3 = OLMO3.config(TINY["olmo3"][1].to_dict())
    assert olmo3.layer_types == ("sliding", "sliding", "sliding", "full")
    assert (olmo3.block.window, olmo3.rope_base, olmo3.local_rope_base) == (4, 50000.0, 100.0)
    assert olmo3.rope_scaling == RopeScaling("yarn", 8.0, 8, attention_factor=1.2079441541679836,
                                             max_positions=64)  # fmt: skip
    untruncated = OLMO3.config(TINY["olmo3-untruncated"][1].to_dict())
    assert untruncated.rope_scaling.truncate is False and untruncated.tie_embeddings
    m3 = MINISTRAL3.config(TINY["ministral3"][1].to_dict())
    assert m3.block.temperature == Temperature(0.5, 8, 0.0) and m3.block.window == 4
    assert (m3.block.head_size, m3.rope_scaling.mscale, m3.rope_scaling.factor) == (16, 1.0, 16.0)
    plain = MINISTRAL3.config(TINY["ministral3-plain"][1].to_dict())
    assert (plain.block.temperature, plain.block.window) == (Temperature(0.7, 6, 0.0), None)
    assert (plain.block.head_size, plain.rope_scaling) == (8, None)
    ministral = MINISTRAL.config(TINY["ministral"][1].to_dict())
    assert ministral.layer_types == ("sliding", "full") and ministral.block.window == 4


def olmo3_rope_as_transformers_reads(file: dict) -> tuple:
    """(full base, full kind, sliding base) of transformers' own reading of a config.json."""
    nested = hf.Olmo3Config.from_dict(deepcopy(file)).rope_parameters  # it edits what it reads
    full, sliding = nested["full_attention"], nested["sliding_attention"]
    return float(full["rope_theta"]), full["rope_type"], float(sliding["rope_theta"])


OLDER = {"model_type": "olmo3", **SHARED, "num_hidden_layers": 4}
OLMO3_SPELLINGS = {
    # an older file: its rope_theta and rope_scaling are the full layers' only
    "older keys": (OLDER | {"rope_theta": 10000.0, "rope_scaling": YARN | {"rope_theta": 10000.0}},
                   (10000.0, "yarn", 500000.0)),
    "older base alone": (OLDER | {"rope_theta": 10000.0}, (10000.0, "default", 500000.0)),
    # a flat rope_parameters is not the nested one: ignored
    "flat rope_parameters": (OLDER | {"rope_parameters": YARN}, (500000.0, "default", 500000.0)),
    "nothing": (OLDER, (500000.0, "default", 500000.0)),
    "scaling beside nested": (OLDER | {"rope_parameters": OLMO3_ROPE,
                                       "rope_scaling": {"rope_type": "linear", "factor": 2.0}},
                              (50000.0, "linear", 100.0)),
}  # fmt: skip


@pytest.mark.parametrize("file, want", OLMO3_SPELLINGS.values(), ids=list(OLMO3_SPELLINGS))
def test_olmo3_rotary_settings_read_as_transformers_reads_them(file, want):
    assert olmo3_rope_as_transformers_reads(file) == want
    config = OLMO3.config(file)
    kind = config.rope_scaling.kind if config.rope_scaling else "default"
    assert (config.rope_base, kind, config.local_rope_base) == want


@pytest.mark.parametrize("outer, inner", [(None, False), (False, None), (False, True)])
def test_olmo3_yarn_truncate_is_read_from_beside_the_nested_objects_as_in_transformers(
    outer, inner
):
    """transformers' YaRN reads `truncate` from the outer rope_parameters: the full layers'
    own is ignored. qkv's full-layer frequencies are transformers' in each case."""
    rope = deepcopy(OLMO3_ROPE) | {"full_attention": dict(UNTRUNCATED)}
    if inner is not None:
        rope["full_attention"]["truncate"] = inner
    if outer is not None:
        rope["truncate"] = outer
    file = OLDER | {"rope_parameters": rope}
    config = OLMO3.config(file)
    assert config.rope_scaling.truncate is (outer is None)
    theirs = hf.Olmo3Config.from_dict(deepcopy(file))
    want = hf.models.olmo3.modeling_olmo3.Olmo3RotaryEmbedding(theirs).full_attention_inv_freq
    torch.testing.assert_close(config.rotary().inv_freq, want, atol=0, rtol=0)


def test_ministral3_without_rotary_keys_is_transformers_default():
    """Neither rope_parameters nor rope_scaling: YaRN x16 from 16 384, base 10^6, beta 0.1;
    an older rope_theta beside nothing else does not change that base (as in transformers)."""
    bare = {"model_type": "ministral3", **SHARED, "num_hidden_layers": 2, "rope_theta": 5.0}
    config = MINISTRAL3.config(bare)
    assert config.rope_base == hf.Ministral3Config.from_dict(bare).rope_parameters["rope_theta"]
    assert config.rope_base == 1e6 and config.block.temperature == Temperature(0.1, 16384)
    assert config.block.head_size == 128 and config.block.kv_heads == 2


def with_keys(name: str, **keys) -> dict:
    return TINY[name][1].to_dict() | keys


NO_BETA = {k: v for k, v in M3_ROPE.items() if k != "llama_4_scaling_beta"}
REFUSED = [
    (with_keys("olmo3", sliding_window=None), "sliding_window must be set"),
    (with_keys("olmo3", attention_bias=True), "OLMo 3 checkpoints with attention_bias=True"),
    (with_keys("olmo3", rope_parameters=OLMO3_ROPE | {"sliding_attention": YARN}),
     "sliding layers with rope scaling 'yarn' are not supported"),
    (with_keys("olmo3", partial_rotary_factor=0.5), "partial_rotary_factor must be 1"),
    (with_keys("olmo3", rope_parameters=YARN, rope_scaling={"rope_type": "linear", "factor": 2}),
     "rope_scaling cannot stand beside a rope_parameters without full_attention"),
    (with_keys("olmo3", rope_parameters={"full_attention": {"rope_type": "yarn",
                                                            "rope_theta": None}}),
     "rope_theta must be a number > 0, got None"),
    (with_keys("olmo3", layer_types=["full_attention"] * 3 + ["chunked_attention"]),
     r"layer_types holds \['chunked_attention'\]"),
    (with_keys("ministral", sliding_window=None), "sliding_window must be set"),
    (with_keys("ministral3", rope_parameters=NO_BETA), "must hold llama_4_scaling_beta"),
    (with_keys("ministral3", rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                              "llama_4_scaling_beta": 0.1}),
     "must hold original_max_position_embeddings"),
    (with_keys("ministral3", rope_parameters={"full_attention": M3_ROPE}),
     "rope_parameters must not be nested by layer type"),
    (with_keys("ministral3", model_type="mistral3"), "multimodal Mistral 3 checkpoints"),
    (with_keys("ministral3", head_dim=None), "head_dim must be a whole number >= 1, got None"),
]  # fmt: skip


@pytest.mark.parametrize("file, message", REFUSED)
def test_a_config_json_qkv_does_not_compute_is_refused_by_name(file, message):
    with pytest.raises(ValueError, match=message):
        family_for(file).config(file)


def qkv_config(name: str):
    return FAMILY[name].config(TINY[name][1].to_dict())


NOT_HELD = [
    (OLMO3, replace(qkv_config("olmo3"), local_rope_base=None), "needs local_rope_base"),
    (OLMO3, _block(qkv_config("olmo3"), temperature=Temperature(0.1, 8)),
     r"block.temperature=Temperature\(.*\) \(it has None\)"),
    (MINISTRAL3, _block(qkv_config("ministral3"), temperature=Temperature(0.1, 9)),
     "cannot hold a temperature every 9 positions with rotary trained on 8"),
    (MINISTRAL3, _block(qkv_config("ministral3"), temperature=Temperature(0.1, 8, 1.0)),
     "its shift is 0"),
    (MINISTRAL, _block(qkv_config("ministral"), temperature=Temperature(0.1, 8)),
     r"block.temperature=Temperature\(.*\) \(it has None\)"),
    (MINISTRAL3, _block(qkv_config("ministral3"), qk_norm="head"),
     r"block.qk_norm='head' \(it has None\)"),
]  # fmt: skip


@pytest.mark.parametrize("family, config, message", NOT_HELD)
def test_a_qkv_config_the_family_cannot_hold_is_refused_by_name(family, config, message):
    with pytest.raises(ValueError, match=message):
        family.hf_config(config)

"""Gemma, Gemma 2 and Gemma 3 (text): tiny random checkpoints built by `transformers`, loaded
by qkv, equal to transformers' eager model in logits, attention weights, padding, cached
decoding and export; their config.json both ways, and what qkv refuses by name.

The tiny models are made to exercise what they test: weights large enough that the soft-caps
bite, texts of 30 tokens past a sliding window of 8 and past Gemma 3's scaled context of 16.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace

import pytest
import torch
import transformers as hf
from safetensors.torch import save_file

import qkv
from qkv.io.checkpoint import export
from qkv.io.embedded import embedded_path
from qkv.io.families import family_for
from qkv.io.families.gemma import GEMMA, GEMMA2, GEMMA3
from qkv.io.hf_folder import load_folder
from qkv.nn.rope import RopeScaling

TOKENIZER_FILES = ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"]
T = 30  # past every tiny model's sliding window (8) and Gemma 3's original context (16)
SHARED = dict(vocab_size=99, hidden_size=32, intermediate_size=37, max_position_embeddings=64)
GEMMA3_ROPE = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
    "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 10000.0},
}
TINY = {
    "gemma": (hf.GemmaForCausalLM, hf.GemmaConfig(
        **SHARED, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, rope_parameters={"rope_type": "default", "rope_theta": 500.0})),
    "gemma-untied": (hf.GemmaForCausalLM, hf.GemmaConfig(
        **SHARED, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
        head_dim=16, hidden_act="gelu", tie_word_embeddings=False)),
    "gemma2": (hf.Gemma2ForCausalLM, hf.Gemma2Config(
        **SHARED, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, query_pre_attn_scalar=64, sliding_window=8, attn_logit_softcapping=4.0,
        final_logit_softcapping=3.0, rope_parameters={"rope_type": "default", "rope_theta": 1e3})),
    "gemma3": (hf.Gemma3ForCausalLM, hf.Gemma3TextConfig(
        **{**SHARED, "max_position_embeddings": 16}, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=1, head_dim=16, query_pre_attn_scalar=64,
        sliding_window=8, final_logit_softcapping=3.0, tie_word_embeddings=False,
        layer_types=["sliding_attention", "sliding_attention", "full_attention",
                     "sliding_attention"], rope_parameters=GEMMA3_ROPE)),
    "gemma3-1b": (hf.Gemma3ForCausalLM, hf.Gemma3TextConfig(  # the 1B's shape: no scaling
        **SHARED, num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1,
        head_dim=16, query_pre_attn_scalar=16, sliding_window=8, sliding_window_pattern=3)),
}  # fmt: skip
FAMILY = {"gemma": GEMMA, "gemma-untied": GEMMA, "gemma2": GEMMA2, "gemma3": GEMMA3,
          "gemma3-1b": GEMMA3}  # fmt: skip
# sdpa computes no soft-cap: Gemma 2's attention is eager's only, in qkv as in transformers
SDPA = ["gemma", "gemma-untied", "gemma3", "gemma3-1b"]
# a sliding and a full layer of each model that has both
RECORDED = {"gemma": [1], "gemma-untied": [0], "gemma2": [0, 1], "gemma3": [1, 2],
            "gemma3-1b": [0, 2]}  # fmt: skip


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """name -> (folder of a tiny random checkpoint, transformers' eager model of it)."""
    made = {}
    for name, (cls, config) in TINY.items():
        torch.manual_seed(7)
        model = cls(config).eval()
        with torch.no_grad():  # random norm gains and weights large enough for the caps to bite
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.3)
        folder = tmp_path_factory.mktemp(name)
        model.save_pretrained(folder)
        made[name] = folder, cls.from_pretrained(folder, attn_implementation="eager").eval()
    return made


def ids_of(batch: int, length: int = T) -> torch.Tensor:
    return torch.randint(0, 99, (batch, length))


@pytest.mark.parametrize(
    "name, backend", [(n, "eager") for n in TINY] + [(n, "sdpa") for n in SDPA]
)
def test_logits_equal_transformers(name, backend, folders):
    """Each backend against transformers' own of the same name (bit for bit, in practice)."""
    folder, theirs = folders[name]
    if backend == "sdpa":
        theirs = TINY[name][0].from_pretrained(folder, attn_implementation="sdpa").eval()
    ours, family, *_ = load_folder(folder, torch.float32, backend)
    assert family is FAMILY[name]
    ids = ids_of(2)
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, theirs(ids).logits, atol=1e-5, rtol=0)


def _block(config, **changes):
    return replace(config, block=replace(config.block, **changes))


def _no_window(config):
    return replace(config, layer_types=None, block=replace(config.block, window=None))


EXERCISED = [
    ("gemma2", "attention soft-cap", lambda c: _block(c, softcap=None)),
    ("gemma2", "final soft-cap", lambda c: replace(c, logit_softcap=None)),
    ("gemma2", "window", _no_window),
    ("gemma2", "score scale", lambda c: _block(c, attn_scale=None)),
    ("gemma3", "rope scaling", lambda c: replace(c, rope_scaling=None)),
    ("gemma3", "local rotary base", lambda c: replace(c, local_rope_base=None)),
    ("gemma3", "final soft-cap", lambda c: replace(c, logit_softcap=None)),
    ("gemma3-1b", "window", _no_window),
]


@pytest.mark.parametrize(
    "name, what, without", EXERCISED, ids=[f"{n}-{w}" for n, w, _ in EXERCISED]
)
def test_the_tiny_models_exercise_what_they_map(name, what, without, folders):
    """Each of the families' choices changes these logits: a mapping that dropped one fails."""
    ours, _, config, _ = load_folder(folders[name][0], torch.float32, "eager")
    other = type(ours)(without(config)).eval()
    other.load_state_dict(ours.state_dict())
    ids = ids_of(1)
    with torch.no_grad():
        assert (other(ids).logits - ours(ids).logits).abs().max() > 1e-2, what


def test_gemma2_refuses_a_backend_without_softcap(folders):
    folder, _ = folders["gemma2"]
    ours, *_ = load_folder(folder, torch.float32, "sdpa")
    with pytest.raises(ValueError, match="sdpa.*soft-?cap"):
        ours(ids_of(1, 5))


@pytest.mark.parametrize("name", list(TINY))
def test_a_left_padded_row_equals_the_row_alone(name, folders):
    ours, *_ = load_folder(folders[name][0], torch.float32, "eager")
    ids, pad = ids_of(2), 5
    mask = torch.ones(2, T, dtype=torch.long)
    mask[1, :pad] = 0
    with torch.no_grad():
        together = ours(ids, attention_mask=mask).logits
        torch.testing.assert_close(together[0], ours(ids[:1]).logits[0], atol=1e-5, rtol=0)
        alone = ours(ids[1:, pad:]).logits[0]
        torch.testing.assert_close(together[1, pad:], alone, atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", list(TINY))
def test_cached_decoding_token_by_token_equals_the_full_forward(name, folders):
    """A left-padded batch, as generation runs it: a prompt, then one token at a time."""
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
    # one query at a time sums in another order than all at once: float32 rounding apart
    # (1.3e-5 on logits of 0.57 was seen), not a missing term
    torch.testing.assert_close(got[0], full[0], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(got[1, 3:], full[1, 3:], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("name", list(TINY))
def test_recorded_weights_equal_transformers_attentions(name, folders):
    folder, theirs = folders[name]
    ours, *_ = load_folder(folder, torch.float32, "eager")
    ids, layers = ids_of(2), RECORDED[name]
    with torch.no_grad():
        want = theirs(ids, output_attentions=True).attentions
        got = ours(ids, layers=layers).records
    for layer in layers:
        torch.testing.assert_close(got[layer].weights(), want[layer], atol=1e-6, rtol=0)


@pytest.mark.parametrize("name", ["gemma2", "gemma3"])
def test_the_articles_steps_give_the_models_own_head_output(name, folders):
    ours, *_ = load_folder(folders[name][0], torch.float32, "eager")
    with torch.no_grad():
        records = ours(ids_of(1), layers=RECORDED[name]).records
    for record in records.values():
        for head, query in [(0, 3), (1, T - 1), (3, 17)]:
            got = record.steps(head, query).contextualized
            torch.testing.assert_close(got.float(), record.out[0, head, query], atol=1e-6, rtol=0)


@pytest.mark.parametrize("name", list(TINY))
def test_export_loads_in_transformers_with_equal_logits(name, folders, tmp_path):
    """The weights under their checkpoint names, beside the config.json qkv writes."""
    ours, family, config, _ = load_folder(folders[name][0], torch.float32, "eager")
    save_file(export(ours, family, config), tmp_path / "model.safetensors", {"format": "pt"})
    (tmp_path / "config.json").write_text(json.dumps(family.hf_config(config)))
    theirs = hf.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager")
    assert type(theirs) is TINY[name][0]
    ids = ids_of(2)
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, theirs(ids).logits, atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", ["gemma2", "gemma3"])
def test_a_loaded_gemma_saves_as_a_folder_transformers_loads(name, folders, tmp_path):
    """qkv.load and Pretrained.save, the way a user exports (any tokenizer will do)."""
    folder = tmp_path / "original"
    shutil.copytree(folders[name][0], folder)
    for file in TOKENIZER_FILES:
        shutil.copy(embedded_path("minilm") / file, folder / file)
    ours = qkv.load(folder)
    ours.save(tmp_path / "exported")
    theirs = TINY[name][0].from_pretrained(tmp_path / "exported", attn_implementation="eager")
    ids = ids_of(2)
    with torch.no_grad():
        torch.testing.assert_close(ours.model(ids).logits, theirs(ids).logits, atol=1e-5, rtol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_embedding_scale_is_rounded_to_the_dtype_as_in_transformers(dtype, folders):
    """sqrt(32) is 5.65625 in bfloat16: the token vectors are those of transformers, bit for
    bit, not the vectors times the exact root."""
    folder, _ = folders["gemma"]
    ours, *_ = load_folder(folder, dtype, None)
    theirs = hf.GemmaForCausalLM.from_pretrained(folder, dtype=dtype)
    ids = ids_of(1, 12)
    with torch.no_grad():
        want = theirs.model.embed_tokens(ids)
        got = ours.embed(ids, torch.arange(12))
    assert torch.equal(got, want)
    assert not torch.equal(ours.embed.tokens(ids) * 32**0.5, want)


# ---- config.json both ways -----------------------------------------------------------------


@pytest.mark.parametrize("name", list(TINY))
def test_a_transformers_config_round_trips_through_qkv(name):
    """transformers' config.json -> qkv -> config.json (read by transformers itself) -> qkv."""
    _, hf_config = TINY[name]
    family = family_for(hf_config.to_dict())
    config = family.config(hf_config.to_dict())
    written = family.hf_config(config)
    assert family_for(written) is family and family.config(written) == config
    reread = type(hf_config).from_dict(written).to_dict()
    assert family.config(reread) == config


def test_what_the_tiny_configs_read_as():
    gemma2 = GEMMA2.config(TINY["gemma2"][1].to_dict())
    assert gemma2.layer_types == ("sliding", "full", "sliding")
    assert (gemma2.block.window, gemma2.block.softcap, gemma2.logit_softcap) == (8, 4.0, 3.0)
    assert gemma2.block.attn_scale == 64**-0.5 and gemma2.block.sublayer_norm
    gemma3 = GEMMA3.config(TINY["gemma3"][1].to_dict())
    assert gemma3.layer_types == ("sliding", "sliding", "full", "sliding")
    assert (gemma3.rope_base, gemma3.local_rope_base) == (10000.0, 100.0)
    assert gemma3.rope_scaling == RopeScaling("linear", 8.0, 16, max_positions=16)
    assert gemma3.block.qk_norm == "head" and gemma3.block.softcap is None
    small = GEMMA3.config(TINY["gemma3-1b"][1].to_dict())
    assert small.layer_types == ("sliding", "sliding", "full")
    assert (small.rope_base, small.local_rope_base, small.rope_scaling) == (1e6, 1e4, None)
    gemma = GEMMA.config(TINY["gemma-untied"][1].to_dict())
    assert gemma.block.mlp == "geglu_tanh"  # Gemma's legacy "gelu" is the tanh approximation


def test_an_older_gemma3_config_reads_as_transformers_reads_it():
    """transformers 4's spelling: rope_theta and rope_scaling for the full layers,
    rope_local_base_freq for the sliding ones, sliding_window_pattern for the layout."""
    old = {"model_type": "gemma3_text", **SHARED, "num_hidden_layers": 4,
           "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 16,
           "rope_theta": 5e5, "rope_local_base_freq": 300.0, "sliding_window_pattern": 2,
           "rope_scaling": {"rope_type": "linear", "factor": 8.0}}  # fmt: skip
    theirs = hf.Gemma3TextConfig.from_dict(old).to_dict()
    assert GEMMA3.config(old) == GEMMA3.config(theirs)
    config = GEMMA3.config(old)
    assert config.layer_types == ("sliding", "full", "sliding", "full")
    assert (config.rope_base, config.local_rope_base, config.rope_scaling.factor) == (
        5e5, 300.0, 8.0)  # fmt: skip


@pytest.mark.parametrize("cls", [hf.GemmaConfig, hf.Gemma2Config, hf.Gemma3TextConfig])
def test_missing_keys_mean_transformers_defaults(cls):
    """A config.json of nothing but its model_type is transformers' default model."""
    bare = {"model_type": cls.model_type}
    family = family_for(bare)
    assert family.config(bare) == family.config(cls().to_dict())


def test_null_caps_mean_none():
    hf_config = {**TINY["gemma2"][1].to_dict(), "attn_logit_softcapping": None,
                 "final_logit_softcapping": None}  # fmt: skip
    config = GEMMA2.config(hf_config)
    assert config.block.softcap is None and config.logit_softcap is None


def with_keys(name: str, **keys) -> dict:
    return {**TINY[name][1].to_dict(), **keys}


REFUSED = [
    (with_keys("gemma", attention_bias=True), "Gemma checkpoints with attention_bias=True"),
    (with_keys("gemma2", use_bidirectional_attention=True),
     "Gemma 2 checkpoints with use_bidirectional_attention=True are not supported"),
    ({"model_type": "gemma3", "text_config": {}}, "multimodal Gemma 3 checkpoints"),
    (with_keys("gemma3", attn_logit_softcapping=50.0),
     "attn_logit_softcapping=50.0 are not supported: transformers' Gemma 3 never applies it"),
    (with_keys("gemma", rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                         "partial_rotary_factor": 0.5}),
     "Gemma checkpoints with partial_rotary_factor are not supported"),
    (with_keys("gemma", hidden_activation="gelu"),
     r"hidden_act \('gelu_pytorch_tanh'\) and hidden_activation \('gelu'\) disagree"),
    (with_keys("gemma2", hidden_activation="relu"), "hidden_activation 'relu' is not supported"),
    (with_keys("gemma3", rope_parameters={"rope_type": "linear", "factor": 8.0}),
     "rope_parameters must be nested by layer type"),
    (with_keys("gemma2", layer_types=["sliding_attention", "chunked_attention",
                                      "full_attention"]),
     r"layer_types holds \['chunked_attention'\]"),
    (with_keys("gemma2", layer_types=["full_attention"]), "layer_types must list the 3 layers"),
    (with_keys("gemma2", sliding_window=None), "sliding_window must be a whole number"),
    (with_keys("gemma3", rope_parameters={**GEMMA3_ROPE,
                                          "sliding_attention": {"rope_type": "linear",
                                                                "factor": 2.0}}),
     "sliding layers with rope scaling 'linear' are not supported"),
]  # fmt: skip


@pytest.mark.parametrize("hf_config, message", REFUSED)
def test_a_config_json_qkv_does_not_compute_is_refused_by_name(hf_config, message):
    with pytest.raises(ValueError, match=message):
        family_for(hf_config).config(hf_config)


def qkv_config(name: str):
    return FAMILY[name].config(TINY[name][1].to_dict())


def changed(name: str, **block):
    return _block(qkv_config(name), **block)


NOT_HELD = [
    (changed("gemma", mlp="geglu"), "a Gemma config.json cannot hold mlp='geglu'"),
    (changed("gemma", window=8), r"block.window=8 \(it has None\)"),
    (replace(qkv_config("gemma"), logit_softcap=30.0), r"logit_softcap=30.0 \(it has None\)"),
    (changed("gemma2", norm="rmsnorm"), r"block.norm='rmsnorm' \(it has 'rmsnorm_plus1'\)"),
    (changed("gemma2", attn_scale=0.3), "cannot hold attn_scale=0.3: its scale is 1/sqrt"),
    (replace(qkv_config("gemma2"), local_rope_base=10.0), r"local_rope_base=10.0"),
    (replace(qkv_config("gemma2"), embed_scale_rounded=False), "embed_scale_rounded=False"),
    (changed("gemma3", softcap=50.0), r"block.softcap=50.0 \(it has None\)"),
    (replace(qkv_config("gemma3"), local_rope_base=None), "needs local_rope_base"),
]  # fmt: skip


@pytest.mark.parametrize("config, message", NOT_HELD)
def test_a_qkv_config_a_gemma_config_json_cannot_hold_is_refused_by_name(config, message):
    with pytest.raises(ValueError, match=message):
        FAMILY["gemma"].hf_config(config)


def test_each_familys_keys_are_read_or_inert():
    """Every key of transformers' own config classes is one the family reads or one that
    does not change the outputs (the keys every config has aside)."""
    common = set(hf.PretrainedConfig().to_dict())
    for family in (GEMMA, GEMMA2, GEMMA3):
        (name,) = family.config_classes
        keys = set(getattr(hf, name)().to_dict()) - common
        assert keys <= set(family.reads) | set(family.inert), (name, keys - set(family.reads))

"""Phi-3, OLMo 2 and GPT-NeoX (Pythia): tiny random checkpoints built by `transformers`, loaded
by qkv, exact against transformers' eager model: logits, padding, cached decoding, attention
weights, the article's steps, export, and each config.json both ways."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
import transformers as hf
from safetensors.torch import save_file

from qkv.io.checkpoint import export, read_checkpoint
from qkv.io.families import family_for, neox, olmo2, phi3
from qkv.io.hf_folder import load_folder

# LONG: past every sliding window and past the 16 positions phi4-mini and neox-sequential were
# trained on (where their rotary scaling changes); SHORT: within them
LONG, SHORT = 20, 12

CASES = {
    # Phi-3-mini: a sliding window on every layer, full rotary, untied head
    "phi3": (hf.Phi3ForCausalLM, hf.Phi3Config(
        vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=37, max_position_embeddings=64,
        sliding_window=6, rope_theta=500.0, pad_token_id=0, eos_token_id=0)),
    # Phi-4-mini: LongRoPE trained on 16 positions, 3/4 of each head turned, tied head
    "phi4-mini": (hf.Phi3ForCausalLM, hf.Phi3Config(
        vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, intermediate_size=37, max_position_embeddings=64,
        original_max_position_embeddings=16, partial_rotary_factor=0.75,
        tie_word_embeddings=True, pad_token_id=0, eos_token_id=0,
        rope_scaling={"rope_type": "longrope", "short_factor": [1.0, 1.3, 1.9, 2.5, 3.0, 4.0],
                      "long_factor": [2.0, 5.0, 9.0, 17.0, 30.0, 64.0]})),
    "olmo2": (hf.Olmo2ForCausalLM, hf.Olmo2Config(
        vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=37, max_position_embeddings=64,
        rope_theta=500.0, pad_token_id=0, eos_token_id=0)),
    "olmo2-linear": (hf.Olmo2ForCausalLM, hf.Olmo2Config(
        vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=37, max_position_embeddings=64, tie_word_embeddings=True,
        rope_scaling={"rope_type": "linear", "factor": 2.0}, pad_token_id=0, eos_token_id=0)),
    # Pythia: parallel attention and MLP, half of each head turned
    "pythia": (hf.GPTNeoXForCausalLM, hf.GPTNeoXConfig(
        vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=37, max_position_embeddings=64, rotary_pct=0.5,
        rotary_emb_base=500, eos_token_id=0)),
    # sequential blocks, and dynamic NTK scaling past 16 positions
    "neox-sequential": (hf.GPTNeoXForCausalLM, hf.GPTNeoXConfig(
        vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=37, max_position_embeddings=16, use_parallel_residual=False,
        rotary_pct=0.5,
        hidden_act="gelu_pytorch_tanh", tie_word_embeddings=True, eos_token_id=0,
        rope_scaling={"rope_type": "dynamic", "factor": 2.0})),
}  # fmt: skip
FAMILY = {"phi3": phi3.FAMILY, "olmo2": olmo2.FAMILY, "gpt_neox": neox.FAMILY}


def build_tiny(name: str, folder):
    """transformers' random model `name`, with every weight moved off its init (norm gains
    off 1, biases off 0, so a mapping error shows), saved to folder; reloaded as eager."""
    cls, config = CASES[name]
    torch.manual_seed(1)
    model = cls(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(folder)
    return cls.from_pretrained(folder, attn_implementation="eager").eval()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """name -> (folder, transformers' model), each built once for the module."""
    made = {}

    def get(name):
        if name not in made:
            folder = tmp_path_factory.mktemp(name)
            made[name] = folder, build_tiny(name, folder)
        return made[name]

    return get


def ids_of(length: int, batch: int = 2) -> torch.Tensor:
    return torch.randint(1, 99, (batch, length), generator=torch.Generator().manual_seed(length))


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
@pytest.mark.parametrize("name", list(CASES))
def test_logits_match_transformers(name, backend, tiny):
    folder, theirs = tiny(name)
    ours, *_ = load_folder(folder, torch.float32, backend)
    for length in (SHORT, LONG):  # phi4-mini: short factors, then long ones
        ids = ids_of(length)
        with torch.no_grad():
            want = theirs(ids).logits
            got = ours(ids).logits
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_phi4_mini_turns_to_its_long_factors_past_its_trained_context(tiny):
    """Short and long factors give different logits at the same positions, so the logits
    test above tells a model that never switches from one that does."""
    folder, _ = tiny("phi4-mini")
    ours, _, config, _ = load_folder(folder, torch.float32, "eager")
    scaling = config.rope_scaling
    assert (scaling.kind, scaling.original_max_positions) == ("longrope", 16)
    ids = ids_of(LONG)
    with torch.no_grad():
        short = ours(ids[:, :SHORT]).logits
        long = ours(ids).logits[:, :SHORT]
    assert (short - long).abs().max() > 1e-3


def test_phi4_mini_decoding_through_the_switch_matches_transformers_decoding(tiny):
    """LongRoPE picks its factors by the text's length so far: a token decoded past the
    trained context turns by the long factors, the cached keys before it by the short ones,
    in transformers as in qkv (and unlike one forward pass over the whole text)."""
    folder, theirs = tiny("phi4-mini")
    ours, *_ = load_folder(folder, torch.float32, "eager")
    ids = ids_of(LONG)
    our_cache, their_cache, got, want = ours.new_cache(), hf.DynamicCache(), [], []
    with torch.no_grad():
        for t in range(LONG):
            got.append(ours(ids[:, t : t + 1], cache=our_cache).logits)
            want.append(theirs(ids[:, t : t + 1], cache=their_cache, use_cache=True).logits)
    torch.testing.assert_close(torch.cat(got, 1), torch.cat(want, 1), atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", list(CASES))
def test_a_left_padded_batch_equals_each_row_alone(name, tiny):
    folder, _ = tiny(name)
    ours, *_ = load_folder(folder, torch.float32, "eager")
    ids = ids_of(SHORT)  # within phi4-mini's trained context: both rows use short factors
    mask = torch.ones_like(ids)
    mask[1, :4] = 0  # row 1 is 8 real tokens, left-padded
    with torch.no_grad():
        batch = ours(ids, attention_mask=mask).logits
        for row, start in ((0, 0), (1, 4)):
            alone = ours(ids[row : row + 1, start:]).logits[0]
            torch.testing.assert_close(batch[row, start:], alone, atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", list(CASES))
def test_cached_decoding_token_by_token_equals_the_full_forward(name, tiny):
    folder, _ = tiny(name)
    ours, *_ = load_folder(folder, torch.float32, "eager")
    ids = ids_of(SHORT)  # past phi3's window of 6: the cache must hide the keys it slid past
    cache = ours.new_cache()
    with torch.no_grad():
        full = ours(ids).logits
        steps = [ours(ids[:, t : t + 1], cache=cache).logits for t in range(SHORT)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", list(CASES))
def test_attention_weights_and_the_articles_steps_are_the_models_own(name, tiny):
    folder, theirs = tiny(name)
    ours, *_ = load_folder(folder, torch.float32, "sdpa")  # the record is exact whatever ran
    ids = ids_of(LONG)
    with torch.no_grad():
        want = theirs(ids, output_attentions=True).attentions
        out = ours(ids, layers=[0, 1])
    for layer in (0, 1):
        record = out.records[layer]
        torch.testing.assert_close(record.weights(), want[layer], atol=1e-6, rtol=0)
        for head, query in ((0, LONG - 1), (1, 7)):
            steps = record.steps(head, query)
            torch.testing.assert_close(
                steps.contextualized.to(record.out.dtype), record.out[0, head, query],
                atol=1e-6, rtol=0,
            )  # fmt: skip


@pytest.mark.parametrize("name", list(CASES))
def test_export_loads_in_transformers_with_equal_logits(name, tiny, tmp_path):
    folder, theirs = tiny(name)
    ours, family, config, _ = load_folder(folder, torch.float32, "eager")
    save_file(export(ours, family, config), tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps(family.hf_config(config)))
    exported = CASES[name][0].from_pretrained(tmp_path, attn_implementation="eager").eval()
    ids = ids_of(LONG)
    with torch.no_grad():
        torch.testing.assert_close(exported(ids).logits, theirs(ids).logits, atol=1e-5, rtol=0)


def test_a_pythia_folder_with_its_buffers_loads(tiny, tmp_path):
    """Pythia's files hold the causal-mask buffers and rotary frequencies of older
    transformers, and the head under embed_out: read past, and read."""
    folder, theirs = tiny("pythia")
    tensors = read_checkpoint(folder)
    assert "embed_out.weight" in tensors
    for layer in range(2):
        prefix = f"gpt_neox.layers.{layer}.attention."
        tensors[prefix + "bias"] = torch.ones(1, 1, 64, 64, dtype=torch.bool).tril()
        tensors[prefix + "masked_bias"] = torch.tensor(-1e9)
        tensors[prefix + "rotary_emb.inv_freq"] = torch.ones(2)
    save_file(tensors, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    ours, *_ = load_folder(tmp_path, torch.float32, "eager")
    ids = ids_of(LONG)
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, theirs(ids).logits, atol=1e-5, rtol=0)


def test_neox_rows_are_regrouped_by_kind():
    """[h0: q, k, v][h1: q, k, v] -> [q0, q1; k0, k1; v0, v1] and back."""
    rows = torch.arange(6)  # q0 k0 v0 q1 k1 v1, GPT-NeoX's order
    grouped = neox._by_kind(2, rows)
    assert grouped.tolist() == [0, 3, 1, 4, 2, 5]  # q0 q1 k0 k1 v0 v1
    assert neox._by_head(2, grouped).tolist() == rows.tolist()
    matrix = torch.arange(12.0).reshape(6, 2)
    assert torch.equal(neox._by_head(2, neox._by_kind(2, matrix)), matrix)


# ---- config.json both ways ------------------------------------------------------------------


@pytest.mark.parametrize("name", list(CASES))
def test_a_transformers_config_json_round_trips_through_qkv(name):
    """transformers' own config.json -> qkv -> config.json -> qkv: the same model."""
    hf_dict = CASES[name][1].to_dict()
    family = family_for(hf_dict)
    config = family.config(hf_dict)
    assert family.config(family.hf_config(config)) == config


def test_what_each_family_reads_from_its_config():
    phi = phi3.config(CASES["phi4-mini"][1].to_dict())
    assert (phi.rope_dims, phi.tie_embeddings, phi.block.window) == (12, True, None)
    assert phi.rope_scaling.long_factor[-1] == 64.0 and phi.rope_scaling.factor == 4.0
    assert phi3.config(CASES["phi3"][1].to_dict()).block.window == 6
    pythia = neox.config(CASES["pythia"][1].to_dict())
    assert (pythia.rope_dims, pythia.rope_base, pythia.block.parallel) == (4, 500.0, True)
    sequential = neox.config(CASES["neox-sequential"][1].to_dict())
    assert (sequential.rope_dims, sequential.block.parallel) == (4, False)
    assert (sequential.rope_scaling.kind, sequential.rope_scaling.max_positions) == ("dynamic", 16)
    olmo = olmo2.config(CASES["olmo2"][1].to_dict())
    assert (olmo.block.qk_norm, olmo.block.norm_position, olmo.has_final_norm) == (
        "full", "none", True)  # fmt: skip


def test_transformers_4_spellings_read_as_transformers_reads_them():
    """Old config.json files: Phi-3's "su" scaling is longrope, GPT-NeoX's rotary_pct and
    rotary_emb_base sit at the top level, and a GPT-NeoX file without rotary_pct turns a
    quarter of each head (GPTNeoXConfig's default), whatever partial_rotary_factor says."""
    phi = CASES["phi4-mini"][1].to_dict()
    rope = {k: v for k, v in phi.pop("rope_parameters").items()
            if k in ("short_factor", "long_factor")}  # fmt: skip
    old = phi | {"rope_scaling": rope | {"type": "su"}, "partial_rotary_factor": 0.75}
    assert phi3.config(old) == phi3.config(CASES["phi4-mini"][1].to_dict())
    base = {"model_type": "gpt_neox", "vocab_size": 99, "hidden_size": 32,
            "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 37}  # fmt: skip
    pythia = neox.config(base | {"rotary_pct": 0.5, "rotary_emb_base": 500})
    assert (pythia.rope_dims, pythia.rope_base) == (4, 500.0)
    for quiet in ({}, {"partial_rotary_factor": 1.0}):
        fraction = hf.GPTNeoXConfig(**base, **quiet).rope_parameters["partial_rotary_factor"]
        assert neox.config(base | quiet).rope_dims == 8 * fraction  # D = 8


REFUSED_JSON = [
    ("phi3", {"hidden_act": "gelu"}, "Phi-3 checkpoints with hidden_act='gelu' are not supported"),
    ("phi3", {"rope_parameters": {"rope_type": "linear", "factor": 2.0}},
     r"rope_scaling type 'linear' is not Phi-3's \(longrope\)"),
    ("phi4-mini", {"rope_parameters": {"rope_type": "longrope", "short_factor": [1.0],
                                       "long_factor": [1.0]}},
     "short_factor must be a list of 6 numbers"),
    ("olmo2", {"attention_bias": True}, "OLMo 2 checkpoints with attention_bias=True"),
    ("olmo2", {"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.5}},
     "partial_rotary_factor must be 1 in an OLMo 2 checkpoint"),
    ("olmo2", {"hidden_act": "gelu"}, "OLMo 2 checkpoints with hidden_act='gelu'"),
    ("neox-sequential", {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0,
                                             "partial_rotary_factor": 0.25}},
     "rope_scaling dynamic needs more than 2 rotated dimensions"),
    ("pythia", {"attention_bias": False}, "GPT-NeoX checkpoints with attention_bias=False"),
    ("pythia", {"hidden_act": "quick_gelu"}, "activation 'quick_gelu' is not supported"),
    ("pythia", {"use_parallel_residual": "yes"}, "use_parallel_residual must be true or false"),
]  # fmt: skip


@pytest.mark.parametrize("name, change, message", REFUSED_JSON)
def test_a_config_json_qkv_does_not_compute_is_refused_by_name(name, change, message):
    hf_dict = CASES[name][1].to_dict() | change
    with pytest.raises(ValueError, match=message) as error:
        family_for(hf_dict).config(hf_dict)
    assert "\n" not in str(error.value)


def _qkv(name):
    return family_for(CASES[name][1].to_dict()).config(CASES[name][1].to_dict())


REFUSED_QKV = [
    ("phi3", lambda c: replace(c, block=replace(c.block, bias=True)),
     r"a Phi-3 config.json cannot hold this model: block.bias=True \(it has False\)"),
    ("phi3", lambda c: replace(c, layer_types=("full", "sliding")),
     r"layer_types=\('full', 'sliding'\) \(it has None\)"),
    ("olmo2", lambda c: replace(c, block=replace(c.block, qk_norm="head")),
     r"a OLMo 2 config.json cannot hold this model: block.qk_norm='head' \(it has 'full'\)"),
    ("olmo2", lambda c: replace(c, rope_dims=4), r"rope_dims=4 \(it has None\)"),
    ("pythia", lambda c: replace(c, block=replace(c.block, num_kv_heads=2)),
     "GPT-NeoX config.json cannot hold head_dim=8 with num_kv_heads=2"),
    ("pythia", lambda c: replace(c, block=replace(c.block, mlp="swiglu")),
     "a GPT-NeoX config.json cannot hold mlp='swiglu'"),
]  # fmt: skip


@pytest.mark.parametrize("name, change, message", REFUSED_QKV)
def test_a_qkv_config_the_family_cannot_hold_is_refused_by_name(name, change, message):
    config = change(_qkv(name))
    with pytest.raises(ValueError, match=message) as error:
        family_for(CASES[name][1].to_dict()).hf_config(config)
    assert "\n" not in str(error.value)


def test_phi3_refuses_to_write_a_scaling_it_does_not_have():
    config = _qkv("olmo2-linear")
    phi = replace(_qkv("phi3"), rope_scaling=config.rope_scaling)
    with pytest.raises(ValueError, match="a Phi-3 config.json cannot hold rope scaling 'linear'"):
        phi3.hf_config(phi)


def test_every_key_of_the_config_classes_is_read_or_inert():
    common = set(hf.PretrainedConfig().to_dict())
    for family in FAMILY.values():
        (name,) = family.config_classes
        keys = set(getattr(hf, name)().to_dict()) - common - {"model_type"}
        assert keys <= set(family.reads) | set(family.inert), (name, keys - set(family.reads))

"""Qwen3.5, Qwen3.5-MoE and Qwen3-Next: tiny random checkpoints built by `transformers`,
loaded by qkv, exact.

Four tiny models between them hold every choice qkv maps: linear layers (Gated DeltaNet, two
value heads per key head, a key size that is not the value size) beside full layers with an
output gate, QK-norms and a rotary part of each head (half, or transformers' default
quarter); Qwen3.5's separate projections and Qwen3-Next's fused, grouped ones; a dense MLP,
experts on every layer (Qwen3.5-MoE) or on some (Qwen3-Next's mlp_only_layers), with a
sigmoid-gated shared expert; the multimodal Qwen3.5 read as its text model. Texts run past a
chunk of the delta rule (64 tokens) by more than 45 tokens.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
import transformers as hf
from safetensors.torch import save_file

from qkv.generate import Sampling, decode_steps, fast_step_refusal
from qkv.io.checkpoint import export, read_checkpoint
from qkv.io.families import family_for, qwen3_5, qwen3_next
from qkv.io.hf_folder import load_folder
from qkv.models import Decoder
from qkv.nn.delta import MemoryCache

T = 112  # a chunk of 64, then 48 more
SMALL = dict(vocab_size=100, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
             linear_key_head_dim=8, linear_value_head_dim=6, linear_conv_kernel_dim=4,
             max_position_embeddings=256, rms_norm_eps=1e-5,
             layer_types=["linear_attention", "full_attention", "linear_attention",
                          "full_attention"])  # fmt: skip
HALF = {"rope_type": "default", "rope_theta": 1000.0, "partial_rotary_factor": 0.5}
EXPERTS = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
               shared_expert_intermediate_size=24)  # fmt: skip
CASES = {
    "qwen3_5": (hf.Qwen3_5TextConfig, hf.Qwen3_5ForCausalLM,
                SMALL | dict(intermediate_size=48, rope_parameters=HALF)),
    # transformers' default quarter of each head turned; tied embeddings
    "qwen3_5_moe": (hf.Qwen3_5MoeTextConfig, hf.Qwen3_5MoeForCausalLM,
                    SMALL | EXPERTS | dict(tie_word_embeddings=True)),
    # the third layer dense; weights not renormalized
    "qwen3_next": (hf.Qwen3NextConfig, hf.Qwen3NextForCausalLM,
                   SMALL | EXPERTS | dict(intermediate_size=48, mlp_only_layers=[2],
                                          norm_topk_prob=False, rope_parameters=HALF)),
}  # fmt: skip
FAMILIES = {"qwen3_5": qwen3_5.FAMILY, "qwen3_5_moe": qwen3_5.MOE,
            "qwen3_next": qwen3_next.FAMILY}  # fmt: skip
NAMES = list(CASES)
LINEAR, FULL = (0, 2), (1, 3)


def randomized(model):
    """Norms far from their centre (1 + w: w far from 0), biases and A_log far from 0,
    unit-scale products."""
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(0.3 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * 0.4 * p.shape[-1] ** -0.5)
    return model.eval()


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    made = {}

    def folder(name: str):
        if name not in made:
            torch.manual_seed(NAMES.index(name))
            config_class, model_class, settings = CASES[name]
            made[name] = tmp_path_factory.mktemp(name)
            randomized(model_class(config_class(**settings))).save_pretrained(made[name])
        return made[name]

    return folder


def theirs(folder):
    return hf.AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager").eval()


def ours(folder, backend="eager"):
    return load_folder(folder, torch.float32, backend)[0]


def tokens(length: int = T, rows: int = 1) -> torch.Tensor:
    return torch.randint(0, 100, (rows, length), generator=torch.Generator().manual_seed(length))


def close(got, want, atol=1e-4):
    torch.testing.assert_close(got, want, atol=atol, rtol=0)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_logits_equal_transformers(name, backend, folders):
    folder = folders(name)
    assert family_for(json.loads((folder / "config.json").read_text())) is FAMILIES[name]
    ids = tokens(T, 2)
    with torch.no_grad():
        close(ours(folder, backend)(ids).logits, theirs(folder)(ids).logits)


@pytest.mark.parametrize("name", NAMES)
def test_records_hold_output_attentions_and_the_linear_layers_effective_weights(name, folders):
    """A full layer's weights, from the very input transformers' layer reads (its
    hidden_states: float32's rounding through the layers before stays out of it)."""
    folder = folders(name)
    model, ids = ours(folder), tokens()
    with torch.no_grad():
        out = theirs(folder)(ids, output_attentions=True, output_hidden_states=True)
        records = model(ids, layers="all").records
        assert len(out.attentions) == len(FULL)  # the full layers'
        for layer, want in zip(FULL, out.attentions, strict=True):
            resumed = model(ids, resume=(layer, out.hidden_states[layer]), layers=[layer])
            assert resumed.records[layer].linear is None
            close(resumed.records[layer].weights(), want, atol=1e-6)
            close(records[layer].weights(), want, atol=1e-5)  # through the layers before
    for layer in LINEAR:
        record = records[layer]
        assert record.linear is not None and record.weights().shape == (1, 4, T, T)
        close(record.weights().float() @ record.v, record.out, atol=1e-6)
        for head, query in [(0, T - 1), (3, 70), (1, 5)]:
            oracle = record.steps(head, query).weights  # the loop, one write at a time
            close(oracle.float(), record.weights()[0, head, query, : query + 1], atol=1e-6)


@pytest.mark.parametrize("name", NAMES)
def test_a_left_padded_row_equals_the_row_alone(name, folders):
    model, pad = ours(folders(name)), 5
    ids = tokens(T, 2)
    mask = torch.ones(2, T, dtype=torch.long)
    mask[1, :pad] = 0
    with torch.no_grad():
        batch = model(ids, attention_mask=mask).logits
        close(batch[1, pad:], model(ids[1:, pad:]).logits[0], atol=1e-5)
        close(batch[0], model(ids[:1]).logits[0], atol=1e-5)


@pytest.mark.parametrize("name", NAMES)
def test_decoding_token_by_token_equals_the_full_forward(name, folders):
    model = ours(folders(name))
    ids, prompt, pad = tokens(T, 2), 100, 3  # the prompt past a chunk, then token by token
    mask = torch.ones(2, T, dtype=torch.long)
    mask[1, :pad] = 0
    cache = model.new_cache()
    assert [type(c) is MemoryCache for c in cache.layers] == [True, False, True, False]
    with torch.no_grad():
        steps = [model(ids[:, :prompt], attention_mask=mask[:, :prompt], cache=cache).logits]
        for t in range(prompt, T):
            steps.append(model(ids[:, t : t + 1], attention_mask=mask[:, : t + 1],
                               cache=cache).logits)  # fmt: skip
        decoded = torch.cat(steps, 1)
        close(decoded[0], model(ids[:1]).logits[0], atol=1e-5)
        close(decoded[1, pad:], model(ids[1:, pad:]).logits[0], atol=1e-5)
    memory = cache.layers[0]
    assert memory.length == T and memory.state.shape == (2, 4, 8, 6)  # (B, H, Dk, Dv): no T


@pytest.mark.parametrize("name", NAMES)
def test_the_cache_holds_transformers_memory_and_convolution_inputs(name, folders):
    """Per linear layer and sequence, each head's memory (Dk x Dv) and the convolution's last
    inputs: what transformers caches, whatever the text's length (`DeltaConfig.state_bytes`)."""
    folder = folders(name)
    model, ids = ours(folder), tokens()
    cache = model.new_cache()
    with torch.no_grad():
        model(ids, cache=cache)
        want = theirs(folder)(ids, use_cache=True).past_key_values
    delta = model.config.block.linear
    assert delta.state_bytes == 4 * 8 * 6 + (2 * 16 + 24) * 3  # no T in it
    for layer in LINEAR:
        held, their = cache.layers[layer], want.layers[layer]
        assert held.numel() == delta.state_bytes
        close(held.state, their.recurrent_states[0], atol=1e-5)
        close(held.conv, their.conv_states[0][..., -(delta.conv - 1) :], atol=1e-6)


@pytest.mark.parametrize("name", NAMES)
def test_greedy_generation_equals_transformers(name, folders):
    folder = folders(name)
    model, ids = ours(folder), tokens(20)
    assert "GatedDeltaNet" in fast_step_refusal(model, ids.device)  # the plain path decodes
    with torch.no_grad():
        want = theirs(folder).generate(ids, max_new_tokens=10, do_sample=False)[0, 20:]
    got = torch.stack(list(decode_steps(model, ids, None, Sampling(), 10)), 1)[0]
    assert got.tolist() == want.tolist()


def test_a_model_of_full_layers_only_is_refused_by_the_fast_step(folders):
    """Its output gate is what the fast step does not compute."""
    cfg = load_folder(folders("qwen3_5"), torch.float32, "eager")[2]
    model = Decoder(replace(cfg, layer_types=("full",) * 4)).eval()
    assert "output gate" in fast_step_refusal(model, torch.device("cpu"))


@pytest.mark.parametrize("name", NAMES)
def test_an_export_is_the_checkpoint_itself_and_loads_in_transformers(name, folders, tmp_path):
    folder = folders(name)
    model, family, cfg, _ = load_folder(folder, torch.float32, "eager")
    exported = export(model, family, cfg)
    original = read_checkpoint(folder)
    assert exported.keys() == original.keys()  # in_proj_qkvz and q_proj put back together
    for key, tensor in original.items():
        assert torch.equal(exported[key], tensor), key
    save_file(exported, tmp_path / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "config.json").write_text(json.dumps(family.hf_config(cfg)))
    ids = tokens(T, 2)
    with torch.no_grad():
        close(theirs(tmp_path)(ids).logits, model(ids).logits)


@pytest.mark.parametrize("name", NAMES)
def test_a_transformers_config_json_round_trips_through_qkv(name, folders):
    family = FAMILIES[name]
    written = json.loads((folders(name) / "config.json").read_text())
    cfg = family.config(written)
    assert family.config(family.hf_config(cfg)) == cfg
    config_class = CASES[name][0]
    assert family.config(config_class(**CASES[name][2]).to_dict()) == cfg
    default = family.config(config_class().to_dict())
    assert family.config(family.hf_config(default)) == default
    assert default.layer_types == ("linear", "linear", "linear", "full") * (default.num_layers // 4)


@pytest.mark.parametrize("name, wrapper", [("qwen3_5", hf.Qwen3_5Config),
                                           ("qwen3_5_moe", hf.Qwen3_5MoeConfig)])  # fmt: skip
def test_a_multimodal_config_reads_as_its_text_config(name, wrapper):
    config_class, _, settings = CASES[name]
    wrapped = wrapper(text_config=settings, tie_word_embeddings=settings.get(
        "tie_word_embeddings", False)).to_dict()  # fmt: skip
    family = FAMILIES[name]
    assert family_for(wrapped) is family
    assert family.config(wrapped) == family.config(config_class(**settings).to_dict())
    with pytest.raises(ValueError, match="rope_parameters.*belongs in text_config"):
        family.config(wrapped | {"rope_parameters": HALF})


def test_the_multimodal_qwen3_5_is_read_as_its_text_model(tmp_path):
    """Qwen3_5ForConditionalGeneration (the hub's Qwen3.5) on a text: qkv reads its
    text_config and model.language_model's weights, leaves the vision tower, and computes the
    same logits."""
    torch.manual_seed(7)
    _, _, text = CASES["qwen3_5"]
    vision = dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=32)
    model = randomized(hf.Qwen3_5ForConditionalGeneration(
        hf.Qwen3_5Config(text_config=text, vision_config=vision)))  # fmt: skip
    model.save_pretrained(tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["model_type"] == "qwen3_5" and family_for(written) is qwen3_5.FAMILY
    assert any(k.startswith("model.visual.") for k in read_checkpoint(tmp_path))
    ids = tokens(T, 2)
    with torch.no_grad():
        close(ours(tmp_path)(ids).logits, model(input_ids=ids).logits)
    with pytest.raises(ValueError, match="tie_word_embeddings"):
        qwen3_5.config(written | {"tie_word_embeddings": True})
    with pytest.raises(ValueError, match="text_config"):
        qwen3_5.config(written | {"text_config": None})


def with_block(**changes):
    return lambda cfg, state: (replace(cfg, block=replace(cfg.block, **changes)), state)


def with_linear(**changes):
    def change(cfg, state):
        linear = replace(cfg.block.linear, **changes)
        return replace(cfg, block=replace(cfg.block, linear=linear)), state

    return change


def without_shared_gate(cfg, state):
    experts = replace(cfg.block.experts, shared_gate=False)
    return replace(cfg, block=replace(cfg.block, experts=experts)), state


def without_earlier_conv_taps(cfg, state):
    """A convolution one token wide: each channel reads its own token only (the last tap)."""
    state = {k: v[..., -1:] if k.endswith("attn.conv") else v for k, v in state.items()}
    return with_linear(conv=1)(cfg, state)


def without_fade(cfg, state):
    """Every memory kept whole: A = exp(A_log) = 0."""
    fade = {k: torch.full_like(v, -torch.inf) for k, v in state.items() if "fade_log_rate" in k}
    return cfg, state | fade


# (case, what, the change that takes it out)
EXERCISED = [
    ("qwen3_5", "the output gate", with_block(output_gate=False)),
    ("qwen3_5", "a rotary half of each head", lambda c, s: (replace(c, rope_dims=None), s)),
    ("qwen3_5", "norms scaled by 1 + weight", with_block(norm="rmsnorm")),
    ("qwen3_5", "the linear layers' convolution", without_earlier_conv_taps),
    ("qwen3_5", "the fade", without_fade),
    ("qwen3_5_moe", "a rotary quarter of each head", lambda c, s: (replace(c, rope_dims=None), s)),
    ("qwen3_5_moe", "the shared expert's gate", without_shared_gate),
    ("qwen3_next", "the fade", without_fade),
    ("qwen3_next", "the shared expert's gate", without_shared_gate),
    ("qwen3_next", "the dense third layer", lambda c, s: (replace(c, moe_layers=None), s)),
]  # fmt: skip


@pytest.mark.parametrize("name, what, without", EXERCISED,
                         ids=[f"{n}-{w}" for n, w, _ in EXERCISED])  # fmt: skip
def test_the_tiny_models_exercise_what_they_map(name, what, without, folders):
    """Each choice changes these logits: a mapping that dropped one would fail above."""
    model, _, cfg, _ = load_folder(folders(name), torch.float32, "eager")
    other_cfg, state = without(cfg, model.state_dict())
    other = Decoder(other_cfg).eval()
    missing, extra = other.load_state_dict(state, strict=False)
    if what == "the dense third layer":  # layer 2's experts are new; its dense MLP unused
        missing = [k for k in missing if not k.startswith("blocks.2.mlp.")]
        extra = [k for k in extra if not k.startswith("blocks.2.mlp.")]
    assert not missing and all("gate" in key for key in extra), (missing, extra)
    ids = tokens()
    with torch.no_grad():
        assert (other(ids).logits - model(ids).logits).abs().max() > 1e-3, what


REFUSED = {
    "hidden_act": "gelu",
    "attention_bias": True,
    "layer_types": ["linear_attention", "sliding_attention"] * 2,
    "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0},
    "linear_num_key_heads": 3,  # does not divide 4 value heads
    "num_experts_per_tok": 5,  # more than the 4 experts
    "partial_rotary_factor": 0.1,  # 0.1 of 8 dimensions turns none
}


# a dense family has no experts to choose from
REFUSALS = [(n, k) for n in NAMES for k in REFUSED if (n, k) != ("qwen3_5", "num_experts_per_tok")]


@pytest.mark.parametrize("name, key", REFUSALS)
def test_a_setting_qkv_does_not_compute_is_refused_by_name(name, key):
    config_class, _, settings = CASES[name]
    given = config_class(**settings).to_dict() | {key: REFUSED[key]}
    if key == "partial_rotary_factor":  # as a file that writes it at the top level
        given["rope_parameters"] = {"rope_type": "default", "rope_theta": 1e4}
    with pytest.raises(ValueError, match=key if key != "layer_types" else "sliding_attention"):
        FAMILIES[name].config(given)


def test_a_model_the_config_json_cannot_hold_is_refused_by_name(folders):
    cfg = qwen3_5.config(json.loads((folders("qwen3_5").joinpath("config.json")).read_text()))
    with pytest.raises(ValueError, match="block.output_gate"):
        qwen3_5.FAMILY.hf_config(replace(cfg, block=replace(cfg.block, output_gate=False)))
    with pytest.raises(ValueError, match="block.window"):
        qwen3_5.FAMILY.hf_config(replace(cfg, block=replace(cfg.block, window=8)))
    with pytest.raises(ValueError, match="linear or full"):
        qwen3_5.FAMILY.hf_config(replace(cfg, layer_types=None))
    gated = replace(cfg.block.linear, gate="sigmoid")  # Kimi's gate, not Qwen's
    with pytest.raises(ValueError, match="block.linear.gate"):
        qwen3_5.FAMILY.hf_config(replace(cfg, block=replace(cfg.block, linear=gated)))

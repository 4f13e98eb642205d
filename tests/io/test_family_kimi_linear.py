"""Kimi Linear: tiny random checkpoints built by `transformers`, loaded by qkv, exact.

Two tiny models between them hold every Kimi Linear choice qkv maps: KDA layers (a fade per
key channel through a low-rank step with a bias per channel and a rate per head, a sigmoid
write strength and output gate) beside full layers of latent attention without positions,
queries straight and through q_lora_rank, attention biases; experts in groups or not, the
correction bias, weights renormalized or not, one or two shared experts, dense layers first
or between; layer kinds from linear_attn_config (counted from 1) or from layer_types; an
eps of the block norms (and of each KDA head's norm) that is not the latent norms' 1e-6.
Texts are longer than a chunk of the delta rule (64 tokens), so the chunked form runs.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
import transformers as hf
from safetensors.torch import save_file
from tokenizers import Tokenizer as Backend
from tokenizers import models, pre_tokenizers
from transformers.models.kimi_linear import modeling_kimi_linear as theirs_module

import qkv
from qkv.io.checkpoint import export, read_checkpoint
from qkv.io.families import family_for
from qkv.io.families.kimi_linear import FAMILY, config
from qkv.io.hf_folder import load_folder
from qkv.models import Decoder
from qkv.nn.delta import GatedDeltaNet, MemoryCache
from qkv.nn.latent import LatentAttention
from qkv.nn.routing import Routing

T = 110  # past one chunk (64) of the delta rule, and 45 tokens past it
SMALL = dict(vocab_size=100, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
             num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
             num_experts=8, num_experts_per_token=2, routed_scaling_factor=2.5,
             kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=12,
             pad_token_id=0, bos_token_id=1, eos_token_id=2)  # fmt: skip
CASES = {
    # as the hub writes it: layer kinds in linear_attn_config (KDA, MLA, KDA), queries straight
    # from x, a dense first layer; 8 experts in 4 groups, top 2 of the best 2
    "hub": SMALL | dict(q_lora_rank=None, num_expert_group=4, topk_group=2,
                        num_shared_experts=1, first_k_dense_replace=1, moe_renormalize=True,
                        linear_attn_config={"kda_layers": [1, 3], "full_attn_layers": [2],
                                            "head_dim": 8, "num_heads": 4,
                                            "short_conv_kernel_size": 4}),
    # layer_types (MLA first), q_lora_rank, attention biases, no groups, weights not
    # renormalized, two shared experts, the dense layer in the middle, norms' eps 1e-3, a
    # convolution of 3 tokens, KDA heads of 6 channels
    "lora": SMALL | dict(q_lora_rank=16, attention_bias=True, num_expert_group=1, topk_group=1,
                         num_shared_experts=2, moe_renormalize=False, rms_norm_eps=1e-3,
                         layer_types=["full_attention", "linear_attention", "linear_attention"],
                         mlp_layer_types=["sparse", "dense", "sparse"], linear_head_dim=6,
                         linear_num_heads=3, linear_conv_kernel_dim=3),
}  # fmt: skip
NAMES = list(CASES)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    made = {}

    def folder(name: str):
        if name not in made:
            torch.manual_seed(NAMES.index(name))
            model = hf.KimiLinearForCausalLM(hf.KimiLinearConfig(**CASES[name])).eval()
            with torch.no_grad():  # norms far from 1, biases far from 0, unit-scale products
                for key, p in model.named_parameters():
                    if key.endswith("A_log"):  # fade rates exp(A_log) around 1
                        p.copy_(0.5 * torch.randn_like(p))
                    elif p.dim() == 1:
                        p.copy_((key.endswith("weight")) + 0.3 * torch.randn_like(p))
                    else:
                        p.copy_(torch.randn_like(p) * 0.6 * p.shape[-1] ** -0.5)
                for key, b in model.named_buffers():
                    if key.endswith("e_score_correction_bias"):
                        b.copy_(0.2 * torch.randn_like(b))
            made[name] = tmp_path_factory.mktemp(name)
            model.save_pretrained(made[name])
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


def kinds(model: Decoder, kind: type) -> list[int]:
    return [i for i, block in enumerate(model.blocks) if isinstance(block.attn, kind)]


@pytest.fixture(scope="module")
def references(folders):
    """transformers' run of each tiny model on tokens(T, 2), once (its rule is slow): logits,
    the full layers' attentions, each MoE layer's router output, and its cache."""
    made = {}

    def reference(name: str):
        if name not in made:
            model, chosen = theirs(folders(name)), {}
            for i, layer in enumerate(model.model.layers):
                if isinstance(layer.mlp, theirs_module.KimiLinearMoE):
                    layer.mlp.gate.register_forward_hook(
                        lambda _, __, out, i=i: chosen.__setitem__(i, out)
                    )  # fmt: skip
            with torch.no_grad():
                out = model(tokens(T, 2), output_attentions=True, use_cache=True)
            made[name] = out.logits, out.attentions, chosen, out.cache
        return made[name]

    return reference


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_logits_equal_transformers(name, backend, folders, references):
    folder = folders(name)
    model = ours(folder, backend)
    assert family_for(json.loads((folder / "config.json").read_text())) is FAMILY
    assert len(kinds(model, GatedDeltaNet)) == 2 and len(kinds(model, LatentAttention)) == 1
    with torch.no_grad():
        close(model(tokens(T, 2)).logits, references(name)[0])


def test_transformers_in_memory_names_load_too(folders, references, tmp_path):
    """The names of transformers' modules (conv1d, forget_gate, mlp.experts.gate_up_proj),
    as a state dict saved as it is holds them, are read as the hub's."""
    folder = folders("hub")
    state = theirs(folder).state_dict()
    assert "model.layers.0.self_attn.forget_gate.A_log" in state
    save_file(state, tmp_path / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    with torch.no_grad():
        close(ours(tmp_path)(tokens(T, 2)).logits, references("hub")[0])


@pytest.mark.parametrize("name", NAMES)
def test_the_experts_chosen_are_transformers_routers_choice(name, folders, references):
    chosen = references(name)[2]
    with torch.no_grad():
        out = ours(folders(name))(tokens(T, 2), layers="all")
    assert set(out.experts) == set(chosen) and len(chosen) == 2, "one record per MoE layer"
    for layer, (_, weights, experts) in chosen.items():
        record = out.experts[layer]
        mine, order = record.experts.sort(-1)  # (B, T, k), by expert index
        theirs_sorted, their_order = experts.view(mine.shape).sort(-1)
        assert torch.equal(mine, theirs_sorted), f"layer {layer} chose other experts"
        # weights near routed_scaling_factor, from layers below equal within rounding
        close(record.weights.gather(-1, order), weights.view(mine.shape).gather(-1, their_order),
              atol=1e-5)  # fmt: skip


@pytest.mark.parametrize("name", NAMES)
def test_full_layers_weights_equal_transformers_attentions(name, folders, references):
    """With every head's keys and values expanded, and with them absorbed into the queries
    (attention over the latent vectors): the weights are transformers'."""
    model, want = ours(folders(name)), references(name)[1]  # the full layers' only
    full = kinds(model, LatentAttention)
    assert len(want) == len(full) == 1
    for absorb in (False, True):
        for layer in full:
            model.blocks[layer].attn.absorb = absorb
        with torch.no_grad():
            records = model(tokens(T, 2), layers=full).records
        for layer, attentions in zip(full, want, strict=True):
            record = records[layer]
            close(record.weights(), attentions, atol=1e-6)
            for head, query in [(0, T - 1), (3, T // 2)]:
                step = record.steps(head, query)
                close(step.contextualized.float(), record.out[0, head, query], atol=1e-6)


@pytest.mark.parametrize("name", NAMES)
def test_a_kda_layer_computes_what_transformers_does(name, folders, monkeypatch):
    """Given the input transformers' KDA layer reads: the queries and keys (Kimi's l2norm,
    x / sqrt(sum + eps), against qkv's x * rsqrt(sum + eps): equal within rounding), the
    write strengths and per-channel fades its rule reads, the head outputs its gated norm
    reads, and the layer's output, are qkv's."""
    folder = folders(name)
    rule, seen = theirs_module.chunk_kimi_delta_attention, []

    def spied(query, key, value, g, beta, **kwargs):
        seen.append((query, key, g, beta))
        return rule(query, key, value, g, beta, **kwargs)

    monkeypatch.setattr(theirs_module, "chunk_kimi_delta_attention", spied)
    reference, inputs, outputs, normed = theirs(folder), [], [], []
    for layer in reference.model.layers:
        if isinstance(layer.self_attn, theirs_module.KimiLinearDeltaAttention):
            attn = layer.self_attn
            attn.register_forward_pre_hook(lambda _, args, kwargs: inputs.append(
                kwargs["hidden_states"]), with_kwargs=True)  # fmt: skip
            attn.register_forward_hook(lambda _, __, out: outputs.append(out))
            attn.o_norm.register_forward_pre_hook(lambda _, args: normed.append(args[0]))
    model = ours(folder)
    linear = kinds(model, GatedDeltaNet)
    with torch.no_grad():
        reference(tokens())
        assert len(seen) == len(inputs) == len(normed) == len(linear) == 2
        for n, layer in enumerate(linear):
            out, record = model.blocks[layer].attn(inputs[n], record=True)
            query, key, g, beta = seen[n]
            for mine, raw in ((record.q, query), (record.k, key)):
                close(mine, theirs_module.l2norm(raw.float()).transpose(1, 2), atol=1e-6)
            close(record.linear.decay, g.permute(0, 2, 1, 3), atol=1e-6)  # (B, H, T, Dk)
            close(record.linear.beta, beta.transpose(1, 2), atol=1e-6)
            close(record.out, normed[n].transpose(1, 2), atol=1e-6)  # (B, H, T, Dv)
            close(out, outputs[n], atol=1e-5)  # after the norm, gate and out projection


@pytest.mark.parametrize("name", NAMES)
def test_a_kda_layers_effective_weights_rebuild_its_outputs(name, folders):
    """weights() @ v is each head's read of its memory, and each weight is the loop's
    account of that key word's write, faded and partly overwritten, read by the query."""
    model = ours(folders(name))
    linear = kinds(model, GatedDeltaNet)
    with torch.no_grad():
        records = model(tokens(), layers=linear).records
    for layer in linear:
        record = records[layer]
        weights = record.weights()  # (B, H, T, T), signed, not summing to 1
        close(weights @ record.v, record.out, atol=1e-6)
        assert (weights < -1e-3).any() and not torch.allclose(weights.sum(-1), torch.ones(1))
        for head, query in [(0, T - 1), (1, T // 2), (2, 70)]:
            steps = record.steps(head, query)
            close(steps.weights.float(), weights[0, head, query, : query + 1], atol=1e-6)


@pytest.mark.parametrize("name", NAMES)
def test_a_left_padded_row_equals_the_row_alone(name, folders):
    model, pad = ours(folders(name)), 5
    ids = tokens(T, 2)
    mask = torch.ones(2, T, dtype=torch.long)
    mask[1, :pad] = 0
    with torch.no_grad():
        batch = model(ids, attention_mask=mask).logits
        close(batch[1, pad:], model(ids[1:, pad:]).logits[0])
        close(batch[0], model(ids[:1]).logits[0])


@pytest.mark.parametrize("name", NAMES)
def test_decoding_token_by_token_equals_the_full_forward(name, folders):
    """A prompt past one chunk, then ten tokens one at a time: each KDA layer keeps its
    memory and its convolution's last inputs, whatever the length; each full layer its latent
    vectors."""
    model, length = ours(folders(name)), 80
    ids, prompt, pad = tokens(length, 2), 70, 3
    mask = torch.ones(2, length, dtype=torch.long)
    mask[1, :pad] = 0
    cache = model.new_cache()
    with torch.no_grad():
        steps = [model(ids[:, :prompt], attention_mask=mask[:, :prompt], cache=cache).logits]
        for t in range(prompt, length):
            steps.append(model(ids[:, t : t + 1], attention_mask=mask[:, : t + 1],
                               cache=cache).logits)  # fmt: skip
        decoded = torch.cat(steps, 1)
        close(decoded[0], model(ids[:1]).logits[0])
        close(decoded[1, pad:], model(ids[1:, pad:]).logits[0])
    linear = model.config.block.linear
    for layer in kinds(model, GatedDeltaNet):
        held = cache.layers[layer]
        assert isinstance(held, MemoryCache) and held.length == length
        assert held.numel() == 2 * linear.state_bytes  # two rows, whatever the length


@pytest.mark.parametrize("name", NAMES)
def test_the_cache_holds_what_transformers_caches(name, folders, references):
    """A KDA layer: each head's memory (Dk x Dv) and the convolution's last inputs
    (transformers keeps conv tokens, qkv the conv - 1 earlier ones a next token reads); a
    full layer: the normed latent vector and the unturned shared key, per token."""
    model, want = ours(folders(name)), references(name)[3]
    cache = model.new_cache()
    with torch.no_grad():
        model(tokens(T, 2), cache=cache)
    for layer, held in enumerate(cache.layers):
        if isinstance(held, MemoryCache):
            close(held.state, want.get_recurrent_state(layer), atol=1e-5)
            close(held.conv, want.get_conv_state(layer)[..., 1:], atol=1e-5)
        else:
            c, k_pe = held.stored()  # normed: rounding from the layers below, magnified
            close(c, want.layers[layer].keys)
            close(k_pe, want.layers[layer].values)


@pytest.mark.parametrize("name", NAMES)
def test_an_export_is_the_checkpoint_itself_and_loads_in_transformers(name, folders, tmp_path):
    folder = folders(name)
    model, family, cfg, _ = load_folder(folder, torch.float32, "eager")
    exported = export(model, family, cfg)
    original = read_checkpoint(folder)
    assert exported.keys() == original.keys()  # q, k, v and their convolutions apart again
    for key, tensor in original.items():
        assert torch.equal(exported[key], tensor), key
    save_file(exported, tmp_path / "model.safetensors", metadata={"format": "pt"})
    ids_of = {k: 0 for k in ("pad_token_id", "bos_token_id", "eos_token_id")}  # in vocab
    (tmp_path / "config.json").write_text(json.dumps(family.hf_config(cfg) | ids_of))
    ids = tokens(T, 2)
    with torch.no_grad():
        close(theirs(tmp_path)(ids).logits, model(ids).logits)


@pytest.mark.parametrize("name", NAMES)
def test_a_transformers_config_json_round_trips_through_qkv(name, folders):
    written = json.loads((folders(name) / "config.json").read_text())
    cfg = config(written)
    assert config(FAMILY.hf_config(cfg)) == cfg
    assert config(hf.KimiLinearConfig(**CASES[name]).to_dict()) == cfg
    default = config(hf.KimiLinearConfig().to_dict())  # the 48B model's, all 27 layers
    assert config(FAMILY.hf_config(default)) == default


# the hub's Kimi-Linear-48B-A3B config.json (Moonshot's own code), its computing keys
HUB = {
    "architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear",
    "first_k_dense_replace": 1, "head_dim": 72, "hidden_act": "silu", "hidden_size": 2304,
    "intermediate_size": 9216, "kv_lora_rank": 512, "mla_use_nope": True,
    "linear_attn_config": {"full_attn_layers": [4, 8, 12, 16, 20, 24, 27], "head_dim": 128,
                           "kda_layers": [i for i in range(1, 28) if i % 4 and i != 27],
                           "num_heads": 32, "short_conv_kernel_size": 4},
    "model_max_length": 1048576, "moe_intermediate_size": 1024, "moe_layer_freq": 1,
    "moe_renormalize": True, "moe_router_activation_func": "sigmoid", "num_attention_heads": 32,
    "num_expert_group": 1, "num_experts": 256, "num_experts_per_token": 8,
    "num_hidden_layers": 27, "num_key_value_heads": 32, "num_nextn_predict_layers": 0,
    "num_shared_experts": 1, "q_lora_rank": None, "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64, "rms_norm_eps": 1e-05, "rope_theta": 10000.0,
    "routed_scaling_factor": 2.446, "tie_word_embeddings": False, "topk_group": 1,
    "use_grouped_topk": True, "v_head_dim": 128, "vocab_size": 163840,
}  # fmt: skip


def test_the_hubs_config_json_reads_as_transformers_reads_it():
    cfg, reference = config(HUB), hf.KimiLinearConfig.from_dict(HUB)
    types = {"linear_attention": "linear", "full_attention": "full"}
    assert cfg.layer_types == tuple(types[t] for t in reference.layer_types)
    assert cfg.layer_types.count("full") == 7 and cfg.layer_types[26] == "full"
    assert cfg.moe_layers == tuple(t == "sparse" for t in reference.mlp_layer_types)
    linear = cfg.block.linear
    assert (linear.heads, linear.key_size, linear.conv) == (32, 128, 4)
    assert linear.fade == "channel" and linear.gate == "sigmoid"
    assert cfg.block.experts.routing == Routing(
        256, 8, score="sigmoid", correction_bias=True, scaling=2.446, logits_dtype="float32"
    )  # fmt: skip
    assert cfg.position == "none" and cfg.block.latent.qk_head_dim == reference.qk_head_dim
    assert config(FAMILY.hf_config(cfg)) == cfg


def with_routing(**changes):
    def change(cfg):
        experts = cfg.block.experts
        routing = replace(experts.routing, **changes)
        return replace(cfg, block=replace(cfg.block, experts=replace(experts, routing=routing)))

    return change


def with_block(part: str, **changes):
    return lambda cfg: replace(
        cfg, block=replace(cfg.block, **{part: replace(getattr(cfg.block, part), **changes)})
    )


def without_shared(cfg):
    return replace(
        cfg, block=replace(cfg.block, experts=replace(cfg.block.experts, shared_hidden=None))
    )


# (case, what, the config without it, the state keys that then go unused)
EXERCISED = [
    ("hub", "groups", with_routing(groups=1, groups_chosen=1), ""),
    ("hub", "correction bias", with_routing(correction_bias=False), "correction_bias"),
    ("hub", "renormalized weights", with_routing(normalize=False), ""),
    ("hub", "routed_scaling_factor", with_routing(scaling=1.0), ""),
    ("hub", "shared experts", without_shared, "shared"),
    ("hub", "the sigmoid output gate", with_block("linear", gate="silu"), ""),
    ("hub", "no positions in the full layers", lambda cfg: replace(cfg, position="rotary"), ""),
    ("lora", "weights not renormalized", with_routing(normalize=True), ""),
    ("lora", "attention biases", with_block("latent", bias=False), "bias"),
    ("lora", "latent norms' own eps", with_block("latent", norm_eps=1e-3), ""),
    ("lora", "KDA heads' norm eps", with_block("linear", norm_eps=1e-6), ""),
]  # fmt: skip


@pytest.mark.parametrize("name, what, without, unused", EXERCISED,
                         ids=[f"{n}-{w}" for n, w, *_ in EXERCISED])  # fmt: skip
def test_the_tiny_models_exercise_what_they_map(name, what, without, unused, folders):
    """Each choice changes these logits: a mapping that dropped one would fail above."""
    model, _, cfg, _ = load_folder(folders(name), torch.float32, "eager")
    other = Decoder(without(cfg)).eval()
    missing, extra = other.load_state_dict(model.state_dict(), strict=False)
    assert not missing and all(unused and unused in key for key in extra), (missing, extra)
    ids = tokens()
    with torch.no_grad():
        assert (other(ids).logits - model(ids).logits).abs().max() > 1e-3, what


@pytest.mark.parametrize("name", NAMES)
def test_the_fade_differs_channel_by_channel(name, folders):
    """Each KDA head's fade made one per head (its channels' fade weights and biases
    averaged) changes the logits: the per-channel fade is exercised."""
    model, ids = ours(folders(name)), tokens()
    with torch.no_grad():
        before = model(ids).logits
        for layer in kinds(model, GatedDeltaNet):
            attn, D = model.blocks[layer].attn, model.config.block.linear.key_size
            for p in (attn.fade[1].weight, attn.fade_bias):  # rows (H * Dk, ...) per channel
                heads = p.view(-1, D, *p.shape[1:])
                p.copy_(heads.mean(1, keepdim=True).expand_as(heads).reshape(p.shape))
        assert (model(ids).logits - before).abs().max() > 1e-3


REFUSED = {
    "num_key_value_heads": 2,
    "hidden_act": "gelu",
    "moe_router_activation_func": "softmax",
    "moe_layer_freq": 2,
    "mla_use_nope": False,
    "use_grouped_topk": False,  # with 4 groups
    "quantization_config": {"quant_method": "fp8"},
    "num_expert_group": 3,  # does not divide 8 experts
    "topk_group": 5,  # more than num_expert_group
    "num_experts_per_token": 6,  # more than the 4 experts of topk_group=2 groups of 2
    "num_shared_experts": 0,
    "layer_types": ["linear_attention", "sliding_attention", "full_attention"],
    "mlp_layer_types": ["dense", "sparse"],  # one short
    "linear_attn_config": {"kda_layers": [1], "full_attn_layers": [2]},  # layer 3 unnamed
}


@pytest.mark.parametrize("key", REFUSED)
def test_a_setting_qkv_does_not_compute_is_refused_by_name(key):
    given = hf.KimiLinearConfig(**CASES["hub"]).to_dict() | {key: REFUSED[key]}
    if key == "linear_attn_config":
        given.pop("layer_types")  # transformers reads the layers' kinds from layer_types first
    with pytest.raises(ValueError, match=key):
        config(given)


def test_a_model_the_config_json_cannot_hold_is_refused_by_name():
    cfg = config(hf.KimiLinearConfig(**CASES["hub"]).to_dict())
    with pytest.raises(ValueError, match="tie_embeddings"):
        FAMILY.hf_config(replace(cfg, tie_embeddings=True))
    with pytest.raises(ValueError, match=r"block\.linear\.gate='silu'"):
        FAMILY.hf_config(with_block("linear", gate="silu")(cfg))
    with pytest.raises(ValueError, match=r"block\.linear\.fade='head'"):
        FAMILY.hf_config(with_block("linear", fade="head", fade_rank=None)(cfg))
    with pytest.raises(ValueError, match="experts"):
        FAMILY.hf_config(
            with_routing(score="softmax", groups=1, groups_chosen=1, correction_bias=False)(cfg)
        )


WORDS = ["[UNK]", "the", "bank", "of", "river", "was", "wide", "and", "deep"]
WORDS += [f"word{i}" for i in range(len(WORDS), 100)]  # one per id the model can choose
TEXT = "the bank of the river was wide and deep"


def test_inspection_runs_on_a_loaded_folder(folders, tmp_path):
    """qkv.load of a folder; a trace through a full layer, every layer's weights (a KDA
    layer's effective ones), the lens, generation."""
    folder = tmp_path / "model"
    folder.mkdir()
    for path in folders("hub").iterdir():
        (folder / path.name).write_bytes(path.read_bytes())
    backend = Backend(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.save(str(folder / "tokenizer.json"))
    model = qkv.load(folder)
    assert model.family is FAMILY
    traced = qkv.trace(model, TEXT, "river", "bank", layer=1, head=2)
    weights = model.attentions(TEXT).weights  # (L, H, T, T)
    assert float(traced.weight) == pytest.approx(float(weights[1, 2, 4, 1]), abs=1e-6)
    assert torch.allclose(weights[1].sum(-1), torch.ones(1))  # the full layer's softmax
    assert (weights[0] < 0).any()  # a KDA layer's effective weights: signed
    assert qkv.lens(model, TEXT).attribution.remainder == pytest.approx(0, abs=1e-4)
    assert model.generate("the bank of", max_new_tokens=4)

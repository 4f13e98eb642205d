"""DeepSeek-V3: tiny random checkpoints built by `transformers`, loaded by qkv, exact.

Three tiny models between them hold every DeepSeek-V3 choice qkv maps: queries through the
low-rank step (q_lora_rank) and straight (null); rope rows interleaved and in halves; YaRN with
mscale == mscale_all_dim (the whole correction in the softmax scale) and with a cos/sin factor
too, or no scaling; groups of experts, the correction bias, renormalized and scaled weights,
shared experts; dense layers first or none; attention biases, tied embeddings, an eps of the
block norms that is not the latent norms' 1e-6. Texts are longer than YaRN's trained context.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
import torch
import transformers as hf
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer as Backend
from tokenizers import models, pre_tokenizers

import qkv
from qkv.io.checkpoint import export, read_checkpoint
from qkv.io.families import family_for
from qkv.io.families.deepseek import FAMILY, config
from qkv.io.hf_folder import load_folder
from qkv.models import Decoder
from qkv.nn import KVCache, LatentCache
from qkv.nn.latent import softmax_scale
from qkv.nn.routing import Routing

T = 40  # past original_max_position_embeddings (32)
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 1.0,
        "mscale_all_dim": 1.0, "original_max_position_embeddings": 32, "beta_fast": 32,
        "beta_slow": 1}  # fmt: skip
SMALL = dict(vocab_size=100, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
             num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
             n_routed_experts=8, num_experts_per_tok=2, routed_scaling_factor=2.5,
             kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=12,
             max_position_embeddings=128, tie_word_embeddings=False)  # fmt: skip
CASES = {
    # the spec's: a dense layer then two MoE ones; 8 experts in 4 groups, top 2 of the best 2
    "lora": SMALL | dict(q_lora_rank=16, rope_interleave=True, rope_parameters=YARN, n_group=4,
                         topk_group=2, n_shared_experts=2, first_k_dense_replace=1,
                         norm_topk_prob=True),
    # q_proj straight from x, no rope scaling, no groups, weights not renormalized, every
    # layer MoE, biases on q_a/kv_a/o (here kv_a and o), block norms' eps 1e-3
    "q_plain": SMALL | dict(q_lora_rank=None, rope_interleave=True,
                            rope_parameters={"rope_type": "default", "rope_theta": 500.0},
                            n_group=1, topk_group=1, n_shared_experts=1, first_k_dense_replace=0,
                            norm_topk_prob=False, attention_bias=True, rms_norm_eps=1e-3),
    # rope rows in halves; YaRN whose cos and sin carry mscale / mscale_all_dim; two dense
    # layers; tied embeddings
    "halves": SMALL | dict(q_lora_rank=16, rope_interleave=False,
                           rope_parameters=YARN | {"mscale": 0.707}, n_group=2, topk_group=1,
                           n_shared_experts=1, first_k_dense_replace=2, norm_topk_prob=True,
                           attention_bias=True, rms_norm_eps=1e-3, tie_word_embeddings=True),
}  # fmt: skip
NAMES = list(CASES)
WORDS = ["[UNK]", "the", "bank", "of", "river", "was", "wide", "and", "deep"]
WORDS += [f"word{i}" for i in range(len(WORDS), 100)]  # one per id the model can choose
TEXT = "the bank of the river was wide and deep"


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    made = {}

    def folder(name: str):
        if name not in made:
            torch.manual_seed(NAMES.index(name))
            model = hf.DeepseekV3ForCausalLM(hf.DeepseekV3Config(**CASES[name])).eval()
            with torch.no_grad():  # norms far from 1, biases far from 0, unit-scale products
                for key, p in model.named_parameters():
                    if p.dim() == 1:
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


def absorbing(model: Decoder, absorb: bool) -> Decoder:
    """The model with every latent layer attending over its compressed vectors (absorb) or
    over every head's expanded keys and values."""
    for block in model.blocks:
        block.attn.absorb = absorb
    return model


def close(got, want, atol=1e-5):
    torch.testing.assert_close(got, want, atol=atol, rtol=0)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_logits_equal_transformers(name, backend, folders):
    folder = folders(name)
    model = ours(folder, backend)
    assert family_for(json.loads((folder / "config.json").read_text())) is FAMILY
    ids = tokens(T, 2)
    with torch.no_grad():
        close(model(ids).logits, theirs(folder)(ids).logits)


@pytest.mark.parametrize("name", NAMES)
def test_the_experts_chosen_are_transformers_routers_choice(name, folders):
    folder = folders(name)
    reference, chosen = theirs(folder), {}
    for i, layer in enumerate(reference.model.layers):
        if isinstance(layer.mlp, hf.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3MoE):
            layer.mlp.gate.register_forward_hook(lambda _, __, out, i=i: chosen.__setitem__(i, out))
    ids = tokens()
    with torch.no_grad():
        reference(ids)
        out = ours(folder)(ids, layers="all")
    assert set(out.experts) == set(chosen) and chosen, "one record per MoE layer"
    for layer, (_, weights, experts) in chosen.items():
        record = out.experts[layer]
        mine, order = record.experts[0].sort(-1)  # (T, k), by expert index
        theirs_sorted, their_order = experts.sort(-1)
        assert torch.equal(mine, theirs_sorted), f"layer {layer} chose other experts"
        close(record.weights[0].gather(-1, order), weights.gather(-1, their_order), atol=1e-6)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("absorb", [False, True])
def test_records_hold_transformers_weights_and_trace_each_head(name, absorb, folders):
    folder = folders(name)
    model = absorbing(ours(folder), absorb)
    ids = tokens()
    with torch.no_grad():
        want = theirs(folder)(ids, output_attentions=True).attentions
        records = model(ids, layers="all").records
    for layer, record in records.items():
        close(record.weights(), want[layer], atol=1e-6)
        assert record.k.shape[1] == (1 if absorb else 4), "absorbed: one latent key head"
        for head, query in [(0, T - 1), (3, T // 2)]:
            step = record.steps(head, query)
            close(step.contextualized.float(), record.out[0, head, query], atol=1e-6)


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
@pytest.mark.parametrize("absorb", [False, True])
def test_decoding_token_by_token_equals_the_full_forward(name, absorb, folders):
    model = absorbing(ours(folders(name)), absorb)
    ids, prompt, pad = tokens(T, 2), 6, 3
    mask = torch.ones(2, T, dtype=torch.long)
    mask[1, :pad] = 0
    cache = model.new_cache()
    with torch.no_grad():
        steps = [model(ids[:, :prompt], attention_mask=mask[:, :prompt], cache=cache).logits]
        for t in range(prompt, T):
            steps.append(model(ids[:, t : t + 1], attention_mask=mask[:, : t + 1],
                               cache=cache).logits)  # fmt: skip
        decoded = torch.cat(steps, 1)
        close(decoded[0], model(ids[:1]).logits[0])
        close(decoded[1, pad:], model(ids[1:, pad:]).logits[0])


@pytest.mark.parametrize("name", NAMES)
def test_the_cache_holds_transformers_compressed_vectors(name, folders):
    """Per token and layer, c (kv_lora_rank) and the turned k_pe (qk_rope_head_dim) only:
    the very vectors transformers caches."""
    folder = folders(name)
    model, ids = ours(folder), tokens()
    cache = model.new_cache()
    with torch.no_grad():
        model(ids, cache=cache)
        want = theirs(folder)(ids, use_cache=True).past_key_values
    latent = model.config.block.latent
    assert (latent.kv_lora_rank, latent.qk_rope_head_dim) == (16, 4)
    for layer, held in enumerate(cache.layers):
        assert isinstance(held, LatentCache) and held.length == T
        assert held.bytes_per_token() == (16 + 4) * 4 == latent.cache_bytes_per_token(torch.float32)
        assert held.bytes_per_token() < latent.expanded_bytes_per_token(torch.float32)
        c, k_pe = held.stored()
        close(c, want.layers[layer].keys)
        close(k_pe, want.layers[layer].values)


@pytest.mark.parametrize("absorb", [False, True])
def test_a_cache_made_of_an_earlier_runs_records_serves(absorb, folders):
    """As inspect's resumed runs make it: KVCache.holding(record.k, record.v) of the first
    tokens, then the rest of the text, equals the whole text at once."""
    model, ids, start = absorbing(ours(folders("lora")), absorb), tokens(), 11
    with torch.no_grad():
        full = model(ids, layers="all")
        cache = model.new_cache()
        for n, record in full.records.items():
            cache.layers[n] = KVCache.holding(record.k[:, :, :start], record.v[:, :, :start])
        rest = model(ids[:, start:], cache=cache).logits
    close(rest, full.logits[:, start:])


@pytest.mark.parametrize("name", NAMES)
def test_an_export_is_the_checkpoint_itself_and_loads_in_transformers(name, folders, tmp_path):
    folder = folders(name)
    model, family, cfg, _ = load_folder(folder, torch.float32, "eager")
    exported = export(model, family, cfg)
    original = read_checkpoint(folder)
    assert exported.keys() == original.keys()  # one tensor per expert, as the hub keeps them
    for key, tensor in original.items():  # the rope rows put back in their pairs, exactly
        assert torch.equal(exported[key], tensor), key
    save_file(exported, tmp_path / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "config.json").write_text(json.dumps(family.hf_config(cfg)))
    ids = tokens(T, 2)
    with torch.no_grad():
        close(theirs(tmp_path)(ids).logits, model(ids).logits)


@pytest.mark.parametrize("name", NAMES)
def test_a_transformers_config_json_round_trips_through_qkv(name, folders):
    written = json.loads((folders(name) / "config.json").read_text())
    cfg = config(written)
    assert config(FAMILY.hf_config(cfg)) == cfg
    assert config(hf.DeepseekV3Config(**CASES[name]).to_dict()) == cfg
    default = config(hf.DeepseekV3Config().to_dict())  # the 671B model's, all 61 layers
    assert config(FAMILY.hf_config(default)) == default
    assert default.moe_layers == (False,) * 3 + (True,) * 58


# the hub's DeepSeek-V3 config.json (DeepSeek's own code; transformers 4 spelling), less its
# FP8 quantization_config
HUB = {
    "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": False, "aux_loss_alpha": 0.001,
    "bos_token_id": 0, "eos_token_id": 1, "ep_size": 1, "first_k_dense_replace": 3,
    "hidden_act": "silu", "hidden_size": 7168, "initializer_range": 0.02,
    "intermediate_size": 18432, "kv_lora_rank": 512, "max_position_embeddings": 163840,
    "model_type": "deepseek_v3", "moe_intermediate_size": 2048, "moe_layer_freq": 1,
    "n_group": 8, "n_routed_experts": 256, "n_shared_experts": 1, "norm_topk_prob": True,
    "num_attention_heads": 128, "num_experts_per_tok": 8, "num_hidden_layers": 61,
    "num_key_value_heads": 128, "num_nextn_predict_layers": 1, "q_lora_rank": 1536,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                     "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                     "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid",
    "seq_aux": True, "tie_word_embeddings": False, "topk_group": 4, "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16", "use_cache": True, "v_head_dim": 128, "vocab_size": 129280,
}  # fmt: skip


def test_the_hubs_config_json_reads_as_transformers_reads_it():
    cfg = config(HUB)
    theirs = hf.DeepseekV3Config.from_dict(HUB)
    with torch.device("meta"):  # the layer's scale, without its 187M weights
        attention = hf.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3Attention(theirs, 0)
    mscale = 0.1 * math.log(40) + 1  # YaRN's, squared into the softmax scale
    assert softmax_scale(192, cfg.rope_scaling) == attention.scaling == 192**-0.5 * mscale**2
    assert cfg.block.experts.routing == Routing(
        256, 8, score="sigmoid", groups=8, groups_chosen=4, correction_bias=True, scaling=2.5,
        logits_dtype="float32",
    )  # fmt: skip
    assert cfg.moe_layers == (False,) * 3 + (True,) * 58 and cfg.block.latent.rope_interleave
    fp8 = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
    with pytest.raises(ValueError, match="quantization_config.*dequantize"):
        config(HUB | {"quantization_config": fp8})


def without_routing(**changes):
    def change(cfg):
        experts = cfg.block.experts
        routing = replace(experts.routing, **changes)
        return replace(cfg, block=replace(cfg.block, experts=replace(experts, routing=routing)))

    return change


def with_latent(**changes):
    return lambda cfg: replace(
        cfg, block=replace(cfg.block, latent=replace(cfg.block.latent, **changes))
    )


def without_shared(cfg):
    return replace(
        cfg, block=replace(cfg.block, experts=replace(cfg.block.experts, shared_hidden=None))
    )


def with_rope(**changes):
    return lambda cfg: replace(cfg, rope_scaling=replace(cfg.rope_scaling, **changes))


# (case, what, the config without it, the state keys that then go unused)
EXERCISED = [
    ("lora", "yarn", lambda cfg: replace(cfg, rope_scaling=None), ""),
    ("lora", "mscale**2 in the softmax scale", with_latent(scale=12**-0.5), ""),
    ("lora", "groups", without_routing(groups=1, groups_chosen=1), ""),
    ("lora", "correction bias", without_routing(correction_bias=False), "correction_bias"),
    ("lora", "renormalized weights", without_routing(normalize=False), ""),
    ("lora", "routed_scaling_factor", without_routing(scaling=1.0), ""),
    ("lora", "shared experts", without_shared, "shared"),
    ("q_plain", "weights not renormalized", without_routing(normalize=True), ""),
    ("q_plain", "attention biases", with_latent(bias=False), "bias"),
    ("q_plain", "latent norms' own eps", with_latent(norm_eps=1e-3), ""),
    ("halves", "yarn's cos/sin factor", with_rope(mscale=None), ""),
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


@pytest.mark.parametrize("name", ["lora", "q_plain"])
def test_interleaved_rope_rows_are_reordered(name, folders, tmp_path):
    """Read as if the checkpoint's rope rows were in halves, the model is another one."""
    folder = folders(name)
    written = json.loads((folder / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(written | {"rope_interleave": False}))
    (tmp_path / "model.safetensors").symlink_to(folder / "model.safetensors")
    ids = tokens()
    with torch.no_grad():
        assert (ours(tmp_path)(ids).logits - ours(folder)(ids).logits).abs().max() > 1e-3


def test_a_missing_expert_tensor_is_named(folders, tmp_path):
    folder = folders("lora")
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.2.mlp.experts.5.up_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    with pytest.raises(ValueError, match=r"model\.layers\.2\.mlp\.experts\.5\.up_proj.*gate_up"):
        ours(tmp_path)


REFUSED = {
    "num_key_value_heads": 2,
    "head_dim": 8,
    "partial_rotary_factor": 0.5,
    "hidden_act": "gelu",
    "scoring_func": "softmax",
    "topk_method": "greedy",
    "moe_layer_freq": 2,
    "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]},
    "n_group": 3,  # does not divide 8 experts
    "topk_group": 5,  # more than n_group
    "num_experts_per_tok": 6,  # more than the 4 experts of topk_group=2 groups of 2
    "n_shared_experts": 0,
    "v_head_dim": None,
}


@pytest.mark.parametrize("key", REFUSED)
def test_a_setting_qkv_does_not_compute_is_refused_by_name(key):
    given = hf.DeepseekV3Config(**CASES["lora"]).to_dict() | {key: REFUSED[key]}
    with pytest.raises(ValueError, match=key):
        config(given)


def test_a_model_the_config_json_cannot_hold_is_refused_by_name():
    cfg = config(hf.DeepseekV3Config(**CASES["lora"]).to_dict())
    with pytest.raises(ValueError, match="moe_layers"):
        FAMILY.hf_config(replace(cfg, moe_layers=(True, False, True)))
    with pytest.raises(ValueError, match="experts"):
        FAMILY.hf_config(
            without_routing(score="softmax", groups=1, groups_chosen=1, correction_bias=False)(cfg)
        )
    with pytest.raises(ValueError, match=r"block\.latent\.scale"):
        FAMILY.hf_config(with_latent(scale=0.5)(cfg))


def test_inspection_runs_on_a_loaded_folder(folders, tmp_path):
    """qkv.load of a folder, and what reads records: a trace, hiding a word (runs resumed
    from a cache of records), ablating heads by their mean output, the lens, generation."""
    folder = tmp_path / "model"
    folder.mkdir()
    for path in folders("lora").iterdir():
        (folder / path.name).write_bytes(path.read_bytes())
    backend = Backend(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.save(str(folder / "tokenizer.json"))
    model = qkv.load(folder)
    assert model.family is FAMILY
    traced = qkv.trace(model, TEXT, "river", "bank", layer=1, head=2)
    weights = model.attentions(TEXT).weights  # (L, H, T, T)
    assert float(traced.weight) == pytest.approx(float(weights[1, 2, 4, 1]), abs=1e-6)
    hidden = qkv.hide(model, TEXT, "bank", query="river")
    assert hidden.effect.isfinite().all() and (hidden.effect > 0).all()
    ablated = qkv.ablate(model, TEXT, [(1, 0), (2, 3)], mode="mean")
    assert ablated.effect[1, 0] > 0 and ablated.effect[2, 3] > 0
    assert qkv.lens(model, TEXT).attribution.remainder == pytest.approx(0, abs=1e-4)
    assert model.generate("the bank of", max_new_tokens=4, record="all").text

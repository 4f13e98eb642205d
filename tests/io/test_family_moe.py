"""Mixtral and Qwen3-MoE: tiny random checkpoints built by `transformers`, loaded by qkv, equal
to transformers' eager model in logits, attention weights, padding, cached decoding, the
experts each token goes to, and export; a checkpoint's per-expert tensors stacked into qkv's
experts and split back (`Weight.parts`).

The tiny models exercise what they map: texts of 14 tokens past a window of 4; Qwen3-MoE's
layers dense by decoder_sparse_step (0, 2) and by mlp_only_layers (3) around an MoE layer
(1); its top-k weights renormalized in one model and not in the other.
"""

from __future__ import annotations

import json
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
from qkv.io.families.moe import MIXTRAL, QWEN3_MOE
from qkv.io.hf_folder import load_folder

WINDOW, T = 4, 14  # the texts run past three windows
SHARED = dict(vocab_size=100, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=64, rope_parameters={"rope_type": "default",
                                                           "rope_theta": 1e6})  # fmt: skip
TINY = {
    "mixtral": (hf.MixtralForCausalLM, hf.MixtralConfig(
        **SHARED, intermediate_size=48, num_hidden_layers=2, num_local_experts=4,
        num_experts_per_tok=2, sliding_window=WINDOW, rms_norm_eps=1e-5)),
    # heads 16 wide (not 32 / 4), no window, three experts, tied embeddings
    "mixtral-heads": (hf.MixtralForCausalLM, hf.MixtralConfig(
        **SHARED, intermediate_size=40, num_hidden_layers=2, head_dim=16, num_local_experts=3,
        num_experts_per_tok=2, tie_word_embeddings=True)),
    # layers 0 and 2 dense by the step, 3 by mlp_only_layers, 1 a mixture of experts
    "qwen3_moe": (hf.Qwen3MoeForCausalLM, hf.Qwen3MoeConfig(
        **SHARED, intermediate_size=64, moe_intermediate_size=24, num_hidden_layers=4,
        head_dim=16, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
        decoder_sparse_step=2, mlp_only_layers=[3], use_sliding_window=True,
        sliding_window=WINDOW)),
    # every layer experts, weights not renormalized, no window, tied embeddings
    "qwen3_moe-plain": (hf.Qwen3MoeForCausalLM, hf.Qwen3MoeConfig(
        **SHARED, intermediate_size=64, moe_intermediate_size=24, num_hidden_layers=2,
        num_experts=4, num_experts_per_tok=2, norm_topk_prob=False, tie_word_embeddings=True)),
}  # fmt: skip
FAMILY = {"mixtral": MIXTRAL, "mixtral-heads": MIXTRAL, "qwen3_moe": QWEN3_MOE,
          "qwen3_moe-plain": QWEN3_MOE}  # fmt: skip
MOE_LAYERS = {"mixtral": [0, 1], "mixtral-heads": [0, 1], "qwen3_moe": [1],
              "qwen3_moe-plain": [0, 1]}  # fmt: skip
WORDS = ["[UNK]", "the", "bank", "of", "river", "was", "wide", "and", "deep"]
TEXT = "the bank of the river was wide and deep and the river was wide"


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """name -> (folder of a tiny random checkpoint, transformers' eager model of it)."""
    made = {}
    for name, (cls, config) in TINY.items():
        torch.manual_seed(3)
        model = cls(config).eval()
        with torch.no_grad():  # norm gains far from 1; routers decisive
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.2)
        folder = tmp_path_factory.mktemp(name)
        model.save_pretrained(folder)
        made[name] = folder, cls.from_pretrained(folder, attn_implementation="eager").eval()
    return made


def ours(folder, backend="eager", dtype=torch.float32):
    return load_folder(folder, dtype, backend)


def ids_of(batch: int, length: int = T) -> torch.Tensor:
    return torch.randint(0, 100, (batch, length), generator=torch.Generator().manual_seed(batch))


@pytest.mark.parametrize("name", list(TINY))
@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_logits_equal_transformers(name, backend, folders):
    folder, theirs = folders[name]
    model, family, *_ = ours(folder, backend)
    assert family is FAMILY[name]
    ids = ids_of(2)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, theirs(ids).logits, atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", list(TINY))
def test_each_token_goes_to_the_experts_transformers_router_chooses(name, folders):
    """The router's choice, weights and logits, read from a hook on transformers' gate."""
    folder, theirs = folders[name]
    model, *_ = ours(folder)
    seen = {}
    gates = {n: theirs.model.layers[n].mlp.gate for n in MOE_LAYERS[name]}
    hooks = [gate.register_forward_hook(lambda module, args, out, n=n: seen.__setitem__(n, out))
             for n, gate in gates.items()]  # fmt: skip
    ids = ids_of(2)
    try:
        with torch.no_grad():
            theirs(ids)
            got = model(ids, layers="all").experts
    finally:
        for hook in hooks:
            hook.remove()
    assert sorted(got) == MOE_LAYERS[name]  # the dense layers keep no record
    for n, (logits, weights, experts) in seen.items():
        record = got[n]
        assert torch.equal(record.experts.reshape(-1, 2), experts)
        torch.testing.assert_close(record.weights.reshape(-1, 2), weights, atol=1e-6, rtol=0)
        torch.testing.assert_close(record.logits.reshape(logits.shape), logits, atol=1e-5,
                                   rtol=0)  # fmt: skip
    assert len(torch.unique(got[MOE_LAYERS[name][0]].experts)) > 1  # not one expert for all


@pytest.mark.parametrize("name", list(TINY))
def test_routers_round_their_weights_as_transformers_does(name, folders):
    """In bfloat16 Qwen3-MoE rounds its weights to the hidden dtype, Mixtral keeps float32."""
    folder, _ = folders[name]
    model, *_ = ours(folder, dtype=torch.bfloat16)
    theirs = TINY[name][0].from_pretrained(folder, dtype=torch.bfloat16).eval()
    layer = MOE_LAYERS[name][0]
    x = torch.randn(T, 32, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    with torch.no_grad():
        _, _, experts, weights = model.blocks[layer].mlp.router(x)
        _, want_weights, want_experts = theirs.model.layers[layer].mlp.gate(x)
    assert weights.dtype == want_weights.dtype
    assert weights.dtype == (torch.float32 if name.startswith("mixtral") else torch.bfloat16)
    assert torch.equal(experts, want_experts) and torch.equal(weights, want_weights)


def _block(config, **changes):
    return replace(config, block=replace(config.block, **changes))


def _routing(config, **changes):
    experts = config.block.experts
    return _block(config, experts=replace(experts, routing=replace(experts.routing, **changes)))


EXERCISED = [
    ("mixtral", "window", lambda c: _block(c, window=None)),
    ("mixtral", "renormalized weights", lambda c: _routing(c, normalize=False)),
    ("mixtral", "top k", lambda c: _routing(c, top_k=1)),
    ("mixtral", "rotary base", lambda c: replace(c, rope_base=10000.0)),
    ("mixtral-heads", "renormalized weights", lambda c: _routing(c, normalize=False)),
    ("qwen3_moe", "window", lambda c: _block(c, window=None)),
    ("qwen3_moe", "norm_topk_prob", lambda c: _routing(c, normalize=False)),
    ("qwen3_moe-plain", "norm_topk_prob", lambda c: _routing(c, normalize=True)),
    ("qwen3_moe-plain", "top k", lambda c: _routing(c, top_k=3)),
]


@pytest.mark.parametrize("name, what, without", EXERCISED,
                         ids=[f"{n}-{w}" for n, w, _ in EXERCISED])  # fmt: skip
def test_the_tiny_models_exercise_what_they_map(name, what, without, folders):
    model, _, config, _ = ours(folders[name][0])
    other = type(model)(without(config)).eval()
    other.load_state_dict(model.state_dict())
    ids = ids_of(1)
    with torch.no_grad():
        assert (other(ids).logits - model(ids).logits).abs().max() > 1e-2, what


@pytest.mark.parametrize("change", [{"mlp_only_layers": []}, {"decoder_sparse_step": 1},
                                    {"mlp_only_layers": [1, 3]}])  # fmt: skip
def test_qwen3_moes_dense_layers_are_where_its_checkpoint_has_them(change, folders, tmp_path):
    """Read with another layer plan, the checkpoint's tensors do not fit: the plan is read."""
    folder, _ = folders["qwen3_moe"]
    written = json.loads((folder / "config.json").read_text()) | change
    (tmp_path / "config.json").write_text(json.dumps(written))
    save_file(read_checkpoint(folder), tmp_path / "model.safetensors", {"format": "pt"})
    with pytest.raises(ValueError, match="the checkpoint has no model.layers"):
        ours(tmp_path)


@pytest.mark.parametrize("name", list(TINY))
def test_a_left_padded_row_equals_the_row_alone(name, folders):
    model, *_ = ours(folders[name][0])
    ids, pad = ids_of(2), 5
    mask = torch.ones(2, T, dtype=torch.long)
    mask[1, :pad] = 0
    with torch.no_grad():
        together = model(ids, attention_mask=mask).logits
        torch.testing.assert_close(together[0], model(ids[:1]).logits[0], atol=1e-5, rtol=0)
        alone = model(ids[1:, pad:]).logits[0]
        torch.testing.assert_close(together[1, pad:], alone, atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", list(TINY))
def test_cached_decoding_token_by_token_equals_the_full_forward(name, folders):
    """A left-padded batch, as generation runs it: a prompt, then one token at a time."""
    model, *_ = ours(folders[name][0])
    ids, prompt = ids_of(2), 4
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
    torch.testing.assert_close(got[0], full[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(got[1, 3:], full[1, 3:], atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", list(TINY))
def test_records_hold_transformers_weights_and_trace_each_head_exactly(name, folders):
    folder, theirs = folders[name]
    model, _, config, _ = ours(folder)
    ids, layers = ids_of(2), list(range(config.num_layers))
    with torch.no_grad():
        want = theirs(ids, output_attentions=True).attentions
        records = model(ids, layers=layers).records
    for layer in layers:
        record = records[layer]
        torch.testing.assert_close(record.weights(), want[layer], atol=1e-6, rtol=0)
        for head, query in [(0, T - 1), (3, T // 2)]:
            step = record.steps(head, query)
            torch.testing.assert_close(step.contextualized.float(), record.out[0, head, query],
                                       atol=1e-6, rtol=0)  # fmt: skip


@pytest.mark.parametrize("name", list(TINY))
def test_export_writes_transformers_names_and_loads_with_equal_logits(name, folders, tmp_path):
    """Stacked experts are split back into one tensor per expert, as save_pretrained has
    them, with the same values."""
    folder, _ = folders[name]
    model, family, config, _ = ours(folder)
    exported = export(model, family, config)
    original = load_file(folder / "model.safetensors")
    assert exported.keys() == original.keys()
    assert all(torch.equal(exported[k], original[k]) for k in original)
    save_file(exported, tmp_path / "model.safetensors", {"format": "pt"})
    (tmp_path / "config.json").write_text(json.dumps(family.hf_config(config)))
    theirs = hf.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager")
    assert type(theirs) is TINY[name][0]
    ids = ids_of(2)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, theirs(ids).logits, atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe"])
def test_transformers_in_memory_names_of_the_stacked_experts_load_too(name, folders, tmp_path):
    """A file of transformers' state_dict (mlp.experts.gate_up_proj, mlp.experts.down_proj,
    mlp.gate) reads as the per-expert file does."""
    folder, theirs = folders[name]
    save_file({k: v.contiguous() for k, v in theirs.state_dict().items()},
              tmp_path / "model.safetensors", {"format": "pt"})  # fmt: skip
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    written = load_file(tmp_path / "model.safetensors")
    assert any(k.endswith("experts.gate_up_proj") for k in written)
    model, *_ = ours(tmp_path)
    want, *_ = ours(folder)
    pairs = zip(model.state_dict().values(), want.state_dict().values(), strict=True)
    assert all(torch.equal(a, b) for a, b in pairs)


def test_a_missing_or_misshapen_expert_is_refused_by_name(folders, tmp_path):
    folder, _ = folders["mixtral"]
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    tensors = read_checkpoint(folder)
    expert = "model.layers.1.block_sparse_moe.experts.2.w3.weight"
    save_file({k: v for k, v in tensors.items() if k != expert}, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=f"not {expert} .1 of the 8 tensors that make "
                                         r"blocks.1.mlp.gate_up are missing"):  # fmt: skip
        ours(tmp_path)
    save_file(tensors | {expert: tensors[expert][:-1]}, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="do not join into blocks.1.mlp.gate_up"):
        ours(tmp_path)


def test_qkv_load_reads_a_folder_and_shows_its_attention(folders, tmp_path):
    """The facade: qkv.load with a tokenizer beside the checkpoint, its attentions equal to
    transformers', and Pretrained.save written as a folder transformers loads."""
    for name in ("mixtral", "qwen3_moe"):
        folder, theirs = folders[name]
        here = tmp_path / name
        here.mkdir()
        for file in ("config.json", "model.safetensors"):
            (here / file).write_bytes((folder / file).read_bytes())
        words = Backend(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
        words.pre_tokenizer = pre_tokenizers.Whitespace()
        words.save(str(here / "tokenizer.json"))
        loaded = qkv.load(str(here))
        seen = loaded.attentions(TEXT)
        ids = torch.tensor([loaded.tokenizer.encode(TEXT).ids])
        with torch.no_grad():
            want = torch.cat(theirs(ids, output_attentions=True).attentions)  # (L, H, T, T)
        torch.testing.assert_close(seen.weights, want, atol=1e-6, rtol=0)
        loaded.save(tmp_path / f"{name}-saved")
        again = TINY[name][0].from_pretrained(tmp_path / f"{name}-saved").eval()
        with torch.no_grad():
            torch.testing.assert_close(again(ids).logits, theirs(ids).logits, atol=1e-5, rtol=0)


# ---- config.json both ways -----------------------------------------------------------------


@pytest.mark.parametrize("name", list(TINY))
def test_a_transformers_config_round_trips_through_qkv(name):
    """transformers' config.json -> qkv -> config.json (read by transformers itself) -> qkv."""
    _, hf_config = TINY[name]
    family = family_for(hf_config.to_dict())
    assert family is FAMILY[name]
    config = family.config(hf_config.to_dict())
    written = family.hf_config(config)
    assert family_for(written) is family and family.config(written) == config
    reread = type(hf_config).from_dict(written).to_dict()
    assert family.config(reread) == config


def test_what_the_tiny_configs_read_as():
    mixtral = MIXTRAL.config(TINY["mixtral"][1].to_dict())
    routing = mixtral.block.experts.routing
    assert (routing.num_experts, routing.top_k, routing.normalize) == (4, 2, True)
    assert (mixtral.block.window, mixtral.moe_layers, mixtral.rope_base) == (WINDOW, None, 1e6)
    assert routing.weights_dtype == "float32" and mixtral.block.experts.hidden == 48
    qwen = QWEN3_MOE.config(TINY["qwen3_moe"][1].to_dict())
    assert qwen.moe_layers == (False, True, False, False)
    assert (qwen.block.mlp_hidden, qwen.block.experts.hidden) == (64, 24)
    assert (qwen.block.window, qwen.layer_types, qwen.block.head_size) == (WINDOW, None, 16)
    assert qwen.block.experts.routing.weights_dtype == "input"
    plain = QWEN3_MOE.config(TINY["qwen3_moe-plain"][1].to_dict())
    assert not plain.block.experts.routing.normalize and plain.block.window is None
    assert plain.block.head_size == 8 and plain.moe_layers is None  # hidden_size / heads


def test_missing_keys_mean_transformers_defaults():
    shape = {"hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2,
             "intermediate_size": 96, "vocab_size": 50}  # fmt: skip
    mixtral = MIXTRAL.config({"model_type": "mixtral", **shape})
    assert (mixtral.block.window, mixtral.rope_base, mixtral.block.kv_heads) == (None, 1e6, 4)
    assert mixtral.block.experts.routing.num_experts == 8
    qwen = QWEN3_MOE.config({"model_type": "qwen3_moe", **shape, "sliding_window": 9})
    assert (qwen.block.window, qwen.rope_base, qwen.block.head_size) == (None, 1e4, 16)
    routing = qwen.block.experts.routing
    assert (routing.num_experts, routing.top_k, routing.normalize) == (128, 8, False)
    assert qwen.block.experts.hidden == 768
    windowed = {"model_type": "qwen3_moe", **shape, "use_sliding_window": True}
    assert QWEN3_MOE.config(windowed).block.window == 4096
    # the hub's spelling of E, and Qwen3's layer keys, which Qwen3-MoE does not use
    hub = windowed | {"num_experts": 16, "max_window_layers": 1, "layer_types": ["x"]}
    assert QWEN3_MOE.config(hub).block.experts.routing.num_experts == 16
    assert QWEN3_MOE.config(hub).layer_types is None


REFUSED_CONFIGS = [
    ("mixtral", {"hidden_act": "gelu"}, "Mixtral checkpoints with hidden_act='gelu'"),
    ("mixtral", {"num_experts_per_tok": 5}, r"num_experts_per_tok \(5\) must be at most 4"),
    ("mixtral", {"num_experts": 8}, r"num_experts \(8\) and num_local_experts \(4\) differ"),
    ("mixtral", {"num_local_experts": 0}, "num_local_experts must be a whole number >= 1"),
    ("mixtral", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6,
                                     "partial_rotary_factor": 0.5}},
     "partial_rotary_factor must be 1 in a Mixtral checkpoint"),
    ("qwen3_moe", {"attention_bias": True}, "Qwen3-MoE checkpoints with attention_bias=True"),
    ("qwen3_moe", {"head_dim": None}, "head_dim must be a whole number or absent"),
    ("qwen3_moe", {"decoder_sparse_step": 0}, "decoder_sparse_step must be a whole number"),
    ("qwen3_moe", {"mlp_only_layers": [1, "3"]}, "mlp_only_layers must list layer indices"),
    ("qwen3_moe", {"norm_topk_prob": "true"}, "norm_topk_prob must be true or false"),
    ("qwen3_moe", {"moe_intermediate_size": 0}, "moe_intermediate_size must be a whole"),
]  # fmt: skip


@pytest.mark.parametrize("name, change, message", REFUSED_CONFIGS)
def test_a_config_json_value_qkv_does_not_compute_is_refused_by_name(name, change, message):
    config = TINY[name][1].to_dict() | change
    with pytest.raises(ValueError, match=message):
        family_for(config).config(config)


MIXTRAL_CFG = MIXTRAL.config(TINY["mixtral"][1].to_dict())
QWEN_CFG = QWEN3_MOE.config(TINY["qwen3_moe"][1].to_dict())
ROUND_TRIPS = [
    (MIXTRAL, _block(MIXTRAL_CFG, window=None, head_dim=16)),
    (MIXTRAL, replace(_routing(MIXTRAL_CFG, top_k=4), tie_embeddings=True)),
    (QWEN3_MOE, replace(QWEN_CFG, moe_layers=(True, False, True, True))),  # mlp_only_layers [1]
    (QWEN3_MOE, replace(QWEN_CFG, moe_layers=None, num_layers=2)),
    (QWEN3_MOE, replace(_routing(QWEN_CFG, normalize=False), moe_layers=(False,) * 4)),
]  # fmt: skip


@pytest.mark.parametrize("family, config", ROUND_TRIPS)
def test_a_qkv_config_written_as_config_json_reads_back_equal(family, config):
    written = family.hf_config(config)
    assert family_for(written) is family and family.config(written) == config
    cls = getattr(hf, family.config_classes[0])
    assert family.config(cls.from_dict(written).to_dict()) == config  # as transformers reads it


REFUSED_EXPORTS = [
    (MIXTRAL, _routing(MIXTRAL_CFG, weights_dtype="input"),
     r"block.experts.routing.weights_dtype='input' \(it has 'float32'\)"),
    (MIXTRAL, replace(MIXTRAL_CFG, moe_layers=(True, False)), r"moe_layers=\(True, False\)"),
    (MIXTRAL, _block(MIXTRAL_CFG, experts=None), "cannot hold a model without experts"),
    (MIXTRAL, _block(MIXTRAL_CFG, qk_norm="head"), r"block.qk_norm='head' \(it has None\)"),
    (QWEN3_MOE, _routing(QWEN_CFG, score="sigmoid"),
     r"block.experts.routing.score='sigmoid' \(it has 'softmax'\)"),
    (QWEN3_MOE, _block(QWEN_CFG, experts=replace(QWEN_CFG.block.experts, shared_hidden=8)),
     r"block.experts.shared_hidden=8 \(it has None\)"),
    (QWEN3_MOE, replace(QWEN_CFG, dense_mlp_hidden=8), r"dense_mlp_hidden=8 \(it has None\)"),
]  # fmt: skip


@pytest.mark.parametrize("family, config, message", REFUSED_EXPORTS)
def test_a_config_the_family_cannot_hold_is_refused_by_name(family, config, message):
    with pytest.raises(ValueError, match=message):
        family.hf_config(config)


def test_every_key_of_the_config_classes_is_read_or_inert():
    common = set(hf.PretrainedConfig().to_dict())
    for family in (MIXTRAL, QWEN3_MOE):
        for name in family.config_classes:
            keys = set(getattr(hf, name)().to_dict()) - common
            assert keys <= set(family.reads) | set(family.inert), name

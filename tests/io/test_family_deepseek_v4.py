"""DeepSeek-V4: tiny random checkpoints built by `transformers`, loaded by qkv, exact.

Two tiny models between them hold every choice qkv maps: a sliding layer, CSA layers (entries
of 4 overlapping, an indexer keeping 3) and HCA layers (16, and transformers' default 128),
hashed and top-k experts (sqrt(softplus) and sigmoid scores) with a clamp that bites
(swiglu_limit 1), hyper-connections of 3 and 2 streams, a YaRN compress rotary, tied and
untied heads. Texts run 45 tokens and more past every window and block. The indexer has 8
heads, so that an entry's score is rarely exactly 0 for every head (ties at 0, which
torch.topk breaks by its own order, would make the choice depend on the call's shape).
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
import transformers as hf
from safetensors.torch import save_file

from qkv.inspect.records import why_not_redone
from qkv.io.checkpoint import export
from qkv.io.families.deepseek_v4 import FAMILY, config
from qkv.io.hf_folder import load_folder
from qkv.models.deepseek_v4 import DeepseekV4Decoder

CSA, HCA, SLIDING = (
    "compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention")  # fmt: skip
SMALL = dict(vocab_size=64, hidden_size=32, moe_intermediate_size=16, num_attention_heads=4,
             head_dim=16, q_lora_rank=24, num_experts_per_tok=2, n_routed_experts=4,
             partial_rotary_factor=0.5, o_groups=2, o_lora_rank=8, index_n_heads=8,
             index_head_dim=12, index_topk=3, sliding_window=8,
             max_position_embeddings=256)  # fmt: skip
CASES = {
    # every attention type, hashed and top-k experts alternating, 3 streams, a clamp that bites
    "mixed": SMALL | dict(num_hidden_layers=4, layer_types=[SLIDING, CSA, HCA, CSA],
                          compress_rates={CSA: 4, HCA: 16}, hc_mult=3, swiglu_limit=1.0,
                          mlp_layer_types=["hash_moe", "moe", "hash_moe", "moe"]),
    # transformers' default rates (HCA of 128), sigmoid scores, YaRN on the compressed layers,
    # 2 streams and 5 Sinkhorn steps, tied embeddings
    "wide": SMALL | dict(num_hidden_layers=2, layer_types=[HCA, CSA], hc_mult=2,
                         hc_sinkhorn_iters=5, mlp_layer_types=["moe", "hash_moe"],
                         scoring_func="sigmoid", tie_word_embeddings=True,
                         rope_parameters={"rope_type": "yarn", "factor": 4.0,
                                          "original_max_position_embeddings": 64}),
}  # fmt: skip
LENGTHS = {"mixed": 64, "wide": 180}
PREFILL = {"mixed": 18, "wide": 122}  # then a token at a time, across the last block's end
NAMES = list(CASES)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    made = {}

    def folder(name: str):
        if name not in made:
            torch.manual_seed(NAMES.index(name))
            model = hf.DeepseekV4ForCausalLM(hf.DeepseekV4Config(**CASES[name])).eval()
            E, k = model.config.n_routed_experts, model.config.num_experts_per_tok
            with torch.no_grad():  # norms far from 1, biases and sinks far from 0
                for key, p in model.named_parameters():
                    if p.dim() == 1:
                        p.copy_(key.endswith("weight") + 0.3 * torch.randn_like(p))
                    else:
                        p.copy_(torch.randn_like(p) * 0.6 * p.shape[-1] ** -0.5)
                for key, b in model.named_buffers():
                    if key.endswith("tid2eid"):
                        b.copy_(torch.stack([torch.randperm(E)[:k] for _ in range(len(b))]))
                    if key.endswith("e_score_correction_bias"):
                        b.copy_(0.1 * torch.randn_like(b))
            path = tmp_path_factory.mktemp(name)
            model.save_pretrained(path)
            made[name] = (path, model)
        return made[name]

    return folder


def ours(folder, backend="eager"):
    return load_folder(folder, torch.float32, backend)[0]


def ids_of(name: str, batch: int = 2) -> torch.Tensor:
    return torch.randint(0, 64, (batch, LENGTHS[name]), generator=torch.Generator().manual_seed(5))


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
@pytest.mark.parametrize("name", NAMES)
def test_logits_equal_transformers_past_every_window_and_block(name, backend, folders):
    path, theirs = folders(name)
    ids = ids_of(name)
    with torch.no_grad():
        expected = theirs(ids).logits
        got = ours(path, backend)(ids).logits
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", NAMES)
def test_the_indexer_chooses_what_transformers_indexer_chooses(name, folders):
    path, theirs = folders(name)
    csa = [i for i, t in enumerate(CASES[name]["layer_types"]) if t == CSA]
    seen = {}
    hooks = [theirs.model.layers[i].self_attn.compressor.indexer.register_forward_hook(
        lambda module, args, out, i=i: seen.__setitem__(i, out)) for i in csa]  # fmt: skip
    ids = ids_of(name)
    with torch.no_grad():
        theirs(ids)
        records = ours(path)(ids, layers=csa).records
    for hook in hooks:
        hook.remove()
    for i in csa:
        keys = records[i].compressed
        B, T, N = keys.chosen.shape
        top = seen[i]  # (B, T, k), -1 where fewer than k entries are complete
        chosen = torch.zeros(B, T, N + 1, dtype=torch.bool)
        chosen.scatter_(-1, torch.where(top >= 0, top, N), True)
        assert torch.equal(keys.chosen, chosen[..., :N]), f"layer {i}"
        complete = keys.ready.sum(-1)  # the indexer really drops entries the query could see
        assert int(complete.max()) == N > keys.top_k == int(keys.chosen.sum(-1).max())


@pytest.mark.parametrize("name", NAMES)
def test_records_weights_give_the_outputs_and_spread_onto_the_words(name, folders):
    path, _ = folders(name)
    out = ours(path)(ids_of(name), layers="all")
    for layer, record in out.records.items():
        weights = record.weights()  # (B, H, Tq, R + N): the window's words, then entries
        v = record.v.expand(-1, weights.shape[1], -1, -1)
        torch.testing.assert_close(weights @ v, record.out, atol=1e-6, rtol=0)
        assert not record.plain
        keys = record.compressed
        if CASES[name]["layer_types"][layer] == SLIDING:
            assert keys is None
            continue
        words = keys.on_words(weights)  # (B, H, Tq, T)
        assert words.shape[-1] == LENGTHS[name]
        torch.testing.assert_close(words.sum(-1), weights.sum(-1), atol=1e-6, rtol=0)
        sinks = record.sink_weights()
        torch.testing.assert_close(words.sum(-1) + sinks, torch.ones_like(sinks))
        assert why_not_redone({layer: record}).startswith(f"layer {layer} attends over compressed")


def test_a_word_without_weight_says_why_and_a_word_with_weight_does_not(folders):
    path, _ = folders("mixed")
    record = ours(path)(ids_of("mixed", 1), layers=[1]).records[1]
    keys = record.compressed
    words = keys.on_words(record.weights())[0].sum(0)  # (Tq, T) every head's together
    ranks = []
    for query in range(40, 64):
        for word in range(64):
            reason = keys.why_zero(query, word)
            assert (reason is None) == bool(words[query, word] > 0), (query, word, reason)
            if reason is not None and "indexer" in reason:
                ranks.append(reason)
    assert keys.why_zero(40, 41) == "word 41 comes after the query (position 40)"
    assert ranks and all("rank " in r and "top 3 chosen" in r for r in ranks)
    assert any(r.startswith("word") and "outside the window of 8 words" in r for r in ranks)
    r, n = keys.rank(50, int(keys.chosen[0, 50].nonzero()[0]))
    assert r <= 3 and n == 12  # a chosen entry is among the best 3 of the 12 complete


@pytest.mark.parametrize("name", NAMES)
def test_cached_decoding_token_by_token_equals_the_full_forward(name, folders):
    path, theirs = folders(name)
    model, ids = ours(path), ids_of(name, 1)
    with torch.no_grad():
        full = model(ids).logits
        cache = model.new_cache()
        first, T = PREFILL[name], ids.shape[1]
        steps = [model(ids[:, :first], cache=cache).logits]
        steps += [model(ids[:, t : t + 1], cache=cache).logits for t in range(first, T)]
        hf_cache = hf.DynamicCache(config=theirs.config)
        theirs_steps = [theirs(ids[:, :first], cache=hf_cache, use_cache=True).logits]
        theirs_steps += [theirs(ids[:, t : t + 1], cache=hf_cache, use_cache=True).logits
                         for t in range(first, T)]  # fmt: skip
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-4, rtol=0)
    torch.testing.assert_close(torch.cat(steps, 1), torch.cat(theirs_steps, 1), atol=1e-4, rtol=0)
    assert cache.length == ids.shape[1]
    assert cache.layers[0].keys.shape[2] == CASES[name]["sliding_window"] - 1


def test_a_padded_batch_is_refused_by_name_as_transformers_pools_padding_into_blocks(folders):
    path, theirs = folders("mixed")
    ids = ids_of("mixed", 1)
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), ids], 1)
    mask = torch.cat([torch.zeros(1, 3, dtype=torch.long), torch.ones_like(ids)], 1)
    with torch.no_grad():  # transformers' own padded row is not its row alone
        alone = theirs(ids).logits
        row = theirs(padded, attention_mask=mask).logits[:, 3:]
    assert (alone - row).abs().max() > 1e-2
    with pytest.raises(ValueError, match="does not take a padded batch"):
        ours(path)(padded, attention_mask=mask)


@pytest.mark.parametrize(
    ("argument", "message"),
    [({"hidden_states": True}, "n streams per token"), ({"positions": torch.arange(64)},
     "positions are not taken"), ({"edits": {}}, "does not take edits")],
)  # fmt: skip
def test_what_the_decoder_does_not_compute_is_refused_by_name(argument, message, folders):
    path, _ = folders("mixed")
    with pytest.raises(ValueError, match=message):
        ours(path)(ids_of("mixed", 1), **argument)


def test_an_export_loads_in_transformers_with_equal_logits(folders, tmp_path):
    path, theirs = folders("mixed")
    model = ours(path)
    cfg = config(json.loads((path / "config.json").read_text()))
    save_file(export(model, FAMILY, cfg), tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps(FAMILY.hf_config(cfg)))
    again = hf.DeepseekV4ForCausalLM.from_pretrained(tmp_path).eval()
    ids = ids_of("mixed")
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, theirs(ids).logits, atol=1e-5, rtol=0)


def _without(model, cfg, **changes):
    """The same weights in a model of a changed config (weights it lacks are dropped, those
    it adds keep their defaults)."""
    other = DeepseekV4Decoder(replace(cfg, **changes))
    other.load_state_dict(model.state_dict(), strict=False)
    return other.eval()


def _no_sinks(model, cfg):
    other = _without(model, cfg)
    with torch.no_grad():
        for block in other.blocks:
            block.attn.sinks.fill_(-1e9)
    return other


EXERCISED = [
    ("the indexer's top k", lambda m, c: _without(m, c, index_top_k=1000)),
    ("compression", lambda m, c: _without(m, c, attention_types=("sliding",) * 4)),
    ("the window", lambda m, c: _without(m, c, block=replace(c.block, window=4))),
    ("hash routing", lambda m, c: _without(m, c, hashed_layers=(False,) * 4)),
    ("Sinkhorn's steps", lambda m, c: _without(m, c, hc_iterations=1)),
    ("the swiglu limit", lambda m, c: _without(m, c, swiglu_limit=1e6)),
    ("the compress rotary", lambda m, c: _without(m, c, compress_rope_base=10000.0)),
    ("the sinks", _no_sinks),
]


@pytest.mark.parametrize(("what", "without"), EXERCISED, ids=[w for w, _ in EXERCISED])
def test_the_tiny_models_exercise_what_they_map(what, without, folders):
    path, _ = folders("mixed")
    model = ours(path)
    cfg = config(json.loads((path / "config.json").read_text()))
    ids = ids_of("mixed")
    with torch.no_grad():
        assert (model(ids).logits - without(model, cfg)(ids).logits).abs().max() > 1e-3, what


@pytest.mark.parametrize("name", NAMES)
def test_a_transformers_config_round_trips_through_qkv(name):
    given = hf.DeepseekV4Config(**CASES[name]).to_dict()
    cfg = config(given)
    assert config(FAMILY.hf_config(cfg)) == cfg
    back = hf.DeepseekV4Config(**FAMILY.hf_config(cfg))
    for key in ("layer_types", "mlp_layer_types", "compress_rates", "hc_mult", "index_topk",
                "sliding_window", "scoring_func"):  # fmt: skip
        assert getattr(back, key) == given[key], key
    for kind in ("main", "compress"):  # written out with YaRN's defaults made explicit
        assert given["rope_parameters"][kind].items() <= back.rope_parameters[kind].items()


def test_what_the_tiny_configs_read_as():
    mixed, wide = (config(hf.DeepseekV4Config(**CASES[n]).to_dict()) for n in NAMES)
    assert mixed.attention_types == ("sliding", "csa", "hca", "csa")
    assert mixed.hashed_layers == (True, False, True, False)
    assert (mixed.csa_rate, mixed.hca_rate, mixed.rope_dims, mixed.streams) == (4, 16, 8, 3)
    assert (wide.hca_rate, wide.expert_score, wide.tie_embeddings) == (128, "sigmoid", True)
    assert wide.compress_rope_scaling.kind == "yarn"
    assert wide.compress_rope_scaling.attention_factor == 1.0
    assert mixed.mtp_layers == 1  # read, kept, not computed (nor by transformers)


def test_older_spellings_read_as_transformers_reads_them():
    base = hf.DeepseekV4Config(**CASES["mixed"]).to_dict()
    del base["layer_types"], base["mlp_layer_types"], base["compress_rates"]
    older = base | {"compress_ratios": [0, 4, 128, 4], "num_hash_layers": 1,
                    "compress_rate_hca": 16}  # fmt: skip
    cfg = config(older)
    assert cfg.attention_types == ("sliding", "csa", "hca", "csa")
    assert cfg.hashed_layers == (True, False, False, False) and cfg.hca_rate == 16


REFUSED = [
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"num_key_value_heads": 2}, "num_key_value_heads"),
    ({"scoring_func": "softmax"}, "scoring_func"),
    ({"layer_types": ["full_attention"] * 4}, "layer_types"),
    ({"mlp_layer_types": ["dense"] * 4}, "mlp_layer_types"),
    ({"o_groups": 3}, "o_groups"),
    ({"quantization_config": {"quant_method": "fp8"}}, "quantization_config"),
    ({"rope_parameters": {"main": {"rope_type": "yarn", "factor": 2.0}, "compress": {}}},
     "rope_parameters"),
    ({"partial_rotary_factor": 2.0}, "partial_rotary_factor"),
    ({"hc_sinkhorn_iters": 10**12}, "at most 1000 Sinkhorn steps"),
]  # fmt: skip


@pytest.mark.parametrize(("change", "message"), REFUSED, ids=[m for _, m in REFUSED])
def test_a_config_json_value_qkv_does_not_compute_is_refused_by_name(change, message):
    given = hf.DeepseekV4Config(**CASES["mixed"]).to_dict() | change
    with pytest.raises(ValueError, match=message):
        config(given)

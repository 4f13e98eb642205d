"""RoBERTa, XLM-R, DistilBERT and ModernBERT: tiny random checkpoints built by `transformers`,
loaded by qkv, equal to transformers' eager model (hidden states, MLM logits, attention
weights), exported back to folders transformers loads with equal outputs."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import transformers as hf
from safetensors.torch import save_file

from qkv.io.checkpoint import export
from qkv.io.families import distilbert, family_for, modernbert, roberta
from qkv.io.hf_folder import load_folder

WINDOW = 8  # ModernBERT's local_attention: keys within 4 positions either side
ROBERTA = {"vocab_size": 99, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
           "intermediate_size": 37, "max_position_embeddings": 64, "type_vocab_size": 1,
           "pad_token_id": 1}  # fmt: skip
MODERNBERT = {"vocab_size": 99, "hidden_size": 32, "intermediate_size": 40,
              "num_hidden_layers": 4, "num_attention_heads": 4, "local_attention": WINDOW,
              "max_position_embeddings": 64, "pad_token_id": 0, "bos_token_id": 2,
              "eos_token_id": 3, "cls_token_id": 2, "sep_token_id": 3,
              "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 500.0},
                                  "sliding_attention": {"rope_type": "default",
                                                        "rope_theta": 50.0}}}  # fmt: skip
BIASED = {"norm_bias": True, "attention_bias": True, "mlp_bias": True, "classifier_bias": True}
TINY = {
    "roberta": (hf.RobertaModel, hf.RobertaConfig(**ROBERTA)),
    "roberta-mlm": (hf.RobertaForMaskedLM, hf.RobertaConfig(**ROBERTA)),
    "xlm-roberta-mlm": (hf.XLMRobertaForMaskedLM, hf.XLMRobertaConfig(**ROBERTA)),
    "distilbert": (
        hf.DistilBertModel,
        hf.DistilBertConfig(vocab_size=99, dim=32, n_layers=2, n_heads=4, hidden_dim=37,
                            max_position_embeddings=64),
    ),
    "distilbert-mlm": (
        hf.DistilBertForMaskedLM,
        hf.DistilBertConfig(vocab_size=99, dim=32, n_layers=2, n_heads=4, hidden_dim=37,
                            max_position_embeddings=64, activation="relu"),
    ),
    "distilbert-sinusoidal": (
        hf.DistilBertModel,
        hf.DistilBertConfig(vocab_size=99, dim=32, n_layers=2, n_heads=4, hidden_dim=37,
                            max_position_embeddings=64, sinusoidal_pos_embds=True),
    ),
    "modernbert": (hf.ModernBertModel, hf.ModernBertConfig(**MODERNBERT)),
    "modernbert-mlm": (hf.ModernBertForMaskedLM, hf.ModernBertConfig(**MODERNBERT)),
    "modernbert-biased-mlm": (
        hf.ModernBertForMaskedLM,
        hf.ModernBertConfig(**MODERNBERT, **BIASED, hidden_activation="gelu_pytorch_tanh",
                            classifier_activation="gelu_pytorch_tanh"),
    ),
}  # fmt: skip
PAD = {"roberta": 1, "xlm-roberta": 1, "distilbert": 0, "modernbert": 0}
LENGTH = {"roberta": 12, "xlm-roberta": 12, "distilbert": 12, "modernbert": 30}  # past WINDOW


def kind(name: str) -> str:
    return name.removesuffix("-mlm").removesuffix("-biased").removesuffix("-sinusoidal")


def save_tiny(name: str, folder):
    """A tiny random checkpoint saved by transformers, and transformers' eager model of it."""
    cls, config = TINY[name]
    torch.manual_seed(1)
    model = cls(config).eval()
    with torch.no_grad():  # random, not zero or one, biases and gains: a mapping error shows
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(folder)
    return cls.from_pretrained(folder, attn_implementation="eager").eval()


def batch(name: str, lengths=(None, -7)):
    """(ids, mask): rows of random tokens (never the padding id), right-padded with it."""
    T, pad = LENGTH[kind(name)], PAD[kind(name)]
    torch.manual_seed(2)
    ids = torch.randint(4, 99, (len(lengths), T))
    mask = torch.ones_like(ids)
    for row, cut in enumerate(lengths):
        if cut is not None:
            ids[row, cut:], mask[row, cut:] = pad, 0
    return ids, mask


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """name -> (folder, transformers' model): each checkpoint built once for the file."""
    made = {}

    def get(name):
        if name not in made:
            folder = tmp_path_factory.mktemp(name)
            made[name] = folder, save_tiny(name, folder)
        return made[name]

    return get


@pytest.mark.parametrize("name", list(TINY))
@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_hidden_states_and_logits_match_transformers(name, backend, tiny):
    folder, theirs = tiny(name)
    ours, *_ = load_folder(folder, torch.float32, backend)
    ids, mask = batch(name)
    mlm = name.endswith("-mlm")
    with torch.no_grad():
        hidden = theirs.base_model(ids, attention_mask=mask).last_hidden_state  # (B, T, C)
        got = ours(ids, attention_mask=mask, logits=mlm)
    real = mask.bool()
    torch.testing.assert_close(got.hidden[real], hidden[real], atol=1e-5, rtol=0)
    if mlm:
        with torch.no_grad():
            logits = theirs(ids, attention_mask=mask).logits  # (B, T, vocab)
        torch.testing.assert_close(got.logits[real], logits[real], atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", ["roberta", "distilbert", "modernbert"])
def test_a_right_padded_batch_equals_each_row_alone(name, tiny):
    folder, _ = tiny(name)
    ours, *_ = load_folder(folder, torch.float32, "eager")
    ids, mask = batch(name, lengths=(None, -3, 5))
    with torch.no_grad():
        together = ours(ids, attention_mask=mask).hidden
        for row in range(ids.shape[0]):
            n = int(mask[row].sum())
            alone = ours(ids[row : row + 1, :n]).hidden[0]
            torch.testing.assert_close(together[row, :n], alone, atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", ["roberta-mlm", "xlm-roberta-mlm", "distilbert", "modernbert"])
def test_attention_weights_match_output_attentions(name, tiny):
    folder, theirs = tiny(name)
    ours, *_ = load_folder(folder, torch.float32, "sdpa")  # weights come from the record
    ids, mask = batch(name)
    layers = list(range(len(ours.blocks)))
    with torch.no_grad():
        want = theirs(ids, attention_mask=mask, output_attentions=True).attentions
        got = ours(ids, attention_mask=mask, layers=layers).records
    real = mask.bool()  # a padding query of a local layer sees no key: qkv's row is zeros
    for layer in layers:
        torch.testing.assert_close(
            got[layer].weights().transpose(1, 2)[real], want[layer].transpose(1, 2)[real],
            atol=1e-6, rtol=0,
        )  # fmt: skip


def test_modernbert_local_layers_see_half_the_window_either_side(tiny):
    folder, _ = tiny("modernbert")
    ours, _, cfg, _ = load_folder(folder, torch.float32, "eager")
    assert [cfg.layer_type(i) for i in range(4)] == ["full", "sliding", "sliding", "full"]
    ids, _ = batch("modernbert", lengths=(None,))
    with torch.no_grad():
        records = ours(ids, layers=[0, 1]).records
    query = 15
    steps = records[1].steps(head=2, query=query)
    seen = [pair.allowed for pair in steps.pairs]
    assert seen == [abs(query - key) <= WINDOW // 2 for key in range(ids.shape[1])]
    assert all(pair.allowed for pair in records[0].steps(head=2, query=query).pairs)


@pytest.mark.parametrize("name", ["roberta", "distilbert", "modernbert"])
def test_trace_steps_give_the_models_own_head_output(name, tiny):
    folder, _ = tiny(name)
    ours, *_ = load_folder(folder, torch.float32, "eager")
    ids, mask = batch(name)
    with torch.no_grad():
        records = ours(ids, attention_mask=mask, layers="all").records
    for record in records.values():
        for head, query in [(0, 0), (3, 5), (1, LENGTH[name] - 1)]:
            steps = record.steps(head, query)
            torch.testing.assert_close(
                steps.contextualized.float(), record.out[0, head, query], atol=1e-6, rtol=0
            )


@pytest.mark.parametrize("name", list(TINY))
def test_export_loads_in_transformers_with_equal_outputs(name, tiny, tmp_path):
    folder, _ = tiny(name)
    ours, family, cfg, _ = load_folder(folder, torch.float32, "eager")
    save_file(export(ours, family, cfg), tmp_path / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "config.json").write_text(json.dumps(family.hf_config(cfg)))
    theirs = TINY[name][0].from_pretrained(tmp_path, attn_implementation="eager").eval()
    again, *_ = load_folder(tmp_path, torch.float32, "eager")
    ids, mask = batch(name)
    mlm = name.endswith("-mlm")
    with torch.no_grad():
        want = theirs(ids, attention_mask=mask)
        got = ours(ids, attention_mask=mask, logits=mlm)
        reloaded = again(ids, attention_mask=mask, logits=mlm)
    real = mask.bool()
    torch.testing.assert_close(reloaded.hidden, got.hidden, atol=0, rtol=0)
    if mlm:
        torch.testing.assert_close(got.logits[real], want.logits[real], atol=1e-5, rtol=0)
    else:
        torch.testing.assert_close(
            got.hidden[real], want.last_hidden_state[real], atol=1e-5, rtol=0
        )


@pytest.mark.parametrize("name", list(TINY))
def test_config_round_trips(name, tiny):
    folder, theirs = tiny(name)
    saved = json.loads((folder / "config.json").read_text())
    family = family_for(saved)
    cfg = family.config(saved)
    assert family.config(family.hf_config(cfg)) == cfg
    assert family.config(theirs.config.to_dict()) == cfg
    assert family.hf_config(cfg)["model_type"] == saved["model_type"]
    assert cfg.mlm_head == name.endswith("-mlm")


def test_modernbert_reads_the_older_config_spelling_the_same():
    newer = hf.ModernBertConfig(**MODERNBERT).to_dict()
    older = {k: v for k, v in newer.items() if k not in ("layer_types", "rope_parameters")}
    older |= {"global_attn_every_n_layers": 3, "global_rope_theta": 500.0,
              "local_rope_theta": 50.0}  # fmt: skip
    cfg = modernbert.config(older)
    assert cfg == modernbert.config(newer)
    assert (cfg.rope_base, cfg.local_rope_base, cfg.block.window) == (500.0, 50.0, 5)


def test_roberta_positions_count_from_the_padding_id(tiny):
    folder, theirs = tiny("roberta")
    ours, *_ = load_folder(folder, torch.float32, "eager")
    ids = torch.tensor([[5, 6, 7, 1, 1]])
    want = theirs.embeddings.create_position_ids_from_input_ids(ids, 1)
    from qkv.models.encoder import padded_positions

    assert padded_positions(ids, 1).tolist() == want.tolist() == [[2, 3, 4, 1, 1]]
    assert ours.config.position_padding == 1


def test_robertas_context_window_is_its_positions_after_the_padding_id(tiny, tmp_path):
    """64 learned positions, real tokens from 2 (padding id 1 + 1): 62 tokens fit, and the
    62nd is the last one the table holds."""
    import qkv
    from qkv.io.embedded import embedded_path

    folder, _ = tiny("roberta")
    shutil.copytree(folder, tmp_path / "roberta")
    for file in ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"]:
        shutil.copy(embedded_path("minilm") / file, tmp_path / "roberta" / file)
    model = qkv.load(tmp_path / "roberta")
    assert model.context_window == 62
    ours, *_ = load_folder(folder, torch.float32, "eager")
    ours(torch.full((1, 62), 5))  # the longest text fits
    with pytest.raises(ValueError, match="position 64 is past this model's 64 learned"):
        ours(torch.full((1, 63), 5))


REFUSED = [
    (roberta.config, {**ROBERTA, "model_type": "roberta", "is_decoder": True}, "is_decoder=True"),
    (roberta.config, {**ROBERTA, "position_embedding_type": "relative_key"},
     "position_embedding_type='relative_key'"),
    (roberta.config, {**ROBERTA, "architectures": ["RobertaForMaskedLM"], "hidden_act": "relu"},
     "RobertaForMaskedLM checkpoints with hidden_act='relu'"),
    (distilbert.config, {"vocab_size": 99, "activation": "tanh"}, "activation 'tanh'"),
    (modernbert.config, {**MODERNBERT, "attention_bias": True}, "attention_bias=True"),
    (modernbert.config, {**MODERNBERT, "hidden_activation": "relu"}, "hidden_activation='relu'"),
    (modernbert.config, {**MODERNBERT, "rope_parameters": {
        "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 500.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 50.0}}}, "'linear'"),
    (modernbert.config, {**MODERNBERT, "architectures": ["ModernBertForMaskedLM"],
                         "classifier_activation": "silu"}, "classifier_activation='silu'"),
    (modernbert.config, {**MODERNBERT, "layer_types": ["local"] * 4}, "layer_types must list"),
]  # fmt: skip


@pytest.mark.parametrize(("read", "hf_config", "message"), REFUSED)
def test_what_qkv_does_not_compute_is_refused_by_name(read, hf_config, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("[", r"\[")):
        read(hf_config)


def test_a_config_json_that_cannot_hold_the_model_is_refused_by_field():
    from dataclasses import replace

    cfg = roberta.config(ROBERTA)
    with pytest.raises(ValueError, match="position_padding=None"):
        roberta.FAMILY.hf_config(replace(cfg, position_padding=None))
    with pytest.raises(ValueError, match=r"block.window=3"):
        roberta.FAMILY.hf_config(replace(cfg, block=replace(cfg.block, window=3)))
    with pytest.raises(ValueError, match="segments"):
        distilbert.hf_config(replace(cfg, position_padding=None))
    modern = modernbert.config(MODERNBERT)
    with pytest.raises(ValueError, match="first_attn_norm=True"):
        modernbert.hf_config(replace(modern, first_attn_norm=True))


@pytest.mark.parametrize(
    "family", [roberta.FAMILY, roberta.XLM_FAMILY, distilbert.FAMILY, modernbert.FAMILY]
)
def test_every_config_key_is_read_or_inert(family):
    common = set(hf.PretrainedConfig().to_dict())
    for name in family.config_classes:
        keys = set(getattr(hf, name)().to_dict()) - common
        assert keys <= set(family.reads) | set(family.inert), name

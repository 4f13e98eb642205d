"""The tour's numbers against the library's own, each recomputed here another way."""

from __future__ import annotations

import json
import math

import pytest
import torch

import qkv
from qkv.inspect.article import SENTENCE
from qkv.inspect.probe import probe
from qkv.inspect.tour import STEPS, tour
from qkv.inspect.trace import attention_vectors


@pytest.fixture(scope="module")
def bank(minilm):
    return tour(minilm, SENTENCE)


def test_steps_in_the_articles_order_with_the_diagrams_ids(bank):
    assert [s.id for s in bank.steps] == list(STEPS)
    assert (bank.query, bank.key) == ("bank", "river")
    json.dumps(bank.to_dict())  # JSON-ready all through


def test_tokens_are_the_tokenizers(minilm, bank):
    encoded = minilm.encode(SENTENCE)
    numbers = bank.step("tokens").numbers
    assert numbers["ids"] == list(encoded.ids) and numbers["tokens"] == list(encoded.tokens)
    assert numbers["tokens"][numbers["query_index"]] == "bank"


def test_embeddings_add_the_position_then_the_norm_gives_layer_0s_input(minilm, bank):
    n = bank.step("embeddings").numbers
    summed = torch.tensor(n["token_vector"]) + torch.tensor(n["position_vector"])
    summed = summed + torch.tensor(n["segment_vector"])
    with torch.inference_mode():
        normed = minilm.model.embed.norm(summed)
        ids = torch.tensor([minilm.encode(SENTENCE).ids])
        first = minilm.model(ids, hidden_states=True).hidden_states[0][0, bank.query_index]
    torch.testing.assert_close(normed, torch.tensor(n["layer_input"]), atol=1e-5, rtol=0)
    torch.testing.assert_close(first, torch.tensor(n["layer_input"]))


def test_the_seven_steps_are_the_traces(minilm, bank):
    t = qkv.trace(minilm, SENTENCE, "bank", "river", layer=bank.layer, head=bank.head)
    n = bank.step("qkv").numbers
    assert n["attention_scalar"] == t.attention_scalar and n["weight"] == t.weight
    for name in ("query_vector", "key_vector", "value_vector", "contextualized", "weights"):
        assert n[name] == [float(x) for x in getattr(t, name).double()]
    # the trace's layer and head are where "bank" attends most to "river"
    weights = minilm.attentions(SENTENCE).weights[:, :, bank.query_index, bank.key_index]
    assert divmod(int(weights.argmax()), weights.shape[1]) == (bank.layer, bank.head)


def test_softmax_with_and_without_the_scale(minilm, bank):
    q, k, _ = attention_vectors(minilm, SENTENCE)  # (L, H, T, D)
    row = k[bank.layer, bank.head].double() @ q[bank.layer, bank.head, bank.query_index].double()
    n = bank.step("scaling").numbers
    D = q.shape[-1]
    assert n["sqrt_d"] == math.sqrt(D)
    torch.testing.assert_close(torch.tensor(n["without_scale"]).double(), row.softmax(0))
    torch.testing.assert_close(torch.tensor(n["with_scale"]).double(),
                               (row / math.sqrt(D)).softmax(0), atol=1e-6, rtol=0)  # fmt: skip
    assert n["top_without"] > n["top_with"]  # the scale spreads the weight


def test_heads_concatenated_and_projected(minilm, bank):
    q, k, v = attention_vectors(minilm, SENTENCE)  # (L, H, T, D)
    _, H, T, D = q.shape
    weights = (q[bank.layer] @ k[bank.layer].transpose(-1, -2) / math.sqrt(D)).softmax(-1)
    heads = weights @ v[bank.layer]  # (H, T, D)
    concatenated = heads[:, bank.query_index].reshape(H * D)
    out = minilm.model.blocks[bank.layer].attn.out
    projected = concatenated @ out.weight.T + out.bias
    n = bank.step("heads").numbers
    torch.testing.assert_close(torch.tensor(n["weights"]), weights[:, bank.query_index,
                                                                   bank.key_index])  # fmt: skip
    torch.testing.assert_close(torch.tensor(n["concatenated"]), concatenated, atol=1e-5, rtol=0)
    torch.testing.assert_close(torch.tensor(n["projected"]), projected, atol=1e-4, rtol=0)
    assert n["shapes"]["concatenated"] == f"(B, T, H*D) = (1, {T}, {H * D})"


def test_layers_change_the_word_and_separate_the_senses(minilm, bank):
    with torch.inference_mode():
        ids = torch.tensor([minilm.encode(SENTENCE).ids])
        states = minilm.model(ids, hidden_states=True).hidden_states
    word = torch.stack([s[0, bank.query_index] for s in states])  # "bank" is one token
    cos = torch.nn.functional.cosine_similarity(word[1:], word[:-1], dim=-1)
    n = bank.step("layers").numbers
    torch.testing.assert_close(torch.tensor(n["consecutive_cosine"]), cos, atol=1e-5, rtol=0)
    assert n["senses"]["separation"] == probe(minilm, "bank").separation


def test_experiments_are_the_librarys(minilm, bank):
    hidden = bank.step("qkv").experiments[0]["result"]
    assert hidden["change"] == qkv.hide(minilm, SENTENCE, "river", query="bank", table=False).total
    ablated = bank.step("heads").experiments[0]["result"]
    assert ablated["change"] == qkv.ablate(minilm, SENTENCE, [(bank.layer, bank.head)]).total
    swapped = bank.step("scaling").experiments[0]["result"]
    assert swapped["text"] == "The bank on the side of the money"
    t = qkv.trace(minilm, swapped["text"], "bank", "money", layer=bank.layer, head=bank.head)
    assert swapped["weight"] == t.weight
    compared = bank.step("layers").experiments[0]["result"]
    p = probe(minilm, "bank", [SENTENCE, compared["text"]])
    assert compared["cosine"] == [float(c) for c in p.similarity[:, 0, 1]]
    # the scale beside each change: two words of the sentence, and the two senses of "bank"
    final = qkv.hide(minilm, SENTENCE, "river", query="bank", table=False).clean_states.double()
    words = torch.nn.functional.cosine_similarity(final[bank.query_index],
                                                  final[bank.key_index], dim=0)  # fmt: skip
    assert hidden["words_apart"] == pytest.approx(1 - float(words), abs=1e-12)


def test_parallel_outputs_agree_and_a_ratio_is_shown(bank):
    n = bank.step("parallel").numbers
    assert n["timed"] and n["max_difference"] < 1e-4 and n["ratio"] > 0
    T = len(bank.tokens)
    assert n["pairs"] == bank.num_heads * T * T


def test_a_decoder_reads_the_pair_the_other_way(smollm2):
    t = tour(smollm2, SENTENCE)
    assert (t.query, t.key) == ("river", "bank") and t.query_index > t.key_index
    n = t.step("embeddings").numbers
    assert n["position_kind"] == "rotary" and "position_vector" not in n
    assert "rotate" in t.step("embeddings").says


def test_another_text_picks_the_last_word_and_what_it_attends_to_most(minilm):
    text = "Cats chase mice at night"
    t = tour(minilm, text)
    assert t.query == "night"
    weights = minilm.attentions(text).weights[:, :, t.query_index].double().mean((0, 1))
    words = [w for w in minilm.encode(text).words() if w.text != "night"]
    best = max(words, key=lambda w: float(weights[w.token_start]))
    assert t.key == best.name


def test_bad_words_and_layers_are_refused(minilm):
    with pytest.raises(ValueError, match="not a word of the text"):
        tour(minilm, SENTENCE, query="boat")
    with pytest.raises(ValueError, match="layer"):
        tour(minilm, SENTENCE, layer=6)
    with pytest.raises(ValueError, match="swap must be one word"):
        tour(minilm, SENTENCE, swap="two words")


def test_a_training_runs_loss_and_cue_head(tmp_path):
    from qkv.data import bank_corpus
    from qkv.train import RunConfig, train

    config = RunConfig().updated({
        "model": {"arch": "bert", "layers": 2, "heads": 2, "width": 32, "context": 32},
        "data": {"kind": "bank", "vocab_size": 300, "examples": 256, "heldout": 32},
        "train": {"steps": 4, "batch_size": 8, "lr": 3e-3, "warmup": 2, "eval_every": 2,
                  "eval_batches": 2, "checkpoint_every": 2, "keep": 2},
    }).check()  # fmt: skip
    train(config, tmp_path / "run", quiet=True)
    trained = qkv.load(tmp_path / "run")
    t = tour(trained, bank_corpus(4, seed=3)[0].text)
    n = t.step("training").numbers
    logged = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text()
              .splitlines()]  # fmt: skip
    assert n["run"] and n["loss"] == [r["loss"] for r in logged]
    assert n["steps"] == [1, 2, 3, 4]
    layer, head, share = probe(trained, "bank").cue_head
    assert {k: n["cue"][k] for k in ("layer", "head", "share")} == {
        "layer": layer, "head": head, "share": share}  # fmt: skip
    # the cue head forming: its share at each kept checkpoint, each loaded on its own
    forming = []
    for step in (2, 4):
        then = qkv.load(tmp_path / "run" / "checkpoints" / f"step-{step:06d}")
        then.run = trained.run  # probed on the run's held-out sentences, as the run itself
        forming.append({"step": step, "share": float(probe(then, "bank").cue_attention[
            layer, head])})  # fmt: skip
    assert n["cue"]["forming"] == forming and forming[-1]["share"] == share


def test_an_encoder_decoders_cross_attention_and_encoder(tmp_path):
    import string

    from qkv.data import word_tokenizer
    from tiny_models import save_tiny

    save_tiny("bart", tmp_path)
    word_tokenizer(list(string.ascii_lowercase), style="bart").save(tmp_path)
    bart = qkv.load(tmp_path)
    t = tour(bart, "a b c d", query="b", key="d", target="d c b a")
    cross = t.step("cross").numbers
    seen = bart.attentions("a b c d", target="d c b a")
    assert cross["decoder_tokens"] == seen.query_tokens == ["</s>", "d", "c", "b", "a"]
    assert cross["predicts"] == ["d", "c", "b", "a", "(the end)"]  # the target shifted right
    peak = seen.weights.double().max(-1).values.mean(-1)
    assert (cross["layer"], cross["head"]) == divmod(int(peak.argmax()), peak.shape[1])
    assert cross["weights"] == seen.weights[cross["layer"], cross["head"]].double().tolist()
    # the other steps read the encoder: its self-attention, as `attentions` without a target
    encoder = bart.attentions("a b c d").weights[t.layer, t.head, t.query_index]
    traced = torch.tensor(t.step("qkv").numbers["weights"])  # the loop's, in float64, to float32
    torch.testing.assert_close(traced, encoder.float(), atol=1e-6, rtol=0)
    assert all(k.startswith("enc.") for k, v in t.boxes.items() if "values" in v)


def test_a_target_is_refused_for_an_encoder(minilm):
    with pytest.raises(ValueError, match="target text is for encoder-decoder"):
        tour(minilm, SENTENCE, target="river the of side")


def test_why_this_scalar_is_qkv_whys(minilm, bank):
    shown = bank.step("qkv").numbers["why"]
    why = qkv.why(minilm, SENTENCE, "bank", "river", layer=bank.layer, head=bank.head, checks=0)
    assert shown["total"] == why.total
    assert [(r["query_part"], r["key_part"], r["value"]) for r in shown["ranked"]] == why.ranked(5)
    assert shown["total"] == pytest.approx(bank.step("qkv").numbers["scaled_scalar"], rel=1e-5)


def test_an_attention_sink_is_named_where_it_takes_the_most(minilm):
    weights = minilm.attentions(SENTENCE).weights  # (L, H, T, T)
    encoded = minilm.encode(SENTENCE)
    at, key = encoded.find("bank")[0], encoded.find("river")[0]
    top = weights[:, :, at].argmax(-1)  # (L, H)
    sinks = [(n, h) for n in range(top.shape[0]) for h in range(top.shape[1])
             if encoded.special[int(top[n, h])]]  # fmt: skip
    layer, head = sinks[0]
    t = tour(minilm, SENTENCE, layer=layer, head=head)
    sink = t.step("qkv").numbers["sink"]
    assert sink["index"] == int(top[layer, head]) != key
    assert sink["weight"] == pytest.approx(float(weights[layer, head, at, sink["index"]]), abs=1e-6)
    assert "attention sink" in t.step("qkv").says
    assert tour(minilm, SENTENCE).step("qkv").numbers["sink"] is None  # "river" takes the most


def test_an_experiment_the_model_refuses_says_why_in_its_place(minilm, monkeypatch):
    import qkv.inspect.tour_experiments as tried

    def refused(*args, **kwargs):
        raise ValueError("this model's heads take no edits")

    monkeypatch.setattr(tried, "ablate", refused)
    t = tour(minilm, SENTENCE)
    (ablated,) = t.step("heads").experiments
    assert ablated["result"] is None
    assert ablated["says"] == "Not on this model: this model's heads take no edits"
    assert t.step("qkv").experiments[0]["result"] is not None  # the others still run

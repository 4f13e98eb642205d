"""The sense probe on the embedded MiniLM: context, not the token, separates the two banks."""

from __future__ import annotations

import json
import re

import pytest
import torch

from qkv.inspect.bank_sentences import LABELS, SENTENCES
from qkv.inspect.probe import Probe, probe
from qkv.viz.plots import probe_plot


@pytest.fixture(scope="module")
def banks(minilm) -> Probe:
    return probe(minilm, "bank")


def test_default_set_is_labelled_bank_sentences_told_apart_by_other_words():
    assert len(SENTENCES) == len(LABELS) >= 12
    assert LABELS.count("river") == LABELS.count("money") == len(LABELS) // 2
    for sentence in SENTENCES:
        assert len(re.findall(r"\bbank\b", sentence.lower())) == 1, sentence
        assert "banks" not in sentence.lower()
    # the sense must come from context: the telltale words are mostly absent
    assert sum("river" in s.lower() for s in SENTENCES) <= 1
    assert sum("money" in s.lower() for s in SENTENCES) <= 1


def test_shapes_names_and_a_cosine_matrix_per_depth(minilm, banks):
    L, N, C = 6, len(SENTENCES), minilm.config.block.width
    assert banks.sentences == SENTENCES and banks.labels == LABELS
    assert banks.layers == ["embeddings", *(f"layer {i}" for i in range(L))]
    assert banks.similarity.shape == (L + 1, N, N)
    assert banks.vectors.shape == (L + 1, N, C)
    assert banks.similarity.dtype == banks.vectors.dtype == torch.float32
    assert len(banks.accuracy) == len(banks.separation) == L + 1
    diagonal = banks.similarity.diagonal(dim1=1, dim2=2)  # (L+1, N)
    torch.testing.assert_close(diagonal, torch.ones_like(diagonal), atol=1e-5, rtol=0)
    torch.testing.assert_close(banks.similarity, banks.similarity.transpose(1, 2))
    unit = torch.nn.functional.normalize(banks.vectors, dim=-1)
    torch.testing.assert_close(banks.similarity, unit @ unit.transpose(1, 2))


def test_context_is_what_separates_the_senses(banks):
    # Before any attention every "bank" is the same token; only its position differs.
    assert banks.similarity[0].min() > 0.8  # measured: 0.936
    assert abs(banks.separation[0]) < 0.01  # measured: 0.001
    # After the last layer the river banks are closer to each other than to the money banks.
    assert banks.separation[-1] > 0.04  # measured: 0.068
    assert banks.separation[-1] > banks.separation[0] + 0.04
    assert banks.accuracy[-1] >= 0.875  # measured: 1.0 (16 of 16); the embeddings: 0.625


def test_separation_and_accuracy_follow_their_definitions(banks):
    same = torch.tensor([[a == b for b in LABELS] for a in LABELS])
    for depth in (0, len(banks.layers) - 1):
        s = banks.similarity[depth].double()
        within = [s[i, j] for i in range(16) for j in range(16) if same[i, j] and i != j]
        across = [s[i, j] for i in range(16) for j in range(16) if not same[i, j]]
        want = sum(within) / len(within) - sum(across) / len(across)
        assert banks.separation[depth] == pytest.approx(float(want), abs=1e-6)
        unit = torch.nn.functional.normalize(banks.vectors[depth].double(), dim=-1)
        right = 0
        for n in range(16):
            keep = [i for i in range(16) if i != n]
            scores = {
                sense: torch.cosine_similarity(
                    unit[n], unit[[i for i in keep if LABELS[i] == sense]].mean(0), dim=0
                )
                for sense in ("river", "money")
            }
            right += max(scores, key=scores.get) == LABELS[n]
        assert banks.accuracy[depth] == right / 16


def test_vectors_are_the_models_own_hidden_states(minilm, banks):
    for n in (0, 5, 12):  # one sentence at a time: no padding, no batch
        encoded = minilm.tokenizer.encode(SENTENCES[n])
        first, last = encoded.find("bank")
        with torch.inference_mode():
            states = minilm.model(torch.tensor([encoded.ids]), hidden_states=True).hidden_states
        want = torch.stack([h[0, first:last].mean(0) for h in states])  # (L+1, C)
        torch.testing.assert_close(banks.vectors[:, n], want, atol=1e-5, rtol=1e-5)


def test_batch_size_and_second_occurrence(minilm):
    sentences = ["The bank by the bank of the river.", "A bank lent money to the bank."]
    whole = probe(minilm, "bank#2", sentences)
    one_by_one = probe(minilm, "bank#2", sentences, batch_size=1)
    torch.testing.assert_close(whole.vectors, one_by_one.vectors, atol=1e-5, rtol=1e-5)
    first = probe(minilm, "bank#1", sentences)
    assert not torch.allclose(whole.vectors[-1], first.vectors[-1], atol=1e-3)
    assert whole.labels is whole.accuracy is whole.separation is None


def test_plot_writes_one_non_blank_png(banks, tmp_path):
    import matplotlib.image

    out = probe_plot(banks, tmp_path / "bank.png")
    assert out == tmp_path / "bank.png"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bank.png"]  # no temporary left
    pixels = matplotlib.image.imread(out)  # (height, width, RGBA) floats in 0..1
    assert pixels.ndim == 3 and pixels.shape[2] in (3, 4)
    assert pixels.shape[0] >= 300 and pixels.shape[1] > pixels.shape[0]
    assert pixels[..., :3].std() > 0.05
    with pytest.raises(ValueError, match=r"the model has 6 layers, 0 to 5"):
        probe_plot(banks, tmp_path / "other.png", layer=6)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bank.png"]


def test_plot_without_labels(minilm, tmp_path):
    import matplotlib.image

    unlabelled = probe(minilm, "bank", SENTENCES[:3])
    out = probe_plot(unlabelled, tmp_path / "three.png", layer=0)
    assert matplotlib.image.imread(out)[..., :3].std() > 0.05


def test_to_dict_round_trips_through_json(banks):
    data = json.loads(json.dumps(banks.to_dict()))
    assert set(data) == {
        "word", "sentences", "labels", "layers", "similarity", "accuracy", "separation",
        "cues", "cue_attention", "cue_head",
    }  # fmt: skip
    assert data["cues"] is None and data["cue_attention"] is None and data["cue_head"] is None
    assert data["word"] == "bank" and data["labels"] == LABELS
    assert data["layers"][0] == "embeddings" and len(data["layers"]) == 7
    assert torch.tensor(data["similarity"]).equal(banks.similarity)
    assert data["separation"] == banks.separation and data["accuracy"] == banks.accuracy


def test_a_sentence_without_the_word_is_named(minilm):
    sentences = ["The bank of the river.", "We walked along the shore."]
    with pytest.raises(ValueError, match=r"sentence 1 \('We walked along the shore\.'\).*shore"):
        probe(minilm, "bank", sentences)
    with pytest.raises(ValueError, match=r"sentence 0 .*occurrence 2"):
        probe(minilm, "bank#2", sentences)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"word": "river", "sentences": None}, r"no sentences given for 'river'; pass sentences"),
        ({"sentences": None, "labels": ["river", "money"]}, r"labels were given without sentences"),
        ({"sentences": ["The bank."]}, r"at least 2, got 1"),
        ({"labels": ["river"]}, r"1 labels for 4 sentences"),
        ({"labels": ["river"] * 4}, r"every label is 'river'; give at least two senses"),
        ({"labels": ["river", "river", "river", "money"]}, r"sense 'money' has only one"),
        ({"batch_size": 0}, r"batch_size must be an integer >= 1"),
    ],
)
def test_bad_input_is_a_one_line_value_error(minilm, kwargs, message):
    four = ["The bank.", "A bank.", "My bank.", "Our bank."]
    arguments = {"word": "bank", "sentences": four, **kwargs}
    with pytest.raises(ValueError, match=message) as error:
        probe(minilm, **arguments)
    assert "\n" not in str(error.value)


def test_probe_command_prints_each_depth_writes_json_and_a_png(tmp_path):
    import subprocess
    import sys

    def run(*args):
        return subprocess.run([sys.executable, "-m", "qkv.cli", "probe", *args],
                              capture_output=True, text=True, timeout=300)  # fmt: skip

    sentences = tmp_path / "bat.txt"
    sentences.write_text(
        "animal\tThe bat flew out of the cave at dusk.\n"
        "animal\tA small bat hung from the barn roof.\n"
        "sport\tHe swung the bat and hit the ball.\n"
        "sport\tShe bought a new cricket bat.\n"
    )
    table = run("bat", "--sentences", str(sentences), "--out", str(tmp_path / "pics" / "bat.png"))
    assert table.returncode == 0, table.stderr
    depths = [
        line for line in table.stdout.splitlines() if "accuracy" in line and ": mean cosine" in line
    ]
    assert len(depths) == 7 and depths[0].strip().startswith("embeddings")
    assert (tmp_path / "pics" / "bat.png").stat().st_size > 0
    data = json.loads(run("bat", "--sentences", str(sentences), "--json").stdout)
    assert data["labels"] == ["animal", "animal", "sport", "sport"] and len(data["accuracy"]) == 7
    missing = run("bat", "--sentences", str(tmp_path / "none.txt"))
    assert missing.returncode == 2 and "does not exist" in missing.stderr


def test_cue_attention_counts_the_heads_whose_top_key_is_the_cue(minilm):
    """With cues, each (layer, head) reports the share of sentences in which the word's
    attention row is largest on its cue, recomputed here from the recorded weights."""
    sentences = ["The bank of the river was muddy.", "The bank lent money to me.",
                 "Ducks sat on the bank by the stream.", "The bank approved my loan."]  # fmt: skip
    cues, labels = ["river", "money", "stream", "loan"], ["river", "money"] * 2
    found = probe(minilm, "bank", sentences, labels, cues=cues)
    L, H = 6, 12
    assert found.cue_attention.shape == (L, H)
    expected = torch.zeros(L, H)
    for sentence, cue in zip(sentences, cues, strict=True):
        seen = minilm.attentions(sentence)
        bank, (first, last) = seen.encoded.find("bank")[0], seen.encoded.find(cue)
        top = seen.weights[:, :, bank].argmax(-1)  # (L, H)
        expected += ((top >= first) & (top < last)).float()
    assert torch.equal(found.cue_attention, expected / 4)
    layer, head, share = found.cue_head
    assert share == float(found.cue_attention.max()) == float(expected[layer, head] / 4)
    with pytest.raises(ValueError, match="cue"):
        probe(minilm, "bank", sentences, labels, cues=["river", "money", "stream", "teller"])

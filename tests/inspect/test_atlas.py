"""The atlas of heads (`qkv.atlas`): its statistics equal a direct computation from records,
its top examples a brute-force ranking, a stopped run resumed writes the same bytes as one
that never stopped, and bad input is refused before anything is written."""

from __future__ import annotations

import json
import random

import pytest
import torch

from intervention_models import encoder_like, llama_like
from qkv.inspect import atlas_corpus
from qkv.inspect.atlas import STATS, survey
from qkv.inspect.atlas_corpus import windows
from qkv.inspect.census import _records
from qkv.viz.atlas import STATE, atlas, read_atlas
from variant_models import WORDS, gemma2_like, tiny


def _corpus(path, paragraphs=12, seed=0):
    rng = random.Random(seed)
    words = WORDS[1:]
    text = "\n\n".join(" ".join(rng.choice(words) for _ in range(rng.randint(3, 25)))
                       for _ in range(paragraphs))  # fmt: skip
    path.write_text(text + "\n", encoding="utf-8")
    return path


def _direct(pretrained, corpus, window):
    """Each statistic's mean and each head's examples, one query at a time from each window's
    records, in float64."""
    sums, counts, candidates = {}, {}, {}
    torch.set_grad_enabled(False)
    for index, ids in enumerate(windows(corpus, pretrained.tokenizer, window=window)):
        for layer, record in _records(pretrained.model, torch.tensor([ids])).items():
            W = record.weights()[0].double()  # (H, T, T)
            for head in range(W.shape[0]):
                at = (layer, head)
                for i in range(1, len(ids)):
                    row = W[head, i]
                    after = [j for j in range(1, i) if ids[j - 1] == ids[i]]
                    values = {
                        "entropy": -sum(w * torch.log(w) for w in row if w > 0),
                        "sink": row[0],
                        "previous_token": row[i - 1],
                        "distance": sum(row[j] * abs(i - j) for j in range(len(ids))),
                        "self": row[i],
                    }
                    if after:
                        values["induction"] = sum(row[j] for j in after)
                    if record.window is not None and min(i, record.window - 1) > 0:
                        farthest = min(i, record.window - 1)
                        values["window_use"] = values["distance"] / farthest
                    for name, value in values.items():
                        sums[at, name] = sums.get((at, name), 0.0) + float(value)
                        counts[at, name] = counts.get((at, name), 0) + 1
                    best = max(range(1, len(ids)), key=lambda j: (float(row[j]), -j))
                    candidates.setdefault(at, []).append((-float(row[best]), index, i, best))
    torch.set_grad_enabled(True)
    means = {key: sums[key] / counts[key] for key in sums}
    return means, {at: sorted(found) for at, found in candidates.items()}


@pytest.mark.parametrize("make", [lambda: tiny(gemma2_like()), llama_like, encoder_like])
def test_the_statistics_and_examples_equal_a_direct_computation(make, tmp_path):
    pretrained = make()
    corpus = _corpus(tmp_path / "corpus.txt")
    found = survey(pretrained, corpus, tmp_path / "state.pt", window=12, batch=1, top=3)
    means, ranked = _direct(pretrained, corpus, 12)
    for name in STATS:
        for (layer, head), value in ((at, means.get((at, name))) for at in ranked):
            got = float(found.stats[name][layer, head])
            if value is None:
                assert got != got, (name, layer, head)  # NaN: no query counted
            else:
                assert got == pytest.approx(value, rel=1e-9, abs=1e-12), (name, layer, head)
    if found.layer_windows[0] is not None:
        assert not found.stats["window_use"][0].isnan().any()
    for (layer, head), want in ranked.items():
        got = [(-e.weight, e.window, e.query, e.key) for e in found.examples[layer][head]]
        assert got == want[:3]
        e = found.examples[layer][head][0]
        shown = e.positions.index(e.query), e.positions.index(e.key)
        assert e.weights[shown].item() == pytest.approx(e.weight, abs=1e-7)
    batched = survey(pretrained, corpus, tmp_path / "batched.pt", window=12, batch=4, top=3)
    for name in STATS:  # a batch of windows in one forward: float32 arithmetic apart
        torch.testing.assert_close(batched.stats[name], found.stats[name], rtol=1e-6,
                                   atol=1e-6, equal_nan=True)  # fmt: skip


def _files(folder):
    return {p.relative_to(folder).as_posix(): p.read_bytes()
            for p in sorted(folder.rglob("*")) if p.is_file() and p.name != STATE}  # fmt: skip


def test_a_stopped_run_resumed_writes_the_same_files_byte_for_byte(tmp_path):
    pretrained = llama_like()
    corpus = _corpus(tmp_path / "corpus.txt", paragraphs=20)
    options = dict(window=10, batch=2, top=3, save_every=1)
    straight = tmp_path / "straight"
    atlas(pretrained, corpus, straight, **options)

    class Stop(Exception):
        pass

    def stop_after_five(done, total):
        if done >= 5:
            raise Stop

    stopped = tmp_path / "stopped"
    with pytest.raises(Stop):
        atlas(pretrained, corpus, stopped, progress=stop_after_five, **options)
    assert sorted(p.name for p in stopped.iterdir()) == [STATE]  # no half-written atlas
    seen = []
    atlas(pretrained, corpus, stopped, progress=lambda done, total: seen.append(done), **options)
    assert seen[0] == 8 and seen[-1] > 8  # resumed after window 6 (a batch is 2), not from 0
    want, got = _files(straight), _files(stopped)
    assert sorted(want) == sorted(got) and "atlas.json" in want and "index.html" in want
    assert [name for name in want if want[name] != got[name]] == []
    data = json.loads(want["atlas.json"])
    assert data["tokens"] == sum(len(ids) for ids in windows(corpus, pretrained.tokenizer,
                                                             window=10))  # fmt: skip
    assert data["corpus"]["bytes"] == corpus.stat().st_size
    assert {"examples/example.html", "examples/L0.js", "examples/L1.js"} <= set(want)
    assert [e["page"] for e in data["examples"][1][0]] == [
        f"examples/example.html#L1H0-{rank}" for rank in range(3)]  # fmt: skip
    back, _ = read_atlas(straight)
    torch.testing.assert_close(back.stats["induction"], torch.tensor(data["stats"]["induction"],
                               dtype=torch.float64))  # fmt: skip

    with pytest.raises(ValueError, match="another corpus"):
        atlas(pretrained, _corpus(tmp_path / "other.txt", seed=1), straight, **options)
    with pytest.raises(ValueError, match="another options"):
        atlas(pretrained, corpus, straight, **{**options, "window": 11})
    assert _files(straight) == want  # refused, untouched


def test_bad_input_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    pretrained = llama_like()
    out = tmp_path / "out"
    cases = {
        "bad.jsonl": ('{"text": "the bank"}\nnot json\n', "line 2 of .* is not JSON"),
        "notext.jsonl": ('{"title": "the bank"}\n', 'line 1 of .* has no "text" string'),
        "empty.txt": ("\n\n", "has no text to read"),
    }
    for name, (text, message) in cases.items():
        (tmp_path / name).write_text(text, encoding="utf-8")
        with pytest.raises(ValueError, match=message):
            atlas(pretrained, tmp_path / name, out)
    (tmp_path / "latin.txt").write_bytes(b"the bank \xe9\n")
    with pytest.raises(ValueError, match="line 1 of .* is not UTF-8"):
        atlas(pretrained, tmp_path / "latin.txt", out)
    with pytest.raises(ValueError, match="does not exist"):
        atlas(pretrained, tmp_path / "missing.txt", out)
    monkeypatch.setattr(atlas_corpus, "MAX_LINE_BYTES", 64)  # a line past it is not read whole
    (tmp_path / "one_line.txt").write_text("the bank " * 20, encoding="utf-8")
    with pytest.raises(ValueError, match="line 1 of .* is over"):
        atlas(pretrained, tmp_path / "one_line.txt", out)
    corpus = _corpus(tmp_path / "corpus.txt")
    with pytest.raises(ValueError, match="window must be"):
        atlas(pretrained, corpus, out, window=1)
    assert not out.exists()
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="holds notes.txt, not an atlas's"):
        atlas(pretrained, corpus, tmp_path / "busy")


def test_jsonl_windows_never_cross_documents_and_stop_at_max_tokens(tmp_path):
    pretrained = llama_like()
    lines = [{"text": "the bank of the river"}, {"text": "was wide and deep the bank"}]
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("\n".join(json.dumps(line) for line in lines) + "\n\n")
    read = list(windows(corpus, pretrained.tokenizer, window=4))
    assert [len(ids) for ids in read] == [4, 4, 2]
    assert read[0] == [WORDS.index(w) for w in ["the", "bank", "of", "the"]]
    assert read[1] == [WORDS.index(w) for w in ["was", "wide", "and", "deep"]]  # "river" alone: out
    capped = list(windows(corpus, pretrained.tokenizer, window=4, max_tokens=6))
    assert sum(len(ids) for ids in capped) == 6


def test_the_index_page_escapes_what_it_names(tmp_path):
    pretrained = llama_like()
    corpus = _corpus(tmp_path / "<script>&x.txt")
    atlas(pretrained, corpus, tmp_path / "out", window=10, top=2)
    page = (tmp_path / "out" / "index.html").read_text(encoding="utf-8")
    assert "<script>&x" not in page and "&lt;script&gt;&amp;x.txt" in page
    assert page.count("<script") == 2  # the data's and the script's own

"""Summaries of long texts: each equals the same computed from the full weights of a short
text, the downsampled heatmap keeps every block's maximum, a region is the slice, and no
(T, T) weights of more than one chunk of queries are ever made."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from qkv.inspect.summaries import Summaries, block_max, chunk_weights, region, summarize
from qkv.nn import AttentionRecord, MultiHeadAttention
from variant_models import TEXT, decoder, gemma2_like, tiny

EXACT = {"rtol": 1e-6, "atol": 1e-6}


def full_summaries(records, heads, top_k, query_bin, key_bin):
    """The same summaries from every layer's whole weights (L, H, Tq, Tk): the reference."""
    w = torch.stack([records[layer].weights(heads)[0] for layer in sorted(records)])
    L, H, Tq, Tk = w.shape
    logs = torch.where(w > 0, w.log(), torch.zeros(()))
    Rq, Rk = math.ceil(Tq / query_bin), math.ceil(Tk / key_bin)
    blocks = torch.zeros(L, H, Rq, Rk)
    for i in range(Rq):  # block by block, the slow obvious way
        for j in range(Rk):
            cell = w[:, :, i * query_bin : (i + 1) * query_bin, j * key_bin : (j + 1) * key_bin]
            blocks[:, :, i, j] = cell.amax(dim=(-2, -1))
    top = w.topk(min(top_k, Tk), dim=-1)
    return {"weights": w, "entropy": -(w * logs).sum(-1), "first_token_mass": w[..., 0],
            "top_weights": top.values, "received": w.double().sum(2),
            "heatmap": blocks}  # fmt: skip


def check_against_full(records, summary: Summaries, heads, top_k):
    full = full_summaries(records, heads, top_k, summary.query_bin, summary.key_bin)
    for name in ("entropy", "first_token_mass", "top_weights", "received", "heatmap"):
        torch.testing.assert_close(getattr(summary, name), full[name], **EXACT, msg=name)
    # the top keys are the keys of those weights (ties may order differently)
    picked = full["weights"].gather(-1, summary.top_keys)
    torch.testing.assert_close(picked, summary.top_weights, **EXACT)
    assert (summary.top_weights[..., :-1] >= summary.top_weights[..., 1:]).all()
    return full


@pytest.mark.parametrize("chunk", [1, 3, 256])
def test_encoder_summaries_equal_the_full_weights(minilm, chunk):
    seen = minilm.attentions("The bank of the river was wide and deep, and we sat on it")
    summary = summarize(seen, top_k=4, bins=5, chunk=chunk)
    T = len(seen.tokens)
    assert summary.entropy.shape == (6, 12, T) and summary.top_keys.shape == (6, 12, T, 4)
    assert summary.query_bin == math.ceil(T / 5) > 1  # downsampled: blocks of several tokens
    full = check_against_full(seen.records, summary, list(range(12)), 4)
    torch.testing.assert_close(summary.received.sum(-1), torch.full((6, 12), float(T),
                               dtype=torch.float64))  # fmt: skip
    assert summary.heatmap.max() == full["weights"].max()  # no strong weight disappears


def test_decoder_summaries_equal_the_full_weights(smollm2):
    seen = smollm2.attentions("The bank of the river was wide and deep", heads=[0, 4, 8])
    summary = summarize(seen, top_k=3, bins=4, chunk=4)
    assert summary.heads == [0, 4, 8] and summary.layers == list(range(30))
    full = check_against_full(seen.records, summary, [0, 4, 8], 3)
    # causal: query 0 sees only key 0
    assert (summary.first_token_mass[:, :, 0] == 1).all() and (summary.entropy[:, :, 0] == 0).all()
    assert (full["weights"].triu(1) == 0).all()


def test_weights_made_in_the_forward_pass_are_read_in_chunks_as_they_are(smollm2):
    seen = smollm2.attentions("The bank of the river was wide and deep")
    assert all(record.made is not None for record in seen.records.values())
    record = seen.records[11]
    for start, w in chunk_weights(record, [1, 7], chunk=4):
        rows = slice(start, start + w.shape[1])
        assert torch.equal(w, record.made[[1, 7], rows, : w.shape[2]])
    bare = {n: dataclasses.replace(r, made=None) for n, r in seen.records.items()}
    made, computed = summarize(seen, top_k=3, chunk=4), summarize(bare, top_k=3, chunk=4)
    for name in ("entropy", "first_token_mass", "top_weights", "received", "heatmap"):
        torch.testing.assert_close(getattr(made, name), getattr(computed, name), **EXACT)


@pytest.mark.parametrize("config", [gemma2_like, lambda: decoder(window=2, num_kv_heads=1)])
def test_windowed_decoders_summaries_equal_the_full_weights(config):
    model = tiny(config())
    seen = model.attentions(TEXT)
    summary = summarize(seen, top_k=2, bins=4, chunk=2)
    full = check_against_full(seen.records, summary, seen.heads, 2)
    assert (full["weights"][0].tril(-3) == 0).all()  # the window hides keys 3 or more back


def test_a_record_with_a_mask_causal_rule_window_and_bias():
    torch.manual_seed(1)
    mha = MultiHeadAttention(width=16, num_heads=4, num_kv_heads=2, window=3, softcap=5.0)
    mask = torch.rand(1, 1, 11, 11) > 0.3
    bias = torch.randn(1, 4, 11, 11)
    with torch.inference_mode():
        _, record = mha(torch.randn(1, 11, 16), mask=mask, causal=True, bias=bias, record=True)
    assert record.window == 3 and record.bias is not None
    summary = summarize({0: record}, top_k=3, bins=3, chunk=4)
    check_against_full({0: record}, summary, list(range(4)), 3)
    parts = [w for _, w in chunk_weights(record, [1, 3], chunk=2)]
    assert [w.shape[2] for w in parts] == [2, 4, 6, 8, 10, 11]  # causal: the later keys left out
    whole = torch.cat([torch.nn.functional.pad(w, (0, 11 - w.shape[2])) for w in parts], dim=1)
    assert torch.equal(whole == 0, record.weights([1, 3])[0] == 0)  # the same hidden keys


def test_the_region_is_the_slice_of_the_full_weights(smollm2):
    seen = smollm2.attentions("The bank of the river was wide and deep, and we sat on it")
    record = seen.records[7]
    full = record.weights([2, 5])[0]
    part = region(record, queries=(3, 11), keys=(1, 6), heads=[2, 5])
    assert part.shape == (2, 8, 5)
    torch.testing.assert_close(part, full[:, 3:11, 1:6], **EXACT)


@pytest.mark.parametrize(("queries", "keys", "message"), [
    ((5, 3), (0, 2), "queries 5:3 is not a range within"),
    ((0, 2), (0, 99), "keys 0:99 is not a range within"),
    ("ab", (0, 2), "queries are a range"),
])  # fmt: skip
def test_a_bad_region_is_refused_by_name(minilm, queries, keys, message):
    record = minilm.attentions("The bank of the river").records[0]
    with pytest.raises(ValueError, match=message):
        region(record, queries=queries, keys=keys)


def test_bad_arguments_are_refused_by_name(minilm):
    seen = minilm.attentions("The bank of the river")
    with pytest.raises(ValueError, match="bins must be a whole number >= 1"):
        summarize(seen, bins=0)
    with pytest.raises(ValueError, match="head 12 is out of range"):
        summarize(seen, heads=[12])
    with pytest.raises(ValueError, match="no layer recorded"):
        summarize({})


def test_block_max_keeps_the_largest_weight_of_each_block():
    w = torch.rand(3, 4, 37)
    got = block_max(w, 5)
    assert got.shape == (3, 4, 8)
    for j in range(8):
        assert torch.equal(got[..., j], w[..., j * 5 : (j + 1) * 5].amax(-1))


def test_no_weights_beyond_one_chunk_are_made(smollm2, monkeypatch):
    """Memory grows with T times the chunk: the largest weights tensor asked of any record
    is (1, H, chunk, T), never (H, T, T), let alone (L, H, T, T)."""
    seen = smollm2.attentions(" ".join(["the bank of the river"] * 12), weights=False)
    T = len(seen.tokens)
    shapes = []
    weights = AttentionRecord.weights

    def recording(self, heads=None):
        out = weights(self, heads)
        shapes.append(tuple(out.shape))
        return out

    monkeypatch.setattr(AttentionRecord, "weights", recording)
    summary = summarize(seen, chunk=8, bins=16)
    assert T > 32 and summary.heatmap.shape == (30, 9, math.ceil(T / summary.query_bin),
                                                math.ceil(T / summary.key_bin))  # fmt: skip
    assert max(s[2] for s in shapes) == 8 and max(s[3] for s in shapes) == T
    assert len(shapes) == 30 * math.ceil(T / 8)


def test_summaries_change_nothing_in_the_model(smollm2):
    before = [p.clone() for p in smollm2.model.parameters()]
    seen = smollm2.attentions("The bank of the river")
    summarize(seen)
    after = smollm2.attentions("The bank of the river")
    assert all(torch.equal(a, b) for a, b in zip(before, smollm2.model.parameters(), strict=True))
    for layer in seen.layers:
        assert torch.equal(seen.records[layer].q, after.records[layer].q)


def test_to_dict_is_json_ready(minilm):
    import json

    summary = summarize(minilm.attentions("The bank of the river"), top_k=2, bins=3)
    data = json.loads(json.dumps(summary.to_dict()))
    assert data["layers"] == list(range(6)) and len(data["heatmap"][0][0]) == 3
    assert data["top_keys"][0][0][0] == summary.top_keys[0, 0, 0].tolist()


# ------------------------------------------------------------------ `qkv show` of a long text

LONG_TEXT = " ".join(["The bank of the river was wide and deep, and we sat on it."] * 38)


@pytest.fixture
def no_full_weights(monkeypatch, smollm2):
    """`Attentions.weights` (L, H, T, T) is never asked for; `qkv show -m smollm2` reads the
    session's SmolLM2 rather than loading its own."""
    from qkv.inspect.attentions import Attentions

    monkeypatch.setattr("qkv.pretrained.load", lambda name, backend=None: smollm2)

    def refuse(self):
        raise AssertionError("the (L, H, T, T) weights of a long text were computed")

    monkeypatch.setattr(Attentions, "weights", property(refuse))


def test_show_draws_a_long_text_from_its_summaries(tmp_path, smollm2, no_full_weights):
    import matplotlib.image as mpimg
    from typer.testing import CliRunner

    from qkv.cli import app

    T = len(smollm2.encode(LONG_TEXT).ids)
    assert T > 512
    runner = CliRunner()
    png, page = tmp_path / "long.png", tmp_path / "long.html"
    drawn = runner.invoke(app, ["show", LONG_TEXT, "-m", "smollm2", "--out", str(png),
                                "--layer", "3", "--head", "2"])  # fmt: skip
    assert drawn.exit_code == 0, drawn.output
    assert drawn.stdout == f"wrote {png}\n" and mpimg.imread(png).ndim == 3
    written = runner.invoke(app, ["show", LONG_TEXT, "-m", "smollm2", "--out", str(page)])
    assert written.exit_code == 0, written.output
    html = page.read_text(encoding="utf-8")
    assert f"A text of {T} tokens" in html and "<script" not in html and "http" not in html
    assert html.count("<tr><td>") == 30 * 9 and "data:image/png;base64," in html
    summary = summarize(smollm2.attentions(LONG_TEXT))
    first = f"<tr><td>0</td><td>0</td><td>{float(summary.entropy[0, 0].mean()):.3f}</td>"
    assert first in html  # the page's numbers are the library's


def test_show_opens_a_region_at_full_resolution(tmp_path, smollm2, monkeypatch, no_full_weights):
    from typer.testing import CliRunner

    import qkv.viz
    from qkv.cli import app

    drawn = {}
    real = qkv.viz.head_heatmap

    def capture(weights, tokens, path, **options):
        drawn.update(weights=weights, tokens=tokens, **options)
        return real(weights, tokens, path, **options)

    monkeypatch.setattr(qkv.viz, "head_heatmap", capture)
    out = tmp_path / "region.png"
    result = CliRunner().invoke(app, ["show", LONG_TEXT, "-m", "smollm2", "--out", str(out),
                                      "--layer", "5", "--head", "7", "--region",
                                      "500:540,0:30"])  # fmt: skip
    assert result.exit_code == 0, result.output
    full = smollm2.attentions(LONG_TEXT).records[5].weights([7])[0, 0]
    torch.testing.assert_close(drawn["weights"], full[500:540, :30], **EXACT)
    tokens = smollm2.encode(LONG_TEXT).pieces  # as people read them: " bank", not "Ġbank"
    assert drawn["tokens"] == tokens[:30] and drawn["query_tokens"] == tokens[500:540]
    assert out.exists()


@pytest.mark.parametrize(("args", "message"), [
    (["--out", "r.png", "--region", "0:10"], "--region takes Q0:Q1,K0:K1"),
    (["--out", "r.png", "--region", "0:5,5:99"], "--region keys 5:99 is not within 0:7"),
    (["--out", "r.html", "--region", "0:2,0:2"], "a --region is drawn as PNG"),
    (["--out", "r.png", "--region", "0:2,0:2", "--layer", "6"], "layer 6 is out of range"),
])  # fmt: skip
def test_show_refuses_a_bad_region_by_name(tmp_path, monkeypatch, args, message):
    from typer.testing import CliRunner

    from qkv.cli import app

    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, ["show", "The bank of the river", *args])  # minilm
    assert result.exit_code == 2 and message in result.stderr, result.output
    assert list(tmp_path.iterdir()) == []

"""The self-contained report: a real model's weights, embedded as its own numbers."""

from __future__ import annotations

import base64
import json
import re
import subprocess
import zlib
from html.parser import HTMLParser

import numpy as np
import pytest
import torch

import qkv
from qkv.inspect.trace import attention_vectors
from qkv.viz import read_weights, strongest_head, write_html, write_report
from qkv.viz import report as report_module

SENTENCE = "The bank on the side of the river"


@pytest.fixture(scope="module")
def att():
    return qkv.load("minilm").attentions(SENTENCE)


@pytest.fixture(scope="module")
def report(att, tmp_path_factory):
    folder = tmp_path_factory.mktemp("reports") / "bank"
    extra = {"example": "bank ← river", "trace": {"scores": torch.tensor([0.25, 0.75])}}
    return write_report(
        folder, att.weights, att.tokens, title="The bank", text=SENTENCE, extra=extra, query=2
    )


@pytest.fixture(scope="module")
def page(report) -> str:
    return (report / "index.html").read_text(encoding="utf-8")


class Elements(HTMLParser):
    """The parts of a page the tests look at: options per select, tokens, src/href links."""

    def __init__(self, page: str):
        super().__init__()
        self.options: dict[str, list[tuple[str, str]]] = {}
        self.tokens: list[tuple[int, str]] = []
        self.links: list[tuple[str, str]] = []
        self._select: str | None = None
        self._open: list | None = None
        self.feed(page)

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        self.links += [(name, attrs[name]) for name in ("src", "href") if name in attrs]
        if tag == "select":
            self._select = attrs["id"]
            self.options[self._select] = []
        elif tag == "option":
            self._open = [attrs["value"], ""]
            self.options[self._select].append(self._open)
        elif "token" in (attrs.get("class") or "").split():
            self._open = [int(attrs["data-index"]), ""]
            self.tokens.append(self._open)

    def handle_data(self, data):
        if self._open is not None:
            self._open[1] += data

    def handle_endtag(self, tag):
        if tag in ("option", "button"):
            self._open = None


def embedded(page: str) -> dict:
    found = re.findall(r'<script type="application/json" id="qkv-data">(.*?)</script>', page, re.S)
    assert len(found) == 1
    return json.loads(found[0])


def stored_weights(data: dict) -> np.ndarray:
    """(L, H, T, T) float32, decoded here without qkv's own reader."""
    T = len(data["tokens"])

    def unpack(text: str) -> np.ndarray:
        return np.frombuffer(zlib.decompress(base64.b64decode(text)), dtype="<f4").reshape(T, T)

    return np.array([[unpack(head) for head in layer] for layer in data["weights"]["heads"]])


def test_the_folder_holds_the_page_and_the_pictures(att, report):
    layer, head = strongest_head(att.weights)
    assert sorted(p.name for p in report.iterdir()) == sorted(
        ["index.html", "model_view.png", f"head_L{layer}_H{head}.png"]
    )
    assert [p.name for p in report.parent.iterdir()] == ["bank"]  # no staging folder left
    for picture in report.glob("*.png"):
        assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_strongest_head_has_the_largest_weight_off_the_diagonal(att):
    w = att.weights.clone()  # (L, H, T, T)
    w[..., torch.arange(w.shape[-1]), torch.arange(w.shape[-1])] = -1
    flat = int(w.flatten(2).max(dim=2).values.flatten().argmax())  # over L * H heads
    layer, head = strongest_head(att.weights)
    assert (layer, head) == divmod(flat, att.weights.shape[1])
    best = w[layer, head].max()
    assert best > 0.9 and best == w.max()


def test_the_page_reaches_for_nothing_outside_itself(page):
    lowered = page.lower()
    for outside in ("http://", "https://", "//cdn", "<link", "@import", "url(", "<iframe"):
        assert outside not in lowered, outside
    assert Elements(page).links == []  # no src= or href= at all
    assert "font-family: system-ui" in page


def test_the_embedded_weights_are_the_models_own_numbers(att, page):
    data = embedded(page)
    assert data["tokens"] == att.tokens
    assert (data["num_layers"], data["num_heads"]) == tuple(att.weights.shape[:2])
    stored = stored_weights(data)  # (L, H, T, T)
    # exactly the model's float32 numbers: not rounded, not renormalised, not clipped
    np.testing.assert_array_equal(stored, att.weights.numpy())
    weights, tokens = read_weights(page)
    np.testing.assert_array_equal(weights, att.weights.numpy())
    assert tokens == att.tokens
    assert "stored here exactly (float32) and not renormalised" in " ".join(page.split())


def test_near_ties_keep_their_order_on_the_page(att, tmp_path):
    """DESIGN.md: no rounding that changes a ranking. Two keys a float32 step apart, and two
    tiny weights far below any fixed number of decimals, keep their order when read back."""
    weights = att.weights.clone()  # (L, H, T, T)
    row = weights[2, 7, 3]
    a = torch.tensor(0.30001, dtype=torch.float32)
    row[0], row[1] = a, torch.nextafter(a, torch.tensor(1.0))  # the nearest tie float32 has
    row[2], row[3] = 3e-9, 2e-9  # both 0.0000 to four decimals
    page = write_html(tmp_path / "ties.html", weights, att.tokens).read_text(encoding="utf-8")
    stored = torch.from_numpy(read_weights(page)[0])
    got = stored[2, 7, 3]
    assert got[1] > got[0] and got[2] > got[3] > 0
    assert (stored.argsort(stable=True) == weights.argsort(stable=True)).all()


def test_rows_are_stored_as_given_never_renormalised(att, tmp_path):
    weights = att.weights.clone()  # (L, H, T, T)
    weights[:, :, 3] *= 0.5  # a row summing to one half stays one half
    weights[:, :, 4] = 0.0  # a query whose keys were all masked: a row of zeros
    page = write_html(tmp_path / "rows.html", weights, att.tokens).read_text(encoding="utf-8")
    stored = stored_weights(embedded(page))
    np.testing.assert_array_equal(stored, weights.numpy())
    assert stored[:, :, 3].sum(-1) == pytest.approx(0.5, abs=1e-6)
    assert stored[:, :, 4].max() == 0


def test_selectors_list_every_layer_and_head_from_zero(att, page):
    L, H = att.weights.shape[:2]
    elements = Elements(page)
    layers, heads = elements.options["layer"], elements.options["head"]
    assert [value for value, _ in layers] == [str(i) for i in range(L)]
    assert [value for value, _ in heads] == [str(i) for i in range(H)]
    assert layers[0][1] == "0 (the first layer)" and heads[0][1] == "0 (the first head)"
    assert [tuple(token) for token in elements.tokens] == list(enumerate(att.tokens))
    layer, head = strongest_head(att.weights)
    assert f'<option value="{layer}" selected>' in page
    assert embedded(page)["selected"] == {"layer": layer, "head": head, "query": 2}


def test_the_page_has_the_hooks_a_browser_test_needs(page):
    for hook in (
        'id="layer"',
        'id="head"',
        'id="heatmap"',
        'id="headview"',
        'id="row"',
        "window.qkvReady = true",
        "data-q",
        "data-k",
        "data-w",
    ):
        assert hook in page, hook
    assert page.count("<script") == 2 and page.count("</script>") == 2


def test_extra_is_shown_and_embedded(page):
    assert embedded(page)["extra"] == {
        "example": "bank ← river",
        "trace": {"scores": [0.25, 0.75]},
    }
    section = re.search(r'<section id="extra">.*?</section>', page, re.S).group(0)
    assert "<dt>example</dt><dd>bank ← river</dd>" in section
    assert "<dt>trace</dt>" in section and "0.75" in section


def test_text_that_looks_like_markup_stays_text(tmp_path):
    tokens = ["</script><script>alert(1)</script>", "<blink>", "&amp;", " "]
    weights = torch.softmax(torch.randn(1, 2, 4, 4), dim=-1)
    path = write_html(tmp_path / "odd.html", weights, tokens, title="<i>t</i>", text="a < b")
    page = path.read_text(encoding="utf-8")
    assert page.count("</script>") == 2 and "<blink>" not in page and "<i>t</i>" not in page
    assert embedded(page)["tokens"] == tokens
    assert [text for _, text in Elements(page).tokens] == [*tokens[:3], '" "']


def test_pages_beside_the_report_are_linked_under_its_title(att, tmp_path):
    label = "The <tour> & more"
    folder = write_report(tmp_path / "r", att.weights, att.tokens, title="t",
                          beside={label: "tour.html"})  # fmt: skip
    page = (folder / "index.html").read_text()
    assert '<a href="tour.html">The &lt;tour&gt; &amp; more</a>' in page
    assert page.index('id="beside"') < page.index('id="text"')  # under the title, first seen
    for bad in ("../x.html", "https://example.com/t.html", "sub/tour.html", "tour.png", ".html"):
        with pytest.raises(ValueError, match="is not a page's file name"):
            write_report(tmp_path / "s", att.weights, att.tokens, title="t", beside={"a": bad})
        assert not (tmp_path / "s").exists()


def test_an_existing_folder_with_files_is_refused_and_untouched(att, tmp_path):
    folder = tmp_path / "taken"
    folder.mkdir()
    (folder / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="exists and is not an empty folder"):
        write_report(folder, att.weights, att.tokens, title="t")
    assert [p.name for p in folder.iterdir()] == ["notes.txt"]
    assert (folder / "notes.txt").read_text() == "mine"
    assert [p.name for p in tmp_path.iterdir()] == ["taken"]
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="not an empty folder"):
        write_report(tmp_path / "file", att.weights, att.tokens, title="t")


def test_an_empty_folder_is_filled_and_a_chosen_head_drawn(att, tmp_path):
    (tmp_path / "empty").mkdir()
    folder = write_report(tmp_path / "empty", att.weights, att.tokens, title="t", head=(5, 11))
    assert sorted(p.name for p in folder.iterdir()) == [
        "head_L5_H11.png",
        "index.html",
        "model_view.png",
    ]
    assert embedded((folder / "index.html").read_text())["selected"]["head"] == 11


def test_a_failure_half_way_leaves_nothing(att, tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(report_module, "model_view", broken)  # after index.html is written
    with pytest.raises(OSError, match="disk full"):
        write_report(tmp_path / "r", att.weights, att.tokens, title="t")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"head": (6, 0)}, r"layer 6 is out of range: the page has 6 layers \(0-5\)"),
        ({"head": (0, 12)}, "head 12 is out of range"),
        ({"query": 10}, "token 10 is out of range: the page has 10 tokens"),
        ({"extra": {"x": object()}}, "extra must be JSON-serialisable"),
        ({"extra": {"x": float("nan")}}, "extra must be JSON-serialisable"),
        ({"extra": ["not", "a", "dict"]}, "extra must be a dict"),
        ({"weights": "scores"}, "between 0 and 1"),
        ({"weights": "one head"}, r"\(L, H, T, T\)"),
    ],
)
def test_bad_input_is_a_one_line_error_and_writes_nothing(att, tmp_path, change, message):
    named = {"scores": att.weights * 5 - 1, "one head": att.weights[0, 0]}  # not (L, H, T, T)
    arguments = {"title": "t", **change}
    arguments["weights"] = named[change["weights"]] if "weights" in change else att.weights
    for write, target in ((write_report, tmp_path / "r"), (write_html, tmp_path / "p.html")):
        with pytest.raises(ValueError, match=message) as error:
            write(target, tokens=att.tokens, **arguments)
        assert "\n" not in str(error.value)
    assert list(tmp_path.iterdir()) == []


def test_write_html_is_one_file_and_refuses_other_extensions(att, tmp_path):
    path = write_html(tmp_path / "deep" / "bank.html", att.weights, att.tokens, text=SENTENCE)
    assert [p.name for p in path.parent.iterdir()] == ["bank.html"]
    data = embedded(path.read_text(encoding="utf-8"))
    assert data["tokens"] == att.tokens and data["extra"] is None
    with pytest.raises(ValueError, match=r"must be \.html, not '\.png'"):
        write_html(tmp_path / "bank.png", att.weights, att.tokens)


def test_512_tokens_make_a_page_no_larger_than_their_float32_bits(tmp_path):
    # minilm's longest text, 512 tokens; 2 of its 6 layers keep the test quick (a page grows
    # with the layers). The weights are stored exactly (float32) so no ranking can change: as
    # JSON text 2 x 12 x 512 x 512 of them would take ~100 MB; their raw bits in base64 take
    # 34 MB, and zlib must not add to that. Random softmax rows are the hard case (about
    # 31 MB); real attention, mostly near 0, compresses a little better.
    L, H, T = 2, 12, 512
    generator = torch.Generator().manual_seed(0)
    weights = torch.softmax(2 * torch.randn(L, H, T, T, generator=generator), dim=-1)
    tokens = [f"w{i}" for i in range(T)]
    folder = write_report(tmp_path / "long", weights, tokens, title="long")
    size = (folder / "index.html").stat().st_size
    assert 15e6 < size < 4 * L * H * T * T * 4 / 3 + 1e6
    stored = stored_weights(embedded((folder / "index.html").read_text()))
    assert stored.shape == (L, H, T, T)
    np.testing.assert_array_equal(stored[1, 7], weights[1, 7].numpy())


def test_the_page_script_is_valid_javascript(page, tmp_path):
    script = re.findall(r"<script>(.*?)</script>", page, re.S)
    assert len(script) == 1
    (tmp_path / "page.js").write_text(script[0])
    subprocess.run(["node", "--check", str(tmp_path / "page.js")], check=True)


def stored_vectors(data: dict) -> list[np.ndarray]:
    """q, k, v as three (L, H, T, D) float32 arrays, decoded here without the page's script."""
    T, D = len(data["tokens"]), data["vectors"]["size"]

    def unpack(text: str) -> np.ndarray:
        return np.frombuffer(zlib.decompress(base64.b64decode(text)), dtype="<f4").reshape(T, D)

    return [
        np.array([[unpack(head) for head in layer] for layer in data["vectors"][name]])
        for name in ("query", "key", "value")
    ]


def test_the_vectors_are_embedded_exactly(att, tmp_path):
    q, k, v = attention_vectors(qkv.load("minilm"), SENTENCE)  # (L, H, T, D) each
    path = write_html(tmp_path / "v.html", att.weights, att.tokens, vectors=(q, k, v), causal=True)
    page = path.read_text(encoding="utf-8")
    data = embedded(page)
    assert data["causal"] is True and data["vectors"]["size"] == q.shape[-1]
    for ours, theirs in zip(stored_vectors(data), (q, k, v), strict=True):
        np.testing.assert_array_equal(ours, theirs.numpy())  # float32 in, float32 out: exact
    assert 'id="trace"' in page and "Click a cell of the heatmap" in page
    # arrays work as well as tensors, and the report folder's page holds the same
    folder = write_report(
        tmp_path / "r", att.weights, att.tokens, vectors=[q.numpy(), k.numpy(), v.numpy()]
    )
    again = embedded((folder / "index.html").read_text(encoding="utf-8"))
    assert again["vectors"] == data["vectors"] and again["causal"] is False


def test_without_vectors_the_trace_panel_says_so(page):
    assert embedded(page)["vectors"] is None
    panel = re.search(r'<section id="trace".*?</section>', page, re.S).group(0)
    assert "written without the query, key and value vectors" in " ".join(panel.split())


def test_vectors_over_the_size_budget_are_left_out_with_a_note(tmp_path):
    # 3 x 1 x 1 x 64 x 11000 float32 is 8.1 MiB, just over the 8 MiB budget
    L, H, T, D = 1, 1, 64, 11_000
    weights = torch.softmax(torch.randn(L, H, T, T), dim=-1)
    vectors = [torch.randn(L, H, T, D) for _ in range(3)]
    tokens = [f"w{i}" for i in range(T)]
    page = write_html(tmp_path / "big.html", weights, tokens, vectors=vectors).read_text()
    assert embedded(page)["vectors"] is None
    assert "they take 8 MB, more than 8 MB" in " ".join(page.split())
    smaller = [x[..., :10_000] for x in vectors]  # 7.3 MiB: kept
    kept = write_html(tmp_path / "kept.html", weights, tokens, vectors=smaller).read_text()
    assert embedded(kept)["vectors"]["size"] == 10_000


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda q, k, v: (q, k), r"vectors must be \(q, k, v\)"),
        (
            lambda q, k, v: (q[:, :, :5], k, v),
            r"query vectors must be \(L, H, T, D\) = \(6, 12, 10",
        ),
        (lambda q, k, v: (q, k[..., :8], v), "same size D"),
        (lambda q, k, v: (q, k, v * float("nan")), "value vectors hold NaN"),
    ],
)
def test_bad_vectors_are_a_one_line_error_and_write_nothing(att, tmp_path, change, message):
    q, k, v = (torch.randn(*att.weights.shape[:3], 32) for _ in range(3))  # (L, H, T, D)
    with pytest.raises(ValueError, match=message):
        write_html(tmp_path / "p.html", att.weights, att.tokens, vectors=change(q, k, v))
    assert list(tmp_path.iterdir()) == []

"""Attention while generating: the rows `generate(record=...)` keeps as it decodes must be the
rows of one forward pass over the final sequence; without `record` nothing changes; the page
holds the generation's own numbers and works offline."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from playwright.sync_api import sync_playwright

from browser import CHROMIUM, FLAGS, only_file
from qkv.inspect.generation import GenerationAttention, Recording
from qkv.viz.generation import read_generation_page, write_generation_page
from variant_models import decoder, gemma2_like, tiny

PROMPT = "The river bank"


def one_forward(pretrained, seen: GenerationAttention) -> torch.Tensor:
    """(L', H', T - 1, T - 1): the weights of one forward pass over the final sequence without
    its last token (chosen, never read), for the recorded layers and heads."""
    ids = torch.tensor([seen.ids[:-1]])
    with torch.inference_mode():
        records = pretrained.model(ids, layers=seen.layers, logits=False).records
    return torch.stack([records[n].weights(seen.heads)[0] for n in seen.layers])


def tiny64(config):
    """A tiny random model in float64: its weights (x 8) give scores in the hundreds, whose
    float32 rounding alone is 1e-5 of a weight; in float64 the rows must agree to 1e-12."""
    model = tiny(config)
    model.model.double()
    return model


def check_rows(pretrained, seen: GenerationAttention, atol: float = 1e-5) -> None:
    full = one_forward(pretrained, seen)
    P = seen.prompt_length
    assert seen.prompt.shape == (len(seen.layers), len(seen.heads), P, P)
    torch.testing.assert_close(seen.prompt, full[:, :, :P, :P], atol=atol, rtol=0)
    for j in range(seen.generated):  # token j was chosen by the query at P + j - 1
        row = seen.row(j)
        assert row.shape == (len(seen.layers), len(seen.heads), P + j)
        torch.testing.assert_close(row, full[:, :, P + j - 1, : P + j], atol=atol, rtol=0)
        ones = torch.ones(row.shape[:2], dtype=row.dtype)
        torch.testing.assert_close(row.sum(-1), ones, atol=max(atol, 1e-6), rtol=0)
    torch.testing.assert_close(seen.weights, full, atol=atol, rtol=0)


@pytest.fixture(scope="module")
def recorded(smollm2) -> GenerationAttention:
    return smollm2.generate(PROMPT, 8, record="all")


def test_smollm2s_recorded_rows_are_one_forward_pass_over_the_final_sequence(smollm2, recorded):
    assert recorded.generated == 8
    assert (recorded.layers, recorded.heads) == (list(range(30)), list(range(9)))
    assert recorded.ids[: recorded.prompt_length] == smollm2.tokenizer.encode(PROMPT).ids
    check_rows(smollm2, recorded)
    # greedy: each token is the argmax of the logits of the one forward pass
    with torch.inference_mode():
        logits = smollm2.model(torch.tensor([recorded.ids[:-1]])).logits[0]
    P = recorded.prompt_length
    assert logits[P - 1 :].argmax(-1).tolist() == recorded.ids[P:]


def test_without_record_generate_returns_the_same_text_and_records_nothing(smollm2, recorded):
    text = smollm2.generate(PROMPT, 8, precision="loaded")  # what record computes with
    assert isinstance(text, str) and text == recorded.text
    assert recorded.text == smollm2.tokenizer.decode(recorded.ids[recorded.prompt_length :])


@pytest.mark.parametrize("config", [decoder(), gemma2_like()], ids=["decoder", "gemma2_like"])
@pytest.mark.parametrize("record", ["all", Recording(layers=[1], heads=[1]), [0]])
def test_tiny_models_recorded_rows_are_one_forward_pass(config, record):
    model = tiny64(config)
    before = {name: p.clone() for name, p in model.model.state_dict().items()}
    seen = model.generate("the bank of the river", 6, record=record, temperature=1.0, seed=3)
    assert seen.generated == 6 and isinstance(seen.text, str)
    assert seen.prompt.dtype == torch.float64
    check_rows(model, seen, atol=1e-12)
    after = model.model.state_dict()
    assert all(torch.equal(before[name], after[name]) for name in before), "the model changed"
    assert seen.text == model.generate("the bank of the river", 6, temperature=1.0, seed=3)


def stops_of(model, whole: GenerationAttention) -> list[tuple[str, str, int]]:
    """(stop string, the text before it, the tokens wholly in that text) for the generation
    `whole`: a token's own text (" river": the tokens before it), and the end of a token's
    word ("ide" of " wide": the tokens before that token, which the cut splits)."""
    P, text = whole.prompt_length, whole.text
    cases = []
    for j in range(1, whole.generated):
        start = len(model.tokenizer.decode(whole.ids[P : P + j]))  # token j's text begins
        end = len(model.tokenizer.decode(whole.ids[P : P + j + 1]))
        whole_token, inside = text[start:end], text[end - 2 : end]
        if not cases and text.find(whole_token) == start:
            cases.append((whole_token, text[:start], j))
        elif len(cases) == 1 and end - start > 3 and text.find(inside) == end - 2:
            cases.append((inside, text[: end - 2], j))
    return cases


@pytest.mark.parametrize("record", ["all", "summaries"])
def test_a_stopped_generations_recording_is_its_texts(record):
    """generate(stop=...) returns the text before the stop string; the recording held the stop
    string's tokens too (its ids, pieces and count). Now it holds the tokens wholly in the
    text: with a token's own text as the stop, the tokens before it; with the end of a token
    as the stop, the tokens before that one, which the cut splits."""
    model = tiny64(decoder())
    options = dict(temperature=1.0, seed=3)
    whole = model.generate("the bank of the river", 8, record="all", **options)
    P = whole.prompt_length
    cases = stops_of(model, whole)
    assert len(cases) == 2, (whole.text, cases)  # 8 words of a 9-word vocabulary have both
    for stop, text, generated in cases:
        seen = model.generate("the bank of the river", 8, record=record, stop=[stop], **options)
        assert seen.text == text == model.generate("the bank of the river", 8, stop=[stop],
                                                    **options)  # fmt: skip
        assert seen.generated == generated and seen.ids == whole.ids[: P + generated]
        assert len(seen.tokens) == len(seen.pieces) == P + generated
        assert text.startswith(model.tokenizer.decode(seen.ids[P:]))
        if record == "all":
            check_rows(model, seen, atol=1e-12)
        else:
            assert seen.summaries.entropy.shape[-1] == P + generated - 1
            torch.testing.assert_close(seen.summary(generated - 1)[0],
                                       model.generate("the bank of the river", 8,
                                                      record="summaries", **options
                                                      ).summary(generated - 1)[0])  # fmt: skip


def test_rows_recorded_on_the_flash_kernel_come_from_its_log_sum_exp():
    model = tiny(decoder(backend="flash"))  # Triton's interpreter on a CPU; float32 only
    seen = model.generate("the bank of the river", 4, record="all")
    with torch.inference_mode():
        records = model.model(torch.tensor([seen.ids]), layers=[0], logits=False).records
    assert records[0].backend == "flash" and records[0].lse is not None
    # float32 scores in the hundreds (the weights x 8) round to 1e-5 of a weight; a wrong row
    # or a wrong key would be off by far more
    check_rows(model, seen, atol=1e-4)


def test_the_gemma2_like_window_hides_far_keys_in_the_recorded_rows():
    seen = tiny(gemma2_like()).generate("the bank of the river", 6, record=[0])
    last = seen.row(5)[0]  # layer 0 is sliding, window 3: only the 3 latest keys are seen
    assert (last[:, :-3] == 0).all() and (last[:, -3:] > 0).all()


def test_without_record_the_forward_passes_record_nothing():
    model = tiny(decoder())
    seen: list[dict] = []
    hook = model.model.register_forward_hook(lambda _, __, out: seen.append(out.records))
    try:
        model.generate("the bank of the river", 4)
        # the prompt's forward pass records nothing; each later token runs FastStep, which
        # keeps no records at all (tests/generate/test_fast_step.py)
        assert seen == [{}]
        seen.clear()
        model.generate("the bank of the river", 4, record=[1])
        assert [sorted(records) for records in seen] == [[1]] * 4
    finally:
        hook.remove()


@pytest.mark.parametrize(
    ("record", "message"),
    [
        ([2], "layer 2 is out of range: tiny has 2 layers (0-1)"),
        (Recording(heads=[5]), "head 5 is out of range: tiny has 2 heads (0-1)"),
        ("some", "record takes 'all', 'summaries', a list of layers or a Recording, not 'some'"),
        (
            {"layer": [0]},
            "record's keys are 'layers', 'heads', 'summaries' and 'top_k', not 'layer'",
        ),
        (Recording(summaries=True, top_k=0), "record's top_k must be a whole number >= 1, got 0"),
        ({"summaries": "yes"}, "record's summaries is True or False, not 'yes'"),
        (Recording(layers=[]), "record asks no layer or no head"),
    ],
)
def test_bad_records_are_refused_by_name_before_any_step(record, message):
    model = tiny(decoder())
    calls: list[int] = []
    hook = model.model.register_forward_hook(lambda *_: calls.append(1))
    with pytest.raises(ValueError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        model.generate("the bank", 3, record=record)
    hook.remove()
    assert calls == []


def test_a_batch_and_a_recording_beyond_the_limit_are_refused(monkeypatch):
    model = tiny(decoder())
    with pytest.raises(ValueError, match="record keeps a decoder's attention over one prompt; 2"):
        model.generate(["the bank", "the river"], 3, record="all")
    monkeypatch.setattr("qkv.inspect.generation.RECORD_MAX_BYTES", 1000)
    # 2 layers x 2 heads x (4 + 2 x 2 + 1) weights x 4 bytes = 144 bytes fit; 30 new tokens,
    # 2 x 2 x (4 + 29 x 2 + 435) x 4 = 7952 bytes (7.8 KiB), do not
    assert model.generate("the bank", 3, record="all").generated == 3
    with pytest.raises(ValueError, match=r"keeps up to 7.8 KiB of weights, more than the 1000 "
                       r"bytes limit \(qkv.inspect.generation.RECORD_MAX_BYTES\)"):  # fmt: skip
        model.generate("the bank", 30, record="all")


@pytest.mark.parametrize("config", [decoder(), gemma2_like()], ids=["decoder", "gemma2_like"])
@pytest.mark.parametrize(
    "record", ["summaries", Recording(layers=[1], heads=[1], summaries=True, top_k=3)]
)
def test_recorded_summaries_are_those_of_one_forward_passs_rows(config, record, monkeypatch):
    """Each row's entropy, weight on token 0 and top keys equal those of the rows of one
    forward pass; the prompt's rows are summarized in chunks (here of 2 queries)."""
    monkeypatch.setattr("qkv.inspect.summaries.CHUNK", 2)
    model = tiny64(config)
    seen = model.generate("the bank of the river", 6, record=record, temperature=1.0, seed=3)
    assert seen.prompt is None and seen.steps == [] and seen.summaries is not None
    full = one_forward(model, seen)  # (L', H', T - 1, T - 1)
    k = min(Recording.of(record).top_k, seen.prompt_length)
    s = seen.summaries
    entropy = -(full * full.clamp_min(1e-300).log()).sum(-1)  # 0 log 0 = 0
    assert s.entropy.dtype == torch.float64  # a float64 model's summaries are float64
    torch.testing.assert_close(s.entropy, entropy, atol=1e-12, rtol=0)
    torch.testing.assert_close(s.first_token_mass, full[..., 0], atol=1e-12, rtol=0)
    top = full.topk(k, dim=-1).values
    torch.testing.assert_close(s.top_weights, top, atol=1e-12, rtol=0)
    chosen = full.gather(-1, s.top_keys)  # the keys named hold those weights
    torch.testing.assert_close(chosen, s.top_weights, atol=1e-12, rtol=0)
    P = seen.prompt_length
    for j in range(seen.generated):  # the row that chose token j
        entropy_j, first_j, keys_j, weights_j = seen.summary(j)
        assert torch.equal(entropy_j, s.entropy[:, :, P - 1 + j])
        assert torch.equal(first_j, s.first_token_mass[:, :, P - 1 + j])
        assert torch.equal(keys_j, s.top_keys[:, :, P - 1 + j])
        assert torch.equal(weights_j, s.top_weights[:, :, P - 1 + j])
    assert seen.text == model.generate("the bank of the river", 6, temperature=1.0, seed=3)
    assert set(seen.to_dict()["summaries"]) == {"entropy", "first_token_mass", "top_keys",
                                                "top_weights"}  # fmt: skip
    with pytest.raises(ValueError, match="kept summaries .* not its weights: read .summary"):
        seen.row(0)
    with pytest.raises(ValueError, match="kept summaries"):
        _ = seen.weights


def test_summaries_keep_a_few_numbers_a_row_beyond_the_rows_limit(monkeypatch):
    model = tiny(decoder())
    monkeypatch.setattr("qkv.inspect.generation.RECORD_MAX_BYTES", 1000)  # 30 tokens' rows: 7.8 KiB
    seen = model.generate("the bank", 30, record="summaries")
    assert seen.summaries.entropy.shape == (2, 2, seen.prompt_length + seen.generated - 1)
    rows = model.generate("the bank", 3, record="all")
    with pytest.raises(ValueError, match="kept its rows, not summaries"):
        rows.summary(0)
    # in a notebook: a row per generated token, the mean entropy of the row that chose it
    shown = seen._repr_html_()
    assert shown.count("<tr><td>") == seen.generated
    assert f"<td>{float(seen.summary(29)[0].mean()):.3f}</td>" in shown
    assert "summaries of 2 layers x 2 heads" in repr(seen)


def test_docs_generate_md_shows_these_numbers(smollm2, recorded):
    """docs/generate.md's table is SmolLM2's own numbers for this generation."""
    doc = (Path(__file__).parents[2] / "docs" / "generate.md").read_text(encoding="utf-8")
    assert repr(recorded.text) in doc
    # the greedy text is not the CPU's round-off: each token's logit leads the next by far
    # more than float32's summation order moves it (1e-4)
    with torch.inference_mode():
        logits = smollm2.model(torch.tensor([recorded.ids[:-1]])).logits[0]
    two = logits[recorded.prompt_length - 1 :].topk(2, dim=-1).values
    assert float((two[:, 0] - two[:, 1]).min()) > 0.01
    row = recorded.row(5)
    assert recorded.pieces[recorded.prompt_length + 5] == " beauty"
    for layer, head in [(0, 0), (15, 3), (29, 8)]:
        top = row[layer, head].topk(3)
        (line,) = [x for x in doc.splitlines() if x.startswith(f"| {layer}, {head} | ")]
        # the weights to their 4 decimals' worth: the last digit is the CPU's summation order
        shown = re.findall(r"('.*?') (\d\.\d{4})", line)
        pieces = [ast.literal_eval(piece) for piece, _ in shown]
        assert pieces == [recorded.pieces[k] for k in top.indices]
        assert [float(w) for _, w in shown] == pytest.approx(top.values.tolist(), abs=2e-4)
    river = row[:, :, 1].flatten().argmax().item()
    assert divmod(river, 9) == (15, 3)


# ------------------------------------------------------------------ the page


def test_the_page_holds_the_tokens_and_the_generations_own_weights(recorded, tmp_path):
    path = write_generation_page(tmp_path / "gen.html", recorded)
    page = path.read_text(encoding="utf-8")
    data = read_generation_page(page)
    assert data["pieces"] == recorded.pieces and data["tokens"] == recorded.tokens
    assert data["prompt_length"] == recorded.prompt_length
    assert len(data["rows"]) == recorded.generated
    for j, row in enumerate(data["rows"]):  # exactly: the float32 numbers themselves
        assert torch.equal(torch.from_numpy(row.copy()), recorded.row(j))
    for piece in recorded.pieces[recorded.prompt_length :]:
        assert f">{piece}</button>" in page
    assert "http" not in page.replace("http-equiv", "")  # nothing to fetch
    assert [p.name for p in tmp_path.iterdir()] == ["gen.html"]  # no staging file left


def test_the_page_refuses_a_head_it_does_not_hold(recorded, tmp_path):
    with pytest.raises(ValueError, match=r"head 12 was not recorded; the recorded heads are \["):
        write_generation_page(tmp_path / "gen.html", recorded, head=(0, 12))
    with pytest.raises(ValueError, match="the extension must be .html"):
        write_generation_page(tmp_path / "gen.png", recorded)
    assert list(tmp_path.iterdir()) == []


def test_a_clicked_token_shows_its_row_offline_in_chromium(recorded, tmp_path):
    page_file = write_generation_page(tmp_path / "gen.html", recorded)
    with offline(page_file) as page:
        assert page.locator("button.token.generated").count() == recorded.generated
        assert page.locator("#layer option").count() == 30
        page.select_option("#layer", "7")
        page.select_option("#head", "4")
        page.locator("button.token[data-step='3']").click()
        page.wait_for_function("document.querySelectorAll('#row li').length > 0")
        listed = page.eval_on_selector_all(
            "#row li", "items => items.map(li => [Number(li.dataset.k), Number(li.dataset.w)])"
        )
        colored = page.eval_on_selector_all(
            "#text .token",
            "ts => ts.map(t => t.dataset.w === undefined ? null : Number(t.dataset.w))",
        )
        title = page.inner_text("#row-title")
    want = recorded.row(3)[7, 4].tolist()
    P = recorded.prompt_length
    assert sorted(k for k, _ in listed) == list(range(P + 3))
    assert all(w == want[k] for k, w in listed)  # float32 values, shown exactly
    assert [w for _, w in listed] == sorted(want, reverse=True)
    assert colored == want + [None] * (len(recorded.ids) - P - 3)
    assert "generated token 3" in title and "layer 7, head 4" in title


@contextmanager
def offline(page_file: Path):
    """A Chromium page showing `page_file`, drawn, with every other request blocked; after
    the page is closed, none may have been made."""
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        try:
            context = browser.new_context(viewport={"width": 1000, "height": 800})
            outside = only_file(context, page_file)
            page = context.new_page()
            errors: list[str] = []
            page.on("pageerror", lambda error: errors.append(str(error)))
            page.goto(page_file.as_uri())
            page.wait_for_function("window.qkvReady === true", timeout=10_000)
            yield page
            assert errors == []
        finally:
            browser.close()
    assert outside == [], f"the page asked the network for {outside}"


# ------------------------------------------------------------------ the command line


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "qkv.cli", *args], capture_output=True, text=True, timeout=120
    )


def test_qkv_generate_attention_writes_the_page_of_the_generation(smollm2, tmp_path):
    out = tmp_path / "pages" / "gen.html"
    result = run("generate", PROMPT, "-n", "5", "--attention", str(out), "--layers", "0,29",
                 "--heads", "3")  # fmt: skip
    assert result.returncode == 0, result.stderr
    seen = smollm2.generate(PROMPT, 5, record=Recording([0, 29], [3]))
    assert result.stdout == f"{PROMPT}{seen.text}\nwrote {out}\n"
    data = read_generation_page(out.read_text(encoding="utf-8"))
    assert (data["layers"], data["heads"]) == ([0, 29], [3])
    for j, row in enumerate(data["rows"]):
        torch.testing.assert_close(torch.from_numpy(row.copy()), seen.row(j), atol=1e-6, rtol=0)


def test_qkv_generate_attention_bad_input_is_one_line_exit_2_and_nothing_written(tmp_path):
    # one model load: the heads' range is checked by the same check_indices (library tests)
    args = ["--layers", "30"]
    message = "error: layer 30 is out of range: smollm2 has 30 layers (0-29)"
    out = tmp_path / "gen.html"
    result = run("generate", PROMPT, "-n", "3", "--attention", str(out), *args)
    assert result.returncode == 2
    assert result.stderr.strip() == message and result.stdout == ""
    assert list(tmp_path.iterdir()) == []


def test_qkv_generate_attention_checks_its_options_before_loading(tmp_path):
    result = run("generate", PROMPT, "--layers", "0")
    assert (result.returncode, result.stderr.strip()) == (
        2, "error: --layers and --heads choose what --attention FILE.html shows")  # fmt: skip
    result = run("generate", PROMPT, "--attention", str(tmp_path / "gen.png"))
    assert result.returncode == 2 and "must end in .html" in result.stderr
    assert list(tmp_path.iterdir()) == []


def test_a_generation_displays_itself_in_a_notebook(smollm2):
    """Its _repr_html_ is the page of `qkv generate --attention`, inline in an iframe; its
    repr is one short line."""
    import html as markup

    from qkv.viz.generation import read_generation_page

    seen = smollm2.generate("The river bank", 3, record={"layers": [0, 29], "heads": [0]})
    shown = seen._repr_html_()
    assert shown.startswith("<iframe") and "http://" not in shown and "https://" not in shown
    page = markup.unescape(shown.split('srcdoc="', 1)[1].split('"', 1)[0])
    assert read_generation_page(page)["pieces"] == seen.pieces
    assert len(repr(seen)) < 200 and "\n" not in repr(seen)

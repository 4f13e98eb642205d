"""`qkv demo` (what `make demo` runs): the article's walk through self-attention, on its own
sentence, with MiniLM.

Each section is text for a person, in the article's order: tokens, the seven steps for
"bank" getting context from "river", what contributed most, heads and layers, the sense
probe, the same question asked causally (hide "river" from "bank"; hide all of its context),
and a report folder with the interactive page and heatmaps.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Annotated

import typer

from qkv.cli.errors import user_errors
from qkv.inspect.article import SENTENCE


def demo(
    out: Annotated[Path, typer.Option(help="the report folder to write")] = Path("qkv-demo"),
) -> None:
    """The article's walk on its own sentence, with the embedded MiniLM's real numbers."""
    with user_errors(out):
        for section in article_walk(out):
            typer.echo(section + "\n")
    typer.echo(f"(sentence: {SENTENCE!r}; every number above is MiniLM's own)")


def free_folder(path: Path) -> Path:
    """path, or path-2, path-3, ... : the first that does not exist or is empty."""
    candidate, n = path, 1
    while candidate.exists() and (not candidate.is_dir() or any(candidate.iterdir())):
        n += 1
        candidate = path.with_name(f"{path.name}-{n}")
    return candidate


def _indented(text: str) -> str:
    return "\n".join("   " + line for line in text.splitlines())


def article_walk(out: Path) -> Iterator[str]:
    """Yield the demo's sections one by one (so a terminal shows each as it is ready)."""
    from qkv.inspect.probe import probe
    from qkv.inspect.trace import trace
    from qkv.pretrained import load
    from qkv.viz.lines import probe_lines
    from qkv.viz.narrate import contributions, heads_and_layers, narrate, tokens_line

    minilm = load("minilm")
    yield (
        f'The article asks how a model knows that "bank" in "{SENTENCE}" is a river bank.\n'
        "Here is MiniLM (all-MiniLM-L6-v2, a 6-layer BERT) answering it with its own numbers."
    )
    seen = minilm.attentions(SENTENCE)  # the one forward pass over the sentence
    traced = trace(minilm, SENTENCE, "bank", "river", attentions=seen)
    yield "1. " + tokens_line(traced)
    yield '2. The article\'s steps, query word "bank", key word "river":\n' + narrate(traced)
    yield "3. " + contributions(traced)
    yield "4. " + heads_and_layers(traced)
    senses = probe(minilm, "bank")
    yield (
        '5. Context pulls the two senses of "bank" apart: the same word in 8 river and 8 money\n'
        "   sentences, its vector before attention and after each layer.\n" + probe_lines(senses)
    )
    from qkv.inspect.hide import hide, senses_without_context
    from qkv.viz.lines import hide_lines, senses_lines

    hidden = hide(minilm, SENTENCE, "river", query="bank")
    yield (
        '6. Asked causally: take "river" away from "bank" (a mask, exactly as padding) in one\n'
        "   head at a time, then in all of them.\n" + _indented(hide_lines(hidden, top=5))
    )
    without = senses_without_context(minilm, "bank")
    yield (
        '7. Hide every other word from "bank" in the 16 sentences, and its two senses no longer\n'
        "   separate: the context did it.\n" + _indented(senses_lines(without))
    )
    folder = free_folder(out)
    from qkv.viz import write_report
    from qkv.viz.plots import probe_plot
    from qkv.viz.tour import write_tour

    write_report(
        folder,
        seen.weights,
        seen.tokens,
        title=f"MiniLM: {SENTENCE}",
        text=SENTENCE,
        head=(traced.layer, traced.head),
        query=traced.query_index,
        extra={
            "explained": f"bank <- river, layer {traced.layer}, head {traced.head}",
        },
        beside={"Start with the guided tour: the article's steps, one by one": "tour.html"},
        vectors=seen.vectors(),
        scale=seen.scale,
        causal=seen.causal,  # False: MiniLM is an encoder, every token sees every other
    )
    probe_plot(senses, folder / "bank_senses.png")
    write_tour(minilm, SENTENCE, folder / "tour.html")  # the page a learner opens first
    files = "\n".join(f"   {path}" for path in sorted(folder.iterdir()))
    yield (
        f"8. The report: open {folder / 'tour.html'} (the guided tour) or "
        f"{folder / 'index.html'} in a browser (no network needed).\n{files}"
    )

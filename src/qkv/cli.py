"""The `qkv` command. Thin: every verb calls a library function and prints its result."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer

from qkv.cli_errors import check_out, user_errors

app = typer.Typer(
    help="qkv: the transformer's self-attention mechanism, real, fast and inspectable.",
    no_args_is_help=True,
    add_completion=False,
)

Model = Annotated[str, typer.Option("--model", "-m", help="embedded name, folder, .gguf or id")]
Backend = Annotated[
    str | None,
    typer.Option(help="attention backend: auto, flash, sdpa, eager, loop (see `qkv backends`)"),
]


@app.callback()
def _root() -> None:
    """Keeps `qkv VERB` a group of verbs even while there are few of them."""


@app.command()
def version() -> None:
    """Print qkv's version and the torch it runs on."""
    import torch

    import qkv

    typer.echo(f"qkv {qkv.__version__} (torch {torch.__version__})")


GEMM_NAMES = {"onednn": "oneDNN", "blas": "torch's BLAS"}
INPUT_NAMES = {"int8": "8-bit inputs (oneDNN)", "bfloat16": "bfloat16 inputs"}


@app.command()
def backends(
    compare: Annotated[
        str | None,
        typer.Option(
            help="lengths, e.g. 16,64,128: each backend against the article's loop on random "
            "q, k, v, their largest difference and how many times longer the loop takes"
        ),
    ] = None,
    verbose: Annotated[
        bool, typer.Option("--verbose", "-v", help="also what this CPU can do, and the choices")
    ] = False,
) -> None:
    """List the attention backends, fastest first."""
    from qkv.attention import BACKENDS, backend_names

    if compare is None:
        for name in backend_names():
            if name == "auto":
                typer.echo("auto     the fastest backend that supports the inputs")
            else:
                typer.echo(f"{name:<8} {BACKENDS[name].description}")
        if verbose:
            import torch

            from qkv.cpu import (
                capability,
                choose_gemm,
                choose_int8_inputs,
                choose_precision,
                freed_memory,
            )

            precision, why = choose_precision()
            typer.echo(f"\nthis CPU: {capability().describe()}; {torch.get_num_threads()} threads")
            typer.echo(f"embed(precision='auto'): {precision}, since {why}")
            library, why = choose_gemm()
            typer.echo(f"float32 Linear products: {GEMM_NAMES[library]}, since {why}")
            from qkv.nn.quantized import int4_available

            typer.echo("generate(precision='auto'): a .gguf file's 4-bit matrices in 4 bits, "
                       + ("since this torch has the CPU int4 kernel" if int4_available() else
                          f"but torch {torch.__version__} has no CPU int4 kernel: the weights "
                          "as loaded"))  # fmt: skip
            typer.echo("  each token after the prompt's through FastStep (few operations a "
                       "step), where a model's blocks allow it")  # fmt: skip
            inputs, why = choose_int8_inputs()
            typer.echo(f"  its 8-bit LM head with {INPUT_NAMES[inputs]}, since {why}")
            typer.echo(f"memory: {freed_memory()}")
        return
    from qkv.attention.compare import TOLERANCE, compare_backends

    with user_errors():
        try:
            lengths = [int(part) for part in compare.split(",")]
        except ValueError:
            raise ValueError(f"--compare takes lengths like 16,64,128, got {compare!r}") from None
        rows = compare_backends(lengths)
    typer.echo("causal attention, 4 heads of 64 numbers, float32 (the loop: float64, one pair")
    typer.echo("at a time); each backend's largest difference from the loop, and how many")
    typer.echo("times longer the loop takes:")
    for row in rows:
        close = "below" if row.max_difference < TOLERANCE else "ABOVE"
        typer.echo(f"  T={row.length:<5} {row.backend:<6} difference {close} {TOLERANCE:g}, "
                   f"the loop takes {row.ratio:,.0f}x as long")  # fmt: skip


@app.command()
def models(
    as_json: Annotated[bool, typer.Option("--json", help="one JSON line per model type")] = False,
) -> None:
    """List the architectures qkv reads, and how each departs from the article's attention.

    Each row is what qkv computes for transformers' default config of that model type."""
    from dataclasses import asdict

    from qkv.inspect.anatomy import family_models

    found = family_models()
    if as_json:
        for model in found:
            typer.echo(json.dumps(asdict(model)))
        return
    header = ("model type", "family", "shape", "positions", "norms", "window", "scores")
    rows = [header] + [
        (m.model_type, m.family, *(
            (m.anatomy.shape, m.anatomy.position, m.anatomy.norm, m.anatomy.window,
             m.anatomy.scores) if m.anatomy else ("?", f"({m.problem})", "", "", "")))
        for m in found
    ]  # fmt: skip
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    for row in rows:
        typer.echo("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())


@app.command()
def generate(
    prompt: str,
    model: Model = "smollm2",
    max_new_tokens: Annotated[
        int | None,
        typer.Option("--max-new-tokens", "-n", help="default: 64, or an encoder-decoder's window"),
    ] = None,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    seed: int | None = None,
    stop: Annotated[list[str] | None, typer.Option(help="stop at this text (repeatable)")] = None,
    chat: Annotated[bool, typer.Option(help="wrap the prompt in the chat template")] = False,
    system: str | None = None,
    backend: Backend = None,
    int4: Annotated[bool, typer.Option(help="keep a .gguf file's 4-bit weights packed")] = False,
    precision: Annotated[
        str,
        typer.Option(
            help="auto: a .gguf file's 4-bit matrices in 4 bits on the CPU; loaded: "
            "the weights as loaded (transformers' numbers); int4"
        ),
    ] = "auto",
    attention: Annotated[
        Path | None,
        typer.Option(help="write a page where each generated token shows what it attended to"),
    ] = None,
    layers: Annotated[
        str | None, typer.Option(help="--attention's layers, e.g. 0,2,5 or 0-3 (default: all)")
    ] = None,
    heads: Annotated[
        str | None, typer.Option(help="--attention's heads, e.g. 0,2 (default: all)")
    ] = None,
) -> None:
    """Continue PROMPT with a pretrained decoder, printing tokens as they come."""
    from qkv import load

    with user_errors(attention):
        if not prompt.strip():
            raise ValueError(
                "the prompt is empty; give the text to continue, e.g. qkv generate 'The river bank'"
            )
        from qkv.generate import Sampling

        Sampling(temperature, top_k, top_p, seed)  # checked before the model loads
        if precision not in ("auto", "loaded", "int4"):
            raise ValueError(f"--precision is auto, loaded or int4, not {precision!r}")
        if attention is None and (layers is not None or heads is not None):
            raise ValueError("--layers and --heads choose what --attention FILE.html shows")
        if attention is not None:
            if attention.suffix.lower() not in (".html", ".htm"):
                raise ValueError(f"--attention {attention} must end in .html")
            check_out(attention, (".html", ".htm"))
        pretrained = load(model, backend=backend, int4=int4)
        recording = None
        if attention is not None:
            recording = _generation_recording(pretrained, prompt, layers, heads, model, chat,
                                              system, max_new_tokens or 64)  # fmt: skip

        def show(row: int, piece: str) -> None:
            sys.stdout.write(piece)
            sys.stdout.flush()

        from qkv.models import EncoderDecoder

        seq2seq = isinstance(pretrained.model, EncoderDecoder)
        if max_new_tokens is None:  # an encoder-decoder writes a new text, up to its window
            max_new_tokens = pretrained.context_window if seq2seq else 64
        if not chat and not seq2seq:
            typer.echo(prompt, nl=False)  # a decoder continues the prompt
        seen = pretrained.generate(
            prompt, max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
            seed=seed, stop=stop or (), stream=show, chat=chat, system=system, record=recording,
            precision=precision,
        )  # fmt: skip
        typer.echo()
        if attention is not None:
            from qkv.viz.generation import write_generation_page

            attention.parent.mkdir(parents=True, exist_ok=True)  # as `qkv show` makes its folders
            write_generation_page(attention, seen, title=f"{model}: attention while generating")
            typer.echo(f"wrote {attention}")


def _generation_recording(pretrained, prompt, layers, heads, model, chat, system, new):
    """generate's `record` for --attention, every choice checked before any token is made:
    the layers and heads in range, what they keep within the library's and the page's limits."""
    from qkv.generate import Recording, check_recording_size
    from qkv.models import Decoder
    from qkv.viz.generation import check_page_size

    if not isinstance(pretrained.model, Decoder):
        raise ValueError(f"--attention shows a decoder's self-attention; {model} is not a decoder")
    cfg = pretrained.model.config
    L, H = cfg.num_layers, cfg.block.num_heads
    recording = Recording(_numbers(layers, "layers", L, model) or "all",
                          _numbers(heads, "heads", H, model))  # fmt: skip
    kept_layers, kept_heads = recording.resolve(L, H, model)
    text = pretrained._chat(prompt, system) if chat else prompt
    P = len(pretrained.tokenizer.encode(text, add_special_tokens=not chat).ids)
    check_recording_size(len(kept_layers), len(kept_heads), P, new)
    check_page_size(len(kept_layers), len(kept_heads), P, new)
    return recording


@app.command()
def embed(
    sentences: list[str],
    model: Model = "minilm",
    as_json: Annotated[bool, typer.Option("--json", help="one JSON line per sentence")] = False,
    backend: Backend = None,
) -> None:
    """Sentence vectors; shown as their cosine similarities, or as JSON lines."""
    from qkv import load

    with user_errors():
        vectors = load(model, backend=backend).embed(sentences)
    if as_json:
        for sentence, vector in zip(sentences, vectors.tolist(), strict=True):
            typer.echo(json.dumps({"sentence": sentence, "embedding": vector}))
        return
    unit = vectors / vectors.norm(dim=-1, keepdim=True)
    similarity = unit @ unit.T
    typer.echo(f"{len(sentences)} sentences, {vectors.shape[1]} numbers each; cosine similarity:")
    for i, sentence in enumerate(sentences):
        row = " ".join(f"{s:+.3f}" for s in similarity[i].tolist())
        typer.echo(f"  [{i}] {row}  {sentence}")


@app.command()
def explain(
    text: str,
    query: Annotated[str, typer.Option(help='the word getting context, e.g. bank or "bank#2"')],
    key: Annotated[str, typer.Option(help="the word giving context")],
    model: Model = "minilm",
    layer: Annotated[
        int | None, typer.Option(help="counted from 0; default: where query attends most to key")
    ] = None,
    head: Annotated[int | None, typer.Option(help="counted from 0")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="every number, as JSON")] = False,
    target: Annotated[
        str | None, typer.Option(help="encoder-decoder models: the decoder's text (query word)")
    ] = None,
    backend: Backend = None,
) -> None:
    """The article's steps for QUERY getting context from KEY in TEXT, with real numbers."""
    from qkv import load
    from qkv.inspect.trace import trace
    from qkv.viz.narrate import contributions, heads_and_layers, narrate, tokens_line

    with user_errors():
        pretrained = load(model, backend=backend)
        traced = trace(pretrained, text, query, key, layer=layer, head=head, target=target)
    if as_json:
        typer.echo(json.dumps(traced.to_dict()))
        return
    for part in (tokens_line, narrate, contributions, heads_and_layers):
        typer.echo(part(traced) + "\n")


@app.command()
def probe(
    word: str,
    sentences: Annotated[
        Path | None,
        typer.Option(
            help="a text file, one sentence a line, or 'label<TAB>sentence', or "
            "'label<TAB>cue<TAB>sentence' (cue: the word that tells the sense)"
        ),
    ] = None,
    model: Model = "minilm",
    out: Annotated[Path | None, typer.Option(help="write the similarity matrices as a PNG")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="every number, as JSON")] = False,
    hide_context: Annotated[
        bool,
        typer.Option(
            help="also hide every other word from WORD (every layer and head): do its senses "
            "still separate?"
        ),
    ] = False,
) -> None:
    """How context separates the senses of WORD across sentences, layer by layer."""
    from qkv import load
    from qkv.inspect.probe import probe as run_probe
    from qkv.viz.lines import probe_lines
    from qkv.viz.plots import probe_plot

    with user_errors(out):
        texts, labels, cues = _read_sentences(sentences) if sentences else (None, None, None)
        if out is not None:
            check_out(out, (".png",))
        pretrained = load(model)
        result = run_probe(pretrained, word, texts, labels, cues=cues)
        senses = None
        if hide_context:
            from qkv.inspect.hide import senses_without_context

            senses = senses_without_context(pretrained, word, result.sentences, result.labels)
        if out is not None:
            out.parent.mkdir(parents=True, exist_ok=True)  # as `qkv show` makes its folders
            probe_plot(result, out)
    if as_json:
        data = result.to_dict()
        if senses is not None:
            data["hidden_context"] = senses.to_dict()
        typer.echo(json.dumps(data))
        return
    typer.echo(probe_lines(result))
    if senses is not None:
        from qkv.viz.lines import senses_lines

        typer.echo("\n" + senses_lines(senses))
    if out is not None:
        typer.echo(f"wrote {out}")


def _read_sentences(path: Path) -> tuple[list[str], list[str] | None, list[str] | None]:
    """One sentence a line: 'sentence', 'label<TAB>sentence' or 'label<TAB>cue<TAB>sentence'
    (the cue: the word that tells the sense), the same on every line; blank lines skipped."""
    if path.is_dir():
        raise ValueError(f"{path} is a folder; --sentences takes a text file, one sentence a line")
    if not path.exists():
        raise ValueError(f"{path} does not exist")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"{path} is not UTF-8 text (byte {error.start}: {error.reason})") from None
    lines = [(n, line) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
    if not lines:
        raise ValueError(f"{path} is empty; write one sentence a line, two at least")
    forms = "'sentence', 'label<TAB>sentence' or 'label<TAB>cue<TAB>sentence'"
    first, columns = lines[0][0], lines[0][1].count("\t") + 1
    for n, line in lines:
        found = line.count("\t") + 1
        if found != columns or found > 3:
            raise ValueError(
                f"{path} line {n} has {found} tab-separated columns"
                + (f", line {first} has {columns}" if n != first else "")
                + f"; give every line the same form: {forms}"
            )
    rows = [line.split("\t") for _, line in lines]
    if columns == 3:
        labels, cues, texts = zip(*rows, strict=True)
        return list(texts), [label.strip() for label in labels], [cue.strip() for cue in cues]
    if columns == 2:
        labels, texts = zip(*rows, strict=True)
        return list(texts), [label.strip() for label in labels], None
    return [line for _, line in lines], None, None


@app.command()
def show(
    text: str,
    model: Model = "minilm",
    out: Annotated[
        Path,
        typer.Option(help="FILE.html (interactive page), FILE.png (heatmaps) or a report folder"),
    ] = Path("qkv-show.html"),
    layers: Annotated[
        str | None, typer.Option(help="a PNG grid of these layers, e.g. 0,2,5")
    ] = None,
    heads: Annotated[str | None, typer.Option(help="a PNG grid of these heads, e.g. 0-3")] = None,
    layer: Annotated[int | None, typer.Option(help="the one head to show: its layer")] = None,
    head: Annotated[int | None, typer.Option(help="the one head to show, from 0")] = None,
    target: Annotated[
        str | None,
        typer.Option(help="encoder-decoder models: the decoder's text; shows cross-attention"),
    ] = None,
    backend: Backend = None,
    region: Annotated[
        str | None,
        typer.Option(help="Q0:Q1,K0:K1: these queries x keys of --layer/--head, every weight"),
    ] = None,
    transformers: Annotated[
        bool,
        typer.Option(
            "--transformers",
            help="load MODEL with transformers, any family it reads, "
            "on qkv's attention (docs/hf.md)",
        ),
    ] = False,
) -> None:
    """Every layer's and head's attention over TEXT: a page, heatmaps, or a report folder.

    A .png is one head's heatmap (--layer, --head), or with --layers/--heads a grid of
    every chosen layer x head. With --target, an encoder-decoder's cross-attention: the
    target's tokens down, TEXT's across (a page, a .png or a report folder). A text of more
    than 512 tokens is drawn from its summaries (docs/long.md): heatmaps where each cell is the
    maximum of its block of weights, a page of per-head summaries; --region opens a part at
    full resolution. With --transformers, MODEL (a folder or hub id) is loaded by transformers
    and run on qkv's attention (qkv.hf), so families qkv does not implement show too.
    """
    from qkv import load
    from qkv.attention.inputs import check_indices
    from qkv.models import Decoder, Encoder
    from qkv.viz import head_heatmap, model_view, write_html, write_report

    with user_errors(out):
        check_out(out)
        if transformers:
            if backend is not None:
                raise ValueError(
                    "--backend chooses the backend of qkv's own models; with "
                    "--transformers qkv's attention takes the fastest (auto)"
                )
            import qkv.hf

            pretrained = qkv.hf.load(model)
        else:
            pretrained = load(model, backend=backend)
        # the one forward pass; a long text is drawn from summaries, never from every weight
        long = len(pretrained.encode(text).ids) > LONG
        seen = pretrained.attentions(text, target=target, weights=False if long else None)
        if region is not None or max(len(seen.tokens), len(seen.query_tokens or ())) > LONG:
            _show_long(seen, out, model, text, layers, heads, layer, head, region)
            typer.echo(f"wrote {out}")
            return
        L, H = seen.weights.shape[:2]
        for name, value, most in (("layer", layer, L), ("head", head, H)):
            if value is not None:
                check_indices(name, [value], most, model)
        chosen = (layer or 0, head or 0) if layer is not None or head is not None else None
        common = {"title": f"{model}: {text[:60]}", "text": text, "head": chosen}
        if out.suffix.lower() == ".png" and (layers or heads):
            model_view(seen.weights, seen.pieces, out, layers=_numbers(layers, "layers", L, model),
                       heads=_numbers(heads, "heads", H, model),
                       query_tokens=seen.query_tokens)  # fmt: skip
        elif out.suffix.lower() == ".png":
            lh = chosen or (0, 0)
            kind = " cross-attention" if target is not None else ""
            head_heatmap(seen.weights[lh], seen.pieces, out,
                         title=f"{model}{kind} L{lh[0]} H{lh[1]}",
                         query_tokens=seen.query_tokens)  # fmt: skip
        else:  # a page, which traces a clicked pair from the q, k, v vectors
            from qkv.inspect.records import why_not_redone as untraceable
            from qkv.viz.page_vectors import page_trace

            vectors = scores = None
            cross = target is not None  # the decoder's q over the encoder output's k and v
            why = untraceable(seen.records, cross=cross)
            if why is not None:  # the page would redo the pairs without it: wrong numbers
                typer.echo(f"(the page traces no pair: {why}; qkv explain and qkv serve "
                           "trace this model)", err=True)  # fmt: skip
            elif cross:
                vectors, scores = page_trace(seen.records, cross=True)
            elif transformers or isinstance(pretrained.model, Encoder | Decoder):
                relative = getattr(pretrained.model.config, "position", None) == "relative"
                vectors, scores = page_trace(seen.records, bias_is_distance=relative)
            write = write_html if out.suffix.lower() in (".html", ".htm") else write_report
            write(out, seen.weights, seen.pieces, vectors=vectors, causal=seen.causal,
                  scale=seen.scale, scores=scores, query_tokens=seen.query_tokens,
                  **common)  # fmt: skip
    typer.echo(f"wrote {out}")


LONG = 512  # tokens beyond which `show` draws summaries rather than every weight


def _show_long(seen, out: Path, model: str, text: str, layers, heads, layer, head, region):
    """`show` of a long text (or of a --region): from summaries computed a chunk of queries at
    a time, never the (L, H, T, T) weights."""
    from qkv.attention.inputs import check_indices
    from qkv.inspect.summaries import region as region_of
    from qkv.inspect.summaries import summarize
    from qkv.viz import head_heatmap
    from qkv.viz.long import downsampled_grid, downsampled_heatmap, summary_page

    L, H = len(seen.layers), len(seen.heads)
    for name, value, most in (("layer", layer, L), ("head", head, H)):
        if value is not None:
            check_indices(name, [value], most, model)
    lh = (layer or 0, head or 0)
    suffix = out.suffix.lower()
    if region is not None:
        if suffix != ".png":
            raise ValueError("a --region is drawn as PNG; use --out FILE.png")
        spans = _region(region, len(seen.query_tokens or seen.tokens), len(seen.tokens))
        (q0, q1), (k0, k1) = spans
        weights = region_of(seen.records[lh[0]], queries=spans[0], keys=spans[1], heads=[lh[1]])
        queries = seen.query_tokens or seen.pieces
        head_heatmap(weights[0], seen.pieces[k0:k1], out, query_tokens=queries[q0:q1],
                     title=f"{model} L{lh[0]} H{lh[1]}: queries {q0}-{q1 - 1} over keys "
                     f"{k0}-{k1 - 1}, every weight")  # fmt: skip
        return
    if suffix not in (".png", ".html", ".htm"):
        raise ValueError(f"a text of more than {LONG} tokens is shown as FILE.png or FILE.html "
                         "(from its summaries); a report folder draws every weight")  # fmt: skip
    summary = summarize(seen)
    if suffix == ".png" and (layers or heads):
        downsampled_grid(summary, out, layers=_numbers(layers, "layers", L, model),
                         heads=_numbers(heads, "heads", H, model))  # fmt: skip
    elif suffix == ".png":
        downsampled_heatmap(summary, *lh, out, title=f"{model} L{lh[0]} H{lh[1]}")
    else:
        summary_page(summary, out, title=f"{model}: {text[:60]}", text=text)


def _region(spec: str, Tq: int, Tk: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """'Q0:Q1,K0:K1' -> ((Q0, Q1), (K0, K1)), each a range of token positions from 0."""
    try:
        spans = [tuple(int(end) for end in part.split(":")) for part in spec.split(",")]
    except ValueError:
        spans = []
    if len(spans) != 2 or any(len(span) != 2 for span in spans):
        raise ValueError(f"--region takes Q0:Q1,K0:K1 (token positions from 0), got {spec!r}")
    for what, (first, last), count in (("queries", spans[0], Tq), ("keys", spans[1], Tk)):
        if not 0 <= first < last <= count:
            raise ValueError(f"--region {what} {first}:{last} is not within 0:{count} "
                             "(first < last; the text has that many tokens)")  # fmt: skip
    return spans[0], spans[1]


def _numbers(spec: str | None, name: str, count: int, model: str) -> list[int] | None:
    """'0,2,5' or '0-3' -> [0, 2, 5] or [0, 1, 2, 3]; None for all. Each range's ends are
    checked before it is listed: '0-1000000000' is refused, not built."""
    if spec is None:
        return None
    from qkv.attention.inputs import check_indices

    chosen: list[int] = []
    for part in spec.split(","):
        first, _, last = part.strip().partition("-")
        try:
            ends = [int(first), int(last or first)]
        except ValueError:
            raise ValueError(f"--{name} takes numbers like 0,2,5 or 0-3, got {spec!r}") from None
        check_indices(name[:-1], dict.fromkeys(ends), count, model)
        if ends[0] > ends[1]:
            raise ValueError(f"--{name} {part.strip()} runs backwards; write {last}-{first}")
        chosen += range(ends[0], ends[1] + 1)
        if len(chosen) > count:  # a repeat, refused before the list grows past the model
            break
    return check_indices(name[:-1], chosen, count, model)  # each once


@app.command()
def train(
    config: Annotated[
        Path | None, typer.Argument(help="a TOML file: [model], [data], [train]")
    ] = None,
    preset: Annotated[str | None, typer.Option(help="a named config: bank, reverse, gpt")] = None,
    out: Annotated[Path | None, typer.Option(help="the run folder (default: runs/NAME)")] = None,
    set_: Annotated[
        list[str] | None, typer.Option("--set", help="change one key, e.g. train.lr=1e-3")
    ] = None,
    resume: Annotated[bool, typer.Option(help="continue the run in --out")] = False,
    quiet: Annotated[bool, typer.Option(help="no progress bar")] = False,
) -> None:
    """Train a model from scratch; under torchrun, on every process.

    The config comes from --preset, then CONFIG, then each --set; resuming starts from the
    run's own config.toml. Metrics go to RUN/metrics.jsonl, checkpoints to RUN/checkpoints.
    """
    from qkv.train import RunConfig
    from qkv.train import preset as named
    from qkv.train import train as run_training
    from qkv.train.report import summary

    with user_errors(out):
        name = preset or (config.stem if config else None)
        if out is None:
            if name is None:
                raise ValueError("give a config file, a --preset or the --out run to resume")
            out = Path("runs") / name
        base = named(preset) if preset else RunConfig()
        if resume and config is None and preset is None:
            base = (
                RunConfig.from_toml(out / "config.toml")
                if (out / "config.toml").is_file()
                else base
            )
        if config is not None:
            base = RunConfig.from_toml(config, base)
        settings = base.override(set_ or []).check()
        result = run_training(settings, out, resume=resume, quiet=quiet)
        if result.checkpoint is not None:  # only the first process writes and reports
            typer.echo(summary(result, settings))


@app.command()
def plot(
    run: Path,
    out: Annotated[
        Path | None, typer.Option(help="the PNG to write (default: RUN/loss.png)")
    ] = None,
) -> None:
    """Draw a training run's loss curves (and learning rate) to a PNG."""
    from qkv.train.plot import plot_run

    with user_errors(out):
        typer.echo(f"wrote {plot_run(run, out)}")


Layers = Annotated[str | None, typer.Option(help="these layers only, e.g. 0,2,5 or 0-3")]
Heads = Annotated[str | None, typer.Option(help="these heads only, e.g. 0,2,5 or 0-3")]
Json = Annotated[bool, typer.Option("--json", help="every number, as JSON")]
Png = Annotated[Path | None, typer.Option(help="write a layer x head heatmap PNG")]


def _stack_shape(pretrained) -> tuple[int, int]:
    from qkv.inspect.runs import stack_of

    config = stack_of(pretrained).config
    return config.num_layers, config.block.num_heads


@app.command()
def hide(
    text: str,
    key: Annotated[str, typer.Option(help='the word to hide, e.g. river or "river#2"')],
    query: Annotated[
        str | None, typer.Option(help="the word it is hidden from; default: every word")
    ] = None,
    model: Model = "minilm",
    layers: Layers = None,
    heads: Heads = None,
    top: Annotated[int, typer.Option(help="heads listed, the largest effect first")] = 10,
    out: Png = None,
    as_json: Json = False,
    backend: Backend = None,
) -> None:
    """Which heads carry KEY into QUERY: hide it in each head alone, then in all at once."""
    from qkv import load
    from qkv.inspect.hide import hide as run_hide
    from qkv.viz.lines import hide_lines

    with user_errors(out):
        if top < 1:
            raise ValueError(f"--top must be 1 or more, got {top}")
        if out is not None:
            check_out(out, (".png",))
        pretrained = load(model, backend=backend)
        L, H = _stack_shape(pretrained)
        result = run_hide(pretrained, text, key, query=query,
                          layers=_numbers(layers, "layers", L, model),
                          heads=_numbers(heads, "heads", H, model))  # fmt: skip
        if out is not None:
            from qkv.viz.grids import grid_plot

            who = f"'{query}'" if query else "every word"
            grid_plot([("1 - cosine", result.effect, None)], out, label="change",
                      title=f"{model}: '{key}' hidden from {who}, one head at a time")  # fmt: skip
    typer.echo(json.dumps(result.to_dict()) if as_json else hide_lines(result, top))
    if out is not None and not as_json:
        typer.echo(f"wrote {out}")


@app.command()
def ablate(
    text: str,
    model: Model = "minilm",
    layers: Layers = None,
    heads: Heads = None,
    mode: Annotated[
        str, typer.Option(help="zero, or mean (each head's mean output over reference texts)")
    ] = "zero",
    out: Png = None,
    as_json: Json = False,
    backend: Backend = None,
) -> None:
    """What each head does to TEXT: ablate it alone (zero or mean), then all chosen at once."""
    from qkv import load
    from qkv.inspect.ablate import ablate as run_ablate
    from qkv.viz.lines import ablate_lines

    with user_errors(out):
        if out is not None:
            check_out(out, (".png",))
        pretrained = load(model, backend=backend)
        L, H = _stack_shape(pretrained)
        chosen_layers = _numbers(layers, "layers", L, model) or range(L)
        chosen_heads = _numbers(heads, "heads", H, model) or range(H)
        pairs = [(n, h) for n in chosen_layers for h in chosen_heads]
        result = run_ablate(pretrained, text, pairs, mode=mode)
        if out is not None:
            from qkv.viz.grids import grid_plot

            grid_plot([("1 - cosine", result.effect, None)], out, label="change",
                      title=f"{model}: each head {mode}-ablated alone")  # fmt: skip
    typer.echo(json.dumps(result.to_dict()) if as_json else ablate_lines(result))
    if out is not None and not as_json:
        typer.echo(f"wrote {out}")


@app.command()
def patch(
    clean: str,
    corrupt: str,
    metric: Annotated[
        str,
        typer.Option(
            help="'diff: Mary, John' (log p(' Mary') - log p(' John')) or 'prob: Paris', "
            "of the next token; tokens as written, spaces kept"
        ),
    ],
    model: Model = "smollm2",
    out: Png = None,
    as_json: Json = False,
    backend: Backend = None,
) -> None:
    """Patch CLEAN's head outputs and residual stream into CORRUPT, one at a time, and score
    the next token: which parts of the model carry the difference."""
    from qkv import load
    from qkv.inspect.patch import patch as run_patch
    from qkv.viz.lines import patch_lines

    with user_errors(out):
        if out is not None:
            check_out(out, (".png",))
        result = run_patch(load(model, backend=backend), clean, corrupt, metric)
        if out is not None:
            from qkv.viz.grids import grid_plot

            grids = [("head outputs (layer x head)", result.restored(result.heads), None),
                     ("residual (layer x position)", result.restored(result.residual),
                      result.clean_tokens)]  # fmt: skip
            grid_plot(grids, out, label="restored", title=f"{model}: {result.metric}")
    typer.echo(json.dumps(result.to_dict()) if as_json else patch_lines(result))
    if out is not None and not as_json:
        typer.echo(f"wrote {out}")


@app.command()
def demo(
    out: Annotated[Path, typer.Option(help="the report folder to write")] = Path("qkv-demo"),
) -> None:
    """The article's walk on its own sentence, with the embedded MiniLM's real numbers."""
    from qkv.inspect.demo import SENTENCE, article_walk

    with user_errors(out):
        for section in article_walk(out):
            typer.echo(section + "\n")
    typer.echo(f"(sentence: {SENTENCE!r}; every number above is MiniLM's own)")


@app.command()
def serve(
    model: Annotated[
        list[str] | None,
        typer.Option("--model", "-m", help="a model to serve (repeatable); default: the embedded"),
    ] = None,
    host: Annotated[str, typer.Option(help="the address to listen on; loopback by default")] = (
        "127.0.0.1"
    ),
    port: Annotated[int, typer.Option(help="0 picks a free port")] = 8000,
    max_tokens: Annotated[int, typer.Option(help="tokens per text, at most")] = 128,
    max_long_tokens: Annotated[
        int, typer.Option(help="tokens per long text (read from its summaries), at most")
    ] = 4096,
    timeout: Annotated[float, typer.Option(help="seconds per request, at most")] = 10.0,
    backend: Backend = None,
    quiet: Annotated[bool, typer.Option(help="no request log")] = False,
) -> None:
    """The attention explorer: a local web page and its JSON API (/docs), until Ctrl-C."""
    from qkv import load
    from qkv.io.embedded import EMBEDDED

    with user_errors():
        try:
            from qkv.serve import Limits, bind, create_app
            from qkv.serve import serve as run_server
            from qkv.serve.server import address
        except ModuleNotFoundError as error:
            if (error.name or "").partition(".")[0] not in _SERVE_EXTRA:
                raise
            raise ValueError(
                f"qkv serve needs the [serve] extra ({error.name} is missing); "
                "install it with: pip install 'qkv[serve]'"
            ) from None
        names = list(dict.fromkeys(model or EMBEDDED))  # each once, in the order given
        limits = Limits(max_tokens=max_tokens, max_long_tokens=max_long_tokens, timeout_s=timeout)
        sock = bind(host, port)  # a port in use fails now, not after the models load
        try:
            models = {}
            for name in names:
                typer.echo(f"loading {name}...", err=True)
                models[name] = load(name, backend=backend)
            served = create_app(models, limits)
        except BaseException:
            sock.close()
            raise

    typer.echo(f"qkv serve: {address(sock)} (models: {', '.join(names)}); Ctrl-C stops it")
    run_server(served, sock, quiet=quiet)
    typer.echo("stopped")


# what `pip install 'qkv[serve]'` brings (pyproject.toml), with fastapi's own starlette, pydantic
_SERVE_EXTRA = {"fastapi", "uvicorn", "swagger_ui_bundle", "starlette", "pydantic"}


@app.command()
def lens(
    text: str,
    model: Model = "smollm2",
    token: Annotated[
        str | None, typer.Option(help="the next token to follow, e.g. ' Paris' (one token)")
    ] = None,
    position: Annotated[int, typer.Option(help="the position read, from 0; -1: the last")] = -1,
    top: Annotated[int, typer.Option(help="next tokens shown per layer")] = 5,
    terms: Annotated[int, typer.Option(help="attribution terms shown, the largest first")] = 10,
    attribution: Annotated[
        bool, typer.Option(help="the direct logit attribution (--no-attribution: the lens only)")
    ] = True,
    as_json: Annotated[bool, typer.Option("--json", help="every number, as JSON")] = False,
    backend: Backend = None,
) -> None:
    """A decoder's next-token prediction after each layer (the logit lens), and each head's
    and MLP's direct contribution to the token's logit."""
    from qkv import load
    from qkv.inspect.lens import lens as run_lens
    from qkv.viz.lines import lens_lines

    with user_errors():
        if terms < 0:
            raise ValueError(f"--terms must be 0 or more, got {terms}")
        found = run_lens(load(model, backend=backend), text, position=position, token=token,
                         top=top, attribute=attribution)  # fmt: skip
    typer.echo(json.dumps(found.to_dict()) if as_json else lens_lines(found, terms))


@app.command("heads")
def heads_census(
    model: Model = "minilm",
    top: Annotated[int, typer.Option(help="how many heads to list for each score")] = 5,
    out: Annotated[
        Path | None, typer.Option(help="a PNG scatter: previous-token vs induction per head")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="every score, as JSON")] = False,
    backend: Backend = None,
) -> None:
    """A census of the model's heads: previous-token, induction, first-token (sink), self,
    entropy and window use on built-in prompts; the top heads and each layer's sink mass."""
    from qkv import load
    from qkv.inspect.census import heads
    from qkv.viz.lines import census_lines
    from qkv.viz.plots import census_plot

    with user_errors(out):
        if top < 1:
            raise ValueError(f"--top must be 1 or more, got {top}")
        if out is not None:
            check_out(out, (".png",))
        census = heads(load(model, backend=backend))
        if out is not None:
            out.parent.mkdir(parents=True, exist_ok=True)
            census_plot(census, out)
    if as_json:
        typer.echo(json.dumps(census.to_dict(top)))
        return
    typer.echo(census_lines(census, top))
    if out is not None:
        typer.echo(f"wrote {out}")


def main() -> None:
    """The `qkv` program. The program's process is its own, so it lets glibc keep freed
    memory for its next tensors (`qkv.cpu.reuse_freed_memory`), and moves what its imports
    made (torch's modules and functions, which live as long as it does) out of the garbage
    collector's way (`gc.freeze`): its full passes over them cost 0.1 s before a verb's first
    result. The library leaves every setting of a user's process as the user made it."""
    import gc

    from qkv.cpu import reuse_freed_memory

    gc.freeze()
    reuse_freed_memory()
    app()


if __name__ == "__main__":
    main()

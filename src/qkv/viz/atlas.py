"""`qkv.atlas`: the atlas of a model's heads over a corpus, written as a folder.

    import qkv
    found = qkv.atlas(qkv.load("smollm2"), "corpus.txt", "atlas/")

The folder (docs/atlas.md):

- atlas.json: every head's statistics and top examples, the model, the corpus's fingerprint,
  the token count (`Atlas.to_dict`, each example with its "page");
- index.html: the page that sorts and filters the heads (`qkv.viz.atlas_page`);
- examples/L{layer}H{head}-{rank}.html: each example as the usual attention page, the head's
  real weights among the tokens around its query and key;
- atlas-state.pt: the running sums, so that the same call, run again, resumes.

The state is written as the corpus is read; the other files when it has all been read, each
all or nothing. A folder that holds another run's state (another corpus, model or options) is
refused, and so is a folder of other files.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from qkv.inspect.atlas import Atlas, survey
from qkv.io.files import write_atomically, write_folder_atomically
from qkv.viz.atlas_page import atlas_page
from qkv.viz.report import render_page

STATE = "atlas-state.pt"
WRITTEN = ("atlas.json", "index.html", "examples", STATE)


def atlas(
    pretrained,
    corpus: str | Path,
    out: str | Path,
    *,
    window: int = 256,
    batch: int = 8,
    top: int = 8,
    max_tokens: int | None = 100_000,
    save_every: int = 4,
    progress: Callable[[int, int], object] | None = None,
) -> Atlas:
    """The atlas of `pretrained`'s heads over `corpus` (a text or .jsonl file), written to the
    folder `out`, resumed from it where a run stopped. Options as `qkv.inspect.atlas.survey`
    takes them: window (tokens per window), batch (windows per forward pass), top (examples
    per head), max_tokens (text tokens read at most), save_every (batches between saves),
    progress(windows_done, windows). Returns the `Atlas`."""
    out = check_atlas_folder(out)
    found = survey(pretrained, corpus, out / STATE, window=window, batch=batch, top=top,
                   max_tokens=max_tokens, save_every=save_every, progress=progress)  # fmt: skip
    write_atlas(found, out)
    return found


def check_atlas_folder(out: str | Path) -> Path:
    """`out` as a folder an atlas may be written to: new, empty, or an atlas's own."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out} is a file; give a folder for the atlas")
    if out.is_dir():
        others = sorted(p.name for p in out.iterdir() if p.name not in WRITTEN)
        if others or (any(out.iterdir()) and not (out / STATE).exists()):
            named = ", ".join(others[:3]) or "files"
            raise ValueError(f"{out} holds {named}, not an atlas's; give a new or empty folder")
    return out


def example_page_name(layer: int, head: int, rank: int) -> str:
    return f"examples/L{layer}H{head}-{rank}.html"


def write_atlas(found: Atlas, out: Path) -> None:
    """The atlas's files in `out`: its example pages, atlas.json and index.html."""

    def pages(staging: Path) -> None:
        for layer, heads in enumerate(found.examples):
            for head, examples in enumerate(heads):
                for rank in range(len(examples)):
                    name = example_page_name(layer, head, rank).removeprefix("examples/")
                    (staging / name).write_bytes(example_page(found, layer, head, rank))

    write_folder_atomically(out / "examples", pages, replace=True)
    data = found.to_dict()
    for layer, heads in enumerate(data["examples"]):
        for head, examples in enumerate(heads):
            for rank, example in enumerate(examples):
                example["page"] = example_page_name(layer, head, rank)
    text = json.dumps(data, separators=(",", ":"), allow_nan=False).encode("utf-8")
    write_atomically(out / "atlas.json", lambda file: file.write(text))
    page = atlas_page(data)
    write_atomically(out / "index.html", lambda file: file.write(page))


def example_page(found: Atlas, layer: int, head: int, rank: int) -> bytes:
    """One example's attention page: the head's weights among its tokens, the query chosen."""
    example = found.examples[layer][head][rank]
    pieces = found.contexts[example.window]
    positions = example.positions
    # a token after a gap in the positions shown is marked, so no one reads them as neighbours
    tokens = [("… " if n and positions[n - 1] != at - 1 else "") + pieces[at]
              for n, at in enumerate(positions)]  # fmt: skip
    weights = example.weights.reshape(1, 1, len(positions), len(positions))  # (1, 1, n, n)
    extra = {
        "model": found.source,
        "layer, head": f"{layer}, {head} (counted from 0)",
        "example": f"{rank + 1} of {len(found.examples[layer][head])} of this head",
        "weight": example.weight,
        "window": example.window,
        "query position": example.query,
        "key position": example.key,
        "positions shown": positions,
        "note": "this head's real weights among these tokens of the window (key 0, and the "
        "tokens around the query and the key); weights on the tokens not shown are left out, so "
        "a row may sum below 1. '… ' marks a token after a gap.",
    }
    title = (f"L{layer} H{head} example {rank + 1}: {example.weight:.3f} from token "
             f"{example.query} to token {example.key} of window {example.window}")  # fmt: skip
    return render_page(weights.numpy(), tokens, title=title, text=None, extra=extra,
                       head=(0, 0), query=positions.index(example.query))  # fmt: skip


def read_atlas(folder: str | Path) -> tuple[Atlas, dict]:
    """An atlas folder's atlas.json, as an `Atlas` (without its examples' weights) and as the
    JSON data itself."""
    path = Path(folder) / "atlas.json"
    if not path.is_file():
        raise ValueError(f"{folder} has no atlas.json; give a folder `qkv atlas` wrote")
    data = json.loads(path.read_text(encoding="utf-8"))
    return Atlas.from_dict(data), data

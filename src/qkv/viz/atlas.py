"""`qkv.atlas`: the atlas of a model's heads over a corpus, written as a folder.

    import qkv
    found = qkv.atlas(qkv.load("smollm2"), "corpus.txt", "atlas/")

The folder (docs/atlas.md):

- atlas.json: every head's statistics and top examples, the model, the corpus's fingerprint,
  the token count (`Atlas.to_dict`, each example with its "page");
- index.html: the page that sorts and filters the heads (`qkv.viz.atlas_page`);
- examples/example.html#L{layer}H{head}-{rank}: each example as the usual attention page, the
  head's real weights among the tokens around its query and key; the page's code is written
  once, each layer's examples' data in examples/L{layer}.js (`qkv.viz.atlas_examples`);
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
from qkv.viz.atlas_examples import PAGE, example_address, example_page, layer_file, layer_script
from qkv.viz.atlas_page import atlas_page

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


def write_atlas(found: Atlas, out: Path) -> None:
    """The atlas's files in `out`: examples/ (example.html and a data file per layer),
    atlas.json and index.html."""

    def pages(staging: Path) -> None:
        if any(examples for heads in found.examples for examples in heads):
            (staging / PAGE).write_bytes(example_page(found))
        for layer in range(len(found.examples)):
            (staging / layer_file(layer)).write_bytes(layer_script(found, layer))

    write_folder_atomically(out / "examples", pages, replace=True)
    data = found.to_dict()
    for layer, heads in enumerate(data["examples"]):
        for head, examples in enumerate(heads):
            for rank, example in enumerate(examples):
                example["page"] = example_address(layer, head, rank)
    text = json.dumps(data, separators=(",", ":"), allow_nan=False).encode("utf-8")
    write_atomically(out / "atlas.json", lambda file: file.write(text))
    page = atlas_page(data)
    write_atomically(out / "index.html", lambda file: file.write(page))


def read_atlas(folder: str | Path) -> tuple[Atlas, dict]:
    """An atlas folder's atlas.json, as an `Atlas` (without its examples' weights) and as the
    JSON data itself."""
    path = Path(folder) / "atlas.json"
    if not path.is_file():
        raise ValueError(f"{folder} has no atlas.json; give a folder `qkv atlas` wrote")
    data = json.loads(path.read_text(encoding="utf-8"))
    return Atlas.from_dict(data), data

"""A training run's folder as io reads it: config.toml beside checkpoints/step-NNNNNN/.

`qkv.train` writes run folders; loading only needs to find their checkpoints, so the
naming lives here and train uses it, and io needs nothing of train.

>>> checkpoint_folder(Path("run"), 300).as_posix(), step_of(Path("run/checkpoints/step-000300"))
('run/checkpoints/step-000300', 300)
"""

from __future__ import annotations

import re
from pathlib import Path

from qkv.io.files import staged_name

STEP = re.compile(r"step-(\d+)")
CONFIG = "config.toml"  # the run's RunConfig, as TOML
# what a run writes beside config.toml: a kill mid-write leaves their staging names behind
RUN_FILES = {CONFIG, "metrics.jsonl", "tokenizer", "data"}


def is_run(folder: Path) -> bool:
    """A training run's folder rather than a model folder: config.toml, no config.json."""
    return (folder / CONFIG).is_file() and not (folder / "config.json").exists()


def checkpoint_folder(run: Path, step: int) -> Path:
    return Path(run) / "checkpoints" / f"step-{step:06d}"


def checkpoints(run: Path) -> list[Path]:
    """The run's complete checkpoints, oldest first (staging folders are hidden, unlisted)."""
    folder = Path(run) / "checkpoints"
    if not folder.is_dir():
        return []
    found = [p for p in folder.iterdir() if p.is_dir() and STEP.fullmatch(p.name)]
    return sorted(found, key=step_of)


def staging_leftovers(run: Path) -> list[Path]:
    """What writes cut short by a kill left in the run folder: hidden staging files and
    folders of qkv's own names, in it and in its checkpoints folder (nothing else).

    >>> staging_leftovers(Path("no-such-run"))
    []
    """
    found = []
    for folder, written in ((Path(run), RUN_FILES.__contains__),
                            (Path(run) / "checkpoints", STEP.fullmatch)):  # fmt: skip
        if folder.is_dir():
            found += [p for p in folder.iterdir() if written(staged_name(p.name) or "")]
    return sorted(found)


def step_of(checkpoint: Path) -> int:
    return int(STEP.fullmatch(Path(checkpoint).name).group(1))


def last_checkpoint(run: Path) -> Path:
    """The run's newest checkpoint: a Hugging Face folder that loads like any other."""
    found = checkpoints(run)
    if not found:
        raise ValueError(f"the training run {run} has no checkpoint yet")
    return found[-1]

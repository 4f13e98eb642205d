"""A training run's folder as io reads it: config.toml beside checkpoints/step-NNNNNN/.

`qkv.train` writes run folders; loading only needs to find their checkpoints, so the
naming lives here and train uses it, and io needs nothing of train.

>>> checkpoint_folder(Path("run"), 300).as_posix(), step_of(Path("run/checkpoints/step-000300"))
('run/checkpoints/step-000300', 300)
"""

from __future__ import annotations

import re
from pathlib import Path

STEP = re.compile(r"step-(\d+)")
CONFIG = "config.toml"  # the run's RunConfig, as TOML
# The staging names io.files gives what it writes (".NAME.<8 hex>.tmp|partial|old"), for
# the names a run writes: a kill mid-write leaves them behind, and only these are cleaned.
_STAGED = r"\.{}\.[0-9a-f]{{8}}\.(?:tmp|partial|old)"
STAGED_IN_RUN = re.compile(_STAGED.format(r"(?:config\.toml|metrics\.jsonl|tokenizer|data)"))
STAGED_CHECKPOINT = re.compile(_STAGED.format(r"step-\d+"))


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
    for folder, pattern in ((Path(run), STAGED_IN_RUN),
                            (Path(run) / "checkpoints", STAGED_CHECKPOINT)):  # fmt: skip
        if folder.is_dir():
            found += [p for p in folder.iterdir() if pattern.fullmatch(p.name)]
    return sorted(found)


def step_of(checkpoint: Path) -> int:
    return int(STEP.fullmatch(Path(checkpoint).name).group(1))


def last_checkpoint(run: Path) -> Path:
    """The run's newest checkpoint: a Hugging Face folder that loads like any other."""
    found = checkpoints(run)
    if not found:
        raise ValueError(f"the training run {run} has no checkpoint yet")
    return found[-1]

"""Checkpoints: a Hugging Face folder of the weights, plus what resuming needs.

run/checkpoints/step-000300/ holds config.json, model.safetensors and the tokenizer (so
`qkv.load` reads it like any model folder), and trainer.pt: the optimizer's and the
schedule's states, the random generators' states and the step, which is also the data
position (batches are a function of the step). A checkpoint is written in a hidden
staging folder, every file fsynced, then renamed into place: a crash or a full disk
leaves the previous checkpoint as it was. The last `keep` checkpoints are kept.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import torch
from torch import nn

from qkv.io.checkpoint import export, fill, read_checkpoint
from qkv.io.files import write_folder_atomically
from qkv.io.runs import STEP, checkpoint_folder, checkpoints, step_of

__all__ = ["STEP", "checkpoints", "load_trainer", "load_weights", "save", "step_of"]


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save(
    run: Path,
    step: int,
    state: dict[str, torch.Tensor],
    shadow: nn.Module,
    family,
    model_config,
    hf: dict,
    tokenizer,
    trainer: dict,
    keep: int,
) -> Path:
    """Write checkpoint `step` atomically and prune to the last `keep`; return its folder.

    state: the model's full state dict; shadow: a model of the same config on the CPU that
    it is copied into for export (the trained model may be sharded or compiled).
    """
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    final = checkpoint_folder(run, step)
    previous = checkpoints(run)

    def write(staging: Path) -> None:
        shadow.load_state_dict(state)
        tensors = {k: v.to(torch.float32) for k, v in export(shadow, family, model_config).items()}
        save_file(tensors, staging / "model.safetensors", metadata={"format": "pt"})
        (staging / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
        tokenizer.save(staging)
        torch.save(trainer, staging / "trainer.pt")

    try:  # a checkpoint of this step from before a resume is replaced
        write_folder_atomically(final, write, replace=True)
    except (OSError, SafetensorError, RuntimeError) as error:  # a full disk, a size limit...
        last = f"step {step_of(previous[-1])}" if previous else "none"
        reason = getattr(error, "strerror", None) or str(error).splitlines()[0]
        raise ValueError(
            f"could not write checkpoint step {step} in {final.parent}: {reason}; "
            f"the last checkpoint ({last}) is intact"
        ) from None
    for old in checkpoints(run)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def load_weights(checkpoint: Path, shadow: nn.Module, family, model_config) -> dict:
    """The checkpoint's weights as a state dict of `shadow`'s names (exact, float32)."""
    fill(shadow, family, model_config, read_checkpoint(checkpoint))
    return shadow.state_dict()


def load_trainer(checkpoint: Path) -> dict:
    path = Path(checkpoint) / "trainer.pt"
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # a damaged zip raises several kinds
        raise ValueError(f"{path} is missing or corrupt: {error}") from None

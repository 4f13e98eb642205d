"""`qkv plot RUN`: a run's loss curves (training and validation) and its learning rate."""

from __future__ import annotations

from pathlib import Path

from qkv.io.files import write_atomically
from qkv.train.metrics import read_records
from qkv.viz.paths import png_path


def read_metrics(run: str | Path) -> list[dict]:
    """The records of run/metrics.jsonl, one per optimizer step."""
    path = Path(run) / "metrics.jsonl"
    if not path.is_file():
        raise ValueError(f"{run} has no metrics.jsonl; is it a qkv training run folder?")
    records = read_records(path)
    if not records:
        raise ValueError(f"{path} is empty: the run has not finished a step yet")
    return records


def plot_run(run: str | Path, out: str | Path | None = None) -> Path:
    """Draw the loss per step (and the validation loss where measured) above the learning
    rate, as a PNG at `out` (default: run/loss.png), written all or nothing."""
    records = read_metrics(run)
    out = png_path(Path(run) / "loss.png" if out is None else out)

    # a Figure of its own, saved by its own canvas: no pyplot, no backend chosen for the
    # whole process, nothing left open
    from matplotlib.figure import Figure

    steps = [r["step"] for r in records]
    figure = Figure(figsize=(7, 5), layout="constrained")
    loss_ax, lr_ax = figure.subplots(2, 1, sharex=True, height_ratios=[3, 1])
    loss_ax.plot(steps, [r["loss"] for r in records], lw=1, label="training loss")
    evaluated = [r for r in records if "val_loss" in r]
    if evaluated:
        loss_ax.plot([r["step"] for r in evaluated], [r["val_loss"] for r in evaluated],
                     marker="o", label="validation loss")  # fmt: skip
    loss_ax.set_yscale("log")
    loss_ax.set_ylabel("cross-entropy (nats per token)")
    loss_ax.set_title(f"{Path(run).name}: {steps[-1]} steps")
    loss_ax.legend()
    loss_ax.grid(alpha=0.3, which="both")
    lr_ax.plot(steps, [r["lr"] for r in records], color="gray")
    lr_ax.set_ylabel("learning rate")
    lr_ax.set_xlabel("optimizer step")
    lr_ax.grid(alpha=0.3)
    write_atomically(out, lambda file: figure.savefig(file, format="png", dpi=100))
    return out

"""The progress bar of a training run: loss, learning rate, tokens/s and time left."""

from __future__ import annotations


class Progress:
    """A rich progress bar over optimizer steps; does nothing when quiet."""

    def __init__(self, total: int, done: int, *, quiet: bool = False):
        self.total, self.done, self.quiet = total, done, quiet
        self._bar = None

    def __enter__(self) -> Progress:
        if self.quiet:
            return self
        from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeRemainingColumn
        from rich.progress import Progress as Bar

        self._bar = Bar(
            TextColumn("train"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]}  lr {task.fields[lr]}  {task.fields[speed]}"),
            TextColumn("left"),
            TimeRemainingColumn(),
        )
        self._bar.__enter__()
        self._task = self._bar.add_task(
            "train", total=self.total, completed=self.done, loss="-", lr="-", speed="-"
        )
        return self

    def update(self, step: int, record: dict) -> None:
        if self._bar is None:
            return
        loss = f"{record['loss']:.4f}"
        if "val_loss" in record:
            loss += f" (val {record['val_loss']:.4f})"
        self._bar.update(self._task, completed=step, loss=loss, lr=f"{record['lr']:.2e}",
                         speed=f"{record['tokens_per_s']:,.0f} tok/s")  # fmt: skip

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.__exit__(*exc)

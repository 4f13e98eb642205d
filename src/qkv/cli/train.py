"""`qkv train` and `qkv plot`: train a model from scratch, and draw a run's loss curves."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from qkv.cli.errors import user_errors


def train(
    config: Annotated[
        Path | None, typer.Argument(help="a TOML file: [model], [data], [train]")
    ] = None,
    preset: Annotated[str | None, typer.Option(help="a named config: bank, reverse, gpt")] = None,
    out: Annotated[Path | None, typer.Option(help="the run folder (default: runs/NAME)")] = None,
    set_: Annotated[
        list[str] | None, typer.Option("--set", help="change one key, e.g. train.lr=1e-3")
    ] = None,
    layers: Annotated[
        str | None,
        typer.Option(
            help="each layer's attention, e.g. linear,full: a Gated DeltaNet memory "
            "(linear) or a softmax (full); sets model.layers and model.layer_types"
        ),
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
        settings = base.override(_layer_settings(layers) + (set_ or [])).check()
        result = run_training(settings, out, resume=resume, quiet=quiet)
        if result.checkpoint is not None:  # only the first process writes and reports
            typer.echo(summary(result, settings))


def _layer_settings(layers: str | None) -> list[str]:
    """--layers linear,full as the --set entries it stands for."""
    if layers is None:
        return []
    kinds = [kind.strip() for kind in layers.split(",")]
    listed = ", ".join(f'"{kind}"' for kind in kinds)
    return [f"model.layers={len(kinds)}", f"model.layer_types=[{listed}]"]


def plot(
    run: Annotated[Path, typer.Argument(metavar="RUN")],
    out: Annotated[
        Path | None, typer.Option(help="the PNG to write (default: RUN/loss.png)")
    ] = None,
) -> None:
    """Draw a training run's loss curves (and learning rate) to a PNG."""
    from qkv.train.plot import plot_run

    with user_errors(out):
        typer.echo(f"wrote {plot_run(run, out)}")

"""The `qkv` command. Thin: every verb parses its options, calls a library function and
prints its result. One module per verb or group of verbs; this file lists them, in the order
`qkv --help` shows them.

The verbs import qkv's library inside their functions, on purpose: `qkv --help` and a
mistyped option answer before torch's models, matplotlib or FastAPI are loaded.
"""

from __future__ import annotations

import typer

from qkv.cli.atlas import atlas
from qkv.cli.attribute import attribute
from qkv.cli.circuits import circuits
from qkv.cli.demo import demo
from qkv.cli.embed import embed
from qkv.cli.explain import explain, probe
from qkv.cli.generate import generate
from qkv.cli.info import backends, models, version
from qkv.cli.interventions import ablate, hide
from qkv.cli.lens import heads_census, lens
from qkv.cli.options import Verb
from qkv.cli.patch import patch, path_patch
from qkv.cli.serve import serve
from qkv.cli.show import show
from qkv.cli.tour import tour
from qkv.cli.train import plot, train
from qkv.cli.why import why

app = typer.Typer(
    help="qkv: the transformer's self-attention mechanism, real, fast and inspectable.",
    no_args_is_help=True,
    add_completion=False,
)


@app.callback()
def _root() -> None:
    """Keeps `qkv VERB` a group of verbs even while there are few of them."""


for verb in (version, backends, models, generate, embed, explain, why, probe, show, train, plot,
             hide, ablate, patch, attribute, demo, serve, lens, circuits, atlas, tour):  # fmt: skip
    app.command(cls=Verb)(verb)
app.command("heads", cls=Verb)(heads_census)
app.command("path-patch", cls=Verb)(path_patch)


def main() -> None:
    """The `qkv` program. The program's process is its own, so it lets glibc keep freed
    memory for its next tensors (`qkv.device.reuse_freed_memory`), and moves what its imports
    made (torch's modules and functions, which live as long as it does) out of the garbage
    collector's way (`gc.freeze`): its full passes over them cost 0.1 s before a verb's first
    result. The library leaves every setting of a user's process as the user made it."""
    import gc

    from qkv.device import reuse_freed_memory

    gc.freeze()
    reuse_freed_memory()
    app()


__all__ = ["app", "main"]

"""`qkv version`, `qkv backends` and `qkv models`: what this qkv is and what it can run."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from qkv.cli.errors import user_errors


def version() -> None:
    """Print qkv's version and the torch it runs on."""
    import torch

    from qkv.version import __version__

    typer.echo(f"qkv {__version__} (torch {torch.__version__})")


LINEAR = """
linear attention, with no softmax (Gated DeltaNet, KDA: qkv.attention.linear), in three forms:
loop      the rule one token at a time, float64: the oracle
recurrent the same on whole tensors: a few tokens (decoding)
chunked   chunks of 64 tokens, one triangular solve each: more tokens (prefill)"""

GEMM_NAMES = {"onednn": "oneDNN", "blas": "torch's BLAS"}
INPUT_NAMES = {"int8": "8-bit inputs (oneDNN)", "bfloat16": "bfloat16 inputs"}


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
        typer.echo(LINEAR)
        if verbose:
            _this_machine()
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


def _this_machine() -> None:
    """`backends --verbose`: what this CPU can do, and what qkv chose for it."""
    import torch

    from qkv.device import capability, choose_gemm, choose_precision, freed_memory
    from qkv.nn.quantized import choose_int8_inputs

    precision, why = choose_precision()
    typer.echo(f"\nthis CPU: {capability().describe()}; {torch.get_num_threads()} threads")
    typer.echo(f"embed(precision='auto'): {precision}, since {why}")
    library, why = choose_gemm()
    typer.echo(f"float32 Linear products: {GEMM_NAMES[library]}, since {why}")
    from qkv import native
    from qkv.nn.quant_linear import in_generation
    from qkv.nn.quantized import int4_available

    typer.echo(native.describe())
    typer.echo("generate(precision='auto'): a .gguf file's 4-bit matrices in 4 bits, "
               + ("multiplied by qkv's native kernels (the file's own blocks, 8-bit "
                  "activations, as llama.cpp; one native call a token)" if in_generation() else
                  "since this torch has the CPU int4 kernel" if int4_available() else
                  f"but torch {torch.__version__} has no CPU int4 kernel: the weights "
                  "as loaded"))  # fmt: skip
    if in_generation():
        from qkv.generate.decode import NATIVE_PROMPT

        typer.echo(f"  a prompt of up to {NATIVE_PROMPT} tokens and each token after it through "
                   "NativeStep (one native call), where a model's blocks allow it; FastStep "
                   "(few operations a step) elsewhere")  # fmt: skip
        typer.echo("  its 8-bit LM head: the file's Q8_0 blocks times 8-bit inputs, on the "
                   "native kernels")  # fmt: skip
    else:
        typer.echo("  each token after the prompt's through FastStep (few operations a "
                   "step), where a model's blocks allow it")  # fmt: skip
        inputs, why = choose_int8_inputs()
        typer.echo(f"  its 8-bit LM head with {INPUT_NAMES[inputs]}, since {why}")
    typer.echo(f"memory: {freed_memory()}")


def models(
    as_json: Annotated[bool, typer.Option("--json", help="one JSON line per model type")] = False,
) -> None:
    """List the architectures qkv reads, and how each departs from the article's attention.

    Each row is what qkv computes for transformers' default config of that model type; the
    cache is what decoding keeps per token over every layer, in 16-bit numbers (bfloat16), and
    beside it the fixed state S of linear layers (a running memory, whatever the length)."""
    from dataclasses import asdict

    from qkv.inspect.anatomy import family_models

    found = family_models()
    if as_json:
        for model in found:
            typer.echo(json.dumps(asdict(model)))
        return
    header = ("model type", "family", "shape", "positions", "norms", "window", "scores",
              "attention", "MLP", "cache/token")  # fmt: skip
    rows = [header] + [
        (m.model_type, m.family, *(
            (m.anatomy.shape, m.anatomy.position, m.anatomy.norm, m.anatomy.window,
             m.anatomy.scores, m.anatomy.attention, m.anatomy.mlp,
             _cache(m.anatomy))
            if m.anatomy else ("?", f"({m.problem})", "", "", "", "", "", "")))
        for m in found
    ]  # fmt: skip
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    for row in rows:
        typer.echo("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())


def _cache(anatomy) -> str:
    """The cache per token, and the linear layers' memory beside it: "2.0 KiB + state S: 1.1
    MiB" (a linear layer keeps no tokens: its memory has one size)."""
    per_token = _size(anatomy.cache_bytes_per_token)
    if not anatomy.state_bytes:
        return per_token
    return f"{per_token} + state S: {_size(anatomy.state_bytes)}"


def _size(nbytes: int) -> str:
    """Bytes in a few characters: "-" for none, else B, KiB or MiB."""
    if nbytes == 0:
        return "-"
    for unit, size in (("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= size:
            return f"{nbytes / size:.1f} {unit}"
    return f"{nbytes} B"

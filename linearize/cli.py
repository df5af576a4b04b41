"""The ``linearize`` command line. Thin: parse, call the Python API, print.

Bad input ends with one line on stderr and exit code 2 (``--debug`` shows the traceback).
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Optional

import typer

from . import __version__

app = typer.Typer(
    help="Turn pretrained softmax-attention LMs into Gated DeltaNet (GDN) models.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

DEBUG = False


class UserError(Exception):
    """Bad input from the user: printed as one line, exit code 2."""


def fail(message: str, code: int = 2):
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    raise typer.Exit(code)


def run_guarded(fn, *args, **kwargs):
    """Call ``fn``; turn the errors a user can fix into one clear line and a non-zero exit."""
    from .models.loading import ModelSourceError

    try:
        return fn(*args, **kwargs)
    except (UserError, ModelSourceError, ValueError, FileNotFoundError, PermissionError, OSError) as e:
        if DEBUG:
            raise
        fail(str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__)


def _version(value: bool):
    if value:
        typer.echo(f"linearize {__version__}")
        raise typer.Exit()


@app.callback()
def main(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version."),
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks instead of one-line errors."),
):
    global DEBUG
    DEBUG = debug


def print_fidelity(rows: list[dict], title: str, inits=("uniform", "vala", "seed", "stable")):
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    table.add_column("layer", justify="right")
    for name in inits:
        table.add_column(name, justify="right")
    for r in rows:
        best = min(inits, key=lambda n: r[n])
        table.add_row(
            str(r["layer"]),
            *[(f"[bold]{r[n]:.3g}[/bold]" if n == best else f"{r[n]:.3g}") for n in inits],
        )
    table.add_row("median", *[f"{statistics.median(r[n] for r in rows):.3g}" for n in inits])
    Console().print(table)


@app.command()
def fidelity(
    model: str = typer.Option("smollm2-135m", "--model", "-m", help="Alias, .gguf file, model directory or hub id."),
    tokens: int = typer.Option(256, "--tokens", "-t", help="Tokens of held-out built-in text."),
    output: Optional[Path] = typer.Option(None, "--output", "-o", help="Write the per-layer errors as JSON here."),
):
    """Per-layer relative error of each linear initialization against the teacher's attention."""
    from .eval import layer_fidelity, text_ids
    from .models import load_teacher

    def go():
        if tokens < 2:
            raise UserError(f"--tokens must be at least 2; got {tokens}")
        lm, tok = load_teacher(model)
        rows = layer_fidelity(lm, text_ids(tok, tokens))
        print_fidelity(rows, f"{model}: relative error vs teacher attention, {tokens} held-out tokens")
        wins = sum(r["stable"] < r["vala"] for r in rows)
        typer.echo(f"stable Taylor form beats VaLA on {wins} of {len(rows)} layers")
        if output is not None:
            output.write_text(json.dumps({"model": model, "tokens": tokens, "layers": rows}, indent=1))
            typer.echo(f"wrote {output}")

    run_guarded(go)


def entry():
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    entry()

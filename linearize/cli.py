"""The ``linearize`` command line. Thin: parse, call the Python API, print.

Bad input ends with one line on stderr and exit code 2 (``--debug`` shows the traceback).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

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
    try:
        return fn(*args, **kwargs)
    except (UserError, ValueError, OSError) as e:  # ModelSourceError is a ValueError
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
    output: Path | None = typer.Option(None, "--output", "-o", help="Write the per-layer errors as JSON here."),
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


def _default_output(model: str) -> Path:
    from .models.loading import resolve_model

    return Path(f"{resolve_model(model).name.replace('/', '_')}-gdn")


@app.command()
def convert(
    model: str = typer.Option("smollm2-135m", "--model", "-m", help="Alias, .gguf file, model directory or hub id."),
    to: str = typer.Option("gdn", "--to", help="Target block (only 'gdn')."),
    output: Path | None = typer.Option(None, "--output", "-o", help="Output directory (default: <model>-gdn)."),
    layers: str | None = typer.Option(None, "--layers", help="Layers that may be converted, e.g. 0-11,14 (default all)."),
    keep_softmax: str | None = typer.Option(
        None, "--keep-softmax",
        help="Layers to keep as softmax: indices (e.g. '3,7' or '5,'), or a count N: the N worst-initialized."),
    form: str = typer.Option("stable", "--form", help="Taylor form: 'stable' or 'taylor-seed' (diverges; for study)."),
    beta_max: float = typer.Option(1.0, "--beta-max", help="Upper bound of β in the stable form."),
    tokens: int = typer.Option(512, "--tokens", help="Held-out tokens for the fidelity report."),
    calibration_tokens: int = typer.Option(512, "--calibration-tokens", help="Tokens of calibration text (ρ, --keep-softmax N)."),
    force: bool = typer.Option(False, "--force", help="Replace the output directory if it exists."),
):
    """Convert a model's softmax attention to Taylor-initialized GDN; report fidelity; save."""
    from .conversion import convert as convert_model
    from . import save
    from .layers.options import TARGETS
    from .saving import check_output_dir
    from .eval import capture_attention, conversion_report, perplexity, plot_fidelity, text_ids
    from .layers.gdn_attention import GDNOptions
    from .models import load_teacher
    from .models.families import family_of

    def go():
        t0 = time.perf_counter()
        if to not in TARGETS:
            raise UserError(f"--to {to!r} is not supported; supported targets: {', '.join(TARGETS)}")
        if form not in ("stable", "taylor-seed"):
            raise UserError(f"--form must be 'stable' or 'taylor-seed'; got {form!r}")
        out = output or _default_output(model)
        check_output_dir(out, force)  # before the slow part: refuse early
        try:
            lm, tok = load_teacher(model)
        except (ValueError, OSError):
            raise  # already a clear message (missing path, not a model directory, ...)
        except Exception as e:  # truncated/corrupt weights surface as many exception types
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise UserError(f"could not load {model}: {first}. Is the checkpoint complete?") from e
        family_of(lm.config)  # unsupported architectures stop here, before any work
        t_load = time.perf_counter()
        heldout = text_ids(tok, tokens, split="heldout")
        teacher_ppl = perplexity(lm, heldout)
        caps = capture_attention(lm, heldout)
        convert_model(lm, to=to, layers=layers, keep_softmax=keep_softmax, tokenizer=tok,
                      calibration_tokens=calibration_tokens, options=GDNOptions(form=form, beta_max=beta_max))
        t_convert = time.perf_counter()
        report = conversion_report(caps, lm, heldout, teacher_ppl)
        t_report = time.perf_counter()
        report.update(model=model, output=str(out), options={"form": form, "beta_max": beta_max})
        rows = report["layers"]
        print_fidelity(rows, f"{model}: relative error vs teacher attention, {tokens} held-out tokens")
        ppl = report["perplexity"]
        gdn = sum(r["block"] == "gdn" for r in rows)
        typer.echo(f"converted {gdn} of {len(rows)} layers to GDN; softmax kept: "
                   f"{[r['layer'] for r in rows if r['block'] == 'softmax'] or 'none'}")
        typer.echo(f"stable form beats VaLA on {report['stable_beats_vala']} of {len(rows)} layers")
        typer.echo(f"held-out perplexity: teacher {ppl['teacher']:.2f}, converted {ppl['converted']:.2f}")

        def write_report(folder: Path):
            (folder / "fidelity.json").write_text(json.dumps(report, indent=1))
            plot_fidelity(rows, folder / "fidelity.png", f"{model} → GDN: per-layer error at init")

        save(lm, tok, out, force=force, extra=write_report)
        t_save = time.perf_counter()
        timing = {"load_s": t_load - t0, "convert_s": t_convert - t_load, "report_s": t_report - t_convert,
                  "save_s": t_save - t_report, "total_s": t_save - t0}
        (out / "timing.json").write_text(json.dumps(timing, indent=1))
        typer.echo(f"saved {out} (fidelity.json, fidelity.png) in {timing['total_s']:.1f} s")

    run_guarded(go)


@app.command()
def generate(
    prompt: str = typer.Argument(..., help="Text to continue."),
    model: Path = typer.Option(..., "--model", "-m", help="A converted model directory."),
    max_new_tokens: int = typer.Option(64, "--max-new-tokens", "-n"),
    chat: bool = typer.Option(False, "--chat", help="Wrap the prompt in the tokenizer's chat template."),
):
    """Generate text with a converted model (constant-size recurrent state, greedy)."""
    import torch
    from transformers import AutoTokenizer

    from .saving import load

    def go():
        lm = load(model)
        tok = AutoTokenizer.from_pretrained(model)
        if chat:
            ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                          return_tensors="pt", return_dict=True)["input_ids"]
        else:
            ids = tok(prompt, return_tensors="pt").input_ids
        out = lm.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                          pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id)
        typer.echo(tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True))

    run_guarded(go)


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": False})
def distill(
    ctx: typer.Context,
    recipe: Path = typer.Argument(..., help="Recipe YAML (see recipes/)."),
    resume: bool = typer.Option(False, "--resume", help="Continue the run in output.dir from its last checkpoint."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the resolved recipe and the token/step budget, then stop."),
):
    """Train the GDN blocks of a converted model against its teacher. Extra args: key=value overrides."""
    from rich.console import Console

    from .config import load_recipe, to_yaml
    from .distill import TrainingError, budget, run_recipe
    from .distill.trainer import world

    def go():
        cfg = load_recipe(recipe, list(ctx.args))
        if dry_run:
            typer.echo(to_yaml(cfg))
            typer.echo(json.dumps(budget(cfg), indent=1))
            return
        console = Console()
        total = budget(cfg)["total_steps"]
        t0 = time.perf_counter()

        def progress(rec, step):
            eta = (time.perf_counter() - t0) / max(step, 1) * (total - step)
            extra = "".join(f" {k[5:]}={v:.3g}" for k, v in rec.items() if k.startswith("eval_"))
            console.print(f"[{step}/{total}] {rec['stage']} loss {rec['loss']:.4g} "
                          f"{rec['tokens_per_s']:.0f} tok/s eta {eta:.0f}s{extra}")

        try:
            summary = run_recipe(cfg, resume=resume, progress=progress)
        except TrainingError as e:
            raise UserError(str(e)) from None
        if world()[0] != 0:  # under torchrun, one summary
            return
        ini, fin = summary["initial"] or {}, summary["final"]
        typer.echo(f"held-out perplexity: teacher {fin['ppl_teacher']:.2f}, student at init "
                   f"{ini.get('ppl_student', float('nan')):.2f} -> after training {fin['ppl_student']:.2f}; "
                   f"KL {fin['kl']:.3f}, top-1 agreement {fin['top1_agreement']:.3f}")
        typer.echo(f"saved {summary['model']}")

    run_guarded(go)


def entry():
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    entry()

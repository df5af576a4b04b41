"""What the CLI checks before anything slow runs: options, the model's files, a recipe's data and
teacher. Each failure is a :class:`UserError` (a ``ValueError``) whose one-line message names the
problem and the fix. Torch-free at import; the model checks read config.json / GGUF metadata only.
"""

from __future__ import annotations

import math
import os
import warnings
from pathlib import Path

from .saving import write_atomic  # noqa: F401  (the CLI's commands write their reports through checks)


class UserError(ValueError):
    """Bad input from the user: printed as one line, exit code 2."""


def first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def positive(value, flag: str, least: float = 1, finite: bool = False) -> None:
    """``finite``: a finite number > 0; otherwise at least ``least``."""
    if finite and not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise UserError(f"{flag} must be a finite number > 0; got {value}")
    if not finite and value < least:
        raise UserError(f"{flag} must be at least {least}; got {value}")


def sparse_cache_size(size: int | None) -> None:
    """``--sparse-cache``: None (the size the model was trained with), or 1 to 65536 slots (``GDNOptions``' bound)."""
    if size is None:
        return
    positive(size, "--sparse-cache", 1)
    if size > 65536:
        raise UserError(f"--sparse-cache must be at most 65536 slots; got {size}")


def resize_sparse_cache(model, size: int | None, what: str) -> None:
    """``--sparse-cache`` on a loaded ``model`` (:func:`linearize.layers.options.resize_sparse_cache`), refused for
    a model ``what`` without a sparse cache."""
    from .layers.options import resize_sparse_cache as resize

    if size is not None and not resize(model, size):
        raise UserError(f"--sparse-cache: {what} has no sparse cache to resize; convert it with --sparse-cache C")


def device_name(device: str | None, flag: str = "--device") -> str:
    """``cuda`` or ``cpu``: the one asked for (checked), or cuda when there is one."""
    import torch

    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device not in ("cuda", "cpu"):
        raise UserError(f"{flag} must be cuda or cpu; got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise UserError(f"{flag} cuda: no CUDA device is available here; use {flag} cpu")
    return device


def builtin_tokens(tokens: int, flag: str, split: str) -> None:
    """A token covers at least one byte of text: more tokens than bytes can never be served."""
    from .eval import builtin_text

    have = len(builtin_text(split).encode())
    if tokens > have:
        raise UserError(f"{flag} {tokens}: the built-in {split} text has about {have // 4} tokens; ask for fewer")


def inspect_model(model: str, needs_teacher: str | None = None):
    """Resolve ``model`` and read what its files say without loading it (custom code is refused, cut
    weight files found). ``needs_teacher``: the command, if it needs an unconverted softmax model.
    Returns ``(ModelSource, SourceInfo)``."""
    from .models.loading import inspect_source, resolve_model

    src = resolve_model(model)
    info = inspect_source(src)
    if needs_teacher and (info.model_type or "").startswith("linearize_"):
        raise UserError(f"{model} is already converted ({info.model_type}); {needs_teacher} needs the softmax "
                        "teacher it was converted from: pass that instead")
    if needs_teacher and info.model_type and not src.gguf_file:  # GGUF architecture names are not model types
        from types import SimpleNamespace

        from .models.families import family_of

        family_of(SimpleNamespace(model_type=info.model_type))  # unsupported architectures stop before loading
    return src, info


def loaded(what: str, fn, debug: bool = False):
    """Every command loads a model through here: a cut or foreign checkpoint is one line, not a traceback."""
    from .models.loading import ModelSourceError

    try:
        return fn()
    except (ModelSourceError, UserError, KeyboardInterrupt):
        raise
    except Exception as e:  # truncated/corrupt weights surface as many exception types
        if debug:
            raise
        raise UserError(f"could not load {what}: {first_line(e)}; is the checkpoint complete?") from e


def json_output(output: Path | None) -> None:
    """A file to write at the end of a run: not a folder, in a folder that exists and is writable."""
    if output is None:
        return
    if output.is_dir():
        raise UserError(f"--output {output} is a folder; give a file name such as {output / 'fidelity.json'}")
    parent = output.parent if str(output.parent) else Path(".")
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise UserError(f"--output {output}: cannot write into {parent}; create it or choose another --output")




def show_warning(message, category, filename, lineno, file=None, line=None, _default=warnings.showwarning):
    """``warnings.showwarning`` that prints a :class:`~linearize.distill.data.DataWarning` as one line."""
    from .distill.data import DataWarning

    if issubclass(category, DataWarning):
        print(f"warning: {message}", file=file or __import__("sys").stderr)
    else:
        _default(message, category, filename, lineno, file, line)


def run_inputs(cfg) -> None:
    """What a recipe names, read before the teacher loads: output folder, data files, teacher files."""
    from .config import RecipeError, check_conversion
    from .distill.data import read_documents

    out = Path(cfg.output.dir)
    where, cwd = out.resolve(), Path.cwd().resolve()
    if where == cwd or where in cwd.parents:
        raise RecipeError(f"output.dir {out} is the working directory or one of its parents; choose a new folder")
    if out.exists() and not out.is_dir():
        raise RecipeError(f"output.dir {out} is an existing file; choose a folder path")
    with warnings.catch_warnings():
        warnings.showwarning = show_warning
        read_documents(cfg.data)
    _, info = inspect_model(cfg.teacher.model, needs_teacher="distill")
    n = info.num_layers
    if n is not None:
        check_conversion(cfg.convert.layers, cfg.convert.keep_softmax, n, ("convert.layers", "convert.keep_softmax"))
        for i, st in enumerate(cfg.stages):
            bad = [k for k in st.layer_weights if k >= n]
            if bad:
                raise RecipeError(f"stages.{i}.layer_weights: layer {bad[0]} is out of range; "
                                  f"the teacher has layers 0-{n - 1}")
    if info.max_positions is not None and cfg.data.seq_len > info.max_positions:
        raise RecipeError(f"data.seq_len {cfg.data.seq_len} exceeds the teacher's {info.max_positions} positions; "
                          "lower data.seq_len")

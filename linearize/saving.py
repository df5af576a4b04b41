"""Writing and reading converted model directories.

    linearize.save(model, tok, "smollm2-gdn")
    model = linearize.load("smollm2-gdn")      # or AutoModelForCausalLM.from_pretrained(...)
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path


def save(model, tokenizer, out_dir: str | os.PathLike, force: bool = False, extra=None) -> Path:
    """``save_pretrained`` model (+ tokenizer) atomically: written to a temporary folder, then renamed.

    ``extra(folder)`` may write more files (reports) into the folder before the rename.
    """
    out = Path(out_dir)
    check_output_dir(out, force)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        model.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        if extra is not None:
            extra(tmp)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def check_output_dir(out: Path, force: bool) -> None:
    """Refuse an existing output (unless ``force``) and an unwritable parent, before any work."""
    if out.exists() and not force:
        raise FileExistsError(f"output directory {out} exists; pass --force to replace it or choose another --output")
    parent = out.parent if str(out.parent) else Path(".")
    try:
        parent.mkdir(parents=True, exist_ok=True)
        Path(tempfile.mkdtemp(prefix=".linearize-write-check-", dir=parent)).rmdir()  # a real write, root included
    except OSError:
        raise PermissionError(f"cannot write into {parent}; choose another --output") from None


def load(path: str | os.PathLike, dtype=None):
    """Load a converted model directory (``AutoModelForCausalLM.from_pretrained`` works too).
    ``dtype`` defaults to float32."""
    import torch
    from transformers import AutoModelForCausalLM

    from .conversion import register

    register()
    p = Path(path)
    if not (p / "config.json").is_file():
        raise FileNotFoundError(f"{path} is not a converted model directory (no config.json)")
    return AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32 if dtype is None else dtype).eval()

"""Writing and reading converted model directories; outputs that are whole or absent.

    linearize.save(model, tok, "smollm2-gdn")
    model = linearize.load("smollm2-gdn")      # or AutoModelForCausalLM.from_pretrained(...)

An output is built in a temporary sibling folder ``.<name>.tmp-<pid>-*`` and renamed into place
when complete; with ``force`` the old output is first renamed aside (``.<name>.old-<pid>-*``) and
removed only after the new one is in. A run killed halfway leaves such folders behind; the next
run on the same output removes them (those of live processes are left alone).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path


def save(model, tokenizer, out_dir: str | os.PathLike, force: bool = False, extra=None) -> Path:
    """``save_pretrained`` model (+ tokenizer) atomically.

    ``extra(folder)`` may write more files (reports) into the folder before it is renamed in.
    Parent folders that did not exist are created, and removed again if the save fails.
    """
    out = Path(out_dir)
    check_output_dir(out, force)

    def fill(tmp: Path) -> None:
        model.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        if extra is not None:
            extra(tmp)

    return write_folder(out, fill)


def write_folder(out: Path, fill) -> Path:
    """``fill(tmp)`` writes a folder beside ``out``, which is renamed into place when complete: an existing
    ``out`` is renamed aside first and removed last, and put back if anything fails. Parent folders that
    did not exist are created, and removed again on failure. Files get the umask's modes."""
    created = _make_parents(out.parent)
    tmp = aside = None
    try:
        tmp = _temp_sibling(out, "tmp")
        fill(tmp)
        _umask_modes(tmp)
        if out.exists():
            aside = _temp_sibling(out, "old")
            os.replace(out, aside / out.name)  # a rename: the old output stays whole until the new one is in
        os.replace(tmp, out)
        tmp = None
    except BaseException:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        if aside is not None and not out.exists() and (aside / out.name).exists():
            os.replace(aside / out.name, out)  # put the old output back
        if aside is not None:
            shutil.rmtree(aside, ignore_errors=True)
        for d in created:  # innermost first; only folders this call made, and only if empty
            try:
                d.rmdir()
            except OSError:
                break
        raise
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)
    return out


def check_output_dir(out: str | os.PathLike, force: bool) -> None:
    """Refuse, before any work: an output that is the working directory or one of its parents, an
    existing file, an existing directory (unless ``force``), a place that cannot be written.
    Creates nothing; removes stale temporary folders of earlier killed runs on this output."""
    out = Path(out)
    where = out.resolve()
    cwd = Path.cwd().resolve()
    if where == cwd or where in cwd.parents:
        raise ValueError(f"--output {out} is the working directory or one of its parents; choose a new folder")
    if out.is_file() or (out.exists() and not out.is_dir()):
        raise FileExistsError(f"--output {out} is an existing file, not a folder; choose another --output")
    if out.exists() and not force:
        raise FileExistsError(f"output directory {out} exists; pass --force to replace it or choose another --output")
    base = _nearest_existing(where.parent)
    if not base.is_dir() or not os.access(base, os.W_OK | os.X_OK):
        raise PermissionError(f"cannot write into {base}; choose another --output")
    if where.parent.is_dir():
        clean_stale(where)


def clean_stale(out: Path) -> list[Path]:
    """Remove ``.<name>.tmp-*`` / ``.<name>.old-*`` siblings of ``out`` left by dead processes.
    An ``old`` folder whose output is missing (killed between the two renames) is put back."""
    removed = []
    prefix = f".{out.name}."
    for p in sorted(q for q in out.parent.iterdir() if q.name.startswith(prefix)):
        kind, _, rest = p.name[len(prefix):].partition("-")
        if kind not in ("tmp", "old") or not p.is_dir() or _alive(rest.split("-", 1)[0]):
            continue
        if kind == "old" and not out.exists() and (p / out.name).is_dir():
            os.replace(p / out.name, out)
        shutil.rmtree(p, ignore_errors=True)
        removed.append(p)
    return removed


def write_atomic(path: Path, text: str) -> None:
    """Write a small file atomically: a temporary name beside it, then a rename."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def umask_mode() -> int:
    """The mode a plain ``mkdir`` gives a folder under the current umask."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o777 & ~mask


def _umask_modes(root: Path) -> None:
    """Folders and files as ``mkdir``/``open`` make them under the umask (some writers use 0600 temp files)."""
    d_mode = umask_mode()
    f_mode = d_mode & 0o666
    for folder, _dirs, files in os.walk(root):
        os.chmod(folder, d_mode)
        for f in files:
            os.chmod(os.path.join(folder, f), f_mode)


def _temp_sibling(out: Path, kind: str) -> Path:
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.{kind}-{os.getpid()}-", dir=out.parent))
    tmp.chmod(umask_mode())  # mkdtemp makes 0700 folders; the output gets the mode mkdir would give
    return tmp


def _alive(pid: str) -> bool:
    if not pid.isdigit():
        return False  # an older name without a pid: nobody owns it any more
    if int(pid) == os.getpid():
        return True
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _nearest_existing(p: Path) -> Path:
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def _make_parents(parent: Path) -> list[Path]:
    """``mkdir -p``; returns the folders it created, innermost first."""
    missing = []
    p = parent.absolute()
    while not p.exists():
        missing.append(p)
        p = p.parent
    parent.mkdir(parents=True, exist_ok=True)
    return missing


def load(path: str | os.PathLike, dtype=None):
    """Load a converted model directory (``AutoModelForCausalLM.from_pretrained`` works too).
    ``dtype`` defaults to float32. Runs no code from the directory (``trust_remote_code=False``)."""
    import torch
    from transformers import AutoModelForCausalLM

    from .conversion import register
    from .models.loading import refuse_remote_code

    register()
    p = Path(path)
    if not (p / "config.json").is_file():
        raise FileNotFoundError(f"{path} is not a converted model directory (no config.json)")
    refuse_remote_code(p)
    return AutoModelForCausalLM.from_pretrained(
        p, dtype=torch.float32 if dtype is None else dtype, trust_remote_code=False).eval()

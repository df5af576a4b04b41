"""The run directory (``output.dir``): one run at a time (an exclusive lock), another run's directory
refused unless resuming it, and what a killed run left half-written cleaned up."""

from __future__ import annotations

import fcntl
import os
import shutil
from pathlib import Path

from ..config import RecipeError

LOCK = ".lock"


class RunLock:
    """``flock`` on ``output.dir/.lock`` for the run's lifetime. The kernel drops the lock when its
    process dies, so the lock of a killed run is simply taken over."""

    def __init__(self, out: Path):
        self.out, self.fd, self.made_dir = out, None, False

    def acquire(self) -> None:
        self.made_dir = not self.out.exists()
        try:
            self.out.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise RecipeError(f"cannot create output.dir {self.out}: {e.strerror}; choose another output.dir") from None
        if not self.out.is_dir():
            raise RecipeError(f"output.dir {self.out} is a file; choose a directory")
        fd = os.open(self.out / LOCK, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid = os.read(fd, 32).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise RecipeError(f"output.dir {self.out} is in use by another run (pid {pid}); "
                              "wait for it to end or choose another output.dir") from None
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        self.fd = fd

    def release(self, failed: bool = False) -> None:
        """Unlock; after a failure before the run wrote anything, remove the directory this lock made."""
        if self.fd is None:
            return
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)
        self.fd = None
        if failed and self.made_dir and [p.name for p in self.out.iterdir()] == [LOCK]:
            shutil.rmtree(self.out, ignore_errors=True)


def check_output(out: Path, resume: bool) -> None:
    """Refuse another run's directory unless resuming it; refuse resuming nothing."""
    has_run = (out / "recipe.yaml").is_file()
    if resume and not has_run:
        raise RecipeError(f"--resume: {out} holds no run to resume (no recipe.yaml); drop --resume to start one")
    if not resume and out.is_dir() and any(p.name != LOCK for p in out.iterdir()):
        what = "another run" if has_run else "files"
        raise RecipeError(f"output.dir {out} already holds {what}; pass --resume to continue it or choose another output.dir")


def clean_stale(out: Path) -> list[Path]:
    """Remove what a killed run left half-written: ``checkpoints/partial-*`` and ``.*.tmp-*`` folders
    and files (the model and reports are written to a temporary name and renamed when complete)."""
    stale = [*out.glob("checkpoints/partial-*"), *out.glob(".*.tmp-*")]
    for p in stale:
        shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
    return stale

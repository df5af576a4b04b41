"""Training checkpoints: one dict of tensors and plain containers per file, written atomically, loaded
with ``torch.load(weights_only=True)`` (so a planted pickle cannot run), newest intact one first.

A checkpoint holds the trained parameters (whole tensors, gathered from FSDP shards), the optimizer
and schedule of the stage it was taken in (``opt_stage``), every RNG state, and where the run goes on:
``stage``/``stage_step``. A checkpoint taken at a stage's end points at the next stage, whose
optimizer and schedule start fresh, as in an uninterrupted run.
"""

from __future__ import annotations

import os
import random
import sys
import tempfile
from pathlib import Path

import torch

from ..saving import umask_mode
from .parallel import full_tensor, is_main, is_sharded

CKPT_DIR = "checkpoints"
FORMAT = 2


def rng_state() -> dict:
    import numpy as np

    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    return {"torch": torch.get_rng_state(), "python": random.getstate(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
            "numpy": {"keys": torch.from_numpy(keys.astype("int64")), "pos": int(pos),
                      "has_gauss": int(has_gauss), "gauss": float(gauss)}}


def set_rng_state(rng: dict) -> None:
    import numpy as np

    torch.set_rng_state(rng["torch"])
    random.setstate(rng["python"])
    if rng["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    n = rng["numpy"]
    np.random.set_state(("MT19937", n["keys"].numpy().astype("uint32"), n["pos"], n["has_gauss"], n["gauss"]))


def save(run, step: int, next_stage: int, next_stage_step: int, opt, sched, opt_stage: int, names) -> Path | None:
    """Every process calls this (FSDP gathers shards); rank 0 writes and returns the path."""
    params = dict(run.student.named_parameters())
    full = {n: full_tensor(params[n].detach()).cpu() for n in names}
    if run.fsdp:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        optim = get_optimizer_state_dict(run.student, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    else:
        optim = opt.state_dict()
    if not is_main():
        return None
    state = {"format": FORMAT, "step": step, "stage": next_stage, "stage_step": next_stage_step, "params": full,
             "opt_stage": opt_stage, "optimizer": optim, "scheduler": sched.state_dict(), "rng": rng_state()}
    d = run.out / CKPT_DIR
    d.mkdir(exist_ok=True)
    final = d / f"step_{step:08d}.pt"
    fd, tmp = tempfile.mkstemp(prefix="partial-", suffix=".pt", dir=d)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())  # on disk before the rename makes it the latest
        os.chmod(tmp, umask_mode() & 0o666)  # mkstemp makes 0600 files
        os.replace(tmp, final)  # atomic: a kill leaves either the old set or the new file, never half of one
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    for old in sorted(d.glob("step_*.pt"))[: -run.cfg.output.keep_last]:
        old.unlink()
    return final


def checkpoints(out: Path) -> list[Path]:
    """The run's checkpoints, newest first."""
    return sorted((out / CKPT_DIR).glob("step_*.pt"), reverse=True)


def read(path: Path) -> dict:
    """A checkpoint's dict; raises ``ValueError`` for a file that is not a complete checkpoint of ours."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # truncated (EOF, zip central directory), or objects outside the allowed set
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ValueError(f"{path.name} is not a readable checkpoint ({first[:160]})") from None
    keys = {"format", "step", "stage", "stage_step", "params", "opt_stage", "optimizer", "scheduler", "rng"}
    if not isinstance(state, dict) or state.get("format") != FORMAT or not keys <= set(state):
        raise ValueError(f"{path.name} is not a checkpoint of this linearize version")
    return state


def load_latest(out: Path) -> tuple[Path | None, dict | None]:
    """The newest checkpoint that reads back whole; unreadable newer ones are reported and skipped."""
    for path in checkpoints(out):
        try:
            return path, read(path)
        except ValueError as e:
            print(f"warning: {e}; trying the one before it", file=sys.stderr)
    return None, None


def restore(run, state: dict) -> None:
    """Put a checkpoint's parameters (into this process's shards under FSDP) and RNG states back."""
    params = dict(run.student.named_parameters())
    missing = sorted(set(state["params"]) - set(params))
    if missing:
        raise ValueError(f"the checkpoint holds {missing[0]}, which the student does not have; "
                         "resume with the recipe that started the run")
    with torch.no_grad():
        for n, t in state["params"].items():
            p = params[n]
            t = t.to(p.device, p.dtype)
            if is_sharded(p):  # this process's shard of the whole tensor
                from torch.distributed.tensor import distribute_tensor

                t = distribute_tensor(t, p.device_mesh, p.placements)
            p.copy_(t)
    set_rng_state(state["rng"])


def restore_optimizer(run, opt, sched, state: dict) -> None:
    if run.fsdp:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        set_optimizer_state_dict(run.student, opt, state["optimizer"], options=StateDictOptions(full_state_dict=True))
    else:
        opt.load_state_dict(state["optimizer"])
    sched.load_state_dict(state["scheduler"])

"""Which ptxas Triton compiles with, and where a newer one is.

ptxas 12.8, the one Triton 3.6 ships, miscompiles some 16-bit ``wgmma`` products of the KDA backward (it takes
their shared-memory address from the wrong register; ptxas 12.9 and 13.0 compile the same PTX right:
docs/kernels.md). Triton takes another ptxas from ``TRITON_PTXAS_PATH``; a CUDA toolkit of 12.9 or newer
installed beside it has one, which :func:`toolkit_ptxas` finds so that a refusal can name it.
"""

from __future__ import annotations

import os
import subprocess
from functools import cache
from pathlib import Path

import torch

PTXAS_FIXED = (12, 9)  # the first ptxas that compiles the KDA backward's 16-bit tensor-core products right


def ptxas_version() -> tuple[int, int] | None:
    """``(major, minor)`` of the ptxas Triton compiles for this CUDA GPU with, or None where it cannot tell."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        major, minor = torch.cuda.get_device_capability()
        return tuple(int(x) for x in str(get_ptxas(10 * major + minor).version).split(".")[:2])
    except Exception:  # no CUDA, another backend, another Triton layout: nothing known to refuse
        return None


def ptxas_release(path: Path | str) -> tuple[int, int] | None:
    """``(major, minor)`` of the ptxas at ``path``, read off its ``--version`` ("… release 13.0, V13.0.88"), or
    None where there is none to ask or it says something else."""
    try:
        out = subprocess.run([str(path), "--version"], capture_output=True, text=True, timeout=30).stdout
        major, minor = out.split("release ")[1].split(",")[0].split(".")[:2]
        return int(major), int(minor)
    except (OSError, IndexError, ValueError, subprocess.SubprocessError):
        return None


@cache
def toolkit_ptxas() -> Path | None:
    """The CUDA toolkit's ptxas (``$CUDA_HOME/bin``, then ``/usr/local/cuda/bin``) where it is 12.9 or newer."""
    homes = [os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    for home in filter(None, homes):
        path = Path(home) / "bin" / "ptxas"
        if path.is_file() and (ptxas_release(path) or (0, 0)) >= PTXAS_FIXED:
            return path
    return None


def newer_ptxas_advice() -> str:
    """What to set so that Triton compiles with a ptxas of 12.9 or newer: the one found here, if any."""
    found = toolkit_ptxas()
    if found is not None:
        return f"set TRITON_PTXAS_PATH={found} (a ptxas of CUDA 12.9+ found here)"
    return "set TRITON_PTXAS_PATH to a newer ptxas (CUDA 12.9+, e.g. /usr/local/cuda/bin/ptxas)"

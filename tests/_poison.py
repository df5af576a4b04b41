"""NaN-poisoned allocations for the kernel tests, so an element a kernel never writes shows as NaN.

Every module of ``linearize.ops.triton`` and ``linearize.modules`` that allocates through ``torch`` sees,
inside :func:`poisoned_outputs`, a ``torch`` whose ``empty``/``empty_like`` come back filled with NaN.
"""

from __future__ import annotations

import contextlib
import importlib
import pkgutil

import torch


class _NaNTorch:
    """``torch`` as the kernels' host code sees it, but ``empty``/``empty_like`` come back NaN-filled."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def empty(*args, **kwargs):
        return torch.empty(*args, **kwargs).fill_(float("nan"))

    @staticmethod
    def empty_like(*args, **kwargs):
        return torch.empty_like(*args, **kwargs).fill_(float("nan"))


def kernel_modules() -> list:
    """The imported modules of the Triton host code that hold ``torch`` as a global."""
    found = []
    for package in ("linearize.ops.triton", "linearize.modules"):
        pkg = importlib.import_module(package)
        for info in pkgutil.iter_modules(pkg.__path__, package + "."):
            module = importlib.import_module(info.name)
            if getattr(module, "torch", None) is torch:
                found.append(module)
    return found


@contextlib.contextmanager
def poisoned_outputs():
    """Inside the block, every buffer the Triton launchers allocate starts as NaN."""
    modules = kernel_modules()
    for m in modules:
        m.torch = _NaNTorch()
    try:
        yield
    finally:
        for m in modules:
            m.torch = torch


"""Test support for the kernels: allocations poisoned with NaN, so unwritten output shows."""

from __future__ import annotations

import contextlib

import torch

from . import chunk_bwd, chunk_fwd, front, rowsq


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


@contextlib.contextmanager
def poisoned_outputs():
    """Inside the block, every buffer the Triton launcher allocates starts as NaN."""
    modules = (chunk_fwd, chunk_bwd, front, rowsq)
    saved = [m.torch for m in modules]
    for m in modules:
        m.torch = _NaNTorch()
    try:
        yield
    finally:
        for m, t in zip(modules, saved):
            m.torch = t

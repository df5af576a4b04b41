"""Putting an inference kernel on a model's own modules: a forward set on each instance (the class, the
weights and the state dict untouched), which takes the kernel where it applies and the module's own forward
elsewhere, and which learns what the module computes at its first call rather than from its class's name.

Used by :mod:`.norm` (RMSNorm) and :mod:`.swiglu` (the gated MLP's activation). A kernel applies on CUDA where
no gradient is wanted (a prefill, scoring, decoding, the held-out evaluation during training) and outside
``torch.compile`` (which fuses the module's own forward itself); training and the CPU keep the module's
forward. The first such call checks the module against the kernel's formula (:func:`recognized`), outside a
CUDA graph's capture, so a model built on the meta device and loaded later is checked on its weights.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from ..ops.common import TRITON_DTYPES


def wanted(x: torch.Tensor, *others) -> bool:
    """Whether an inference kernel may take this call: the rows ``x`` alone (``others``: the call's other
    arguments, none), fp16/bf16/fp32, on CUDA, no gradient, not inside ``torch.compile``."""
    return (not any(others) and x.dtype in TRITON_DTYPES and x.is_cuda and not torch.is_grad_enabled()
            and not torch.compiler.is_compiling())


def recognized(module: torch.nn.Module, key: str, recognize: Callable[[torch.nn.Module], object]):
    """The module's form under ``key``: ``recognize(module)`` at the first call outside a CUDA graph's capture,
    then remembered (False where it computes none of the kernel's forms; None while not yet known)."""
    form = getattr(module, key)
    if form is None and not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()):
        form = recognize(module) or False
        setattr(module, key, form)
    return form


def fuse(model: torch.nn.Module, key: str, candidate: Callable[[torch.nn.Module], bool], forward) -> int:
    """Set ``forward`` (a function of ``(module, *args, **kwargs)``) on every module of ``model`` that
    ``candidate`` accepts and that has no forward of its own on its instance (a hook's, a compiled one's),
    marked ``key`` (None: not yet recognized). The forward is a ``functools.partial`` of the module, so a copy,
    a pickle or ``torch.compile`` of the model keeps it working. Idempotent; returns how many modules carry it."""
    n = 0
    for module in model.modules():
        if hasattr(module, key):
            n += 1
        elif "forward" not in module.__dict__ and candidate(module):
            setattr(module, key, None)
            module.forward = functools.partial(forward, module)
            n += 1
    return n


def unfuse(model: torch.nn.Module, key: str, forward) -> int:
    """Take :func:`fuse`'s ``forward`` marked ``key`` off again (a forward set on the instance since, by a hook or
    a compiler, is left where it is, and so is the mark); returns how many modules."""
    n = 0
    for module in model.modules():
        own = module.__dict__.get("forward")
        if hasattr(module, key) and isinstance(own, functools.partial) and own.func is forward:
            del module.forward
            delattr(module, key)
            n += 1
    return n

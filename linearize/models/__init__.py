"""Reading pretrained checkpoints: where the weights are, and how each family's attention computes q, k, v.

Torch-free at import (``families``, ``loading``); ``project_qkv`` loads on first access.
"""

from .loading import DEFAULT_MODEL, load_teacher, resolve_model


def __getattr__(name):
    if name == "project_qkv":
        from .adapters import project_qkv

        return project_qkv
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["DEFAULT_MODEL", "load_teacher", "project_qkv", "resolve_model"]

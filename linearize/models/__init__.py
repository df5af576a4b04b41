"""Reading pretrained checkpoints: where the weights are, and how each family's attention computes q, k, v."""

from .adapters import project_qkv
from .loading import DEFAULT_MODEL, load_teacher, resolve_model

__all__ = ["DEFAULT_MODEL", "load_teacher", "project_qkv", "resolve_model"]

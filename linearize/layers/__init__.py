"""The GDN attention module (a drop-in for a transformers attention module), its VaLA subclass (the
``linear`` target) and their cache state.

``linearize.layers.options`` (and the names it defines, re-exported here) is torch-free; the module
and its cache layer load on first access, so the CLI can check options without importing torch.
"""

from .options import BACKENDS, DEFAULT_BETA_MAX, FORMS, TARGETS, GDNOptions, check_form, check_target

_LAZY = {"GDNAttention": ".gdn_attention", "fused_path": ".gdn_attention", "GDNStateLayer": ".cache",
         "VaLAAttention": ".vala_attention"}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["BACKENDS", "DEFAULT_BETA_MAX", "FORMS", "TARGETS", "GDNAttention", "GDNOptions", "GDNStateLayer",
           "VaLAAttention", "check_form", "check_target", "fused_path"]

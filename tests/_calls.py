"""Counting a module's calls of some of its functions, for tests that check which launches a path makes."""

from __future__ import annotations


def counted_calls(monkeypatch, module, names) -> dict:
    """Replaces each function of ``names`` in ``module`` by one that counts its calls, then runs it; returns
    the live ``{name: calls}`` (monkeypatch undoes the replacement)."""
    calls = dict.fromkeys(names, 0)

    def counting(name, real):
        def call(*args, **kwargs):
            calls[name] += 1
            return real(*args, **kwargs)
        return call

    for name in names:
        monkeypatch.setattr(module, name, counting(name, getattr(module, name)))
    return calls

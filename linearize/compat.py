"""Differences between transformers versions, in one place (STYLE.md convention 7).

- 5.17 passes the cache to attention modules as ``past_key_values=``; 5.24 renamed it ``cache=``.
"""

from __future__ import annotations


def attention_cache(past_key_values=None, cache=None, kwargs: dict | None = None):
    """The Cache object an attention module was given, under whichever name this version uses."""
    if cache is not None:
        return cache
    if past_key_values is not None:
        return past_key_values
    if kwargs:
        return kwargs.get("cache", kwargs.get("past_key_values"))
    return None

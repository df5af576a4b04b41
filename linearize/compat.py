"""Differences between transformers versions, in one place (STYLE.md convention 7).

- 5.17 passes the cache to attention modules as ``past_key_values=``; 5.24 renamed it ``cache=``.
"""

from __future__ import annotations


def attention_cache(past_key_values=None, cache=None):
    """The Cache object an attention module was given, under whichever name this version uses."""
    return cache if cache is not None else past_key_values

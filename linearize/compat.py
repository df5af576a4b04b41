"""Differences between transformers versions, in one place (STYLE.md convention 7).

- The cache keyword: 5.17 passes the cache to attention modules and takes it in ``forward`` as
  ``past_key_values=``; 5.24 renamed it ``cache=`` and warns (FutureWarning) on the old name, which
  5.40 removes. Attention modules read it with :func:`attention_cache`; callers of a model's
  ``forward`` name it with :func:`cache_kwargs`.
- Both versions have ``transformers.cache_utils.LinearAttentionLayer`` (the recurrent-state cache
  layer GDN's state is kept in), so no difference lives here for it.

Torch-free at import; what it reads of transformers it reads on first use.
"""

from __future__ import annotations

import functools


def attention_cache(past_key_values=None, cache=None):
    """The Cache object an attention module was given, under whichever name this version uses."""
    return cache if cache is not None else past_key_values


@functools.cache
def cache_kwarg() -> str:
    """``"cache"`` where the models' ``forward`` takes that name (5.24), else ``"past_key_values"`` (5.17)."""
    import inspect

    from transformers.models.llama.modeling_llama import LlamaModel

    return "cache" if "cache" in inspect.signature(LlamaModel.forward).parameters else "past_key_values"


def cache_kwargs(cache) -> dict:
    """``model(x, **cache_kwargs(cache))``: the cache under this version's keyword, without its FutureWarning."""
    return {cache_kwarg(): cache}

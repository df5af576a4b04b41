"""The decoding state of one GDN layer, kept inside the model's transformers ``Cache``.

A GDN layer's state is ``(A, Σk, Σv, t)`` (SPEC §2 "Decoding"): constant in size whatever the
context length. It lives in the same ``Cache`` object as the KV caches of any softmax layers the
model keeps, as one more ``CacheLayerMixin``, so ``generate()``, ``get_seq_length()`` (RoPE
positions) and mask sizing work unchanged for pure and hybrid models.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import CacheLayerMixin

from ..ops.taylor import RunningSums


class GDNStateLayer(CacheLayerMixin):
    """Recurrent state of one GDN layer: ``state [B, H, K, V]`` (fp32) and the running sums."""

    is_sliding = False
    is_compileable = False
    is_croppable = False
    supports_early_init = False

    def __init__(self, **kwargs):
        super().__init__()
        self.state: torch.Tensor | None = None
        self.sums: RunningSums | None = None
        self.seen = 0  # positions processed (padding included): what RoPE/masks count

    # the CacheLayerMixin contract -----------------------------------------------------------
    def lazy_initialization(self, *args, **kwargs) -> None:
        self.is_initialized = True

    def update(self, *args, **kwargs):
        raise RuntimeError("a GDN layer keeps a recurrent state, not keys and values; use set_state()")

    def get_mask_sizes(self, query_length, *args, **kwargs) -> tuple[int, int]:
        q = query_length.shape[0] if isinstance(query_length, torch.Tensor) else int(query_length)
        return self.seen + q, 0

    def get_seq_length(self, *args, **kwargs) -> int:
        return self.seen

    def get_max_length(self) -> int:
        return -1

    def get_max_cache_shape(self) -> int:
        return -1

    def offload(self):
        pass

    def prefetch(self):
        pass

    def reset(self) -> None:
        self.state, self.sums, self.seen = None, None, 0

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        if self.state is not None:
            idx = beam_idx.to(self.state.device)
            self.state = self.state.index_select(0, idx)
            self.sums = RunningSums(*(x.index_select(0, idx) for x in (self.sums.k, self.sums.v, self.sums.count)))

    def crop(self, tokens_to_remove: int) -> None:
        raise RuntimeError("a recurrent GDN state cannot be cropped back to an earlier position")

    # ours --------------------------------------------------------------------------------------
    def set_state(self, state: torch.Tensor, sums: RunningSums, new_tokens: int) -> None:
        self.state, self.sums = state, sums
        self.seen += new_tokens
        self.is_initialized = True

    def nbytes(self) -> int:
        if self.state is None:
            return 0
        return sum(x.numel() * x.element_size() for x in (self.state, self.sums.k, self.sums.v, self.sums.count))


def gdn_cache_layer(cache, layer_idx: int) -> GDNStateLayer:
    """This layer's :class:`GDNStateLayer` inside ``cache``, put there on first use."""
    from transformers.cache_utils import DynamicLayer

    layers = cache.layers
    while len(layers) <= layer_idx:
        layers.append(DynamicLayer())
    if not isinstance(layers[layer_idx], GDNStateLayer):
        layers[layer_idx] = GDNStateLayer()
    return layers[layer_idx]

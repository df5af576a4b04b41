"""The decoding state of one GDN layer, kept inside the model's transformers ``Cache``.

A GDN layer's state is ``(A, Σk, Σv, t)`` (SPEC §2 "Decoding"): constant in size whatever the
context length. It lives in the same ``Cache`` object as the KV caches of any softmax layers the
model keeps, as transformers' own linear-attention cache layer (the one Qwen3-Next's recurrent
layers use: ``recurrent_states`` copied in place, beam reordering, offloading and reset by the
library), so ``generate()``, ``get_seq_length()`` (RoPE positions) and mask sizing work unchanged
for pure and hybrid models.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import CacheLayerMixin, DynamicLayer, LinearAttentionLayer

from ..ops.taylor import RunningSums

_STATE, _SUM_K, _SUM_V, _COUNT = range(4)  # recurrent state slots: A, Σk, Σv, t
# the short convolution's last K-1 inputs of q, k, v (GDNOptions.short_conv), kept as recurrent slots
# too, so the library's reorder, offload and reset treat them like the rest of the state
_CONV_INPUTS = (4, 5, 6)
# a sink + sliding-window block's sinks and last tokens (GDNOptions.window; ops/window_inputs.py's WindowBuffers)
_WINDOW = tuple(range(7, 15))
_SUM_KK = 15  # Σkkᵀ of the old keys, for the window block's second-order mix (GDNOptions.mix_order = 2)
# the sparse cache's tokens and keys (GDNOptions.sparse_cache; ops/sparse_cache.py's CacheBuffers)
_SPARSE = tuple(range(16, 20))


# Also a CacheLayerMixin: beside A it keeps running sums (3 more slots), and a model whose every layer
# is GDN has no attention layer left to answer get_seq_length / get_mask_sizes (RoPE positions, masks).
class GDNStateLayer(LinearAttentionLayer, CacheLayerMixin):
    """Recurrent state of one GDN layer: ``state [B, H, K, V]`` (fp32) and the running sums."""

    is_sliding = False
    is_compileable = False  # the layer's forward reads the padding mask on the host
    supports_early_init = False

    def __init__(self, own_columns: bool = False, **kwargs):
        CacheLayerMixin.__init__(self)
        LinearAttentionLayer.__init__(self, number_of_states=20)
        self.seen = 0  # positions processed (padding included): what RoPE/masks count
        # masks over the new tokens' columns only: where every layer of the model is GDN (see get_mask_sizes)
        self.own_columns = own_columns

    @property
    def state(self) -> torch.Tensor | None:
        return self.recurrent_states[_STATE] if self.has_previous_state[_STATE] else None

    @property
    def sums(self) -> RunningSums | None:
        if not self.has_previous_state[_STATE]:
            return None
        r = self.recurrent_states
        return RunningSums(k=r[_SUM_K], v=r[_SUM_V], count=r[_COUNT],
                           kk=r[_SUM_KK] if self.has_previous_state[_SUM_KK] else None)

    @property
    def conv_inputs(self) -> tuple[torch.Tensor, ...] | None:
        """The short convolution's last K-1 inputs of q, k, v, each ``[B, K-1, H·D]``; None without one."""
        if not (self.has_previous_state[_STATE] and self.has_previous_state[_CONV_INPUTS[0]]):
            return None
        return tuple(self.recurrent_states[i] for i in _CONV_INPUTS)

    @property
    def window_buffers(self):
        """The sinks and window of a sink + sliding-window block (a ``WindowBuffers``); None without one."""
        if not (self.has_previous_state[_STATE] and self.has_previous_state[_WINDOW[0]]):
            return None
        from ..ops.window_inputs import WindowBuffers

        return WindowBuffers(*(self.recurrent_states[i] for i in _WINDOW))

    @property
    def cache_buffers(self):
        """The sparse cache beside a window (a ``CacheBuffers``); None without one."""
        if not (self.has_previous_state[_STATE] and self.has_previous_state[_SPARSE[0]]):
            return None
        from ..ops.sparse_cache import CacheBuffers

        return CacheBuffers(*(self.recurrent_states[i] for i in _SPARSE))

    def set_state(self, state: torch.Tensor, sums: RunningSums, new_tokens: int,
                  conv_inputs: list[torch.Tensor] | None = None, window=None, sparse=None) -> None:
        self.device, self.dtype = state.device, state.dtype  # what the library's reorder/prefetch read
        slots = [(_STATE, state), (_SUM_K, sums.k), (_SUM_V, sums.v), (_COUNT, sums.count)]
        slots += list(zip(_CONV_INPUTS, conv_inputs or []))
        slots += list(zip(_WINDOW, window.tensors() if window is not None else []))
        slots += list(zip(_SPARSE, sparse.tensors() if sparse is not None else []))
        if sums.kk is not None:
            slots.append((_SUM_KK, sums.kk))
        for i, x in slots:
            if not self.is_recurrent_states_initialized[i]:  # the first store sets the slot's strides
                self.update_recurrent_state(_standard(x), state_idx=i)
            elif self.recurrent_states[i] is not x:  # (else updated in place)
                self.update_recurrent_state(x, state_idx=i)
            self.has_previous_state[i] = True
        self.seen += new_tokens
        self.is_initialized = True

    def nbytes(self) -> int:
        if self.state is None:
            return 0
        return sum(x.numel() * x.element_size() for x in self.recurrent_states.values() if x is not None)

    # the CacheLayerMixin side ---------------------------------------------------------------------
    def update(self, *args, **kwargs):
        raise RuntimeError("a GDN layer keeps a recurrent state, not keys and values; use set_state()")

    def get_mask_sizes(self, query_length, *args, **kwargs) -> tuple[int, int]:
        """``(kv_length, kv_offset)`` of the masks the model builds from this layer. A GDN layer reads only
        the mask's diagonal (the padding of its new tokens; the window and cache it attends to are its state),
        so where no softmax layer needs the older columns (``own_columns``) the mask covers the new tokens
        alone: a prompt fed in chunks builds ``[B, 1, q, q]`` masks, not ``[B, 1, q, seen + q]`` ones that grow
        with the context (8.6 GB at 64K × 16 in chunks of 8,192). A hybrid's masks span everything seen."""
        q = query_length.shape[0] if isinstance(query_length, torch.Tensor) else int(query_length)
        return (q, self.seen) if self.own_columns else (self.seen + q, 0)

    def get_seq_length(self, *args, **kwargs) -> int:
        return self.seen

    def get_max_cache_shape(self) -> int:
        return -1

    def reset(self) -> None:
        LinearAttentionLayer.reset(self)
        self.seen = 0

    def crop(self, tokens_to_remove: int) -> None:
        raise RuntimeError("a recurrent GDN state cannot be cropped back to an earlier position")


def _standard(x: torch.Tensor) -> torch.Tensor:
    """``x``, or a copy of it where its strides are not the standard row-major ones — a size-1 dimension's too: a
    prefill's slices carry the prompt's length in them, and a compiled decode step would compile again for each."""
    stride, n = [], 1
    for size in reversed(x.shape):
        stride.insert(0, n)
        n *= size
    return x if tuple(stride) == x.stride() else x.clone(memory_format=torch.contiguous_format)


def gdn_cache_layer(cache, layer_idx: int, own_columns: bool = False) -> GDNStateLayer:
    """This layer's :class:`GDNStateLayer` inside ``cache``, put there on first use (``own_columns``: the
    model has no softmax layer, see :meth:`GDNStateLayer.get_mask_sizes`)."""
    layers = cache.layers
    while len(layers) <= layer_idx:
        layers.append(DynamicLayer())
    if not isinstance(layers[layer_idx], GDNStateLayer):
        layers[layer_idx] = GDNStateLayer(own_columns=own_columns)
    return layers[layer_idx]


class StaticKVLayer(CacheLayerMixin):
    """The keys and values of one softmax layer in fixed-size buffers ``[B, H, L, D]``, for a decode step
    recorded once and replayed (:mod:`linearize.decoding`): each step writes its token at ``position``, a
    one-element tensor the decoder advances on the device, and attends over all ``L`` slots through a 4-D
    mask the decoder keeps (slots not yet written are masked there). ``seen`` counts positions, as the GDN
    layers' does."""

    is_sliding = False
    is_compileable = True
    supports_early_init = False

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, position: torch.Tensor, seen: int):
        CacheLayerMixin.__init__(self)
        self.keys, self.values, self.position, self.seen = keys, values, position, seen
        self.device, self.dtype = keys.device, keys.dtype
        self.is_initialized = True

    @classmethod
    def from_dynamic(cls, layer, length: int, position: torch.Tensor) -> StaticKVLayer:
        """A layer of ``length`` slots holding what the growing ``layer`` (transformers' DynamicLayer) holds."""
        B, H, T, D = layer.keys.shape
        keys = layer.keys.new_zeros(B, H, length, D)
        values = layer.values.new_zeros(B, H, length, layer.values.shape[-1])
        new = cls(keys, values, position, 0)
        new.load(layer)
        return new

    def load(self, layer) -> bool:
        """Take ``layer``'s keys and values into the first slots; False (nothing copied) where they do not fit."""
        k, v = layer.keys, layer.values
        if k is None or k.shape[:2] != self.keys.shape[:2] or k.shape[2] > self.keys.shape[2] or \
                k.shape[3] != self.keys.shape[3] or v.shape[3] != self.values.shape[3]:
            return False
        T = k.shape[2]
        self.keys[:, :, :T].copy_(k)
        self.values[:, :, :T].copy_(v)
        self.seen = T
        return True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        self.keys.index_copy_(2, self.position, key_states)
        self.values.index_copy_(2, self.position, value_states)
        self.seen += key_states.shape[2]  # as a GDN layer's set_state counts (a replayed graph counts apart)
        return self.keys, self.values

    def lazy_initialization(self, *args, **kwargs) -> None:  # the buffers exist from the start
        return None

    def get_mask_sizes(self, query_length, *args, **kwargs) -> tuple[int, int]:
        return self.keys.shape[2], 0

    def get_seq_length(self, *args, **kwargs) -> int:
        return self.seen

    def get_max_cache_shape(self) -> int:
        return self.keys.shape[2]

    get_max_length = get_max_cache_shape  # the name of transformers' newer releases

    def reset(self) -> None:
        self.keys.zero_()
        self.values.zero_()
        self.seen = 0

    def crop(self, tokens_to_remove: int) -> None:
        raise RuntimeError("a decoder's static KV buffers are not cropped; decode again from the prompt")


@dataclass
class StaticMask:
    """The 4-D attention mask ``[B, 1, 1, L]`` over a hybrid's fixed-size key/value slots (bool for SDPA,
    additive for eager attention) and the slot ``position [1]`` the next token is written to."""

    mask: torch.Tensor
    position: torch.Tensor
    keep: bool | float
    drop: bool | float

    @classmethod
    def for_model(cls, model, B: int, slots: int, dev) -> StaticMask:
        if model.config._attn_implementation == "sdpa":
            keep, drop, dtype = True, False, torch.bool
        else:
            dtype = next(model.parameters()).dtype
            keep, drop = 0.0, torch.finfo(dtype).min
        return cls(torch.full((B, 1, 1, slots), drop, dtype=dtype, device=dev),
                   torch.zeros(1, dtype=torch.long, device=dev), keep, drop)

    def reset(self, prompt_mask: torch.Tensor) -> None:
        """The prompt's real tokens attended to, nothing after them; the next token at the prompt's end."""
        T = prompt_mask.shape[1]
        self.mask.fill_(self.drop)
        self.mask[:, 0, 0, :T].masked_fill_(prompt_mask.bool(), self.keep)
        self.position.fill_(T)

    def open_slot(self) -> None:
        self.mask.index_fill_(3, self.position, self.keep)

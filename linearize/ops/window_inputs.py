"""Who each query of a sink + sliding-window block sees, fresh or from a cache (``GDNOptions.window``).

:func:`linearize.ops.window.sink_window_softmax` takes keys as "the ``W`` before the first query, then
one per query"; the Taylor-GDN part takes the *old* stream: at query ``t``, the token ``t − W`` that just
left the window, unless it is a sink or belongs to another document (then that step writes nothing).
This module lays both out:

- :func:`fresh_inputs`: a sequence (or packed documents, or a padded batch) from its start: ``W`` empty
  slots before it, the sinks of each query's own document gathered per query;
- :func:`cached_inputs`: a continuation from :class:`WindowBuffers` — the sinks seen so far and the last
  ``W`` tokens (a fixed size, so decoding memory stays constant) — returning the buffers after it.

Positions count a row's (or a document's) real tokens from 1; padding is never a key.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .common import LastTensorMemo
from .taylor import _documents


@dataclass
class WindowInputs:
    k: torch.Tensor  # (B, W + T, H, D): the W keys before the first query, then one per query
    v: torch.Tensor
    key_doc: torch.Tensor  # (B, W + T): a query sees a key of its own document id; empty/padding: -1
    query_doc: torch.Tensor  # (B, T): padding: -2
    sink_k: torch.Tensor | None  # (B, T or 1, S, H, D)
    sink_v: torch.Tensor | None
    sink_ok: torch.Tensor | None  # (B, T, S): the sink exists, precedes the query and is outside its window
    old_ok: torch.Tensor  # (B, T): the old stream's token at t (k[:, t], v[:, t]) is written into the state
    pos: torch.Tensor | None = None  # (B, T): position in its document from 1 (padding 0)

    @property
    def old_k(self) -> torch.Tensor:
        return self.k[:, : self.query_doc.shape[1]]

    @property
    def old_v(self) -> torch.Tensor:
        return self.v[:, : self.query_doc.shape[1]]


@dataclass
class WindowBuffers:
    """What decoding keeps of the exact part, per row: ``S`` sinks and the last ``W`` tokens."""

    sink_k: torch.Tensor  # (B, S, H, D)
    sink_v: torch.Tensor
    sink_index: torch.Tensor  # (B, S) long: the sink's index in the row (padding counted); -1 = none yet
    win_k: torch.Tensor  # (B, W, H, D)
    win_v: torch.Tensor
    win_pos: torch.Tensor  # (B, W) long: the token's position (real tokens from 1); 0 = empty slot
    count: torch.Tensor  # (B,) long: real tokens so far
    # (B,) long: row positions so far, padding counted (what sink_index counts in). On the device, not the
    # cache's host counter, so a captured decode step reads the current value on every replay
    rows: torch.Tensor

    def tensors(self) -> list[torch.Tensor]:
        return [self.sink_k, self.sink_v, self.sink_index, self.win_k, self.win_v, self.win_pos, self.count, self.rows]

    @classmethod
    def empty(cls, like: torch.Tensor, window: int, sinks: int) -> WindowBuffers:
        B, _, H, D = like.shape
        z = lambda n: like.new_zeros(B, n, H, D)  # noqa: E731
        long = dict(dtype=torch.long, device=like.device)
        return cls(z(sinks), z(sinks), torch.full((B, sinks), -1, **long), z(window), z(window),
                   torch.zeros(B, window, **long), torch.zeros(B, **long), torch.zeros(B, **long))


def fresh_inputs(k: torch.Tensor, v: torch.Tensor, window: int, sinks: int, cu_seqlens: torch.Tensor | None = None,
                 mask: torch.Tensor | None = None, gather_sinks: bool = True) -> WindowInputs:
    """A sequence from its start. k, v ``(B, T, H, D)``; ``cu_seqlens``: packed documents (B = 1);
    ``mask`` ``(B, T)`` bool: False for padding (not with ``cu_seqlens``). ``gather_sinks=False`` leaves the
    per-query sinks out (None): FlexAttention reads them through its mask from ``pos`` instead."""
    B, T, H, D = k.shape
    lay = fresh_layout(B, T, window, sinks, cu_seqlens, mask, k.device, gather_sinks)
    pad = lambda x: torch.cat([x.new_zeros(B, window, H, D), x], 1)  # noqa: E731  W empty slots before the first
    sink_k = sink_v = None
    if lay.sink_index is not None:
        index = lay.sink_index
        gather = lambda x: torch.gather(x.flatten(2), 1, index.reshape(B, -1, 1).expand(-1, -1, x[0, 0].numel()))  # noqa: E731
        sink_k, sink_v = (gather(x).view(B, -1, sinks, *x.shape[2:]) for x in (k, v))
    return WindowInputs(pad(k), pad(v), lay.key_doc, lay.query_doc, sink_k, sink_v, lay.sink_ok, lay.old_ok, lay.pos)


@dataclass
class FreshLayout:
    """What :func:`fresh_inputs` lays out from the rows' documents alone, whatever the keys and values."""

    key_doc: torch.Tensor
    query_doc: torch.Tensor
    old_ok: torch.Tensor
    pos: torch.Tensor  # padding 0
    sink_index: torch.Tensor | None  # (B, T or 1, S): the token each query's sink j is
    sink_ok: torch.Tensor | None


def fresh_layout(B: int, T: int, window: int, sinks: int, cu_seqlens: torch.Tensor | None, mask: torch.Tensor | None,
                 device, gather_sinks: bool = True) -> FreshLayout:
    """The index part of :func:`fresh_inputs`, laid out once for the layers of one forward: every layer passes
    the same ``cu_seqlens`` (or none, and no mask), so its tensors are the same objects from layer to layer
    (no launch a layer, and :func:`linearize.ops.window.sink_window_flex` knows its block mask by them)."""
    key = (B, T, window, sinks, gather_sinks, str(device), torch.is_inference_mode_enabled())
    if mask is not None or torch.compiler.is_compiling():  # (a trace keeps nothing between calls)
        return _layout(B, T, window, sinks, cu_seqlens, mask, device, gather_sinks)
    if cu_seqlens is not None:
        return _LAYOUTS.get(cu_seqlens, lambda: _layout(B, T, window, sinks, cu_seqlens, None, device, gather_sinks), key)
    if _ROWS.get("key") != key:  # rows of one document each: the layout depends on the shape alone
        _ROWS.update(key=key, layout=_layout(B, T, window, sinks, None, None, device, gather_sinks))
    return _ROWS["layout"]


_LAYOUTS = LastTensorMemo()
_ROWS: dict = {}


def _layout(B, T, window, sinks, cu_seqlens, mask, dev, gather_sinks) -> FreshLayout:
    valid = torch.ones(B, T, dtype=torch.bool, device=dev) if mask is None else mask.bool()
    ar = torch.arange(T, device=dev)
    if cu_seqlens is not None:
        doc, start = _documents(T, cu_seqlens, dev)
        first = start[doc].expand(B, T)  # index of each token's document start
        doc, pos = doc.expand(B, T), (ar - first + 1)
    else:
        doc = torch.zeros(B, T, dtype=torch.long, device=dev)
        pos = valid.long().cumsum(1) * valid
    query_doc = torch.where(valid, doc, -2)
    pos_c = torch.cat([pos.new_zeros(B, window), pos], 1)
    key_doc = torch.cat([doc.new_full((B, window), -1), torch.where(valid, doc, -1)], 1)
    # the token leaving the window at t is written even when t itself is padding, as decoding does
    old_ok = (key_doc[:, :T] == doc) & (pos_c[:, :T] > sinks)
    index = sink_ok = None
    if sinks and gather_sinks:
        j = torch.arange(sinks, device=dev)
        if cu_seqlens is not None:  # sink j of a query is its document's token j
            index = (first[..., None] + j).clamp_max(T - 1)  # (B, T, S)
        else:  # the (j+1)-th real token of the row
            hit = valid[:, None, :] & (pos[:, None, :] == (j + 1)[None, :, None])  # (B, S, T)
            index = hit.int().argmax(-1)[:, None, :].expand(B, T, sinks)
        sink_ok = (pos[..., None] >= j + 1) & (index <= ar[None, :, None] - window) & valid[..., None]
        if cu_seqlens is None:  # one set of sinks per row
            index = index[:, :1]
    return FreshLayout(key_doc, query_doc, old_ok, pos * valid, index, sink_ok)


def cached_inputs(k: torch.Tensor, v: torch.Tensor, buffers: WindowBuffers, window: int, sinks: int,
                  mask: torch.Tensor | None = None) -> tuple[WindowInputs, WindowBuffers]:
    """A continuation: ``T`` new tokens after the ``buffers.rows`` positions (padding included) held in
    ``buffers``. Returns the inputs and the buffers after these tokens (the caller stores them). Reads no
    value on the host, so a decode step through it can be captured in a CUDA graph."""
    B, T = k.shape[:2]
    dev = k.device
    valid = torch.ones(B, T, dtype=torch.bool, device=dev) if mask is None else mask.bool()
    pos = (buffers.count[:, None] + valid.long().cumsum(1)) * valid
    index = buffers.rows[:, None] + torch.arange(T, device=dev)  # (B, T): row positions, padding counted
    sk, sv, si = buffers.sink_k.clone(), buffers.sink_v.clone(), buffers.sink_index.clone()
    rows = torch.arange(B, device=dev)
    for j in range(sinks):  # a new token at position j+1 becomes sink j
        hit = valid & (pos == j + 1)
        at = hit.int().argmax(-1)
        fill = hit.any(-1) & (si[:, j] < 0)
        sk[:, j] = torch.where(fill[:, None, None], k[rows, at].to(sk.dtype), sk[:, j])
        sv[:, j] = torch.where(fill[:, None, None], v[rows, at].to(sv.dtype), sv[:, j])
        si[:, j] = torch.where(fill, index[rows, at], si[:, j])
    sink_ok = ((si[:, None, :] >= 0) & (si[:, None, :] <= index[:, :, None] - window) & valid[..., None]
               if sinks else None)
    cat = lambda a, b: torch.cat([a, b.to(a.dtype)], 1)  # noqa: E731
    kk, vv, pos_c = cat(buffers.win_k, k), cat(buffers.win_v, v), cat(buffers.win_pos, pos)
    key_doc = torch.where(pos_c > 0, 0, -1)
    query_doc = torch.where(valid, 0, -2)
    inputs = WindowInputs(kk, vv, key_doc, query_doc, sk[:, None] if sinks else None, sv[:, None] if sinks else None,
                          sink_ok, pos_c[:, :T] > sinks, pos)
    after = WindowBuffers(sk, sv, si, kk[:, -window:], vv[:, -window:], pos_c[:, -window:],
                          buffers.count + valid.long().sum(1), buffers.rows + T)
    return inputs, after

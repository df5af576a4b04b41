"""The packed view every GDN kernel works on: tokens flattened, documents given by ``cu_seqlens``.

A dense ``[B, T]`` batch is the packing of B equal-length documents, so one code path serves both. The
host side builds the chunk tables (which chunk of which document each program takes); the ``@triton.jit``
helpers below read them inside the kernels.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common import TRITON_MAX_K, LastTensorMemo, cdiv

BT = 64  # chunk size
GRID_Y_MAX = 65535  # CUDA's limit on a grid's second and third dimensions


def grid_slices(n: int) -> list[tuple[int, int]]:
    """``(first, count)`` of each launch that covers ``n`` programs on a grid's second dimension: one launch
    up to :data:`GRID_Y_MAX` (a prompt of 4M tokens is 65,536 chunks), several of that many beyond."""
    return [(p, min(GRID_Y_MAX, n - p)) for p in range(0, n, GRID_Y_MAX)]


@triton.jit
def chunk_at(chunk_indices, cu_seqlens, chunk_offsets, i_t):
    """(bos, T, boh, i_c): start token and length of the chunk's sequence, its first chunk, the chunk's index in it."""
    i_n = tl.load(chunk_indices + i_t * 2).to(tl.int64)
    i_c = tl.load(chunk_indices + i_t * 2 + 1).to(tl.int64)
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    T = tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos
    boh = tl.load(chunk_offsets + i_n).to(tl.int64)
    return bos, T, boh, i_c


@triton.jit
def sequence_at(cu_seqlens, chunk_offsets, i_n):
    """(bos, T, boh): start token and length of sequence ``i_n`` and the index of its first chunk."""
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    T = tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos
    boh = tl.load(chunk_offsets + i_n).to(tl.int64)
    return bos, T, boh


@triton.jit
def chain_at(segments, cu_seqlens, chunk_offsets, i_c, E: tl.constexpr, BT: tl.constexpr):
    """(bos, T, boh, c0, c1) of chain ``i_c`` of a sequential state kernel: sequence ``i_c`` whole (``E`` = 0:
    its chunks 0 … c1 − 1), or the segment of ``E`` chunks that row ``i_c`` of ``segments`` (``Layout.groups(E)``)
    names, chunks c0 … c1 − 1 of its sequence; bos, T, boh as :func:`sequence_at` gives them."""
    if E == 0:
        i_n, c0 = i_c, 0
    else:
        i_n = tl.load(segments + i_c * 2).to(tl.int64)
        c0 = tl.load(segments + i_c * 2 + 1).to(tl.int64) * E
    bos, T, boh = sequence_at(cu_seqlens, chunk_offsets, i_n)
    c1 = tl.cdiv(T, BT)
    if E > 0:
        c1 = tl.minimum(c0 + E, c1)
    return bos, T, boh, c0, c1


@triton.jit
def state_slot(boh, i_n, i_c, EVERY: tl.constexpr):
    """Row of ``hs`` holding the state entering chunk ``i_c`` (a multiple of ``EVERY``) of sequence ``i_n``,
    whose first chunk is chunk ``boh`` overall: that chunk's row when every state is kept, else
    ``boh // E + i_n + i_c // E``, which rises within a sequence and starts past the previous sequence's last
    row (``(boh + c) // E + 1 ≥ boh // E + ⌈c / E⌉`` for its c chunks); ``n_slots(NC, N, E)`` rows in all."""
    if EVERY == 1:
        return boh + i_c
    else:
        return boh // EVERY + i_n + i_c // EVERY


def n_slots(NC: int, N: int, every: int) -> int:
    """Rows of ``hs`` for ``NC`` chunks in ``N`` sequences, one state kept per ``every`` chunks (``state_slot``)."""
    return max(NC, 1) if every == 1 else NC // every + N + 1


def _chunk_tables(cu_seqlens: torch.Tensor) -> tuple:
    """``(chunk_indices [NC, 2] = (sequence, chunk in sequence), chunk_offsets [N+1], NC, counts, groups)``:
    ``counts`` the chunks of each sequence, on the host; ``groups`` the group tables by group size (the
    output kernel's, the state kernels' segments) and their offsets, filled by ``Layout.groups`` and
    ``Layout.group_offsets``. One device→host copy of ``cu_seqlens`` (the grid size depends on
    it); the rest is vectorized."""
    dev = cu_seqlens.device
    cu = cu_seqlens.to("cpu", torch.int64)
    counts = (cu[1:] - cu[:-1] + BT - 1) // BT
    offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
    NC = int(offsets[-1])
    return _indices(counts, dev), offsets.to(dev, torch.int32), NC, counts, {}


def _indices(counts: torch.Tensor, dev) -> torch.Tensor:
    """``[Σ counts, 2]`` int32 on ``dev``: (sequence, index in sequence) of every item, ``counts`` items per
    sequence (host tensor); one row of zeros when there are none."""
    n = int(counts.sum())
    if n == 0:
        return torch.zeros(1, 2, dtype=torch.int32, device=dev)
    seq = torch.repeat_interleave(torch.arange(counts.numel()), counts)
    offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
    return torch.stack([seq, torch.arange(n) - offsets[seq]], 1).to(dev, torch.int32)


def _dense_tables(B: int, T: int, device) -> tuple:
    """The tables of B documents of length T (as ``_chunk_tables``), built without reading anything back
    from the GPU."""
    key = (B, T, str(device))
    if key not in _DENSE:
        n = cdiv(T, BT)
        cu = torch.arange(0, (B + 1) * T, T, dtype=torch.int32, device=device)
        off = torch.arange(0, (B + 1) * n, n, dtype=torch.int32, device=device) if n else torch.zeros(B + 1, dtype=torch.int32, device=device)
        _DENSE.clear()  # one shape at a time is what training and benchmarks use
        _DENSE[key] = (cu, _grid(B, n, device), off, B * n, torch.full((B,), n, dtype=torch.int64), {})
    return _DENSE[key]


def _grid(B: int, n: int, device) -> torch.Tensor:
    """``_indices`` of B sequences of n items each, made on ``device`` (no host → device copy)."""
    if B * n == 0:
        return torch.zeros(1, 2, dtype=torch.int32, device=device)
    seq = torch.arange(B, dtype=torch.int32, device=device).repeat_interleave(n)
    return torch.stack([seq, torch.arange(n, dtype=torch.int32, device=device).repeat(B)], 1)


_DENSE: dict = {}
_PACKED = LastTensorMemo()  # the tables of the last cu_seqlens: every layer passes the same one


class Layout:
    """The packed view every kernel works on: tokens flattened, documents given by ``cu_seqlens``."""

    def __init__(self, q, v, cu_seqlens):
        B, T, self.HQ, self.K = q.shape
        if self.K > TRITON_MAX_K:
            raise ValueError(f"the Triton backend takes key head sizes up to {TRITON_MAX_K}; got {self.K} (use backend='torch')")
        self.H, self.V = v.shape[2], v.shape[3]
        self.G = self.HQ // self.H
        self.tokens = B * T
        if cu_seqlens is None:  # a dense batch is B packed documents of length T
            tables = _dense_tables(B, T, q.device)
        else:
            def tables():
                cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
                return (cu, *_chunk_tables(cu))

            tables = _PACKED.get(cu_seqlens, tables)
        self.cu_seqlens, self.chunk_indices, self.chunk_offsets, self.NC, self._counts, self._groups = tables
        self.N = self.cu_seqlens.numel() - 1
        self.dense = cu_seqlens is None
        self.ieee = q.dtype == torch.float32
        self.device = q.device

    def groups(self, E: int) -> tuple[torch.Tensor, int]:
        """``(group_indices [NG, 2] = (sequence, group in sequence), NG)``: each sequence's chunks in groups of
        ``E`` (the last one shorter), the output kernel's grid. Built once per chunk table: on the GPU for a
        dense batch, from the host's chunk counts (one host → device copy) for packed documents."""
        if E == 1:
            return self.chunk_indices, self.NC
        if E not in self._groups:
            counts = (self._counts + E - 1) // E
            table = _grid(self.N, int(counts[0]) if self.N else 0, self.device) if self.dense else _indices(counts, self.device)
            self._groups[E] = (table, int(counts.sum()))
        return self._groups[E]

    def n_groups(self, E: int) -> int:
        """How many groups of ``E`` chunks :meth:`groups` makes (from the host's chunk counts: no table built)."""
        return int(((self._counts + E - 1) // E).sum())

    def group_offsets(self, E: int) -> torch.Tensor:
        """``[N + 1]`` int32: where each sequence's groups of ``E`` chunks (:meth:`groups`) start among all
        groups. On the GPU for a dense batch; for packed documents one host → device copy, kept."""
        key = ("offsets", E)
        if key not in self._groups:
            counts = (self._counts + E - 1) // E
            if self.dense:
                n = int(counts[0]) if self.N else 0
                off = torch.arange(0, (self.N + 1) * n, n, dtype=torch.int32, device=self.device) if n else \
                    torch.zeros(self.N + 1, dtype=torch.int32, device=self.device)
            else:
                off = torch.cat([counts.new_zeros(1), counts.cumsum(0)]).to(self.device, torch.int32)
            self._groups[key] = off
        return self._groups[key]

    @property
    def longest(self) -> int:
        """Chunks of the longest sequence (read from the host's counts: no device sync)."""
        return int(self._counts.max()) if self.N else 0

    @staticmethod
    def flat(*xs):
        """[B, T, H, D] → [B·T, H, D] and [B, T, H] → [B·T, H], contiguous."""
        return [x.contiguous().view(x.shape[0] * x.shape[1], *x.shape[2:]) for x in xs]

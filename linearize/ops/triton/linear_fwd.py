"""Triton forward of the decayed linear attention (:mod:`linearize.ops.linear`), chunkwise. With its switch on
(``linear_fused.ONE_PASS``) 16-bit inputs with keys up to 128 wide take the one pass of
``ops/triton/linear_fused.py`` (no state stored per chunk), which builds on the kernels here; the rest take the
two stages below, and the backward recomputes stage 1's states with :func:`linear_fwd_h` whatever the forward
took. Two stages:

1. per (V block, K block, sequence × KV head), over the chunks in order — the only sequential part — store
   the state entering each chunk and carry ``h ← exp(G_C) h + Σ_j exp(G_C − G_j) w_j k_j v_jᵀ`` in float32
   (no delta rule couples a state's rows, so a program may hold a block of the key channels); the factors
   ``exp(G_C)`` and ``w_j exp(G_C − G_j)`` come from a pass over every chunk at once before it, so that the
   chain over the chunks does no scan of its own. Where a few long sequences would leave the GPU's SMs idle
   along one chain of hundreds of chunks, the chain is cut into segments of ``E`` chunks (:func:`linear_segment`):
   each segment's own states from zero (stored per chunk) and total decay in parallel, then a short chain over
   the segments for the state entering each (:func:`_linear_carry_kernel`): a chunk's state is its segment's
   own plus the segment's entering state times the decay between them, summed where it is read
   (:func:`chunk_state`), so no second pass over the segments stores it;
2. per (V block, chunk, query head), in parallel:
   ``o_r = scale·(exp(G_r) q_r h_0 + Σ_{j≤r} exp(G_r − G_j) w_j (q_r·k_j) v_j) (+ v_offset_r)``.

``G`` is the cumulative log-decay inside the chunk, summed in the kernels; every exponent is ≤ 0, and the
decays between two tokens are summed from the g between them (:func:`chunk_gates`, :func:`pair_decays`). The backward
is ``ops/triton/linear_bwd.py``, which recomputes stage 1 with :func:`linear_fwd_h`. Packed documents
and dense batches share the chunk tables of :class:`~linearize.ops.triton.layout.Layout`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..common import cdiv, next_pow2
from .layout import BT, Layout, chain_at, chunk_at, grid_slices
from .settings import block_k, sms_for, state_bv
from .tiles import mm


@triton.jit
def chunk_gates(g, w, t0, o_r, n, H: tl.constexpr, BT: tl.constexpr):
    """``(G, w, G_C, tail)`` of one chunk as float32: the in-chunk cumulative log-decay, the write weights
    (0 past the end), the chunk's total log-decay and ``tail_j = Σ_{i>j} g_i`` (= G_C − G_j). ``g``, ``w``
    point at the sequence's first token and head; ``n``: its tokens from ``t0`` on. The tail is a reverse
    cumsum of the g that follow each token (loaded one token on), a sum of exactly those terms, not
    G_C − G_j: under strong decays |G| reaches thousands inside a chunk, and that difference keeps ~1e-4 of
    absolute error in the exponent. ``G_C`` is the cumsum's last element (g is 0 past the end)."""
    m_t = o_r < n
    b_g = tl.load(g + (t0 + o_r) * H, mask=m_t, other=0.0).to(tl.float32)
    b_w = tl.load(w + (t0 + o_r) * H, mask=m_t, other=0.0).to(tl.float32)
    b_next = tl.load(g + (t0 + o_r + 1) * H, mask=(o_r + 1 < BT) & (o_r + 1 < n), other=0.0).to(tl.float32)
    b_G = tl.cumsum(b_g, 0)
    return b_G, b_w, tl.sum(tl.where(o_r == BT - 1, b_G, 0.0), 0), tl.cumsum(b_next, 0, reverse=True)


@triton.jit
def pair_decays(g, t0, o_r, m_t, H: tl.constexpr, BT: tl.constexpr):
    """``D[r, j] = exp(Σ_{j<i≤r} g_i)`` (= exp(G_r − G_j)) for r ≥ j at a token of the chunk, else 0; the sum
    taken over the g between the two tokens, for the reason :func:`chunk_gates` gives its tail."""
    b_g = tl.load(g + (t0 + o_r) * H, mask=m_t, other=0.0).to(tl.float32)
    b_L = tl.cumsum(tl.where(o_r[:, None] > o_r[None, :], b_g[:, None], 0.0), 0)  # [i → r, j]: Σ_{j<i≤r} g_i
    causal = (o_r[:, None] >= o_r[None, :]) & m_t[None, :]
    return tl.exp(tl.where(causal, b_L, float("-inf")))


@triton.jit
def _linear_gates_kernel(g, w, coef, decay, qdec, cu_seqlens, chunk_indices, chunk_offsets, H: tl.constexpr,
                         BT: tl.constexpr, QDEC: tl.constexpr):
    """Per (chunk, KV head), in parallel: ``coef_j = w_j exp(G_C − G_j)`` of its tokens and ``decay = exp(G_C)``,
    what :func:`_linear_state_kernel` carries the state with (:func:`chunk_gates`' sums); with ``QDEC`` also
    ``exp(G_r)`` of its tokens, what the backward's state kernel weighs the queries with."""
    i_t, i_h = tl.program_id(0), tl.program_id(1)
    bos, T, boh, i_c = chunk_at(chunk_indices, cu_seqlens, chunk_offsets, i_t)
    t0, o_r = i_c * BT, tl.arange(0, BT)
    b_G, b_w, g_last, b_tail = chunk_gates(g + bos * H + i_h, w + bos * H + i_h, t0, o_r, T - t0, H, BT)
    rows = (bos + t0 + o_r) * H + i_h
    tl.store(coef + rows, b_w * tl.exp(b_tail), mask=o_r < T - t0)
    tl.store(decay + (boh + i_c) * H + i_h, tl.exp(g_last))
    if QDEC:
        tl.store(qdec + rows, tl.exp(b_G), mask=o_r < T - t0)


@triton.jit
def _linear_state_kernel(
    k, v, coef, decay, hs, h0, ht, dseg, dcum, cu_seqlens, chunk_offsets, segments,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    E: tl.constexpr, USE_H0: tl.constexpr, STORE_HS: tl.constexpr, STORE_HT: tl.constexpr, IEEE: tl.constexpr,
):
    """Per (V block, K block, chain × KV head): a chain is a whole sequence (``E`` = 0) or the segment of ``E``
    chunks that row ``i`` of ``segments`` names (sequence, segment). ``h0``/``ht``: the state entering/leaving
    each chain; with ``E`` > 0 and ``STORE_HT``, ``dseg`` gets the chain's total decay ``Π exp(G_C)``, and with
    ``STORE_HS`` ``dcum`` [NC, H] the decay from the chain's start to each chunk (:func:`chunk_state`)."""
    i_v, i_k, i_nh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_c, i_h = i_nh // H, i_nh % H  # the chain
    bos, T, boh, c0, c1 = chain_at(segments, cu_seqlens, chunk_offsets, i_c, E, BT)
    o_k, o_v, o_r = i_k * BK + tl.arange(0, BK), i_v * BV + tl.arange(0, BV), tl.arange(0, BT)
    m_k, m_v = o_k < K, o_v < V
    p_h, m_h = o_k[:, None] * V + o_v[None, :], m_k[:, None] & m_v[None, :]
    k += (bos * H + i_h) * K
    v += (bos * H + i_h) * V
    coef += bos * H + i_h
    decay += boh * H + i_h
    dcum += boh * H + i_h
    hs += (boh * H + i_h) * K * V
    b_h = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_H0:
        b_h = tl.load(h0 + i_nh.to(tl.int64) * K * V + p_h, mask=m_h, other=0.0).to(tl.float32)
    b_d = tl.full([], 1.0, tl.float32)
    for i_t in range(c0, c1):
        t0 = i_t * BT
        m_t = o_r < T - t0
        if STORE_HS:  # the state entering chunk i_t
            tl.store(hs + i_t * (H * K * V) + p_h, b_h.to(hs.dtype.element_ty), mask=m_h)
            if E > 0:  # every (V, K) block of the chain stores the same value
                tl.store(dcum + i_t * H, b_d)
        b_c = tl.load(coef + (t0 + o_r) * H, mask=m_t, other=0.0)
        b_k = tl.load(k + (t0 + o_r)[:, None] * (H * K) + o_k[None, :], mask=m_t[:, None] & m_k[None, :], other=0.0)
        b_v = tl.load(v + (t0 + o_r)[:, None] * (H * V) + o_v[None, :], mask=m_t[:, None] & m_v[None, :], other=0.0)
        b_kw = b_k.to(tl.float32) * b_c[:, None]  # w_j k_j exp(G_C − G_j)
        b_e = tl.load(decay + i_t * H)
        b_h = b_h * b_e + mm(tl.trans(b_kw), b_v, b_v, IEEE)
        if E > 0:
            b_d *= b_e
    if STORE_HT:
        tl.store(ht + i_nh.to(tl.int64) * K * V + p_h, b_h, mask=m_h)
        if E > 0:  # every (V, K) block of the chain stores the same value
            tl.store(dseg + i_nh, b_d)


@triton.jit
def _linear_carry_kernel(hloc, dseg, hin, h0, ht, seg_offsets, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                         BK: tl.constexpr, BV: tl.constexpr, USE_H0: tl.constexpr, STORE_HT: tl.constexpr,
                         REVERSE: tl.constexpr):
    """Per (V block, K block, sequence × KV head), over its segments in order (``REVERSE``: last first), the
    chain the segmented state kernels leave: store the state ``hin`` entering each segment, then
    ``h ← dseg·h + hloc`` with the segment's own total decay and own state from zero; ``h0`` starts the chain,
    ``ht`` gets its end. The backward's gradient chain is the same, run from the sequence's end."""
    i_v, i_k, i_nh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_n, i_h = i_nh // H, i_nh % H
    s0 = tl.load(seg_offsets + i_n).to(tl.int64)
    ns = tl.load(seg_offsets + i_n + 1).to(tl.int64) - s0
    o_k, o_v = i_k * BK + tl.arange(0, BK), i_v * BV + tl.arange(0, BV)
    p_h, m_h = o_k[:, None] * V + o_v[None, :], (o_k < K)[:, None] & (o_v < V)[None, :]
    b_h = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_H0:
        b_h = tl.load(h0 + i_nh.to(tl.int64) * K * V + p_h, mask=m_h, other=0.0).to(tl.float32)
    for i in range(ns):
        if REVERSE:
            i_s = s0 + ns - 1 - i
        else:
            i_s = s0 + i
        p_s = (i_s * H + i_h) * K * V + p_h
        tl.store(hin + p_s, b_h.to(hin.dtype.element_ty), mask=m_h)
        b_h = b_h * tl.load(dseg + i_s * H + i_h) + tl.load(hloc + p_s, mask=m_h, other=0.0)
    if STORE_HT:
        tl.store(ht + i_nh.to(tl.int64) * K * V + p_h, b_h.to(ht.dtype.element_ty), mask=m_h)


@triton.jit
def chunk_state(hs, hin, dcum, seg_offsets, chunk_indices, i_t, boh, i_c, i_h, p_kv, m_kv, H: tl.constexpr,
                K: tl.constexpr, V: tl.constexpr, E: tl.constexpr):
    """The (K, V) block ``p_kv`` of the state ``hs`` holds for chunk ``i_c`` of its sequence (whose first chunk is
    ``boh``; ``i_t``: its row of ``chunk_indices``), in ``hs``' dtype. With ``E`` > 0 the sequential kernels cut
    the chain into segments of ``E`` chunks and ``hs`` holds each chunk's share from its segment alone: the
    whole is ``hs + dcum · hin[segment]`` (``dcum`` [NC, H]: the decay between the segment's end that ``hin``
    [NS, H, K, V] holds the state at and the chunk; ``seg_offsets``: each sequence's first segment), summed in
    float32. ``hin`` has ``hs``' dtype, as a chunk's whole state has without segments: in 16 bits it keeps the
    readers' registers where they were (the output kernel 136 at K = V = 128 in bf16, 178 with ``hin`` in
    float32; Triton 3.6, sm_90).
    The backward's gradients of the states take the same form from the segment's other end."""
    p_c = (boh + i_c) * H + i_h
    b_h = tl.load(hs + p_c * K * V + p_kv, mask=m_kv, other=0.0)
    if E > 0:
        i_n = tl.load(chunk_indices + i_t * 2).to(tl.int64)
        i_s = tl.load(seg_offsets + i_n).to(tl.int64) + i_c // E
        b_in = tl.load(hin + (i_s * H + i_h) * K * V + p_kv, mask=m_kv, other=0.0)
        b_h = (b_h.to(tl.float32) + tl.load(dcum + p_c) * b_in).to(hs.dtype.element_ty)
    return b_h


@triton.jit
def chunk_output(q, k, v, g, w, o, v_offset, b_h, bos, T, t0, i_h, i_hq, i_v, scale, H: tl.constexpr,
                 HQ: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                 BV: tl.constexpr, USE_OFFSET: tl.constexpr, IEEE: tl.constexpr):
    """Store the output rows of the chunk at token ``t0`` of the sequence at ``bos`` (``T`` tokens) for query
    head ``i_hq`` and V block ``i_v``, from ``b_h`` (K × BV), the state entering the chunk:
    ``o_r = scale·(exp(G_r) q_r h_0 + Σ_{j≤r} exp(G_r − G_j) w_j (q_r·k_j) v_j) (+ v_offset_r)``."""
    o_k, o_v, o_r = tl.arange(0, BK), i_v * BV + tl.arange(0, BV), tl.arange(0, BT)
    m_k, m_v, m_t = o_k < K, o_v < V, o_r < T - t0
    rows = bos + t0 + o_r  # (BT,) int64: the chunk's tokens
    m_tk, m_tv = m_t[:, None] & m_k[None, :], m_t[:, None] & m_v[None, :]
    b_q = tl.load(q + (rows * HQ + i_hq)[:, None] * K + o_k[None, :], mask=m_tk, other=0.0)
    b_k = tl.load(k + (rows * H + i_h)[:, None] * K + o_k[None, :], mask=m_tk, other=0.0)
    b_v = tl.load(v + (rows * H + i_h)[:, None] * V + o_v[None, :], mask=m_tv, other=0.0)
    b_G, b_w, _, _ = chunk_gates(g + bos * H + i_h, w + bos * H + i_h, t0, o_r, T - t0, H, BT)
    b_o = mm(b_q, b_h, b_q, IEEE) * tl.exp(b_G)[:, None]  # exp(G_r) q_r h_0
    b_d = pair_decays(g + bos * H + i_h, t0, o_r, m_t, H, BT)  # exp(G_r − G_j), 0 above the diagonal
    b_s = mm(b_q, tl.trans(b_k), b_q, IEEE) * b_d * b_w[None, :]
    b_o = (b_o + mm(b_s, b_v, b_v, IEEE)) * scale
    if USE_OFFSET:
        b_o += tl.load(v_offset + (rows * H + i_h)[:, None] * V + o_v[None, :], mask=m_tv, other=0.0).to(tl.float32)
    tl.store(o + (rows * HQ + i_hq)[:, None] * V + o_v[None, :], b_o.to(o.dtype.element_ty), mask=m_tv)


@triton.jit
def _linear_output_kernel(
    q, k, v, g, w, hs, hin, dcum, seg_offsets, o, v_offset, cu_seqlens, chunk_indices, chunk_offsets, scale, p0,
    H: tl.constexpr, HQ: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
    BV: tl.constexpr, E: tl.constexpr, USE_OFFSET: tl.constexpr, IEEE: tl.constexpr,
):
    """Per (V block, chunk, query head): :func:`chunk_output` from the chunk's state (:func:`chunk_state`)."""
    i_v, i_t, i_hq = tl.program_id(0), tl.program_id(1) + p0, tl.program_id(2)  # p0: this launch's first chunk
    i_h = i_hq // (HQ // H)  # query heads h·G … h·G + G − 1 read KV head h
    bos, T, boh, i_c = chunk_at(chunk_indices, cu_seqlens, chunk_offsets, i_t)
    o_k, o_v = tl.arange(0, BK), i_v * BV + tl.arange(0, BV)
    b_h = chunk_state(hs, hin, dcum, seg_offsets, chunk_indices, i_t, boh, i_c, i_h, o_k[:, None] * V + o_v[None, :],
                      (o_k < K)[:, None] & (o_v < V)[None, :], H, K, V, E)
    chunk_output(q, k, v, g, w, o, v_offset, b_h, bos, T, i_c * BT, i_h, i_hq, i_v, scale, H, HQ, K, V, BT, BK, BV,
                 USE_OFFSET, IEEE)


def linear_bv(K: int, V: int) -> int:
    """V block of every linear-attention kernel: 64, 32 for 256-wide keys, at most V's next power of two."""
    return min(64 if block_k(K) <= 128 else 32, max(16, next_pow2(V)))


SEGMENT = 16  # chunks per segment of a cut state chain (linear_segment)
SEGMENT_FROM = 256  # the chunks of the longest sequence from which a chain is cut, where pairs are few


def linear_segment(layout: Layout, device: torch.device) -> int:
    """Chunks per segment of the sequential state kernels, or 0 (each sequence one chain): ``SEGMENT`` on CUDA
    where (sequence, head) pairs are fewer than the SMs and a sequence reaches ``SEGMENT_FROM`` chunks — a chain
    of a thousand small steps is then the whole cost, and cut in segments it runs as three chains of at most
    ``SEGMENT`` and ``NC / SEGMENT`` steps, with a program per segment."""
    L = layout
    sms = sms_for(L.N * L.H, device)
    return SEGMENT if sms is not None and L.N * L.H < sms and L.longest >= SEGMENT_FROM else 0


def linear_state_bv(layout: Layout, device: torch.device, chains: int | None = None) -> int:
    """V block of the sequential state kernels (forward and backward): the GDN state kernels' rule
    (:func:`~linearize.ops.triton.settings.state_bv`), narrower while too few (chain, head) pairs fill the
    GPU — at long T and a small batch the chain over the chunks is the whole cost. ``chains``: the chains
    (segments, :func:`linear_segment`; default one per sequence)."""
    L = layout
    pairs = (L.N if chains is None else chains) * L.H
    return state_bv(L.K, L.V, L.ieee, pairs, sms_for(pairs, device))


def linear_state_bk(layout: Layout, bv: int, device: torch.device, chains: int | None = None) -> int:
    """K block of the sequential state kernels (forward and backward): the whole key row, halved (down to 32)
    while their programs — V blocks × K blocks × (chain, head) pairs — would not give every SM of the GPU
    one (off CUDA: whole)."""
    L = layout
    pairs = (L.N if chains is None else chains) * L.H
    bk, sms = block_k(L.K), sms_for(pairs, device)
    while sms is not None and bk > 32 and pairs * cdiv(L.V, bv) * cdiv(L.K, bk) < sms:
        bk //= 2
    return bk


def linear_gates(layout: Layout, g, w, query_decays: bool = False) -> tuple:
    """``(coef [tokens, H], decay [NC, H], qdec [tokens, H] or None)`` in float32 for the sequential state
    kernels: ``w_j exp(G_C − G_j)``, ``exp(G_C)`` and, with ``query_decays``, ``exp(G_r)``. ``g``, ``w``: flat
    float32 ``[tokens, H]``."""
    L = layout
    coef = torch.empty(L.tokens, L.H, dtype=torch.float32, device=g.device)
    decay = torch.empty(max(L.NC, 1), L.H, dtype=torch.float32, device=g.device)
    qdec = torch.empty_like(coef) if query_decays else None
    _linear_gates_kernel[(L.NC, L.H)](g, w, coef, decay, qdec if query_decays else coef, L.cu_seqlens,
                                      L.chunk_indices, L.chunk_offsets, H=L.H, BT=BT, QDEC=query_decays, num_warps=2)
    return coef, decay, qdec


def carry_segments(L: Layout, E: int, BK: int, BV: int, hloc, dseg, hin, h0, ht, *, reverse: bool) -> None:
    """The chain over each sequence's segments of ``E`` chunks (:func:`_linear_carry_kernel`): ``hin`` ``[NS, H,
    K, V]`` gets the state entering each segment (``reverse``: the gradient leaving it) from the segments' own
    ``hloc`` and total decays ``dseg``; ``h0`` (or None: zero) starts each sequence's chain, ``ht`` (when given)
    gets its end."""
    _linear_carry_kernel[(cdiv(L.V, BV), cdiv(L.K, BK), L.N * L.H)](
        hloc, dseg, hin, h0 if h0 is not None else hin, ht if ht is not None else hin, L.group_offsets(E),
        H=L.H, K=L.K, V=L.V, BK=BK, BV=BV, USE_H0=h0 is not None, STORE_HT=ht is not None, REVERSE=reverse,
        num_warps=4)


class Split(NamedTuple):
    """How the states a sequential kernel stored per chunk are read (:func:`chunk_state`): ``E`` = 0, whole; else
    each chunk's share from its segment of ``E`` chunks, plus ``dcum`` [NC, H] times ``hin`` [NS, H, K, V]
    (in the states' dtype), the state at the segment's end; ``offsets`` [N + 1]: each sequence's first segment."""

    hin: torch.Tensor
    dcum: torch.Tensor
    offsets: torch.Tensor
    E: int

    def args(self) -> tuple:
        return self.hin, self.dcum, self.offsets


def segment_buffers(L: Layout, NS: int, dtype: torch.dtype) -> tuple:
    """The buffers of ``NS`` segments' chains (forward or backward): each segment's own state at its far end
    (float32) and the state the chain over the segments gives it (``dtype``, the stored states' own:
    :func:`chunk_state`), the segment's total decay, and the decay between that state and each chunk
    (:class:`Split`'s ``dcum``)."""
    own = torch.empty(NS, L.H, L.K, L.V, dtype=torch.float32, device=L.device)
    entering = torch.empty(NS, L.H, L.K, L.V, dtype=dtype, device=L.device)
    dseg = torch.empty(NS, L.H, dtype=torch.float32, device=L.device)
    return own, entering, dseg, torch.empty(L.NC, L.H, dtype=torch.float32, device=L.device)


def linear_fwd_h(*, layout: Layout, k, v, g, w, hs, h0=None, ht=None, gates=None, segment=None) -> Split:
    """Stage 1 (also the backward's recomputation): fill ``hs`` ``[NC, H, K, V]`` with the state entering every
    chunk — where the chain is cut into segments of ``segment`` chunks (default :func:`linear_segment`'s), each
    chunk's share from its segment, the rest in the returned :class:`Split` — and, when given, ``ht`` with each
    sequence's final state. ``hs`` None (segments only): no chunk's state stored, the Split's ``hin`` the state
    entering each segment in float32 (where the one-pass forward, ``linear_fused``, starts each).
    ``k``, ``v``: flat ``[tokens, H, ·]``; ``g``, ``w``: flat float32 ``[tokens, H]``; ``h0``: float32
    ``[N, H, K, V]`` or None; ``gates``: :func:`linear_gates` of g and w, if made already."""
    L = layout
    coef, decay, _ = gates or linear_gates(L, g, w)
    E = linear_segment(L, k.device) if segment is None else segment
    assert hs is not None or E > 0, "only cut chains can leave the chunks' states unstored"
    segments, NS = L.groups(E) if E else (L.cu_seqlens, L.N)
    BV = linear_state_bv(L, k.device, NS)
    BK = linear_state_bk(L, BV, k.device, NS)
    grid = (cdiv(L.V, BV), cdiv(L.K, BK), NS * L.H)
    common = {"H": L.H, "K": L.K, "V": L.V, "BT": BT, "BK": BK, "BV": BV, "E": E, "IEEE": L.ieee, "num_warps": 4}
    if not E:
        _linear_state_kernel[grid](
            k, v, coef, decay, hs, h0 if h0 is not None else hs, ht if ht is not None else hs, decay, decay,
            L.cu_seqlens, L.chunk_offsets, segments, USE_H0=h0 is not None, STORE_HS=True, STORE_HT=ht is not None,
            **common)
        return Split(hs, decay, L.cu_seqlens, 0)
    # each segment's states from zero, its end state and total decay; then the chain over the segments
    hend, hin, dseg, dcum = segment_buffers(L, NS, hs.dtype if hs is not None else torch.float32)
    stored = hs if hs is not None else hend  # not written without STORE_HS
    _linear_state_kernel[grid](k, v, coef, decay, stored, stored, hend, dseg, dcum, L.cu_seqlens, L.chunk_offsets,
                               segments, USE_H0=False, STORE_HS=hs is not None, STORE_HT=True, **common)
    carry_segments(L, E, BK, BV, hend, dseg, hin, h0, ht, reverse=False)
    return Split(hin, dcum, L.group_offsets(E), E)


def linear_attention_triton(q, k, v, g, w, *, scale: float = 1.0, initial_state=None, output_final_state: bool = False,
                            cu_seqlens=None, v_offset=None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The forward of :func:`linearize.ops.linear.linear_attention` on the kernels above (inputs checked
    there). ``(o [B, T, G·H, V] in v's dtype, final float32 state [N, H, K, V] or None)``."""
    B, T, HQ, K = q.shape
    L = Layout(q, v, cu_seqlens)
    H, V, ieee = L.H, L.V, L.ieee
    qf, kf, vf = Layout.flat(q, k, v)
    gf, wf = (x.float() for x in Layout.flat(g, w))
    BK = block_k(K)
    BV = linear_bv(K, V)
    ht = torch.empty(L.N, H, K, V, dtype=torch.float32, device=q.device) if output_final_state else None
    h0 = initial_state.to(torch.float32).contiguous() if initial_state is not None else None
    o = torch.empty(L.tokens, HQ, V, dtype=v.dtype, device=q.device)
    if L.NC == 0:  # no tokens: the state passes through
        if ht is not None:
            ht.copy_(h0 if h0 is not None else torch.zeros_like(ht))
        return o.view(B, T, HQ, V), ht
    off = Layout.flat(v_offset)[0] if v_offset is not None else None
    from .linear_fused import fused_segment, linear_fused_forward, use_fused  # it builds on this module

    if use_fused(L):
        linear_fused_forward(L, qf, kf, vf, gf, wf, o, off, h0, ht, scale, fused_segment(L, q.device))
        return o.view(B, T, HQ, V), ht
    common = {"H": H, "K": K, "V": V, "BT": BT, "BK": BK, "BV": BV, "IEEE": ieee}
    off = off if off is not None else vf  # a pointer the kernel does not read without USE_OFFSET
    hs = torch.empty(max(L.NC, 1), H, K, V, dtype=torch.float32 if ieee else k.dtype, device=q.device)
    split = linear_fwd_h(layout=L, k=kf, v=vf, g=gf, w=wf, hs=hs, h0=h0, ht=ht)
    for p0, n in grid_slices(L.NC):
        _linear_output_kernel[(cdiv(V, BV), n, HQ)](
            qf, kf, vf, gf, wf, hs, *split.args(), o, off, L.cu_seqlens, L.chunk_indices, L.chunk_offsets, float(scale),
            p0, HQ=HQ, E=split.E, USE_OFFSET=v_offset is not None, **common, num_warps=4)
    return o.view(B, T, HQ, V), ht

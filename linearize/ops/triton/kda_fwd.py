"""Triton forward of KDA, the gated delta rule with one decay per key channel (:mod:`linearize.ops.kda`: read
its docstring first), chunk 64, GQA-native and varlen. Four kernel stages (two launchers for the first two):

0. ``_solve_kernel``    per (chunk, KV head): ``G`` the in-chunk cumulative log-decay per channel,
   ``A = strictly-lower(β_r Σ_i k_ri k_ji exp(G_ri − G_ji))`` in 16-row bands, ``T = (I + A)⁻¹`` as the GDN
   solve inverts it (:func:`solve.store_inverse`); T is kept for the backward.
1. ``_prepare_kernel``  per (chunk, KV head): ``W = T (βγ⊙k)`` and ``U = T (βv)``.
2. ``_state_kernel``    per (V block, sequence × KV head), over the chunks in order — the only sequential part:
   stores the state entering each chunk, ``Δ = U − W h``, then ``h ← Diag(γ_C) h + (k ⊙ exp(G_C − G))ᵀ Δ``.
3. ``_output_kernel``   per (V block, chunk, query head):
   ``o = scale·((γ⊙q) h + P Δ) (+ v_offset)``, ``P_rj = Σ_i q_ri k_ji exp(G_ri − G_ji)`` (j ≤ r).

Every exponent is ≤ 0 (``g ≤ 0``): the pairwise decays go through :mod:`kda_tiles`. G is recomputed from g
by each kernel (a (64, K) cumsum) rather than stored. The backward (``kda_bwd.py``) runs stages 1 and 2
again, on the forward's T. Dots in the inputs' dtype with float32 accumulation (IEEE fp32 for fp32 inputs).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common import cdiv, next_pow2
from .kda_tiles import chunk_log_decay, decayed_scores, row_of
from .layout import BT, Layout, chunk_at, sequence_at
from .settings import block_k
from .solve import store_inverse
from .tiles import mm

SUB = 16  # rows of a sub-chunk: the pairwise decays are taken inside one (kda_tiles)


@triton.jit
def _band(k, g, beta, r, m, i_h, H: tl.constexpr, K: tl.constexpr, BK: tl.constexpr):
    """``(k, g, β)`` of one band of ``BT/4`` rows (token indices ``r``, ``m`` inside the document): k in its
    dtype, g and β as float32, 0 past the document's end."""
    o_k = tl.arange(0, BK)
    p = (r * H + i_h)[:, None] * K + o_k[None, :]
    m_k = m[:, None] & (o_k < K)[None, :]
    return (tl.load(k + p, mask=m_k, other=0.0), tl.load(g + p, mask=m_k, other=0.0).to(tl.float32),
            tl.load(beta + r * H + i_h, mask=m, other=0.0).to(tl.float32))


@triton.jit
def _cross(ka, Ga, ba, kb, Gb, IEEE: tl.constexpr):
    """The block of ``A`` between two bands, rows of band a after those of band b:
    ``β_r Σ_i k_ri k_ji exp(G_ri − G_ji)``, through the log-decay at band a's first row (both factors ≤ 1)."""
    ref = row_of(Ga, 0)
    ea = tl.exp(Ga - ref[None, :])
    fb = tl.exp(ref[None, :] - Gb)
    return mm(ka.to(tl.float32) * ea, tl.trans(kb.to(tl.float32) * fb), ka, IEEE) * ba[:, None]


@triton.jit
def _solve_kernel(
    k, g, beta, tm, chunk_indices, cu_seqlens, chunk_offsets,
    H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr,
):
    """Per (chunk, KV head): ``T = (I + A)⁻¹``, ``A = strictly-lower(β_r Σ_i k_ri k_ji exp(G_ri − G_ji))``, in
    four bands of ``BT/4`` rows as the GDN solve holds it (:func:`solve.store_inverse`): the six blocks between
    bands by :func:`_cross`, the four inside one by :func:`kda_tiles.decayed_scores` on the band."""
    BC: tl.constexpr = BT // 4
    i_t, i_h = tl.program_id(0), tl.program_id(1)
    bos, T, _, i_c = chunk_at(chunk_indices, cu_seqlens, chunk_offsets, i_t)
    n = tl.minimum(T - i_c * BT, BT)
    o_c = tl.arange(0, BC)
    r0 = bos + i_c * BT + o_c
    r1, r2, r3 = r0 + BC, r0 + 2 * BC, r0 + 3 * BC
    m0, m1, m2, m3 = o_c < n, o_c + BC < n, o_c + 2 * BC < n, o_c + 3 * BC < n
    k0, x0, b0 = _band(k, g, beta, r0, m0, i_h, H, K, BK)
    k1, x1, b1 = _band(k, g, beta, r1, m1, i_h, H, K, BK)
    k2, x2, b2 = _band(k, g, beta, r2, m2, i_h, H, K, BK)
    k3, x3, b3 = _band(k, g, beta, r3, m3, i_h, H, K, BK)
    # the cumulative log-decay per channel, band by band
    G0 = tl.cumsum(x0, 0)
    G1 = tl.cumsum(x1, 0) + row_of(G0, BC - 1)[None, :]
    G2 = tl.cumsum(x2, 0) + row_of(G1, BC - 1)[None, :]
    G3 = tl.cumsum(x3, 0) + row_of(G2, BC - 1)[None, :]
    p0 = ((bos + i_c * BT) * H + i_h) * K  # the chunk's first row of k and g
    A00 = decayed_scores(k0, k0, k + p0, g + p0, H * K, G0, n, K, True, BC, IEEE) * b0[:, None]
    p1 = p0 + BC * H * K
    A11 = decayed_scores(k1, k1, k + p1, g + p1, H * K, G1, n - BC, K, True, BC, IEEE) * b1[:, None]
    p2 = p1 + BC * H * K
    A22 = decayed_scores(k2, k2, k + p2, g + p2, H * K, G2, n - 2 * BC, K, True, BC, IEEE) * b2[:, None]
    p3 = p2 + BC * H * K
    A33 = decayed_scores(k3, k3, k + p3, g + p3, H * K, G3, n - 3 * BC, K, True, BC, IEEE) * b3[:, None]
    A10 = _cross(k1, G1, b1, k0, G0, IEEE)
    A20 = _cross(k2, G2, b2, k0, G0, IEEE)
    A21 = _cross(k2, G2, b2, k1, G1, IEEE)
    A30 = _cross(k3, G3, b3, k0, G0, IEEE)
    A31 = _cross(k3, G3, b3, k1, G1, IEEE)
    A32 = _cross(k3, G3, b3, k2, G2, IEEE)
    store_inverse(tm, A00, A11, A22, A33, A10, A20, A21, A30, A31, A32, r0, r1, r2, r3, m0, m1, m2, m3, i_h, H, BT,
                  IEEE)


@triton.jit
def _prepare_kernel(
    k, v, g, beta, tm, w, u, chunk_indices, cu_seqlens, chunk_offsets,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    IEEE: tl.constexpr,
):
    i_t, i_h = tl.program_id(0), tl.program_id(1)
    bos, T, _, i_c = chunk_at(chunk_indices, cu_seqlens, chunk_offsets, i_t)
    o_r, o_k = tl.arange(0, BT), tl.arange(0, BK)
    n = tl.minimum(T - i_c * BT, BT)  # rows inside the document
    m_t = o_r < n
    rows = bos + i_c * BT + o_r  # (BT,) int64: the chunk's tokens
    m_tk = m_t[:, None] & (o_k < K)[None, :]
    p_k = (rows * H + i_h)[:, None] * K + o_k[None, :]
    b_G = chunk_log_decay(g, p_k, m_tk)
    b_k = tl.load(k + p_k, mask=m_tk, other=0.0)
    b_beta = tl.load(beta + rows * H + i_h, mask=m_t, other=0.0).to(tl.float32)
    b_T = tl.load(tm + (rows * H + i_h)[:, None] * BT + o_r[None, :], mask=m_t[:, None], other=0.0)
    b_kg = b_k.to(tl.float32) * tl.exp(b_G) * b_beta[:, None]  # βγ⊙k
    tl.store(w + p_k, mm(b_T, b_kg, b_k, IEEE).to(w.dtype.element_ty), mask=m_tk)
    for i_v in range(tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_tv = m_t[:, None] & (o_v < V)[None, :]
        p_v = (rows * H + i_h)[:, None] * V + o_v[None, :]
        b_v = tl.load(v + p_v, mask=m_tv, other=0.0)
        tl.store(u + p_v, mm(b_T, b_v.to(tl.float32) * b_beta[:, None], b_k, IEEE).to(u.dtype.element_ty), mask=m_tv)


@triton.jit
def _state_kernel(
    k, g, w, u, hs, v_new, h0, ht, cu_seqlens, chunk_offsets,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    USE_H0: tl.constexpr, STORE_HT: tl.constexpr, IEEE: tl.constexpr,
):
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    bos, T, boh = sequence_at(cu_seqlens, chunk_offsets, i_n)
    o_k, o_v, o_r = tl.arange(0, BK), i_v * BV + tl.arange(0, BV), tl.arange(0, BT)
    m_k, m_v = o_k < K, o_v < V
    p_h, m_h = o_k[:, None] * V + o_v[None, :], m_k[:, None] & m_v[None, :]
    k += (bos * H + i_h) * K
    g += (bos * H + i_h) * K
    w += (bos * H + i_h) * K
    u += (bos * H + i_h) * V
    v_new += (bos * H + i_h) * V
    hs += (boh * H + i_h) * K * V
    b_h = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_H0:
        b_h = tl.load(h0 + i_nh.to(tl.int64) * K * V + p_h, mask=m_h, other=0.0).to(tl.float32)
    for i_t in range(tl.cdiv(T, BT)):
        t0 = i_t * BT
        m_t = o_r < T - t0
        m_tk, m_tv = m_t[:, None] & m_k[None, :], m_t[:, None] & m_v[None, :]
        p_tk, p_tv = (t0 + o_r)[:, None] * (H * K) + o_k[None, :], (t0 + o_r)[:, None] * (H * V) + o_v[None, :]
        tl.store(hs + i_t * (H * K * V) + p_h, b_h.to(hs.dtype.element_ty), mask=m_h)  # the state entering chunk i_t
        b_w = tl.load(w + p_tk, mask=m_tk, other=0.0)
        b_d = tl.load(u + p_tv, mask=m_tv, other=0.0).to(tl.float32) - mm(b_w, b_h, b_w, IEEE)  # Δ = U − W h
        tl.store(v_new + p_tv, b_d.to(v_new.dtype.element_ty), mask=m_tv)
        b_G = chunk_log_decay(g, p_tk, m_tk)
        g_last = row_of(b_G, BT - 1)  # G_C per channel
        b_k = tl.load(k + p_tk, mask=m_tk, other=0.0)
        b_kd = b_k.to(tl.float32) * tl.exp(tl.where(m_tk, g_last[None, :] - b_G, float("-inf")))  # k ⊙ exp(G_C − G)
        b_h = b_h * tl.exp(g_last)[:, None] + mm(tl.trans(b_kd), b_d, b_w, IEEE)
    if STORE_HT:
        tl.store(ht + i_nh.to(tl.int64) * K * V + p_h, b_h, mask=m_h)


@triton.jit
def _output_kernel(
    q, k, g, v_new, hs, o, v_offset, cu_seqlens, chunk_indices, chunk_offsets, scale,
    H: tl.constexpr, G: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
    BV: tl.constexpr, SUB: tl.constexpr, USE_OFFSET: tl.constexpr, IEEE: tl.constexpr,
):
    HQ: tl.constexpr = H * G
    i_v, i_t, i_hq = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_h = i_hq // G  # query heads h·G … h·G + G − 1 read KV head h
    bos, T, boh, i_c = chunk_at(chunk_indices, cu_seqlens, chunk_offsets, i_t)
    o_k, o_v, o_r = tl.arange(0, BK), i_v * BV + tl.arange(0, BV), tl.arange(0, BT)
    n = tl.minimum(T - i_c * BT, BT)
    m_k, m_v, m_t = o_k < K, o_v < V, o_r < n
    rows = bos + i_c * BT + o_r
    m_tk, m_tv = m_t[:, None] & m_k[None, :], m_t[:, None] & m_v[None, :]
    p_k = (rows * H + i_h)[:, None] * K + o_k[None, :]
    b_q = tl.load(q + (rows * HQ + i_hq)[:, None] * K + o_k[None, :], mask=m_tk, other=0.0)
    b_k = tl.load(k + p_k, mask=m_tk, other=0.0)
    b_G = chunk_log_decay(g, p_k, m_tk)
    b_h = tl.load(hs + ((boh + i_c) * H + i_h) * K * V + o_k[:, None] * V + o_v[None, :],
                  mask=m_k[:, None] & m_v[None, :], other=0.0)
    b_d = tl.load(v_new + (rows * H + i_h)[:, None] * V + o_v[None, :], mask=m_tv, other=0.0)
    p0 = ((bos + i_c * BT) * H + i_h) * K
    b_P = decayed_scores(b_q, b_k, k + p0, g + p0, H * K, b_G, n, K, False, SUB, IEEE)
    b_o = mm(b_q.to(tl.float32) * tl.exp(b_G), b_h, b_q, IEEE) + mm(b_P, b_d, b_q, IEEE)
    b_o *= scale
    if USE_OFFSET:
        b_o += tl.load(v_offset + (rows * H + i_h)[:, None] * V + o_v[None, :], mask=m_tv, other=0.0).to(tl.float32)
    tl.store(o + (rows * HQ + i_hq)[:, None] * V + o_v[None, :], b_o.to(o.dtype.element_ty), mask=m_tv)


def kda_bv(K: int, V: int) -> int:
    """V block of every KDA kernel: 64, 32 for 256-wide keys, at most V's next power of two."""
    return min(64 if block_k(K) <= 128 else 32, max(16, next_pow2(V)))


def chunk_warps(K: int) -> int:
    """Warps of the per-chunk KDA kernels, which hold several (64, K) float32 tiles at once: 8 past K = 64
    (the linear attention backward's rule); untuned."""
    return 4 if block_k(K) <= 64 else 8


def kda_stages(K: int, ieee: bool, kernel: str, G: int = 1) -> int:
    """Pipelining stages of the kernels that loop over whole (64, K) or (K, BV) tiles: ``kernel`` "state" (the
    forward state kernel), "state_bwd" (the backward one, ``G`` query heads per KV head) or "wy_bwd". A block
    gets 232,448 B of shared memory on the H200; compiled for sm_90 as the launchers launch them (Triton 3.6,
    ``scripts/kernel_resources.py --launchers``), at Triton's default 3 stages:

    - IEEE fp32 tiles are twice as wide: 2 stages (at K = 128 the state kernel 164,352 B, the backward one
      180,224 at G = 1), 1 for 256-wide keys;
    - 256-wide keys: the forward state kernel needs 372,736 B for 16-bit inputs (237,568 at 2 stages, 69,632 at 1),
      so 1 stage for every dtype; the 16-bit WY backward (114,688 B) keeps 3;
    - at G = 1 the backward state kernel's loop over the query heads folds away and q and do are pipelined with
      k, w and dΔ: 245,760 B for 16-bit K = 128 (155,648 at 2 stages), 286,720 for K = 256 at 2 (81,920 at 1),
      so at most 2 stages at K = 128 and 1 at K = 256 there; K = 64 (139,264 B) keeps 3."""
    wide = block_k(K) > 128
    stages = (1 if wide else 2) if ieee else 3
    if kernel == "state" and wide:
        return 1
    if kernel == "state_bwd" and G == 1 and block_k(K) > 64:
        return min(stages, 1 if wide else 2)
    return stages


def kda_prepare(*, layout: Layout, k, v, g, beta, tm=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Stage 1: ``(T [tokens, H, BT], W like k, U like v)``; T in the dots' dtype (float32 for float32 inputs).
    Inputs flat (``Layout.flat``), g float32. Given ``tm`` (the backward: the forward's T), only W and U are
    computed, from it: the same values as in the forward."""
    L = layout
    if tm is None:
        tm = torch.empty(L.tokens, L.H, BT, dtype=torch.float32 if L.ieee else k.dtype, device=L.device)
        if L.NC:
            _solve_kernel[(L.NC, L.H)](k, g, beta, tm, L.chunk_indices, L.cu_seqlens, L.chunk_offsets, H=L.H, K=L.K,
                                       BT=BT, BK=block_k(L.K), IEEE=L.ieee, num_warps=chunk_warps(L.K) // 2)
    w, u = torch.empty_like(k), torch.empty_like(v)
    if L.NC:
        _prepare_kernel[(L.NC, L.H)](
            k, v, g, beta, tm, w, u, L.chunk_indices, L.cu_seqlens, L.chunk_offsets, H=L.H, K=L.K, V=L.V, BT=BT,
            BK=block_k(L.K), BV=kda_bv(L.K, L.V), IEEE=L.ieee, num_warps=chunk_warps(L.K))
    return tm, w, u


def kda_states(*, layout: Layout, k, g, w, u, h0=None, ht=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Stage 2: ``(hs [NC, H, K, V], Δ like u)``: the state entering every chunk (k's dtype, float32 for float32
    inputs) and ``Δ = U − W h``; fills ``ht`` ``[N, H, K, V]`` (float32) with each sequence's final state when
    given. ``h0``: float32 ``[N, H, K, V]`` or None."""
    L = layout
    hs = torch.empty(max(L.NC, 1), L.H, L.K, L.V, dtype=torch.float32 if L.ieee else k.dtype, device=L.device)
    v_new = torch.empty_like(u)
    BV = kda_bv(L.K, L.V)
    _state_kernel[(cdiv(L.V, BV), L.N * L.H)](
        k, g, w, u, hs, v_new, h0 if h0 is not None else hs, ht if ht is not None else hs, L.cu_seqlens,
        L.chunk_offsets, H=L.H, K=L.K, V=L.V, BT=BT, BK=block_k(L.K), BV=BV, USE_H0=h0 is not None,
        STORE_HT=ht is not None, IEEE=L.ieee, num_warps=4, num_stages=kda_stages(L.K, L.ieee, "state"))
    return hs, v_new


def kda_fwd(*, q, k, v, g, beta, scale: float, initial_state, output_final_state: bool, cu_seqlens,
            v_offset=None) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Host pipeline: ``(o [B, T, G·H, V] in v's dtype, final float32 state [N, H, K, V] or None, T)``, T the
    ``(I + A)⁻¹`` of every chunk (:func:`kda_prepare`; None without tokens), which the backward reuses. Inputs
    as :func:`linearize.ops.gated_delta_rule` with a per-channel ``g [B, T, H, K]`` (checked there);
    ``v_offset`` ``[B, T, H, V]`` or None is added to every query head's output of its KV head."""
    B, T, HQ, K = q.shape
    L = Layout(q, v, cu_seqlens)
    qf, kf, vf, bf = Layout.flat(q, k, v, beta)
    gf = Layout.flat(g)[0].float()
    ht = torch.empty(L.N, L.H, K, L.V, dtype=torch.float32, device=q.device) if output_final_state else None
    h0 = initial_state.to(torch.float32).contiguous() if initial_state is not None else None
    o = torch.empty(L.tokens, HQ, L.V, dtype=v.dtype, device=q.device)
    if L.NC == 0:  # no tokens: the state passes through
        if ht is not None:
            ht.copy_(h0 if h0 is not None else torch.zeros_like(ht))
        return o.view(B, T, HQ, L.V), ht, None
    tm, w, u = kda_prepare(layout=L, k=kf, v=vf, g=gf, beta=bf)
    hs, v_new = kda_states(layout=L, k=kf, g=gf, w=w, u=u, h0=h0, ht=ht)
    BV = kda_bv(K, L.V)
    off = Layout.flat(v_offset)[0] if v_offset is not None else vf
    _output_kernel[(cdiv(L.V, BV), L.NC, HQ)](
        qf, kf, gf, v_new, hs, o, off, L.cu_seqlens, L.chunk_indices, L.chunk_offsets, float(scale), H=L.H, G=L.G,
        K=K, V=L.V, BT=BT, BK=block_k(K), BV=BV, SUB=SUB, USE_OFFSET=v_offset is not None, IEEE=L.ieee,
        num_warps=chunk_warps(K))
    return o.view(B, T, HQ, L.V), ht, tm

"""Triton forward of KDA, the gated delta rule with one decay per key channel (:mod:`linearize.ops.kda`: read
its docstring first), chunk 64, GQA-native and varlen. Five kernels in four stages:

0. ``_scores_kernel``   per (chunk, KV head): ``G`` the in-chunk cumulative log-decay per channel, the in-chunk
   scores with their pairwise decays per channel, ``A = strictly-lower(β_r Σ_i k_ri k_ji exp(G_ri − G_ji))``
   (float32 scratch) and every query head's ``P_rj = Σ_i q_ri k_ji exp(G_ri − G_ji)`` (j ≤ r), in the same
   pass as A (they share the pairwise decays: :func:`kda_tiles.cross_scores_pair`,
   :func:`kda_tiles.sub_chunk_pairs`);
   ``_solve_kernel`` per (chunk, KV head), one warp: ``T = (I + A)⁻¹`` as the GDN solve inverts it
   (:func:`solve.store_inverse`). T and P are kept for the backward.
1. ``_prepare_kernel``  per (chunk, KV head, block of 64 key channels or of value columns): ``W = T (βγ⊙k)``,
   ``U = T (βv)``, for the state kernel ``K̃ = k ⊙ exp(G_C − G)`` and ``G_C``, the chunk's total log-decay per
   channel, and for the output kernel every query head's ``scale·γ⊙q``.
2. ``_state_kernel``    per (V block, sequence × KV head), over the chunks in order — the only sequential part:
   stores the state entering each chunk, ``Δ = U − W h``, then ``h ← Diag(exp(G_C)) h + K̃ᵀ Δ``; it reads
   no log-decays, and its V block narrows when (sequence, head) pairs are few (:func:`kda_state_bv`).
3. ``_output_kernel``   per (chunk, query head), over the V blocks: ``o = (scale·γ⊙q) h + scale·P Δ (+ v_offset)``;
   it reads no log-decays either.

Every exponent is ≤ 0 (``g ≤ 0``): the pairwise decays go through :mod:`kda_tiles`. G is recomputed from g
by the per-chunk kernels (a (64, K) cumsum) rather than stored. The backward (``kda_bwd.py``) reads stages 1
and 2's outputs as the forward kept them (:class:`Kept`), or runs them again on the forward's T. Dots in the
inputs' dtype with float32 accumulation (IEEE fp32 for fp32 inputs).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..common import cdiv, next_pow2
from .kda_tiles import (
    chunk_log_decay,
    chunk_scores,
    decayed_scores,
    row_of,
    sub_chunk_dots_fit,
    sub_chunk_pairs,
)
from .layout import BT, Layout, chunk_at, sequence_at
from .settings import block_k, sms_for
from .solve import store_inverse
from .tiles import exp_ftz, mm

SUB = 16  # rows of a sub-chunk: the pairwise decays are taken inside one (kda_tiles)
# channels of the prepare kernel's key blocks (_prepare_kernel), one program each beside the value blocks' programs
PREPARE_BK = 64
# the pairs inside the sub-chunks as tensor-core dots through anchored offsets (kda_tiles.sub_chunk_dots), in the
# programs whose span allows it, the row-by-row steps elsewhere; off: the steps everywhere. On an H100 the dots
# take 8-9% off the forward and 1-2% off forward+backward (results/bench_kda_sub_chunk_dots_h100.md)
SUB_CHUNK_DOTS = True
# with them, every pair of a chunk as one dot through offsets from the chunk's middle row, in the programs whose
# chunk-wide span allows it (kda_tiles.sub_chunk_dots_fit's mode 2): on an H100, 10-14% off the forward and 6-7%
# off forward+backward against the sub-chunk dots alone (results/bench_kda_chunk_dots_h100.md)
CHUNK_DOTS = True
# fp16 ends at 65504 (e^11.1) and turns subnormal below 6e-5: its factors exp(±E) stay within e^6, which holds
# |q|, |k| up to ~160 (the steps have no such bound); bf16 and fp32 reach e^±88, and e^±30 leaves any q, k and
# the masked products beyond the triangles room
SUB_CHUNK_SPAN = {torch.float16: 6.0, None: 30.0}


@triton.jit
def scores_block_mask(BT: tl.constexpr):
    """(BT, BT): the (BT/4)² blocks of a chunk's scores on and below the diagonal, the ones the scores kernel
    stores of A and P; the rest of a causal score tile is 0, and its readers load them masked by this (other 0)."""
    o_r = tl.arange(0, BT)
    return o_r[:, None] // (BT // 4) >= o_r[None, :] // (BT // 4)


@triton.jit
def _scores_kernel(
    q, k, g, beta, am, pm, chunk_indices, cu_seqlens, chunk_offsets,
    H: tl.constexpr, G: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, SUB: tl.constexpr,
    STORE_P: tl.constexpr, IEEE: tl.constexpr, DIAG: tl.constexpr, WHOLE: tl.constexpr,
):
    """Per (chunk, KV head): ``A = strictly-lower(β_r Σ_i k_ri k_ji exp(G_ri − G_ji))`` (float32, to ``am``) and,
    with ``STORE_P``, every query head's ``P_rj = Σ_i q_ri k_ji exp(G_ri − G_ji)`` (j ≤ r; to ``pm``, in the
    dtype the output kernel's product takes it in). Every query head's P shares A's pairwise decays: those
    between sub-chunks per head (:func:`kda_tiles.cross_scores_pair`), those inside a sub-chunk once for the
    whole GQA group (:func:`kda_tiles.sub_chunk_pairs`), or, where ``DIAG`` allows, as dots per head
    (:func:`kda_tiles.sub_chunk_dots`); with ``WHOLE``, where the chunk's span allows, every pair as one dot per
    head (:func:`kda_tiles.chunk_scores`)."""
    HQ: tl.constexpr = H * G
    i_t, i_h = tl.program_id(0), tl.program_id(1)
    bos, T, _, i_c = chunk_at(chunk_indices, cu_seqlens, chunk_offsets, i_t)
    n = tl.minimum(T - i_c * BT, BT)
    o_r, o_k = tl.arange(0, BT), tl.arange(0, BK)
    m_t = o_r < n
    rows = bos + i_c * BT + o_r
    m_tk, m_tt = m_t[:, None] & (o_k < K)[None, :], m_t[:, None] & (o_r < BT)[None, :]
    p_k = (rows * H + i_h)[:, None] * K + o_k[None, :]
    b_k = tl.load(k + p_k, mask=m_tk, other=0.0)
    b_G = chunk_log_decay(g, p_k, m_tk)
    b_beta = tl.load(beta + rows * H + i_h, mask=m_t, other=0.0).to(tl.float32)
    p0 = ((bos + i_c * BT) * H + i_h) * K  # the chunk's first row of k and g
    p_a = (rows * H + i_h)[:, None] * BT + o_r[None, :]
    # the (BT/4)² blocks on and below the diagonal: A's that the solve reads (:func:`_a_block`) and P's that the
    # output kernel and the backward read (the others, 0, are not stored: :func:`scores_block_mask`)
    m_a = m_tt & scores_block_mask(BT)
    if STORE_P:
        p_q = (rows * HQ + i_h * G)[:, None] * K + o_k[None, :]
        p_p = (rows * HQ + i_h * G)[:, None] * BT + o_r[None, :]
        b_q = tl.load(q + p_q, mask=m_tk, other=0.0)
        # A with the first query head; in mode 0 stored but for the sub-chunks' strictly lower triangles, which
        # sub_chunk_pairs stores after, rows by half sub-chunks (kda_tiles.chunk_scores)
        b_E, mode = sub_chunk_dots_fit(b_G, SUB, DIAG, WHOLE)  # mode 2: every pair as one dot
        m_x = m_tt & ((o_r[:, None] // SUB != o_r[None, :] // SUB) | (o_r[:, None] <= o_r[None, :])
                      | (tl.zeros([BT, BT], dtype=tl.int32) + mode != 0))  # a tile: the interpreter's scalar | is int
        b_A, b_P = chunk_scores(b_q, b_k, b_G, b_E, mode, n, SUB, True, IEEE, WHOLE)
        tl.store(am + p_a, b_A * b_beta[:, None], mask=m_x & m_a)
        tl.store(pm + p_p, b_P.to(pm.dtype.element_ty), mask=m_x & m_a)
        for i_g in range(1, G):  # the other query heads of a GQA group
            b_q = tl.load(q + p_q + i_g * K, mask=m_tk, other=0.0)
            b_none, b_P = chunk_scores(b_q, b_k, b_G, b_E, mode, n, SUB, False, IEEE, WHOLE)  # M_bb: 0
            tl.store(pm + p_p + i_g * BT, b_P.to(pm.dtype.element_ty), mask=m_x & m_a)
        if mode == 0:
            HS: tl.constexpr = SUB // 2
            o_h = tl.arange(0, BT // 2)
            c_lo = (o_h // HS) * SUB + o_h % HS  # the first half of every sub-chunk: keys up to HS − 1 back
            c_hi = c_lo + HS  # the second half: keys up to SUB − 1 back
            r0 = bos + i_c * BT
            pa = q + (r0 * HQ + i_h * G) * K
            pma, pmb = pm + (r0 * HQ + i_h * G) * BT, am + (r0 * H + i_h) * BT
            w_lo = tl.load(beta + (r0 + c_lo) * H + i_h, mask=c_lo < n, other=0.0).to(tl.float32)
            sub_chunk_pairs(pa, k + p0, g + p0, HQ * K, H * K, c_lo, n, w_lo, pma, HQ * BT, pmb, H * BT, K, BK, SUB, HS,
                            G, BT)
            w_hi = tl.load(beta + (r0 + c_hi) * H + i_h, mask=c_hi < n, other=0.0).to(tl.float32)
            sub_chunk_pairs(pa, k + p0, g + p0, HQ * K, H * K, c_hi, n, w_hi, pma, HQ * BT, pmb, H * BT, K, BK, SUB,
                            SUB, G, BT)
    else:
        b_A = decayed_scores(b_k, b_k, k + p0, g + p0, H * K, b_G, n, K, True, SUB, IEEE)
        tl.store(am + p_a, b_A * b_beta[:, None], mask=m_a)


@triton.jit
def _a_block(am, rows, m, c0: tl.constexpr, i_h, H: tl.constexpr, BT: tl.constexpr):
    """The (BT/4)² block of ``am`` at rows ``rows`` (token indices, ``m`` inside the document) and columns
    ``c0 …``, float32, 0 past the document's end."""
    o_c = tl.arange(0, BT // 4)
    return tl.load(am + (rows * H + i_h)[:, None] * BT + c0 + o_c[None, :], mask=m[:, None], other=0.0)


@triton.jit
def _solve_kernel(
    am, tm, chunk_indices, cu_seqlens, chunk_offsets,
    H: tl.constexpr, BT: tl.constexpr, IEEE: tl.constexpr,
):
    """Per (chunk, KV head): ``T = (I + A)⁻¹`` of the ``A`` that stage 0 stored, read as the GDN
    solve holds it, ten (BT/4)² blocks, and inverted by its :func:`solve.store_inverse`."""
    BC: tl.constexpr = BT // 4
    i_t, i_h = tl.program_id(0), tl.program_id(1)
    bos, T, _, i_c = chunk_at(chunk_indices, cu_seqlens, chunk_offsets, i_t)
    n = tl.minimum(T - i_c * BT, BT)
    o_c = tl.arange(0, BC)
    r0 = bos + i_c * BT + o_c
    r1, r2, r3 = r0 + BC, r0 + 2 * BC, r0 + 3 * BC
    m0, m1, m2, m3 = o_c < n, o_c + BC < n, o_c + 2 * BC < n, o_c + 3 * BC < n
    A00 = _a_block(am, r0, m0, 0, i_h, H, BT)
    A10, A11 = _a_block(am, r1, m1, 0, i_h, H, BT), _a_block(am, r1, m1, BC, i_h, H, BT)
    A20, A21 = _a_block(am, r2, m2, 0, i_h, H, BT), _a_block(am, r2, m2, BC, i_h, H, BT)
    A22 = _a_block(am, r2, m2, 2 * BC, i_h, H, BT)
    A30, A31 = _a_block(am, r3, m3, 0, i_h, H, BT), _a_block(am, r3, m3, BC, i_h, H, BT)
    A32, A33 = _a_block(am, r3, m3, 2 * BC, i_h, H, BT), _a_block(am, r3, m3, 3 * BC, i_h, H, BT)
    store_inverse(tm, A00, A11, A22, A33, A10, A20, A21, A30, A31, A32, r0, r1, r2, r3, m0, m1, m2, m3, i_h, H, BT,
                  IEEE)


@triton.jit
def _prepare_kernel(
    k, v, g, beta, tm, w, u, kd, gc, q, qg, kg, scale, chunk_indices, cu_seqlens, chunk_offsets,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    IEEE: tl.constexpr, G: tl.constexpr = 1, QG: tl.constexpr = False, KG: tl.constexpr = False,
):
    """Per (chunk, KV head, block): the chunk's ``NK`` key blocks (BK channels each: K̃, G_C, γ⊙k, W and
    scale·γ⊙q of those channels) and ``NV`` value blocks (U of BV columns), one block a program, the blocks of a
    chunk adjacent (axis 0: chunk·(NK + NV) + block) so that their programs read the chunk's T from L2. Every
    channel's cumulative decay and every column of ``T ·`` is independent of the others: a block holds (BT, BK)
    tiles where one program per chunk held (BT, K) ones (sm_90, bf16, K = 128: 128-149 registers, none spilled,
    against 255 and a spill; ``scripts/kernel_resources.py --launchers``)."""
    NK: tl.constexpr = (K + BK - 1) // BK
    NV: tl.constexpr = (V + BV - 1) // BV
    i_s, i_h = tl.program_id(0), tl.program_id(1)
    i_t, i_b = i_s // (NK + NV), i_s % (NK + NV)
    bos, T, boh, i_c = chunk_at(chunk_indices, cu_seqlens, chunk_offsets, i_t)
    o_r = tl.arange(0, BT)
    n = tl.minimum(T - i_c * BT, BT)  # rows inside the document
    m_t = o_r < n
    rows = bos + i_c * BT + o_r  # (BT,) int64: the chunk's tokens
    b_beta = tl.load(beta + rows * H + i_h, mask=m_t, other=0.0).to(tl.float32)
    b_T = tl.load(tm + (rows * H + i_h)[:, None] * BT + o_r[None, :], mask=m_t[:, None], other=0.0)
    if i_b < NK:  # channels i_b·BK …
        o_k = i_b * BK + tl.arange(0, BK)
        m_tk = m_t[:, None] & (o_k < K)[None, :]
        p_k = (rows * H + i_h)[:, None] * K + o_k[None, :]
        b_G = chunk_log_decay(g, p_k, m_tk)
        b_k = tl.load(k + p_k, mask=m_tk, other=0.0)
        # for the state kernel, off its sequential path: K̃ = k ⊙ exp(G_C − G) in k's dtype (the dtype its product
        # takes it in) and the chunk's total log-decay G_C per channel
        g_last = row_of(b_G, BT - 1)
        b_kd = b_k.to(tl.float32) * exp_ftz(tl.where(m_tk, g_last[None, :] - b_G, float("-inf")))
        tl.store(kd + p_k, b_kd.to(kd.dtype.element_ty), mask=m_tk)
        tl.store(gc + ((boh + i_c) * H + i_h) * K + o_k, g_last, mask=o_k < K)
        b_gamma = exp_ftz(b_G)
        b_kg = b_k.to(tl.float32) * b_gamma  # γ⊙k
        if KG:  # for the backward's WY kernel, in k's dtype (its products take it in that)
            tl.store(kg + p_k, b_kg.to(kg.dtype.element_ty), mask=m_tk)
        tl.store(w + p_k, mm(b_T, b_kg * b_beta[:, None], b_k, IEEE).to(w.dtype.element_ty), mask=m_tk)  # T (βγ⊙k)
        if QG:  # scale·γ⊙q of each query head, in q's dtype: for the output kernel and the backward's state
            # kernel, so that neither takes a log-decay
            b_gs = b_gamma * scale
            for i_g in range(G):
                p_q = (rows * (H * G) + i_h * G + i_g)[:, None] * K + o_k[None, :]
                b_q = tl.load(q + p_q, mask=m_tk, other=0.0)
                tl.store(qg + p_q, (b_q.to(tl.float32) * b_gs).to(qg.dtype.element_ty), mask=m_tk)
    else:  # columns (i_b − NK)·BV … of U = T (βv)
        o_v = (i_b - NK) * BV + tl.arange(0, BV)
        m_tv = m_t[:, None] & (o_v < V)[None, :]
        p_v = (rows * H + i_h)[:, None] * V + o_v[None, :]
        b_v = tl.load(v + p_v, mask=m_tv, other=0.0)
        tl.store(u + p_v, mm(b_T, b_v.to(tl.float32) * b_beta[:, None], b_v, IEEE).to(u.dtype.element_ty), mask=m_tv)


@triton.jit
def _state_kernel(
    kd, gc, w, u, hs, v_new, h0, ht, cu_seqlens, chunk_offsets,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    USE_H0: tl.constexpr, STORE_HT: tl.constexpr, IEEE: tl.constexpr,
):
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    bos, T, boh = sequence_at(cu_seqlens, chunk_offsets, i_n)
    o_k, o_v, o_r = tl.arange(0, BK), i_v * BV + tl.arange(0, BV), tl.arange(0, BT)
    m_k, m_v = o_k < K, o_v < V
    p_h, m_h = o_k[:, None] * V + o_v[None, :], m_k[:, None] & m_v[None, :]
    kd += (bos * H + i_h) * K
    w += (bos * H + i_h) * K
    u += (bos * H + i_h) * V
    v_new += (bos * H + i_h) * V
    gc += (boh * H + i_h) * K
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
        g_last = tl.load(gc + i_t * (H * K) + o_k, mask=m_k, other=0.0)  # G_C per channel
        b_kd = tl.load(kd + p_tk, mask=m_tk, other=0.0)  # k ⊙ exp(G_C − G), from the prepare kernel
        b_h = b_h * exp_ftz(g_last)[:, None] + mm(tl.trans(b_kd), b_d, b_w, IEEE)
    if STORE_HT:
        tl.store(ht + i_nh.to(tl.int64) * K * V + p_h, b_h, mask=m_h)


@triton.jit
def _output_kernel(
    qg, v_new, hs, pm, o, v_offset, cu_seqlens, chunk_indices, chunk_offsets, scale,
    H: tl.constexpr, G: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
    BV: tl.constexpr, USE_OFFSET: tl.constexpr, IEEE: tl.constexpr,
):
    """Per (chunk, query head), over the V blocks, with the scores ``P`` stage 0 stored and the prepare kernel's
    ``scale·γ⊙q`` (``qg``): no log-decay."""
    HQ: tl.constexpr = H * G
    i_t, i_hq = tl.program_id(0), tl.program_id(1)
    i_h = i_hq // G  # query heads h·G … h·G + G − 1 read KV head h
    bos, T, boh, i_c = chunk_at(chunk_indices, cu_seqlens, chunk_offsets, i_t)
    o_k, o_r = tl.arange(0, BK), tl.arange(0, BT)
    n = tl.minimum(T - i_c * BT, BT)
    m_k, m_t = o_k < K, o_r < n
    rows = bos + i_c * BT + o_r
    m_tk = m_t[:, None] & m_k[None, :]
    b_qg = tl.load(qg + (rows * HQ + i_hq)[:, None] * K + o_k[None, :], mask=m_tk, other=0.0)
    b_P = tl.load(pm + (rows * HQ + i_hq)[:, None] * BT + o_r[None, :], mask=m_t[:, None] & scores_block_mask(BT),
                  other=0.0)
    p_s = ((boh + i_c) * H + i_h) * K * V
    for i_v in range(tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = o_v < V
        m_tv = m_t[:, None] & m_v[None, :]
        b_h = tl.load(hs + p_s + o_k[:, None] * V + o_v[None, :], mask=m_k[:, None] & m_v[None, :], other=0.0)
        b_d = tl.load(v_new + (rows * H + i_h)[:, None] * V + o_v[None, :], mask=m_tv, other=0.0)
        b_o = mm(b_qg, b_h, b_qg, IEEE) + mm(b_P, b_d, b_qg, IEEE) * scale
        if USE_OFFSET:
            b_o += tl.load(v_offset + (rows * H + i_h)[:, None] * V + o_v[None, :], mask=m_tv,
                           other=0.0).to(tl.float32)
        tl.store(o + (rows * HQ + i_hq)[:, None] * V + o_v[None, :], b_o.to(o.dtype.element_ty), mask=m_tv)


def dot_modes(dtype: torch.dtype) -> dict:
    """The kernels' ``DIAG`` and ``WHOLE``: the largest anchored span (:func:`kda_tiles.anchored_offsets`) at which
    a program takes the pairs inside its sub-chunks as dots, 0 with :data:`SUB_CHUNK_DOTS` off
    (:data:`SUB_CHUNK_SPAN`), and whether it may take the whole chunk's pairs as one dot (:data:`CHUNK_DOTS`)."""
    limit = SUB_CHUNK_SPAN.get(dtype, SUB_CHUNK_SPAN[None]) if SUB_CHUNK_DOTS else 0.0
    return {"DIAG": limit, "WHOLE": bool(CHUNK_DOTS and limit > 0)}


def kda_bv(K: int, V: int) -> int:
    """V block of every KDA kernel: 64, 32 for 256-wide keys, at most V's next power of two."""
    return min(64 if block_k(K) <= 128 else 32, max(16, next_pow2(V)))


def chunk_warps(K: int) -> int:
    """Warps of the per-chunk KDA kernels, which hold several (64, K) float32 tiles at once: 8 past K = 64
    (the linear attention backward's rule); untuned."""
    return 4 if block_k(K) <= 64 else 8


def replayed(K: int, ieee: bool) -> bool:
    """Whether launches of this key width and precision take the settings that replays at other settings
    found faster (``scripts/tune_launches.py``, H100, bf16, 16 heads of 128; ``results/tune_launches_kda_*_h100.json``):
    16-bit tiles, keys up to 128 wide. Wider heads and float32 tiles keep the settings they had."""
    return block_k(K) <= 128 and not ieee


def replay_warps(K: int, ieee: bool) -> int:
    """Warps of the backward's ``_dqk_kernel``: 4 where :func:`replayed` — at 2×8192 1.09× faster than 8 (the
    backward's ``_intra_bwd_kernel`` 1.18× at 4 warps and 2 stages; the prepare kernel, when it took a whole
    chunk's keys, 1.41×) — else :func:`chunk_warps`."""
    return 4 if replayed(K, ieee) else chunk_warps(K)


def scores_launch(K: int, ieee: bool, G: int) -> dict:
    """``num_warps``/``num_stages`` of the scores kernel: (4, 2) where :func:`replayed` with one query head per
    KV head — 1.25× faster than (8, 3) in the replays at 2×8192 (H100, bf16, K = 128,
    ``results/tune_launches_kda_2x8192_16warps_h100.json``); else :func:`chunk_warps` (8 under GQA: at K = 64,
    272 B spilled at 4) and Triton's default 3 stages."""
    if G == 1 and replayed(K, ieee):
        return {"num_warps": 4, "num_stages": 2}
    return {"num_warps": chunk_warps(K) if G == 1 else 8, "num_stages": 3}


def state_launch(layout: Layout, bv: int) -> tuple[int, int]:
    """``(num_warps, num_stages)`` of the forward state kernel: where its (sequence, KV head, V block)
    programs are no more than the SMs (a long sequence, a small batch: one program an SM whatever its
    size), 8 warps and 3 stages — 1.23× faster than (4, 2) in the replays at 2×8192 (H100, bf16, K = 128);
    else (4, 2), two programs sharing an SM (best of the replays at 8×2048, where 256 programs run). Wider
    or float32 tiles keep (4, 2) (:func:`kda_stages`: shared memory)."""
    L = layout
    sms = sms_for(L.N * L.H, L.device)
    if sms is not None and replayed(L.K, L.ieee) and L.N * L.H * cdiv(L.V, bv) <= sms:
        return 8, 3
    return 4, kda_stages(L.K, L.ieee, "state")


def kda_stages(K: int, ieee: bool, kernel: str, G: int = 1) -> int:
    """Pipelining stages of the kernels that loop over whole (64, K) or (K, BV) tiles: ``kernel`` "state" (the
    forward state kernel), "state_bwd" (the backward one, ``G`` query heads per KV head) or "wy_bwd". A block
    gets 232,448 B of shared memory on the H200; compiled for sm_90 as the launchers launch them (Triton 3.6,
    ``scripts/kernel_resources.py --launchers``), at Triton's default 3 stages:

    - the forward state kernel reads W, K̃ and U per chunk (no log-decays: :func:`kda_prepare` makes K̃ and
      G_C), and takes 2 stages at every K and dtype: 16-bit K = 128, BV = 64 asks for 98,304 B there (139,264
      at 3), so two programs share an SM, and their two chains hide each other's latency; K = 256 155,648 B
      (16-bit, BV = 32), 172,032 (fp32);
    - IEEE fp32 tiles are twice as wide: 2 stages (the backward state kernel 180,224 B at K = 128, G = 1), 1 for
      256-wide keys;
    - 256-wide keys: the 16-bit WY backward (114,688 B) keeps 3;
    - at G = 1 the backward state kernel's loop over the query heads folds away and q and do are pipelined with
      k, w and dΔ: 196,608 B for 16-bit K = 128 at 3 stages (139,264 at 2; 3 replayed 1.05× faster at 2×8192 on
      an H100, ``results/tune_launches_kda_2x8192_16warps_h100.json``), 327,680 for K = 256 at 3 and 225,280 at
      2 (53,248 at 1), so 1 stage at K = 256 there (2 fit, untimed)."""
    wide = block_k(K) > 128
    stages = (1 if wide else 2) if ieee else 3
    if kernel == "state":
        return 2
    if kernel == "state_bwd" and G == 1 and wide:
        return 1
    return stages


def kda_solve(*, layout: Layout, k, g, beta, q=None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Stage 0: ``(T [tokens, H, BT], P [tokens, HQ, BT] or None)``: T in the dots' dtype (float32 for float32
    inputs), and, given ``q``, every query head's in-chunk scores P in q's dtype (float32 for float32 inputs),
    the dtype the output kernel's product takes them in. Inputs flat (``Layout.flat``), g float32."""
    L = layout
    dt = torch.float32 if L.ieee else k.dtype
    tm = torch.empty(L.tokens, L.H, BT, dtype=dt, device=L.device)
    pm = torch.empty(L.tokens, L.HQ, BT, dtype=dt, device=L.device) if q is not None else None
    if L.NC:
        am = torch.empty(L.tokens, L.H, BT, dtype=torch.float32, device=L.device)
        _scores_kernel[(L.NC, L.H)](
            q if q is not None else k, k, g, beta, am, pm if pm is not None else am, L.chunk_indices, L.cu_seqlens,
            L.chunk_offsets, H=L.H, G=L.G, K=L.K, BT=BT, BK=block_k(L.K), SUB=SUB, STORE_P=q is not None,
            IEEE=L.ieee, **dot_modes(k.dtype), **scores_launch(L.K, L.ieee, L.G))
        _solve_kernel[(L.NC, L.H)](am, tm, L.chunk_indices, L.cu_seqlens, L.chunk_offsets, H=L.H, BT=BT, IEEE=L.ieee,
                                   num_warps=1, num_stages=1)
    return tm, pm


def kda_prepare(*, layout: Layout, k, v, g, beta, tm=None, q=None, scale: float = 1.0,
                kg: bool = False) -> tuple[torch.Tensor, ...]:
    """Stage 1: ``(T, W like k, U like v, K̃ like k, G_C [NC, H, K] float32, scale·γ⊙q, γ⊙k)``: T from
    :func:`kda_solve` unless given (the backward: the forward's T), ``K̃ = k ⊙ exp(G_C − G)`` and ``G_C`` (each
    chunk's total log-decay per channel) for the state kernel. Inputs flat (``Layout.flat``), g float32; W and U
    are the same values as in the forward. Last ``scale·γ⊙q`` like q where ``q`` is given (else None), what the
    output kernel multiplies the states by and the backward's state kernel ``do``, so that neither takes a
    log-decay, and with ``kg`` ``γ⊙k`` like k (else None), what the backward's WY kernel takes in place of k and
    the log-decays."""
    L = layout
    if tm is None:
        tm, _ = kda_solve(layout=L, k=k, g=g, beta=beta)
    w, u, kd = torch.empty_like(k), torch.empty_like(v), torch.empty_like(k)
    gc = torch.empty(max(L.NC, 1), L.H, L.K, dtype=torch.float32, device=L.device)
    qg = torch.empty_like(q) if q is not None else None
    kg = torch.empty_like(k) if kg else None
    if L.NC:
        bk, bv = min(PREPARE_BK, block_k(L.K)), kda_bv(L.K, L.V)
        _prepare_kernel[(L.NC * (cdiv(L.K, bk) + cdiv(L.V, bv)), L.H)](
            k, v, g, beta, tm, w, u, kd, gc, q if q is not None else k, qg if q is not None else k,
            kg if kg is not None else k, float(scale),
            L.chunk_indices, L.cu_seqlens, L.chunk_offsets, H=L.H, K=L.K, V=L.V, BT=BT, BK=bk, BV=bv, IEEE=L.ieee,
            G=L.G if q is not None else 1, QG=q is not None, KG=kg is not None, num_warps=4)
    return tm, w, u, kd, gc, qg, kg


def kda_state_bv(layout: Layout) -> int:
    """V block of the state kernel: :func:`kda_bv`, halved (down to 16) while the (sequence, KV head) pairs
    times V blocks would not reach half of the GPU's SMs (``settings.state_bv``'s rule; off CUDA not halved):
    at long T with a small batch the sequential loop is the whole cost."""
    L = layout
    bv = kda_bv(L.K, L.V)
    sms = sms_for(L.N * L.H, L.device)
    if sms is not None:
        while bv > 16 and L.N * L.H * cdiv(L.V, bv) < sms // 2:
            bv //= 2
    return bv


def kda_states(*, layout: Layout, kd, gc, w, u, h0=None, ht=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Stage 2: ``(hs [NC, H, K, V], Δ like u)``: the state entering every chunk (k's dtype, float32 for float32
    inputs) and ``Δ = U − W h``; fills ``ht`` ``[N, H, K, V]`` (float32) with each sequence's final state when
    given. ``kd``, ``gc``: :func:`kda_prepare`'s K̃ and G_C; ``h0``: float32 ``[N, H, K, V]`` or None."""
    L = layout
    hs = torch.empty(max(L.NC, 1), L.H, L.K, L.V, dtype=torch.float32 if L.ieee else kd.dtype, device=L.device)
    v_new = torch.empty_like(u)
    BV = kda_state_bv(L)
    warps, stages = state_launch(L, BV)
    _state_kernel[(cdiv(L.V, BV), L.N * L.H)](
        kd, gc, w, u, hs, v_new, h0 if h0 is not None else hs, ht if ht is not None else hs, L.cu_seqlens,
        L.chunk_offsets, H=L.H, K=L.K, V=L.V, BT=BT, BK=block_k(L.K), BV=BV, USE_H0=h0 is not None,
        STORE_HT=ht is not None, IEEE=L.ieee, num_warps=warps, num_stages=stages)
    return hs, v_new


def kda_fwd(*, q, k, v, g, beta, scale: float, initial_state, output_final_state: bool, cu_seqlens,
            v_offset=None, return_scores: bool = False, keep: bool = False) -> tuple:
    """Host pipeline: ``(o [B, T, G·H, V] in v's dtype, final float32 state [N, H, K, V] or None, T)``, T the
    ``(I + A)⁻¹`` of every chunk (:func:`kda_solve`; None without tokens), which the backward reuses; with
    ``return_scores`` also P, every query head's in-chunk scores (:func:`kda_solve`; None without tokens),
    which the backward reuses too; with ``keep`` last :class:`Kept`, what the backward would otherwise
    compute again (None without tokens). Inputs as :func:`linearize.ops.gated_delta_rule` with a per-channel
    ``g [B, T, H, K]`` (checked there); ``v_offset`` ``[B, T, H, V]`` or None is added to every query head's
    output of its KV head."""
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
        return (o.view(B, T, HQ, L.V), ht, None) + ((None,) if return_scores else ()) + ((None,) if keep else ())
    tm, pm = kda_solve(layout=L, k=kf, g=gf, beta=bf, q=qf)
    # kept for the backward, with γ⊙k, which the prepare kernel then writes too
    _, w, u, kd, gc, qg, kg = kda_prepare(layout=L, k=kf, v=vf, g=gf, beta=bf, tm=tm, q=qf, scale=scale, kg=keep)
    hs, v_new = kda_states(layout=L, kd=kd, gc=gc, w=w, u=u, h0=h0, ht=ht)
    kept = Kept(w, kd, gc, qg, kg, hs, v_new) if keep else None
    del w, u, kd, gc, kg
    BV = kda_bv(K, L.V)
    off = Layout.flat(v_offset)[0] if v_offset is not None else vf
    _output_kernel[(L.NC, HQ)](
        qg, v_new, hs, pm, o, off, L.cu_seqlens, L.chunk_indices, L.chunk_offsets, float(scale), H=L.H, G=L.G,
        K=K, V=L.V, BT=BT, BK=block_k(K), BV=BV, USE_OFFSET=v_offset is not None, IEEE=L.ieee,
        num_warps=chunk_warps(K))
    return (o.view(B, T, HQ, L.V), ht, tm) + ((pm,) if return_scores else ()) + ((kept,) if keep else ())


class Kept(NamedTuple):
    """What :func:`kda_fwd` computed that the backward reads: :func:`kda_prepare`'s W, K̃, G_C, scale·γ⊙q and γ⊙k,
    and :func:`kda_states`' states entering every chunk and Δ. Kept, the backward runs neither again: at 2×8192,
    16 heads of 128, bf16, ~470 MB held from the forward to the backward, where the backward's prepare and state
    kernels took 0.29 and 0.24 ms of the 6.2 ms of launches on an H100 (``results/tune_launches_kda_2x8192_h100.json``)."""

    w: torch.Tensor
    kd: torch.Tensor
    gc: torch.Tensor
    qg: torch.Tensor
    kg: torch.Tensor
    hs: torch.Tensor
    v_new: torch.Tensor

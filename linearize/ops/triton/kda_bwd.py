"""Triton backward of KDA (:mod:`linearize.ops.kda`) and its ``autograd.Function``.

Per chunk, with ``q̃ = scale·q``, ``G`` the in-chunk cumulative log-decay per channel, ``γ = exp(G)``,
``D_rj = exp(G_r − G_j)`` per channel (j ≤ r), ``h₀``/``h₁`` the states entering/leaving the chunk:

    A = strictly-lower(β_r Σ_i k_ri k_ji D_rj,i),  T = (I + A)⁻¹,  W = T (βγ⊙k),  U = T (βv),  Δ = U − W h₀
    o_r = (γ_r⊙q̃_r)ᵀ h₀ + Σ_{j≤r} P_rj Δ_j,  P_rj = Σ_i q̃_ri k_ji D_rj,i
    h₁ = Diag(γ_C) h₀ + K̃ᵀ Δ,  K̃_j = k_j ⊙ exp(G_C − G_j)

Backward (the GDN derivation of ``linearize/ops/chunk_bwd.py`` with the decays per channel): in reverse
over the chunks ``dΔ = Σ_g Pᵀ do + K̃ dh₁`` and ``dh₀ = Diag(γ_C) dh₁ + Σ_g (γ⊙q̃)ᵀ do − Wᵀ dΔ``; then per
chunk, with ``dP_rj = do_r·Δ_j``, ``dW = −dΔ h₀ᵀ``, ``dT = dΔ (βv)ᵀ + dW (βγ⊙k)ᵀ`` and
``dA = −Tᵀ dT Tᵀ`` (strictly lower):

    dq̃ = γ⊙(do h₀ᵀ) + Σ_j dP_rj k_j⊙D_rj,   dv = β ⊙ Tᵀ dΔ,   dK̃ = Δ dh₁ᵀ
    dk = Σ_r dP_rj q̃_r⊙D_rj + dK̃⊙exp(G_C − G) + βγ⊙TᵀdW + β X + Y
    X_r = Σ_j dA_rj k_j⊙D_rj,   Y_j = Σ_r β_r dA_rj k_r⊙D_rj
    dβ = (TᵀdΔ)·v + (TᵀdW)·(γ⊙k) + k·X

The decay: G enters through q̃⊙e^G, k⊙e^G (the rows of P, A, W) and k⊙e^−G (their columns), and
through ``γ_C``, so the gradient of ``G_r`` is ``q̃⊙dq̃ + βγk⊙TᵀdW + βk⊙X − k⊙dk_P − k⊙Y`` with the scores' diagonal
(``D_rr = 1``, no decay) left out of ``dq̃`` and ``dk_P`` — it cancels between them exactly, and summed it
would cost precision under strong decays; ``dg`` is its reverse cumulative sum in the chunk. The state's
terms are added already summed, grouped so that none cancels another:
``dg_t += γ_C⊙Σ_v(dh₁⊙h₀) + Σ_{j<t} k_j⊙dK̃_j⊙exp(G_C − G_j)``.

Kernels, after stages 1 and 2 of the forward again (``kda_fwd.py``: W and U from the forward's T, the
states and Δ; the prepare kernel also writes ``γ⊙q̃`` of every query head and ``γ⊙k``, and K̃ and G_C are
kept, or all of them taken from the forward: ``kda_fwd.Kept``): ``_dv_local_kernel`` per (V block, chunk, KV
head) ``Σ_g Pᵀ do`` (P the forward's, kept with T); ``_state_bwd_kernel`` per (V block, sequence × KV head), in
reverse, ``dh₁`` of every chunk, ``dΔ`` and ``dh₀``, from those (no log-decay on its sequential path); then the
dense parts per (chunk, KV head), which take no log-decay at all: ``_dqk_kernel`` dP and the initial state's
``scale·do h₀ᵀ``, ``_wy_bwd_kernel`` dv, dA, the dense share of dβ and the products through W and K̃
(``TᵀdW``, ``dK̃``, ``Σ_v dh₁⊙h₀``); last ``_intra_bwd_kernel`` per (slice of 32 channels, chunk, KV head),
every log-decay of the backward — the pairwise ``D`` (each taken once, for dP's and dA's left and right
products), γ, ``exp(G_C − G)`` and ``γ_C`` — which finishes dq, dk, dg and its slice's share of dβ. Every
elementwise term of a decay thus runs on (64, 32) tiles, not in the dense kernels' (64, K) ones, where they
spilled registers. The per-head kernels loop over the G query heads of their KV head, so nothing is summed
with atomics and K/V are never repeated; dβ's shares (the dense one and one per channel slice) are summed
after.
"""

from __future__ import annotations

import warnings
from functools import cache

import torch
import triton
import triton.language as tl

from ..common import TRITON_DTYPES, cdiv, wants_grad
from .kda_fwd import (
    SUB,
    chunk_warps,
    dot_modes,
    kda_bv,
    kda_fwd,
    kda_prepare,
    kda_stages,
    kda_state_bv,
    kda_states,
    replay_warps,
    replayed,
    scores_block_mask,
)
from .kda_tiles import FLOOR, chunk_log_decay, decayed_pairs, decayed_scores, sub_chunk_dots_fit
from .layout import BT, Layout, chunk_at, sequence_at
from .ptxas import PTXAS_FIXED, newer_ptxas_advice, ptxas_version
from .settings import block_k
from .tiles import exp_ftz, mm


@triton.jit
def _dv_local_kernel(
    q, k, g, pm, do, dd, cu_seqlens, chunk_indices, chunk_offsets, scale,
    H: tl.constexpr, G: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
    BV: tl.constexpr, SUB: tl.constexpr, HAS_P: tl.constexpr, IEEE: tl.constexpr,
):
    """``dd = Σ_g P_gᵀ do_g`` (in the dots' dtype) of one chunk, KV head and V block: the in-chunk part of ``dΔ``. With
    ``HAS_P`` the scores are the forward's (``pm``, :func:`kda_fwd.kda_solve`), else computed again."""
    HQ: tl.constexpr = H * G
    i_v, i_t, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    bos, T, _, i_c = chunk_at(chunk_indices, cu_seqlens, chunk_offsets, i_t)
    n = tl.minimum(T - i_c * BT, BT)
    o_k, o_v, o_r = tl.arange(0, BK), i_v * BV + tl.arange(0, BV), tl.arange(0, BT)
    m_t = o_r < n
    rows = bos + i_c * BT + o_r
    m_tk, m_tv = m_t[:, None] & (o_k < K)[None, :], m_t[:, None] & (o_v < V)[None, :]
    p_k = (rows * H + i_h)[:, None] * K + o_k[None, :]
    b_k = tl.load(k + p_k, mask=m_tk, other=0.0)
    b_G = chunk_log_decay(g, p_k, m_tk)
    p0 = ((bos + i_c * BT) * H + i_h) * K  # the chunk's first row of k and g
    b_dd = tl.zeros([BT, BV], dtype=tl.float32)
    for i_g in range(G):
        i_hq = i_h * G + i_g
        b_do = tl.load(do + (rows * HQ + i_hq)[:, None] * V + o_v[None, :], mask=m_tv, other=0.0)
        if HAS_P:
            b_P = tl.load(pm + (rows * HQ + i_hq)[:, None] * BT + o_r[None, :],
                          mask=m_t[:, None] & scores_block_mask(BT), other=0.0)
        else:
            b_q = tl.load(q + (rows * HQ + i_hq)[:, None] * K + o_k[None, :], mask=m_tk, other=0.0)
            b_P = decayed_scores(b_q, b_k, k + p0, g + p0, H * K, b_G, n, K, False, SUB, IEEE)
        b_dd += mm(tl.trans(b_P), b_do, b_do, IEEE)
    tl.store(dd + (rows * H + i_h)[:, None] * V + o_v[None, :], (b_dd * scale).to(dd.dtype.element_ty), mask=m_tv)


@triton.jit
def _state_bwd_kernel(
    qg, kd, gc, w, do, dd, dhs, dht, dh0, cu_seqlens, chunk_offsets,
    H: tl.constexpr, G: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
    BV: tl.constexpr, USE_DHT: tl.constexpr, STORE_DH0: tl.constexpr, IEEE: tl.constexpr,
):
    """In reverse over the chunks: store ``dh₁``, ``dΔ = dd + K̃ dh₁`` over ``dd``, and
    ``dh ← Diag(γ_C) dh₁ + Σ_g (scale·γ⊙q_g)ᵀ do_g − Wᵀ dΔ``, on :func:`kda_prepare`'s K̃, G_C and scale·γ⊙q
    (``qg``): the loop takes no log-decay (computing them here, it took 4x the instructions and spilled)."""
    HQ: tl.constexpr = H * G
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    bos, T, boh = sequence_at(cu_seqlens, chunk_offsets, i_n)
    o_k, o_v, o_r = tl.arange(0, BK), i_v * BV + tl.arange(0, BV), tl.arange(0, BT)
    m_k, m_v = o_k < K, o_v < V
    p_h, m_h = o_k[:, None] * V + o_v[None, :], m_k[:, None] & m_v[None, :]
    qg += (bos * HQ + i_h * G) * K
    do += (bos * HQ + i_h * G) * V
    kd += (bos * H + i_h) * K
    w += (bos * H + i_h) * K
    dd += (bos * H + i_h) * V
    gc += (boh * H + i_h) * K
    dhs += (boh * H + i_h) * K * V
    b_dh = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_DHT:
        b_dh = tl.load(dht + i_nh.to(tl.int64) * K * V + p_h, mask=m_h, other=0.0).to(tl.float32)
    NT = tl.cdiv(T, BT)
    for i in range(NT):
        i_t = NT - 1 - i
        t0 = i_t * BT
        m_t = o_r < T - t0
        m_tk, m_tv = m_t[:, None] & m_k[None, :], m_t[:, None] & m_v[None, :]
        p_tk, p_tv = (t0 + o_r)[:, None] * (H * K) + o_k[None, :], (t0 + o_r)[:, None] * (H * V) + o_v[None, :]
        tl.store(dhs + i_t * (H * K * V) + p_h, b_dh.to(dhs.dtype.element_ty), mask=m_h)  # dh₁ of chunk i_t
        b_kd = tl.load(kd + p_tk, mask=m_tk, other=0.0)
        b_dd = tl.load(dd + p_tv, mask=m_tv, other=0.0).to(tl.float32) + mm(b_kd, b_dh, b_kd, IEEE)
        tl.store(dd + p_tv, b_dd.to(dd.dtype.element_ty), mask=m_tv)
        b_w = tl.load(w + p_tk, mask=m_tk, other=0.0)
        g_last = tl.load(gc + i_t * (H * K) + o_k, mask=m_k, other=0.0)
        b_dh = b_dh * exp_ftz(g_last)[:, None] - mm(tl.trans(b_w), b_dd, b_w, IEEE)
        for i_g in range(G):
            b_q = tl.load(qg + (t0 + o_r)[:, None] * (HQ * K) + i_g * K + o_k[None, :], mask=m_tk, other=0.0)
            b_do = tl.load(do + (t0 + o_r)[:, None] * (HQ * V) + i_g * V + o_v[None, :], mask=m_tv, other=0.0)
            b_dh += mm(tl.trans(b_q), b_do, b_do, IEEE)  # (scale·γ⊙q)ᵀ do
    if STORE_DH0:
        tl.store(dh0 + i_nh.to(tl.int64) * K * V + p_h, b_dh.to(dh0.dtype.element_ty), mask=m_h)


@triton.jit
def _dqk_kernel(
    v_new, do, hs, dpm, xq, cu_seqlens, chunk_indices, chunk_offsets, scale,
    H: tl.constexpr, G: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
    BV: tl.constexpr, IEEE: tl.constexpr,
):
    """The scores' dense part, per (chunk, KV head) over its G query heads, with no log-decay:
    ``dP = scale·do Δᵀ`` lower with its diagonal (``dpm`` [tokens, HQ, BT] in the dots' dtype, the one
    ``_intra_bwd_kernel``'s products take it in; the pairwise decays below
    the diagonal are ``_intra_bwd_kernel``'s, and the diagonal has none) and the initial state's
    ``X = scale·do h₀ᵀ`` (float32 ``xq`` [tokens, HQ, K]), which ``_intra_bwd_kernel`` turns into
    ``γ⊙X``, dq's term, and ``q⊙γ⊙X``, G's gradient's."""
    HQ: tl.constexpr = H * G
    i_t, i_h = tl.program_id(0), tl.program_id(1)
    bos, T, boh, i_c = chunk_at(chunk_indices, cu_seqlens, chunk_offsets, i_t)
    n = tl.minimum(T - i_c * BT, BT)
    o_k, o_r = tl.arange(0, BK), tl.arange(0, BT)
    m_k, m_t = o_k < K, o_r < n
    rows = bos + i_c * BT + o_r
    m_tk = m_t[:, None] & m_k[None, :]
    p_s = ((boh + i_c) * H + i_h) * K * V
    for i_g in range(G):
        p_q = (rows * HQ + i_h * G + i_g)[:, None]
        b_dP = tl.zeros([BT, BT], dtype=tl.float32)
        b_x = tl.zeros([BT, BK], dtype=tl.float32)
        for i_v in range(tl.cdiv(V, BV)):
            o_v = i_v * BV + tl.arange(0, BV)
            m_v = o_v < V
            m_tv = m_t[:, None] & m_v[None, :]
            b_do = tl.load(do + p_q * V + o_v[None, :], mask=m_tv, other=0.0)
            b_d = tl.load(v_new + (rows * H + i_h)[:, None] * V + o_v[None, :], mask=m_tv, other=0.0)
            b_h = tl.load(hs + p_s + o_k[:, None] * V + o_v[None, :], mask=m_k[:, None] & m_v[None, :], other=0.0)
            b_dP += mm(b_do, tl.trans(b_d), b_do, IEEE)  # do_r·Δ_j
            b_x += mm(b_do, tl.trans(b_h), b_do, IEEE)  # do h₀ᵀ
        tl.store(dpm + p_q * BT + o_r[None, :],
                 tl.where(o_r[None, :] <= o_r[:, None], b_dP * scale, 0.0).to(dpm.dtype.element_ty), mask=m_t[:, None])
        tl.store(xq + p_q * K + o_k[None, :], b_x * scale, mask=m_tk)


@triton.jit
def _wy_bwd_kernel(
    kg, v, beta, tm, v_new, hs, dhs, dd, tdw, dkt, hdh, dam, dv, dbp, cu_seqlens, chunk_indices, chunk_offsets,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    IEEE: tl.constexpr,
):
    """The dense part through ``K̃``, ``γ_C``, ``Δ = U − W h₀`` and T, per (chunk, KV head), on the forward's γ⊙k
    (``kg``, :func:`kda_fwd.kda_prepare`) and no log-decay: dv, and ``dA = −Tᵀ dT Tᵀ`` strictly lower (``dam``
    [tokens, H, BT] in the dots' dtype; its pairwise decays are ``_intra_bwd_kernel``'s), dβ's share
    ``(TᵀdΔ)·v + (TᵀdW)·(γ⊙k)`` (float32, ``dbp``), and for ``_intra_bwd_kernel``, which takes their log-decays per
    slice of channels, ``TᵀdW`` (``tdw``), ``dK̃ = Δ dh₁ᵀ`` (``dkt``; both float32 like k) and ``Σ_v dh₁⊙h₀``
    (float32 ``hdh`` [NC, H, K])."""
    i_t, i_h = tl.program_id(0), tl.program_id(1)
    bos, T, boh, i_c = chunk_at(chunk_indices, cu_seqlens, chunk_offsets, i_t)
    n = tl.minimum(T - i_c * BT, BT)
    o_k, o_r = tl.arange(0, BK), tl.arange(0, BT)
    m_k, m_t = o_k < K, o_r < n
    rows = bos + i_c * BT + o_r
    m_tk = m_t[:, None] & m_k[None, :]
    p_k = (rows * H + i_h)[:, None] * K + o_k[None, :]
    p_s = ((boh + i_c) * H + i_h) * K * V
    b_kg = tl.load(kg + p_k, mask=m_tk, other=0.0)
    b_beta = tl.load(beta + rows * H + i_h, mask=m_t, other=0.0).to(tl.float32)
    b_T = tl.load(tm + (rows * H + i_h)[:, None] * BT + o_r[None, :], mask=m_t[:, None], other=0.0)
    b_dW = tl.zeros([BT, BK], dtype=tl.float32)  # −dΔ h₀ᵀ
    b_hdh = tl.zeros([BK], dtype=tl.float32)  # Σ_v dh₁ ⊙ h₀
    b_dT = tl.zeros([BT, BT], dtype=tl.float32)
    b_db = tl.zeros([BT], dtype=tl.float32)
    for i_v in range(tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = o_v < V
        m_tv, m_kv = m_t[:, None] & m_v[None, :], m_k[:, None] & m_v[None, :]
        p_tv, p_kv = (rows * H + i_h)[:, None] * V + o_v[None, :], o_k[:, None] * V + o_v[None, :]
        b_dd = tl.load(dd + p_tv, mask=m_tv, other=0.0)
        b_v = tl.load(v + p_tv, mask=m_tv, other=0.0)
        b_h = tl.load(hs + p_s + p_kv, mask=m_kv, other=0.0)
        b_dh = tl.load(dhs + p_s + p_kv, mask=m_kv, other=0.0)
        b_dW -= mm(b_dd, tl.trans(b_h), b_v, IEEE)
        b_hdh += tl.sum(b_dh.to(tl.float32) * b_h.to(tl.float32), 1)
        b_tdu = mm(tl.trans(b_T), b_dd, b_v, IEEE)  # Tᵀ dU
        tl.store(dv + p_tv, (b_tdu * b_beta[:, None]).to(dv.dtype.element_ty), mask=m_tv)
        b_bv = b_v.to(tl.float32) * b_beta[:, None]
        b_db += tl.sum(b_tdu * b_v.to(tl.float32), 1)
        b_dT += mm(b_dd, tl.trans(b_bv), b_v, IEEE)
    b_tdw = mm(tl.trans(b_T), b_dW, b_kg, IEEE)  # Tᵀ dW
    b_dT += mm(b_dW, tl.trans(b_kg.to(tl.float32) * b_beta[:, None]), b_kg, IEEE)
    b_dA = -mm(mm(tl.trans(b_T), b_dT, b_kg, IEEE), tl.trans(b_T), b_kg, IEEE)
    tl.store(dam + (rows * H + i_h)[:, None] * BT + o_r[None, :],
             tl.where(o_r[None, :] < o_r[:, None], b_dA, 0.0).to(dam.dtype.element_ty), mask=m_t[:, None])
    tl.store(dbp + rows * H + i_h, b_db + tl.sum(b_tdw * b_kg.to(tl.float32), 1), mask=m_t)
    tl.store(tdw + p_k, b_tdw, mask=m_tk)
    tl.store(hdh + ((boh + i_c) * H + i_h) * K + o_k, b_hdh, mask=m_k)
    # dK̃ = Δ dh₁ᵀ, the state leaving the chunk, in a second pass over V rather than held with dW through the first
    b_dKt = tl.zeros([BT, BK], dtype=tl.float32)
    for i_v in range(tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = o_v < V
        b_d = tl.load(v_new + (rows * H + i_h)[:, None] * V + o_v[None, :], mask=m_t[:, None] & m_v[None, :],
                      other=0.0)
        b_dh = tl.load(dhs + p_s + o_k[:, None] * V + o_v[None, :], mask=m_k[:, None] & m_v[None, :], other=0.0)
        b_dKt += mm(b_d, tl.trans(b_dh), b_d, IEEE)
    tl.store(dkt + p_k, b_dKt, mask=m_tk)


@triton.jit
def _query_head(q, dpm, xq, dq, b_A, b_R, b_k, b_beta, b_G, b_gamma, pk, pq, pg, pp, pa, pbeta, rows, i_hq, n, o_k,
                m_k, m_tk, H: tl.constexpr, HQ: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, WITH_A: tl.constexpr,
                SUB: tl.constexpr, IEEE: tl.constexpr, b_E, dots, WHOLE: tl.constexpr):
    """One query head of ``_intra_bwd_kernel``: stores its ``dq = γ⊙X + dP_rr k + L_P``; returns ``b_R`` plus its
    right products, its share ``q⊙(L_P + γ⊙X)`` of G's gradient (the diagonal, which has no decay, left out),
    with ``WITH_A`` A's left product X on the same decays (:func:`kda_tiles.decayed_pairs`), and its share
    ``dP_rr q`` of dk."""
    o_r = tl.arange(0, BT)
    p_q = (rows * HQ + i_hq)[:, None]
    b_q = tl.load(q + p_q * K + o_k[None, :], mask=m_tk, other=0.0)
    b_P = tl.load(dpm + p_q * BT + o_r[None, :], mask=(o_r < n)[:, None], other=0.0)
    diag = o_r[:, None] == o_r[None, :]
    b_Pd = tl.sum(tl.where(diag, b_P, 0.0), 1)  # dP_rr, without a decay
    b_P = tl.where(diag, 0.0, b_P)  # the pairs j < r (decayed_pairs takes P strictly lower)
    b_dqs, b_X, b_R = decayed_pairs(b_P, b_A, b_R, b_k, b_q, b_beta, pk, pq, pg, pp, pa, pbeta, H * K, HQ * K, HQ * BT,
                                    H * BT, H, b_G, n, m_k, WITH_A, SUB, IEEE, b_E, dots, WHOLE)
    b_dqs += b_gamma * tl.load(xq + p_q * K + o_k[None, :], mask=m_tk, other=0.0)  # + γ⊙X, the initial state's
    b_qf = b_q.to(tl.float32)
    tl.store(dq + p_q * K + o_k[None, :], (b_dqs + b_Pd[:, None] * b_k.to(tl.float32)).to(dq.dtype.element_ty),
             mask=m_tk)
    return b_R, b_qf * b_dqs, b_X, b_Pd[:, None] * b_qf


@triton.jit
def _intra_bwd_kernel(
    q, k, g, beta, gc, dpm, dam, xq, tdw, dkt, hdh, dq, dk, dg, dbp, NB, cu_seqlens, chunk_indices, chunk_offsets,
    H: tl.constexpr, G: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, SUB: tl.constexpr,
    IEEE: tl.constexpr, DIAG: tl.constexpr, WHOLE: tl.constexpr,
):
    """Every log-decay of the backward, per (slice of BK channels, chunk, KV head): the channels are independent,
    so G is the cumulative sum of the slice's own log-decays. From the dense kernels' dP (``dpm``, every query
    head, with its diagonal), dA (``dam``), ``X = scale·do h₀ᵀ`` (``xq``), ``TᵀdW``, ``dK̃`` and ``Σ_v dh₁⊙h₀``,
    and the forward's G_C (``gc``): the pairwise decays on one ``exp`` per pair
    (:func:`kda_tiles.decayed_pairs`), with ``R = Σ_g R_P + Y``: ``dq = γ⊙X + dP_rr k + L_P`` per query head,
    ``dk = R + β⊙X_A + Σ_g dP_rr q + βγ⊙TᵀdW + dK̃⊙exp(G_C − G)``, and
    ``dg = revcumsum(Σ_g q⊙(L_P + γ⊙X) − k⊙R + βk⊙X_A + βγk⊙TᵀdW) + γ_C⊙Σ_v dh₁⊙h₀ + Σ_{j<t} k_j⊙dK̃_j⊙exp(G_C − G_j)``
    (dq, dk, dg in their dtypes), and the slice's share ``k·X_A`` of dβ (float32, at ``dbp + (1 + slice)·NB``)."""
    HQ: tl.constexpr = H * G
    i_k, i_t, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    bos, T, boh, i_c = chunk_at(chunk_indices, cu_seqlens, chunk_offsets, i_t)
    n = tl.minimum(T - i_c * BT, BT)
    o_k, o_r = i_k * BK + tl.arange(0, BK), tl.arange(0, BT)
    m_k, m_t = o_k < K, o_r < n
    rows = bos + i_c * BT + o_r
    m_tk = m_t[:, None] & m_k[None, :]
    p_k = (rows * H + i_h)[:, None] * K + o_k[None, :]
    b_k = tl.load(k + p_k, mask=m_tk, other=0.0)
    b_G = chunk_log_decay(g, p_k, m_tk)
    b_gamma = exp_ftz(b_G)
    b_beta = tl.load(beta + rows * H + i_h, mask=m_t, other=0.0).to(tl.float32)
    b_A = tl.load(dam + (rows * H + i_h)[:, None] * BT + o_r[None, :], mask=m_t[:, None], other=0.0)
    if not IEEE:  # held across the query heads in the dtype its products take it in (decayed_pairs)
        b_A = b_A.to(b_k.dtype)
    p0, p0q = (bos + i_c * BT) * H + i_h, (bos + i_c * BT) * HQ + i_h * G  # the chunk's first row, KV and query
    pk, pq, pg = k + p0 * K + i_k * BK, q + p0q * K + i_k * BK, g + p0 * K + i_k * BK
    b_R = tl.zeros([BT, BK], dtype=tl.float32)
    b_E, dots = sub_chunk_dots_fit(b_G, SUB, DIAG, WHOLE)  # the same for every query head
    b_R, b_dG, b_X, b_dkq = _query_head(q, dpm, xq, dq, b_A, b_R, b_k, b_beta, b_G, b_gamma, pk, pq, pg,
                                        dpm + p0q * BT, dam + p0 * BT, beta + p0, rows, i_h * G, n, o_k, m_k, m_tk, H,
                                        HQ, K, BT, True, SUB, IEEE, b_E, dots, WHOLE)
    for i_g in range(1, G):  # the other query heads: A's products are done
        b_R, b_dGs, _, b_dkqs = _query_head(q, dpm, xq, dq, b_A, b_R, b_k, b_beta, b_G, b_gamma, pk, pq + i_g * K, pg,
                                            dpm + (p0q + i_g) * BT, dam + p0 * BT, beta + p0, rows, i_h * G + i_g, n,
                                            o_k, m_k, m_tk, H, HQ, K, BT, False, SUB, IEEE, b_E, dots, WHOLE)
        b_dG += b_dGs
        b_dkq += b_dkqs
    b_kf = b_k.to(tl.float32)
    b_bg = b_gamma * b_beta[:, None]  # βγ
    b_tdw = tl.load(tdw + p_k, mask=m_tk, other=0.0)
    b_dk = b_R + b_X * b_beta[:, None] + b_dkq + b_tdw * b_bg
    b_dG += (b_X * b_beta[:, None] - b_R + b_tdw * b_bg) * b_kf
    # the state leaving the chunk: K̃ = k ⊙ exp(G_C − G), and γ_C
    g_last = tl.load(gc + ((boh + i_c) * H + i_h) * K + o_k, mask=m_k, other=0.0)
    b_e = exp_ftz(tl.where(m_tk, g_last[None, :] - b_G, float("-inf")))
    b_dKt = tl.load(dkt + p_k, mask=m_tk, other=0.0)
    b_dk += b_dKt * b_e
    b_sp = b_kf * b_dKt * b_e
    b_hdh = tl.load(hdh + ((boh + i_c) * H + i_h) * K + o_k, mask=m_k, other=0.0)
    b_dg = tl.cumsum(b_dG, 0, reverse=True) + (exp_ftz(g_last) * b_hdh)[None, :] + (tl.cumsum(b_sp, 0) - b_sp)
    tl.store(dk + p_k, b_dk.to(dk.dtype.element_ty), mask=m_tk)
    b_dg = tl.where(tl.load(g + p_k, mask=m_tk, other=0.0) < FLOOR, 0.0, b_dg)  # the floor's gradient (kda_tiles.floored)
    tl.store(dg + p_k, b_dg.to(dg.dtype.element_ty), mask=m_tk)
    tl.store(dbp + (1 + i_k) * NB + rows * H + i_h, tl.sum(b_X * b_kf, 1), mask=m_t)


def intra_bk(K: int) -> int:
    """Channels per ``_intra_bwd_kernel`` program: 32 (as fla's ``chunk_kda_bwd_kernel_intra``), 16 for K ≤ 16.
    It runs 8 warps: compiled for sm_90 (``scripts/kernel_resources.py --launchers``, Triton 3.9) its bf16
    launches take 197–239 registers and no stack (K = 8 to 256, G = 1 to 7), where 4 warps spilled 336–440 B at
    K = 128 and 64-channel slices 528–656 B."""
    return min(32, block_k(K))


def kda_bwd(*, q, k, v, g, beta, scale: float, initial_state, do, dht, cu_seqlens, tm=None, pm=None,
            kept=None) -> tuple:
    """``(dq, dk, dv, dg, dbeta, dh0)`` of :func:`kda_fwd`'s output and final state, each in its input's dtype
    (``dh0`` None without an initial state). ``do`` ``[B, T, G·H, V]``; ``dht`` ``[N, H, K, V]`` or None;
    ``tm`` the forward's T (:func:`kda_fwd`), or None to solve again; ``pm`` the forward's in-chunk scores
    (``kda_fwd(..., return_scores=True)``), or None to compute them again; ``kept`` the forward's
    :class:`~linearize.ops.triton.kda_fwd.Kept` (``keep=True``), or None to run its prepare and states again."""
    B, T, HQ, K = q.shape
    L = Layout(q, v, cu_seqlens)
    H, V, G, ieee, dev = L.H, L.V, L.G, L.ieee, q.device
    qf, kf, vf, bf, dof = Layout.flat(q, k, v, beta, do)
    gf = Layout.flat(g)[0].float()
    h0 = initial_state.to(torch.float32).contiguous() if initial_state is not None else None
    dh0 = torch.empty(L.N, H, K, V, dtype=initial_state.dtype, device=dev) if initial_state is not None else None
    dq, dk, dv = torch.empty_like(qf), torch.empty_like(kf), torch.empty_like(vf)
    dg, dbeta = torch.empty(L.tokens, H, K, dtype=g.dtype, device=dev), torch.empty_like(bf)
    shape = lambda x, *s: x.view(B, T, *s)  # noqa: E731
    if L.NC == 0:  # no tokens: the state's gradient passes through
        if dh0 is not None:
            dh0.copy_(dht if dht is not None else torch.zeros_like(dh0))
        return shape(dq, HQ, K), shape(dk, H, K), shape(dv, H, V), shape(dg, H, K), shape(dbeta, H), dh0
    if kept is None:
        tm, w, u, kd, gc, qg, kg = kda_prepare(layout=L, k=kf, v=vf, g=gf, beta=bf, tm=tm, q=qf, scale=scale,
                                                   kg=True)
        hs, v_new = kda_states(layout=L, kd=kd, gc=gc, w=w, u=u, h0=h0)
        del u
    else:
        w, kd, gc, qg, kg, hs, v_new = kept
    dhs = torch.empty_like(hs)
    f32 = lambda *s: torch.empty(L.tokens, *s, dtype=torch.float32, device=dev)  # noqa: E731
    tdw, dkt, xq = f32(H, K), f32(H, K), f32(HQ, K)
    # dΔ (as GDN's), dP and dA in the dots' dtype: every product that reads them takes them in that, and dP and
    # dA are read by every channel slice of the intra kernel
    dots = lambda *s: torch.empty(L.tokens, *s, dtype=torch.float32 if ieee else k.dtype, device=dev)  # noqa: E731
    dd, dpm, dam = dots(H, V), dots(HQ, BT), dots(H, BT)
    hdh = torch.empty(L.NC, H, K, dtype=torch.float32, device=dev)
    BKI = intra_bk(K)
    NK = cdiv(K, BKI)
    dbp = torch.empty(1 + NK, L.tokens, H, dtype=torch.float32, device=dev)  # dβ's shares: dense, then per slice
    dht = dht.contiguous() if dht is not None else None
    BK, BV = block_k(K), kda_bv(K, V)
    c = {"H": H, "K": K, "V": V, "BT": BT, "BK": BK, "BV": BV, "IEEE": ieee}
    _dv_local_kernel[(cdiv(V, BV), L.NC, H)](
        qf, kf, gf, pm if pm is not None else dd, dof, dd, L.cu_seqlens, L.chunk_indices, L.chunk_offsets,
        float(scale), G=G, SUB=SUB, HAS_P=pm is not None, **c, num_warps=chunk_warps(K))
    BVS = kda_state_bv(L)  # (as the forward's: narrower while the (sequence, head) pairs are few)
    _state_bwd_kernel[(cdiv(V, BVS), L.N * H)](
        qg, kd, gc, w, dof, dd, dhs, dht if dht is not None else dhs, dh0 if dh0 is not None else dhs,
        L.cu_seqlens, L.chunk_offsets, G=G, USE_DHT=dht is not None, STORE_DH0=dh0 is not None, **{**c, "BV": BVS},
        num_warps=4, num_stages=kda_stages(K, ieee, "state_bwd", G))
    del qg, kd
    _dqk_kernel[(L.NC, H)](
        v_new, dof, hs, dpm, xq, L.cu_seqlens, L.chunk_indices, L.chunk_offsets, float(scale), G=G, **c,
        num_warps=replay_warps(K, ieee))
    _wy_bwd_kernel[(L.NC, H)](
        kg, vf, bf, tm, v_new, hs, dhs, dd, tdw, dkt, hdh, dam, dv, dbp, L.cu_seqlens, L.chunk_indices,
        L.chunk_offsets, **c, num_warps=chunk_warps(K), num_stages=kda_stages(K, ieee, "wy_bwd"))
    del kg, v_new, hs, dhs, dd
    iw, ist = (4, 2) if replayed(K, ieee) else (8, 3)  # (4, 2): 1.18× in the replays (replay_warps)
    _intra_bwd_kernel[(NK, L.NC, H)](
        qf, kf, gf, bf, gc, dpm, dam, xq, tdw, dkt, hdh, dq, dk, dg, dbp, L.tokens * H, L.cu_seqlens,
        L.chunk_indices, L.chunk_offsets, H=H, G=G, K=K, BT=BT, BK=BKI, SUB=SUB, IEEE=ieee, **dot_modes(k.dtype),
        num_warps=iw, num_stages=ist)
    dbeta.copy_(dbp.sum(0))
    return shape(dq, HQ, K), shape(dk, H, K), shape(dv, H, V), shape(dg, H, K), shape(dbeta, H), dh0


# keep the forward's prepare and state outputs for the backward (``kda_fwd.Kept``) rather than run both again
KEEP_FORWARD = True


class KDAFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, initial_state, scale, output_final_state, cu_seqlens, v_offset, keep):
        o, ht, tm, pm, *kept = kda_fwd(q=q, k=k, v=v, g=g, beta=beta, scale=scale, initial_state=initial_state,
                                       output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                                       v_offset=v_offset, return_scores=True, keep=keep)
        kept = kept[0] if kept else None
        # T and the scores P are kept (their pairwise decays per channel are the costly part), and with
        # KEEP_FORWARD W, K̃, G_C, scale·γ⊙q, the states and Δ; else the backward computes those again
        ctx.save_for_backward(q, k, v, g, beta, initial_state, cu_seqlens, tm, pm, *(kept or ()))
        ctx.scale = scale
        ctx.offset_dtype = v_offset.dtype if v_offset is not None else None
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, g, beta, h0, cu_seqlens, tm, pm, *kept = ctx.saved_tensors
        dq, dk, dv, dg, dbeta, dh0 = kda_bwd(q=q, k=k, v=v, g=g, beta=beta, scale=ctx.scale, initial_state=h0,
                                             do=do.contiguous(), dht=dht, cu_seqlens=cu_seqlens, tm=tm, pm=pm,
                                             kept=kept or None)
        dvo = None
        if ctx.needs_input_grad[9]:  # o = … + v_offset of the KV head, read by its G query heads
            B, T, HQ, V = do.shape
            H = v.shape[2]
            dvo = do.reshape(B, T, H, HQ // H, V).sum(3, dtype=torch.float32).to(ctx.offset_dtype)
        return dq, dk, dv, dg, dbeta, dh0, None, None, None, dvo, None


def backward_compiles(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the backward kernels compile right here: always in float32 and off CUDA; in 16 bits on CUDA
    only with ptxas 12.9 or newer. ptxas 12.8, the one Triton 3.6 ships, takes the shared-memory address of
    some of the backward's bf16/fp16 ``wgmma`` products from the wrong register, so a product reads the wrong
    rows: on an H200 ``dg`` came out 0.12 from the reference while the same kernels compiled by ptxas 12.9
    and 13.0 read the right ones (docs/kernels.md)."""
    if device.type != "cuda" or dtype == torch.float32:
        return True
    version = ptxas_version()
    return version is None or version >= PTXAS_FIXED


def check_backward_compiler(dtype: torch.dtype, device: torch.device) -> None:
    """Refuse a 16-bit backward on CUDA that :func:`backward_compiles` says ptxas would miscompile."""
    if not backward_compiles(dtype, device):
        version = ptxas_version()
        raise RuntimeError(
            f"the KDA Triton backward in {dtype} needs ptxas >= 12.9, and Triton compiles with ptxas "
            f"{version[0]}.{version[1]}, which miscompiles it; {newer_ptxas_advice()}, or train kda in float32 or "
            "with backend='torch'")


@cache
def warn_torch_backward(dtype: torch.dtype) -> None:
    """Once a process and dtype: ``backend="auto"`` trains a 16-bit KDA on CUDA through the chunkwise PyTorch
    form, since :func:`backward_compiles` says Triton's ptxas would miscompile the kernels' backward."""
    version = ptxas_version()
    warnings.warn(
        f"KDA in {dtype} trains through the PyTorch chunkwise form, not the Triton kernels: Triton compiles with "
        f"ptxas {version[0]}.{version[1]}, which miscompiles their backward; {newer_ptxas_advice()} for the "
        "kernels", stacklevel=3)


def kda_triton(q, k, v, g, beta, *, scale: float = 1.0, initial_state=None, output_final_state: bool = False,
               cu_seqlens=None, v_offset=None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """KDA on the Triton kernels, differentiable (gradients of q, k, v, g, beta, the initial state and
    v_offset); same contract as :func:`linearize.ops.gated_delta_rule` with a per-channel ``g [B, T, H, K]``
    (inputs checked there), plus ``v_offset`` ``[B, T, H, V]`` or None, added to the output of every query head
    of its KV head before the output's one rounding."""
    if q.dtype not in TRITON_DTYPES:
        raise ValueError(f"the Triton backend takes {', '.join(map(str, TRITON_DTYPES))}; got {q.dtype} (use backend='torch')")
    if v_offset is not None and v_offset.shape != v.shape:
        raise ValueError(f"v_offset must be shaped like v {tuple(v.shape)}; got {tuple(v_offset.shape)}")
    grad = wants_grad(q, k, v, g, beta, initial_state, v_offset)
    if grad:
        check_backward_compiler(q.dtype, q.device)
    # the forward's tensors kept only where autograd will differentiate this call
    return KDAFunction.apply(q, k, v, g, beta, initial_state, float(scale), output_final_state, cu_seqlens, v_offset,
                             KEEP_FORWARD and grad)

"""Triton backward of the chunkwise gated delta rule: the kernels of ``linearize/ops/chunk_bwd.py``.

Read that file's docstring first: it derives every term below, and its PyTorch code is the spec these
kernels are tested against (besides the float64 reference). Of the forward's intermediates only
``T = (I + A)⁻¹`` is kept (the solve kernel is skipped); the backward recomputes W, U and g's cumsum with
the forward's ``prepare``, then the forward's states (``states``) on a side CUDA stream while kernels 1 and
2 below run (they do not need them), then runs:

1. ``_dv_local_kernel``  per (V block, chunk, KV head): ``Pᵀ do`` summed over the G query heads that
   read this KV head (the in-chunk part of ``dΔ``); under GQA also the chunk's ``Σ_g (γ⊙q_g)ᵀ do_g``
   (``qdo_outside``), so the sequential kernel below does not run G products per chunk.
2. ``_state_bwd_kernel`` per (V block, sequence, KV head): the only sequential part, in reverse over
   chunks: ``dΔ = Pᵀdo + K̃ dh₁``, ``dh₀ = γ_C dh₁ + (γ⊙q)ᵀ do − Wᵀ dΔ``; stores ``dh₁`` per chunk, and ``dΔ``
   over kernel 1's ``Pᵀdo`` (one buffer, in the dots' dtype).
3. ``_dqk_kernel``       per (chunk, query head): ``dq`` and this query head's share of ``dk`` and of the
   log-decay gradient (through ``P`` and ``γ ⊙ (q h₀)``).
4. ``_wy_bwd_kernel``    per (chunk, KV head): through ``K̃``, ``γ_C``, ``Δ = U − W h₀``, ``T`` and ``A``;
   sums the query heads' shares, writes ``dk``, ``dv``, ``dβ`` and ``dg`` (reverse cumsum in the chunk).

GQA: KV head ``h`` is read by query heads ``h·G … h·G+G−1``; kernels 1, 2 and 4 loop over them, so K/V
are never repeated. Dots run in the input dtype with fp32 accumulation (IEEE fp32 for fp32 inputs).
"""

from __future__ import annotations

import functools
from types import MappingProxyType

import torch
import triton
import triton.language as tl

from ..common import cdiv, next_pow2
from .chunk_fwd import (
    BT,
    Layout,
    _block_k,
    _blocks_load,
    _blocks_rows_dot,
    _blocks_start,
    _blocks_store,
    _blocks_update,
    _chunk,
    _sequence,
    _state_bv,
    frozen,
    prepare,
    sms_for,
    states,
)


@triton.jit
def _mm(a, b, ref, IEEE: tl.constexpr):
    """a @ b with fp32 accumulation: IEEE fp32 operands, or both cast to ``ref``'s dtype (bf16/fp16)."""
    if IEEE:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a.to(ref.dtype), b.to(ref.dtype))


@triton.jit
def _dv_local_kernel(
    q, k, gcum, do, dvl, dql, chunk_indices, cu_seqlens, chunk_offsets, scale,
    H: tl.constexpr, G: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, QDO: tl.constexpr, IEEE: tl.constexpr,
):
    """``Pᵀ do`` summed over the G query heads of this KV head; with ``QDO`` also the chunk's share of the
    state gradient, ``Σ_g (γ⊙q_g)ᵀ do_g · scale`` ([K, V] per chunk, fp32, into ``dql``), which the state
    kernel then reads instead of running G products in its sequential chain."""
    i_v, i_t, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    HQ: tl.constexpr = H * G
    bos, T, boh, i_c = _chunk(chunk_indices, cu_seqlens, chunk_offsets, i_t)
    o_r = tl.arange(0, BT)
    m_t = i_c * BT + o_r < T
    row = bos + i_c * BT + o_r
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    m_qk = m_t[:, None] & m_k[None, :]
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    m_qv = m_t[:, None] & m_v[None, :]

    b_k = tl.load(k + row[:, None] * (H * K) + i_h * K + o_k[None, :], mask=m_qk, other=0.0)
    b_g = tl.load(gcum + row * H + i_h, mask=m_t, other=0.0)
    # [j, r]: r ≥ j, both in the document (rows past its end read g = 0: exp(0 − g_j) may overflow, and 0·inf = NaN)
    up = (o_r[:, None] <= o_r[None, :]) & m_t[:, None] & m_t[None, :]
    dec_t = tl.where(up, tl.exp(tl.where(up, b_g[None, :] - b_g[:, None], 0.0)), 0.0)  # γ_r/γ_j
    gs = tl.exp(b_g) * scale
    acc = tl.zeros([BT, BV], dtype=tl.float32)
    acc_h = tl.zeros([BK, BV], dtype=tl.float32)
    for i_g in range(G):
        i_hq = i_h * G + i_g
        b_q = tl.load(q + row[:, None] * (HQ * K) + i_hq * K + o_k[None, :], mask=m_qk, other=0.0)
        b_do = tl.load(do + row[:, None] * (HQ * V) + i_hq * V + o_v[None, :], mask=m_qv, other=0.0)
        p_t = _mm(b_k, tl.trans(b_q), b_k, IEEE) * dec_t * scale  # Pᵀ
        acc += _mm(p_t, b_do, b_k, IEEE)
        if QDO:
            acc_h += _mm(tl.trans(b_q.to(tl.float32) * gs[:, None]), b_do, b_k, IEEE)  # (γ⊙q_g)ᵀ do_g
    tl.store(dvl + row[:, None] * (H * V) + i_h * V + o_v[None, :], acc.to(dvl.dtype.element_ty), mask=m_qv)
    if QDO:
        tl.store(dql + ((boh + i_c) * H + i_h).to(tl.int64) * K * V + o_k[:, None] * V + o_v[None, :], acc_h,
                 mask=m_k[:, None] & m_v[None, :])


@triton.jit
def _state_bwd_kernel(
    q, k, w, gcum, do, dvl, dql, dhs, ddl, dht, dh0, cu_seqlens, chunk_offsets, scale,
    H: tl.constexpr, G: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, KB: tl.constexpr, BV: tl.constexpr,
    QDO: tl.constexpr, USE_DHT: tl.constexpr, STORE_DH0: tl.constexpr, IEEE: tl.constexpr,
):
    """Per (V block, sequence × KV head), over the chunks in reverse: store dh₁ (the gradient of the state
    leaving the chunk), ``dΔ = Pᵀdo + (γ_C/γ_j ⊙ k) dh₁``, then ``dh₀ = γ_C dh₁ + Σ_g (γ⊙q_g)ᵀ do_g − Wᵀ dΔ``.
    ``ddl`` may be ``dvl`` (updated in place). The state gradient is held as up to four (KB, BV) blocks, as
    in the forward's ``_state_kernel``. With ``QDO`` the q term is read per chunk from ``dql`` (written by
    ``_dv_local_kernel``) instead of computed here."""
    HQ: tl.constexpr = H * G
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    bos, T, boh = _sequence(cu_seqlens, chunk_offsets, i_n)
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    o_r = tl.arange(0, BT)
    q += (bos * HQ + i_h * G) * K
    do += (bos * HQ + i_h * G) * V
    k += (bos * H + i_h) * K
    w += (bos * H + i_h) * K
    dvl += (bos * H + i_h) * V
    ddl += (bos * H + i_h) * V
    gcum += bos * H + i_h
    dhs += (boh * H + i_h) * K * V
    dql += (boh * H + i_h) * K * V

    b_dh1, b_dh2, b_dh3, b_dh4 = _blocks_start(dht + i_nh.to(tl.int64) * K * V, USE_DHT, o_v, m_v, K, V, KB, BV)
    NT = tl.cdiv(T, BT)
    for i in range(NT):
        i_t = NT - 1 - i
        t0 = i_t * BT
        m_t = o_r < T - t0
        _blocks_store(dhs + i_t * (H * K * V), b_dh1, b_dh2, b_dh3, b_dh4, o_v, m_v, K, V, KB)
        g_last = tl.load(gcum + (tl.minimum(t0 + BT, T) - 1) * H)
        b_g = tl.load(gcum + t0 * H + o_r * H, mask=m_t, other=0.0)
        e_c = tl.exp(g_last)
        # dΔ = Pᵀdo + K̃ dh₁, K̃ = γ_C/γ_j ⊙ k: the decay scales the product's rows
        b_kdh = _blocks_rows_dot(k + t0 * (H * K), H * K, o_r, m_t, b_dh1, b_dh2, b_dh3, b_dh4, K, KB, False, IEEE)
        p_tv = o_r[:, None] * (H * V) + o_v[None, :]
        m_tv = m_t[:, None] & m_v[None, :]
        b_dd = tl.load(dvl + t0 * (H * V) + p_tv, mask=m_tv, other=0.0).to(tl.float32)
        b_dd += b_kdh * tl.where(m_t, tl.exp(g_last - b_g), 0.0)[:, None]
        tl.store(ddl + t0 * (H * V) + p_tv, b_dd.to(ddl.dtype.element_ty), mask=m_tv)
        # dh₀ = γ_C dh₁ − Wᵀ dΔ + Σ_g (γ⊙q_g)ᵀ do_g (scale folded into do)
        b_dh1, b_dh2, b_dh3, b_dh4 = _blocks_update(b_dh1, b_dh2, b_dh3, b_dh4, e_c, w + t0 * (H * K), H * K, o_r, m_t,
                                                    b_dd, K, KB, True, IEEE)
        if QDO:
            b_dh1, b_dh2, b_dh3, b_dh4 = _blocks_load(dql + i_t * (H * K * V), b_dh1, b_dh2, b_dh3, b_dh4, o_v, m_v,
                                                      K, V, KB)
        else:
            gs = tl.exp(b_g) * scale
            for i_g in range(G):
                p_q = q + t0 * (HQ * K) + i_g * K
                b_do = tl.load(do + t0 * (HQ * V) + i_g * V + o_r[:, None] * (HQ * V) + o_v[None, :], mask=m_tv,
                               other=0.0)
                b_dos = b_do.to(tl.float32) * gs[:, None]
                b_dh1, b_dh2, b_dh3, b_dh4 = _blocks_update(b_dh1, b_dh2, b_dh3, b_dh4, 1.0, p_q, HQ * K, o_r, m_t,
                                                            b_dos, K, KB, False, IEEE)
    if STORE_DH0:
        _blocks_store(dh0 + i_nh.to(tl.int64) * K * V, b_dh1, b_dh2, b_dh3, b_dh4, o_v, m_v, K, V, KB)


@triton.jit
def _dqk_kernel(
    q, k, v_new, gcum, hs, do, dq, dkq, dgq, chunk_indices, cu_seqlens, chunk_offsets, scale,
    H: tl.constexpr, G: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, IEEE: tl.constexpr,
):
    i_t, i_hq = tl.program_id(0), tl.program_id(1)
    i_h = i_hq // G
    HQ: tl.constexpr = H * G
    bos, T, boh, i_c = _chunk(chunk_indices, cu_seqlens, chunk_offsets, i_t)
    o_r = tl.arange(0, BT)
    m_t = i_c * BT + o_r < T
    row = bos + i_c * BT + o_r
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    m_tk = m_t[:, None] & m_k[None, :]

    b_k = tl.load(k + row[:, None] * (H * K) + i_h * K + o_k[None, :], mask=m_tk, other=0.0)
    b_qs = tl.load(q + row[:, None] * (HQ * K) + i_hq * K + o_k[None, :], mask=m_tk, other=0.0).to(tl.float32) * scale
    b_g = tl.load(gcum + row * H + i_h, mask=m_t, other=0.0)
    acc_dp = tl.zeros([BT, BT], dtype=tl.float32)  # do Δᵀ
    acc_dqh = tl.zeros([BT, BK], dtype=tl.float32)  # do h₀ᵀ
    for i_v in range(tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = o_v < V
        m_tv = m_t[:, None] & m_v[None, :]
        b_do = tl.load(do + row[:, None] * (HQ * V) + i_hq * V + o_v[None, :], mask=m_tv, other=0.0)
        b_dl = tl.load(v_new + row[:, None] * (H * V) + i_h * V + o_v[None, :], mask=m_tv, other=0.0)
        b_h = tl.load(hs + ((boh + i_c) * H + i_h) * K * V + o_k[:, None] * V + o_v[None, :],
                      mask=m_k[:, None] & m_v[None, :], other=0.0)
        acc_dp += _mm(b_do, tl.trans(b_dl), b_k, IEEE)
        acc_dqh += _mm(b_do, tl.trans(b_h), b_k, IEEE)
    causal = (o_r[:, None] >= o_r[None, :]) & m_t[:, None] & m_t[None, :]  # (see _dv_local_kernel)
    decay = tl.where(causal, tl.exp(tl.where(causal, b_g[:, None] - b_g[None, :], 0.0)), 0.0)
    b_p = _mm(b_qs, tl.trans(b_k), b_k, IEEE) * decay  # P
    b_dpd = acc_dp * decay  # dP ⊙ D (causal)
    gam = tl.exp(b_g)
    b_dq = acc_dqh * gam[:, None] + _mm(b_dpd, b_k, b_k, IEEE)
    tl.store(dq + row[:, None] * (HQ * K) + i_hq * K + o_k[None, :], (b_dq * scale).to(dq.dtype.element_ty), mask=m_tk)
    b_dk = _mm(tl.trans(b_dpd), b_qs, b_k, IEEE)
    tl.store(dkq + row[:, None] * (HQ * K) + i_hq * K + o_k[None, :], b_dk, mask=m_tk)
    b_m = acc_dp * b_p  # ∂/∂ log D_rj
    b_dg = tl.sum(b_m, axis=1) - tl.sum(b_m, axis=0) + gam * tl.sum(acc_dqh * b_qs, axis=1)
    tl.store(dgq + row * HQ + i_hq, b_dg, mask=m_t)


@triton.jit
def _wy_bwd_kernel(
    k, v, beta, gcum, tm, v_new, hs, dhs, ddl, dkq, dgq, dk, dv, dbeta, dg,
    chunk_indices, cu_seqlens, chunk_offsets,
    H: tl.constexpr, G: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BKB: tl.constexpr, IEEE: tl.constexpr,
):
    """Two passes over one chunk, each holding only (BT, BT) and (BT, BKB|BV) tiles (K in blocks of BKB).

    The gradient reaching A needs no K-sized term: with ``dU = dΔ`` and ``dW = −dΔ h₀ᵀ``,
    ``Tᵀ (dU Uᵀ + dW Wᵀ) = Tᵀ dΔ (U − W h₀)ᵀ = Tᵀ dΔ Δᵀ``, since ``Δ = U − W h₀``. So:
    1. over V blocks, through U = T(βv): dv, the v-part of dβ, and ``Tᵀ dΔ Δᵀ`` (then dA ⊙ D, held);
    2. per K block, everything of dk at once: through K̃ (``Δ dh₁ᵀ``) and W (``Tᵀ (−dΔ h₀ᵀ)``), through A
       (``dA ⊙ D`` times k, both ways), plus the query heads' shares from ``dkq``; the log-decay gradient
       through A comes from the same products (row and column sums of ``dA ⊙ D ⊙ β k kᵀ``);
    then dg as an in-chunk reverse cumsum."""
    i_t, i_h = tl.program_id(0), tl.program_id(1)
    HQ: tl.constexpr = H * G
    bos, T, boh, i_c = _chunk(chunk_indices, cu_seqlens, chunk_offsets, i_t)
    o_r = tl.arange(0, BT)
    o_t = i_c * BT + o_r
    m_t = o_t < T
    row = bos + o_t
    p_state = ((boh + i_c) * H + i_h) * K * V

    b_beta = tl.load(beta + row * H + i_h, mask=m_t, other=0.0).to(tl.float32)
    b_g = tl.load(gcum + row * H + i_h, mask=m_t, other=0.0)
    last = tl.minimum(i_c * BT + BT, T) - 1
    g_last = tl.load(gcum + (bos + last) * H + i_h)
    gam = tl.exp(b_g)
    e = tl.where(m_t, tl.exp(g_last - b_g), 0.0)  # γ_C/γ_j
    ref = tl.zeros([BT], dtype=k.dtype.element_ty)  # carries the dtype of the dots (k's)
    b_tt = tl.trans(tl.load(tm + row[:, None] * (H * BT) + i_h * BT + o_r[None, :], mask=m_t[:, None], other=0.0))
    if not IEEE:  # only Tᵀ is used, as a dot operand
        b_tt = b_tt.to(ref.dtype)

    # 1. U = T (β v): dU = dΔ
    acc_da = tl.zeros([BT, BT], dtype=tl.float32)  # Tᵀ dΔ Δᵀ = −∂/∂A (before masking)
    b_dbeta = tl.zeros([BT], dtype=tl.float32)
    for i_v in range(tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_tv = m_t[:, None] & (o_v < V)[None, :]
        p_tv = row[:, None] * (H * V) + i_h * V + o_v[None, :]
        b_dd = tl.load(ddl + p_tv, mask=m_tv, other=0.0)
        b_v = tl.load(v + p_tv, mask=m_tv, other=0.0)
        b_dl = tl.load(v_new + p_tv, mask=m_tv, other=0.0)
        b_ttdu = _mm(b_tt, b_dd, ref, IEEE)  # Tᵀ dU
        tl.store(dv + p_tv, (b_beta[:, None] * b_ttdu).to(dv.dtype.element_ty), mask=m_tv)
        b_dbeta += tl.sum(b_ttdu * b_v.to(tl.float32), axis=1)
        acc_da += _mm(b_ttdu, tl.trans(b_dl), ref, IEEE)
    # A = strictly-lower(β k kᵀ ⊙ γ_r/γ_j): dA = −strict-lower(acc_da); b_ds = dA ⊙ D
    strict = (o_r[:, None] > o_r[None, :]) & m_t[:, None] & m_t[None, :]  # (see _dv_local_kernel)
    decay = tl.where(strict, tl.exp(tl.where(strict, b_g[:, None] - b_g[None, :], 0.0)), 0.0)
    b_ds = tl.where(strict, -acc_da, 0.0) * decay

    # 2. per K block: ∂/∂K̃ = Δ dh₁ᵀ, ∂/∂W = −dΔ h₀ᵀ, and A's two products
    ktw = tl.zeros([BT], dtype=tl.float32)  # Σ_k (Tᵀ dW) ⊙ k
    de = tl.zeros([BT], dtype=tl.float32)  # ∂/∂ log e_j
    rows_a = tl.zeros([BT], dtype=tl.float32)  # Σ_j (dA ⊙ D ⊙ β k kᵀ)_rj
    cols_a = tl.zeros([BT], dtype=tl.float32)  # Σ_r (dA ⊙ D ⊙ β k kᵀ)_rj
    hdh = 0.0  # Σ h₀ ⊙ dh₁
    p_dkq = dkq + row[:, None] * (HQ * K) + i_h * G * K
    for i_k in range(tl.cdiv(K, BKB)):
        o_k = i_k * BKB + tl.arange(0, BKB)
        m_k = o_k < K
        m_tk = m_t[:, None] & m_k[None, :]
        acc_dkt = tl.zeros([BT, BKB], dtype=tl.float32)
        acc_dw = tl.zeros([BT, BKB], dtype=tl.float32)
        for i_v in range(tl.cdiv(V, BV)):
            o_v = i_v * BV + tl.arange(0, BV)
            m_v = o_v < V
            m_tv = m_t[:, None] & m_v[None, :]
            m_kv = m_k[:, None] & m_v[None, :]
            p_tv = row[:, None] * (H * V) + i_h * V + o_v[None, :]
            b_dl = tl.load(v_new + p_tv, mask=m_tv, other=0.0)
            b_dd = tl.load(ddl + p_tv, mask=m_tv, other=0.0)
            b_h = tl.load(hs + p_state + o_k[:, None] * V + o_v[None, :], mask=m_kv, other=0.0)
            b_dh = tl.load(dhs + p_state + o_k[:, None] * V + o_v[None, :], mask=m_kv, other=0.0)
            acc_dkt += _mm(b_dl, tl.trans(b_dh), ref, IEEE)
            acc_dw -= _mm(b_dd, tl.trans(b_h), ref, IEEE)
            hdh += tl.sum(tl.sum(b_h.to(tl.float32) * b_dh.to(tl.float32), axis=1), axis=0)
        b_k = tl.load(k + row[:, None] * (H * K) + i_h * K + o_k[None, :], mask=m_tk, other=0.0).to(tl.float32)
        b_ttdw = _mm(b_tt, acc_dw, ref, IEEE)  # Tᵀ dW
        ktw += tl.sum(b_ttdw * b_k, axis=1)
        de += tl.sum(acc_dkt * b_k, axis=1) * e
        b_dkb = _mm(b_ds, b_k, ref, IEEE)  # (dA ⊙ D) k
        b_dka = _mm(tl.trans(b_ds), b_k * b_beta[:, None], ref, IEEE)  # (dA ⊙ D)ᵀ (β k)
        s_dkb = tl.sum(b_dkb * b_k, axis=1)
        b_dbeta += s_dkb
        rows_a += b_beta * s_dkb
        cols_a += tl.sum(b_dka * b_k, axis=1)
        b_dk = acc_dkt * e[:, None] + (b_beta * gam)[:, None] * b_ttdw + b_beta[:, None] * b_dkb + b_dka
        for i_g in range(G):
            b_dk += tl.load(p_dkq + i_g * K + o_k[None, :], mask=m_tk, other=0.0)
        tl.store(dk + row[:, None] * (H * K) + i_h * K + o_k[None, :], b_dk.to(dk.dtype.element_ty), mask=m_tk)

    b_dbeta += gam * ktw
    b_dG = rows_a - cols_a + b_beta * gam * ktw - de
    for i_g in range(G):
        b_dG += tl.load(dgq + row * HQ + i_h * G + i_g, mask=m_t, other=0.0)
    extra = tl.sum(de, axis=0) + tl.exp(g_last) * hdh  # through γ_C
    b_dG += tl.where(o_t == last, extra, 0.0)
    b_dG = tl.where(m_t, b_dG, 0.0)
    b_dg = tl.sum(b_dG, axis=0) - tl.cumsum(b_dG, axis=0) + b_dG  # G = cumsum(g) in the chunk
    tl.store(dbeta + row * H + i_h, b_dbeta, mask=m_t)
    tl.store(dg + row * H + i_h, b_dg, mask=m_t)


def launch_settings(H: int, G: int, K: int, V: int, ieee: bool, programs: int | None = None,
                    device: torch.device | None = None) -> MappingProxyType:
    """``{name: (kernel, constexprs, warps, stages)}`` of the backward kernels, built once per shape and
    read-only (see ``chunk_fwd.launch_settings``)."""
    bvs = _state_bv(K, V, ieee, programs, sms_for(programs, device))
    return _launch_settings(H, G, K, V, ieee, bvs, qdo_outside(G))


@functools.lru_cache(maxsize=256)
def _launch_settings(H: int, G: int, K: int, V: int, ieee: bool, bvs: int, qdo: bool) -> MappingProxyType:
    """The table for one shape, state-kernel V block ``bvs`` and ``qdo`` choice (made per call by the caller)."""
    BK = _block_k(K)
    wide = BK > 128
    common = dict(H=H, G=G, K=K, V=V, BT=BT, BK=BK, IEEE=ieee)
    bv = min(64 if not wide else 32, max(16, next_pow2(V)))
    vmax = max(16, next_pow2(V))
    stages = 1 if wide else 2
    return frozen({
        # 128-wide V blocks: 79 µs against 101 at 64 (H200 sweep, 8x2048); with the q term as well (GQA), still
        # fastest: 106 µs against 115 at BV 64 and 116 at 8 warps (Llama-3-8B shape, 2x4096)
        "dv_local": (_dv_local_kernel, {**common, "QDO": qdo, "BV": min(128, vmax) if not wide else bv}, 4, stages),
        "state_bwd": (_state_bwd_kernel, {"H": H, "G": G, "K": K, "V": V, "BT": BT, "KB": min(BK, 64), "BV": bvs,
                                          "QDO": qdo, "IEEE": ieee, "USE_DHT": False, "STORE_DH0": False}, 4,
                      # fp32 (IEEE) at 3 stages needs 239–280 KB of shared memory at K=128 (the H200 has 227 KB)
                      1 if wide else (2 if ieee else 3)),
        # 4 warps at K ≤ 128: 237 µs against 283 at 8 (H200 sweep, 8x2048)
        "dqk": (_dqk_kernel, {**common, "BV": bv}, 4 if not wide else 8, stages),
        # its tiles are (BT, 64) whatever K is; BV 64 for the reason given at the forward's prepare kernel
        # 4 warps, 1 stage: 399 µs against 426 at 2 stages and 629 at 8 warps (H200 sweep, 8x2048,
        # results/sweep_wy_bwd_h200.json)
        "wy_bwd": (_wy_bwd_kernel, {**common, "BV": 64, "BKB": 64}, 4, 1),
    })


def qdo_outside(G: int) -> bool:
    """Whether the state gradient's q term ``Σ_g (γ⊙q_g)ᵀ do_g`` is computed per chunk in parallel
    (``_dv_local_kernel``, one fp32 [K, V] per chunk and KV head) rather than in the sequential chain of
    ``_state_bwd_kernel`` (G products per chunk there). GQA only: with one query head the chain's single
    product costs less than the buffer's traffic."""
    return G > 1


_SIDE: dict = {}


def _side_stream(device: torch.device):
    """One extra CUDA stream per device (None off CUDA: the interpreter runs everything in order)."""
    if device.type != "cuda":
        return None
    if device not in _SIDE:
        _SIDE[device] = torch.cuda.Stream(device)
    return _SIDE[device]


def chunk_gated_delta_rule_bwd(q, k, v, g, beta, scale, initial_state, do, dht, cu_seqlens, tm=None):
    """Gradients w.r.t. ``(q, k, v, g, beta, initial_state)`` (the last ``None`` without an initial state),
    each in its input's dtype. Inputs as the forward's, ``do`` like the output, ``dht`` like the final state or
    None; ``tm`` the forward's T (recomputed when None)."""
    B, T = q.shape[:2]
    L = Layout(q, v, cu_seqlens)
    H, HQ, G, K, V, ieee, dev = L.H, L.HQ, L.G, L.K, L.V, L.ieee, L.device
    qf, kf, vf, gf, bf, dof = Layout.flat(q, k, v, g, beta, do)
    gcum, w, u, tm = prepare(L, kf, vf, gf, bf, tm)
    # The forward's states are recomputed on a side stream while dv_local and the backward state kernel run:
    # neither needs them, and at long T with few sequences each sequential kernel alone leaves SMs idle.
    side = _side_stream(dev)
    if side is not None:
        main = torch.cuda.current_stream(dev)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            hs, v_new, _ = states(L, kf, w, u, gcum, initial_state, False)
        hs.record_stream(main)  # allocated on the side stream, used and freed on the main one
        v_new.record_stream(main)
    else:
        hs, v_new, _ = states(L, kf, w, u, gcum, initial_state, False)
    f32 = torch.float32
    S = launch_settings(H, G, K, V, ieee, L.N * H, dev)
    tables = (L.chunk_indices, L.cu_seqlens, L.chunk_offsets)

    # Pᵀdo, then dΔ in place; only ever a dot operand afterwards, so kept in the dots' dtype
    dvl = torch.empty(L.tokens, H, V, dtype=f32 if ieee else v.dtype, device=dev)
    # the q term of the state gradient per chunk (GQA: see qdo_outside)
    dql = torch.empty(max(L.NC, 1), H, K, V, dtype=f32, device=dev) if S["dv_local"][1]["QDO"] else dvl
    if L.NC:
        fn, c, warps, stages = S["dv_local"]
        fn[(cdiv(V, c["BV"]), L.NC, H)](qf, kf, gcum, dof, dvl, dql, *tables, scale, **c,
                                        num_warps=warps, num_stages=stages)

    dhs = torch.empty_like(hs)
    ddl = dvl  # dΔ = Pᵀdo + K̃ dh₁ overwrites Pᵀdo in place: each element is read, then written, by one program
    dh0 = torch.empty(L.N, H, K, V, dtype=initial_state.dtype, device=dev) if initial_state is not None else None
    dht = dht.contiguous() if dht is not None else None
    fn, c, warps, stages = S["state_bwd"]
    fn[(cdiv(V, c["BV"]), L.N * H)](
        qf, kf, w, gcum, dof, dvl, dql, dhs, ddl, dht if dht is not None else hs, dh0 if dh0 is not None else hs,
        L.cu_seqlens, L.chunk_offsets, scale, **{**c, "USE_DHT": dht is not None, "STORE_DH0": dh0 is not None},
        num_warps=warps, num_stages=stages)

    if side is not None:
        main.wait_stream(side)
    dq = torch.empty_like(qf)
    dk = torch.empty_like(kf)
    dv = torch.empty_like(vf)
    dbeta = torch.empty(L.tokens, H, dtype=f32, device=dev)
    dg = torch.empty(L.tokens, H, dtype=f32, device=dev)
    if L.NC:
        dkq = torch.empty(L.tokens, HQ, K, dtype=f32, device=dev)
        dgq = torch.empty(L.tokens, HQ, dtype=f32, device=dev)
        fn, c, warps, stages = S["dqk"]
        fn[(L.NC, HQ)](qf, kf, v_new, gcum, hs, dof, dq, dkq, dgq, *tables, scale, **c, num_warps=warps, num_stages=stages)
        fn, c, warps, stages = S["wy_bwd"]
        fn[(L.NC, H)](kf, vf, bf, gcum, tm, v_new, hs, dhs, ddl, dkq, dgq, dk, dv, dbeta, dg, *tables, **c,
                      num_warps=warps, num_stages=stages)
    return (dq.view(q.shape), dk.view(k.shape), dv.view(v.shape), dg.view(g.shape).to(g.dtype),
            dbeta.view(beta.shape).to(beta.dtype), dh0)

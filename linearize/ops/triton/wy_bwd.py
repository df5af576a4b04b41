"""Backward stage 4, per (chunk, KV head): through ``K̃``, ``γ_C``, ``Δ = U − W h₀``, ``T`` and ``A``; sums the
query heads' shares of stage 3 and writes ``dk``, ``dv``, ``dβ`` and ``dg`` (a reverse cumsum in the chunk)."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .layout import BT, Layout, chunk_at
from .settings import block_k, frozen
from .tiles import log_decay, mm


@triton.jit
def _wy_bwd_kernel(
    k, v, beta, gcum, tm, v_new, hs, dhs, ddl, dkq, dgq, dk, dv, dbeta, dg,
    chunk_indices, cu_seqlens, chunk_offsets,
    H: tl.constexpr, G: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, BKB: tl.constexpr, IEEE: tl.constexpr,
    USE_G: tl.constexpr = True,
):
    """Two passes over one chunk, each holding only (BT, BT) and (BT, BKB|BV) tiles (K in blocks of BKB).

    The gradient reaching A needs no K-sized term: with ``dU = dΔ`` and ``dW = −dΔ h₀ᵀ``,
    ``Tᵀ (dU Uᵀ + dW Wᵀ) = Tᵀ dΔ (U − W h₀)ᵀ = Tᵀ dΔ Δᵀ``, since ``Δ = U − W h₀``. So:
    1. over V blocks, through U = T(βv): dv, the v-part of dβ, and ``Tᵀ dΔ Δᵀ`` (then dA ⊙ D, held);
    2. per K block, everything of dk at once: through K̃ (``Δ dh₁ᵀ``) and W (``Tᵀ (−dΔ h₀ᵀ)``), through A
       (``dA ⊙ D`` times k, both ways), plus the query heads' shares from ``dkq``; the log-decay gradient
       through A comes from the same products (row and column sums of ``dA ⊙ D ⊙ β k kᵀ``);
    then dg as an in-chunk reverse cumsum (none without a decay, ``USE_G`` False)."""
    i_t, i_h = tl.program_id(0), tl.program_id(1)
    HQ: tl.constexpr = H * G
    bos, T, boh, i_c = chunk_at(chunk_indices, cu_seqlens, chunk_offsets, i_t)
    o_r = tl.arange(0, BT)
    o_t = i_c * BT + o_r
    m_t = o_t < T
    row = bos + o_t
    p_state = ((boh + i_c) * H + i_h) * K * V

    b_beta = tl.load(beta + row * H + i_h, mask=m_t, other=0.0).to(tl.float32)
    b_g = log_decay(gcum + row * H + i_h, m_t, USE_G)
    last = tl.minimum(i_c * BT + BT, T) - 1
    g_last = log_decay(gcum + (bos + last) * H + i_h, None, USE_G)
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
        b_ttdu = mm(b_tt, b_dd, ref, IEEE)  # Tᵀ dU
        tl.store(dv + p_tv, (b_beta[:, None] * b_ttdu).to(dv.dtype.element_ty), mask=m_tv)
        b_dbeta += tl.sum(b_ttdu * b_v.to(tl.float32), axis=1)
        acc_da += mm(b_ttdu, tl.trans(b_dl), ref, IEEE)
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
            acc_dkt += mm(b_dl, tl.trans(b_dh), ref, IEEE)
            acc_dw -= mm(b_dd, tl.trans(b_h), ref, IEEE)
            if USE_G:
                hdh += tl.sum(tl.sum(b_h.to(tl.float32) * b_dh.to(tl.float32), axis=1), axis=0)
        b_k = tl.load(k + row[:, None] * (H * K) + i_h * K + o_k[None, :], mask=m_tk, other=0.0).to(tl.float32)
        b_ttdw = mm(b_tt, acc_dw, ref, IEEE)  # Tᵀ dW
        ktw += tl.sum(b_ttdw * b_k, axis=1)
        if USE_G:
            de += tl.sum(acc_dkt * b_k, axis=1) * e
        b_dkb = mm(b_ds, b_k, ref, IEEE)  # (dA ⊙ D) k
        b_dka = mm(tl.trans(b_ds), b_k * b_beta[:, None], ref, IEEE)  # (dA ⊙ D)ᵀ (β k)
        s_dkb = tl.sum(b_dkb * b_k, axis=1)
        b_dbeta += s_dkb
        if USE_G:
            rows_a += b_beta * s_dkb
            cols_a += tl.sum(b_dka * b_k, axis=1)
        b_dk = acc_dkt * e[:, None] + (b_beta * gam)[:, None] * b_ttdw + b_beta[:, None] * b_dkb + b_dka
        for i_g in range(G):
            b_dk += tl.load(p_dkq + i_g * K + o_k[None, :], mask=m_tk, other=0.0)
        tl.store(dk + row[:, None] * (H * K) + i_h * K + o_k[None, :], b_dk.to(dk.dtype.element_ty), mask=m_tk)

    b_dbeta += gam * ktw
    tl.store(dbeta + row * H + i_h, b_dbeta, mask=m_t)
    if USE_G:
        b_dG = rows_a - cols_a + b_beta * gam * ktw - de
        for i_g in range(G):
            b_dG += tl.load(dgq + row * HQ + i_h * G + i_g, mask=m_t, other=0.0)
        extra = tl.sum(de, axis=0) + tl.exp(g_last) * hdh  # through γ_C
        b_dG += tl.where(o_t == last, extra, 0.0)
        b_dG = tl.where(m_t, b_dG, 0.0)
        b_dg = tl.sum(b_dG, axis=0) - tl.cumsum(b_dG, axis=0) + b_dG  # G = cumsum(g) in the chunk
        tl.store(dg + row * H + i_h, b_dg, mask=m_t)


@functools.lru_cache(maxsize=256)
def wy_bwd_settings(H: int, G: int, K: int, V: int, ieee: bool) -> tuple:
    """``(kernel, constexprs, warps, stages)``: its tiles are (BT, 64) whatever K is; BV 64 for the reason
    given at :func:`prepare.prepare_settings`; 4 warps, 1 stage."""
    return frozen(_wy_bwd_kernel, {"H": H, "G": G, "K": K, "V": V, "BT": BT, "BK": block_k(K), "IEEE": ieee,
                                   "BV": 64, "BKB": 64}, 4, 1)


def chunk_bwd_wy(*, layout: Layout, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, gcum: torch.Tensor | None,
                 tm: torch.Tensor, v_new: torch.Tensor, hs: torch.Tensor, dhs: torch.Tensor, ddl: torch.Tensor,
                 dkq: torch.Tensor | None, dgq: torch.Tensor | None) -> tuple:
    """``(dk like k, dv like v, dbeta [tokens, H] fp32, dg [tokens, H] fp32)``, dg None without a decay
    (``gcum`` None). Inputs flat; ``ddl`` is dΔ (:func:`state_bwd.chunk_bwd_dh`), ``dkq``/``dgq`` the query
    heads' shares (:func:`dqk.chunk_bwd_dqk`)."""
    L = layout
    H, dev = L.H, L.device
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    dbeta = torch.empty(L.tokens, H, dtype=torch.float32, device=dev)
    dg = torch.empty(L.tokens, H, dtype=torch.float32, device=dev) if gcum is not None else None
    if L.NC:
        fn, c, warps, stages = wy_bwd_settings(H, L.G, L.K, L.V, L.ieee)
        fn[(L.NC, H)](k, v, beta, dbeta if gcum is None else gcum, tm, v_new, hs, dhs, ddl, dkq,
                      dbeta if dgq is None else dgq, dk, dv, dbeta, dbeta if dg is None else dg, L.chunk_indices,
                      L.cu_seqlens, L.chunk_offsets, **c, USE_G=gcum is not None, num_warps=warps,
                      num_stages=stages)
    return dk, dv, dbeta, dg

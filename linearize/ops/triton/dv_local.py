"""Backward stage 1, per (V block, chunk, KV head): ``Pᵀ do`` summed over the G query heads that read this
KV head (the in-chunk part of ``dΔ``); under GQA also the chunk's ``Σ_g (γ⊙q_g)ᵀ do_g`` (``qdo_outside``),
so the sequential state kernel does not run G products per chunk."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ..common import cdiv, next_pow2
from .layout import BT, Layout, chunk_at
from .settings import block_k, frozen
from .tiles import log_decay, mm


@triton.jit
def _dv_local_kernel(
    q, k, gcum, do, dvl, dql, chunk_indices, cu_seqlens, chunk_offsets, scale,
    H: tl.constexpr, G: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, QDO: tl.constexpr, IEEE: tl.constexpr,
    USE_G: tl.constexpr = True,
):
    """``Pᵀ do`` summed over the G query heads of this KV head; with ``QDO`` also the chunk's share of the
    state gradient, ``Σ_g (γ⊙q_g)ᵀ do_g · scale`` ([K, V] per chunk, fp32, into ``dql``), which the state
    kernel then reads instead of running G products in its sequential chain."""
    i_v, i_t, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    HQ: tl.constexpr = H * G
    bos, T, boh, i_c = chunk_at(chunk_indices, cu_seqlens, chunk_offsets, i_t)
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
    b_g = log_decay(gcum + row * H + i_h, m_t, USE_G)
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
        p_t = mm(b_k, tl.trans(b_q), b_k, IEEE) * dec_t * scale  # Pᵀ
        acc += mm(p_t, b_do, b_k, IEEE)
        if QDO:
            acc_h += mm(tl.trans(b_q.to(tl.float32) * gs[:, None]), b_do, b_k, IEEE)  # (γ⊙q_g)ᵀ do_g
    tl.store(dvl + row[:, None] * (H * V) + i_h * V + o_v[None, :], acc.to(dvl.dtype.element_ty), mask=m_qv)
    if QDO:
        tl.store(dql + ((boh + i_c) * H + i_h).to(tl.int64) * K * V + o_k[:, None] * V + o_v[None, :], acc_h,
                 mask=m_k[:, None] & m_v[None, :])


@functools.lru_cache(maxsize=256)
def dv_local_settings(H: int, G: int, K: int, V: int, ieee: bool, qdo: bool) -> tuple:
    """``(kernel, constexprs, warps, stages)``; ``qdo``: also the q term (:func:`settings.qdo_outside`).
    128-wide V blocks, with the q term as well."""
    BK = block_k(K)
    wide = BK > 128
    vmax = max(16, next_pow2(V))
    bv = min(128, vmax) if not wide else min(32, vmax)
    return frozen(_dv_local_kernel, {"H": H, "G": G, "K": K, "V": V, "BT": BT, "BK": BK, "IEEE": ieee, "QDO": qdo,
                                     "BV": bv}, 4, 1 if wide else 2)


def chunk_bwd_dv_local(*, layout: Layout, q: torch.Tensor, k: torch.Tensor, gcum: torch.Tensor | None, do: torch.Tensor,
                       scale: float, qdo: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(dvl [tokens, H, V], dql)``: ``Pᵀdo`` in the dots' dtype (do's, or float32 for float32 inputs: it is
    only ever a dot operand afterwards), and with ``qdo`` the q term of the state gradient per chunk,
    ``[chunks, H, K, V]`` float32 (else None). Inputs flat."""
    L = layout
    H, K, V, dev = L.H, L.K, L.V, L.device
    dvl = torch.empty(L.tokens, H, V, dtype=torch.float32 if L.ieee else do.dtype, device=dev)
    dql = torch.empty(max(L.NC, 1), H, K, V, dtype=torch.float32, device=dev) if qdo else None
    if L.NC:
        fn, c, warps, stages = dv_local_settings(H, L.G, K, V, L.ieee, qdo)
        fn[(cdiv(V, c["BV"]), L.NC, H)](q, k, dvl if gcum is None else gcum, do, dvl, dql if qdo else dvl,
                                        L.chunk_indices, L.cu_seqlens, L.chunk_offsets, scale, **c,
                                        USE_G=gcum is not None, num_warps=warps, num_stages=stages)
    return dvl, dql

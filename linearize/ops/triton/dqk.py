"""Backward stage 3, per (chunk, query head): ``dq`` and this query head's share of ``dk`` and of the
log-decay gradient (through ``P`` and ``γ ⊙ (q h₀)``); stage 4 sums the shares over the query heads."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ..common import next_pow2
from .layout import BT, Layout, chunk_at
from .settings import block_k, frozen
from .tiles import log_decay, mm


@triton.jit
def _dqk_kernel(
    q, k, v_new, gcum, hs, do, dq, dkq, dgq, chunk_indices, cu_seqlens, chunk_offsets, scale,
    H: tl.constexpr, G: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, IEEE: tl.constexpr, USE_G: tl.constexpr = True,
):
    i_t, i_hq = tl.program_id(0), tl.program_id(1)
    i_h = i_hq // G
    HQ: tl.constexpr = H * G
    bos, T, boh, i_c = chunk_at(chunk_indices, cu_seqlens, chunk_offsets, i_t)
    o_r = tl.arange(0, BT)
    m_t = i_c * BT + o_r < T
    row = bos + i_c * BT + o_r
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    m_tk = m_t[:, None] & m_k[None, :]

    b_k = tl.load(k + row[:, None] * (H * K) + i_h * K + o_k[None, :], mask=m_tk, other=0.0)
    b_qs = tl.load(q + row[:, None] * (HQ * K) + i_hq * K + o_k[None, :], mask=m_tk, other=0.0).to(tl.float32) * scale
    b_g = log_decay(gcum + row * H + i_h, m_t, USE_G)
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
        acc_dp += mm(b_do, tl.trans(b_dl), b_k, IEEE)
        acc_dqh += mm(b_do, tl.trans(b_h), b_k, IEEE)
    causal = (o_r[:, None] >= o_r[None, :]) & m_t[:, None] & m_t[None, :]  # (see _dv_local_kernel)
    decay = tl.where(causal, tl.exp(tl.where(causal, b_g[:, None] - b_g[None, :], 0.0)), 0.0)
    b_p = mm(b_qs, tl.trans(b_k), b_k, IEEE) * decay  # P
    b_dpd = acc_dp * decay  # dP ⊙ D (causal)
    gam = tl.exp(b_g)
    b_dq = acc_dqh * gam[:, None] + mm(b_dpd, b_k, b_k, IEEE)
    tl.store(dq + row[:, None] * (HQ * K) + i_hq * K + o_k[None, :], (b_dq * scale).to(dq.dtype.element_ty), mask=m_tk)
    b_dk = mm(tl.trans(b_dpd), b_qs, b_k, IEEE)
    tl.store(dkq + row[:, None] * (HQ * K) + i_hq * K + o_k[None, :], b_dk, mask=m_tk)
    if USE_G:  # the query head's share of dg (none without a decay)
        b_m = acc_dp * b_p  # ∂/∂ log D_rj
        b_dg = tl.sum(b_m, axis=1) - tl.sum(b_m, axis=0) + gam * tl.sum(acc_dqh * b_qs, axis=1)
        tl.store(dgq + row * HQ + i_hq, b_dg, mask=m_t)


@functools.lru_cache(maxsize=256)
def dqk_settings(H: int, G: int, K: int, V: int, ieee: bool) -> tuple:
    """``(kernel, constexprs, warps, stages)``: 4 warps at K ≤ 128, 8 for 256-wide keys."""
    BK = block_k(K)
    wide = BK > 128
    bv = min(64 if not wide else 32, max(16, next_pow2(V)))
    return frozen(_dqk_kernel, {"H": H, "G": G, "K": K, "V": V, "BT": BT, "BK": BK, "IEEE": ieee, "BV": bv},
                  4 if not wide else 8, 1 if wide else 2)


def chunk_bwd_dqk(*, layout: Layout, q: torch.Tensor, k: torch.Tensor, v_new: torch.Tensor,
                  gcum: torch.Tensor | None, hs: torch.Tensor, do: torch.Tensor, scale: float) -> tuple:
    """``(dq like q, dkq [tokens, HQ, K] fp32, dgq [tokens, HQ] fp32)``, the last two None when there are no
    chunks, dgq None without a decay (``gcum`` None). Inputs flat; ``hs`` and ``v_new`` the forward's states and
    Δ, every state kept."""
    L = layout
    dq = torch.empty_like(q)
    if not L.NC:
        return dq, None, None
    dkq = torch.empty(L.tokens, L.HQ, L.K, dtype=torch.float32, device=L.device)
    dgq = torch.empty(L.tokens, L.HQ, dtype=torch.float32, device=L.device) if gcum is not None else None
    fn, c, warps, stages = dqk_settings(L.H, L.G, L.K, L.V, L.ieee)
    fn[(L.NC, L.HQ)](q, k, v_new, dkq if gcum is None else gcum, hs, do, dq, dkq, dkq if dgq is None else dgq,
                     L.chunk_indices, L.cu_seqlens, L.chunk_offsets, scale, **c, USE_G=gcum is not None,
                     num_warps=warps, num_stages=stages)
    return dq, dkq, dgq

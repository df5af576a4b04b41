"""Forward stage 1, per (chunk, KV head): the in-chunk cumsum of g, ``W = T (β γ k)`` and ``U = T (β v)``.
The backward runs it again on the forward's T (W and U are not kept)."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .layout import BT, Layout, chunk_at
from .settings import block_k, frozen
from .tiles import dot


@triton.jit
def _prepare_kernel(
    k, v, g, beta, gcum, w, u, tm, chunk_indices, cu_seqlens, chunk_offsets,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, IEEE: tl.constexpr, USE_G: tl.constexpr = True,
):
    """Per (chunk, KV head), after ``_solve_kernel``: cumulative g, ``W = T (β γ k)`` and ``U = T (β v)`` as
    (BT, BT)·(BT, ·) products. The backward runs it again (W, U are not kept), on the forward's T."""
    i_t, i_h = tl.program_id(0), tl.program_id(1)
    bos, T, _, i_c = chunk_at(chunk_indices, cu_seqlens, chunk_offsets, i_t)
    o_r = tl.arange(0, BT)
    o_t = i_c * BT + o_r
    m_t = o_t < T
    row = bos + o_t
    if USE_G:
        b_g = tl.cumsum(tl.load(g + row * H + i_h, mask=m_t, other=0.0).to(tl.float32), axis=0)
        tl.store(gcum + row * H + i_h, b_g, mask=m_t)
    else:  # no decay (the deltanet target): γ = 1, every exp below folds away at compile time
        b_g = tl.zeros([BT], dtype=tl.float32)
    b_beta = tl.load(beta + row * H + i_h, mask=m_t, other=0.0).to(tl.float32)
    o_k = tl.arange(0, BK)
    m_tk = m_t[:, None] & (o_k < K)[None, :]
    b_t = tl.load(tm + row[:, None] * (H * BT) + i_h * BT + o_r[None, :], mask=m_t[:, None], other=0.0)
    b_k = tl.load(k + row[:, None] * (H * K) + i_h * K + o_k[None, :], mask=m_tk, other=0.0)

    kg = (b_k.to(tl.float32) * (b_beta * tl.exp(b_g))[:, None]).to(b_k.dtype)
    tl.store(w + row[:, None] * (H * K) + i_h * K + o_k[None, :], dot(b_t, kg, IEEE).to(w.dtype.element_ty), mask=m_tk)
    for i_v in range(tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_tv = m_t[:, None] & (o_v < V)[None, :]
        p_v = row[:, None] * (H * V) + i_h * V + o_v[None, :]
        b_v = (tl.load(v + p_v, mask=m_tv, other=0.0).to(tl.float32) * b_beta[:, None]).to(b_k.dtype)
        tl.store(u + p_v, dot(b_t, b_v, IEEE).to(u.dtype.element_ty), mask=m_tv)


@functools.lru_cache(maxsize=256)
def prepare_settings(H: int, K: int, V: int, ieee: bool) -> tuple:
    """``(kernel, constexprs, warps, stages)``. BV 64 always: at BV 32 the (64, 64) × (64, 32) product of
    U = T(βv) compiles, on Triton 3.6 for the H200, to an invalid shared-memory read (compute-sanitizer:
    "Invalid __shared__ read of size 1024"). 8 warps at K ≤ 64, where 4 spill registers."""
    BK = block_k(K)
    return frozen(_prepare_kernel, {"H": H, "K": K, "V": V, "BT": BT, "BK": BK, "IEEE": ieee, "BV": 64},
                  8 if BK <= 64 else 4, 3 if BK == 128 and not ieee else 1)


def recompute_w_u(*, layout: Layout, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor | None, beta: torch.Tensor,
                  tm: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
    """``(gcum [tokens, H] fp32, w like k, u like v)`` from T (:func:`solve_tril`). Inputs flat; ``g`` None:
    no decay, and ``gcum`` None (every later stage then runs without one)."""
    L = layout
    gcum = torch.empty(L.tokens, L.H, dtype=torch.float32, device=L.device) if g is not None else None
    w = torch.empty_like(k)
    u = torch.empty_like(v)
    if L.NC:
        fn, c, warps, stages = prepare_settings(L.H, L.K, L.V, L.ieee)
        fn[(L.NC, L.H)](k, v, beta if g is None else g, beta, beta if g is None else gcum, w, u, tm, L.chunk_indices,
                        L.cu_seqlens, L.chunk_offsets, **c, USE_G=g is not None, num_warps=warps, num_stages=stages)
    return gcum, w, u

"""Forward stage 0, per (chunk, KV head): ``T = (I + A)⁻¹`` with ``A = strictly-lower(β_r k_r·k_j γ_r/γ_j)``,
in registers (16×16 diagonal blocks by forward substitution, the rest by products). T is kept for the
backward, which skips this stage."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .layout import BT, Layout, chunk_at
from .settings import block_k, frozen
from .tiles import dot


@triton.jit
def _gram_block(k, r_a, m_a, r_b, m_b, i_h, H: tl.constexpr, K: tl.constexpr, BC: tl.constexpr,
                BKB: tl.constexpr, IEEE: tl.constexpr):
    """``k_a k_bᵀ`` for two (BC)-row groups of one KV head, rows ``r_a`` / ``r_b`` (token indices), fp32."""
    acc = tl.zeros([BC, BC], dtype=tl.float32)
    for i_k in range(tl.cdiv(K, BKB)):
        o_k = i_k * BKB + tl.arange(0, BKB)
        m_k = (o_k < K)[None, :]
        k_a = tl.load(k + r_a[:, None] * (H * K) + i_h * K + o_k[None, :], mask=m_a[:, None] & m_k, other=0.0)
        k_b = tl.load(k + r_b[:, None] * (H * K) + i_h * K + o_k[None, :], mask=m_b[:, None] & m_k, other=0.0)
        acc += dot(k_a, tl.trans(k_b), IEEE)
    return acc


@triton.jit
def _scale_block(a, g_r, g_j, b_r, m_r, STRICT: tl.constexpr):
    """``β_r a_rj γ_r/γ_j`` of one (BC, BC) block of A; ``STRICT``: a diagonal block (only j < r kept)."""
    o = tl.arange(0, a.shape[0])
    if STRICT:
        keep = m_r[:, None] & (o[:, None] > o[None, :])
    else:
        keep = m_r[:, None] & (o[None, :] >= 0)
    return tl.where(keep, a * tl.exp(tl.where(keep, g_r[:, None] - g_j[None, :], 0.0)) * b_r[:, None], 0.0)


@triton.jit
def _solve_kernel(
    k, g, beta, tm, chunk_indices, cu_seqlens, chunk_offsets,
    H: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BKB: tl.constexpr, IEEE: tl.constexpr,
    USE_G: tl.constexpr = True,
):
    """Per (chunk, KV head): ``T = (I + A)⁻¹``, ``A = strictly-lower(β_r k_r·k_j γ_r/γ_j)``, held in registers
    as 4×4 blocks of 16×16 (BC) rows: the ten lower blocks of ``k kᵀ`` as (BC, BKB)·(BKB, BC) products, then
    :func:`store_inverse`. T goes to ``tm[token, head, 0:BT]`` (the dots' dtype: it is only ever a dot
    operand). Small tiles: meant for 1–2 warps."""
    BC: tl.constexpr = BT // 4
    i_t, i_h = tl.program_id(0), tl.program_id(1)
    bos, T, _, i_c = chunk_at(chunk_indices, cu_seqlens, chunk_offsets, i_t)
    o_c = tl.arange(0, BC)
    t0 = i_c * BT + o_c
    t1, t2, t3 = t0 + BC, t0 + 2 * BC, t0 + 3 * BC
    m0, m1, m2, m3 = t0 < T, t1 < T, t2 < T, t3 < T
    r0, r1, r2, r3 = bos + t0, bos + t1, bos + t2, bos + t3
    if USE_G:  # log-decay cumulated over the chunk, 16 rows at a time
        x0 = tl.load(g + r0 * H + i_h, mask=m0, other=0.0).to(tl.float32)
        x1 = tl.load(g + r1 * H + i_h, mask=m1, other=0.0).to(tl.float32)
        x2 = tl.load(g + r2 * H + i_h, mask=m2, other=0.0).to(tl.float32)
        x3 = tl.load(g + r3 * H + i_h, mask=m3, other=0.0).to(tl.float32)
        g0 = tl.cumsum(x0, axis=0)
        g1 = tl.cumsum(x1, axis=0) + tl.sum(x0, axis=0)
        g2 = tl.cumsum(x2, axis=0) + tl.sum(x0, axis=0) + tl.sum(x1, axis=0)
        g3 = tl.cumsum(x3, axis=0) + tl.sum(x0, axis=0) + tl.sum(x1, axis=0) + tl.sum(x2, axis=0)
    else:  # no decay (the deltanet target): the exps of _scale_block fold away at compile time
        g0 = tl.zeros([BC], dtype=tl.float32)
        g1, g2, g3 = g0, g0, g0
    b0 = tl.load(beta + r0 * H + i_h, mask=m0, other=0.0).to(tl.float32)
    b1 = tl.load(beta + r1 * H + i_h, mask=m1, other=0.0).to(tl.float32)
    b2 = tl.load(beta + r2 * H + i_h, mask=m2, other=0.0).to(tl.float32)
    b3 = tl.load(beta + r3 * H + i_h, mask=m3, other=0.0).to(tl.float32)

    A00 = _scale_block(_gram_block(k, r0, m0, r0, m0, i_h, H, K, BC, BKB, IEEE), g0, g0, b0, m0, True)
    A11 = _scale_block(_gram_block(k, r1, m1, r1, m1, i_h, H, K, BC, BKB, IEEE), g1, g1, b1, m1, True)
    A22 = _scale_block(_gram_block(k, r2, m2, r2, m2, i_h, H, K, BC, BKB, IEEE), g2, g2, b2, m2, True)
    A33 = _scale_block(_gram_block(k, r3, m3, r3, m3, i_h, H, K, BC, BKB, IEEE), g3, g3, b3, m3, True)
    A10 = _scale_block(_gram_block(k, r1, m1, r0, m0, i_h, H, K, BC, BKB, IEEE), g1, g0, b1, m1, False)
    A20 = _scale_block(_gram_block(k, r2, m2, r0, m0, i_h, H, K, BC, BKB, IEEE), g2, g0, b2, m2, False)
    A21 = _scale_block(_gram_block(k, r2, m2, r1, m1, i_h, H, K, BC, BKB, IEEE), g2, g1, b2, m2, False)
    A30 = _scale_block(_gram_block(k, r3, m3, r0, m0, i_h, H, K, BC, BKB, IEEE), g3, g0, b3, m3, False)
    A31 = _scale_block(_gram_block(k, r3, m3, r1, m1, i_h, H, K, BC, BKB, IEEE), g3, g1, b3, m3, False)
    A32 = _scale_block(_gram_block(k, r3, m3, r2, m2, i_h, H, K, BC, BKB, IEEE), g3, g2, b3, m3, False)

    store_inverse(tm, A00, A11, A22, A33, A10, A20, A21, A30, A31, A32, r0, r1, r2, r3, m0, m1, m2, m3, i_h, H, BT,
                  IEEE)


@triton.jit
def store_inverse(tm, A00, A11, A22, A33, A10, A20, A21, A30, A31, A32, r0, r1, r2, r3, m0, m1, m2, m3, i_h,
                  H: tl.constexpr, BT: tl.constexpr, IEEE: tl.constexpr):
    """``T = (I + A)⁻¹`` of a strictly lower (BT, BT) A held as its ten lower (BT/4)² blocks ``A_ij``, stored to
    ``tm[token, head, 0:BT]`` (rows ``r0 … r3`` of the four bands, ``m0 … m3`` inside the document): the four
    diagonal blocks by forward substitution side by side (row i of T_dd = e_i − Σ_{j<i} A_ij T_j, rows taken
    out of the register tile with a masked sum); the off-diagonal blocks from T_ij = −T_ii Σ_{j≤m<i} A_im T_mj.
    Shared by the GDN and KDA solves."""
    BC: tl.constexpr = BT // 4
    o_c = tl.arange(0, BC)
    eye = o_c[:, None] == o_c[None, :]
    T00 = tl.where(eye, 1.0, 0.0)
    T11 = tl.where(eye, 1.0, 0.0)
    T22 = tl.where(eye, 1.0, 0.0)
    T33 = tl.where(eye, 1.0, 0.0)
    for i in range(1, BC):  # four independent chains per step
        sel = o_c[:, None] == i
        a0 = tl.sum(tl.where(sel, A00, 0.0), axis=0)  # row i of A_dd, as a vector over j
        a1 = tl.sum(tl.where(sel, A11, 0.0), axis=0)
        a2 = tl.sum(tl.where(sel, A22, 0.0), axis=0)
        a3 = tl.sum(tl.where(sel, A33, 0.0), axis=0)
        T00 = tl.where(sel, T00 - tl.sum(a0[:, None] * T00, axis=0)[None, :], T00)
        T11 = tl.where(sel, T11 - tl.sum(a1[:, None] * T11, axis=0)[None, :], T11)
        T22 = tl.where(sel, T22 - tl.sum(a2[:, None] * T22, axis=0)[None, :], T22)
        T33 = tl.where(sel, T33 - tl.sum(a3[:, None] * T33, axis=0)[None, :], T33)
    # off-diagonal blocks (tf32 products for bf16/fp16 inputs, IEEE for fp32)
    T10 = -dot(T11, dot(A10, T00, IEEE), IEEE)
    T21 = -dot(T22, dot(A21, T11, IEEE), IEEE)
    T20 = -dot(T22, dot(A20, T00, IEEE) + dot(A21, T10, IEEE), IEEE)
    T32 = -dot(T33, dot(A32, T22, IEEE), IEEE)
    T31 = -dot(T33, dot(A31, T11, IEEE) + dot(A32, T21, IEEE), IEEE)
    T30 = -dot(T33, dot(A30, T00, IEEE) + dot(A31, T10, IEEE) + dot(A32, T20, IEEE), IEEE)
    zero = tl.zeros([BC, BC], dtype=tl.float32)
    _store_t_row(tm, T00, zero, zero, zero, r0, m0, i_h, H, BT, BC)
    _store_t_row(tm, T10, T11, zero, zero, r1, m1, i_h, H, BT, BC)
    _store_t_row(tm, T20, T21, T22, zero, r2, m2, i_h, H, BT, BC)
    _store_t_row(tm, T30, T31, T32, T33, r3, m3, i_h, H, BT, BC)


@triton.jit
def _store_t_row(tm, t0, t1, t2, t3, rows, m_rows, i_h, H: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    """Store one 16-row band of T (its four 16×16 blocks; ``rows`` are token indices) to ``tm[token, head, 0:BT]``."""
    o_c = tl.arange(0, BC)
    m = m_rows[:, None] & (o_c < BC)[None, :]
    base = tm + rows[:, None] * (H * BT) + i_h * BT + o_c[None, :]
    ty = tm.dtype.element_ty
    tl.store(base, t0.to(ty), mask=m)
    tl.store(base + BC, t1.to(ty), mask=m)
    tl.store(base + 2 * BC, t2.to(ty), mask=m)
    tl.store(base + 3 * BC, t3.to(ty), mask=m)


@functools.lru_cache(maxsize=256)
def solve_settings(H: int, K: int, ieee: bool) -> tuple:
    """``(kernel, constexprs, warps, stages)``. 16×16 register tiles: one warp (8 values per thread of a
    16×16 fp32 tile), K blocks of up to 128."""
    return frozen(_solve_kernel, {"H": H, "K": K, "BT": BT, "BKB": min(block_k(K), 128), "IEEE": ieee}, 1, 1)


def solve_tril(*, layout: Layout, k: torch.Tensor, g: torch.Tensor | None, beta: torch.Tensor) -> torch.Tensor:
    """T of every chunk, ``[tokens, H, BT]``: only ever a dot operand, so kept in the dots' dtype (k's, or
    float32 for float32 inputs). Inputs flat (``Layout.flat``); ``g`` None: no decay."""
    L = layout
    tm = torch.empty(L.tokens, L.H, BT, dtype=torch.float32 if L.ieee else k.dtype, device=L.device)
    if L.NC:
        fn, c, warps, stages = solve_settings(L.H, L.K, L.ieee)
        fn[(L.NC, L.H)](k, beta if g is None else g, beta, tm, L.chunk_indices, L.cu_seqlens, L.chunk_offsets,
                        **c, USE_G=g is not None, num_warps=warps, num_stages=stages)
    return tm

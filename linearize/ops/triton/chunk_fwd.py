"""Triton forward of the chunkwise gated delta rule (chunk 64, WY/UT form), GQA-native and varlen.

The math is the one of ``linearize/ops/chunk.py`` (read its docstring first); four kernels:

0. ``_solve_kernel``    per (chunk, KV head): ``A = strictly-lower(β_r k_r·k_j γ_r/γ_j)`` and ``T = (I + A)⁻¹``
   in registers (16×16 diagonal blocks by forward substitution, the rest by products); T is kept for the backward.
1. ``_prepare_kernel``  per (chunk, KV head): in-chunk cumsum of g, ``W = T (β γ k)`` and ``U = T (β v)``.
2. ``_state_kernel``    per (sequence, KV head, V block): the only sequential part — carries the fp32
   state across chunks, writes ``Δ = U − W h`` and the state entering each chunk (in the forward at
   K = 128, of every 8th chunk only: ``output_group``).
3. ``_output_kernel``   per (chunk or group of 8 chunks, query head, V block):
   ``o = γ (q h) + (q kᵀ ⊙ γ_r/γ_j)_causal Δ``, carrying h from chunk to chunk on Δ within a group;
   query head ``h_q`` reads KV head ``h_q // G``, so K/V are never repeated in memory.

Every sequence layout is handled as packed documents: a dense ``[B, T]`` batch is the packing of B
equal-length documents, so one code path serves both.
"""

from __future__ import annotations

import functools
from types import MappingProxyType

import torch
import triton
import triton.language as tl

from ..common import TRITON_MAX_K, LastTensorMemo, cdiv, next_pow2

BT = 64  # chunk size


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _chunk(chunk_indices, cu_seqlens, chunk_offsets, i_t):
    """(bos, T, boh, i_c): start token and length of the chunk's sequence, its first chunk, the chunk's index in it."""
    i_n = tl.load(chunk_indices + i_t * 2).to(tl.int64)
    i_c = tl.load(chunk_indices + i_t * 2 + 1).to(tl.int64)
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    T = tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos
    boh = tl.load(chunk_offsets + i_n).to(tl.int64)
    return bos, T, boh, i_c


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
        acc += _dot(k_a, tl.trans(k_b), IEEE)
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
):
    """Per (chunk, KV head): ``T = (I + A)⁻¹``, ``A = strictly-lower(β_r k_r·k_j γ_r/γ_j)``, held in registers
    as 4×4 blocks of 16×16 (BC) rows: the ten lower blocks of ``k kᵀ`` as (BC, BKB)·(BKB, BC) products; the
    four diagonal blocks inverted by forward substitution side by side (row i of T_dd = e_i − Σ_{j<i} A_ij T_j,
    rows taken out of the register tile with a masked sum); the off-diagonal blocks from
    T_ij = −T_ii Σ_{j≤m<i} A_im T_mj. T goes to ``tm[token, head, 0:BT]`` (the dots' dtype: it is only ever a
    dot operand). Small tiles: meant for 1–2 warps."""
    BC: tl.constexpr = BT // 4
    i_t, i_h = tl.program_id(0), tl.program_id(1)
    bos, T, _, i_c = _chunk(chunk_indices, cu_seqlens, chunk_offsets, i_t)
    o_c = tl.arange(0, BC)
    t0 = i_c * BT + o_c
    t1, t2, t3 = t0 + BC, t0 + 2 * BC, t0 + 3 * BC
    m0, m1, m2, m3 = t0 < T, t1 < T, t2 < T, t3 < T
    r0, r1, r2, r3 = bos + t0, bos + t1, bos + t2, bos + t3
    # log-decay cumulated over the chunk, 16 rows at a time
    x0 = tl.load(g + r0 * H + i_h, mask=m0, other=0.0).to(tl.float32)
    x1 = tl.load(g + r1 * H + i_h, mask=m1, other=0.0).to(tl.float32)
    x2 = tl.load(g + r2 * H + i_h, mask=m2, other=0.0).to(tl.float32)
    x3 = tl.load(g + r3 * H + i_h, mask=m3, other=0.0).to(tl.float32)
    g0 = tl.cumsum(x0, axis=0)
    g1 = tl.cumsum(x1, axis=0) + tl.sum(x0, axis=0)
    g2 = tl.cumsum(x2, axis=0) + tl.sum(x0, axis=0) + tl.sum(x1, axis=0)
    g3 = tl.cumsum(x3, axis=0) + tl.sum(x0, axis=0) + tl.sum(x1, axis=0) + tl.sum(x2, axis=0)
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
    T10 = -_dot(T11, _dot(A10, T00, IEEE), IEEE)
    T21 = -_dot(T22, _dot(A21, T11, IEEE), IEEE)
    T20 = -_dot(T22, _dot(A20, T00, IEEE) + _dot(A21, T10, IEEE), IEEE)
    T32 = -_dot(T33, _dot(A32, T22, IEEE), IEEE)
    T31 = -_dot(T33, _dot(A31, T11, IEEE) + _dot(A32, T21, IEEE), IEEE)
    T30 = -_dot(T33, _dot(A30, T00, IEEE) + _dot(A31, T10, IEEE) + _dot(A32, T20, IEEE), IEEE)
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


@triton.jit
def _prepare_kernel(
    k, v, g, beta, gcum, w, u, tm, chunk_indices, cu_seqlens, chunk_offsets,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, IEEE: tl.constexpr,
):
    """Per (chunk, KV head), after ``_solve_kernel``: cumulative g, ``W = T (β γ k)`` and ``U = T (β v)`` as
    (BT, BT)·(BT, ·) products. The backward runs it again (W, U are not kept), on the forward's T."""
    i_t, i_h = tl.program_id(0), tl.program_id(1)
    bos, T, _, i_c = _chunk(chunk_indices, cu_seqlens, chunk_offsets, i_t)
    o_r = tl.arange(0, BT)
    o_t = i_c * BT + o_r
    m_t = o_t < T
    row = bos + o_t
    b_g = tl.cumsum(tl.load(g + row * H + i_h, mask=m_t, other=0.0).to(tl.float32), axis=0)
    tl.store(gcum + row * H + i_h, b_g, mask=m_t)
    b_beta = tl.load(beta + row * H + i_h, mask=m_t, other=0.0).to(tl.float32)
    o_k = tl.arange(0, BK)
    m_tk = m_t[:, None] & (o_k < K)[None, :]
    b_t = tl.load(tm + row[:, None] * (H * BT) + i_h * BT + o_r[None, :], mask=m_t[:, None], other=0.0)
    b_k = tl.load(k + row[:, None] * (H * K) + i_h * K + o_k[None, :], mask=m_tk, other=0.0)

    kg = (b_k.to(tl.float32) * (b_beta * tl.exp(b_g))[:, None]).to(b_k.dtype)
    tl.store(w + row[:, None] * (H * K) + i_h * K + o_k[None, :], _dot(b_t, kg, IEEE).to(w.dtype.element_ty), mask=m_tk)
    for i_v in range(tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_tv = m_t[:, None] & (o_v < V)[None, :]
        p_v = row[:, None] * (H * V) + i_h * V + o_v[None, :]
        b_v = (tl.load(v + p_v, mask=m_tv, other=0.0).to(tl.float32) * b_beta[:, None]).to(b_k.dtype)
        tl.store(u + p_v, _dot(b_t, b_v, IEEE).to(u.dtype.element_ty), mask=m_tv)


@triton.jit
def _sequence(cu_seqlens, chunk_offsets, i_n):
    """(bos, T, boh): start token and length of sequence ``i_n`` and the index of its first chunk."""
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    T = tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos
    boh = tl.load(chunk_offsets + i_n).to(tl.int64)
    return bos, T, boh


@triton.jit
def _slot(boh, i_n, i_c, EVERY: tl.constexpr):
    """Row of ``hs`` holding the state entering chunk ``i_c`` (a multiple of ``EVERY``) of sequence ``i_n``,
    whose first chunk is chunk ``boh`` overall: that chunk's row when every state is kept, else
    ``boh // E + i_n + i_c // E``, which rises within a sequence and starts past the previous sequence's last
    row (``(boh + c) // E + 1 ≥ boh // E + ⌈c / E⌉`` for its c chunks); ``n_slots(NC, N, E)`` rows in all."""
    if EVERY == 1:
        return boh + i_c
    else:
        return boh // EVERY + i_n + i_c // EVERY


def n_slots(NC: int, N: int, every: int) -> int:
    """Rows of ``hs`` for ``NC`` chunks in ``N`` sequences, one state kept per ``every`` chunks (``_slot``)."""
    return max(NC, 1) if every == 1 else NC // every + N + 1


@triton.jit
def _kv_load(p, kb, o_v, m_v, K: tl.constexpr, V: tl.constexpr, KB: tl.constexpr):
    """Rows ``kb·KB …`` (a K block) and columns ``o_v`` of a row-major [K, V] state at ``p``, as fp32."""
    o_k = kb * KB + tl.arange(0, KB)
    return tl.load(p + o_k[:, None] * V + o_v[None, :], mask=(o_k < K)[:, None] & m_v[None, :], other=0.0).to(tl.float32)


@triton.jit
def _kv_store(p, b, kb, o_v, m_v, K: tl.constexpr, V: tl.constexpr, KB: tl.constexpr):
    o_k = kb * KB + tl.arange(0, KB)
    tl.store(p + o_k[:, None] * V + o_v[None, :], b.to(p.dtype.element_ty), mask=(o_k < K)[:, None] & m_v[None, :])


@triton.jit
def _rows_dot(x, stride, o_r, m_r, kb, b, K: tl.constexpr, KB: tl.constexpr, IEEE: tl.constexpr):
    """``x[o_r, K block kb] @ b`` (fp32): x a row-major [rows, stride] tile pointer, b a fp32 (KB, ·) tile."""
    o_k = kb * KB + tl.arange(0, KB)
    xb = tl.load(x + o_r[:, None] * stride + o_k[None, :], mask=m_r[:, None] & (o_k < K)[None, :], other=0.0)
    if IEEE:
        return tl.dot(xb.to(tl.float32), b, input_precision="ieee")
    else:
        return tl.dot(xb, b.to(xb.dtype))


@triton.jit
def _cols_dot(x, stride, o_r, m_r, kb, b, K: tl.constexpr, KB: tl.constexpr, IEEE: tl.constexpr):
    """``x[o_r, K block kb]ᵀ @ b`` (fp32), the transposed tile loaded directly; b a (rows, ·) tile."""
    o_k = kb * KB + tl.arange(0, KB)
    xt = tl.load(x + o_k[:, None] + o_r[None, :] * stride, mask=(o_k < K)[:, None] & m_r[None, :], other=0.0)
    if IEEE:
        return tl.dot(xt.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(xt, b.to(xt.dtype))


@triton.jit
def _blocks_load(p, b1, b2, b3, b4, o_v, m_v, K: tl.constexpr, V: tl.constexpr, KB: tl.constexpr):
    """The state kernels hold a [K, BV] tile as four (KB, BV) fp32 K blocks; the blocks past K are never
    touched. This adds the row-major [K, V] state at ``p`` (columns ``o_v``) to ``b1 … b4``."""
    NKB: tl.constexpr = (K + KB - 1) // KB
    b1 += _kv_load(p, 0, o_v, m_v, K, V, KB)
    if NKB > 1:
        b2 += _kv_load(p, 1, o_v, m_v, K, V, KB)
    if NKB > 2:
        b3 += _kv_load(p, 2, o_v, m_v, K, V, KB)
    if NKB > 3:
        b4 += _kv_load(p, 3, o_v, m_v, K, V, KB)
    return b1, b2, b3, b4


@triton.jit
def _blocks_start(p, USE: tl.constexpr, o_v, m_v, K: tl.constexpr, V: tl.constexpr, KB: tl.constexpr, BV: tl.constexpr):
    """The four (KB, BV) fp32 K blocks a state kernel starts from: zeros, plus the [K, V] state at ``p`` if ``USE``."""
    b1 = tl.zeros([KB, BV], dtype=tl.float32)
    b2 = tl.zeros([KB, BV], dtype=tl.float32)
    b3 = tl.zeros([KB, BV], dtype=tl.float32)
    b4 = tl.zeros([KB, BV], dtype=tl.float32)
    if USE:
        b1, b2, b3, b4 = _blocks_load(p, b1, b2, b3, b4, o_v, m_v, K, V, KB)
    return b1, b2, b3, b4


@triton.jit
def _blocks_store(p, b1, b2, b3, b4, o_v, m_v, K: tl.constexpr, V: tl.constexpr, KB: tl.constexpr):
    """Store the K blocks ``b1 … b4`` as columns ``o_v`` of the row-major [K, V] state at ``p``."""
    NKB: tl.constexpr = (K + KB - 1) // KB
    _kv_store(p, b1, 0, o_v, m_v, K, V, KB)
    if NKB > 1:
        _kv_store(p, b2, 1, o_v, m_v, K, V, KB)
    if NKB > 2:
        _kv_store(p, b3, 2, o_v, m_v, K, V, KB)
    if NKB > 3:
        _kv_store(p, b4, 3, o_v, m_v, K, V, KB)


@triton.jit
def _blocks_rows_dot(x, stride, o_r, m_r, b1, b2, b3, b4, K: tl.constexpr, KB: tl.constexpr,
                     NEG: tl.constexpr, IEEE: tl.constexpr):
    """``±x[o_r, :K] @ [b1; …; b4]`` (fp32; ``NEG``: minus), one (BT, KB)·(KB, ·) product per K block."""
    NKB: tl.constexpr = (K + KB - 1) // KB
    acc = _rows_dot(x, stride, o_r, m_r, 0, b1, K, KB, IEEE)
    if NEG:
        acc = -acc
    if NKB > 1:
        acc = _rows_acc(acc, x, stride, o_r, m_r, 1, b2, K, KB, NEG, IEEE)
    if NKB > 2:
        acc = _rows_acc(acc, x, stride, o_r, m_r, 2, b3, K, KB, NEG, IEEE)
    if NKB > 3:
        acc = _rows_acc(acc, x, stride, o_r, m_r, 3, b4, K, KB, NEG, IEEE)
    return acc


@triton.jit
def _rows_acc(acc, x, stride, o_r, m_r, kb, b, K: tl.constexpr, KB: tl.constexpr, NEG: tl.constexpr, IEEE: tl.constexpr):
    if NEG:
        return acc - _rows_dot(x, stride, o_r, m_r, kb, b, K, KB, IEEE)
    else:
        return acc + _rows_dot(x, stride, o_r, m_r, kb, b, K, KB, IEEE)


@triton.jit
def _blocks_update(b1, b2, b3, b4, scale, x, stride, o_r, m_r, d, K: tl.constexpr, KB: tl.constexpr,
                   SUB: tl.constexpr, IEEE: tl.constexpr):
    """``b_kb ← scale·b_kb ± x[o_r, K block kb]ᵀ d`` for every K block (``SUB``: minus), the transposed
    tiles loaded directly."""
    NKB: tl.constexpr = (K + KB - 1) // KB
    b1 = _block_update(b1, scale, x, stride, o_r, m_r, 0, d, K, KB, SUB, IEEE)
    if NKB > 1:
        b2 = _block_update(b2, scale, x, stride, o_r, m_r, 1, d, K, KB, SUB, IEEE)
    if NKB > 2:
        b3 = _block_update(b3, scale, x, stride, o_r, m_r, 2, d, K, KB, SUB, IEEE)
    if NKB > 3:
        b4 = _block_update(b4, scale, x, stride, o_r, m_r, 3, d, K, KB, SUB, IEEE)
    return b1, b2, b3, b4


@triton.jit
def _block_update(b, scale, x, stride, o_r, m_r, kb, d, K: tl.constexpr, KB: tl.constexpr,
                  SUB: tl.constexpr, IEEE: tl.constexpr):
    if SUB:
        return b * scale - _cols_dot(x, stride, o_r, m_r, kb, d, K, KB, IEEE)
    else:
        return b * scale + _cols_dot(x, stride, o_r, m_r, kb, d, K, KB, IEEE)


@triton.jit
def _state_kernel(
    k, w, u, gcum, hs, v_new, h0, ht, cu_seqlens, chunk_offsets,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, KB: tl.constexpr, BV: tl.constexpr,
    USE_H0: tl.constexpr, STORE_HT: tl.constexpr, IEEE: tl.constexpr, EVERY: tl.constexpr,
):
    """Per (V block, sequence × KV head), over the chunks in order: store the state h entering the chunk
    (of every ``EVERY``-th chunk only, at its ``_slot``), ``Δ = U − W h``, then
    ``h ← γ_C h + Kᵀ (Δ ⊙ γ_C/γ_j)``. The [K, BV] state is held as up to four (KB, BV) fp32 blocks (K
    blocks of KB rows), so each product is (BT, KB)·(KB, BV) and the blocks update independently; the decay
    is applied to Δ's rows rather than to k. Pointers move to the sequence and the chunk first, so tile
    offsets stay 32-bit."""
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    bos, T, boh = _sequence(cu_seqlens, chunk_offsets, i_n)
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    o_r = tl.arange(0, BT)
    k += (bos * H + i_h) * K
    w += (bos * H + i_h) * K
    u += (bos * H + i_h) * V
    v_new += (bos * H + i_h) * V
    gcum += bos * H + i_h
    hs += (_slot(boh, i_n, 0, EVERY) * H + i_h) * K * V

    b_h1, b_h2, b_h3, b_h4 = _blocks_start(h0 + i_nh.to(tl.int64) * K * V, USE_H0, o_v, m_v, K, V, KB, BV)
    for i_t in range(tl.cdiv(T, BT)):
        t0 = i_t * BT
        m_t = o_r < T - t0
        # the state entering chunk i_t, for the output kernel (which carries it over the next EVERY − 1 chunks)
        if EVERY == 1:
            _blocks_store(hs + i_t * (H * K * V), b_h1, b_h2, b_h3, b_h4, o_v, m_v, K, V, KB)
        elif i_t % EVERY == 0:
            _blocks_store(hs + (i_t // EVERY) * (H * K * V), b_h1, b_h2, b_h3, b_h4, o_v, m_v, K, V, KB)
        b_d = _blocks_rows_dot(w + t0 * (H * K), H * K, o_r, m_t, b_h1, b_h2, b_h3, b_h4, K, KB, True, IEEE)  # −W h
        p_tv = o_r[:, None] * (H * V) + o_v[None, :]
        m_tv = m_t[:, None] & m_v[None, :]
        b_d += tl.load(u + t0 * (H * V) + p_tv, mask=m_tv, other=0.0).to(tl.float32)
        tl.store(v_new + t0 * (H * V) + p_tv, b_d.to(v_new.dtype.element_ty), mask=m_tv)
        g_last = tl.load(gcum + (tl.minimum(t0 + BT, T) - 1) * H)
        b_g = tl.load(gcum + t0 * H + o_r * H, mask=m_t, other=0.0)
        b_de = b_d * tl.where(m_t, tl.exp(g_last - b_g), 0.0)[:, None]  # Δ ⊙ γ_C/γ_j
        e_c = tl.exp(g_last)
        b_h1, b_h2, b_h3, b_h4 = _blocks_update(b_h1, b_h2, b_h3, b_h4, e_c, k + t0 * (H * K), H * K, o_r, m_t, b_de,
                                                K, KB, False, IEEE)  # γ_C h + Kᵀ (Δ ⊙ γ_C/γ_j)
    if STORE_HT:
        _blocks_store(ht + i_nh.to(tl.int64) * K * V, b_h1, b_h2, b_h3, b_h4, o_v, m_v, K, V, KB)


@triton.jit
def _output_kernel(
    q, k, v_new, gcum, hs, o, vm, group_indices, cu_seqlens, chunk_offsets, scale,
    H: tl.constexpr, G: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, IEEE: tl.constexpr, HAS_VM: tl.constexpr,
    E: tl.constexpr,
):
    """Per (V block, group of ``E`` consecutive chunks of one sequence, query head), chunk by chunk:
    ``o = scale·(γ (q h) + (q kᵀ ⊙ γ_r/γ_j)_causal Δ)``, plus the KV head's ``vm`` row (float32,
    ``[tokens, H, V]``) when ``HAS_VM`` — the Taylor back ``+ v̄``, added before the one rounding to o's dtype.
    Only the state entering the group's first chunk is read (the state kernel keeps one per ``E`` chunks);
    the program carries it to the next chunk itself, ``h ← γ_C h + Kᵀ (Δ ⊙ γ_C/γ_j)`` — the state kernel's
    update, on the Δ it stored — so the states cost 1/E of their traffic, and the loop lets Triton load
    the next chunk under this one's products. ``E = 1`` (``group_indices`` = the chunk table): one chunk, no
    loop, the state read in the dots' dtype."""
    i_v, i_p, i_hq = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_h = i_hq // G
    HQ: tl.constexpr = H * G
    o_r = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    if E == 1:
        bos, T, boh, i_c = _chunk(group_indices, cu_seqlens, chunk_offsets, i_p)
        o_t = i_c * BT + o_r
        m_t = o_t < T
        row = bos + o_t
        m_tv = m_t[:, None] & m_v[None, :]
        b_q = tl.load(q + row[:, None] * (HQ * K) + i_hq * K + o_k[None, :], mask=m_t[:, None] & m_k[None, :], other=0.0)
        b_k = tl.load(k + row[:, None] * (H * K) + i_h * K + o_k[None, :], mask=m_t[:, None] & m_k[None, :], other=0.0)
        b_h = tl.load(hs + ((boh + i_c) * H + i_h) * K * V + o_k[:, None] * V + o_v[None, :],
                      mask=m_k[:, None] & m_v[None, :], other=0.0)
        b_d = tl.load(v_new + row[:, None] * (H * V) + i_h * V + o_v[None, :], mask=m_tv, other=0.0)
        b_g = tl.load(gcum + row * H + i_h, mask=m_t, other=0.0)
        b_o = _chunk_output(b_q, b_k, b_h, b_d, b_g, m_t, scale, IEEE)
        if HAS_VM:
            b_o += tl.load(vm + row[:, None] * (H * V) + i_h * V + o_v[None, :], mask=m_tv, other=0.0)
        tl.store(o + row[:, None] * (HQ * V) + i_hq * V + o_v[None, :], b_o.to(o.dtype.element_ty), mask=m_tv)
    else:
        i_n = tl.load(group_indices + i_p * 2).to(tl.int64)
        c0 = tl.load(group_indices + i_p * 2 + 1).to(tl.int64) * E
        bos, T, boh = _sequence(cu_seqlens, chunk_offsets, i_n)
        q += (bos * HQ + i_hq) * K
        k += (bos * H + i_h) * K
        v_new += (bos * H + i_h) * V
        vm += (bos * H + i_h) * V
        o += (bos * HQ + i_hq) * V
        gcum += bos * H + i_h
        b_h = tl.load(hs + (_slot(boh, i_n, c0, E) * H + i_h) * K * V + o_k[:, None] * V + o_v[None, :],
                      mask=m_k[:, None] & m_v[None, :], other=0.0).to(tl.float32)
        for i_c in range(c0, tl.minimum(c0 + E, tl.cdiv(T, BT))):
            t0 = i_c * BT
            m_t = o_r < T - t0
            m_tk = m_t[:, None] & m_k[None, :]
            m_tv = m_t[:, None] & m_v[None, :]
            b_q = tl.load(q + t0 * (HQ * K) + o_r[:, None] * (HQ * K) + o_k[None, :], mask=m_tk, other=0.0)
            b_k = tl.load(k + t0 * (H * K) + o_r[:, None] * (H * K) + o_k[None, :], mask=m_tk, other=0.0)
            b_d = tl.load(v_new + t0 * (H * V) + o_r[:, None] * (H * V) + o_v[None, :], mask=m_tv, other=0.0)
            b_g = tl.load(gcum + (t0 + o_r) * H, mask=m_t, other=0.0)
            b_o = _chunk_output(b_q, b_k, b_h, b_d, b_g, m_t, scale, IEEE)
            if HAS_VM:
                b_o += tl.load(vm + t0 * (H * V) + o_r[:, None] * (H * V) + o_v[None, :], mask=m_tv, other=0.0)
            tl.store(o + t0 * (HQ * V) + o_r[:, None] * (HQ * V) + o_v[None, :], b_o.to(o.dtype.element_ty),
                     mask=m_tv)
            # the state entering the next chunk
            g_last = tl.load(gcum + (tl.minimum(t0 + BT, T) - 1) * H)
            b_de = b_d.to(tl.float32) * tl.where(m_t, tl.exp(g_last - b_g), 0.0)[:, None]
            if IEEE:
                b_h = b_h * tl.exp(g_last) + tl.dot(tl.trans(b_k.to(tl.float32)), b_de, input_precision="ieee")
            else:
                b_h = b_h * tl.exp(g_last) + tl.dot(tl.trans(b_k), b_de.to(b_k.dtype))


@triton.jit
def _chunk_output(b_q, b_k, b_h, b_d, b_g, m_t, scale, IEEE: tl.constexpr):
    """``scale·(γ (q h) + (q kᵀ ⊙ γ_r/γ_j)_causal Δ)`` of one chunk, float32: q, k (BT, BK) and Δ (BT, BV)
    tiles, the state h (BK, BV), the chunk's cumulative log-decay g, ``m_t`` its rows inside the document."""
    o_r = tl.arange(0, b_q.shape[0])
    causal = (o_r[:, None] >= o_r[None, :]) & m_t[:, None]  # rows past the document's end read g = 0
    decay = tl.where(causal, tl.exp(tl.where(causal, b_g[:, None] - b_g[None, :], 0.0)), 0.0)
    if IEEE:
        b_o = tl.dot(b_q.to(tl.float32), b_h.to(tl.float32), input_precision="ieee")
        b_A = tl.dot(b_q.to(tl.float32), tl.trans(b_k.to(tl.float32)), input_precision="ieee") * decay
        b_o = b_o * tl.exp(b_g)[:, None] + tl.dot(b_A, b_d.to(tl.float32), input_precision="ieee")
    else:
        b_o = tl.dot(b_q, b_h.to(b_q.dtype))
        b_A = tl.dot(b_q, tl.trans(b_k)) * decay
        b_o = b_o * tl.exp(b_g)[:, None] + tl.dot(b_A.to(b_d.dtype), b_d)
    return b_o * scale


def _chunk_tables(cu_seqlens: torch.Tensor) -> tuple:
    """``(chunk_indices [NC, 2] = (sequence, chunk in sequence), chunk_offsets [N+1], NC, counts, groups)``:
    ``counts`` the chunks of each sequence, on the host; ``groups`` the output kernel's group tables by group
    size, filled by ``Layout.groups``. One device→host copy of ``cu_seqlens`` (the grid size depends on
    it); the rest is vectorized."""
    dev = cu_seqlens.device
    cu = cu_seqlens.to("cpu", torch.int64)
    counts = (cu[1:] - cu[:-1] + BT - 1) // BT
    offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
    NC = int(offsets[-1])
    return _indices(counts, dev), offsets.to(dev, torch.int32), NC, counts, {}


def _indices(counts: torch.Tensor, dev) -> torch.Tensor:
    """``[Σ counts, 2]`` int32 on ``dev``: (sequence, index in sequence) of every item, ``counts`` items per
    sequence (host tensor); one row of zeros when there are none."""
    n = int(counts.sum())
    if n == 0:
        return torch.zeros(1, 2, dtype=torch.int32, device=dev)
    seq = torch.repeat_interleave(torch.arange(counts.numel()), counts)
    offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
    return torch.stack([seq, torch.arange(n) - offsets[seq]], 1).to(dev, torch.int32)


def _dense_tables(B: int, T: int, device) -> tuple:
    """The tables of B documents of length T (as ``_chunk_tables``), built without reading anything back
    from the GPU."""
    key = (B, T, str(device))
    if key not in _DENSE:
        n = cdiv(T, BT)
        cu = torch.arange(0, (B + 1) * T, T, dtype=torch.int32, device=device)
        off = torch.arange(0, (B + 1) * n, n, dtype=torch.int32, device=device) if n else torch.zeros(B + 1, dtype=torch.int32, device=device)
        _DENSE.clear()  # one shape at a time is what training and benchmarks use
        _DENSE[key] = (cu, _grid(B, n, device), off, B * n, torch.full((B,), n, dtype=torch.int64), {})
    return _DENSE[key]


def _grid(B: int, n: int, device) -> torch.Tensor:
    """``_indices`` of B sequences of n items each, made on ``device`` (no host → device copy)."""
    if B * n == 0:
        return torch.zeros(1, 2, dtype=torch.int32, device=device)
    seq = torch.arange(B, dtype=torch.int32, device=device).repeat_interleave(n)
    return torch.stack([seq, torch.arange(n, dtype=torch.int32, device=device).repeat(B)], 1)


_DENSE: dict = {}
_PACKED = LastTensorMemo()  # the tables of the last cu_seqlens: every layer passes the same one


def _block_k(K: int) -> int:
    return max(16, next_pow2(K))


def _state_bv(K: int, V: int, ieee: bool, programs: int | None, sms: int | None) -> int:
    """V block of the sequential state kernels: at most 64 (narrower for Gemma's 256-wide keys, whose
    fp32 state must fit in registers), halved (down to 16) while ``programs`` (sequence, head) pairs times
    V blocks would not reach half of the GPU's ``sms`` SMs (None off CUDA: not halved) — at long T with a
    small batch the sequential loop is the whole cost. H200 sweep (``scripts/profile_kernels.py --sweep
    state_fwd,state_bwd``, 16 heads, d=128): at 8×2048 64 is fastest (forward 115 µs against 144 at 32); at
    1×16384 16 is (255 µs against 304 at 32)."""
    bv = min(64 if _block_k(K) <= 128 else (16 if ieee else 32), max(16, next_pow2(V)))
    if programs is not None and sms is not None:
        while bv > 16 and programs * cdiv(V, bv) < sms // 2:
            bv //= 2
    return bv


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def sms_for(programs: int | None, device: torch.device | None) -> int | None:
    """The SM count ``_state_bv``'s rule reads: the device's when ``programs`` is given on CUDA, else None."""
    return _sm_count(device) if programs is not None and device is not None and device.type == "cuda" else None


def frozen(settings: dict) -> MappingProxyType:
    """A launch-settings table made read-only (the tables are cached and shared by every call)."""
    return MappingProxyType({name: (fn, MappingProxyType(c), warps, stages)
                             for name, (fn, c, warps, stages) in settings.items()})


def launch_settings(H: int, G: int, K: int, V: int, ieee: bool, programs: int | None = None,
                    device: torch.device | None = None) -> MappingProxyType:
    """``{name: (kernel, constexprs, warps, stages)}`` of the forward kernels — the one table the launchers
    and ``scripts/kernel_resources.py`` read. ``programs`` = sequences × KV heads (the state kernel's
    parallelism). Built once per distinct shape and returned read-only: the forward asks three times per call
    (``scripts/bench_host.py`` times the launcher's host side)."""
    bv = _state_bv(K, V, ieee, programs, sms_for(programs, device))
    return _launch_settings(H, G, K, V, ieee, bv, output_group(K))


@functools.lru_cache(maxsize=256)
def _launch_settings(H: int, G: int, K: int, V: int, ieee: bool, bv: int, E: int) -> MappingProxyType:
    """The table for one shape, state V block ``bv`` and output group ``E`` (chosen per call by the caller)."""
    BK = _block_k(K)
    wide = BK > 128
    vmax = max(16, next_pow2(V))
    common = dict(H=H, K=K, V=V, BT=BT, BK=BK, IEEE=ieee)
    return frozen({
        # BV 64 always: at BV 32 the (64, 64) × (64, 32) product of U = T(βv) compiles, on Triton 3.6 for
        # the H200, to an invalid shared-memory read (compute-sanitizer: "Invalid __shared__ read of size 1024")
        # 8 warps at K ≤ 64: 4 spill ~850 B of registers there (scripts/kernel_resources.py)
        # 16×16 register tiles: one warp (8 values per thread of a 16×16 fp32 tile), 128-wide K blocks
        # (H200 sweep, 8x2048: 92 µs against 143 at 2 warps, 117 at K blocks of 64)
        "solve": (_solve_kernel, {"H": H, "K": K, "BT": BT, "BKB": min(BK, 128), "IEEE": ieee}, 1, 1),
        # 3 stages at K = 128: 91 µs against 96 at 1 (H200 sweep, 8x2048)
        "prepare": (_prepare_kernel, {**common, "BV": 64}, 8 if BK <= 64 else 4, 3 if BK == 128 and not ieee else 1),
        # 4 stages: fastest at every V block in the sweep (bf16); IEEE fp32 tiles take twice the shared memory
        # (sm_90 compiles, scripts/kernel_resources.py: fp32 at 3 stages reaches 181 KB at K=128)
        "state_fwd": (_state_kernel, {"H": H, "K": K, "V": V, "BT": BT, "KB": min(BK, 64), "BV": bv, "IEEE": ieee,
                                      "USE_H0": False, "STORE_HT": False, "EVERY": 1}, 4, 1 if wide else (2 if ieee else 4)),
        # E chunks per program, the state carried between them (one kept per E chunks): see output_group.
        # One chunk: wide V blocks, fewer recomputes of q·kᵀ (146 µs at BV 128 against 168 at 64, 2x8192)
        "output": (_output_kernel, {**common, "G": G, "BV": min(128 if E == 1 and not wide else 64, vmax),
                                    "HAS_VM": False, "E": E}, 4, 1 if wide else 2),
    })


def output_group(K: int) -> int:
    """Chunks per output program (``E``). H200 sweeps of the output kernel (``scripts/profile_kernels.py
    --sweep output``, results/sweep_output_groups.json and sweep_output_groups_gqa.json): 8 where the
    [K, V] states are large next to a chunk's q, k, Δ — at K = 128, 2x8192 134.8 µs against 146 for one
    chunk per program, Llama-3-8B 2x4096 130.0 against 147.3; one at K = 64 (SmolLM2 16x2048: 66.0 against
    76.5) and for Gemma's 256-wide keys (registers)."""
    return 8 if 64 < K <= 128 else 1


class Layout:
    """The packed view every kernel works on: tokens flattened, documents given by ``cu_seqlens``."""

    def __init__(self, q, v, cu_seqlens):
        B, T, self.HQ, self.K = q.shape
        if self.K > TRITON_MAX_K:
            raise ValueError(f"the Triton backend takes key head sizes up to {TRITON_MAX_K}; got {self.K} (use backend='torch')")
        self.H, self.V = v.shape[2], v.shape[3]
        self.G = self.HQ // self.H
        self.tokens = B * T
        if cu_seqlens is None:  # a dense batch is B packed documents of length T
            tables = _dense_tables(B, T, q.device)
        else:
            def tables():
                cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
                return (cu, *_chunk_tables(cu))

            tables = _PACKED.get(cu_seqlens, tables)
        self.cu_seqlens, self.chunk_indices, self.chunk_offsets, self.NC, self._counts, self._groups = tables
        self.N = self.cu_seqlens.numel() - 1
        self.dense = cu_seqlens is None
        self.ieee = q.dtype == torch.float32
        self.BK = _block_k(self.K)
        self.device = q.device

    def groups(self, E: int) -> tuple[torch.Tensor, int]:
        """``(group_indices [NG, 2] = (sequence, group in sequence), NG)``: each sequence's chunks in groups of
        ``E`` (the last one shorter), the output kernel's grid. Built once per chunk table: on the GPU for a
        dense batch, from the host's chunk counts (one host → device copy) for packed documents."""
        if E == 1:
            return self.chunk_indices, self.NC
        if E not in self._groups:
            counts = (self._counts + E - 1) // E
            table = _grid(self.N, int(counts[0]) if self.N else 0, self.device) if self.dense else _indices(counts, self.device)
            self._groups[E] = (table, int(counts.sum()))
        return self._groups[E]

    @staticmethod
    def flat(*xs):
        """[B, T, H, D] → [B·T, H, D] and [B, T, H] → [B·T, H], contiguous."""
        return [x.contiguous().view(x.shape[0] * x.shape[1], *x.shape[2:]) for x in xs]


def prepare(L: Layout, k, v, g, beta, tm=None):
    """Kernels 0 and 1: T (solved unless ``tm``, T of an earlier call on the same inputs, is given), cumulative
    g, W and U. Inputs flat (``Layout.flat``). Returns ``(gcum, w, u, tm)``."""
    H, ieee, dev = L.H, L.ieee, L.device
    S = launch_settings(H, L.G, L.K, L.V, ieee, L.N * H, dev)
    gcum = torch.empty(L.tokens, H, dtype=torch.float32, device=dev)
    w = torch.empty_like(k)
    u = torch.empty_like(v)
    solve = tm is None
    if solve:  # T is only ever a dot operand: kept in the dots' dtype
        tm = torch.empty(L.tokens, H, BT, dtype=torch.float32 if ieee else k.dtype, device=dev)
    if L.NC:
        if solve:
            fn, c, warps, stages = S["solve"]
            fn[(L.NC, H)](k, g, beta, tm, L.chunk_indices, L.cu_seqlens, L.chunk_offsets, **c,
                          num_warps=warps, num_stages=stages)
        fn, c, warps, stages = S["prepare"]
        fn[(L.NC, H)](k, v, g, beta, gcum, w, u, tm, L.chunk_indices, L.cu_seqlens, L.chunk_offsets, **c,
                      num_warps=warps, num_stages=stages)
    return gcum, w, u, tm


def states(L: Layout, k, w, u, gcum, initial_state, output_final_state, every: int = 1):
    """Kernel 2, the sequential one: the state entering every chunk (every ``every``-th chunk: ``_slot``) and
    Δ = U − W h (and the final state). Returns ``(hs, v_new, ht)``."""
    H, K, V, ieee, dev = L.H, L.K, L.V, L.ieee, L.device
    v_new = torch.empty_like(u)
    hs = torch.empty(n_slots(L.NC, L.N, every), H, K, V, dtype=k.dtype if not ieee else torch.float32, device=dev)
    ht = torch.empty(L.N, H, K, V, dtype=torch.float32, device=dev) if output_final_state else None
    h0 = initial_state.contiguous() if initial_state is not None else None
    fn, c, warps, stages = launch_settings(H, L.G, K, V, ieee, L.N * H, dev)["state_fwd"]
    fn[(cdiv(V, c["BV"]), L.N * H)](
        k, w, u, gcum, hs, v_new, h0 if h0 is not None else hs, ht if ht is not None else hs,
        L.cu_seqlens, L.chunk_offsets,
        **{**c, "USE_H0": h0 is not None, "STORE_HT": ht is not None, "EVERY": every},
        num_warps=warps, num_stages=stages,
    )
    return hs, v_new, ht


def prepare_and_states(L: Layout, k, v, g, beta, initial_state, output_final_state, tm=None, every: int = 1):
    """``prepare`` then ``states``. Returns ``(gcum, w, u, tm, hs, v_new, ht)``."""
    gcum, w, u, tm = prepare(L, k, v, g, beta, tm)
    return (gcum, w, u, tm, *states(L, k, w, u, gcum, initial_state, output_final_state, every))


def chunk_gated_delta_rule_fwd(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, v_offset=None):
    """Host launcher. Inputs ``[B, T, H(q), D]``; returns ``(o, final_state, T)``, T = (I + A)⁻¹ of every
    chunk, ``[tokens, H, 64]`` in k's dtype (float32 for float32 inputs), for the backward. ``v_offset``
    (``[B, T, H, V]``, float32): added to every query head's output of its KV head (the Taylor back)."""
    B, T = q.shape[:2]
    L = Layout(q, v, cu_seqlens)
    q, k, v, g, beta = Layout.flat(q, k, v, g, beta)
    fn, c, warps, stages = launch_settings(L.H, L.G, L.K, L.V, L.ieee)["output"]
    gcum, _, _, tm, hs, v_new, ht = prepare_and_states(L, k, v, g, beta, initial_state, output_final_state,
                                                       every=c["E"])
    o = torch.empty(L.tokens, L.HQ, L.V, dtype=v.dtype, device=q.device)
    if L.NC:
        vm = Layout.flat(v_offset.float())[0] if v_offset is not None else o
        groups, NG = L.groups(c["E"])
        fn[(cdiv(L.V, c["BV"]), NG, L.HQ)](
            q, k, v_new, gcum, hs, o, vm, groups, L.cu_seqlens, L.chunk_offsets, scale,
            **{**c, "HAS_VM": v_offset is not None}, num_warps=warps, num_stages=stages)
    return o.view(B, T, L.HQ, L.V), ht, tm

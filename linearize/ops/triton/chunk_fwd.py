"""Triton forward of the chunkwise gated delta rule (chunk 64, WY/UT form), GQA-native and varlen.

The math is the one of ``linearize/ops/chunk.py`` (read its docstring first); three kernels:

1. ``_prepare_kernel``  per (chunk, KV head): in-chunk cumsum of g, ``A = strictly-lower(β_r k_r·k_j γ_r/γ_j)``,
   ``T = (I + A)⁻¹`` by forward substitution, ``W = T (β γ k)`` and ``U = T (β v)``.
2. ``_state_kernel``    per (sequence, KV head, V block): the only sequential part — carries the fp32
   state across chunks, writes the state entering each chunk and ``Δ = U − W h``.
3. ``_output_kernel``   per (chunk, query head, V block): ``o = γ (q h) + (q kᵀ ⊙ γ_r/γ_j)_causal Δ``;
   query head ``h_q`` reads KV head ``h_q // G``, so K/V are never repeated in memory.

Every sequence layout is handled as packed documents: a dense ``[B, T]`` batch is the packing of B
equal-length documents, so one code path serves both.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common import LastTensorMemo

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
def _sequence_tile(cu_seqlens, chunk_offsets, i_v, i_nh, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                   BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    """For the sequential state kernels, one program per (V block, sequence × KV head): the sequence's
    start, length, first chunk and chunk count, and the (BK, BV) tile of its [K, V] state."""
    i_n, i_h = i_nh // H, i_nh % H
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    T = tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos
    boh = tl.load(chunk_offsets + i_n).to(tl.int64)
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    p_state = (i_n * H + i_h) * K * V + o_k[:, None] * V + o_v[None, :]
    return i_n, i_h, bos, T, boh, tl.cdiv(T, BT), o_k, m_k, o_v, m_v, m_k[:, None] & m_v[None, :], p_state


@triton.jit
def _tile_ptrs(base, row0, T, bos, i_h, o_d, m_d, H: tl.constexpr, D: tl.constexpr, BC: tl.constexpr):
    """Pointers and mask of a (BC, len(o_d)) tile of a [tokens, H, D] tensor, rows from row0."""
    o_t = row0 + tl.arange(0, BC)
    m = (o_t < T)[:, None] & m_d[None, :]
    return base + (bos + o_t)[:, None] * (H * D) + i_h * D + o_d[None, :], m


@triton.jit
def _load_sub(k, beta, gcum, row0, T, bos, i_h, H: tl.constexpr, K: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr):
    """Rows [row0, row0 + BC) of one chunk: k (BC, BK), β (BC,), cumulative g (BC,), row mask."""
    o_t = row0 + tl.arange(0, BC)
    m_t = o_t < T
    row = bos + o_t
    o_k = tl.arange(0, BK)
    p, m = _tile_ptrs(k, row0, T, bos, i_h, o_k, o_k < K, H, K, BC)
    b_k = tl.load(p, mask=m, other=0.0)
    b_beta = tl.load(beta + row * H + i_h, mask=m_t, other=0.0).to(tl.float32)
    b_g = tl.load(gcum + row * H + i_h, mask=m_t, other=0.0)
    return b_k, b_beta, b_g


@triton.jit
def _block_A(ki, bi, gi, kj, gj, DIAG: tl.constexpr, BC: tl.constexpr, IEEE: tl.constexpr):
    """A_ij = β_r (k_r·k_s) γ_r/γ_s for rows r of block i, columns s of block j (strictly lower on the diagonal)."""
    kbi = (ki.to(tl.float32) * bi[:, None]).to(ki.dtype)
    a = _dot(kbi, tl.trans(kj), IEEE)
    o = tl.arange(0, BC)
    if DIAG:
        keep = o[:, None] > o[None, :]
        return tl.where(keep, a * tl.exp(tl.where(keep, gi[:, None] - gj[None, :], 0.0)), 0.0)
    else:
        return a * tl.exp(gi[:, None] - gj[None, :])


@triton.jit
def _inv_unit_lower(a, BC: tl.constexpr):
    """(I + a)⁻¹ for a strictly lower (BC, BC) block, one row at a time: T_i = e_i − Σ_{j<i} a_ij T_j."""
    o = tl.arange(0, BC)
    t = tl.zeros([BC, BC], dtype=tl.float32)
    for i in range(BC):
        a_i = tl.sum(tl.where(o[:, None] == i, a, 0.0), axis=0)
        t_i = tl.where(o == i, 1.0, -tl.sum(a_i[:, None] * t, axis=0))
        t = tl.where(o[:, None] == i, t_i[None, :], t)
    return t


@triton.jit
def _store_wu(w, u, v, T00, T10, T11, T20, T21, T22, T30, T31, T32, T33, kg0, kg1, kg2, kg3,
              b0, b1, b2, b3, row0, T, bos, i_h,
              H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr,
              BV: tl.constexpr, IEEE: tl.constexpr):
    """W = T (β γ k) and U = T (β v), one 16-row tile at a time."""
    dt = kg0.dtype
    if IEEE:
        kg0, kg1, kg2, kg3 = kg0.to(tl.float32), kg1.to(tl.float32), kg2.to(tl.float32), kg3.to(tl.float32)
    else:
        T00, T10, T11, T20, T21, T22 = T00.to(dt), T10.to(dt), T11.to(dt), T20.to(dt), T21.to(dt), T22.to(dt)
        T30, T31, T32, T33 = T30.to(dt), T31.to(dt), T32.to(dt), T33.to(dt)
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    w0 = _dot(T00, kg0, IEEE)
    w1 = _dot(T10, kg0, IEEE) + _dot(T11, kg1, IEEE)
    w2 = _dot(T20, kg0, IEEE) + _dot(T21, kg1, IEEE) + _dot(T22, kg2, IEEE)
    w3 = _dot(T30, kg0, IEEE) + _dot(T31, kg1, IEEE) + _dot(T32, kg2, IEEE) + _dot(T33, kg3, IEEE)
    p, m = _tile_ptrs(w, row0, T, bos, i_h, o_k, m_k, H, K, BC)
    tl.store(p, w0.to(w.dtype.element_ty), mask=m)
    p, m = _tile_ptrs(w, row0 + BC, T, bos, i_h, o_k, m_k, H, K, BC)
    tl.store(p, w1.to(w.dtype.element_ty), mask=m)
    p, m = _tile_ptrs(w, row0 + 2 * BC, T, bos, i_h, o_k, m_k, H, K, BC)
    tl.store(p, w2.to(w.dtype.element_ty), mask=m)
    p, m = _tile_ptrs(w, row0 + 3 * BC, T, bos, i_h, o_k, m_k, H, K, BC)
    tl.store(p, w3.to(w.dtype.element_ty), mask=m)
    for i_v in range(tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = o_v < V
        p0, m0 = _tile_ptrs(v, row0, T, bos, i_h, o_v, m_v, H, V, BC)
        p1, m1 = _tile_ptrs(v, row0 + BC, T, bos, i_h, o_v, m_v, H, V, BC)
        p2, m2 = _tile_ptrs(v, row0 + 2 * BC, T, bos, i_h, o_v, m_v, H, V, BC)
        p3, m3 = _tile_ptrs(v, row0 + 3 * BC, T, bos, i_h, o_v, m_v, H, V, BC)
        v0 = tl.load(p0, mask=m0, other=0.0).to(tl.float32) * b0[:, None]
        v1 = tl.load(p1, mask=m1, other=0.0).to(tl.float32) * b1[:, None]
        v2 = tl.load(p2, mask=m2, other=0.0).to(tl.float32) * b2[:, None]
        v3 = tl.load(p3, mask=m3, other=0.0).to(tl.float32) * b3[:, None]
        if not IEEE:
            v0, v1, v2, v3 = v0.to(dt), v1.to(dt), v2.to(dt), v3.to(dt)
        u0 = _dot(T00, v0, IEEE)
        u1 = _dot(T10, v0, IEEE) + _dot(T11, v1, IEEE)
        u2 = _dot(T20, v0, IEEE) + _dot(T21, v1, IEEE) + _dot(T22, v2, IEEE)
        u3 = _dot(T30, v0, IEEE) + _dot(T31, v1, IEEE) + _dot(T32, v2, IEEE) + _dot(T33, v3, IEEE)
        q0, _ = _tile_ptrs(u, row0, T, bos, i_h, o_v, m_v, H, V, BC)
        q1, _ = _tile_ptrs(u, row0 + BC, T, bos, i_h, o_v, m_v, H, V, BC)
        q2, _ = _tile_ptrs(u, row0 + 2 * BC, T, bos, i_h, o_v, m_v, H, V, BC)
        q3, _ = _tile_ptrs(u, row0 + 3 * BC, T, bos, i_h, o_v, m_v, H, V, BC)
        tl.store(q0, u0.to(u.dtype.element_ty), mask=m0)
        tl.store(q1, u1.to(u.dtype.element_ty), mask=m1)
        tl.store(q2, u2.to(u.dtype.element_ty), mask=m2)
        tl.store(q3, u3.to(u.dtype.element_ty), mask=m3)


@triton.jit
def _store_t_row(tm, t0, t1, t2, t3, row0, T, bos, i_h, H: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    """Store one 16-row band of T (its four 16×16 tiles) to ``tm[token, head, 0:BT]``."""
    o_t = row0 + tl.arange(0, BC)
    o_c = tl.arange(0, BC)
    m = (o_t < T)[:, None] & (o_c < BC)[None, :]
    base = tm + (bos + o_t)[:, None] * (H * BT) + i_h * BT + o_c[None, :]
    tl.store(base, t0, mask=m)
    tl.store(base + BC, t1, mask=m)
    tl.store(base + 2 * BC, t2, mask=m)
    tl.store(base + 3 * BC, t3, mask=m)


@triton.jit
def _prepare_kernel(
    k, v, g, beta, gcum, w, u, tm, chunk_indices, cu_seqlens, chunk_offsets,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, IEEE: tl.constexpr, STORE_T: tl.constexpr,
):
    """Per (chunk, KV head). The 64×64 solve is blocked in 16×16 tiles (BC): the four diagonal
    tiles by forward substitution, the rest from T_ij = −T_ii Σ_{j≤m<i} A_im T_mj with matrix products."""
    BC: tl.constexpr = BT // 4
    i_t, i_h = tl.program_id(0), tl.program_id(1)
    bos, T, _, i_c = _chunk(chunk_indices, cu_seqlens, chunk_offsets, i_t)
    row0 = i_c * BT
    o_t = row0 + tl.arange(0, BT)
    m_t = o_t < T
    b_g = tl.cumsum(tl.load(g + (bos + o_t) * H + i_h, mask=m_t, other=0.0).to(tl.float32), axis=0)
    tl.store(gcum + (bos + o_t) * H + i_h, b_g, mask=m_t)
    tl.debug_barrier()  # the sub-block loads below read gcum back

    k0, b0, g0 = _load_sub(k, beta, gcum, row0, T, bos, i_h, H, K, BC, BK)
    k1, b1, g1 = _load_sub(k, beta, gcum, row0 + BC, T, bos, i_h, H, K, BC, BK)
    k2, b2, g2 = _load_sub(k, beta, gcum, row0 + 2 * BC, T, bos, i_h, H, K, BC, BK)
    k3, b3, g3 = _load_sub(k, beta, gcum, row0 + 3 * BC, T, bos, i_h, H, K, BC, BK)

    T00 = _inv_unit_lower(_block_A(k0, b0, g0, k0, g0, True, BC, IEEE), BC)
    T11 = _inv_unit_lower(_block_A(k1, b1, g1, k1, g1, True, BC, IEEE), BC)
    T22 = _inv_unit_lower(_block_A(k2, b2, g2, k2, g2, True, BC, IEEE), BC)
    T33 = _inv_unit_lower(_block_A(k3, b3, g3, k3, g3, True, BC, IEEE), BC)
    A10 = _block_A(k1, b1, g1, k0, g0, False, BC, IEEE)
    A20 = _block_A(k2, b2, g2, k0, g0, False, BC, IEEE)
    A21 = _block_A(k2, b2, g2, k1, g1, False, BC, IEEE)
    A30 = _block_A(k3, b3, g3, k0, g0, False, BC, IEEE)
    A31 = _block_A(k3, b3, g3, k1, g1, False, BC, IEEE)
    A32 = _block_A(k3, b3, g3, k2, g2, False, BC, IEEE)
    # off-diagonal tiles of (I + A)^-1 in fp32 (IEEE products for fp32 inputs)
    T10 = -_dot(T11, _dot(A10, T00, IEEE), IEEE)
    T21 = -_dot(T22, _dot(A21, T11, IEEE), IEEE)
    T20 = -_dot(T22, _dot(A20, T00, IEEE) + _dot(A21, T10, IEEE), IEEE)
    T32 = -_dot(T33, _dot(A32, T22, IEEE), IEEE)
    T31 = -_dot(T33, _dot(A31, T11, IEEE) + _dot(A32, T21, IEEE), IEEE)
    T30 = -_dot(T33, _dot(A30, T00, IEEE) + _dot(A31, T10, IEEE) + _dot(A32, T20, IEEE), IEEE)

    if STORE_T:  # the backward reads T = (I + A)⁻¹ back, row by row: tm[token, head, 0:BT]
        zero = tl.zeros([BC, BC], dtype=tl.float32)
        _store_t_row(tm, T00, zero, zero, zero, row0, T, bos, i_h, H, BT, BC)
        _store_t_row(tm, T10, T11, zero, zero, row0 + BC, T, bos, i_h, H, BT, BC)
        _store_t_row(tm, T20, T21, T22, zero, row0 + 2 * BC, T, bos, i_h, H, BT, BC)
        _store_t_row(tm, T30, T31, T32, T33, row0 + 3 * BC, T, bos, i_h, H, BT, BC)

    kg0 = (k0.to(tl.float32) * (b0 * tl.exp(g0))[:, None]).to(k0.dtype)
    kg1 = (k1.to(tl.float32) * (b1 * tl.exp(g1))[:, None]).to(k0.dtype)
    kg2 = (k2.to(tl.float32) * (b2 * tl.exp(g2))[:, None]).to(k0.dtype)
    kg3 = (k3.to(tl.float32) * (b3 * tl.exp(g3))[:, None]).to(k0.dtype)
    _store_wu(w, u, v, T00, T10, T11, T20, T21, T22, T30, T31, T32, T33, kg0, kg1, kg2, kg3,
              b0, b1, b2, b3, row0, T, bos, i_h, H, K, V, BC, BK, BV, IEEE)


@triton.jit
def _state_kernel(
    k, w, u, gcum, hs, v_new, h0, ht, cu_seqlens, chunk_offsets,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    USE_H0: tl.constexpr, STORE_HT: tl.constexpr, IEEE: tl.constexpr,
):
    i_n, i_h, bos, T, boh, NT, o_k, m_k, o_v, m_v, m_kv, p_state = _sequence_tile(
        cu_seqlens, chunk_offsets, tl.program_id(0), tl.program_id(1), H, K, V, BT, BK, BV)

    b_h = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_H0:
        b_h += tl.load(h0 + p_state, mask=m_kv, other=0.0).to(tl.float32)
    for i_t in range(NT):
        # the state entering chunk i_t, for the output kernel
        tl.store(hs + ((boh + i_t) * H + i_h) * K * V + o_k[:, None] * V + o_v[None, :],
                 b_h.to(hs.dtype.element_ty), mask=m_kv)
        o_t = i_t * BT + tl.arange(0, BT)
        m_t = o_t < T
        row = bos + o_t
        b_w = tl.load(w + row[:, None] * (H * K) + i_h * K + o_k[None, :], mask=m_t[:, None] & m_k[None, :], other=0.0)
        b_u = tl.load(u + row[:, None] * (H * V) + i_h * V + o_v[None, :], mask=m_t[:, None] & m_v[None, :], other=0.0)
        if IEEE:
            b_d = b_u.to(tl.float32) - tl.dot(b_w.to(tl.float32), b_h, input_precision="ieee")
        else:
            b_d = b_u.to(tl.float32) - tl.dot(b_w, b_h.to(b_w.dtype))
        tl.store(v_new + row[:, None] * (H * V) + i_h * V + o_v[None, :], b_d.to(v_new.dtype.element_ty),
                 mask=m_t[:, None] & m_v[None, :])
        last = tl.minimum(i_t * BT + BT, T) - 1
        g_last = tl.load(gcum + (bos + last) * H + i_h)
        b_g = tl.load(gcum + row * H + i_h, mask=m_t, other=0.0)
        b_k = tl.load(k + row[:, None] * (H * K) + i_h * K + o_k[None, :], mask=m_t[:, None] & m_k[None, :], other=0.0)
        b_kd = b_k.to(tl.float32) * tl.where(m_t, tl.exp(g_last - b_g), 0.0)[:, None]
        b_h = b_h * tl.exp(g_last)
        if IEEE:
            b_h += tl.dot(tl.trans(b_kd), b_d, input_precision="ieee")
        else:
            b_h += tl.dot(tl.trans(b_kd.to(b_k.dtype)), b_d.to(b_k.dtype))
    if STORE_HT:
        tl.store(ht + p_state, b_h, mask=m_kv)


@triton.jit
def _output_kernel(
    q, k, v_new, gcum, hs, o, chunk_indices, cu_seqlens, chunk_offsets, scale,
    H: tl.constexpr, G: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, IEEE: tl.constexpr,
):
    i_v, i_t, i_hq = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_h = i_hq // G
    HQ: tl.constexpr = H * G
    bos, T, boh, i_c = _chunk(chunk_indices, cu_seqlens, chunk_offsets, i_t)
    o_r = tl.arange(0, BT)
    o_t = i_c * BT + o_r
    m_t = o_t < T
    row = bos + o_t
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V

    b_q = tl.load(q + row[:, None] * (HQ * K) + i_hq * K + o_k[None, :], mask=m_t[:, None] & m_k[None, :], other=0.0)
    b_k = tl.load(k + row[:, None] * (H * K) + i_h * K + o_k[None, :], mask=m_t[:, None] & m_k[None, :], other=0.0)
    b_h = tl.load(hs + ((boh + i_c) * H + i_h) * K * V + o_k[:, None] * V + o_v[None, :],
                  mask=m_k[:, None] & m_v[None, :], other=0.0)
    b_d = tl.load(v_new + row[:, None] * (H * V) + i_h * V + o_v[None, :], mask=m_t[:, None] & m_v[None, :], other=0.0)
    b_g = tl.load(gcum + row * H + i_h, mask=m_t, other=0.0)
    causal = o_r[:, None] >= o_r[None, :]
    decay = tl.where(causal, tl.exp(tl.where(causal, b_g[:, None] - b_g[None, :], 0.0)), 0.0)
    if IEEE:
        b_o = tl.dot(b_q.to(tl.float32), b_h.to(tl.float32), input_precision="ieee")
        b_A = tl.dot(b_q.to(tl.float32), tl.trans(b_k.to(tl.float32)), input_precision="ieee") * decay
        b_o = b_o * tl.exp(b_g)[:, None] + tl.dot(b_A, b_d.to(tl.float32), input_precision="ieee")
    else:
        b_o = tl.dot(b_q, b_h.to(b_q.dtype))
        b_A = tl.dot(b_q, tl.trans(b_k)) * decay
        b_o = b_o * tl.exp(b_g)[:, None] + tl.dot(b_A.to(b_d.dtype), b_d)
    tl.store(o + row[:, None] * (HQ * V) + i_hq * V + o_v[None, :], (b_o * scale).to(o.dtype.element_ty),
             mask=m_t[:, None] & m_v[None, :])


def _chunk_tables(cu_seqlens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``(chunk_indices [NC, 2] = (sequence, chunk in sequence), chunk_offsets [N+1], NC)``.
    One device→host copy of ``cu_seqlens`` (the grid size depends on it); the rest is vectorized."""
    dev = cu_seqlens.device
    cu = cu_seqlens.to("cpu", torch.int64)
    counts = (cu[1:] - cu[:-1] + BT - 1) // BT
    offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
    NC = int(offsets[-1])
    seq = torch.repeat_interleave(torch.arange(counts.numel()), counts)
    idx = torch.stack([seq, torch.arange(NC) - offsets[seq]], 1) if NC else torch.zeros(1, 2, dtype=torch.int64)
    return idx.to(dev, torch.int32), offsets.to(dev, torch.int32), NC


def _dense_tables(B: int, T: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """The tables of B documents of length T, built without reading anything back from the GPU."""
    key = (B, T, str(device))
    if key not in _DENSE:
        n = triton.cdiv(T, BT)
        cu = torch.arange(0, (B + 1) * T, T, dtype=torch.int32, device=device)
        seq = torch.arange(B, dtype=torch.int32, device=device).repeat_interleave(n)
        idx = torch.stack([seq, torch.arange(n, dtype=torch.int32, device=device).repeat(B)], 1)
        if B * n == 0:
            idx = torch.zeros(1, 2, dtype=torch.int32, device=device)
        off = torch.arange(0, (B + 1) * n, n, dtype=torch.int32, device=device) if n else torch.zeros(B + 1, dtype=torch.int32, device=device)
        _DENSE.clear()  # one shape at a time is what training and benchmarks use
        _DENSE[key] = (cu, idx, off, B * n)
    return _DENSE[key]


_DENSE: dict = {}
_PACKED = LastTensorMemo()  # the tables of the last cu_seqlens: every layer passes the same one


def _block_k(K: int) -> int:
    return max(16, triton.next_power_of_2(K))


def _state_bv(K: int, V: int, ieee: bool, programs: int, device: torch.device) -> int:
    """V block of the sequential state kernels: at most 64 (narrower for Gemma's 256-wide keys, whose
    fp32 state must fit in registers), and narrower still when few (sequence, head) pairs would leave
    SMs idle — at long T with a small batch the sequential loop is the whole cost."""
    bv = min(64 if _block_k(K) <= 128 else (16 if ieee else 32), max(16, triton.next_power_of_2(V)))
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        while bv > 16 and programs * triton.cdiv(V, bv) < 2 * sms:
            bv //= 2
    return bv


class Layout:
    """The packed view every kernel works on: tokens flattened, documents given by ``cu_seqlens``."""

    def __init__(self, q, v, cu_seqlens):
        B, T, self.HQ, self.K = q.shape
        self.H, self.V = v.shape[2], v.shape[3]
        self.G = self.HQ // self.H
        self.tokens = B * T
        if cu_seqlens is None:  # a dense batch is B packed documents of length T
            self.cu_seqlens, self.chunk_indices, self.chunk_offsets, self.NC = _dense_tables(B, T, q.device)
        else:
            def tables():
                cu = cu_seqlens.to(device=q.device, dtype=torch.int32)
                return (cu, *_chunk_tables(cu))

            self.cu_seqlens, self.chunk_indices, self.chunk_offsets, self.NC = _PACKED.get(cu_seqlens, tables)
        self.N = self.cu_seqlens.numel() - 1
        self.ieee = q.dtype == torch.float32
        self.BK = _block_k(self.K)
        self.device = q.device

    @staticmethod
    def flat(*xs):
        """[B, T, H, D] → [B·T, H, D] and [B, T, H] → [B·T, H], contiguous."""
        return [x.contiguous().view(x.shape[0] * x.shape[1], *x.shape[2:]) for x in xs]


def prepare_and_states(L: Layout, k, v, g, beta, initial_state, output_final_state, store_t=False):
    """Kernels 1 and 2: cumulative g, W, U (and T when ``store_t``), the state entering every chunk
    and Δ. Inputs flat (``Layout.flat``). Returns ``(gcum, w, u, tm, hs, v_new, ht)``."""
    H, K, V, ieee, dev = L.H, L.K, L.V, L.ieee, L.device
    f32 = torch.float32
    BV_P = min(64 if L.BK <= 128 else (16 if ieee else 32), max(16, triton.next_power_of_2(V)))
    BV = _state_bv(K, V, ieee, L.N * H, dev)
    stages = 1 if L.BK > 128 else 2
    gcum = torch.empty(L.tokens, H, dtype=f32, device=dev)
    w = torch.empty_like(k)
    u = torch.empty_like(v)
    tm = torch.empty(L.tokens, H, BT, dtype=f32, device=dev) if store_t else None
    v_new = torch.empty_like(v)
    hs = torch.empty(max(L.NC, 1), H, K, V, dtype=k.dtype if not ieee else f32, device=dev)
    ht = torch.empty(L.N, H, K, V, dtype=f32, device=dev) if output_final_state else None
    if L.NC:
        _prepare_kernel[(L.NC, H)](k, v, g, beta, gcum, w, u, tm if store_t else gcum, L.chunk_indices, L.cu_seqlens,
                                   L.chunk_offsets,
                                   H=H, K=K, V=V, BT=BT, BK=L.BK, BV=BV_P, IEEE=ieee, STORE_T=store_t, num_warps=4)
    h0 = initial_state.contiguous() if initial_state is not None else None
    _state_kernel[(triton.cdiv(V, BV), L.N * H)](
        k, w, u, gcum, hs, v_new, h0 if h0 is not None else hs, ht if ht is not None else hs,
        L.cu_seqlens, L.chunk_offsets, H=H, K=K, V=V, BT=BT, BK=L.BK, BV=BV,
        USE_H0=h0 is not None, STORE_HT=ht is not None, IEEE=ieee, num_warps=4, num_stages=stages,
    )
    return gcum, w, u, tm, hs, v_new, ht


def chunk_gated_delta_rule_fwd(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens):
    """Host launcher. Inputs ``[B, T, H(q), D]``; returns ``(o, final_state)``."""
    B, T = q.shape[:2]
    L = Layout(q, v, cu_seqlens)
    q, k, v, g, beta = Layout.flat(q, k, v, g, beta)
    gcum, _, _, _, hs, v_new, ht = prepare_and_states(L, k, v, g, beta, initial_state, output_final_state)
    o = torch.empty(L.tokens, L.HQ, L.V, dtype=v.dtype, device=q.device)
    if L.NC:
        BV_O = min(128 if L.BK <= 128 else 64, max(16, triton.next_power_of_2(L.V)))  # fewer q·kᵀ recomputes
        _output_kernel[(triton.cdiv(L.V, BV_O), L.NC, L.HQ)](
            q, k, v_new, gcum, hs, o, L.chunk_indices, L.cu_seqlens, L.chunk_offsets, scale,
            H=L.H, G=L.G, K=L.K, V=L.V, BT=BT, BK=L.BK, BV=BV_O, IEEE=L.ieee, num_warps=4,
            num_stages=1 if L.BK > 128 else 2,
        )
    return o.view(B, T, L.HQ, L.V), ht

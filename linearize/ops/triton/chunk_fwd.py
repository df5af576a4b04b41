"""Triton forward of the chunkwise gated delta rule (chunk 64, WY/UT form), GQA-native and varlen.

The math is the one of ``linearize/ops/chunk.py`` (read its docstring first); three kernels:

1. ``_prepare_kernel``  per (chunk, KV head): in-chunk cumsum of g, ``A = strictly-lower(β_r k_r·k_j γ_r/γ_j)``,
   ``T = (I + A)⁻¹`` (16×16 diagonal blocks by forward substitution, the rest by products),
   ``W = T (β γ k)`` and ``U = T (β v)``; T is left in a scratch buffer for the backward.
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
def _tm_block(tm, row0, col0, T, bos, i_h, H: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    """A (BC, BC) block of the chunk's (BT, BT) matrix kept in ``tm[token, head, 0:BT]``: rows from ``row0``
    (a position in the sequence), columns from ``col0`` (within the chunk); rows past T read 0."""
    o_t = row0 + tl.arange(0, BC)
    p = tm + (bos + o_t)[:, None] * (H * BT) + i_h * BT + col0 + tl.arange(0, BC)[None, :]
    return tl.load(p, mask=(o_t < T)[:, None], other=0.0)


@triton.jit
def _prepare_kernel(
    k, v, g, beta, gcum, w, u, tm, chunk_indices, cu_seqlens, chunk_offsets,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, IEEE: tl.constexpr, SOLVE: tl.constexpr,
):
    """Per (chunk, KV head): cumulative g; ``A = strictly-lower(β_r k_r·k_j γ_r/γ_j)`` in one (BT, BT)
    product; ``T = (I + A)⁻¹``; ``W = T (β γ k)`` and ``U = T (β v)`` in (BT, BT) products.

    ``tm[token, head, 0:BT]`` is the chunk's scratch: A goes there first, its rows are read back for the
    four 16×16 (BC) diagonal blocks, inverted by forward substitution side by side (four independent
    chains per step); the off-diagonal blocks follow from T_ij = −T_ii Σ_{j≤m<i} A_im T_mj; T is written
    over A and read back whole for W and U. The backward passes the forward's T back (``SOLVE=False``)
    and only W, U and the cumulative g are recomputed."""
    BC: tl.constexpr = BT // 4
    i_t, i_h = tl.program_id(0), tl.program_id(1)
    bos, T, _, i_c = _chunk(chunk_indices, cu_seqlens, chunk_offsets, i_t)
    row0 = i_c * BT
    o_r = tl.arange(0, BT)
    o_t = row0 + o_r
    m_t = o_t < T
    row = bos + o_t
    b_g = tl.cumsum(tl.load(g + row * H + i_h, mask=m_t, other=0.0).to(tl.float32), axis=0)
    tl.store(gcum + row * H + i_h, b_g, mask=m_t)
    b_beta = tl.load(beta + row * H + i_h, mask=m_t, other=0.0).to(tl.float32)
    o_k = tl.arange(0, BK)
    m_tk = m_t[:, None] & (o_k < K)[None, :]
    p_tm = tm + row[:, None] * (H * BT) + i_h * BT + o_r[None, :]
    if SOLVE:
        b_k = tl.load(k + row[:, None] * (H * K) + i_h * K + o_k[None, :], mask=m_tk, other=0.0)
        strict = o_r[:, None] > o_r[None, :]
        b_a = _dot((b_k.to(tl.float32) * b_beta[:, None]).to(b_k.dtype), tl.trans(b_k), IEEE)
        b_a = tl.where(strict, b_a * tl.exp(tl.where(strict, b_g[:, None] - b_g[None, :], 0.0)), 0.0)
        tl.store(p_tm, b_a, mask=m_t[:, None])
        tl.debug_barrier()  # A's rows are read back below, by other threads

        o_c = tl.arange(0, BC)
        eye = o_c[:, None] == o_c[None, :]
        T00 = tl.where(eye, 1.0, 0.0)
        T11 = tl.where(eye, 1.0, 0.0)
        T22 = tl.where(eye, 1.0, 0.0)
        T33 = tl.where(eye, 1.0, 0.0)
        p_row = tm + (bos + row0) * (H * BT) + i_h * BT + o_c
        for i in range(1, BC):  # row i of T_dd = e_i − Σ_{j<i} A_ij T_j, for the four diagonal blocks at once
            # (masks are written as vectors, o_c * 0 + …: the interpreter rejects a scalar mask on a vector load)
            sel = o_c[:, None] == i
            a0 = tl.load(p_row + i * (H * BT), mask=o_c * 0 + row0 + i < T, other=0.0)
            a1 = tl.load(p_row + (BC + i) * (H * BT) + BC, mask=o_c * 0 + row0 + BC + i < T, other=0.0)
            a2 = tl.load(p_row + (2 * BC + i) * (H * BT) + 2 * BC, mask=o_c * 0 + row0 + 2 * BC + i < T, other=0.0)
            a3 = tl.load(p_row + (3 * BC + i) * (H * BT) + 3 * BC, mask=o_c * 0 + row0 + 3 * BC + i < T, other=0.0)
            T00 = tl.where(sel, T00 - tl.sum(a0[:, None] * T00, axis=0)[None, :], T00)
            T11 = tl.where(sel, T11 - tl.sum(a1[:, None] * T11, axis=0)[None, :], T11)
            T22 = tl.where(sel, T22 - tl.sum(a2[:, None] * T22, axis=0)[None, :], T22)
            T33 = tl.where(sel, T33 - tl.sum(a3[:, None] * T33, axis=0)[None, :], T33)
        A10 = _tm_block(tm, row0 + BC, 0, T, bos, i_h, H, BT, BC)
        A20 = _tm_block(tm, row0 + 2 * BC, 0, T, bos, i_h, H, BT, BC)
        A21 = _tm_block(tm, row0 + 2 * BC, BC, T, bos, i_h, H, BT, BC)
        A30 = _tm_block(tm, row0 + 3 * BC, 0, T, bos, i_h, H, BT, BC)
        A31 = _tm_block(tm, row0 + 3 * BC, BC, T, bos, i_h, H, BT, BC)
        A32 = _tm_block(tm, row0 + 3 * BC, 2 * BC, T, bos, i_h, H, BT, BC)
        # off-diagonal blocks of (I + A)^-1 in fp32 (IEEE products for fp32 inputs)
        T10 = -_dot(T11, _dot(A10, T00, IEEE), IEEE)
        T21 = -_dot(T22, _dot(A21, T11, IEEE), IEEE)
        T20 = -_dot(T22, _dot(A20, T00, IEEE) + _dot(A21, T10, IEEE), IEEE)
        T32 = -_dot(T33, _dot(A32, T22, IEEE), IEEE)
        T31 = -_dot(T33, _dot(A31, T11, IEEE) + _dot(A32, T21, IEEE), IEEE)
        T30 = -_dot(T33, _dot(A30, T00, IEEE) + _dot(A31, T10, IEEE) + _dot(A32, T20, IEEE), IEEE)
        tl.debug_barrier()  # every read of A is done before T overwrites it
        zero = tl.zeros([BC, BC], dtype=tl.float32)
        _store_t_row(tm, T00, zero, zero, zero, row0, T, bos, i_h, H, BT, BC)
        _store_t_row(tm, T10, T11, zero, zero, row0 + BC, T, bos, i_h, H, BT, BC)
        _store_t_row(tm, T20, T21, T22, zero, row0 + 2 * BC, T, bos, i_h, H, BT, BC)
        _store_t_row(tm, T30, T31, T32, T33, row0 + 3 * BC, T, bos, i_h, H, BT, BC)
        tl.debug_barrier()  # T is read back whole
    b_t = tl.load(p_tm, mask=m_t[:, None], other=0.0)
    b_k = tl.load(k + row[:, None] * (H * K) + i_h * K + o_k[None, :], mask=m_tk, other=0.0)
    if not IEEE:
        b_t = b_t.to(b_k.dtype)

    kg = (b_k.to(tl.float32) * (b_beta * tl.exp(b_g))[:, None]).to(b_k.dtype)
    tl.store(w + row[:, None] * (H * K) + i_h * K + o_k[None, :], _dot(b_t, kg, IEEE).to(w.dtype.element_ty), mask=m_tk)
    for i_v in range(tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_tv = m_t[:, None] & (o_v < V)[None, :]
        p_v = row[:, None] * (H * V) + i_h * V + o_v[None, :]
        b_v = (tl.load(v + p_v, mask=m_tv, other=0.0).to(tl.float32) * b_beta[:, None]).to(b_k.dtype)
        tl.store(u + p_v, _dot(b_t, b_v, IEEE).to(u.dtype.element_ty), mask=m_tv)


@triton.jit
def _store_t_row(tm, t0, t1, t2, t3, row0, T, bos, i_h, H: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr):
    """Store one 16-row band of T (its four 16×16 blocks) to ``tm[token, head, 0:BT]``."""
    o_t = row0 + tl.arange(0, BC)
    o_c = tl.arange(0, BC)
    m = (o_t < T)[:, None] & (o_c < BC)[None, :]
    base = tm + (bos + o_t)[:, None] * (H * BT) + i_h * BT + o_c[None, :]
    tl.store(base, t0, mask=m)
    tl.store(base + BC, t1, mask=m)
    tl.store(base + 2 * BC, t2, mask=m)
    tl.store(base + 3 * BC, t3, mask=m)


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


def _state_bv(K: int, V: int, ieee: bool, programs: int | None, device: torch.device | None) -> int:
    """V block of the sequential state kernels: at most 64 (narrower for Gemma's 256-wide keys, whose
    fp32 state must fit in registers), and 32 when ``programs`` (sequence, head) pairs would leave SMs
    idle at 64 — at long T with a small batch the sequential loop is the whole cost. Measured on the
    H200 (``scripts/profile_kernels.py --sweep state_fwd,state_bwd``): 32 beats 16 there too."""
    bv = min(64 if _block_k(K) <= 128 else (16 if ieee else 32), max(16, triton.next_power_of_2(V)))
    if programs is not None and device is not None and device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        if bv > 32 and programs * triton.cdiv(V, bv) < sms:
            bv = 32
    return bv


def launch_settings(H: int, G: int, K: int, V: int, ieee: bool, programs: int | None = None,
                    device: torch.device | None = None) -> dict:
    """``{name: (kernel, constexprs, warps, stages)}`` of the forward kernels — the one table the launchers
    and ``scripts/kernel_resources.py`` read. ``programs`` = sequences × KV heads (the state kernel's parallelism)."""
    BK = _block_k(K)
    wide = BK > 128
    vmax = max(16, triton.next_power_of_2(V))
    common = dict(H=H, K=K, V=V, BT=BT, BK=BK, IEEE=ieee)
    bv = _state_bv(K, V, ieee, programs, device)
    return {
        # BV 64 always: at BV 32 the (64, 64) × (64, 32) product of U = T(βv) compiles, on Triton 3.6 for
        # the H200, to an invalid shared-memory read (compute-sanitizer: "Invalid __shared__ read of size 1024")
        # 8 warps at K ≤ 64: 4 spill ~850 B of registers there (scripts/kernel_resources.py)
        "prepare": (_prepare_kernel, {**common, "BV": 64, "SOLVE": True}, 8 if BK <= 64 else 4, 1),
        "state_fwd": (_state_kernel, {**common, "BV": bv, "USE_H0": False, "STORE_HT": False}, 4,
                      1 if wide else (2 if bv >= 64 else 3)),
        # wide V blocks: fewer recomputes of q·kᵀ
        "output": (_output_kernel, {**common, "G": G, "BV": min(128 if not wide else 64, vmax)}, 4, 1 if wide else 2),
    }


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


def prepare_and_states(L: Layout, k, v, g, beta, initial_state, output_final_state, tm=None):
    """Kernels 1 and 2: cumulative g, W, U, T, the state entering every chunk and Δ. Inputs flat
    (``Layout.flat``); ``tm``, T of an earlier call on the same inputs, skips the solve.
    Returns ``(gcum, w, u, tm, hs, v_new, ht)``."""
    H, K, V, ieee, dev = L.H, L.K, L.V, L.ieee, L.device
    f32 = torch.float32
    S = launch_settings(H, L.G, K, V, ieee, L.N * H, dev)
    gcum = torch.empty(L.tokens, H, dtype=f32, device=dev)
    w = torch.empty_like(k)
    u = torch.empty_like(v)
    solve = tm is None
    if solve:
        tm = torch.empty(L.tokens, H, BT, dtype=f32, device=dev)  # the prepare kernel's scratch, then T
    v_new = torch.empty_like(v)
    hs = torch.empty(max(L.NC, 1), H, K, V, dtype=k.dtype if not ieee else f32, device=dev)
    ht = torch.empty(L.N, H, K, V, dtype=f32, device=dev) if output_final_state else None
    if L.NC:
        fn, c, warps, stages = S["prepare"]
        fn[(L.NC, H)](k, v, g, beta, gcum, w, u, tm, L.chunk_indices, L.cu_seqlens, L.chunk_offsets,
                      **{**c, "SOLVE": solve}, num_warps=warps, num_stages=stages)
    h0 = initial_state.contiguous() if initial_state is not None else None
    fn, c, warps, stages = S["state_fwd"]
    fn[(triton.cdiv(V, c["BV"]), L.N * H)](
        k, w, u, gcum, hs, v_new, h0 if h0 is not None else hs, ht if ht is not None else hs,
        L.cu_seqlens, L.chunk_offsets, **{**c, "USE_H0": h0 is not None, "STORE_HT": ht is not None},
        num_warps=warps, num_stages=stages,
    )
    return gcum, w, u, tm, hs, v_new, ht


def chunk_gated_delta_rule_fwd(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens):
    """Host launcher. Inputs ``[B, T, H(q), D]``; returns ``(o, final_state, T)``, T = (I + A)⁻¹ of every
    chunk, ``[tokens, H, 64]`` float32, for the backward."""
    B, T = q.shape[:2]
    L = Layout(q, v, cu_seqlens)
    q, k, v, g, beta = Layout.flat(q, k, v, g, beta)
    gcum, _, _, tm, hs, v_new, ht = prepare_and_states(L, k, v, g, beta, initial_state, output_final_state)
    o = torch.empty(L.tokens, L.HQ, L.V, dtype=v.dtype, device=q.device)
    if L.NC:
        fn, c, warps, stages = launch_settings(L.H, L.G, L.K, L.V, L.ieee)["output"]
        fn[(triton.cdiv(L.V, c["BV"]), L.NC, L.HQ)](
            q, k, v_new, gcum, hs, o, L.chunk_indices, L.cu_seqlens, L.chunk_offsets, scale, **c,
            num_warps=warps, num_stages=stages)
    return o.view(B, T, L.HQ, L.V), ht, tm

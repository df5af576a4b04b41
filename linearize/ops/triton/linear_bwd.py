"""Triton backward of the decayed linear attention (:mod:`linearize.ops.linear`) and its ``autograd.Function``.

Inside a chunk, with ``q̃ = scale·q``, ``G_r = Σ_{s≤r} g_s``, ``D_rj = exp(G_r − G_j)`` (j ≤ r, else 0),
``e_j = exp(G_C − G_j)``, ``h₀`` the state entering the chunk and ``h₁`` the one leaving it:

    o_r = exp(G_r) h₀ᵀ q̃_r + Σ_j D_rj w_j (q̃_r·k_j) v_j,    h₁ = exp(G_C) h₀ + Σ_j e_j w_j k_j v_jᵀ

Given ``do`` and ``dh₁`` (the gradient of the state leaving the chunk), with ``dS_rj = do_r·v_j`` per query head:

    dh₀ = exp(G_C) dh₁ + Σ_g Σ_r exp(G_r) q̃_r do_rᵀ               (sequential, in reverse over chunks)
    dq̃_r = exp(G_r) h₀ do_r + Σ_j dS_rj D_rj w_j k_j
    dk_j = Σ_g Σ_r dS_rj D_rj w_j q̃_r + e_j w_j dh₁ v_j
    dv_j = Σ_g Σ_r D_rj w_j (q̃_r·k_j) do_r + e_j w_j dh₁ᵀ k_j
    dw_j = Σ_g Σ_r D_rj (q̃_r·k_j) dS_rj + e_j k_j·(dh₁ v_j)

The decay: write ``q'_r = exp(G_r) q̃_r`` and ``k'_j = exp(−G_j) k_j``; then ``o_r = h₀ᵀq'_r + Σ_j w_j
(q'_r·k'_j) v_j`` and ``h₁ = exp(G_C)(h₀ + Σ_j w_j k'_j v_jᵀ)`` hold G only through q', k' and the factor
``exp(G_C)``, so ``∂L/∂G_r = Σ_g q̃_r·dq̃_r − k_r·dk_r + [r = C]⟨dh₁, h₁⟩`` and, over a whole sequence,
``dg_t = Σ_{s≥t} (Σ_g q_s·dq_s − k_s·dk_s) + ⟨dh_T, h_T⟩`` (tested in float64). Summed in that form the
diagonal terms (``D_rr = 1``) cancel between q·dq and k·dk, and the last token's write between k·dk and
⟨dh₁, h₁⟩: under strong decays, where dg is made of the small remainder, that costs precision. The
kernels sum the same thing grouped by what ``g_r`` moves — ``exp(G_i)`` for i ≥ r, ``D_ij`` for i ≥ r > j,
``e_j`` for j < r and ``exp(G_C)`` — so no term cancels another:

    dg_r = Σ_{i≥r} a_i + Σ_{i≥r>j} M_ij + Σ_{j<r} w_j e_j k_j·(dh₁ v_j) + exp(G_C)⟨dh₁, h₀⟩
    a_i = Σ_g exp(G_i) (h₀ᵀq̃_i)·do_i,   M_ij = Σ_g D_ij w_j (q̃_i·k_j) dS_ij

Kernels: the chunks' decay factors (``linear_gates``, in parallel), the forward's states again
(``linear_fwd_h``), then ``_state_bwd_kernel`` per (V block, K block, sequence × KV head) stores ``dh₁`` of
every chunk and ``dh₀`` (where the forward cuts a few long chains into segments, so does it, and both kinds of
state are read as :func:`~linearize.ops.triton.linear_fwd.chunk_state` sums: :func:`state_bwd_h`);
``_dv_kernel`` per (V block, chunk, KV head) and ``_dqkwg_kernel`` per (chunk, KV head) the rest (with
``DV_IN_DQ`` on, at one query head per KV head and 128-wide keys dv too: :func:`dv_in_dqkwg`). Both loop
over the G query heads of their KV head, so dk, dv, dw and dg are summed over them without atomics. Dots in
the input dtype with fp32 accumulation (IEEE fp32 for fp32 inputs).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common import TRITON_DTYPES, cdiv
from .layout import BT, Layout, chain_at, chunk_at
from .linear_fwd import (
    Split,
    carry_segments,
    chunk_gates,
    chunk_state,
    linear_attention_triton,
    linear_bv,
    linear_fwd_h,
    linear_gates,
    linear_segment,
    linear_state_bk,
    linear_state_bv,
    pair_decays,
    segment_buffers,
)
from .settings import block_k
from .tiles import mm


@triton.jit
def _state_bwd_kernel(
    q, qdec, decay, do, dhs, dht, dh0, dseg, dcum, cu_seqlens, chunk_offsets, segments, scale,
    H: tl.constexpr, G: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
    BV: tl.constexpr, E: tl.constexpr, USE_DHT: tl.constexpr, STORE_DHS: tl.constexpr, STORE_DH0: tl.constexpr,
    IEEE: tl.constexpr,
):
    """Per (V block, K block, chain × KV head), over the chain's chunks from its end: a chain is a whole sequence
    (``E`` = 0) or a segment of ``E`` chunks (``segments``, as the forward's state kernel cuts them); ``dht``/
    ``dh0`` the gradient of the state leaving/entering each chain, and with ``E`` > 0 and ``STORE_DH0``
    ``dseg`` the chain's total decay, with ``STORE_DHS`` ``dcum`` the decay from each chunk's end to the
    chain's."""
    HQ: tl.constexpr = H * G
    i_v, i_k, i_nh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_c, i_h = i_nh // H, i_nh % H  # the chain
    bos, T, boh, c0, c1 = chain_at(segments, cu_seqlens, chunk_offsets, i_c, E, BT)
    o_k, o_v, o_r = i_k * BK + tl.arange(0, BK), i_v * BV + tl.arange(0, BV), tl.arange(0, BT)
    m_k, m_v = o_k < K, o_v < V
    p_h, m_h = o_k[:, None] * V + o_v[None, :], m_k[:, None] & m_v[None, :]
    q += (bos * HQ + i_h * G) * K
    do += (bos * HQ + i_h * G) * V
    qdec += bos * H + i_h
    decay += boh * H + i_h
    dcum += boh * H + i_h
    dhs += (boh * H + i_h) * K * V
    b_dh = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_DHT:
        b_dh = tl.load(dht + i_nh.to(tl.int64) * K * V + p_h, mask=m_h, other=0.0).to(tl.float32)
    b_d = tl.full([], 1.0, tl.float32)
    for i in range(c1 - c0):
        i_t = c1 - 1 - i
        t0 = i_t * BT
        m_t = o_r < T - t0
        if STORE_DHS:  # dh₁ of chunk i_t
            tl.store(dhs + i_t * (H * K * V) + p_h, b_dh.to(dhs.dtype.element_ty), mask=m_h)
            if E > 0:  # every (V, K) block of the chain stores the same value
                tl.store(dcum + i_t * H, b_d)
        b_e = tl.load(decay + i_t * H)  # exp(G_C)
        b_dh = b_dh * b_e
        if E > 0:
            b_d *= b_e
        gs = tl.load(qdec + (t0 + o_r) * H, mask=m_t, other=0.0) * scale  # exp(G_r) scale
        for i_g in range(G):
            b_q = tl.load(q + (t0 + o_r)[:, None] * (HQ * K) + i_g * K + o_k[None, :],
                          mask=m_t[:, None] & m_k[None, :], other=0.0)
            b_do = tl.load(do + (t0 + o_r)[:, None] * (HQ * V) + i_g * V + o_v[None, :],
                           mask=m_t[:, None] & m_v[None, :], other=0.0)
            b_dh += mm(tl.trans(b_q), b_do.to(tl.float32) * gs[:, None], b_q, IEEE)  # Σ_r exp(G_r) q̃_r do_rᵀ
    if STORE_DH0:
        tl.store(dh0 + i_nh.to(tl.int64) * K * V + p_h, b_dh.to(dh0.dtype.element_ty), mask=m_h)
        if E > 0:  # every (V, K) block of the chain stores the same value
            tl.store(dseg + i_nh, b_d)


@triton.jit
def _dv_kernel(
    q, k, g, w, do, dhs, din, dcum, seg_offsets, dv, cu_seqlens, chunk_indices, chunk_offsets, scale,
    H: tl.constexpr, G: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
    BV: tl.constexpr, E: tl.constexpr, IEEE: tl.constexpr,
):
    HQ: tl.constexpr = H * G
    i_v, i_t, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    bos, T, boh, i_c = chunk_at(chunk_indices, cu_seqlens, chunk_offsets, i_t)
    t0 = i_c * BT
    o_k, o_v, o_r = tl.arange(0, BK), i_v * BV + tl.arange(0, BV), tl.arange(0, BT)
    m_k, m_v, m_t = o_k < K, o_v < V, o_r < T - t0
    rows = bos + t0 + o_r
    m_tk, m_tv = m_t[:, None] & m_k[None, :], m_t[:, None] & m_v[None, :]
    b_k = tl.load(k + (rows * H + i_h)[:, None] * K + o_k[None, :], mask=m_tk, other=0.0)
    _, b_w, _, b_tail = chunk_gates(g + bos * H + i_h, w + bos * H + i_h, t0, o_r, T - t0, H, BT)
    b_dh = chunk_state(dhs, din, dcum, seg_offsets, chunk_indices, i_t, boh, i_c, i_h, o_k[:, None] * V + o_v[None, :],
                       m_k[:, None] & m_v[None, :], H, K, V, E)
    b_ew = tl.where(m_t, tl.exp(b_tail), 0.0) * b_w  # e_j w_j
    b_dv = mm(b_k, b_dh, b_k, IEEE) * b_ew[:, None]
    b_Dw = pair_decays(g + bos * H + i_h, t0, o_r, m_t, H, BT) * b_w[None, :] * scale  # D_rj w_j scale
    for i_g in range(G):
        b_q = tl.load(q + (rows * HQ + i_h * G + i_g)[:, None] * K + o_k[None, :], mask=m_tk, other=0.0)
        b_do = tl.load(do + (rows * HQ + i_h * G + i_g)[:, None] * V + o_v[None, :], mask=m_tv, other=0.0)
        b_s = mm(b_q, tl.trans(b_k), b_q, IEEE) * b_Dw  # (r, j)
        b_dv += mm(tl.trans(b_s), b_do, b_do, IEEE)
    tl.store(dv + (rows * H + i_h)[:, None] * V + o_v[None, :], b_dv.to(dv.dtype.element_ty), mask=m_tv)


@triton.jit
def _dqkwg_kernel(
    q, k, v, g, w, do, hs, hin, hcum, h_offsets, dhs, din, dcum, d_offsets, dq, dk, dv, dw, dg, cu_seqlens,
    chunk_indices, chunk_offsets, scale, H: tl.constexpr, G: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, E: tl.constexpr, DV: tl.constexpr, IEEE: tl.constexpr,
):
    """Per (chunk, KV head): dq, dk, dw, dg and, with ``DV`` (one query head: :func:`dv_in_dqkwg`), dv as
    ``_dv_kernel`` makes it, from the q·kᵀ and do this pass reads anyway."""
    HQ: tl.constexpr = H * G
    i_t, i_h = tl.program_id(0), tl.program_id(1)
    bos, T, boh, i_c = chunk_at(chunk_indices, cu_seqlens, chunk_offsets, i_t)
    t0 = i_c * BT
    o_k, o_r = tl.arange(0, BK), tl.arange(0, BT)
    m_k, m_t = o_k < K, o_r < T - t0
    rows = bos + t0 + o_r
    m_tk = m_t[:, None] & m_k[None, :]
    b_k = tl.load(k + (rows * H + i_h)[:, None] * K + o_k[None, :], mask=m_tk, other=0.0)
    b_G, b_w, g_last, b_tail = chunk_gates(g + bos * H + i_h, w + bos * H + i_h, t0, o_r, T - t0, H, BT)
    b_e = tl.where(m_t, tl.exp(b_tail), 0.0)
    b_D = pair_decays(g + bos * H + i_h, t0, o_r, m_t, H, BT)  # dg is made of these off-diagonal terms
    # through the state leaving the chunk: v dh₁ᵀ (dk, dw), and ⟨dh₁, h₀⟩ (dg)
    b_vdh = tl.zeros([BT, BK], dtype=tl.float32)
    b_hdh = tl.zeros([BK], dtype=tl.float32)
    for i_v in range(tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = o_v < V
        p_kv, m_kv = o_k[:, None] * V + o_v[None, :], m_k[:, None] & m_v[None, :]
        b_v = tl.load(v + (rows * H + i_h)[:, None] * V + o_v[None, :], mask=m_t[:, None] & m_v[None, :], other=0.0)
        b_dh = chunk_state(dhs, din, dcum, d_offsets, chunk_indices, i_t, boh, i_c, i_h, p_kv, m_kv, H, K, V, E)
        b_h = chunk_state(hs, hin, hcum, h_offsets, chunk_indices, i_t, boh, i_c, i_h, p_kv, m_kv, H, K, V, E)
        b_vdh += mm(b_v, tl.trans(b_dh), b_v, IEEE)
        b_hdh += tl.sum(b_dh.to(tl.float32) * b_h.to(tl.float32), 1)
    b_dw = b_e * tl.sum(b_vdh * b_k.to(tl.float32), 1)  # e_j k_j·(dh₁ v_j)
    b_dk = b_vdh * (b_e * b_w)[:, None]
    before = o_r[None, :] < o_r[:, None]  # (r, j): j < r
    # dg through the state: exp(G_C)⟨dh₁, h₀⟩ + Σ_{j<r} w_j e_j k_j·(dh₁ v_j)
    b_dg = tl.sum(b_hdh, 0) * tl.exp(g_last) + tl.sum(tl.where(before, (b_w * b_dw)[None, :], 0.0), 1)
    b_a = tl.zeros([BT], dtype=tl.float32)  # exp(G_r) (h₀ᵀq̃_r)·do_r, summed over the query heads
    b_M = tl.zeros([BT, BT], dtype=tl.float32)  # (q_r·k_j) D_rj dS_rj, summed over the query heads
    for i_g in range(G):
        p_q = (rows * HQ + i_h * G + i_g)[:, None]
        b_q = tl.load(q + p_q * K + o_k[None, :], mask=m_tk, other=0.0)
        b_dq = tl.zeros([BT, BK], dtype=tl.float32)
        b_ds = tl.zeros([BT, BT], dtype=tl.float32)
        if DV:
            b_qk = mm(b_q, tl.trans(b_k), b_q, IEEE)
            b_sdw = b_qk * b_D * b_w[None, :] * scale  # (r, j): D_rj w_j scale (q_r·k_j)
        for i_v in range(tl.cdiv(V, BV)):
            o_v = i_v * BV + tl.arange(0, BV)
            m_v = o_v < V
            m_tv = m_t[:, None] & m_v[None, :]
            p_kv, m_kv = o_k[:, None] * V + o_v[None, :], m_k[:, None] & m_v[None, :]
            b_do = tl.load(do + p_q * V + o_v[None, :], mask=m_tv, other=0.0)
            b_v = tl.load(v + (rows * H + i_h)[:, None] * V + o_v[None, :], mask=m_tv, other=0.0)
            b_h = chunk_state(hs, hin, hcum, h_offsets, chunk_indices, i_t, boh, i_c, i_h, p_kv, m_kv, H, K, V, E)
            b_dq += mm(b_do, tl.trans(b_h), b_do, IEEE)
            b_ds += mm(b_do, tl.trans(b_v), b_do, IEEE)  # dS_rj = do_r·v_j
            if DV:  # dv_j = Σ_r D_rj w_j (q̃_r·k_j) do_r + e_j w_j dh₁ᵀ k_j
                b_dh = chunk_state(dhs, din, dcum, d_offsets, chunk_indices, i_t, boh, i_c, i_h, p_kv, m_kv, H, K, V, E)
                b_dv = mm(tl.trans(b_sdw), b_do, b_do, IEEE) + mm(b_k, b_dh, b_k, IEEE) * (b_e * b_w)[:, None]
                tl.store(dv + (rows * H + i_h)[:, None] * V + o_v[None, :], b_dv.to(dv.dtype.element_ty), mask=m_tv)
        b_dq = b_dq * tl.exp(b_G)[:, None]  # ∂L/∂q̃ through h₀
        b_a += tl.sum(b_dq * b_q.to(tl.float32), 1)
        b_dsd = b_ds * b_D
        b_dsw = b_dsd * b_w[None, :]
        b_dq += mm(b_dsw, b_k, b_k, IEEE)  # ∂L/∂q̃
        b_dk += mm(tl.trans(b_dsw), b_q, b_q, IEEE) * scale
        if DV:
            b_qkd = b_qk * b_dsd
        else:
            b_qkd = mm(b_q, tl.trans(b_k), b_q, IEEE) * b_dsd
        b_dw += tl.sum(b_qkd, 0) * scale
        b_M += b_qkd
        tl.store(dq + p_q * K + o_k[None, :], (b_dq * scale).to(dq.dtype.element_ty), mask=m_tk)
    # dg through exp(G_i) h₀ᵀq̃_i (i ≥ r) and through D_ij (i ≥ r > j): no term that cancels another
    b_M = tl.where(before, b_M * b_w[None, :], 0.0) * scale
    b_dg += tl.cumsum(b_a, 0, reverse=True) * scale
    b_dg += tl.sum(tl.where(before, tl.cumsum(b_M, 0, reverse=True), 0.0), 1)
    tl.store(dk + (rows * H + i_h)[:, None] * K + o_k[None, :], b_dk.to(dk.dtype.element_ty), mask=m_tk)
    tl.store(dw + rows * H + i_h, b_dw.to(dw.dtype.element_ty), mask=m_t)
    tl.store(dg + rows * H + i_h, b_dg.to(dg.dtype.element_ty), mask=m_t)


def state_bwd_h(L: Layout, q, qdec, decay, do, dhs, dht, dh0, scale: float, c: dict) -> Split:
    """``dhs`` (the gradient of the state leaving every chunk) and ``dh0``, by ``_state_bwd_kernel`` over each
    sequence, or where the forward cuts its chain (:func:`~linearize.ops.triton.linear_fwd.linear_segment`) over
    segments: each segment's own gradients from zero (``dhs``) and decay, then the chain over the segments from
    the end (:func:`~linearize.ops.triton.linear_fwd.carry_segments`) for the gradient leaving each, which the
    returned :class:`~linearize.ops.triton.linear_fwd.Split` adds where ``dhs`` is read."""
    E = linear_segment(L, q.device)
    segments, NS = L.groups(E) if E else (L.cu_seqlens, L.N)
    SBV = linear_state_bv(L, q.device, NS)
    SBK = linear_state_bk(L, SBV, q.device, NS)
    grid = (cdiv(L.V, SBV), cdiv(L.K, SBK), NS * L.H)
    common = {**c, "BK": SBK, "BV": SBV, "E": E, "num_warps": 4}
    if not E:
        _state_bwd_kernel[grid](
            q, qdec, decay, do, dhs, dht if dht is not None else dhs, dh0 if dh0 is not None else dhs, decay, decay,
            L.cu_seqlens, L.chunk_offsets, segments, scale, USE_DHT=dht is not None, STORE_DHS=True,
            STORE_DH0=dh0 is not None, **common)
        return Split(dhs, decay, L.cu_seqlens, 0)
    dstart, dout, dseg, dcum = segment_buffers(L, NS, dhs.dtype)
    _state_bwd_kernel[grid](q, qdec, decay, do, dhs, dhs, dstart, dseg, dcum, L.cu_seqlens, L.chunk_offsets, segments,
                            scale, USE_DHT=False, STORE_DHS=True, STORE_DH0=True, **common)
    carry_segments(L, E, SBK, SBV, dstart, dseg, dout, dht, dh0, reverse=True)
    return Split(dout, dcum, L.group_offsets(E), E)


# on, dv_in_dqkwg's rule applies; off until its GPU test (tests/test_linear_triton_bwd.py -m gpu -k dv_in) has
# passed: so far it is checked under the interpreter only. scripts/bench_kernels.py --linear-dv-in-dq turns it on
DV_IN_DQ = False


def dv_in_dqkwg(layout: Layout, E: int) -> bool:
    """Whether ``_dqkwg_kernel`` makes dv in its pass (no ``_dv_kernel``): one query head per KV head (with G of
    them the pass would hold G products at once), keys over 64 wide (at 64 the pass is light and the dv kernel's
    own launch cheap; 256-wide keys would spill) and chains not cut (the cut chains' states are sums, which the
    pass would read twice); 16-bit inputs, the ones timed. The same change as a branch, since lost, measured
    on an H100 at 16 heads of 128, bf16, with the forward's states stored: forward+backward 1.13 / 1.10 / 1.12×
    faster at 8×2048 / 2×8192 / 4×4096, 0.99× at the cut 1×16384 and 1×32768
    (``results/ab_linear_kernel_candidates_h100/``)."""
    return DV_IN_DQ and not layout.ieee and layout.G == 1 and 64 < block_k(layout.K) <= 128 and E == 0


def linear_attention_triton_bwd(*, q, k, v, g, w, scale: float, initial_state, do, dht, cu_seqlens) -> tuple:
    """``(dq, dk, dv, dg, dw, dh0)`` of :func:`linear_attention_triton`'s output ``o`` and final state, each in
    its input's dtype (``dh0`` None without an initial state). ``do`` ``[B, T, G·H, V]``; ``dht`` ``[N, H, K, V]``
    or None."""
    B, T, HQ, K = q.shape
    L = Layout(q, v, cu_seqlens)
    H, V, G, ieee, dev = L.H, L.V, L.G, L.ieee, q.device
    qf, kf, vf, dof = Layout.flat(q, k, v, do)
    gf, wf = (x.float() for x in Layout.flat(g, w))
    h0 = initial_state.to(torch.float32).contiguous() if initial_state is not None else None
    dh0 = torch.empty(L.N, H, K, V, dtype=initial_state.dtype, device=dev) if initial_state is not None else None
    dq, dk, dv = torch.empty_like(qf), torch.empty_like(kf), torch.empty_like(vf)
    dg, dw = torch.empty(L.tokens, H, dtype=g.dtype, device=dev), torch.empty(L.tokens, H, dtype=w.dtype, device=dev)
    shape = lambda x, *s: x.view(B, T, *s)  # noqa: E731
    if L.NC == 0:  # no tokens: the state's gradient passes through
        if dh0 is not None:
            dh0.copy_(dht if dht is not None else torch.zeros_like(dh0))
        return shape(dq, HQ, K), shape(dk, H, K), shape(dv, H, V), shape(dg, H), shape(dw, H), dh0
    sdt = torch.float32 if ieee else k.dtype
    hs = torch.empty(L.NC, H, K, V, dtype=sdt, device=dev)
    gates = linear_gates(L, gf, wf, query_decays=True)  # shared with the states' recomputation
    _, decay, qdec = gates
    hsplit = linear_fwd_h(layout=L, k=kf, v=vf, g=gf, w=wf, hs=hs, h0=h0, gates=gates)
    dhs = torch.empty(L.NC, H, K, V, dtype=sdt, device=dev)
    dht = dht.contiguous() if dht is not None else None
    BK, BV = block_k(K), linear_bv(K, V)
    c = {"H": H, "G": G, "K": K, "V": V, "BT": BT, "BK": BK, "BV": BV, "IEEE": ieee,
         "num_stages": 1 if BK > 128 else (2 if ieee else 3)}  # the GDN backward's rule (shared memory)
    dsplit = state_bwd_h(L, qf, qdec, decay, dof, dhs, dht, dh0, float(scale), c)
    dv_here = dv_in_dqkwg(L, dsplit.E)
    if not dv_here:
        _dv_kernel[(cdiv(V, BV), L.NC, H)](
            qf, kf, gf, wf, dof, dhs, *dsplit.args(), dv, L.cu_seqlens, L.chunk_indices, L.chunk_offsets, float(scale),
            E=dsplit.E, **c, num_warps=4)
    assert hsplit.E == dsplit.E  # one linear_segment call cuts both chains alike; the kernel reads both by E
    _dqkwg_kernel[(L.NC, H)](
        qf, kf, vf, gf, wf, dof, hs, *hsplit.args(), dhs, *dsplit.args(), dq, dk, dv, dw, dg, L.cu_seqlens,
        L.chunk_indices, L.chunk_offsets, float(scale), E=dsplit.E, DV=dv_here, **c, num_warps=4 if BK <= 64 else 8)
    return shape(dq, HQ, K), shape(dk, H, K), shape(dv, H, V), shape(dg, H), shape(dw, H), dh0


class LinearAttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, w, initial_state, scale, output_final_state, cu_seqlens, v_offset):
        o, ht = linear_attention_triton(q, k, v, g, w, scale=scale, initial_state=initial_state,
                                        output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                                        v_offset=v_offset)
        # no intermediate is kept: the backward recomputes the chunk states (one sequential pass)
        ctx.save_for_backward(q, k, v, g, w, initial_state, cu_seqlens)
        ctx.scale = scale
        ctx.offset_dtype = v_offset.dtype if v_offset is not None else None
        return o, ht

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, g, w, h0, cu_seqlens = ctx.saved_tensors
        dq, dk, dv, dg, dw, dh0 = linear_attention_triton_bwd(q=q, k=k, v=v, g=g, w=w, scale=ctx.scale,
                                                              initial_state=h0, do=do, dht=dht, cu_seqlens=cu_seqlens)
        dvo = None
        if ctx.needs_input_grad[9]:  # o = … + v_offset of the KV head, read by its G query heads
            B, T, HQ, V = do.shape
            H = v.shape[2]
            dvo = do.reshape(B, T, H, HQ // H, V).sum(3, dtype=torch.float32).to(ctx.offset_dtype)
        return dq, dk, dv, dg, dw, dh0, None, None, None, dvo


def linear_attention_triton_train(q, k, v, g, w, *, scale: float = 1.0, initial_state=None,
                                  output_final_state: bool = False, cu_seqlens=None, v_offset=None):
    """:func:`linear_attention_triton` differentiable through the kernels above (inputs checked by
    :func:`linearize.ops.linear.linear_attention`): gradients of q, k, v, g, w, the initial state and v_offset."""
    if q.dtype not in TRITON_DTYPES:
        raise ValueError(f"the Triton backend takes {', '.join(map(str, TRITON_DTYPES))}; got {q.dtype} (use backend='torch')")
    if v_offset is not None and v_offset.shape != v.shape:
        raise ValueError(f"v_offset must be shaped like v {tuple(v.shape)}; got {tuple(v_offset.shape)}")
    return LinearAttentionFunction.apply(q, k, v, g, w, initial_state, float(scale), output_final_state, cu_seqlens,
                                         v_offset)

"""Forward stage 3, per (V block, chunk or group of ``E`` chunks, query head):
``o = γ (q h) + (q kᵀ ⊙ γ_r/γ_j)_causal Δ``, carrying h from chunk to chunk on Δ within a group. Query head
``h_q`` reads KV head ``h_q // G``, so K/V are never repeated in memory."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ..common import cdiv, next_pow2
from .layout import BT, Layout, chunk_at, grid_slices, sequence_at, state_slot
from .settings import block_k, frozen
from .tiles import log_decay


@triton.jit
def _output_kernel(
    q, k, v_new, gcum, hs, o, vm, group_indices, cu_seqlens, chunk_offsets, scale, p0,
    H: tl.constexpr, G: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, IEEE: tl.constexpr, HAS_VM: tl.constexpr,
    E: tl.constexpr, USE_G: tl.constexpr = True, HS_EVERY: tl.constexpr = 0,
):
    """Per (V block, group of ``E`` consecutive chunks of one sequence, query head), chunk by chunk:
    ``o = scale·(γ (q h) + (q kᵀ ⊙ γ_r/γ_j)_causal Δ)``, plus the KV head's ``vm`` row (float32,
    ``[tokens, H, V]``) when ``HAS_VM`` — the Taylor back ``+ v̄``, added before the one rounding to o's dtype.
    Only the state entering the group's first chunk is read (the state kernel keeps one per ``E`` chunks);
    the program carries it to the next chunk itself, ``h ← γ_C h + Kᵀ (Δ ⊙ γ_C/γ_j)`` — the state kernel's
    update, on the Δ it stored — so the states cost 1/E of their traffic, and the loop lets Triton load
    the next chunk under this one's products. ``E = 1`` (``group_indices`` = the chunk table): one chunk, no
    loop, the state read in the dots' dtype. ``HS_EVERY`` 1: ``hs`` holds every chunk's state (kept for the
    backward), of which the group's first is read; 0: one per ``E`` chunks."""
    i_v, i_p, i_hq = tl.program_id(0), tl.program_id(1) + p0, tl.program_id(2)  # p0: this launch's first group
    i_h = i_hq // G
    HQ: tl.constexpr = H * G
    o_r = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    if E == 1:
        bos, T, boh, i_c = chunk_at(group_indices, cu_seqlens, chunk_offsets, i_p)
        o_t = i_c * BT + o_r
        m_t = o_t < T
        row = bos + o_t
        m_tv = m_t[:, None] & m_v[None, :]
        b_q = tl.load(q + row[:, None] * (HQ * K) + i_hq * K + o_k[None, :], mask=m_t[:, None] & m_k[None, :], other=0.0)
        b_k = tl.load(k + row[:, None] * (H * K) + i_h * K + o_k[None, :], mask=m_t[:, None] & m_k[None, :], other=0.0)
        b_h = tl.load(hs + ((boh + i_c) * H + i_h) * K * V + o_k[:, None] * V + o_v[None, :],
                      mask=m_k[:, None] & m_v[None, :], other=0.0)
        b_d = tl.load(v_new + row[:, None] * (H * V) + i_h * V + o_v[None, :], mask=m_tv, other=0.0)
        b_g = log_decay(gcum + row * H + i_h, m_t, USE_G)
        b_o = _chunk_output(b_q, b_k, b_h, b_d, b_g, m_t, scale, IEEE)
        if HAS_VM:
            b_o += tl.load(vm + row[:, None] * (H * V) + i_h * V + o_v[None, :], mask=m_tv, other=0.0)
        tl.store(o + row[:, None] * (HQ * V) + i_hq * V + o_v[None, :], b_o.to(o.dtype.element_ty), mask=m_tv)
    else:
        i_n = tl.load(group_indices + i_p * 2).to(tl.int64)
        c0 = tl.load(group_indices + i_p * 2 + 1).to(tl.int64) * E
        bos, T, boh = sequence_at(cu_seqlens, chunk_offsets, i_n)
        q += (bos * HQ + i_hq) * K
        k += (bos * H + i_h) * K
        v_new += (bos * H + i_h) * V
        vm += (bos * H + i_h) * V
        o += (bos * HQ + i_hq) * V
        gcum += bos * H + i_h
        slot = state_slot(boh, i_n, c0, HS_EVERY if HS_EVERY else E)
        b_h = tl.load(hs + (slot * H + i_h) * K * V + o_k[:, None] * V + o_v[None, :],
                      mask=m_k[:, None] & m_v[None, :], other=0.0).to(tl.float32)
        for i_c in range(c0, tl.minimum(c0 + E, tl.cdiv(T, BT))):
            t0 = i_c * BT
            m_t = o_r < T - t0
            m_tk = m_t[:, None] & m_k[None, :]
            m_tv = m_t[:, None] & m_v[None, :]
            b_q = tl.load(q + t0 * (HQ * K) + o_r[:, None] * (HQ * K) + o_k[None, :], mask=m_tk, other=0.0)
            b_k = tl.load(k + t0 * (H * K) + o_r[:, None] * (H * K) + o_k[None, :], mask=m_tk, other=0.0)
            b_d = tl.load(v_new + t0 * (H * V) + o_r[:, None] * (H * V) + o_v[None, :], mask=m_tv, other=0.0)
            b_g = log_decay(gcum + (t0 + o_r) * H, m_t, USE_G)
            b_o = _chunk_output(b_q, b_k, b_h, b_d, b_g, m_t, scale, IEEE)
            if HAS_VM:
                b_o += tl.load(vm + t0 * (H * V) + o_r[:, None] * (H * V) + o_v[None, :], mask=m_tv, other=0.0)
            tl.store(o + t0 * (HQ * V) + o_r[:, None] * (HQ * V) + o_v[None, :], b_o.to(o.dtype.element_ty),
                     mask=m_tv)
            # the state entering the next chunk
            g_last = log_decay(gcum + (tl.minimum(t0 + BT, T) - 1) * H, None, USE_G)
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


@functools.lru_cache(maxsize=256)
def output_settings(H: int, G: int, K: int, V: int, ieee: bool, E: int) -> tuple:
    """``(kernel, constexprs, warps, stages)`` for ``E`` chunks per program (:func:`settings.output_group`).
    One chunk per program: wide V blocks, fewer recomputes of q·kᵀ."""
    BK = block_k(K)
    wide = BK > 128
    bv = min(128 if E == 1 and not wide else 64, max(16, next_pow2(V)))
    return frozen(_output_kernel, {"H": H, "K": K, "V": V, "BT": BT, "BK": BK, "IEEE": ieee, "G": G, "BV": bv,
                                   "HAS_VM": False, "E": E}, 4, 1 if wide else 2)


def chunk_fwd_o(*, layout: Layout, q: torch.Tensor, k: torch.Tensor, v_new: torch.Tensor, gcum: torch.Tensor | None,
                hs: torch.Tensor, scale: float, v_offset: torch.Tensor | None, every: int,
                all_states: bool = False) -> torch.Tensor:
    """``o [tokens, HQ, V]`` in v_new's dtype, ``every`` chunks a program, from the states ``hs`` kept every
    ``every`` chunks (:func:`state_fwd.chunk_fwd_h`), or every chunk's with ``all_states``; ``v_offset`` (flat
    ``[tokens, H, V]`` float32, or None) is added to every query head of its KV head, before the one rounding."""
    L = layout
    o = torch.empty(L.tokens, L.HQ, L.V, dtype=v_new.dtype, device=L.device)
    if L.NC:
        fn, c, warps, stages = output_settings(L.H, L.G, L.K, L.V, L.ieee, every)
        groups, NG = L.groups(every)
        for p0, n in grid_slices(NG):
            fn[(cdiv(L.V, c["BV"]), n, L.HQ)](
                q, k, v_new, o if gcum is None else gcum, hs, o, v_offset if v_offset is not None else o, groups,
                L.cu_seqlens, L.chunk_offsets, scale, p0, **{**c, "HAS_VM": v_offset is not None},
                USE_G=gcum is not None, HS_EVERY=int(all_states and every > 1), num_warps=warps, num_stages=stages)
    return o

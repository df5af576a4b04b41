"""Forward stage 2, per (V block, sequence × KV head): the only sequential part. Carries the float32 state
across chunks, writes ``Δ = U − W h`` and the state entering each chunk (of every ``EVERY``-th chunk only
when the output kernel carries the state itself: :func:`settings.output_group`)."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ..common import cdiv
from .layout import BT, Layout, n_slots, sequence_at, state_slot
from .settings import block_k, frozen, sms_for, state_bv
from .tiles import blocks_rows_dot, blocks_start, blocks_store, blocks_update, log_decay


@triton.jit
def _state_kernel(
    k, w, u, gcum, hs, v_new, h0, ht, cu_seqlens, chunk_offsets,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, KB: tl.constexpr, BV: tl.constexpr,
    USE_H0: tl.constexpr, STORE_HT: tl.constexpr, IEEE: tl.constexpr, EVERY: tl.constexpr,
    USE_G: tl.constexpr = True,
):
    """Per (V block, sequence × KV head), over the chunks in order: store the state h entering the chunk
    (of every ``EVERY``-th chunk only, at its ``state_slot``), ``Δ = U − W h``, then
    ``h ← γ_C h + Kᵀ (Δ ⊙ γ_C/γ_j)``. The [K, BV] state is held as up to four (KB, BV) fp32 blocks (K
    blocks of KB rows), so each product is (BT, KB)·(KB, BV) and the blocks update independently; the decay
    is applied to Δ's rows rather than to k. Pointers move to the sequence and the chunk first, so tile
    offsets stay 32-bit."""
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    bos, T, boh = sequence_at(cu_seqlens, chunk_offsets, i_n)
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    o_r = tl.arange(0, BT)
    k += (bos * H + i_h) * K
    w += (bos * H + i_h) * K
    u += (bos * H + i_h) * V
    v_new += (bos * H + i_h) * V
    gcum += bos * H + i_h
    hs += (state_slot(boh, i_n, 0, EVERY) * H + i_h) * K * V

    b_h1, b_h2, b_h3, b_h4 = blocks_start(h0 + i_nh.to(tl.int64) * K * V, USE_H0, o_v, m_v, K, V, KB, BV)
    for i_t in range(tl.cdiv(T, BT)):
        t0 = i_t * BT
        m_t = o_r < T - t0
        # the state entering chunk i_t, for the output kernel (which carries it over the next EVERY − 1 chunks)
        if EVERY == 1:
            blocks_store(hs + i_t * (H * K * V), b_h1, b_h2, b_h3, b_h4, o_v, m_v, K, V, KB)
        elif i_t % EVERY == 0:
            blocks_store(hs + (i_t // EVERY) * (H * K * V), b_h1, b_h2, b_h3, b_h4, o_v, m_v, K, V, KB)
        b_d = blocks_rows_dot(w + t0 * (H * K), H * K, o_r, m_t, b_h1, b_h2, b_h3, b_h4, K, KB, True, IEEE)  # −W h
        p_tv = o_r[:, None] * (H * V) + o_v[None, :]
        m_tv = m_t[:, None] & m_v[None, :]
        b_d += tl.load(u + t0 * (H * V) + p_tv, mask=m_tv, other=0.0).to(tl.float32)
        tl.store(v_new + t0 * (H * V) + p_tv, b_d.to(v_new.dtype.element_ty), mask=m_tv)
        g_last = log_decay(gcum + (tl.minimum(t0 + BT, T) - 1) * H, None, USE_G)
        b_g = log_decay(gcum + t0 * H + o_r * H, m_t, USE_G)
        b_de = b_d * tl.where(m_t, tl.exp(g_last - b_g), 0.0)[:, None]  # Δ ⊙ γ_C/γ_j
        e_c = tl.exp(g_last)
        b_h1, b_h2, b_h3, b_h4 = blocks_update(b_h1, b_h2, b_h3, b_h4, e_c, k + t0 * (H * K), H * K, o_r, m_t, b_de,
                                                K, KB, False, IEEE)  # γ_C h + Kᵀ (Δ ⊙ γ_C/γ_j)
    if STORE_HT:
        blocks_store(ht + i_nh.to(tl.int64) * K * V, b_h1, b_h2, b_h3, b_h4, o_v, m_v, K, V, KB)


@functools.lru_cache(maxsize=256)
def state_fwd_settings(H: int, K: int, V: int, ieee: bool, bv: int) -> tuple:
    """``(kernel, constexprs, warps, stages)`` for the state V block ``bv`` (:func:`settings.state_bv`). 4 stages
    for 16-bit inputs; IEEE fp32 tiles take twice the shared memory, so 2; 1 for 256-wide keys."""
    KB = min(block_k(K), 64)
    wide = block_k(K) > 128
    return frozen(_state_kernel, {"H": H, "K": K, "V": V, "BT": BT, "KB": KB, "BV": bv, "IEEE": ieee,
                                  "USE_H0": False, "STORE_HT": False, "EVERY": 1},
                  4, 1 if wide else (2 if ieee else 4))


def chunk_fwd_h(*, layout: Layout, k: torch.Tensor, w: torch.Tensor, u: torch.Tensor, gcum: torch.Tensor | None,
                initial_state: torch.Tensor | None, output_final_state: bool, every: int = 1) -> tuple:
    """``(hs, v_new, ht)``: the state entering every ``every``-th chunk (rows at ``state_slot``; k's dtype, or
    float32 for float32 inputs), Δ = U − W h like u, and the float32 final state (or None)."""
    L = layout
    H, K, V, ieee, dev = L.H, L.K, L.V, L.ieee, L.device
    v_new = torch.empty_like(u)
    hs = torch.empty(n_slots(L.NC, L.N, every), H, K, V, dtype=k.dtype if not ieee else torch.float32, device=dev)
    ht = torch.empty(L.N, H, K, V, dtype=torch.float32, device=dev) if output_final_state else None
    h0 = initial_state.contiguous() if initial_state is not None else None
    bv = state_bv(K, V, ieee, L.N * H, sms_for(L.N * H, dev))
    fn, c, warps, stages = state_fwd_settings(H, K, V, ieee, bv)
    fn[(cdiv(V, c["BV"]), L.N * H)](
        k, w, u, u if gcum is None else gcum, hs, v_new, h0 if h0 is not None else hs, ht if ht is not None else hs,
        L.cu_seqlens, L.chunk_offsets,
        **{**c, "USE_H0": h0 is not None, "STORE_HT": ht is not None, "EVERY": every}, USE_G=gcum is not None,
        num_warps=warps, num_stages=stages,
    )
    return hs, v_new, ht

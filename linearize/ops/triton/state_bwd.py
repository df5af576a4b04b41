"""Backward stage 2, per (V block, sequence × KV head): the only sequential part, in reverse over chunks:
``dΔ = Pᵀdo + K̃ dh₁``, ``dh₀ = γ_C dh₁ + (γ⊙q)ᵀ do − Wᵀ dΔ``. Stores ``dh₁`` per chunk, and ``dΔ`` over
stage 1's ``Pᵀdo`` (one buffer, in the dots' dtype)."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ..common import cdiv
from .layout import BT, Layout, n_slots, sequence_at
from .settings import block_k, frozen, sms_for, state_bv
from .tiles import blocks_load, blocks_rows_dot, blocks_start, blocks_store, blocks_update, log_decay


@triton.jit
def _state_bwd_kernel(
    q, k, w, gcum, do, dvl, dql, dhs, ddl, dht, dh0, cu_seqlens, chunk_offsets, scale,
    H: tl.constexpr, G: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, KB: tl.constexpr, BV: tl.constexpr,
    QDO: tl.constexpr, USE_DHT: tl.constexpr, STORE_DH0: tl.constexpr, IEEE: tl.constexpr,
    USE_G: tl.constexpr = True,
):
    """Per (V block, sequence × KV head), over the chunks in reverse: store dh₁ (the gradient of the state
    leaving the chunk), ``dΔ = Pᵀdo + (γ_C/γ_j ⊙ k) dh₁``, then ``dh₀ = γ_C dh₁ + Σ_g (γ⊙q_g)ᵀ do_g − Wᵀ dΔ``.
    ``ddl`` may be ``dvl`` (updated in place). The state gradient is held as up to four (KB, BV) blocks, as
    in the forward's ``_state_kernel``. With ``QDO`` the q term is read per chunk from ``dql`` (written by
    ``_dv_local_kernel``) instead of computed here."""
    HQ: tl.constexpr = H * G
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    bos, T, boh = sequence_at(cu_seqlens, chunk_offsets, i_n)
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V
    o_r = tl.arange(0, BT)
    q += (bos * HQ + i_h * G) * K
    do += (bos * HQ + i_h * G) * V
    k += (bos * H + i_h) * K
    w += (bos * H + i_h) * K
    dvl += (bos * H + i_h) * V
    ddl += (bos * H + i_h) * V
    gcum += bos * H + i_h
    dhs += (boh * H + i_h) * K * V
    dql += (boh * H + i_h) * K * V

    b_dh1, b_dh2, b_dh3, b_dh4 = blocks_start(dht + i_nh.to(tl.int64) * K * V, USE_DHT, o_v, m_v, K, V, KB, BV)
    NT = tl.cdiv(T, BT)
    for i in range(NT):
        i_t = NT - 1 - i
        t0 = i_t * BT
        m_t = o_r < T - t0
        blocks_store(dhs + i_t * (H * K * V), b_dh1, b_dh2, b_dh3, b_dh4, o_v, m_v, K, V, KB)
        g_last = log_decay(gcum + (tl.minimum(t0 + BT, T) - 1) * H, None, USE_G)
        b_g = log_decay(gcum + t0 * H + o_r * H, m_t, USE_G)
        e_c = tl.exp(g_last)
        # dΔ = Pᵀdo + K̃ dh₁, K̃ = γ_C/γ_j ⊙ k: the decay scales the product's rows
        b_kdh = blocks_rows_dot(k + t0 * (H * K), H * K, o_r, m_t, b_dh1, b_dh2, b_dh3, b_dh4, K, KB, False, IEEE)
        p_tv = o_r[:, None] * (H * V) + o_v[None, :]
        m_tv = m_t[:, None] & m_v[None, :]
        b_dd = tl.load(dvl + t0 * (H * V) + p_tv, mask=m_tv, other=0.0).to(tl.float32)
        b_dd += b_kdh * tl.where(m_t, tl.exp(g_last - b_g), 0.0)[:, None]
        tl.store(ddl + t0 * (H * V) + p_tv, b_dd.to(ddl.dtype.element_ty), mask=m_tv)
        # dh₀ = γ_C dh₁ − Wᵀ dΔ + Σ_g (γ⊙q_g)ᵀ do_g (scale folded into do)
        b_dh1, b_dh2, b_dh3, b_dh4 = blocks_update(b_dh1, b_dh2, b_dh3, b_dh4, e_c, w + t0 * (H * K), H * K, o_r, m_t,
                                                    b_dd, K, KB, True, IEEE)
        if QDO:
            b_dh1, b_dh2, b_dh3, b_dh4 = blocks_load(dql + i_t * (H * K * V), b_dh1, b_dh2, b_dh3, b_dh4, o_v, m_v,
                                                      K, V, KB)
        else:
            gs = tl.exp(b_g) * scale
            for i_g in range(G):
                p_q = q + t0 * (HQ * K) + i_g * K
                b_do = tl.load(do + t0 * (HQ * V) + i_g * V + o_r[:, None] * (HQ * V) + o_v[None, :], mask=m_tv,
                               other=0.0)
                b_dos = b_do.to(tl.float32) * gs[:, None]
                b_dh1, b_dh2, b_dh3, b_dh4 = blocks_update(b_dh1, b_dh2, b_dh3, b_dh4, 1.0, p_q, HQ * K, o_r, m_t,
                                                            b_dos, K, KB, False, IEEE)
    if STORE_DH0:
        blocks_store(dh0 + i_nh.to(tl.int64) * K * V, b_dh1, b_dh2, b_dh3, b_dh4, o_v, m_v, K, V, KB)


@functools.lru_cache(maxsize=256)
def state_bwd_settings(H: int, G: int, K: int, V: int, ieee: bool, bv: int, qdo: bool) -> tuple:
    """``(kernel, constexprs, warps, stages)`` for the state V block ``bv`` (:func:`settings.state_bv`). fp32
    (IEEE) at 3 stages overflows the H200's shared memory at K = 128, so 2."""
    BK = block_k(K)
    return frozen(_state_bwd_kernel, {"H": H, "G": G, "K": K, "V": V, "BT": BT, "KB": min(BK, 64), "BV": bv,
                                      "QDO": qdo, "IEEE": ieee, "USE_DHT": False, "STORE_DH0": False},
                  4, 1 if BK > 128 else (2 if ieee else 3))


def chunk_bwd_dh(*, layout: Layout, q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, gcum: torch.Tensor | None,
                 do: torch.Tensor, dvl: torch.Tensor, dql: torch.Tensor | None, dht: torch.Tensor | None,
                 initial_state: torch.Tensor | None, scale: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(dhs, dh0)``: the gradient of the state leaving every chunk (k's dtype, or float32 for float32
    inputs) and of the initial state (None without one). Overwrites ``dvl`` (``Pᵀdo``) with ``dΔ``: each
    element is read, then written, by one program. ``dql``: stage 1's q term, or None to compute it here."""
    L = layout
    H, K, V, ieee, dev = L.H, L.K, L.V, L.ieee, L.device
    qdo = dql is not None
    dhs = torch.empty(n_slots(L.NC, L.N, 1), H, K, V, dtype=k.dtype if not ieee else torch.float32, device=dev)
    dh0 = torch.empty(L.N, H, K, V, dtype=initial_state.dtype, device=dev) if initial_state is not None else None
    dht = dht.contiguous() if dht is not None else None
    bv = state_bv(K, V, ieee, L.N * H, sms_for(L.N * H, dev))
    fn, c, warps, stages = state_bwd_settings(H, L.G, K, V, ieee, bv, qdo)
    fn[(cdiv(V, c["BV"]), L.N * H)](
        q, k, w, dvl if gcum is None else gcum, do, dvl, dql if qdo else dvl, dhs, dvl, dht if dht is not None else dhs,
        dh0 if dh0 is not None else dhs, L.cu_seqlens, L.chunk_offsets, scale,
        **{**c, "USE_DHT": dht is not None, "STORE_DH0": dh0 is not None}, USE_G=gcum is not None,
        num_warps=warps, num_stages=stages)
    return dhs, dh0

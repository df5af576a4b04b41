"""Triton forward of the decayed linear attention in one pass: the state carried through a chain of chunks
in registers while each chunk's output is made from it, no state ever stored per chunk.

The two-stage forward (``ops/triton/linear_fwd.py``) stores the state entering every chunk and reads it back
in a second, parallel kernel: at K = V = 128 in 16 bits that is 32 KiB written and read per chunk and head,
more than the chunk's q, k and v. Here one program per (V block, chain × KV head) walks its chunks in order
and, for each, makes every query head's output

    ``o_r = scale·(exp(G_r) q_r h + Σ_{j≤r} exp(G_r − G_j) w_j (q_r·k_j) v_j) (+ v_offset_r)``

from the state ``h`` it holds, then carries ``h ← exp(G_C) h + Σ_j exp(G_C − G_j) w_j k_j v_jᵀ`` in float32.

A chain is a whole sequence, or — where whole chains would leave most of the GPU's SMs idle (a few long
sequences: :func:`fused_segment`) — a segment of ``E`` chunks. The state entering each segment then comes
first, from the two-stage forward's own stage 1 told to store no chunk's state
(:func:`~linearize.ops.triton.linear_fwd.linear_fwd_h` with ``hs`` None): each segment's state from zero and
total decay in parallel, then the short chain over the segments. The segments' states are thus made twice,
once without outputs; the states per chunk never exist.

In a chunk, the pair decays ``exp(G_r − G_j)`` are taken from the in-chunk cumulative sums rather than summed
over the g between the two tokens (:func:`~linearize.ops.triton.linear_fwd.pair_decays`): under strong decays
the difference keeps ~1e-4 of absolute error in the exponent, below the 16-bit rounding of the scores they
weigh, so only 16-bit inputs take this pass (:func:`use_fused`); float32 keeps the two stages. Keys up to
128 wide: 256-wide ones would not fit the state and the chunk's tiles in one program's registers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common import cdiv
from .layout import BT, Layout, chain_at
from .linear_fwd import chunk_gates, linear_bv, linear_fwd_h
from .settings import block_k, sms_for

# on, 16-bit forwards take this pass (use_fused); off until its GPU tests (tests/test_linear_fused.py -m gpu) have
# passed: so far it is checked under the interpreter only. scripts/bench_kernels.py --linear-one-pass turns it on
ONE_PASS = False
SEGMENT = 16  # chunks per segment where chains are cut (fused_segment; 0: never cut), halved ...
SEGMENT_MIN = 4  # ... down to this while the segments' programs would not give every SM one


@triton.jit
def _linear_fused_kernel(
    q, k, v, g, w, o, v_offset, hin, ht, cu_seqlens, chunk_offsets, segments, scale,
    H: tl.constexpr, HQ: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
    BV: tl.constexpr, E: tl.constexpr, USE_H0: tl.constexpr, STORE_HT: tl.constexpr, USE_OFFSET: tl.constexpr,
):
    """Per (chain × KV head, V block): the chain's outputs for the HQ / H query heads of its KV head, chunk
    by chunk. ``hin``: float32, the state entering each chain (``E`` = 0: each sequence's initial state,
    read only with ``USE_H0``; ``E`` > 0: [NS, H, K, V], each segment's); ``ht`` gets a whole chain's end."""
    i_nh, i_v = tl.program_id(0), tl.program_id(1)
    i_c, i_h = i_nh // H, i_nh % H
    bos, T, boh, c0, c1 = chain_at(segments, cu_seqlens, chunk_offsets, i_c, E, BT)
    o_k, o_v, o_r = tl.arange(0, BK), i_v * BV + tl.arange(0, BV), tl.arange(0, BT)
    m_k, m_v = o_k < K, o_v < V
    p_h, m_h = o_k[:, None] * V + o_v[None, :], m_k[:, None] & m_v[None, :]
    b_h = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_H0 or E > 0:
        b_h = tl.load(hin + i_nh.to(tl.int64) * K * V + p_h, mask=m_h, other=0.0)
    causal = o_r[:, None] >= o_r[None, :]
    for i_t in range(c0, c1):
        t0 = i_t * BT
        m_t = o_r < T - t0
        rows = bos + t0 + o_r  # (BT,) int64: the chunk's tokens
        m_tk, m_tv = m_t[:, None] & m_k[None, :], m_t[:, None] & m_v[None, :]
        b_k = tl.load(k + (rows * H + i_h)[:, None] * K + o_k[None, :], mask=m_tk, other=0.0)
        b_v = tl.load(v + (rows * H + i_h)[:, None] * V + o_v[None, :], mask=m_tv, other=0.0)
        b_G, b_w, g_last, b_tail = chunk_gates(g + bos * H + i_h, w + bos * H + i_h, t0, o_r, T - t0, H, BT)
        # w_j exp(G_r − G_j) on and below the diagonal (every exponent ≤ 0), 0 above it
        b_dw = tl.exp(tl.where(causal, b_G[:, None] - b_G[None, :], float("-inf"))) * b_w[None, :]
        b_qdec = tl.exp(b_G)[:, None]
        b_hk = b_h.to(b_k.dtype)
        if USE_OFFSET:
            b_off = tl.load(v_offset + (rows * H + i_h)[:, None] * V + o_v[None, :], mask=m_tv, other=0.0).to(tl.float32)
        for i_g in range(HQ // H):  # query heads h·G … h·G + G − 1 read KV head h
            i_hq = i_h * (HQ // H) + i_g
            b_q = tl.load(q + (rows * HQ + i_hq)[:, None] * K + o_k[None, :], mask=m_tk, other=0.0)
            b_s = (tl.dot(b_q, tl.trans(b_k)) * b_dw).to(b_v.dtype)
            b_o = (tl.dot(b_q, b_hk) * b_qdec + tl.dot(b_s, b_v)) * scale
            if USE_OFFSET:
                b_o += b_off
            tl.store(o + (rows * HQ + i_hq)[:, None] * V + o_v[None, :], b_o.to(o.dtype.element_ty), mask=m_tv)
        b_kw = (b_k.to(tl.float32) * (b_w * tl.exp(b_tail))[:, None]).to(b_v.dtype)  # w_j exp(G_C − G_j) k_j
        b_h = b_h * tl.exp(g_last) + tl.dot(tl.trans(b_kw), b_v)
    if STORE_HT:
        tl.store(ht + i_nh.to(tl.int64) * K * V + p_h, b_h, mask=m_h)


def use_fused(layout: Layout) -> bool:
    """Whether the forward takes this one pass: 16-bit inputs and keys up to 128 wide (the module's doc)."""
    return ONE_PASS and not layout.ieee and block_k(layout.K) <= 128


def fused_segment(layout: Layout, device: torch.device) -> int:
    """Chunks per segment of the one pass's chains, or 0 (each sequence one chain). On CUDA, where the whole
    chains' programs — V blocks × (sequence, KV head) pairs — would not reach half of the SMs (a pass holds
    two programs an SM), ``SEGMENT``, halved down to ``SEGMENT_MIN`` while the segments' programs would not
    give every SM one; 0 where the longest sequence is no longer than one segment. Set from an earlier
    version of this pass timed on an H100 (132 SMs, K = V = 128, 16 heads; ``results/ab_linear_kernel_candidates_h100/``):
    at 4×4096 (128 whole-chain programs) whole chains 0.272 ms against cut ones' 0.289; at 2×8192 (64) cut
    0.289 against whole 0.511."""
    L = layout
    sms = sms_for(L.N * L.H, device)
    if sms is None or SEGMENT == 0:
        return 0
    per_chain = cdiv(L.V, linear_bv(L.K, L.V)) * L.H
    if per_chain * L.N >= sms // 2:
        return 0
    E = SEGMENT
    while E > SEGMENT_MIN and per_chain * L.n_groups(E) < sms:
        E //= 2
    return E if L.longest > E else 0


def linear_fused_forward(L: Layout, qf, kf, vf, gf, wf, o, off, h0, ht, scale: float, E: int) -> None:
    """Fill ``o`` (flat ``[tokens, HQ, V]``) and, when given, ``ht`` (float32 ``[N, H, K, V]``) by the one pass
    over chains of ``E`` chunks (0: whole sequences). Flat inputs as ``linear_attention_triton`` makes them;
    ``off``: the flat ``v_offset`` or None; ``h0``: float32 ``[N, H, K, V]`` or None."""
    BK, BV = block_k(L.K), linear_bv(L.K, L.V)
    common = {"H": L.H, "HQ": L.HQ, "K": L.K, "V": L.V, "BT": BT, "BK": BK, "BV": BV, "USE_OFFSET": off is not None,
              "num_warps": 4, "num_stages": 2}
    off = off if off is not None else vf  # a pointer the kernel does not read without USE_OFFSET
    if not E:
        _linear_fused_kernel[(L.N * L.H, cdiv(L.V, BV))](
            qf, kf, vf, gf, wf, o, off, h0 if h0 is not None else o, ht if ht is not None else o, L.cu_seqlens,
            L.chunk_offsets, L.cu_seqlens, float(scale), E=0, USE_H0=h0 is not None, STORE_HT=ht is not None,
            **common)
        return
    # the state entering each segment (no chunk's stored), the sequences' final states with it
    split = linear_fwd_h(layout=L, k=kf, v=vf, g=gf, w=wf, hs=None, h0=h0, ht=ht, segment=E)
    segments, NS = L.groups(E)
    _linear_fused_kernel[(NS * L.H, cdiv(L.V, BV))](
        qf, kf, vf, gf, wf, o, off, split.hin, o, L.cu_seqlens, L.chunk_offsets, segments, float(scale), E=E,
        USE_H0=False, STORE_HT=False, **common)

"""The Taylor front (SPEC §2, ``linearize/ops/taylor.py``) fused into Triton kernels, parallel over chunks.

Per token ``t`` (counted from 1 in its document), from the running sums Σk and Σv (fp32):

    k̄ = Σk/t,  k̃ = k − k̄,  n = ‖k̃‖,  k̂ = k̃/n                  v̄ = Σv/t,  ṽ = v − (Σv − v)/max(t−1, 1)
    β = clip(ρ n/(t−1) · f, 0, β_max) (0 at t = 1)           u = n ṽ/(t β)   (0 where β = 0)
    g = log(1 − 1/t)  (0 at t = 1)

Forward, three launches: the Σk, Σv of each sub-block of every 64-token chunk (one program per chunk and
KV head); an exclusive scan of those per (document, KV head), one row per sub-block — the running sums
entering every sub-block, kept for the backward; then every chunk at once, writing k̂, u, g, β and v̄ (and k̄,
for the window block's mix, where asked).
One program per document walking its whole length left the GPU idle at training shapes (16 rows × 3 KV
heads = 48 programs). The backward recomputes k̄ and v̄ from the kept running sums, bit for bit (the same
float32 operations on the same values), instead of reading float32 copies of them.

The backward is the transpose: the gradient reaching Σk_t and Σv_t is local (from k, v, k̄, v̄ and the
output gradients), so each chunk first sums it, a reverse scan gives the suffix sums over later chunks,
and a second pass over every chunk recomputes the local terms and writes dk, dv, dρ (per token, summed on
the host) and df.

Covers the training path: the stable form, no padding mask, no carried running sums (a prefill or a
decode step still uses the PyTorch front). ``tests/test_triton.py`` checks it against
:func:`linearize.ops.taylor.taylor_front` (values and every gradient) under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common import next_pow2
from .layout import BT, Layout, chunk_at


@triton.jit
def _front_terms(b_k, b_v, b_kbar, b_vbar, t, b_f, rho, beta_max, eps):
    """Per-token terms shared by forward and backward (rows of a chunk, fp32)."""
    tm1 = tl.maximum(t - 1.0, 1.0)
    live = t > 1.0
    b_kc = tl.where(live[:, None], b_k - b_kbar, 0.0)  # k̃ ≡ 0 at a document's first token
    n = tl.sqrt(tl.sum(b_kc * b_kc, axis=1))
    b_vc = b_v - (b_vbar * t[:, None] - b_v) / tm1[:, None]
    b_raw = rho * n / tm1 * b_f
    beta = tl.where(live, tl.minimum(tl.maximum(b_raw, 0.0), beta_max), 0.0)
    coef = tl.where(beta > 0.0, n / (t * tl.maximum(beta, eps)), 0.0)
    return tm1, b_kc, n, b_vc, live, b_raw, beta, coef


@triton.jit
def _chunk_rows(k, v, bf, bos, L, c, i_h, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                BK: tl.constexpr, BV: tl.constexpr, USE_BF: tl.constexpr):
    """Chunk ``c`` of one document and KV head: offsets, masks, t, and k, v, β factor as fp32."""
    o_t = c * BT + tl.arange(0, BT)
    o_k, o_v = tl.arange(0, BK), tl.arange(0, BV)
    m_t = o_t < L
    row = bos + o_t
    p_k = row[:, None] * (H * K) + i_h * K + o_k[None, :]
    p_v = row[:, None] * (H * V) + i_h * V + o_v[None, :]
    m_tk, m_tv = m_t[:, None] & (o_k < K)[None, :], m_t[:, None] & (o_v < V)[None, :]
    b_k = tl.load(k + p_k, mask=m_tk, other=0.0).to(tl.float32)
    b_v = tl.load(v + p_v, mask=m_tv, other=0.0).to(tl.float32)
    b_f = tl.full([BT], 1.0, tl.float32)
    if USE_BF:
        b_f = tl.load(bf + row * H + i_h, mask=m_t, other=1.0).to(tl.float32)
    return row, m_t, p_k, p_v, m_tk, m_tv, (o_t + 1).to(tl.float32), b_k, b_v, b_f


@triton.jit
def _front_sums_kernel(
    k, v, sums, chunk_indices, cu_seqlens, chunk_offsets,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, CH: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
    BV: tl.constexpr,
):
    """Per (chunk, KV head): Σk and Σv over each of the chunk's sub-blocks of BT tokens →
    ``sums[chunk · CH/BT + sub-block, head, :K]`` and ``[K:K+V]``."""
    i_t, i_h = tl.program_id(0), tl.program_id(1)
    bos, L, _, i_c = chunk_at(chunk_indices, cu_seqlens, chunk_offsets, i_t)
    NS: tl.constexpr = CH // BT
    for sub in range(NS):
        rows = _chunk_rows(k, v, k, bos, L, i_c * NS + sub, i_h, H, K, V, BT, BK, BV, False)
        # k, then v, as float32
        _store_sums(sums, i_t * NS + sub, i_h, tl.sum(rows[7], axis=0), tl.sum(rows[8], axis=0), H, K, V, BK, BV)


@triton.jit
def _store_sums(sums, i_t, i_h, acc_k, acc_v, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
                BV: tl.constexpr):
    o_k, o_v = tl.arange(0, BK), tl.arange(0, BV)
    p = sums + (i_t.to(tl.int64) * H + i_h) * (K + V)
    tl.store(p + o_k, acc_k, mask=o_k < K)
    tl.store(p + K + o_v, acc_v, mask=o_v < V)


@triton.jit
def _load_sums(sums, i_t, i_h, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    o_k, o_v = tl.arange(0, BK), tl.arange(0, BV)
    p = sums + (i_t.to(tl.int64) * H + i_h) * (K + V)
    return tl.load(p + o_k, mask=o_k < K, other=0.0), tl.load(p + K + o_v, mask=o_v < V, other=0.0)


@triton.jit
def _front_scan_kernel(sums, chunk_offsets, H: tl.constexpr, W: tl.constexpr, BW: tl.constexpr, REVERSE: tl.constexpr,
                       NS: tl.constexpr):
    """Per (document, KV head), in place over its sums, ``NS`` rows per chunk: the exclusive prefix sums
    (``REVERSE``: the exclusive suffix sums) — the running sums entering each row's tokens. One row of ``W``
    floats per chunk (``NS`` = 1) or per sub-block."""
    i_n, i_h = tl.program_id(0), tl.program_id(1)
    boh = tl.load(chunk_offsets + i_n).to(tl.int64) * NS
    nc = tl.load(chunk_offsets + i_n + 1).to(tl.int64) * NS - boh
    o = tl.arange(0, BW)
    m = o < W
    acc = tl.zeros([BW], dtype=tl.float32)
    for i in range(nc):
        c = boh + (nc - 1 - i if REVERSE else i)
        p = sums + (c * H + i_h) * W + o
        x = tl.load(p, mask=m, other=0.0)
        tl.store(p, acc, mask=m)
        acc += x


@triton.jit
def _front_fwd_kernel(
    k, v, bf, khat, u, g, beta_out, vbar, kbar, rho, sums, chunk_indices, cu_seqlens, chunk_offsets, beta_max, eps,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, CH: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
    BV: tl.constexpr, USE_BF: tl.constexpr, KBAR: tl.constexpr,
):
    """Per (chunk, KV head), from the running sums entering each sub-block (``_front_scan_kernel``'s output).
    ``KBAR``: also write k̄ (float32)."""
    i_t, i_h = tl.program_id(0), tl.program_id(1)
    bos, L, _, i_c = chunk_at(chunk_indices, cu_seqlens, chunk_offsets, i_t)
    r = tl.load(rho + i_h).to(tl.float32)
    NS: tl.constexpr = CH // BT
    for sub in range(NS):
        row, m_t, p_k, p_v, m_tk, m_tv, t, b_k, b_v, b_f = _chunk_rows(k, v, bf, bos, L, i_c * NS + sub, i_h,
                                                                        H, K, V, BT, BK, BV, USE_BF)
        b_kbar, b_vbar = _means(b_k, b_v, t, sums, i_t * NS + sub, i_h, H, K, V, BK, BV)
        tm1, b_kc, n, b_vc, live, b_raw, beta, coef = _front_terms(b_k, b_v, b_kbar, b_vbar, t, b_f, r, beta_max, eps)
        tl.store(khat + p_k, (b_kc / tl.maximum(n, eps)[:, None]).to(khat.dtype.element_ty), mask=m_tk)
        tl.store(u + p_v, (coef[:, None] * b_vc).to(u.dtype.element_ty), mask=m_tv)
        tl.store(g + row * H + i_h, tl.log(tl.where(live, 1.0 - 1.0 / t, 1.0)), mask=m_t)
        tl.store(beta_out + row * H + i_h, beta, mask=m_t)
        tl.store(vbar + p_v, b_vbar, mask=m_tv)
        if KBAR:
            tl.store(kbar + p_k, b_kbar, mask=m_tk)


@triton.jit
def _means(b_k, b_v, t, sums, i_s, i_h, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
           BV: tl.constexpr):
    """``(k̄, v̄)`` of a sub-block's rows: (running sums entering the sub-block + in-block prefix sums) / t.
    The forward and the backward both compute them here, so the backward's are the forward's exactly."""
    carry_k, carry_v = _load_sums(sums, i_s, i_h, H, K, V, BK, BV)
    return ((tl.cumsum(b_k, axis=0) + carry_k[None, :]) / t[:, None],
            (tl.cumsum(b_v, axis=0) + carry_v[None, :]) / t[:, None])


@triton.jit
def _front_bwd_kernel(
    k, v, bf, carry, dkhat, du, dbeta, dvbar, dkbar, dk, dv, dbf, drho, rho, sums, chunk_indices, cu_seqlens,
    chunk_offsets, beta_max, eps,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, CH: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
    BV: tl.constexpr, USE_BF: tl.constexpr, SUMS: tl.constexpr, KBAR: tl.constexpr,
):
    """Per (chunk, KV head). ``SUMS``: only the chunk's totals of ∂L/∂Σk_t and ∂L/∂Σv_t (→ ``sums``, then
    reverse-scanned); otherwise, from the suffix sums over later chunks, every gradient, sub-blocks in reverse.
    ``carry``: the forward's running sums entering every sub-block (k̄ and v̄ are recomputed from them).
    ``KBAR``: k̄ was an output too, with gradient ``dkbar``."""
    i_t, i_h = tl.program_id(0), tl.program_id(1)
    bos, L, _, i_c = chunk_at(chunk_indices, cu_seqlens, chunk_offsets, i_t)
    r = tl.load(rho + i_h).to(tl.float32)
    if SUMS:
        suf_k = tl.zeros([BK], dtype=tl.float32)
        suf_v = tl.zeros([BV], dtype=tl.float32)
    else:
        suf_k, suf_v = _load_sums(sums, i_t, i_h, H, K, V, BK, BV)  # Σ over later chunks of ∂L/∂Σk_t, ∂L/∂Σv_t
    NS: tl.constexpr = CH // BT
    for i in range(NS):
        row, m_t, p_k, p_v, m_tk, m_tv, t, b_k, b_v, b_f = _chunk_rows(k, v, bf, bos, L, i_c * NS + NS - 1 - i, i_h,
                                                                        H, K, V, BT, BK, BV, USE_BF)
        b_kbar, b_vbar = _means(b_k, b_v, t, carry, i_t * NS + NS - 1 - i, i_h, H, K, V, BK, BV)
        tm1, b_kc, n, b_vc, live, b_raw, beta, coef = _front_terms(b_k, b_v, b_kbar, b_vbar, t, b_f, r, beta_max, eps)

        b_dkhat = tl.load(dkhat + p_k, mask=m_tk, other=0.0).to(tl.float32)
        b_du = tl.load(du + p_v, mask=m_tv, other=0.0).to(tl.float32)
        b_dbeta = tl.load(dbeta + row * H + i_h, mask=m_t, other=0.0).to(tl.float32)
        b_dvbar = tl.load(dvbar + p_v, mask=m_tv, other=0.0).to(tl.float32)
        # u = coef ṽ,  coef = n / (t · max(β, eps))
        dcoef = tl.sum(b_du * b_vc, axis=1)
        b_dvc = coef[:, None] * b_du
        pos = beta > 0.0
        dn = tl.where(pos, dcoef / (t * tl.maximum(beta, eps)), 0.0)
        dbeta_all = b_dbeta - tl.where(pos & (beta >= eps), dcoef * n / (t * beta * beta), 0.0)
        # β = clip(ρ n/(t−1) · f, 0, β_max) where live
        draw = tl.where(live & (b_raw >= 0.0) & (b_raw <= beta_max), dbeta_all, 0.0)
        dn += draw * r * b_f / tm1
        # k̂ = k̃ / max(n, eps),  n = ‖k̃‖
        nn = tl.maximum(n, eps)
        b_dkc = b_dkhat / nn[:, None]
        dn += tl.where(n >= eps, -tl.sum(b_dkhat * b_kc, axis=1) / (nn * nn), 0.0)
        b_dkc += dn[:, None] * tl.where((n > 0.0)[:, None], b_kc / tl.where(n > 0.0, n, 1.0)[:, None], 0.0)
        # k̃ = k − Σk/t (0 at t = 1);  ṽ = v − (Σv − v)/max(t−1, 1);  v̄ = Σv/t;  Σ = prefix sums in the document
        b_dkc = tl.where(live[:, None], b_dkc, 0.0)
        d_sk = tl.where(m_tk, -b_dkc / t[:, None], 0.0)
        if KBAR:  # k̄ = Σk/t
            d_sk += tl.where(m_tk, tl.load(dkbar + p_k, mask=m_tk, other=0.0) / t[:, None], 0.0)
        d_sv = tl.where(m_tv, -b_dvc / tm1[:, None] + b_dvbar / t[:, None], 0.0)
        if not SUMS:
            tl.store(drho + row * H + i_h, draw * n * b_f / tm1, mask=m_t)
            if USE_BF:
                tl.store(dbf + row * H + i_h, draw * r * n / tm1, mask=m_t)
            rev_k = tl.sum(d_sk, axis=0)[None, :] - tl.cumsum(d_sk, axis=0) + d_sk + suf_k[None, :]
            rev_v = tl.sum(d_sv, axis=0)[None, :] - tl.cumsum(d_sv, axis=0) + d_sv + suf_v[None, :]
            tl.store(dk + p_k, (b_dkc + rev_k).to(dk.dtype.element_ty), mask=m_tk)
            tl.store(dv + p_v, (b_dvc * (1.0 + 1.0 / tm1)[:, None] + rev_v).to(dv.dtype.element_ty), mask=m_tv)
        suf_k += tl.sum(d_sk, axis=0)
        suf_v += tl.sum(d_sv, axis=0)
    if SUMS:
        _store_sums(sums, i_t, i_h, suf_k, suf_v, H, K, V, BK, BV)


FRONT_WARPS = 8


def _blocks(K: int, V: int) -> tuple[int, int, int]:
    """(sub-block rows, BK, BV): a chunk is walked in sub-blocks of 2048 // max(BK, BV) rows — at 8 warps the
    sm_90 builds of both kernels then spill nothing at K = V = 64, 128 and 256 (32, 16 and 8 rows), where
    64-row blocks at 4 warps spilled 0.8–7 KB per thread."""
    BK, BV = next_pow2(K), next_pow2(V)
    return min(BT, max(8, 2048 // max(BK, BV))), BK, BV


def _scan(L: Layout, sums, reverse: bool, rows_per_chunk: int = 1):
    """The running sums entering every chunk or sub-block (reverse: the sums over every later chunk), in place."""
    W = sums.shape[-1]
    _front_scan_kernel[(L.N, L.H)](sums, L.chunk_offsets, H=L.H, W=W, BW=next_pow2(W), REVERSE=reverse,
                                   NS=rows_per_chunk, num_warps=1)


class FusedTaylorFront(torch.autograd.Function):
    """Chunk-parallel: every kernel but the scan runs one program per (64-token chunk, KV head); the scan
    runs per (document, KV head) over one row of sums per sub-block (forward) or per chunk (backward)."""

    @staticmethod
    def forward(ctx, k, v, rho, beta_factor, cu_seqlens, beta_max, eps, with_k_mean=False):
        B, T, H, K = k.shape
        V = v.shape[-1]
        L = Layout(k, v, cu_seqlens)
        kf, vf = Layout.flat(k, v)
        bff = beta_factor.contiguous().view(B * T, H) if beta_factor is not None else kf
        f32 = dict(dtype=torch.float32, device=k.device)
        # k̂ and u in the inputs' dtype (what the operator takes); v̄ and everything inside in float32
        khat = torch.empty(B * T, H, K, dtype=k.dtype, device=k.device)
        u, vbar = torch.empty(B * T, H, V, dtype=v.dtype, device=k.device), torch.empty(B * T, H, V, **f32)
        g, beta = torch.empty(B * T, H, **f32), torch.empty(B * T, H, **f32)
        kbar = torch.empty(B * T, H, K, **f32) if with_k_mean else vbar
        sub, BK, BV = _blocks(K, V)
        # the running sums entering every sub-block, kept for the backward (K + V floats per sub-block and head)
        carry = torch.empty(max(L.NC, 1) * (BT // sub), H, K + V, **f32)
        if L.NC:
            tables = (L.chunk_indices, L.cu_seqlens, L.chunk_offsets)
            _front_sums_kernel[(L.NC, H)](kf, vf, carry, *tables, H=H, K=K, V=V, CH=BT, BT=sub, BK=BK, BV=BV,
                                          num_warps=FRONT_WARPS)
            _scan(L, carry, reverse=False, rows_per_chunk=BT // sub)
            _front_fwd_kernel[(L.NC, H)](kf, vf, bff, khat, u, g, beta, vbar, kbar, rho.contiguous(), carry, *tables,
                                        float(beta_max), float(eps), H=H, K=K, V=V, CH=BT, BT=sub, BK=BK, BV=BV,
                                        USE_BF=beta_factor is not None, KBAR=with_k_mean, num_warps=FRONT_WARPS)
        ctx.save_for_backward(kf, vf, beta_factor, carry, rho, cu_seqlens)
        ctx.meta = (B, T, H, K, V, float(beta_max), float(eps), with_k_mean)
        return tuple(x.view(B, T, *x.shape[1:]) for x in (khat, u, g, beta, vbar) + ((kbar,) if with_k_mean else ()))

    @staticmethod
    def backward(ctx, dkhat, du, dg, dbeta, dvbar, dkbar=None):
        kf, vf, beta_factor, carry, rho, cu_seqlens = ctx.saved_tensors
        B, T, H, K, V, beta_max, eps, with_k_mean = ctx.meta
        L = Layout(kf.view(B, T, H, K), vf.view(B, T, H, V), cu_seqlens)
        f32 = dict(dtype=torch.float32, device=kf.device)
        grads = [x.contiguous().view(B * T, *x.shape[2:]) if x is not None else torch.zeros((B * T, H, *s), **f32)
                 for x, s in ((dkhat, (K,)), (du, (V,)), (dbeta, ()), (dvbar, (V,)),
                              *([(dkbar, (K,))] if with_k_mean else []))]
        if not with_k_mean:  # the kernel reads no dkbar: any pointer will do
            grads.append(grads[0])
        # dk, dv in k's and v's dtypes: the kernel rounds its float32 values once, as it stores them
        dk, dv = torch.empty(B * T, H, K, dtype=kf.dtype, device=kf.device), torch.empty(B * T, H, V, dtype=vf.dtype, device=kf.device)
        drho = torch.empty(B * T, H, **f32)
        dbf = torch.empty(B * T, H, **f32) if beta_factor is not None else drho
        bff = beta_factor.contiguous().view(B * T, H) if beta_factor is not None else kf
        sub, BK, BV = _blocks(K, V)
        sums = torch.empty(max(L.NC, 1), H, K + V, **f32)
        if L.NC:
            args = (kf, vf, bff, carry, *grads, dk, dv, dbf, drho, rho.contiguous(), sums, L.chunk_indices,
                    L.cu_seqlens, L.chunk_offsets, beta_max, eps)
            meta = dict(H=H, K=K, V=V, CH=BT, BT=sub, BK=BK, BV=BV, USE_BF=beta_factor is not None, KBAR=with_k_mean,
                        num_warps=FRONT_WARPS)
            _front_bwd_kernel[(L.NC, H)](*args, SUMS=True, **meta)
            _scan(L, sums, reverse=True)
            _front_bwd_kernel[(L.NC, H)](*args, SUMS=False, **meta)
        dbf_out = dbf.view(B, T, H).to(beta_factor.dtype) if beta_factor is not None else None
        return (dk.view(B, T, H, K), dv.view(B, T, H, V), drho.sum(0).to(rho.dtype),
                dbf_out, None, None, None, None)


def taylor_front_triton(k, v, rho, beta_max, beta_factor=None, cu_seqlens=None, eps=1e-12, k_mean=False):
    """``(k̂, u, g, β, v̄)`` of the stable Taylor form, as :func:`linearize.ops.taylor.taylor_front` computes
    them without a mask or carried sums. ``rho``: ``(H,)`` tensor. k and v may be bf16/fp16: the kernels
    compute in float32 and return k̂ and u in k's and v's dtype (g, β, v̄ in float32); the gradients of k
    and v come back in their dtypes. ``k_mean``: also return k̄ ``(B, T, H, K)`` float32, last (the window
    block's mix reads it; its gradient flows back through the same prefix sums)."""
    return FusedTaylorFront.apply(k, v, rho, beta_factor, cu_seqlens, beta_max, eps, k_mean)

"""The Taylor front (SPEC §2, ``linearize/ops/taylor.py``) fused into one Triton kernel each way.

Forward, per (document, KV head), one pass over time in chunks of ``BT`` tokens carrying the running
sums Σk and Σv (fp32) from chunk to chunk; per token ``t`` (counted from 1 in its document):

    k̄ = Σk/t,  k̃ = k − k̄,  n = ‖k̃‖,  k̂ = k̃/n                  v̄ = Σv/t,  ṽ = v − (Σv − v)/max(t−1, 1)
    β = clip(ρ n/(t−1) · f, 0, β_max) (0 at t = 1)           u = n ṽ/(t β)   (0 where β = 0)
    g = log(1 − 1/t)  (0 at t = 1)

It writes k̂, u, g, β, v̄ and k̄ (kept for the backward). The backward runs the same chunks in reverse,
recomputes every local term from k, v, k̄, v̄, and carries the suffix sums of ∂L/∂Σk and ∂L/∂Σv
(the transpose of the prefix sums). ρ's gradient is written per token and summed on the host.

Covers the training path: the stable form, no padding mask, no carried running sums (a prefill or a
decode step still uses the PyTorch front). ``tests/test_triton.py`` checks it against
:func:`linearize.ops.taylor.taylor_front` (values and every gradient) under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .chunk_fwd import Layout


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
def _front_fwd_kernel(
    k, v, bf, khat, u, g, beta_out, vbar, kbar, rho, cu_seqlens, beta_max, eps,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    USE_BF: tl.constexpr,
):
    i_n, i_h = tl.program_id(0), tl.program_id(1)
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    L = tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos
    r = tl.load(rho + i_h).to(tl.float32)
    carry_k = tl.zeros([BK], dtype=tl.float32)
    carry_v = tl.zeros([BV], dtype=tl.float32)
    for c in range(tl.cdiv(L, BT)):
        row, m_t, p_k, p_v, m_tk, m_tv, t, b_k, b_v, b_f = _chunk_rows(k, v, bf, bos, L, c, i_h, H, K, V, BT, BK, BV,
                                                                        USE_BF)
        s_k = tl.cumsum(b_k, axis=0) + carry_k[None, :]
        s_v = tl.cumsum(b_v, axis=0) + carry_v[None, :]
        carry_k += tl.sum(b_k, axis=0)
        carry_v += tl.sum(b_v, axis=0)
        b_kbar = s_k / t[:, None]
        b_vbar = s_v / t[:, None]
        tm1, b_kc, n, b_vc, live, b_raw, beta, coef = _front_terms(b_k, b_v, b_kbar, b_vbar, t, b_f, r, beta_max, eps)
        tl.store(khat + p_k, b_kc / tl.maximum(n, eps)[:, None], mask=m_tk)
        tl.store(u + p_v, coef[:, None] * b_vc, mask=m_tv)
        tl.store(g + row * H + i_h, tl.log(tl.where(live, 1.0 - 1.0 / t, 1.0)), mask=m_t)
        tl.store(beta_out + row * H + i_h, beta, mask=m_t)
        tl.store(vbar + p_v, b_vbar, mask=m_tv)
        tl.store(kbar + p_k, b_kbar, mask=m_tk)


@triton.jit
def _front_bwd_kernel(
    k, v, bf, kbar, vbar, dkhat, du, dbeta, dvbar, dk, dv, dbf, drho, rho, cu_seqlens, beta_max, eps,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    USE_BF: tl.constexpr,
):
    i_n, i_h = tl.program_id(0), tl.program_id(1)
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    L = tl.load(cu_seqlens + i_n + 1).to(tl.int64) - bos
    r = tl.load(rho + i_h).to(tl.float32)
    suf_k = tl.zeros([BK], dtype=tl.float32)  # Σ over later chunks of ∂L/∂Σk_t
    suf_v = tl.zeros([BV], dtype=tl.float32)
    NT = tl.cdiv(L, BT)
    for i in range(NT):
        row, m_t, p_k, p_v, m_tk, m_tv, t, b_k, b_v, b_f = _chunk_rows(k, v, bf, bos, L, NT - 1 - i, i_h, H, K, V, BT,
                                                                        BK, BV, USE_BF)
        b_kbar = tl.load(kbar + p_k, mask=m_tk, other=0.0)
        b_vbar = tl.load(vbar + p_v, mask=m_tv, other=0.0)
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
        tl.store(drho + row * H + i_h, draw * n * b_f / tm1, mask=m_t)
        if USE_BF:
            tl.store(dbf + row * H + i_h, draw * r * n / tm1, mask=m_t)
        # k̂ = k̃ / max(n, eps),  n = ‖k̃‖
        nn = tl.maximum(n, eps)
        b_dkc = b_dkhat / nn[:, None]
        dn += tl.where(n >= eps, -tl.sum(b_dkhat * b_kc, axis=1) / (nn * nn), 0.0)
        b_dkc += dn[:, None] * tl.where((n > 0.0)[:, None], b_kc / tl.where(n > 0.0, n, 1.0)[:, None], 0.0)
        # k̃ = k − Σk/t (0 at t = 1);  ṽ = v − (Σv − v)/max(t−1, 1);  v̄ = Σv/t;  Σ = prefix sums in the document
        b_dkc = tl.where(live[:, None], b_dkc, 0.0)
        d_sk = -b_dkc / t[:, None]
        d_sv = -b_dvc / tm1[:, None] + b_dvbar / t[:, None]
        rev_k = tl.sum(d_sk, axis=0)[None, :] - tl.cumsum(d_sk, axis=0) + d_sk + suf_k[None, :]
        rev_v = tl.sum(d_sv, axis=0)[None, :] - tl.cumsum(d_sv, axis=0) + d_sv + suf_v[None, :]
        suf_k += tl.sum(d_sk, axis=0)
        suf_v += tl.sum(d_sv, axis=0)
        tl.store(dk + p_k, b_dkc + rev_k, mask=m_tk)
        tl.store(dv + p_v, b_dvc * (1.0 + 1.0 / tm1)[:, None] + rev_v, mask=m_tv)


def _blocks(K: int, V: int) -> tuple[int, int, int]:
    BK, BV = triton.next_power_of_2(K), triton.next_power_of_2(V)
    return (64 if max(BK, BV) <= 128 else 16), BK, BV


class FusedTaylorFront(torch.autograd.Function):
    @staticmethod
    def forward(ctx, k, v, rho, beta_factor, cu_seqlens, beta_max, eps):
        B, T, H, K = k.shape
        V = v.shape[-1]
        L = Layout(k, v, cu_seqlens)
        kf, vf = Layout.flat(k, v)
        bff = beta_factor.contiguous().view(B * T, H) if beta_factor is not None else kf
        f32 = dict(dtype=torch.float32, device=k.device)
        khat, kbar = torch.empty(B * T, H, K, **f32), torch.empty(B * T, H, K, **f32)
        u, vbar = torch.empty(B * T, H, V, **f32), torch.empty(B * T, H, V, **f32)
        g, beta = torch.empty(B * T, H, **f32), torch.empty(B * T, H, **f32)
        BT, BK, BV = _blocks(K, V)
        _front_fwd_kernel[(L.N, H)](kf, vf, bff, khat, u, g, beta, vbar, kbar, rho.contiguous(), L.cu_seqlens,
                                    float(beta_max), float(eps), H=H, K=K, V=V, BT=BT, BK=BK, BV=BV,
                                    USE_BF=beta_factor is not None, num_warps=4)
        ctx.save_for_backward(kf, vf, beta_factor, kbar, vbar, rho, cu_seqlens)
        ctx.meta = (B, T, H, K, V, float(beta_max), float(eps))
        return tuple(x.view(B, T, *x.shape[1:]) for x in (khat, u, g, beta, vbar))

    @staticmethod
    def backward(ctx, dkhat, du, dg, dbeta, dvbar):
        kf, vf, beta_factor, kbar, vbar, rho, cu_seqlens = ctx.saved_tensors
        B, T, H, K, V, beta_max, eps = ctx.meta
        L = Layout(kf.view(B, T, H, K), vf.view(B, T, H, V), cu_seqlens)
        zeros = lambda shape: torch.zeros(shape, dtype=torch.float32, device=kf.device)  # noqa: E731
        grads = [x.contiguous().view(B * T, *x.shape[2:]) if x is not None else zeros((B * T, H, *s))
                 for x, s in ((dkhat, (K,)), (du, (V,)), (dbeta, ()), (dvbar, (V,)))]
        dk, dv = torch.empty(B * T, H, K, dtype=torch.float32, device=kf.device), torch.empty(B * T, H, V, dtype=torch.float32, device=kf.device)
        drho = torch.empty(B * T, H, dtype=torch.float32, device=kf.device)
        dbf = torch.empty(B * T, H, dtype=torch.float32, device=kf.device) if beta_factor is not None else drho
        bff = beta_factor.contiguous().view(B * T, H) if beta_factor is not None else kf
        BT, BK, BV = _blocks(K, V)
        _front_bwd_kernel[(L.N, H)](kf, vf, bff, kbar, vbar, *grads, dk, dv, dbf, drho, rho.contiguous(), L.cu_seqlens,
                                    beta_max, eps, H=H, K=K, V=V, BT=BT, BK=BK, BV=BV,
                                    USE_BF=beta_factor is not None, num_warps=4)
        dbf_out = dbf.view(B, T, H).to(beta_factor.dtype) if beta_factor is not None else None
        return (dk.view(B, T, H, K).to(kf.dtype), dv.view(B, T, H, V).to(vf.dtype), drho.sum(0).to(rho.dtype),
                dbf_out, None, None, None)


def taylor_front_triton(k, v, rho, beta_max, beta_factor=None, cu_seqlens=None, eps=1e-12):
    """``(k̂, u, g, β, v̄)`` of the stable Taylor form, float32, as :func:`linearize.ops.taylor.taylor_front`
    computes them without a mask or carried sums. ``rho``: ``(H,)`` tensor."""
    return FusedTaylorFront.apply(k, v, rho, beta_factor, cu_seqlens, beta_max, eps)

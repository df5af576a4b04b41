"""Hand-written backward of the chunkwise gated delta rule, in PyTorch (the twin of a Triton backward).

Forward, per chunk, as in ``chunk.py`` (q already scaled; h0 the state entering the chunk):

    A = strict-lower((β k) kᵀ ⊙ D),  D_rj = γ_r/γ_j,  T = (I + A)⁻¹
    W = T (β γ k),  U = T (β v),  Δ = U − W h0
    o = γ ⊙ (q h0) + P Δ,  P = causal(q kᵀ ⊙ D)
    h1 = γ_C h0 + K̃ᵀ Δ,  K̃_j = k_j γ_C/γ_j

Backward: one reverse pass over chunks carries the state gradient

    dΔ = Pᵀ do + K̃ dh1,   dh0 = γ_C dh1 + (γ ⊙ q)ᵀ do − Wᵀ dΔ

and everything else is batched over chunks: through P (dq, dk), K̃ and γ_C (dk, decay), U and W
(dv, dβ, dk through T: dA = −Tᵀ dT Tᵀ), A (dk, dβ, decay), and finally dg = reverse cumsum of the
gradient of the cumulative log-decay G. Autograd is not involved, so no graph over chunks is kept.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .chunk import CHUNK
from .common import compute_dtype, time_spans


def _bwd_one(q, k, v, g, beta, h0, do, dht, chunk):
    """One sequence. q: (L, Hq, K) scaled; k: (L, H, K); v: (L, H, V); g, beta: (L, H); h0: (H, K, V);
    do: (L, Hq, V); dht: (H, K, V) or None. Returns dq, dk, dv, dg, dbeta, dh0 in the same layouts."""
    L, Hq, K = q.shape
    H, V = v.shape[1], v.shape[2]
    G = Hq // H
    if L == 0:
        z = q.new_zeros
        return z(0, Hq, K), z(0, H, K), z(0, H, V), z(0, H), z(0, H), (dht if dht is not None else torch.zeros_like(h0))
    pad = (-L) % chunk
    if pad:
        q, k, v, do = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v, do))
        g, beta = (F.pad(x, (0, 0, 0, pad)) for x in (g, beta))
    n, C = (L + pad) // chunk, chunk
    q = q.view(n, C, H, G, K).permute(0, 2, 3, 1, 4)  # (n, H, G, C, K)
    do = do.view(n, C, H, G, V).permute(0, 2, 3, 1, 4)  # (n, H, G, C, V)
    k = k.view(n, C, H, K).transpose(1, 2)  # (n, H, C, K)
    v = v.view(n, C, H, V).transpose(1, 2)  # (n, H, C, V)
    Gc = g.view(n, C, H).transpose(1, 2).cumsum(-1)  # (n, H, C)
    beta = beta.view(n, C, H).transpose(1, 2)  # (n, H, C)

    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    decay = (Gc[..., :, None] - Gc[..., None, :]).masked_fill(~causal, float("-inf")).exp()  # (n, H, C, C)
    gam = Gc.exp()  # γ_r
    gam_C = gam[..., -1]  # (n, H)
    e = (Gc[..., -1:] - Gc).exp()  # γ_C/γ_j
    kb = k * beta[..., None]
    S = kb @ k.transpose(-1, -2)
    A = (S * decay).tril(-1)
    eye = torch.eye(C, dtype=q.dtype, device=q.device)
    Tm = torch.linalg.solve_triangular(A + eye, eye.expand_as(A), upper=False, unitriangular=True)
    bgk = kb * gam[..., None]  # β γ k
    bv = v * beta[..., None]
    W, U = Tm @ bgk, Tm @ bv
    Kt = k * e[..., None]  # K̃

    # forward states again: the state entering every chunk and Δ
    hs, deltas = [], []
    h = h0
    for i in range(n):
        hs.append(h)
        d = U[i] - W[i] @ h
        deltas.append(d)
        h = gam_C[i, :, None, None] * h + Kt[i].transpose(-1, -2) @ d
    Hs, Dl = torch.stack(hs), torch.stack(deltas)  # (n, H, K, V), (n, H, C, V)

    P = (q @ k[:, :, None].transpose(-1, -2)) * decay[:, :, None]  # (n, H, G, C, C)
    qg = q * gam[:, :, None, :, None]  # γ ⊙ q
    PtDo = (P.transpose(-1, -2) @ do).sum(2)  # (n, H, C, V)
    Qdo = (qg.transpose(-1, -2) @ do).sum(2)  # (n, H, K, V)

    dh = dht if dht is not None else torch.zeros_like(h0)
    dDl, dH1 = [None] * n, [None] * n
    for i in reversed(range(n)):
        dH1[i] = dh
        dd = PtDo[i] + Kt[i] @ dh
        dDl[i] = dd
        dh = gam_C[i, :, None, None] * dh + Qdo[i] - W[i].transpose(-1, -2) @ dd
    dh0 = dh
    dDl, dH1 = torch.stack(dDl), torch.stack(dH1)

    # through P and the γ ⊙ (q h0) term
    dP = (do @ Dl[:, :, None].transpose(-1, -2)) * causal  # (n, H, G, C, C)
    dPd = dP * decay[:, :, None]
    dq = (do @ Hs[:, :, None].transpose(-1, -2)) * gam[:, :, None, :, None] + dPd @ k[:, :, None]
    dk = (dPd.transpose(-1, -2) @ q).sum(2)
    dG = torch.zeros_like(Gc)
    M = (dP * P).sum(2)  # ∂/∂(log D_rj) summed over query heads
    dG += M.sum(-1) - M.sum(-2)
    dG += (do * (qg @ Hs[:, :, None])).sum((2, 4))  # γ_r in front of q_r h0
    # through K̃ = k ⊙ e and γ_C h0
    dKt = Dl @ dH1.transpose(-1, -2)  # (n, H, C, K)
    dk += dKt * e[..., None]
    de = (dKt * Kt).sum(-1)  # (n, H, C): ∂/∂ log e_j
    dG -= de
    dG[..., -1] += de.sum(-1) + gam_C * (dH1 * Hs).sum((-1, -2))
    # through Δ = U − W h0
    dU, dW = dDl, -(dDl @ Hs.transpose(-1, -2))
    TtdU, TtdW = Tm.transpose(-1, -2) @ dU, Tm.transpose(-1, -2) @ dW
    dv = beta[..., None] * TtdU
    dbeta = (TtdU * v).sum(-1) + gam * (TtdW * k).sum(-1)
    dk += (beta * gam)[..., None] * TtdW
    dG += beta * gam * (TtdW * k).sum(-1)
    # through T = (I + A)^-1 and A = strict-lower((β k) kᵀ ⊙ D)
    dT = dU @ bv.transpose(-1, -2) + dW @ bgk.transpose(-1, -2)
    dA = -(Tm.transpose(-1, -2) @ dT @ Tm.transpose(-1, -2)).tril(-1)
    dS = dA * decay
    dkb = dS @ k
    dk += dS.transpose(-1, -2) @ kb + beta[..., None] * dkb
    dbeta += (dkb * k).sum(-1)
    M2 = dA * A
    dG += M2.sum(-1) - M2.sum(-2)
    dg = dG.flip(-1).cumsum(-1).flip(-1)  # G = cumsum(g) within the chunk

    dq = dq.permute(0, 3, 1, 2, 4).reshape(n * C, Hq, K)[:L]
    dk = dk.transpose(1, 2).reshape(n * C, H, K)[:L]
    dv = dv.transpose(1, 2).reshape(n * C, H, V)[:L]
    dg = dg.transpose(1, 2).reshape(n * C, H)[:L]
    dbeta = dbeta.transpose(1, 2).reshape(n * C, H)[:L]
    return dq, dk, dv, dg, dbeta, dh0


@torch.no_grad()
def gated_delta_rule_chunk_bwd(q, k, v, g, beta, scale, initial_state, do, dht, cu_seqlens=None, chunk_size=CHUNK):
    """Gradients of :func:`linearize.ops.chunk.gated_delta_rule_chunk` w.r.t. every input, computed
    in float32 (float64 for float64). Returns ``(dq, dk, dv, dg, dbeta, dh0)``, each in its input's dtype."""
    B, T, Hq, K = q.shape
    H, V = v.shape[2], v.shape[3]
    dt = compute_dtype(q.dtype)
    qs = q.to(dt) * scale
    k_, v_, g_, b_, do_ = (x.to(dt) for x in (k, v, g, beta, do))
    if cu_seqlens is None:  # fold the batch into the head axis, as the forward does
        fold = lambda x: x.transpose(0, 1).reshape(T, B * x.shape[2], *x.shape[3:])
        h0 = initial_state.to(dt).reshape(B * H, K, V) if initial_state is not None else qs.new_zeros(B * H, K, V)
        dh_t = dht.to(dt).reshape(B * H, K, V) if dht is not None else None
        outs = _bwd_one(fold(qs), fold(k_), fold(v_), fold(g_), fold(b_), h0, fold(do_), dh_t, chunk_size)
        unfold = lambda x, h: x.view(T, B, h, *x.shape[2:]).transpose(0, 1)
        dq, dk, dv, dg, db = (unfold(x, h) for x, h in zip(outs[:5], (Hq, H, H, H, H)))
        dh0 = outs[5].view(B, H, K, V)
    else:
        parts = []
        for n, (s, e) in enumerate(time_spans(T, cu_seqlens)):
            h0 = initial_state[n].to(dt) if initial_state is not None else qs.new_zeros(H, K, V)
            dh_t = dht[n].to(dt) if dht is not None else None
            parts.append(_bwd_one(qs[0, s:e], k_[0, s:e], v_[0, s:e], g_[0, s:e], b_[0, s:e], h0, do_[0, s:e],
                                  dh_t, chunk_size))
        dq, dk, dv, dg, db = (torch.cat([p[i] for p in parts])[None] for i in range(5))
        dh0 = torch.stack([p[5] for p in parts])
    dq = dq * scale
    return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dg.to(g.dtype), db.to(beta.dtype),
            dh0.to(initial_state.dtype) if initial_state is not None else None)

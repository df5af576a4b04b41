"""Chunkwise gated delta rule in PyTorch (WY/UT form, seed 002), for the CPU and as a fallback.

Inside a chunk of C positions with cumulative log-decay ``G_r = Σ_{s≤r} g_s`` and ``γ_r = exp(G_r)``,
the per-position corrections ``δ_r = β_r (v_r − α_r h_{r−1}ᵀ k_r)`` solve one unit lower-triangular
system (the UT transform):

    (I + A) Δ = B V − (B Γ K) h_0,   A_rj = β_r (k_r·k_j) γ_r/γ_j  for j < r
    ⇒ Δ = U − W h_0,   U = (I + A)⁻¹ B V,   W = (I + A)⁻¹ B Γ K

and then, with ``h_0`` the state entering the chunk,

    o_r = γ_r h_0ᵀ q_r + Σ_{j≤r} (γ_r/γ_j)(q_r·k_j) δ_j
    h_C = γ_C h_0 + Σ_j (γ_C/γ_j) k_j δ_jᵀ.

Everything but the short loop that carries ``h`` from chunk to chunk is batched matrix work, and
autograd differentiates it as it stands.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .common import check_inputs, chunked_over_sequences

CHUNK = 64


def _chunk_one(q, k, v, g, beta, h, chunk):
    """One sequence. q: (L, Hq, K); k: (L, H, K); v: (L, H, V); g, beta: (L, H); h: (H, K, V)."""
    L, Hq, K = q.shape
    H, V = v.shape[1], v.shape[2]
    G = Hq // H
    if L == 0:
        return q.new_zeros(0, Hq, V), h
    pad = (-L) % chunk
    if pad:  # zero k, v, beta and g = 0 leave the state untouched
        q, k, v = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (F.pad(x, (0, 0, 0, pad)) for x in (g, beta))
    n = (L + pad) // chunk
    # chunk-major layouts, contiguous, so that the loop below slices whole blocks
    q = q.view(n, chunk, H, G, K).permute(0, 2, 3, 1, 4).reshape(n, H, G * chunk, K)  # rows (g, c)
    k = k.view(n, chunk, H, K).transpose(1, 2).contiguous()  # (n, H, C, K)
    v = v.view(n, chunk, H, V).transpose(1, 2).contiguous()  # (n, H, C, V)
    g = g.view(n, chunk, H).transpose(1, 2).cumsum(-1)  # (n, H, C): G_r
    beta = beta.view(n, chunk, H).transpose(1, 2)  # (n, H, C)

    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    # γ_r/γ_j for j ≤ r; masked before exp so that nothing overflows above the diagonal
    decay = (g[..., :, None] - g[..., None, :]).masked_fill(~causal, float("-inf")).exp()  # (n, H, C, C)

    kb = k * beta[..., None]
    A = (kb @ k.transpose(-1, -2) * decay).tril(-1)  # strictly lower
    eye = torch.eye(chunk, dtype=q.dtype, device=q.device)
    rhs = torch.cat([kb * g.exp()[..., None], v * beta[..., None]], dim=-1)  # (n, H, C, K+V)
    WU = torch.linalg.solve_triangular(A + eye, rhs, upper=False, unitriangular=True)
    W, U = WU[..., :K], WU[..., K:]

    qk = (q @ k.transpose(-1, -2)).view(n, H, G, chunk, chunk) * decay[:, :, None]  # causal incl. diagonal
    qk = qk.view(n, H, G * chunk, chunk)
    q_decayed = (q.view(n, H, G, chunk, K) * g.exp()[:, :, None, :, None]).view(n, H, G * chunk, K)
    k_to_end = (k * (g[..., -1:] - g).exp()[..., None]).transpose(-1, -2).contiguous()  # (n, H, K, C)
    chunk_decay = g[..., -1, None, None].exp()  # (n, H, 1, 1)

    outs = []
    for i in range(n):
        delta = U[i] - W[i] @ h  # (H, C, V)
        outs.append(q_decayed[i] @ h + qk[i] @ delta)  # (H, G·C, V)
        h = chunk_decay[i] * h + k_to_end[i] @ delta
    o = torch.stack(outs).view(n, H, G, chunk, V).permute(0, 3, 1, 2, 4).reshape(n * chunk, Hq, V)[:L]
    return o, h


def gated_delta_rule_chunk(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float = 1.0,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    chunk_size: int = CHUNK,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunkwise GDN. Same contract as :func:`linearize.ops.reference.gated_delta_rule_reference`."""
    check_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    return chunked_over_sequences(_chunk_one, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                                  chunk_size)

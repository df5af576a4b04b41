"""Kimi Delta Attention (KDA): the gated delta rule with one decay per key channel.

    h_t = (I − β_t k_t k_tᵀ) Diag(α_t) h_{t−1} + β_t k_t v_tᵀ,   o_t = h_tᵀ q_t,   α_t = exp(g_t) ∈ (0, 1]^K

with ``h`` the ``[K, V]`` state (``Sᵀ``: ``S_{t−1} Diag(α_t)`` scales column i of S, row i of h, by ``α_t,i``).
With ``g_t,i = g_t`` for every i it is the gated delta rule of :mod:`linearize.ops.reference` exactly.

Chunkwise form (the WY/UT form of ``chunk.py`` with the decays moved onto keys and queries): inside a chunk,
``Γ_r = Σ_{s≤r} g_s`` per channel and ``γ_r = exp(Γ_r)``; the corrections ``δ_r = β_r (v_r − (D_r h_{r−1})ᵀ k_r)``
solve

    (I + A) Δ = B V − B (γ ⊙ K) h_0,   A_rj = β_r Σ_i k_ri k_ji exp(Γ_ri − Γ_ji)  (j < r)
    o_r = h_0ᵀ (γ_r ⊙ q_r) + Σ_{j≤r} [Σ_i q_ri k_ji exp(Γ_ri − Γ_ji)] δ_j
    h_C = Diag(γ_C) h_0 + Σ_j (k_j ⊙ exp(Γ_C − Γ_j)) δ_jᵀ.

Every exponent here is ≤ 0 (g ≤ 0), except that the pairwise ``exp(Γ_r − Γ_j)`` must not be split into
``exp(Γ_r)·exp(−Γ_j)``, whose second factor overflows float32 once a chunk decays by more than e⁸⁸.
:func:`decayed_scores` keeps every factor ≤ 1: between sub-chunks of 16 it goes through the log-decay at the
start of the query's sub-chunk, inside one it takes the pairwise decays as they are.

:func:`kda_step` is one decode step; :func:`kda_reference` the loop that defines the op; :func:`kda_chunk` the
chunkwise form. The public :func:`linearize.ops.gated_delta_rule` takes a per-channel ``g [B, T, H, K]``
and routes it here; with ``backend="triton"`` to the Triton forward and backward of ``ops/triton/kda_fwd.py`` and
``kda_bwd.py`` (tested under the Triton interpreter, not yet on a GPU: ``"auto"`` keeps this module's form).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .common import check_inputs, chunked_over_sequences, recurrent_over_sequences

CHUNK = 64
SUB = 16  # positions of a sub-chunk: the pairwise decays are taken inside one


def scale_log_decay(g: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """``g · factor``: a log-decay per head ``(..., H)`` times a correction per head ``(..., H)``, or per key
    channel ``(..., H, K)`` — then a per-channel log-decay ``(..., H, K)``. A positive factor keeps ``g ≤ 0``."""
    return g * factor if factor.dim() == g.dim() else g[..., None] * factor


def check_kda_inputs(q, k, v, g, beta, initial_state, cu_seqlens) -> tuple[int, int]:
    """:func:`~linearize.ops.common.check_inputs` with ``g`` per key channel, ``[B, T, H_kv, K]``."""
    if g.shape != k.shape:
        raise ValueError(f"a per-channel g must be [B, T, H_kv, K], the shape of k {list(k.shape)}; "
                         f"got {list(g.shape)}")
    return check_inputs(q, k, v, g[..., 0], beta, initial_state, cu_seqlens)


def kda_step(q, k, v, g, beta, state, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode step for a batch of sequences.

    Args:
        q: ``[N, G·H, K]``; k: ``[N, H, K]``; v: ``[N, H, V]``; g: ``[N, H, K]`` (log α per channel);
        beta: ``[N, H]``; state: ``[N, H, K, V]`` (float32 or float64).
    Returns:
        ``(o [N, G·H, V] in v's dtype, new_state [N, H, K, V])``.

    Example:
        >>> N, H, G, K, V = 2, 3, 2, 8, 8
        >>> o, s = kda_step(torch.randn(N, H * G, K), torch.randn(N, H, K), torch.randn(N, H, V),
        ...                 -torch.rand(N, H, K), torch.rand(N, H), torch.zeros(N, H, K, V))
        >>> o.shape, s.shape
        (torch.Size([2, 6, 8]), torch.Size([2, 3, 8, 8]))
    """
    N, Hq, K = q.shape
    H = k.shape[1]
    if Hq % H:
        raise ValueError(f"q heads ({Hq}) must be a multiple of k/v heads ({H})")
    if g.shape != k.shape:
        raise ValueError(f"a per-channel g must be [N, H, K] = {list(k.shape)}; got {list(g.shape)}")
    if state.shape != (N, H, K, v.shape[-1]):
        raise ValueError(f"state must be [N, H, K, V] = {[N, H, K, v.shape[-1]]}; got {tuple(state.shape)}")
    dt = state.dtype
    q, k, v, g, beta = (x.to(dt) for x in (q, k, v, g, beta))
    h = state * g.exp()[..., None]  # Diag(α) h: key channel i decays by α_i
    pred = torch.einsum("nhkv,nhk->nhv", h, k)  # what the decayed state recalls for k_t
    delta = beta[..., None] * (v - pred)  # (N, H, V)
    h = h + k[..., :, None] * delta[..., None, :]
    qg = (q * scale).view(N, H, Hq // H, K)  # (N, H, G, K)
    o = torch.einsum("nhkv,nhgk->nhgv", h, qg).reshape(N, Hq, -1)
    return o.to(v.dtype), h


def kda_reference(q, k, v, g, beta, *, scale: float = 1.0, initial_state=None, output_final_state: bool = False,
                  cu_seqlens=None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Recurrent KDA, one :func:`kda_step` at a time: the definition every other form is tested against.

    Shapes: q ``[B, T, G·H, K]``, k and g ``[B, T, H, K]``, v ``[B, T, H, V]``, beta ``[B, T, H]``; the rest as
    :func:`linearize.ops.reference.gated_delta_rule_reference`."""
    check_kda_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    return recurrent_over_sequences(kda_step, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens)


def decayed_scores(a: torch.Tensor, b: torch.Tensor, G: torch.Tensor, sub: int, strict: bool) -> torch.Tensor:
    """``M_rj = Σ_i a_ri b_ji exp(G_ri − G_ji)`` for ``j < r`` (``strict``) or ``j ≤ r``, 0 above: ``(..., C, C)``.

    a ``(..., C, K)``; b and G ``(..., C, K)``, their leading dims broadcast against a's (GQA: a query group
    over one key head); G is a cumulative log-decay, non-increasing along C. C must be a multiple of ``sub``."""
    C, K = a.shape[-2:]
    S = C // sub
    dev = a.device
    first = G[..., ::sub, :]  # (..., S, K): the log-decay at the start of each sub-chunk
    # between sub-chunks: query r of sub-chunk s and key j before it, exp(G_r − G_first(s)) · exp(G_first(s) − G_j)
    a_in = a * (G - first.repeat_interleave(sub, dim=-2)).exp()  # (..., C, K)
    before = torch.arange(C, device=dev)[None, :] < torch.arange(0, C, sub, device=dev)[:, None]  # (S, C)
    out = (first[..., :, None, :] - G[..., None, :, :]).masked_fill(~before[..., None], float("-inf")).exp()
    b_out = b[..., None, :, :] * out  # (..., S, C, K)
    between = torch.einsum("...sik,...sjk->...sij", a_in.unflatten(-2, (S, sub)), b_out)  # (..., S, sub, C)
    # inside a sub-chunk: the pairwise decays, masked before exp so that nothing overflows above the diagonal
    Gs = G.unflatten(-2, (S, sub))
    tri = torch.ones(sub, sub, dtype=torch.bool, device=dev).tril(-1 if strict else 0)
    pair = (Gs[..., :, None, :] - Gs[..., None, :, :]).masked_fill(~tri[..., None], float("-inf")).exp()
    within = torch.einsum("...sik,...sjk,...sijk->...sij", a.unflatten(-2, (S, sub)), b.unflatten(-2, (S, sub)),
                          pair)  # (..., S, sub, sub)
    eye = torch.eye(S, dtype=a.dtype, device=dev)[:, None, :, None]  # sub-chunk s's block on the diagonal
    M = between.unflatten(-1, (S, sub)) + within[..., :, :, None, :] * eye  # (..., S, sub, S, sub)
    return M.reshape(*M.shape[:-4], C, C)


def _chunk_one(q, k, v, g, beta, h, chunk):
    """One sequence. q: (L, Hq, K); k, g: (L, H, K); v: (L, H, V); beta: (L, H); h: (H, K, V)."""
    L, Hq, K = q.shape
    H, V = v.shape[1], v.shape[2]
    G = Hq // H
    if L == 0:
        return q.new_zeros(0, Hq, V), h
    pad = (-L) % chunk
    if pad:  # zero k, v, beta and g = 0 leave the state untouched
        q, k, v, g = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v, g))
        beta = F.pad(beta, (0, 0, 0, pad))
    n = (L + pad) // chunk
    sub = SUB if chunk % SUB == 0 else chunk
    q = q.view(n, chunk, H, G, K).permute(0, 2, 3, 1, 4)  # (n, H, G, C, K)
    k = k.view(n, chunk, H, K).transpose(1, 2).contiguous()  # (n, H, C, K)
    v = v.view(n, chunk, H, V).transpose(1, 2).contiguous()  # (n, H, C, V)
    gam = g.view(n, chunk, H, K).transpose(1, 2).cumsum(-2)  # (n, H, C, K): Γ_r
    beta = beta.view(n, chunk, H).transpose(1, 2)  # (n, H, C)

    A = beta[..., None] * decayed_scores(k, k, gam, sub, strict=True)  # (n, H, C, C), strictly lower
    eye = torch.eye(chunk, dtype=q.dtype, device=q.device)
    rhs = torch.cat([k * gam.exp() * beta[..., None], v * beta[..., None]], dim=-1)  # (n, H, C, K+V)
    WU = torch.linalg.solve_triangular(A + eye, rhs, upper=False, unitriangular=True)
    W, U = WU[..., :K], WU[..., K:]

    qk = decayed_scores(q, k[:, :, None], gam[:, :, None], sub, strict=False).reshape(n, H, G * chunk, chunk)
    q_decayed = (q * gam.exp()[:, :, None]).reshape(n, H, G * chunk, K)  # rows (g, c)
    k_to_end = (k * (gam[..., -1:, :] - gam).exp()).transpose(-1, -2).contiguous()  # (n, H, K, C)
    chunk_decay = gam[..., -1, :, None].exp()  # (n, H, K, 1)

    outs = []
    for i in range(n):
        delta = U[i] - W[i] @ h  # (H, C, V)
        outs.append(q_decayed[i] @ h + qk[i] @ delta)  # (H, G·C, V)
        h = chunk_decay[i] * h + k_to_end[i] @ delta
    o = torch.stack(outs).view(n, H, G, chunk, V).permute(0, 3, 1, 2, 4).reshape(n * chunk, Hq, V)[:L]
    return o, h


def kda_chunk(q, k, v, g, beta, *, scale: float = 1.0, initial_state=None, output_final_state: bool = False,
              cu_seqlens=None, chunk_size: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunkwise KDA in PyTorch (float32 inside; float64 for float64 inputs), differentiated by autograd.
    Same contract as :func:`kda_reference`.

    Example:
        >>> B, T, H, G, K, V = 1, 70, 2, 2, 8, 8
        >>> k = torch.nn.functional.normalize(torch.randn(B, T, H, K), dim=-1)
        >>> o, h = kda_chunk(torch.randn(B, T, H * G, K), k, torch.randn(B, T, H, V), -torch.rand(B, T, H, K),
        ...                  torch.rand(B, T, H), output_final_state=True)
        >>> o.shape, h.shape
        (torch.Size([1, 70, 4, 8]), torch.Size([1, 2, 8, 8]))
    """
    check_kda_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    return chunked_over_sequences(_chunk_one, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                                  chunk_size)

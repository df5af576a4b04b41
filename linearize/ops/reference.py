"""The definition of the gated delta rule: a plain loop over time. Slow, simple, float64-capable.

    h_t = α_t (I − β_t k_t k_tᵀ) h_{t−1} + β_t k_t v_tᵀ,   o_t = h_tᵀ q_t,   α_t = exp(g_t)

with ``h`` the ``[K, V]`` state (``Sᵀ`` of SPEC §2). Every other implementation is tested
against this file.
"""

from __future__ import annotations

import torch

from .common import check_inputs, recurrent_over_sequences
from .kda import kda_step


def gated_delta_rule_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode step for a batch of sequences (with a per-channel ``g [N, H, K]``: :func:`~linearize.ops.kda.kda_step`).

    Args:
        q: ``[N, Hq, K]``; k: ``[N, H, K]``; v: ``[N, H, V]``; g, beta: ``[N, H]``;
        state: ``[N, H, K, V]`` (float32 or float64).
    Returns:
        ``(o [N, Hq, V], new_state [N, H, K, V])``; ``o`` in ``v.dtype``.

    Example:
        >>> N, H, G, K, V = 2, 3, 3, 8, 8
        >>> s = torch.zeros(N, H, K, V)
        >>> o, s = gated_delta_rule_step(torch.randn(N, H * G, K), torch.randn(N, H, K),
        ...     torch.randn(N, H, V), -torch.rand(N, H), torch.rand(N, H), s)
        >>> o.shape
        torch.Size([2, 9, 8])
    """
    if g.dim() == 3:
        return kda_step(q, k, v, g, beta, state, scale)
    N, Hq, K = q.shape
    H = k.shape[1]
    if Hq % H:
        raise ValueError(f"q heads ({Hq}) must be a multiple of k/v heads ({H})")
    if state.shape != (N, H, K, v.shape[-1]):
        raise ValueError(f"state must be [N, H, K, V] = {[N, H, K, v.shape[-1]]}; got {tuple(state.shape)}")
    dt = state.dtype
    q, k, v, g, beta = (x.to(dt) for x in (q, k, v, g, beta))
    h = state * g.exp()[..., None, None]  # decay: (N, H, K, V)
    pred = torch.einsum("nhkv,nhk->nhv", h, k)  # what the state recalls for k_t
    delta = beta[..., None] * (v - pred)  # (N, H, V)
    h = h + k[..., :, None] * delta[..., None, :]
    qg = (q * scale).view(N, H, Hq // H, K)  # (N, H, G, K)
    o = torch.einsum("nhkv,nhgk->nhgv", h, qg).reshape(N, Hq, -1)
    return o.to(v.dtype), h


def gated_delta_rule_reference(
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
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Recurrent GDN, one step at a time. Same signature as :func:`linearize.ops.gated_delta_rule`.

    Shapes: q ``[B, T, G·H, K]``, k ``[B, T, H, K]``, v ``[B, T, H, V]``, g/beta ``[B, T, H]``,
    initial_state ``[N, H, K, V]`` with N = B, or the number of documents when ``cu_seqlens``
    (``[0, ..., T]``, B = 1) packs several. Returns o ``[B, T, G·H, V]`` and the final state.
    """
    check_inputs(q, k, v, g, beta, initial_state, cu_seqlens)
    return recurrent_over_sequences(gated_delta_rule_step, q, k, v, g, beta, scale, initial_state, output_final_state,
                                    cu_seqlens)

"""The VaLA front: softmax attention's q, k, v → the decayed linear attention of :mod:`linearize.ops.linear`.

Seed 000, eq. va-la-2 (equal to eq. va-la, ``o_t = v̄_t + ((1/t) Σ v_i k_iᵀ − v̄_t k̄_tᵀ) q_t``), as a
recurrence per document (``t`` counts from 1 at every document start, as in the Taylor front):

    S_t = (1 − 1/t) S_{t−1} + (1/t) ṽ_t k̃_tᵀ,   k̃_t = k_t − k̄_t,  ṽ_t = v_t − v̄_{t−1}
    o_t = v̄_t + S_t q_t

i.e. the operator's ``g = log(1 − 1/t)``, ``w = 1/t`` on the centred ``k̃``, ``ṽ`` (at a document's first
token ``k̃ = 0``: nothing is written, and ``g = 0``). The running sums are the Taylor front's
(:func:`linearize.ops.taylor.prefix_means`), so a VaLA layer keeps the same decoding state ``(S, Σk, Σv, t)``.
A learnable correction raises the decay to a data-dependent power, ``α_t ← α_t^{f_t}`` (``g ← f_t·g``), as
the GDN block's gate does; ``f = 1`` is the equation exactly.

``q`` must already carry the softmax scale.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .linear import linear_attention, linear_attention_step
from .taylor import RunningSums, prefix_means


@dataclass
class VaLAInputs:
    """What the linear attention operator consumes, plus the prefix mean of v added behind it."""

    k: torch.Tensor  # (B, T, H, K): k̃_t
    v: torch.Tensor  # (B, T, H, V): ṽ_t
    g: torch.Tensor  # (B, T, H): log-decay, f_t·log(1 − 1/t)
    w: torch.Tensor  # (B, T, H): write weight 1/t
    v_mean: torch.Tensor  # (B, T, H, V): v̄_t
    sums: RunningSums | None  # Σk, Σv and t after the last token (for decoding on)


def vala_front(k: torch.Tensor, v: torch.Tensor, *, cu_seqlens: torch.Tensor | None = None,
               mask: torch.Tensor | None = None, initial: RunningSums | None = None,
               gate_factor: torch.Tensor | None = None) -> VaLAInputs:
    """Teacher k ``(B, T, H, K)``, v ``(B, T, H, V)`` after RoPE/norms → the VaLA recurrence's inputs.

    Args:
        cu_seqlens: packed documents, each with its own means and ``t``.
        mask: optional ``(B, T)`` bool, False for padding: such tokens neither count in ``t`` and the
            means nor touch the state (``g = 0``, ``w = 0``).
        initial: running sums carried over from earlier tokens (decoding); not with ``cu_seqlens``.
        gate_factor: optional ``(B, T, H)`` exponent on the decay (a learnable correction; 1 = VaLA).
    """
    if initial is not None and cu_seqlens is not None:
        raise ValueError("initial running sums and cu_seqlens exclude each other: packed documents start fresh")
    B, T, H, _ = k.shape
    pm = prefix_means(k, v, cu_seqlens=cu_seqlens, mask=mask, initial=initial)
    t = pm.count.clamp_min(1)  # (B, T, 1)
    live = pm.live  # (B, T, 1)
    k_c = torch.where(live[..., None], k - pm.k_mean, 0.0)  # k̃_t (0 where nothing is written)
    w = torch.where(live, 1.0 / t, 0.0).expand(B, T, H)
    g = torch.where(live, 1.0 - 1.0 / t, 1.0).log().expand(B, T, H)
    if gate_factor is not None:
        g = g * gate_factor
    return VaLAInputs(k=k_c, v=v - pm.v_prev, g=g, w=w, v_mean=pm.v_mean, sums=pm.sums)


def vala_attention_front(q, k, v, *, scale: float | None = None, cu_seqlens=None, backend: str = "auto"):
    """VaLA end to end through the front and the chunkwise operator: ``(B, T, G·H, V)``, the same as
    :func:`linearize.ops.taylor.vala_attention` (the quadratic form)."""
    q = q * (q.shape[-1] ** -0.5 if scale is None else scale)
    front = vala_front(k, v, cu_seqlens=cu_seqlens)
    return linear_attention(q, front.k, front.v, front.g, front.w, cu_seqlens=cu_seqlens, backend=backend,
                            v_offset=front.v_mean)[0]


def vala_step_(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, state: torch.Tensor, sums: RunningSums,
               gate_factor: torch.Tensor | None = None, mask: torch.Tensor | None = None) -> torch.Tensor:
    """One decode step of a VaLA layer, updating ``state`` ``[N, H, K, V]`` and ``sums`` in place (so a cache
    that holds them, and a CUDA graph that captured them, see the new values); nothing is read back to the
    host. q ``[N, Hq, K]`` (scaled), k ``[N, H, K]``, v ``[N, H, V]``, gate_factor ``[N, H]``, mask ``[N]``
    (False: a padding step, which moves nothing). Returns o ``[N, Hq, V]`` in v's dtype: the same token
    as :func:`vala_front` and :func:`linear_attention` on the whole sequence would give."""
    front = vala_front(k[:, None], v[:, None], mask=None if mask is None else mask[:, None], initial=sums,
                       gate_factor=None if gate_factor is None else gate_factor[:, None])
    o, h = linear_attention_step(q, front.k[:, 0], front.v[:, 0], front.g[:, 0], front.w[:, 0], state)
    state.copy_(h)
    for old, new in ((sums.k, front.sums.k), (sums.v, front.sums.v), (sums.count, front.sums.count)):
        old.copy_(new)
    N, Hq, V = o.shape
    H = v.shape[1]
    return (o.view(N, H, Hq // H, V) + front.v_mean[:, 0, :, None].to(o.dtype)).view(N, Hq, V)

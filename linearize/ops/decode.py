"""One decode step of a Taylor-GDN layer, in place: the Taylor front for one token with carried running
sums, the gated delta rule's step and the Taylor back ``+ v̄``, as one call.

Per sequence and KV head, with ``m`` = 1 (0 for a padding step) and ``t = count + m`` (SPEC §2):

    Σk ← Σk + m k,  Σv ← Σv + m v,  k̄ = Σk/t,  v̄_t = Σv/t,  v̄_{t−1} = Σv_old/max(t−1, 1)
    live = m·[t > 1];  k̃ = k − k̄ (0 unless live),  n = ‖k̃‖,  k̂ = k̃/n
    β = clip(ρ n/(t−1) · f_β, 0, β_max) (0 unless live),  u = n (v − v̄_{t−1})/(t β)  (0 where β = 0)
    α = (1 − 1/t)^{f_g}  (1 unless live)
    h ← α (I − β k̂ k̂ᵀ) h + β k̂ uᵀ,   o_g = hᵀ (scale · q_g) + v̄_t   for the G query heads g of the KV head

With a per-channel ``f_g`` ``[N, H, K]`` (the kda target) ``α`` is per key channel and the update
``h ← (I − β k̂ k̂ᵀ) Diag(α) h + β k̂ uᵀ`` (:func:`linearize.ops.kda.kda_step`); the PyTorch body only.

A padding step (``mask`` False) leaves the state, the sums and the count as they were (α = 1, β = 0) and
returns ``hᵀ (scale·q) + Σv/max(count, 1)``, as ``taylor_front`` with its ``mask`` does.

:func:`taylor_gdn_step_` runs the Triton kernel of ``ops/triton/decode.py`` on CUDA (one launch) and the
PyTorch body below elsewhere (and for float64); both update their arguments in place and neither reads a
value back to the host, so a CUDA graph can capture the step.
"""

from __future__ import annotations

import torch

from .common import TRITON_MAX_K
from .kda import scale_log_decay
from .reference import gated_delta_rule_step

STEP_BACKENDS = ("auto", "torch", "triton")


def taylor_gdn_step_torch(q, k, v, state, sum_k, sum_v, count, rho, beta_factor, gate_factor, beta_max: float,
                          scale: float, mask=None, eps: float = 1e-12, decays: bool = True) -> torch.Tensor:
    """The step in PyTorch, computed in the state's dtype (float32 or float64); same contract as
    :func:`taylor_gdn_step_`. ``decays=False``: the ``deltanet`` target's form, α = 1, ``u ← t·u`` and the
    read with ``q/t`` (:func:`linearize.ops.taylor.fold_decay`); ``gate_factor`` is then not read."""
    N, H, K = k.shape
    dt, out_dtype = state.dtype, v.dtype
    k, v, rho, f_b, f_g = (x.to(dt) for x in (k, v, rho, beta_factor, gate_factor))
    m = torch.ones_like(count) if mask is None else mask.to(dt)
    t = count + m  # (N,)
    live = ((m > 0) & (t > 1))[:, None]  # (N, 1)
    t_safe, tm1 = t.clamp_min(1)[:, None], (t - 1).clamp_min(1)[:, None]
    new_k = sum_k + m[:, None, None] * k
    new_v = sum_v + m[:, None, None] * v
    k_c = torch.where(live[..., None], k - new_k / t_safe[..., None], 0.0)  # k̃
    n = k_c.norm(dim=-1)  # (N, H)
    k_hat = k_c / n.clamp_min(eps)[..., None]
    beta = torch.where(live, (rho * n / tm1 * f_b).clamp(0.0, beta_max), 0.0)
    coef = torch.where(beta > 0, n / (t_safe * beta.clamp_min(eps)), 0.0)
    if decays:
        g = scale_log_decay(torch.log(torch.where(live, 1.0 - 1.0 / t_safe, 1.0)), f_g)  # log α: (N, H) or (N, H, K)
    else:
        g, coef, q = torch.zeros_like(beta), coef * t_safe, q.to(dt) / t_safe[..., None]
    u = coef[..., None] * (v - sum_v / tm1[..., None])
    o, h = gated_delta_rule_step(q, k_hat, u, g, beta, state, scale)
    v_mean = new_v / t_safe[..., None]  # v̄_t
    o = (o.view(N, H, -1, v.shape[-1]) + v_mean[:, :, None]).view(o.shape)
    state.copy_(h)
    sum_k.copy_(new_k)
    sum_v.copy_(new_v)
    count.copy_(t)
    return o.to(out_dtype)


def taylor_gdn_step_(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    state: torch.Tensor,
    sum_k: torch.Tensor,
    sum_v: torch.Tensor,
    count: torch.Tensor,
    rho: torch.Tensor,
    beta_factor: torch.Tensor,
    gate_factor: torch.Tensor,
    beta_max: float,
    scale: float,
    *,
    mask: torch.Tensor | None = None,
    eps: float = 1e-12,
    backend: str = "auto",
) -> torch.Tensor:
    """One decode step of N sequences; ``state``, ``sum_k``, ``sum_v`` and ``count`` are updated in place.

    Args:
        q: ``[N, G·H, K]``, before the softmax scale; k: ``[N, H, K]`` (after RoPE/norms); v: ``[N, H, V]``.
        state: ``[N, H, K, V]``; sum_k ``[N, H, K]``, sum_v ``[N, H, V]``: Σk, Σv so far; count ``[N]``:
            the tokens counted so far, before this one. Float32 (float64 with ``backend="torch"``).
        rho: ``[H]``; beta_factor, gate_factor: ``[N, H]`` (:func:`linearize.layers.gdn_attention.correction_factors`);
            gate_factor may be ``[N, H, K]``, one per key channel (then the torch body: ``"auto"`` takes it).
        beta_max: the upper clip of β; scale: the softmax scale, applied to q inside.
        mask: ``[N]`` bool or None; False: a padding step (nothing is updated, see the module docstring).
        backend: ``"triton"`` (the fused kernel; CUDA, or the CPU under TRITON_INTERPRET=1), ``"torch"``, or
            ``"auto"``: Triton on CUDA for fp16/bf16/fp32 inputs with a float32 state, else torch.
    Returns:
        ``o [N, G·H, V]`` in v's dtype.

    Example:
        >>> N, H, G, K, V = 2, 3, 2, 8, 8
        >>> state, sk, sv, n = torch.zeros(N, H, K, V), torch.zeros(N, H, K), torch.zeros(N, H, V), torch.zeros(N)
        >>> o = taylor_gdn_step_(torch.randn(N, G * H, K), torch.randn(N, H, K), torch.randn(N, H, V), state, sk,
        ...                      sv, n, torch.ones(H), torch.ones(N, H), torch.ones(N, H), 1.0, K ** -0.5)
        >>> o.shape, n.tolist()
        (torch.Size([2, 6, 8]), [1.0, 1.0])
    """
    from . import _triton_usable

    if backend not in STEP_BACKENDS:
        raise ValueError(f"backend must be one of {STEP_BACKENDS}; got {backend!r}")
    per_channel = gate_factor.dim() == 3
    if backend == "auto":
        fits = q.is_cuda and state.dtype == torch.float32 and k.shape[-1] <= TRITON_MAX_K and not per_channel
        backend = "triton" if fits and _triton_usable(q) else "torch"
    if backend == "triton":
        if per_channel:
            raise ValueError(f"backend='triton' takes one decay factor per head, gate_factor [N, H]; got a per-channel "
                             f"{list(gate_factor.shape)} (the kda target): use backend='torch' or 'auto'")
        if not _triton_usable(q):
            raise ValueError("backend='triton' needs fp16/bf16/fp32 CUDA tensors (or TRITON_INTERPRET=1)")
        from .triton.decode import taylor_gdn_step_triton

        return taylor_gdn_step_triton(q, k, v, state, sum_k, sum_v, count, rho, beta_factor, gate_factor, beta_max,
                                      scale, mask=mask, eps=eps)
    return taylor_gdn_step_torch(q, k, v, state, sum_k, sum_v, count, rho, beta_factor, gate_factor, beta_max,
                                 scale, mask=mask, eps=eps)

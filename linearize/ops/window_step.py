"""One decode step of a sink + sliding-window Taylor-GDN layer (``GDNOptions.window``), in place, as one call.

Per sequence, with ``c`` its real tokens so far, ``r`` its row positions so far (padding counted) and the
new token at position ``p = c + 1`` (row position ``r``), in the layout of :mod:`linearize.ops.window_inputs`:

- sinks: the new token becomes sink ``c`` when ``c < S`` (and that slot is empty); sink ``j`` is a key of
  this query when it exists and lies outside the window, ``0 ≤ sink_index_j ≤ r − W``;
- the window is a shift register of the last ``W`` row positions: slot 0 is the token leaving it, slots
  ``1 … W − 1`` (those with ``win_pos > 0``) and the new token are keys; afterwards every slot moves down
  one and the new token takes slot ``W − 1``;
- exact part: ``o_E = Σ_j softmax(q·k_j) v_j`` over those keys, ``lse = log Σ_j exp(q·k_j)``;
- old stream: the leaving token (slot 0) enters the Taylor-GDN state when it is real and no sink,
  ``m = [win_pos_0 > S]``; with ``t = count + m`` (``count``: the old-stream tokens so far)

      Σk ← Σk + m k,  Σv ← Σv + m v,  k̄ = Σk/t,  v̄_t = Σv/t,  v̄_{t−1} = Σv_old/max(t−1, 1)
      live = m·[t > 1];  k̃ = k − k̄ (0 unless live),  n = ‖k̃‖,  k̂ = k̃/n
      β = clip(ρ n/(t−1) · f_β, 0, β_max) (0 unless live),  u = n (v − v̄_{t−1})/(t β)  (0 where β = 0)
      α = (1 − 1/t)^{f_g}  (1 unless live)
      h ← α (I − β k̂ k̂ᵀ) h + β k̂ uᵀ,   o_O = hᵀ q + v̄_t

  (with a per-channel ``f_g`` ``[N, H, K]`` — the kda target — ``α`` per key channel and
  ``h ← (I − β k̂ k̂ᵀ) Diag(α) h + β k̂ uᵀ``, on the PyTorch body only; without a decay — the ``deltanet`` target, ``decays=False`` — ``α = 1``, ``u ← t u`` and ``o_O = hᵀ q/t
  + v̄_t``: :func:`linearize.ops.taylor.fold_decay`); with ``m = 0`` nothing of it moves;
- mix: ``o = w o_E + (1 − w) o_O`` with ``w = σ(lse − log max(t, 1) − q·k̄ − bias)`` (``w = 1`` while
  ``t = 0``), :func:`linearize.ops.window.mix_by_mass`.

This is what ``GDNAttention._attend_window`` computes for one token per row (``mask=None``) from a cache,
together with the buffers ``cached_inputs`` returns and the state and running sums ``set_state`` stores.
:func:`sink_window_gdn_step_` runs the Triton kernel of ``ops/triton/window_step.py`` on CUDA (one launch)
and elsewhere the PyTorch body below, which composes those very functions; both update every buffer in
place and read nothing back to the host, so a CUDA graph can capture the step.
"""

from __future__ import annotations

import torch

from .common import TRITON_MAX_K
from .decode import STEP_BACKENDS
from .kda import scale_log_decay
from .reference import gated_delta_rule_step
from .taylor import RunningSums, fold_decay, taylor_back, taylor_front
from .window import mix_by_mass, sink_window_softmax
from .window_inputs import WindowBuffers, cached_inputs


def sink_window_gdn_step_torch(q, k, v, buffers: WindowBuffers, state, sum_k, sum_v, count, rho, beta_factor,
                               gate_factor, mix_bias, beta_max: float, window: int, sinks: int, decays: bool = True,
                               eps: float = 1e-12) -> torch.Tensor:
    """The step as ``_attend_window`` composes it (``cached_inputs``, ``sink_window_softmax``, ``taylor_front``,
    ``gated_delta_rule_step``, ``taylor_back``, ``mix_by_mass``), the results copied into the arguments;
    same contract as :func:`sink_window_gdn_step_`."""
    dt = torch.float64 if q.dtype == torch.float64 else torch.float32
    q = q.to(dt)[:, None]  # (N, 1, G·H, D)
    inp, after = cached_inputs(k[:, None], v[:, None], buffers, window, sinks)
    o_exact, lse = sink_window_softmax(q, inp.k, inp.v, inp.key_doc, inp.query_doc, window, inp.sink_k, inp.sink_v,
                                       inp.sink_ok)
    front = taylor_front(q, inp.old_k.to(dt), inp.old_v.to(dt), form="stable", rho=rho.to(dt), beta_max=beta_max,
                         beta_factor=beta_factor.to(dt)[:, None], mask=inp.old_ok,
                         initial=RunningSums(sum_k, sum_v, count), eps=eps)
    front.g = scale_log_decay(front.g, gate_factor.to(dt)[:, None])
    q_old, front = (q, front) if decays else fold_decay(q, front)
    o_old, h = gated_delta_rule_step(q_old[:, 0], front.k[:, 0], front.v[:, 0], front.g[:, 0], front.beta[:, 0], state)
    o_old = taylor_back(o_old[:, None], front.v_mean)
    o = mix_by_mass(o_exact, lse, o_old, q, front.k_mean, front.count, mix_bias)
    for dst, src in zip(buffers.tensors(), after.tensors()):
        dst.copy_(src)
    for dst, src in ((state, h), (sum_k, front.sums.k), (sum_v, front.sums.v), (count, front.sums.count)):
        dst.copy_(src)
    return o[:, 0]


def sink_window_gdn_step_(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    buffers: WindowBuffers,
    state: torch.Tensor,
    sum_k: torch.Tensor,
    sum_v: torch.Tensor,
    count: torch.Tensor,
    rho: torch.Tensor,
    beta_factor: torch.Tensor,
    gate_factor: torch.Tensor,
    mix_bias: torch.Tensor,
    beta_max: float,
    window: int,
    sinks: int,
    *,
    decays: bool = True,
    eps: float = 1e-12,
    backend: str = "auto",
) -> torch.Tensor:
    """One decode step of N sequences through a sink + sliding-window block; every buffer changes in place.

    Args:
        q: ``[N, G·H, D]``, the softmax scale folded in (float32; float64 with ``backend="torch"``).
        k, v: ``[N, H, D]``: the new token's key (after RoPE/norms) and value, one real token per row.
        buffers: the layer's :class:`~linearize.ops.window_inputs.WindowBuffers` (sinks ``[N, S, H, D]``,
            ``sink_index [N, S]``, window ``[N, W, H, D]``, ``win_pos [N, W]``, ``count``/``rows [N]``).
        state: ``[N, H, D, D]``; sum_k, sum_v ``[N, H, D]``, count ``[N]``: the old stream's Taylor-GDN state
            and running sums (the cache layer's ``state`` and ``sums``), float32 (float64 with torch).
        rho: ``[H]``; beta_factor, gate_factor: ``[N, H]`` (``correction_factors`` of the new token; gate_factor
            ``[N, H, K]`` for a per-channel decay, which only the torch body takes: ``"auto"`` picks it);
            mix_bias: ``[G·H]``; beta_max: the clip of β; window, sinks: ``W ≥ 1``, ``S ≥ 0``.
        decays: False for the ``deltanet`` target (no decay; the state is ``t×`` the GDN one).
        backend: ``"triton"`` (the fused kernel; CUDA, or the CPU under TRITON_INTERPRET=1), ``"torch"``, or
            ``"auto"``: Triton on CUDA for a float32 state, D ≤ 256 and contiguous buffers, else torch.
    Returns:
        ``o [N, G·H, D]``: the mixed output, float32 (float64 for a float64 q on the torch path).

    Example:
        >>> from linearize.ops.window_inputs import WindowBuffers
        >>> N, H, G, D, W, S = 2, 1, 2, 8, 4, 2
        >>> buf = WindowBuffers.empty(torch.zeros(N, 1, H, D), W, S)
        >>> state, sk, sv, n = torch.zeros(N, H, D, D), torch.zeros(N, H, D), torch.zeros(N, H, D), torch.zeros(N)
        >>> o = sink_window_gdn_step_(torch.randn(N, G * H, D), torch.randn(N, H, D), torch.randn(N, H, D), buf,
        ...                           state, sk, sv, n, torch.ones(H), torch.ones(N, H), torch.ones(N, H),
        ...                           torch.zeros(G * H), 1.0, W, S)
        >>> o.shape, buf.count.tolist(), buf.sink_index.tolist()
        (torch.Size([2, 2, 8]), [1, 1], [[0, -1], [0, -1]])
    """
    from . import _triton_usable

    if backend not in STEP_BACKENDS:
        raise ValueError(f"backend must be one of {STEP_BACKENDS}; got {backend!r}")
    if window < 1 or sinks < 0:
        raise ValueError(f"a decode step needs window ≥ 1 and sinks ≥ 0; got window={window}, sinks={sinks}")
    per_channel = gate_factor.dim() == 3
    if backend == "auto":
        in_place = [state, sum_k, sum_v, count, *buffers.tensors()]
        fits = (q.is_cuda and state.dtype == torch.float32 and k.shape[-1] <= TRITON_MAX_K and not per_channel
                and all(x.is_contiguous() for x in in_place))
        backend = "triton" if fits and _triton_usable(q) and _triton_usable(k) else "torch"
    if backend == "triton":
        if per_channel:
            raise ValueError(f"backend='triton' takes one decay factor per head, gate_factor [N, H]; got a per-channel "
                             f"{list(gate_factor.shape)} (the kda target): use backend='torch' or 'auto'")
        if not (_triton_usable(q) and _triton_usable(k)):
            raise ValueError("backend='triton' needs fp16/bf16/fp32 CUDA tensors (or TRITON_INTERPRET=1)")
        from .triton.window_step import sink_window_gdn_step_triton

        return sink_window_gdn_step_triton(q, k, v, buffers, state, sum_k, sum_v, count, rho, beta_factor,
                                           gate_factor, mix_bias, beta_max, window, sinks, decays=decays, eps=eps)
    return sink_window_gdn_step_torch(q, k, v, buffers, state, sum_k, sum_v, count, rho, beta_factor, gate_factor,
                                      mix_bias, beta_max, window, sinks, decays=decays, eps=eps)

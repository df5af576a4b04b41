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
- with a sparse cache (``GDNOptions.sparse_cache``): first the token leaving the window takes the lowest-keyed
  of the ``C`` cache slots when its selection key (the window's key of slot 0; −inf unless ``m``) is at least
  that one's, and the new token's key — its probe score at position ``c + 1``,
  :func:`linearize.ops.sparse_cache.selection_keys`, −inf for a sink — enters the window's keys; the slots
  with a finite key are exact keys too (:func:`linearize.ops.sparse_cache.cache_enter_`, :func:`cache_step_`).

This is what ``GDNAttention._attend_window`` computes for one token per row (``mask=None``) from a cache,
together with the buffers ``cached_inputs`` returns and the state and running sums ``set_state`` stores.
:func:`sink_window_gdn_step_` runs the Triton kernel of ``ops/triton/window_step.py`` on CUDA (one launch)
and elsewhere the PyTorch body below, which writes the step out for all rows and heads at once (the old
stream through :func:`linearize.ops.decode.taylor_gdn_step_torch`); tests/test_window_step.py ties it to the
model's composed path. Both update every buffer in place and read nothing back to the host, so a CUDA graph
can capture the step.
"""

from __future__ import annotations

import torch

from .common import TRITON_MAX_K, compute_dtype
from .decode import STEP_BACKENDS, taylor_gdn_step_torch
from .sparse_cache import CacheBuffers, cache_enter_, masked_softmax, merge_softmax, probe_scores, score_keys
from .window_inputs import WindowBuffers


def sink_window_gdn_step_torch(q, k, v, buffers: WindowBuffers, state, sum_k, sum_v, count, rho, beta_factor,
                               gate_factor, mix_bias, beta_max: float, window: int, sinks: int, decays: bool = True,
                               eps: float = 1e-12, cache: CacheBuffers | None = None) -> torch.Tensor:
    """The step in PyTorch for all rows and heads at once, as the kernel takes it (about 60 operations, where
    composing ``_attend_window``'s functions for one token takes several hundred: the decode step off CUDA);
    same contract as :func:`sink_window_gdn_step_`."""
    N, Hq, D = q.shape
    H, W, S, b = k.shape[1], window, sinks, buffers
    dt = compute_dtype(q.dtype)
    q = q.to(dt)
    c, r = b.count, b.rows
    # the old stream: slot 0 leaves the window and enters the state when it is real and no sink
    m = b.win_pos[:, 0] > S
    o_old = taylor_gdn_step_torch(q, b.win_k[:, 0].to(dt), b.win_v[:, 0].to(dt), state, sum_k, sum_v, count, rho,
                                  beta_factor, gate_factor, beta_max, 1.0, mask=m, eps=eps, decays=decays)
    # the exact part: window slots 1 … W − 1 holding a token, the new token, the sinks outside the window
    keys = torch.cat([b.win_k[:, 1:], k.to(b.win_k.dtype)[:, None], b.sink_k], 1)  # (N, W + S, H, D)
    values = torch.cat([b.win_v[:, 1:], v.to(b.win_v.dtype)[:, None], b.sink_v], 1)
    sink_ok = (b.sink_index >= 0) & (b.sink_index <= (r - W)[:, None])
    ok = torch.cat([b.win_pos[:, 1:] > 0, torch.ones_like(m)[:, None], sink_ok], 1)[:, None].expand(-1, H, -1)
    qh = q.view(N, H, Hq // H, D)
    heads = lambda x: x.to(dt).transpose(1, 2)  # noqa: E731  (N, H, keys, D): the buffers as they lie
    o_exact, lse = masked_softmax(qh, heads(keys), heads(values), ok[:, :, None])  # finite: the new token is a key
    if cache is not None:  # and the sparse cache's slots holding a token (cache_enter_ has taken the old one in)
        filled = torch.isfinite(cache.key).transpose(1, 2)[:, :, None]  # (N, H, 1, C)
        o_c, lse_c = masked_softmax(qh, heads(cache.k), heads(cache.v), filled)
        o_exact, lse = merge_softmax(o_exact, lse, o_c, lse_c)  # (the window's and the cache's softmax, joined)
    lse = lse[..., None]
    # the mix by mass, with the old stream's count and mean key after this step
    t = count.to(dt)[:, None, None, None].clamp_min(1)
    log_z = (qh @ sum_k.to(dt)[..., None]) / t + torch.log(t) + mix_bias.to(dt).view(H, -1, 1)
    w = torch.where(count[:, None, None, None] > 0, torch.sigmoid(lse - log_z), 1.0)
    o = (o_old.view(N, H, -1, D) + w * (o_exact - o_old.view(N, H, -1, D))).reshape(N, Hq, D)
    # the buffers move on: the new token becomes sink c while there are fewer than S, and enters the window
    if S:
        at = c.clamp_max(S - 1)[:, None]
        fill = (c[:, None] < S) & (b.sink_index.gather(1, at) < 0)  # (N, 1)
        for buf, x in ((b.sink_k, k), (b.sink_v, v)):
            slot = buf.gather(1, at[..., None, None].expand(-1, -1, H, D))
            buf.scatter_(1, at[..., None, None].expand(-1, -1, H, D), torch.where(fill[..., None, None], x[:, None].to(buf.dtype), slot))
        b.sink_index.scatter_(1, at, torch.where(fill, r[:, None], b.sink_index.gather(1, at)))
    for buf, x in ((b.win_k, k), (b.win_v, v), (b.win_pos, c + 1)):
        buf.copy_(torch.cat([buf[:, 1:], x.to(buf.dtype)[:, None]], 1))
    c.add_(1)
    r.add_(1)
    return o


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
    cache: CacheBuffers | None = None,
    token_score: torch.Tensor | None = None,
    probe: tuple[torch.Tensor, torch.Tensor] | None = None,
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
        cache, token_score: a sparse cache beside the window (``GDNOptions.sparse_cache``; ``CacheBuffers``, slots
            ``[N, C, H, D]``, keys ``[N, C, H]`` and the window's keys ``[N, W, H]`` float64) and the new token's
            probe score ``[N, H]`` (float64, or float32) (:func:`~linearize.ops.sparse_cache.probe_scores`): first the token
            leaving the window is offered to the cache (:func:`~linearize.ops.sparse_cache.cache_enter_`) and the
            new token's selection key (its score at position ``count + 1``, −inf for a sink) joins the window's
            keys, then the slots holding a token join the exact part's keys — in the kernel, or before the body.
        probe: in place of ``token_score``, ``(x [N, F], probe [H, F + 1])``, the block's input and its cache probe:
            the score :func:`~linearize.ops.sparse_cache.probe_scores` gives, computed in the Triton kernel itself.
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
        in_place = [state, sum_k, sum_v, count, *buffers.tensors(), *(cache.tensors() if cache is not None else [])]
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

        step = sink_window_gdn_step_triton
    else:
        step = sink_window_gdn_step_torch
    if cache is not None:
        if probe is not None and (token_score is not None or probe[0].shape[0] != cache.key.shape[0]
                                  or probe[1].shape != (cache.key.shape[2], probe[0].shape[-1] + 1)):
            raise ValueError(f"probe must be (x [N, F], probe [H, F + 1]) for N, H = {list(cache.key.shape[::2])}, "
                             "in place of token_score")
        if probe is None and (token_score is None or token_score.shape != cache.key.shape[::2]):
            raise ValueError(f"a sparse cache needs the new token's probe score [N, H] = {list(cache.key.shape[::2])}")
        if backend == "triton":  # the kernel scores the new token (given the probe), offers the old one and keys the new
            return step(q, k, v, buffers, state, sum_k, sum_v, count, rho, beta_factor, gate_factor, mix_bias,
                        beta_max, window, sinks, decays=decays, eps=eps, cache=cache, token_score=token_score, probe=probe)
        if probe is not None:
            token_score = probe_scores(*probe)
        pos = buffers.count[:, None] + 1
        key = score_keys(token_score[:, None], pos, sinks)[:, 0]
        cache_enter_(cache, buffers.win_k, buffers.win_v, buffers.win_pos, key, sinks)
    return step(q, k, v, buffers, state, sum_k, sum_v, count, rho, beta_factor, gate_factor, mix_bias, beta_max,
                window, sinks, decays=decays, eps=eps, cache=cache)

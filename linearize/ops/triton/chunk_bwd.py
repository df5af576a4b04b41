"""Triton backward of the chunkwise gated delta rule: the kernels of ``linearize/ops/chunk_bwd.py``.

Read that file's docstring first: it derives every term below, and its PyTorch code is the spec these
kernels are tested against (besides the float64 reference). Of the forward's intermediates ``T = (I + A)⁻¹``
is kept (the solve stage is skipped), and where the forward kept them (``chunk_fwd.Kept``) W, g's cumsum,
the states and Δ; else the backward recomputes W, U and g's cumsum with the forward's ``recompute_w_u``,
then the forward's states (``chunk_fwd_h``) on a side CUDA stream while stages 1 and 2 below run (they do
not need them). Then four kernel stages, one module each:

1. ``dv_local.chunk_bwd_dv_local``  per (V block, chunk, KV head): ``Pᵀ do`` summed over the G query heads that
   read this KV head (the in-chunk part of ``dΔ``); under GQA also the chunk's ``Σ_g (γ⊙q_g)ᵀ do_g``
   (``qdo_outside``), so the sequential kernel below does not run G products per chunk.
2. ``state_bwd.chunk_bwd_dh``       per (V block, sequence, KV head): the only sequential part, in reverse over
   chunks: ``dΔ = Pᵀdo + K̃ dh₁``, ``dh₀ = γ_C dh₁ + (γ⊙q)ᵀ do − Wᵀ dΔ``; stores ``dh₁`` per chunk, and ``dΔ``
   over stage 1's ``Pᵀdo`` (one buffer, in the dots' dtype).
3. ``dqk.chunk_bwd_dqk``            per (chunk, query head): ``dq`` and this query head's share of ``dk`` and of the
   log-decay gradient (through ``P`` and ``γ ⊙ (q h₀)``).
4. ``wy_bwd.chunk_bwd_wy``          per (chunk, KV head): through ``K̃``, ``γ_C``, ``Δ = U − W h₀``, ``T`` and ``A``;
   sums the query heads' shares, writes ``dk``, ``dv``, ``dβ`` and ``dg`` (reverse cumsum in the chunk).

GQA: KV head ``h`` is read by query heads ``h·G … h·G+G−1``; stages 1, 2 and 4 loop over them, so K/V
are never repeated. Dots run in the input dtype with fp32 accumulation (IEEE fp32 for fp32 inputs).
"""

from __future__ import annotations

import functools
from types import MappingProxyType

import torch

from .dqk import chunk_bwd_dqk, dqk_settings
from .dv_local import chunk_bwd_dv_local, dv_local_settings
from .layout import Layout
from .prepare import recompute_w_u
from .settings import qdo_outside, sms_for, state_bv
from .solve import solve_tril
from .state_bwd import chunk_bwd_dh, state_bwd_settings
from .state_fwd import chunk_fwd_h
from .wy_bwd import chunk_bwd_wy, wy_bwd_settings


def launch_settings(H: int, G: int, K: int, V: int, ieee: bool, programs: int | None = None,
                    device: torch.device | None = None) -> MappingProxyType:
    """``{name: (kernel, constexprs, warps, stages)}`` of the backward kernels, built once per shape and
    read-only (see ``chunk_fwd.launch_settings``)."""
    bv = state_bv(K, V, ieee, programs, sms_for(programs, device))
    return _launch_settings(H, G, K, V, ieee, bv, qdo_outside(G))


@functools.lru_cache(maxsize=256)
def _launch_settings(H: int, G: int, K: int, V: int, ieee: bool, bv: int, qdo: bool) -> MappingProxyType:
    return MappingProxyType({
        "dv_local": dv_local_settings(H, G, K, V, ieee, qdo),
        "state_bwd": state_bwd_settings(H, G, K, V, ieee, bv, qdo),
        "dqk": dqk_settings(H, G, K, V, ieee),
        "wy_bwd": wy_bwd_settings(H, G, K, V, ieee),
    })


_SIDE: dict = {}


def _side_stream(device: torch.device):
    """One extra CUDA stream per device (None off CUDA: the interpreter runs everything in order)."""
    if device.type != "cuda":
        return None
    if device not in _SIDE:
        _SIDE[device] = torch.cuda.Stream(device)
    return _SIDE[device]


def chunk_gated_delta_rule_bwd(*, q, k, v, g, beta, scale, initial_state, do, dht, cu_seqlens, tm=None,
                               kept=None):
    """Gradients w.r.t. ``(q, k, v, g, beta, initial_state)`` (the last ``None`` without an initial state),
    each in its input's dtype. Inputs as the forward's, ``do`` like the output, ``dht`` like the final state or
    None; ``tm`` the forward's T (recomputed when None); ``kept`` the forward's ``chunk_fwd.Kept`` (recomputed
    when None). ``g`` None: no decay, and its gradient None."""
    B, T = q.shape[:2]
    L = Layout(q, v, cu_seqlens)
    qf, kf, vf, bf, dof = Layout.flat(q, k, v, beta, do)
    gf = Layout.flat(g)[0] if g is not None else None
    if tm is None:
        tm = solve_tril(layout=L, k=kf, g=gf, beta=bf)
    side = main = None
    if kept is not None:
        gcum, w, hs, v_new = kept
    else:
        gcum, w, u = recompute_w_u(layout=L, k=kf, v=vf, g=gf, beta=bf, tm=tm)
        # The forward's states are recomputed on a side stream while dv_local and the backward state kernel
        # run: neither needs them, and at long T with few sequences each sequential kernel alone leaves SMs idle.
        states = functools.partial(chunk_fwd_h, layout=L, k=kf, w=w, u=u, gcum=gcum, initial_state=initial_state,
                                   output_final_state=False)
        side = _side_stream(L.device)
        if side is None:
            hs, v_new, _ = states()
        else:
            main = torch.cuda.current_stream(L.device)
            side.wait_stream(main)
            with torch.cuda.stream(side):
                hs, v_new, _ = states()
            hs.record_stream(main)  # allocated on the side stream, used and freed on the main one
            v_new.record_stream(main)

    dvl, dql = chunk_bwd_dv_local(layout=L, q=qf, k=kf, gcum=gcum, do=dof, scale=scale, qdo=qdo_outside(L.G))
    dhs, dh0 = chunk_bwd_dh(layout=L, q=qf, k=kf, w=w, gcum=gcum, do=dof, dvl=dvl, dql=dql, dht=dht,
                            initial_state=initial_state, scale=scale)
    ddl = dvl  # now dΔ
    if side is not None:
        main.wait_stream(side)
    dq, dkq, dgq = chunk_bwd_dqk(layout=L, q=qf, k=kf, v_new=v_new, gcum=gcum, hs=hs, do=dof, scale=scale)
    dk, dv, dbeta, dg = chunk_bwd_wy(layout=L, k=kf, v=vf, beta=bf, gcum=gcum, tm=tm, v_new=v_new, hs=hs, dhs=dhs,
                                     ddl=ddl, dkq=dkq, dgq=dgq)
    dg = dg.view(g.shape).to(g.dtype) if g is not None else None
    return dq.view(q.shape), dk.view(k.shape), dv.view(v.shape), dg, dbeta.view(beta.shape).to(beta.dtype), dh0

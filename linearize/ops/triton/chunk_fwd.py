"""Triton forward of the chunkwise gated delta rule (chunk 64, WY/UT form), GQA-native and varlen: the
host pipeline. The math is the one of ``linearize/ops/chunk.py`` (read its docstring first); four kernel
stages, one module each, each kernel with its launcher:

0. ``solve.solve_tril``        per (chunk, KV head): ``T = (I + A)⁻¹``, ``A = strictly-lower(β_r k_r·k_j γ_r/γ_j)``,
   in registers; T is kept for the backward.
1. ``prepare.recompute_w_u``   per (chunk, KV head): in-chunk cumsum of g, ``W = T (β γ k)`` and ``U = T (β v)``.
2. ``state_fwd.chunk_fwd_h``   per (sequence, KV head, V block): the only sequential part — carries the fp32
   state across chunks, writes ``Δ = U − W h`` and the state entering each chunk (of every ``output_group``-th).
3. ``output.chunk_fwd_o``      per (chunk or group of chunks, query head, V block):
   ``o = γ (q h) + (q kᵀ ⊙ γ_r/γ_j)_causal Δ``, carrying h from chunk to chunk on Δ within a group.

Shared: the packed sequence layout (``layout.py``), launch-settings helpers (``settings.py``) and tile
helpers (``tiles.py``).
"""

from __future__ import annotations

import functools
from types import MappingProxyType
from typing import NamedTuple

import torch

from .layout import Layout
from .output import chunk_fwd_o, output_settings
from .prepare import prepare_settings, recompute_w_u
from .settings import output_group, sms_for, state_bv
from .solve import solve_settings, solve_tril
from .state_fwd import chunk_fwd_h, state_fwd_settings


def launch_settings(H: int, G: int, K: int, V: int, ieee: bool, programs: int | None = None,
                    device: torch.device | None = None) -> MappingProxyType:
    """``{name: (kernel, constexprs, warps, stages)}`` of the forward kernels, as their launchers use them —
    the table ``scripts/kernel_resources.py`` and ``scripts/profile_kernels.py`` read. ``programs`` =
    sequences × KV heads (the state kernel's parallelism). Built once per shape, read-only."""
    bv = state_bv(K, V, ieee, programs, sms_for(programs, device))
    return _launch_settings(H, G, K, V, ieee, bv, output_group(K))


@functools.lru_cache(maxsize=256)
def _launch_settings(H: int, G: int, K: int, V: int, ieee: bool, bv: int, E: int) -> MappingProxyType:
    return MappingProxyType({
        "solve": solve_settings(H, K, ieee),
        "prepare": prepare_settings(H, K, V, ieee),
        "state_fwd": state_fwd_settings(H, K, V, ieee, bv),
        "output": output_settings(H, G, K, V, ieee, E),
    })


class Kept(NamedTuple):
    """What the forward computed that the backward reads besides T (``keep=True``): g's in-chunk cumsum (None
    without a decay), W, the state entering every chunk and Δ = U − W h, as ``chunk_bwd`` would compute them
    again. Held from the forward to the backward, they cost ``tokens × H × (K + V)`` + ``chunks × H × K × V``
    elements (~270 MB at 2×8192, 16 heads of 128, bf16) and spare the backward ``recompute_w_u`` and
    ``chunk_fwd_h``."""

    gcum: torch.Tensor | None
    w: torch.Tensor
    hs: torch.Tensor
    v_new: torch.Tensor


def chunk_gated_delta_rule_fwd(*, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                               v_offset=None, keep: bool = False):
    """Host launcher. Inputs ``[B, T, H(q), D]``; returns ``(o, final_state, T)``, T = (I + A)⁻¹ of every
    chunk, ``[tokens, H, 64]`` in k's dtype (float32 for float32 inputs), for the backward; with ``keep`` a
    fourth, :class:`Kept` (the state kernel then stores every chunk's state, not one per output group).
    ``v_offset`` (``[B, T, H, V]``, float32): added to every query head's output of its KV head (the Taylor
    back). ``g`` None: no decay (the delta rule; every kernel then reads no g and takes no exp of it)."""
    B, T = q.shape[:2]
    L = Layout(q, v, cu_seqlens)
    q, k, v, beta = Layout.flat(q, k, v, beta)
    g = Layout.flat(g)[0] if g is not None else None
    every = output_group(L.K)  # the state kernel keeps one state per output group (or all, kept)
    tm = solve_tril(layout=L, k=k, g=g, beta=beta)
    gcum, w, u = recompute_w_u(layout=L, k=k, v=v, g=g, beta=beta, tm=tm)
    hs, v_new, ht = chunk_fwd_h(layout=L, k=k, w=w, u=u, gcum=gcum, initial_state=initial_state,
                                output_final_state=output_final_state, every=1 if keep else every)
    vm = Layout.flat(v_offset.float())[0] if v_offset is not None else None
    o = chunk_fwd_o(layout=L, q=q, k=k, v_new=v_new, gcum=gcum, hs=hs, scale=scale, v_offset=vm, every=every,
                    all_states=keep)
    out = (o.view(B, T, L.HQ, L.V), ht, tm)
    return out + (Kept(gcum, w, hs, v_new),) if keep else out

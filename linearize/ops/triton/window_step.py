"""One decode step of a sink + sliding-window Taylor-GDN layer as one kernel (``linearize.ops.window_step``).

Per sequence ``n`` and KV head, with the new token at position ``p = c + 1`` (``c``: real tokens so far) and
row position ``r`` (padding counted), for the G query heads ``q_g`` of the head (softmax scale folded in):

    exact keys  the new token; window slots j = 1 … W−1 with win_pos_j > 0; sinks j with 0 ≤ sink_index_j ≤ r − W;
                with a sparse cache, its slots with a finite key after the old token's offer (C > 0: the slot of
                the lowest key, first of equals, takes slot 0 when its key is at least that; the new token's
                key, tie-broken by position as ``selection_keys`` does, joins the window's keys; its score, given
                the block's input and the probe, is computed here too: ``probe_scores``' float64 dot product)
    o_E, lse    their softmax, online over blocks of keys: m ← max(m, max s), l ← l·e^{m_old − m} + Σ e^{s − m},
                acc ← acc·e^{m_old − m} + Σ e^{s − m} v;  o_E = acc/l,  lse = m + log l
    old token   window slot 0, written when win_pos_0 > S (m = 1): the Taylor step of ``ops/decode.py``
                (Σk, Σv, t = count + m, k̂, β, u, α), h ← α h + k̂ (β (u − hᵀk̂))ᵀ,  o_O = hᵀ q + v̄_t
    mix         o = w o_E + (1 − w) o_O,  w = σ(lse − log max(t, 1) − q·Σk/max(t, 1) − bias)  (1 while t = 0)

and the buffers moved on: the window shifted down one slot with the new token in slot W − 1, ``win_pos``
likewise (``p`` in the last slot), the new token as sink ``c`` when ``c < S`` and that sink is empty,
``count`` and ``rows`` + 1 — what ``cached_inputs`` and ``set_state`` leave (the module docstring of
``ops/window_step.py`` has the whole step, the deltanet variant included).

One program per (sequence, KV head): it reads the head's keys, values and state once for all G query heads.
Race-free in place:

- the head's state, Σk, Σv and its slices of the window and the sinks are read and written by this program
  alone. Σk, then the state and Σv tile by tile, are read, then written after a barrier (the compiler loads
  a small block once for each layout it is used in, so threads other than the one that stores an entry
  read it too), before the window moves; the window shifts while the softmax streams over it: block b
  reads slots ``[bB, (b+1)B)`` and folds them into the softmax, then, after a barrier, writes them to
  ``[bB − 1, (b+1)B − 1)`` — below anything a later block reads, and only once every thread of the program
  has read (and used) them;
- ``o`` first takes ``o_O`` (tile by tile), then, between two barriers, ``w o_E + (1 − w) o_O`` read back;
- what every head of the sequence reads — ``count``, ``rows``, ``sink_index``, ``win_pos`` and the old
  stream's count — changes only after all of them are done: each program takes a ticket from a per-sequence
  counter (the pure step's, ``ops/triton/decode.py``) when it is, and the last one writes those (shifting
  ``win_pos`` the same way) and resets the counter to 0 for the next launch.

With a sparse cache the cache's slots are a second kernel's (flash-decoding): ``(sequence, KV head, split)``
programs each fold ``_CACHE_SPLIT`` slots into a partial softmax — at batch 1 a layer's 256 slots are 8
programs per KV head, not one walking them all — and the head's last program to finish (a ticket per
sequence and KV head, acquire/release) joins them with the step kernel's partial (new token, window, sinks)
and mixes. The step kernel makes the offer first, so the second reads the cache as the step leaves it.

The kernels allocate nothing but their output and partials, read nothing back to the host and branch on no
value on the host, so a CUDA graph can capture them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common import TRITON_DTYPES, next_pow2
from ..sparse_cache import _TIE
from .decode import _tickets, check_shapes


@triton.jit
def _softmax_block(b_q, b_kb, b_vb, ok, m_run, l_run, acc):
    """Fold one block of keys ``[BW, BD]`` (``ok``: which are keys) into the running max ``m_run [BG]`` (−inf:
    none yet), sum ``l_run [BG]`` and unnormalized output ``acc [BG, BD]`` of the G query heads ``b_q [BG, BD]``."""
    s = tl.sum(b_q[:, None, :] * b_kb[None, :, :], axis=2)  # (BG, BW)
    s = tl.where(ok[None, :], s, float("-inf"))
    m_new = tl.maximum(m_run, tl.max(s, axis=1))
    m_sub = tl.where(m_new > float("-inf"), m_new, 0.0)  # −inf while no key is seen (a cache split's start)
    p = tl.exp(s - m_sub[:, None])
    rescale = tl.exp(m_run - m_sub)
    l_run = l_run * rescale + tl.sum(p, axis=1)
    acc = acc * rescale[:, None] + tl.sum(p[:, :, None] * b_vb[None, :, :], axis=1)
    return m_new, l_run, acc


@triton.jit
def _sink_window_gdn_step_kernel(
    q, k, v, sink_k, sink_v, sink_index, win_k, win_v, win_pos, tokens, rows,
    state, sum_k, sum_v, count, rho, beta_factor, gate_factor, mix_bias, o, tickets, beta_max, eps,
    cache_k, cache_v, cache_key, win_key, token_score, probe_in, probe, F, part_m, part_l, part_acc, part_z, NP,
    H: tl.constexpr, G: tl.constexpr, D: tl.constexpr, W: tl.constexpr, S: tl.constexpr, BG: tl.constexpr,
    BD: tl.constexpr, BW: tl.constexpr, BS: tl.constexpr, BV: tl.constexpr, BP: tl.constexpr,
    DECAYS: tl.constexpr, C: tl.constexpr, BM: tl.constexpr, TIE: tl.constexpr, PROBE: tl.constexpr,
    BF: tl.constexpr,
):
    i_nh = tl.program_id(0)
    i_n, i_h = i_nh // H, i_nh % H
    i_n64, i_nh64 = i_n.to(tl.int64), i_nh.to(tl.int64)
    o_d = tl.arange(0, BD)
    m_d = o_d < D
    o_g = tl.arange(0, BG)
    m_g = o_g < G
    row_q = i_nh64 * G + o_g  # query head h·G + g reads KV head h
    p_o = o + row_q[:, None] * D + o_d[None, :]
    m_o = m_g[:, None] & m_d[None, :]
    b_q = tl.load(q + row_q[:, None] * D + o_d[None, :], mask=m_o, other=0.0).to(tl.float32)  # (BG, BD)

    # the sequence's counters, read by every head before the last one moves them on
    c = tl.load(tokens + i_n64)  # real tokens so far
    r = tl.load(rows + i_n64)  # row positions so far (the new token's, 0-based)
    # the old stream: window slot 0 leaves; it enters the state when it is real and no sink
    p_win = (i_n64 * W * H + i_h) * D  # slot j of this head at p_win + j·H·D
    m = (tl.load(win_pos + i_n64 * W) > S).to(tl.float32)
    t = tl.load(count + i_n64) + m
    live = (m > 0.0) & (t > 1.0)
    t_safe = tl.maximum(t, 1.0)
    tm1 = tl.maximum(t - 1.0, 1.0)
    b_kold = tl.load(win_k + p_win + o_d, mask=m_d, other=0.0).to(tl.float32)
    b_sk = tl.load(sum_k + i_nh64 * D + o_d, mask=m_d, other=0.0) + m * b_kold
    tl.debug_barrier()  # every thread has read Σk (some in another layout) before any writes it
    tl.store(sum_k + i_nh64 * D + o_d, b_sk, mask=m_d)
    b_kmean = b_sk / t_safe
    b_kc = tl.where(live, b_kold - b_kmean, 0.0)  # k̃
    n = tl.sqrt(tl.sum(b_kc * b_kc, axis=0))
    b_khat = b_kc / tl.maximum(n, eps)
    beta = tl.load(rho + i_h).to(tl.float32) * n / tm1 * tl.load(beta_factor + i_nh64).to(tl.float32)
    beta = tl.where(live, tl.minimum(tl.maximum(beta, 0.0), beta_max), 0.0)
    coef = tl.where(beta > 0.0, n / (t_safe * tl.maximum(beta, eps)), 0.0)
    if DECAYS:
        f_g = tl.load(gate_factor + i_nh64).to(tl.float32)
        alpha = tl.exp(tl.log(tl.where(live, 1.0 - 1.0 / t_safe, 1.0)) * f_g)  # (1 − 1/t)^f_g
        read = 1.0
    else:  # fold_decay: α = 1, u ← t u, read with q/t
        alpha = 1.0
        coef = coef * t_safe
        read = 1.0 / t_safe

    # the state and Σv tile by tile (before the window shifts, as they read its slot 0); o ← o_O
    for v0 in range(0, D, BV):
        o_v = v0 + tl.arange(0, BV)
        m_v = o_v < D
        b_vold = tl.load(win_v + p_win + o_v, mask=m_v, other=0.0).to(tl.float32)
        p_sv = sum_v + i_nh64 * D + o_v
        b_sv = tl.load(p_sv, mask=m_v, other=0.0)
        b_u = coef * (b_vold - b_sv / tm1)  # ṽ uses v̄_{t−1}, the mean before this token
        b_sv = b_sv + m * b_vold
        p_h = state + i_nh64 * D * D + o_d[:, None] * D + o_v[None, :]
        m_h = m_d[:, None] & m_v[None, :]
        b_h = tl.load(p_h, mask=m_h, other=0.0) * alpha
        tl.debug_barrier()  # every thread has read this tile of Σv and h (in any layout) before any writes it
        tl.store(p_sv, b_sv, mask=m_v)
        b_h += b_khat[:, None] * (beta * (b_u - tl.sum(b_h * b_khat[:, None], axis=0)))[None, :]
        tl.store(p_h, b_h, mask=m_h)
        for g in tl.static_range(G):
            b_qg = tl.load(q + (i_nh64 * G + g) * D + o_d, mask=m_d, other=0.0).to(tl.float32) * read
            b_og = tl.sum(b_h * b_qg[:, None], axis=0) + b_sv / t_safe
            tl.store(o + (i_nh64 * G + g) * D + o_v, b_og, mask=m_v)

    if C > 0:  # the sparse cache (cache_enter_): the old token offered, the new one keyed, before the exact part
        p_wk = win_key + i_n64 * W * H + i_h  # window slot j's selection key at p_wk + j·H
        new = tl.where(m > 0.0, tl.load(p_wk), float("-inf"))  # the old token's key; −inf: no candidate
        o_m = tl.arange(0, BM)
        lane_min = tl.full((BM,), float("inf"), tl.float64)
        lane_at = tl.zeros((BM,), tl.int32)
        for j0 in range(0, C, BM):  # the lowest key and its first slot (as torch.argmin): keys only, wide blocks
            j = j0 + o_m
            b_key = tl.load(cache_key + (i_n64 * C + j) * H + i_h, mask=j < C, other=float("inf"))
            lower = b_key < lane_min
            lane_at = tl.where(lower, j, lane_at)
            lane_min = tl.where(lower, b_key, lane_min)
        low = tl.min(lane_min, axis=0)
        at = tl.min(tl.where(lane_min == low, lane_at, C), axis=0)
        tl.debug_barrier()  # every thread has read the keys (a small block is loaded once per warp) before one changes
        take = new >= low
        p_at = ((i_n64 * C + at) * H + i_h) * D + o_d
        m_take = tl.where(take, o_d, D) < D  # m_d where take (a vector & scalar mask comes out int32 interpreted)
        tl.store(cache_k + p_at, b_kold.to(cache_k.dtype.element_ty), mask=m_take)
        tl.store(cache_v + p_at, tl.load(win_v + p_win + o_d, mask=m_d, other=0.0).to(cache_v.dtype.element_ty),
                 mask=m_take)
        tl.store(cache_key + (i_n64 * C + at) * H + i_h, new, mask=take)
        if PROBE:  # the new token's score, the probe (H, F + 1) on the block's input (N, F), as probe_scores: float64
            o_f = tl.arange(0, BF)
            acc_f = tl.zeros((BF,), tl.float64)
            for f0 in range(0, F, BF):
                m_f = f0 + o_f < F
                acc_f += (tl.load(probe_in + i_n64 * F + f0 + o_f, mask=m_f, other=0.0).to(tl.float64)
                          * tl.load(probe + i_h * (F + 1) + f0 + o_f, mask=m_f, other=0.0).to(tl.float64))
            score = tl.sum(acc_f, axis=0) + tl.load(probe + i_h * (F + 1) + F).to(tl.float64)
        else:
            score = tl.load(token_score + i_nh64).to(tl.float64)
        key = score + TIE * (c + 1).to(tl.float64) * (tl.abs(score) + 1.0)  # selection_keys at position c + 1
        key = tl.where(c + 1 > S, key, float("-inf"))  # a sink is never a candidate
        o_k = tl.arange(0, BP)
        for j0 in range(0, W, BP):  # the window's keys move down one slot, the new token's last
            slot = j0 + o_k
            m_s = (slot < W) & (slot >= 1)
            b_wk = tl.load(p_wk + slot * H, mask=m_s, other=0.0)
            tl.debug_barrier()
            tl.store(p_wk + (slot - 1) * H, b_wk, mask=m_s)
        tl.debug_barrier()
        tl.store(p_wk + (W - 1) * H, key)  # (the barriers above also order the cache's stores before its reads)

    # the exact part, online over the new token, the window (shifted as it streams) and the sinks
    b_k = tl.load(k + i_nh64 * D + o_d, mask=m_d, other=0.0)
    b_v = tl.load(v + i_nh64 * D + o_d, mask=m_d, other=0.0)
    b_knew, b_vnew = b_k.to(win_k.dtype.element_ty), b_v.to(win_v.dtype.element_ty)  # as the window keeps it
    m_run = tl.sum(b_q * b_knew.to(tl.float32)[None, :], axis=1)  # (BG,)
    l_run = tl.full((BG,), 1.0, tl.float32)
    acc = tl.zeros((BG, BD), tl.float32) + b_vnew.to(tl.float32)[None, :]
    o_w = tl.arange(0, BW)
    for j0 in range(0, W, BW):
        slot = j0 + o_w
        m_s = slot < W
        p_kv = p_win + slot.to(tl.int64)[:, None] * (H * D) + o_d[None, :]
        m_kv = m_s[:, None] & m_d[None, :]
        b_kb = tl.load(win_k + p_kv, mask=m_kv, other=0.0)
        b_vb = tl.load(win_v + p_kv, mask=m_kv, other=0.0)
        ok = m_s & (slot >= 1) & (tl.load(win_pos + i_n64 * W + slot, mask=m_s, other=0) > 0)
        m_run, l_run, acc = _softmax_block(b_q, b_kb.to(tl.float32), b_vb.to(tl.float32), ok, m_run, l_run, acc)
        tl.debug_barrier()  # every thread has read (and used) these slots before any writes one of them
        down = m_kv & (slot >= 1)[:, None]
        tl.store(win_k + p_kv - H * D, b_kb, mask=down)
        tl.store(win_v + p_kv - H * D, b_vb, mask=down)
    tl.debug_barrier()
    tl.store(win_k + p_win + (W - 1) * H * D + o_d, b_knew, mask=m_d)
    tl.store(win_v + p_win + (W - 1) * H * D + o_d, b_vnew, mask=m_d)
    o_j = tl.arange(0, BS)
    for j0 in range(0, S, BS):
        j = j0 + o_j
        m_j = j < S
        si = tl.load(sink_index + i_n64 * S + j, mask=m_j, other=-1)
        ok = m_j & (si >= 0) & (si <= r - W)  # a sink inside the window is a window key already
        p_kv = ((i_n64 * S + j.to(tl.int64)) * H + i_h)[:, None] * D + o_d[None, :]
        m_kv = ok[:, None] & m_d[None, :]
        b_kb = tl.load(sink_k + p_kv, mask=m_kv, other=0.0).to(tl.float32)
        b_vb = tl.load(sink_v + p_kv, mask=m_kv, other=0.0).to(tl.float32)
        m_run, l_run, acc = _softmax_block(b_q, b_kb, b_vb, ok, m_run, l_run, acc)
    # the new token becomes sink c while there are fewer than S (never a key of this step: it is in the window)
    fill = (c < S) & (tl.load(sink_index + i_n64 * S + c, mask=c < S, other=0) < 0)
    p_sink = ((i_n64 * S + c) * H + i_h) * D + o_d
    m_fill = tl.where(fill, o_d, D) < D  # m_d where fill (vector & scalar masks come out int32 when interpreted)
    tl.store(sink_k + p_sink, b_k.to(sink_k.dtype.element_ty), mask=m_fill)
    tl.store(sink_v + p_sink, b_v.to(sink_v.dtype.element_ty), mask=m_fill)

    # the mix by mass, on o_O read back
    lse = m_run + tl.log(l_run)
    log_z = tl.log(t_safe) + tl.sum(b_q * b_kmean[None, :], axis=1)
    log_z += tl.load(mix_bias + i_h * G + o_g, mask=m_g, other=0.0).to(tl.float32)
    if C > 0:  # the cache's slots come in the next kernel, which mixes: this part's softmax and log Z handed on
        tl.store(part_m + row_q * NP, m_run, mask=m_g)
        tl.store(part_l + row_q * NP, l_run, mask=m_g)
        tl.store(part_acc + row_q[:, None] * (NP * D) + o_d[None, :], acc, mask=m_o)
        tl.store(part_z + row_q, tl.where(t > 0.0, log_z, float("-inf")), mask=m_g)
    else:
        w = tl.where(t > 0.0, 1.0 / (1.0 + tl.exp(log_z - lse)), 1.0)[:, None]
        tl.debug_barrier()  # o_O was stored by other threads
        b_o = w * (acc / l_run[:, None]) + (1.0 - w) * tl.load(p_o, mask=m_o, other=0.0)
        tl.debug_barrier()  # and is read by all before any overwrites it
        tl.store(p_o, b_o, mask=m_o)

    # what every head of the sequence read: moved on by its last program
    tl.debug_barrier()
    ticket = tl.atomic_add(tickets + i_n64, 1)
    if ticket == H - 1:
        o_p = tl.arange(0, BP)
        for j0 in range(0, W, BP):
            slot = j0 + o_p
            m_s = (slot < W) & (slot >= 1)
            b_p = tl.load(win_pos + i_n64 * W + slot, mask=m_s, other=0)
            tl.debug_barrier()
            tl.store(win_pos + i_n64 * W + slot - 1, b_p, mask=m_s)
        tl.debug_barrier()
        tl.store(win_pos + i_n64 * W + W - 1, c + 1)
        tl.store(sink_index + i_n64 * S + c, r, mask=fill)
        tl.store(tokens + i_n64, c + 1)
        tl.store(rows + i_n64, r + 1)
        tl.store(count + i_n64, t)
        tl.atomic_xchg(tickets + i_n64, 0)


@triton.jit
def _cache_softmax_mix_kernel(
    q, cache_k, cache_v, cache_key, o, part_m, part_l, part_acc, part_z, tickets, NP,
    H: tl.constexpr, G: tl.constexpr, D: tl.constexpr, C: tl.constexpr, CS: tl.constexpr, BG: tl.constexpr,
    BD: tl.constexpr, BC: tl.constexpr,
):
    """The sparse cache's slots ``[i·CS, (i+1)·CS)`` of a KV head (program ``(n·H + h, i)``), the offer taken:
    their softmax for the G query heads into partial ``i + 1`` (partial 0: the step kernel's new token, window
    and sinks). The head's last program to finish joins the ``NP`` partials (flash-decoding) and mixes:
    ``o = w o_E + (1 − w) o_O``, ``o_O`` read from ``o``, ``w = σ(lse − log Z)``."""
    i_nh, i_sp = tl.program_id(0), tl.program_id(1)
    i_n64, i_nh64 = (i_nh // H).to(tl.int64), i_nh.to(tl.int64)
    i_h = i_nh % H
    o_d = tl.arange(0, BD)
    m_d = o_d < D
    o_g = tl.arange(0, BG)
    m_g = o_g < G
    row_q = i_nh64 * G + o_g
    m_o = m_g[:, None] & m_d[None, :]
    b_q = tl.load(q + row_q[:, None] * D + o_d[None, :], mask=m_o, other=0.0).to(tl.float32)
    m_run = tl.full((BG,), float("-inf"), tl.float32)
    l_run = tl.zeros((BG,), tl.float32)
    acc = tl.zeros((BG, BD), tl.float32)
    o_c = tl.arange(0, BC)
    for j0 in range(i_sp * CS, i_sp * CS + CS, BC):  # the slots that hold a token (a finite key)
        j = j0 + o_c
        m_j = (j < C) & (j < i_sp * CS + CS)
        p_key = (i_n64 * C + j.to(tl.int64)) * H + i_h
        ok = m_j & (tl.load(cache_key + p_key, mask=m_j, other=float("-inf")) > float("-inf"))
        m_kv = ok[:, None] & m_d[None, :]
        b_kb = tl.load(cache_k + p_key[:, None] * D + o_d[None, :], mask=m_kv, other=0.0).to(tl.float32)
        b_vb = tl.load(cache_v + p_key[:, None] * D + o_d[None, :], mask=m_kv, other=0.0).to(tl.float32)
        m_run, l_run, acc = _softmax_block(b_q, b_kb, b_vb, ok, m_run, l_run, acc)
    part = 1 + i_sp
    tl.store(part_m + row_q * NP + part, m_run, mask=m_g)
    tl.store(part_l + row_q * NP + part, l_run, mask=m_g)
    tl.store(part_acc + (row_q[:, None] * NP + part) * D + o_d[None, :], acc, mask=m_o)
    tl.debug_barrier()  # every thread's partial stored before the ticket (acq_rel) publishes it
    ticket = tl.atomic_add(tickets + i_nh64, 1)
    if ticket == NP - 2:  # the last of the NP − 1 splits: join them all
        tl.debug_barrier()
        m_all = tl.full((BG,), float("-inf"), tl.float32)
        for i in range(NP):  # partial 0 is finite (the new token's score), so m_all is
            m_all = tl.maximum(m_all, tl.load(part_m + row_q * NP + i, mask=m_g, other=float("-inf"), cache_modifier=".cg"))
        l_all = tl.zeros((BG,), tl.float32)
        acc_all = tl.zeros((BG, BD), tl.float32)
        for i in range(NP):
            f = tl.exp(tl.load(part_m + row_q * NP + i, mask=m_g, other=float("-inf"), cache_modifier=".cg") - m_all)
            l_all += f * tl.load(part_l + row_q * NP + i, mask=m_g, other=0.0, cache_modifier=".cg")
            acc_all += f[:, None] * tl.load(part_acc + (row_q[:, None] * NP + i) * D + o_d[None, :], mask=m_o,
                                            other=0.0, cache_modifier=".cg")
        lse = m_all + tl.log(l_all)
        log_z = tl.load(part_z + row_q, mask=m_g, other=0.0)
        w = (1.0 / (1.0 + tl.exp(log_z - lse)))[:, None]  # log Z = −inf (no old token yet): w = 1
        p_o = o + row_q[:, None] * D + o_d[None, :]
        b_o = w * (acc_all / l_all[:, None]) + (1.0 - w) * tl.load(p_o, mask=m_o, other=0.0)
        tl.store(p_o, b_o, mask=m_o)
        tl.atomic_xchg(tickets + i_nh64, 0)


def _check(q, k, v, buffers, state, sum_k, sum_v, count, rho, beta_factor, gate_factor, mix_bias, window, sinks, cache):
    N, H, D = k.shape
    W, S = window, sinks
    if q.dim() != 3 or q.shape[0] != N or q.shape[2] != D or q.shape[1] % H:
        raise ValueError(f"q must be [N, G·H, D] for k [N, H, D] = {list(k.shape)}; got {tuple(q.shape)}")
    b = buffers
    want = {"v": (v, (N, H, D)), "state": (state, (N, H, D, D)), "sum_k": (sum_k, (N, H, D)),
            "sum_v": (sum_v, (N, H, D)), "count": (count, (N,)), "rho": (rho, (H,)),
            "beta_factor": (beta_factor, (N, H)), "gate_factor": (gate_factor, (N, H)),
            "mix_bias": (mix_bias, (q.shape[1],)), "sink_k": (b.sink_k, (N, S, H, D)),
            "sink_v": (b.sink_v, (N, S, H, D)), "sink_index": (b.sink_index, (N, S)),
            "win_k": (b.win_k, (N, W, H, D)), "win_v": (b.win_v, (N, W, H, D)), "win_pos": (b.win_pos, (N, W)),
            "buffers.count": (b.count, (N,)), "rows": (b.rows, (N,))}
    if cache is not None:
        C = cache.key.shape[1]
        want.update({"cache.k": (cache.k, (N, C, H, D)), "cache.v": (cache.v, (N, C, H, D)),
                     "cache.key": (cache.key, (N, C, H)), "cache.win_key": (cache.win_key, (N, W, H))})
        if cache.key.dtype != torch.float64 or cache.win_key.dtype != torch.float64:
            raise ValueError("the sparse cache's selection keys are float64 (ops.sparse_cache.selection_keys)")
        if not all(x.is_contiguous() for x in cache.tensors()):
            raise ValueError("the sparse cache's buffers are read by the kernel: they must be contiguous")
    check_shapes(want, {"state": state, "sum_k": sum_k, "sum_v": sum_v, "count": count})
    for name, x in (("sink_index", b.sink_index), ("win_pos", b.win_pos), ("buffers.count", b.count),
                    ("rows", b.rows)):
        if x.dtype != torch.long or not x.is_contiguous():
            raise ValueError(f"{name} is updated in place by the kernel: it must be contiguous int64")
    for name, x in (("sink_k", b.sink_k), ("sink_v", b.sink_v), ("win_k", b.win_k), ("win_v", b.win_v)):
        if x.dtype not in TRITON_DTYPES or not x.is_contiguous():
            raise ValueError(f"{name} is updated in place by the kernel: it must be contiguous fp16/bf16/fp32")


# cache slots per program of the cache's kernel: at batch 1 a layer's 256 slots are 8 programs per KV head instead of
# one walking them all (flash-decoding)
_CACHE_SPLIT = 32


def _blocks(G: int, D: int, W: int, S: int, C: int) -> dict[str, int]:
    """Block sizes: a block of keys (``BW`` window slots, ``BS`` sinks, ``BC`` cache slots) times the G query heads
    times D kept to 4096 products per program (32 fp32 registers a thread at 4 warps), a state tile of ``D × BV``
    to 4096 entries, ``win_pos`` shifted and the cache's lowest key sought 1024 slots at a time."""
    BG, BD = next_pow2(G), next_pow2(D)
    keys = max(2, 4096 // (BG * BD))
    return dict(BG=BG, BD=BD, BW=min(keys, max(2, next_pow2(W))), BS=min(keys, max(2, next_pow2(max(S, 1)))),
                BC=min(keys, _CACHE_SPLIT, max(2, next_pow2(max(C, 1)))), BM=min(1024, max(2, next_pow2(max(C, 1)))),
                BV=max(16, min(BD, 4096 // BD)), BP=min(1024, max(2, next_pow2(W))))


def sink_window_gdn_step_triton(q, k, v, buffers, state, sum_k, sum_v, count, rho, beta_factor, gate_factor, mix_bias,
                                beta_max, window, sinks, decays=True, eps=1e-12, cache=None, token_score=None,
                                probe=None):
    """The kernel's launcher; arguments as :func:`linearize.ops.window_step.sink_window_gdn_step_`. Returns
    ``o [N, G·H, D]`` float32; the buffers, ``state``, ``sum_k``, ``sum_v`` and ``count`` change in place.
    ``probe``: ``(block input [N, F], probe [H, F + 1])`` in place of ``token_score``, the score computed in the
    kernel (four small launches fewer a layer and step than :func:`~linearize.ops.sparse_cache.probe_scores`)."""
    _check(q, k, v, buffers, state, sum_k, sum_v, count, rho, beta_factor, gate_factor, mix_bias, window, sinks, cache)
    N, H, D = k.shape
    Hq = q.shape[1]
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    o = torch.empty(N, Hq, D, dtype=torch.float32, device=q.device)
    if N == 0:
        return o
    b = buffers
    C = 0 if cache is None else cache.key.shape[1]
    ck, cv, ckey, wkey = (b.sink_k, b.sink_v, b.sink_index, b.sink_index) if cache is None else cache.tensors()
    score = mix_bias if token_score is None else token_score.double().contiguous()
    probe_in, weights = (mix_bias, mix_bias) if probe is None else (x.contiguous() for x in probe)
    F = probe_in.shape[-1] if probe is not None else 1
    tickets = _tickets(q.device, N * H)  # per sequence here, per (sequence, KV head) in the cache's kernel
    blocks = _blocks(Hq // H, D, window, sinks, C)
    BC = blocks.pop("BC")
    splits = triton.cdiv(C, _CACHE_SPLIT)
    NP = splits + 1  # the partial softmaxes the cache's kernel joins: the step kernel's, then one per split
    part_m = part_l = part_acc = part_z = o  # without a cache unused: the step kernel mixes itself
    if C:
        f32 = dict(dtype=torch.float32, device=q.device)
        part_m, part_l, part_acc, part_z = (torch.empty(N * Hq, NP, **f32), torch.empty(N * Hq, NP, **f32),
                                            torch.empty(N * Hq, NP, D, **f32), torch.empty(N * Hq, **f32))
    _sink_window_gdn_step_kernel[(N * H,)](
        q, k, v, b.sink_k, b.sink_v, b.sink_index, b.win_k, b.win_v, b.win_pos, b.count, b.rows,
        state, sum_k, sum_v, count, rho.contiguous(), beta_factor.contiguous(), gate_factor.contiguous(),
        mix_bias.contiguous(), o, tickets, float(beta_max), float(eps), ck, cv, ckey, wkey, score, probe_in, weights, F,
        part_m, part_l, part_acc, part_z, NP,
        H=H, G=Hq // H, D=D, W=window, S=sinks, DECAYS=bool(decays), C=C, TIE=_TIE, PROBE=probe is not None,
        BF=min(1024, next_pow2(F)), num_warps=4, **blocks,
    )
    if C:
        _cache_softmax_mix_kernel[(N * H, splits)](
            q, ck, cv, ckey, o, part_m, part_l, part_acc, part_z, tickets, NP,
            H=H, G=Hq // H, D=D, C=C, CS=_CACHE_SPLIT, BG=blocks["BG"], BD=blocks["BD"], BC=BC, num_warps=4,
        )
    return o

"""One decode step of a Taylor-GDN layer as one kernel: the Taylor front, the delta update and the back.

Per sequence ``n`` and KV head, with ``m`` = 1 (0 for a padding step) and ``t = count + m``:

    Σk ← Σk + m k,  Σv ← Σv + m v,  k̄ = Σk/t,  v̄_t = Σv/t,  v̄_{t−1} = Σv_old/max(t−1, 1)
    live = m·[t > 1];  k̃ = k − k̄ (0 unless live),  n = ‖k̃‖,  k̂ = k̃/n
    β = clip(ρ n/(t−1) · f_β, 0, β_max) (0 unless live),  u = n (v − v̄_{t−1})/(t β)  (0 where β = 0)
    α = (1 − 1/t)^{f_g}  (1 unless live)
    h ← α h;  h ← h + k̂ (β (u − hᵀk̂))ᵀ;  o_g = hᵀ (scale · q_g) + v̄_t   for the G query heads g

— what ``taylor_front`` (one token, carried running sums), ``gated_delta_rule_step`` and ``taylor_back``
compute, with the state ``h [K, V]``, the sums and the count updated in place (a CUDA graph can capture
the step: it allocates only its output, reads nothing back to the host and branches on no value).

One program per (sequence, KV head, V tile): it owns its tile of ``h`` and of ``Σv`` and reads the KV
head's state once for all G query heads. ``Σk`` (read by every V tile of the head) and ``count`` (read by
every head of the sequence) must change only after all of them have read it: each program takes a ticket
from a per-sequence counter once it is done, and the last one of the sequence writes the new ``count`` and
``Σk`` of all its heads and resets the counter to 0 for the next launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common import cdiv, next_pow2


@triton.jit
def _taylor_gdn_step_kernel(
    q, k, v, state, sum_k, sum_v, count, mask, rho, beta_factor, gate_factor, o, tickets, beta_max, scale, eps,
    H: tl.constexpr, G: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    NV: tl.constexpr, HAS_MASK: tl.constexpr,
):
    i_nh, i_v = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    i_n64, i_nh64 = i_n.to(tl.int64), i_nh.to(tl.int64)
    o_k = tl.arange(0, BK)
    m_k = o_k < K
    o_v = i_v * BV + tl.arange(0, BV)
    m_v = o_v < V

    # the token count and the key side: the same in every V tile
    if HAS_MASK:
        m = tl.load(mask + i_n64).to(tl.float32)
        t = tl.load(count + i_n64) + m
        live = (m > 0.0) & (t > 1.0)  # where the state moves at all
    else:
        m = 1.0
        t = tl.load(count + i_n64) + 1.0
        live = t > 1.0
    t_safe = tl.maximum(t, 1.0)
    tm1 = tl.maximum(t - 1.0, 1.0)
    b_k = tl.load(k + i_nh64 * K + o_k, mask=m_k, other=0.0).to(tl.float32)
    b_sk = tl.load(sum_k + i_nh64 * K + o_k, mask=m_k, other=0.0)
    b_kc = tl.where(live, b_k - (b_sk + m * b_k) / t_safe, 0.0)  # k̃
    n = tl.sqrt(tl.sum(b_kc * b_kc, axis=0))
    b_khat = b_kc / tl.maximum(n, eps)
    f_b = tl.load(beta_factor + i_nh64).to(tl.float32)
    f_g = tl.load(gate_factor + i_nh64).to(tl.float32)
    beta = tl.load(rho + i_h).to(tl.float32) * n / tm1 * f_b
    beta = tl.where(live, tl.minimum(tl.maximum(beta, 0.0), beta_max), 0.0)
    coef = tl.where(beta > 0.0, n / (t_safe * tl.maximum(beta, eps)), 0.0)
    alpha = tl.exp(tl.log(tl.where(live, 1.0 - 1.0 / t_safe, 1.0)) * f_g)  # (1 − 1/t)^f_g, 1 unless live

    # the value side, on this program's V tile
    p_v = i_nh64 * V + o_v
    b_v = tl.load(v + p_v, mask=m_v, other=0.0).to(tl.float32)
    b_sv = tl.load(sum_v + p_v, mask=m_v, other=0.0)
    b_u = coef * (b_v - b_sv / tm1)  # ṽ uses v̄_{t−1}, the mean before this token
    b_sv = b_sv + m * b_v
    b_vbar = b_sv / t_safe

    # h ← α h, then the rank-1 delta update; the state tile is read and written once
    p_h = state + i_nh64 * K * V + o_k[:, None] * V + o_v[None, :]
    m_h = m_k[:, None] & m_v[None, :]
    b_h = tl.load(p_h, mask=m_h, other=0.0) * alpha
    # every thread has read Σv and h before any writes them: the compiler may load a small block once for
    # each layout it is used in, and then threads other than the one that stores an entry read it too
    tl.debug_barrier()
    tl.store(sum_v + p_v, b_sv, mask=m_v)
    b_delta = beta * (b_u - tl.sum(b_h * b_khat[:, None], axis=0))
    b_h += b_khat[:, None] * b_delta[None, :]
    tl.store(p_h, b_h, mask=m_h)

    # o = hᵀ (scale q) + v̄ for each query head of the group (query head i_h·G + g reads KV head i_h)
    for g in tl.static_range(G):
        row = i_nh64 * G + g
        b_q = tl.load(q + row * K + o_k, mask=m_k, other=0.0).to(tl.float32) * scale
        b_o = tl.sum(b_h * b_q[:, None], axis=0) + b_vbar
        tl.store(o + row * V + o_v, b_o.to(o.dtype.element_ty), mask=m_v)

    # Σk and count: written by the sequence's last program, after every other one has read them
    tl.debug_barrier()
    ticket = tl.atomic_add(tickets + i_n64, 1)
    if ticket == H * NV - 1:
        tl.store(count + i_n64, t)
        for j in range(H):
            p_k = (i_n64 * H + j) * K + o_k
            b_kj = tl.load(k + p_k, mask=m_k, other=0.0).to(tl.float32)
            b_skj = tl.load(sum_k + p_k, mask=m_k, other=0.0)
            tl.store(sum_k + p_k, b_skj + m * b_kj, mask=m_k)
        tl.atomic_xchg(tickets + i_n64, 0)


_TICKETS: dict[torch.device, torch.Tensor] = {}
_OUTGROWN: list[torch.Tensor] = []  # replaced counters stay allocated: a CUDA graph captured on them replays them


def _tickets(device: torch.device, N: int) -> torch.Tensor:
    """At least ``N`` ticket counters (per sequence, or per sequence and KV head), zero between launches (each
    launch's last programs reset theirs). Kept per device and reused, so a captured step allocates nothing;
    launches on several streams at once must not share them."""
    buf = _TICKETS.get(device)
    if buf is None or buf.numel() < N:
        if buf is not None:
            _OUTGROWN.append(buf)
        buf = _TICKETS[device] = torch.zeros(max(N, 64), dtype=torch.int32, device=device)
    return buf


def _blocks(K: int, V: int) -> tuple[int, int]:
    """``(BK, BV)``: the whole key row, and a V tile of at most 4096 state entries per program (more
    programs at small batches; 32 fp32 registers a thread at 4 warps)."""
    BK = next_pow2(K)
    return BK, max(16, min(next_pow2(V), 4096 // BK))


def _check(q, k, v, state, sum_k, sum_v, count, rho, beta_factor, gate_factor, mask) -> None:
    N, H, K = k.shape
    V = v.shape[-1]
    if q.dim() != 3 or q.shape[0] != N or q.shape[2] != K or q.shape[1] % H:
        raise ValueError(f"q must be [N, G·H, K] for k [N, H, K] = {list(k.shape)}; got {tuple(q.shape)}")
    want = {"v": (v, (N, H, V)), "state": (state, (N, H, K, V)), "sum_k": (sum_k, (N, H, K)),
            "sum_v": (sum_v, (N, H, V)), "count": (count, (N,)), "rho": (rho, (H,)),
            "beta_factor": (beta_factor, (N, H)), "gate_factor": (gate_factor, (N, H))}
    if mask is not None:
        want["mask"] = (mask, (N,))
    check_shapes(want, {"state": state, "sum_k": sum_k, "sum_v": sum_v, "count": count})


def check_shapes(want: dict, in_place_fp32: dict) -> None:
    """Each ``name: (tensor, shape)`` of ``want`` has its shape; each tensor of ``in_place_fp32`` (the state and
    its sums, which a step kernel updates in place) is contiguous float32. Raises ValueError naming the first
    that is not."""
    for name, (x, shape) in want.items():
        if tuple(x.shape) != shape:
            raise ValueError(f"{name} must be {list(shape)}; got {tuple(x.shape)}")
    for name, x in in_place_fp32.items():
        if x.dtype != torch.float32 or not x.is_contiguous():
            raise ValueError(f"{name} is updated in place by the kernel: it must be contiguous float32")


def taylor_gdn_step_triton(q, k, v, state, sum_k, sum_v, count, rho, beta_factor, gate_factor, beta_max, scale,
                           mask=None, eps=1e-12):
    """The kernel's launcher; arguments as :func:`linearize.ops.decode.taylor_gdn_step_`. Returns
    ``o [N, G·H, V]`` in v's dtype; ``state``, ``sum_k``, ``sum_v`` and ``count`` change in place."""
    _check(q, k, v, state, sum_k, sum_v, count, rho, beta_factor, gate_factor, mask)
    N, H, K = k.shape
    Hq, V = q.shape[1], v.shape[-1]
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    o = torch.empty(N, Hq, V, dtype=v.dtype, device=v.device)
    if N == 0:
        return o
    BK, BV = _blocks(K, V)
    NV = cdiv(V, BV)
    m = mask.contiguous().view(torch.uint8) if mask is not None else count
    _taylor_gdn_step_kernel[(N * H, NV)](
        q, k, v, state, sum_k, sum_v, count, m, rho.contiguous(), beta_factor.contiguous(), gate_factor.contiguous(),
        o, _tickets(v.device, N), float(beta_max), float(scale), float(eps),
        H=H, G=Hq // H, K=K, V=V, BK=BK, BV=BV, NV=NV, HAS_MASK=mask is not None, num_warps=4,
    )
    return o

"""The exact part of a sink + sliding-window block as one Triton forward kernel (inference only).

When it applies: where no gradient is wanted (a prefill, scoring), as :func:`linearize.ops.window.window_triton_usable`
decides; training keeps FlexAttention or the banded PyTorch form, which differentiate. Same arguments and results as
:func:`linearize.ops.window.sink_window_softmax`, which is its reference (``tests/test_window_triton.py``).

Per (query block, sequence, KV head) one program, whose ``BR`` rows are the ``G`` query heads of ``QB = BR // G``
consecutive queries (row ``r``: query ``t0 + r // G``, head ``h·G + r % G``), so each key and value tile is
read once for every query head that shares it:

    window      query t sees keys t + 1 … t + W of k (the W slots before the first query, then one per query)
                whose key_doc equals its query_doc; the block's queries t0 … t0 + QB − 1 together see
                keys t0 + 1 … t0 + QB − 1 + W, walked in tiles of BN: s = q kᵀ and p·v by ``tl.dot``
    sinks       where sink_ok: one set a sequence (sink_k of 1 row: a prefill, a continuation) is one more
                tile of keys, by ``tl.dot``; a set a query (T rows: packed documents) goes a sink at a time,
                a dot product a row
    softmax     online in float32: m ← max(m, max s), l ← l·e^{m_old − m} + Σ e^{s − m},
                acc ← acc·e^{m_old − m} + Σ e^{s − m} v;  o = acc / l,  lse = m + log l
                (o = 0, lse = −inf where a query sees no key)

Each block touches ``QB + W − 1`` keys and its queries' ``S`` sinks, so the cost is linear in T; programs of
neighbouring query blocks (grid axis 0) share most of their keys, which they find in L2. fp16/bf16 dots
multiply in the inputs' dtype (p rounded to it for p·v, as flash attention does) and add in float32; fp32
inputs take IEEE dots.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ..common import TRITON_DTYPES, TRITON_MAX_K, cdiv, next_pow2
from .tiles import dot, mm, online, online_result


@triton.jit
def _sink_window_fwd_kernel(
    q, k, v, key_doc, query_doc, sink_k, sink_v, sink_ok, o, lse, T,
    H: tl.constexpr, G: tl.constexpr, D: tl.constexpr, W: tl.constexpr, S: tl.constexpr, QB: tl.constexpr,
    BR: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr, BS: tl.constexpr, SHARED_SINKS: tl.constexpr,
    IEEE: tl.constexpr,
):
    i_q, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = (i_bh // H).to(tl.int64), i_bh % H
    HQ: tl.constexpr = G * H
    NT: tl.constexpr = (QB + W - 1 + BN - 1) // BN  # key tiles of a block
    L = W + T  # keys in a row
    t0 = i_q * QB
    o_r = tl.arange(0, BR)
    t = t0 + o_r // G  # (BR,) each row's query
    head = i_h * G + o_r % G  # and its query head
    m_r = (o_r < QB * G) & (t < T)
    o_d = tl.arange(0, BD)
    m_d = o_d < D
    m_rd = m_r[:, None] & m_d[None, :]
    row = (i_b * T + t) * HQ + head  # (BR,) int64: the row of o / lse
    b_q = tl.load(q + row[:, None] * D + o_d[None, :], mask=m_rd, other=0.0)  # (BR, BD)
    b_qd = tl.load(query_doc + i_b * T + t, mask=m_r, other=0)

    m_run = tl.full((BR,), float("-inf"), tl.float32)
    l_run = tl.zeros((BR,), tl.float32)
    acc = tl.zeros((BR, BD), tl.float32)
    p_kv = i_b * L * (H * D) + i_h * D  # key j of this sequence and head at p_kv + j·H·D
    o_n = tl.arange(0, BN)
    for n in range(NT):
        j = t0 + 1 + n * BN + o_n  # (BN,) key indices
        m_j = j < L
        b_kt = tl.load(k + p_kv + j[None, :].to(tl.int64) * (H * D) + o_d[:, None],
                       mask=m_j[None, :] & m_d[:, None], other=0.0)  # (BD, BN)
        b_v = tl.load(v + p_kv + j[:, None].to(tl.int64) * (H * D) + o_d[None, :],
                      mask=m_j[:, None] & m_d[None, :], other=0.0)  # (BN, BD)
        b_kd = tl.load(key_doc + i_b * L + j, mask=m_j, other=0)
        ok = (j[None, :] > t[:, None]) & (j[None, :] <= t[:, None] + W) & (b_kd[None, :] == b_qd[:, None])
        ok = ok & m_j[None, :] & m_r[:, None]
        s = tl.where(ok, dot(b_q, b_kt, IEEE), float("-inf"))  # (BR, BN)
        m_run, p, l_run, acc = online(s, m_run, l_run, acc)
        acc += mm(p, b_v, b_v, IEEE)

    if SHARED_SINKS:  # one set of sinks a sequence: a tile of BS keys, as the window's
        o_s = tl.arange(0, BS)
        m_s = o_s < S
        p_sk = ((i_b * S + o_s) * H + i_h) * D  # (BS,) int64
        b_skt = tl.load(sink_k + p_sk[None, :] + o_d[:, None], mask=m_s[None, :] & m_d[:, None], other=0.0)
        b_sv = tl.load(sink_v + p_sk[:, None] + o_d[None, :], mask=m_s[:, None] & m_d[None, :], other=0.0)
        ok = tl.load(sink_ok + ((i_b * T + t) * S)[:, None] + o_s[None, :], mask=m_r[:, None] & m_s[None, :], other=0)
        s = tl.where(ok != 0, dot(b_q, b_skt, IEEE), float("-inf"))  # (BR, BS)
        m_run, p, l_run, acc = online(s, m_run, l_run, acc)
        acc += mm(p, b_sv, b_sv, IEEE)
    else:  # sinks of their own for each query (packed documents): one column at a time, a dot product a row
        for js in range(S):
            ok = tl.load(sink_ok + (i_b * T + t) * S + js, mask=m_r, other=0) != 0
            p_sk = (((i_b * T + t) * S + js) * H + i_h)[:, None] * D + o_d[None, :]
            m_sk = ok[:, None] & m_d[None, :]
            b_sk = tl.load(sink_k + p_sk, mask=m_sk, other=0.0).to(tl.float32)
            s = tl.where(ok, tl.sum(b_q.to(tl.float32) * b_sk, axis=1), float("-inf"))[:, None]  # (BR, 1)
            m_run, p, l_run, acc = online(s, m_run, l_run, acc)
            acc += p * tl.load(sink_v + p_sk, mask=m_sk, other=0.0).to(tl.float32)

    b_o, b_lse = online_result(m_run, l_run, acc)
    tl.store(o + row[:, None] * D + o_d[None, :], b_o, mask=m_rd)
    tl.store(lse + row, b_lse, mask=m_r)


def check_inputs(q, k, v, key_doc, query_doc, window, sink_k, sink_v, sink_ok) -> None:
    """Raises ValueError naming the first argument that breaks :func:`sink_window_triton`'s contract."""
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(f"q must be [B, T, G·H, D] and k, v [B, W + T, H, D]; got q{tuple(q.shape)} k{tuple(k.shape)}")
    B, T, Hq, D = q.shape
    H, W = k.shape[2], window
    if not isinstance(W, int) or W < 1:
        raise ValueError(f"window must be a positive int; got {window!r}")
    if Hq % H:
        raise ValueError(f"q heads ({Hq}) must be a multiple of k/v heads ({H}) for grouped-query attention")
    if D > TRITON_MAX_K:
        raise ValueError(f"head sizes up to {TRITON_MAX_K} only; got {D} (use sink_window_softmax)")
    want = {"k": (k, (B, W + T, H, D)), "v": (v, (B, W + T, H, D)), "key_doc": (key_doc, (B, W + T)),
            "query_doc": (query_doc, (B, T))}
    if (sink_k is None) != (sink_v is None) or (sink_k is None) != (sink_ok is None):
        raise ValueError("sink_k, sink_v and sink_ok come together or not at all")
    if sink_k is not None:
        S = sink_k.shape[2] if sink_k.dim() == 5 else 0
        rows = 1 if sink_k.dim() == 5 and sink_k.shape[1] == 1 else T  # one set of sinks a row, or one a query
        want |= {"sink_k": (sink_k, (B, rows, S, H, D)), "sink_v": (sink_v, (B, rows, S, H, D)),
                 "sink_ok": (sink_ok, (B, T, S))}
    for name, (x, shape) in want.items():
        if tuple(x.shape) != shape:
            raise ValueError(f"{name} must be {list(shape)} for q {list(q.shape)} and window {W}; got {tuple(x.shape)}")
    if q.dtype not in TRITON_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k, v must share one dtype of fp16/bf16/fp32; got {q.dtype}, {k.dtype}, {v.dtype}")
    if sink_k is not None and (sink_k.dtype != q.dtype or sink_v.dtype != q.dtype):
        raise ValueError(f"sink_k, sink_v must be in q's dtype {q.dtype}; got {sink_k.dtype}, {sink_v.dtype}")
    if sink_ok is not None and sink_ok.dtype != torch.bool:
        raise ValueError(f"sink_ok must be bool; got {sink_ok.dtype}")
    for name, x in (("key_doc", key_doc), ("query_doc", query_doc)):
        if x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool:
            raise ValueError(f"{name} must hold integer document ids; got {x.dtype}")
    tensors = [x for x in (q, k, v, key_doc, query_doc, sink_k, sink_v, sink_ok) if x is not None]
    if any(x.device != q.device for x in tensors):
        raise ValueError(f"all inputs must be on one device; got {sorted({str(x.device) for x in tensors})}")
    if not q.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"sink_window_triton needs CUDA tensors (or TRITON_INTERPRET=1); got {q.device} "
                         "(use linearize.ops.window.sink_window_softmax)")


def blocks(G: int, D: int, dtype: torch.dtype) -> dict[str, int]:
    """Tiling: ``BR`` rows (G query heads × ``QB = BR // G`` queries) by ``BN`` keys by ``BD`` (D padded to a
    power of two), 8 warps. 128 × 64 up to D = 64 (a key tile then serves ~128/G queries), 64 × 32 beyond;
    fp32's exact (IEEE) dots hold their operands in registers: 32 × 32. The sm_90 builds (Triton 3.9) spill
    nothing with shared sinks, and with per-query sinks up to D = 128 (512 bytes at D = 256)."""
    BD = max(16, next_pow2(D))
    BR, BN = (32, 32) if dtype == torch.float32 else (128, 64) if BD <= 64 else (64, 32)
    BR = max(BR, next_pow2(G))
    return dict(QB=BR // G, BR=BR, BN=BN, BD=BD, num_warps=8)


def sink_window_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_doc: torch.Tensor,
    query_doc: torch.Tensor,
    window: int,
    sink_k: torch.Tensor | None = None,
    sink_v: torch.Tensor | None = None,
    sink_ok: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`linearize.ops.window.sink_window_softmax` in one Triton kernel; forward only (no autograd).

    Args:
        q: ``(B, T, G·H, D)`` fp16/bf16/fp32, the softmax scale folded in; D ≤ 256.
        k, v: ``(B, W + T, H, D)``, q's dtype: the ``W`` keys before the first query, then one per query.
            Query ``t`` sees keys ``t + 1 … t + W`` whose ``key_doc`` ``(B, W + T)`` equals its
            ``query_doc`` ``(B, T)`` (integer document ids).
        sink_k, sink_v: ``(B, T or 1, S, H, D)``: the sinks each query sees beside its window where
            ``sink_ok`` ``(B, T, S)`` (bool) is True.

    Returns ``o (B, T, G·H, D)`` and ``lse (B, T, G·H)``, float32; ``lse = −inf`` and ``o = 0`` for a query
    that sees no key.

    Example (on CUDA)::

        >>> from linearize.ops.window_inputs import fresh_inputs
        >>> q, k, v = torch.randn(2, 100, 6, 64, device="cuda"), *torch.randn(2, 2, 100, 2, 64, device="cuda")
        >>> x = fresh_inputs(k, v, window=64, sinks=4)
        >>> o, lse = sink_window_triton(q, x.k, x.v, x.key_doc, x.query_doc, 64, x.sink_k, x.sink_v, x.sink_ok)
        >>> o.shape, lse.shape
        (torch.Size([2, 100, 6, 64]), torch.Size([2, 100, 6]))
    """
    check_inputs(q, k, v, key_doc, query_doc, window, sink_k, sink_v, sink_ok)
    B, T, Hq, D = q.shape
    H = k.shape[2]
    o = torch.empty(B, T, Hq, D, dtype=torch.float32, device=q.device)
    lse = torch.empty(B, T, Hq, dtype=torch.float32, device=q.device)
    if B * T * Hq == 0:
        return o, lse
    S = 0 if sink_k is None else sink_k.shape[2]
    if S == 0:
        sink_k = sink_v = sink_ok = q  # never read
    else:
        sink_k, sink_v, sink_ok = sink_k.contiguous(), sink_v.contiguous(), sink_ok.contiguous()
    tiles = blocks(Hq // H, D, q.dtype)
    _sink_window_fwd_kernel[(cdiv(T, tiles["QB"]), B * H)](
        q.contiguous(), k.contiguous(), v.contiguous(), key_doc.contiguous(), query_doc.contiguous(),
        sink_k, sink_v, sink_ok, o, lse, T,
        H=H, G=Hq // H, D=D, W=window, S=S, BS=max(16, next_pow2(max(S, 1))),
        SHARED_SINKS=S > 0 and sink_k.shape[1] == 1, IEEE=q.dtype == torch.float32, **tiles,
    )
    return o, lse

"""The sparse cache's softmax for a prefill as one Triton forward kernel a selection block (inference only).

:func:`linearize.ops.sparse_cache.cache_softmax` is its reference (``tests/test_cache_triton.py``): the same
blocks of queries and the same candidates each block can keep (``_pooled_blocks``: the ``size`` best carried
in, then the block's own stream), the same thresholds. The reference writes every query's logits against
every candidate of its block, ``(B, H, G, Q, C + Q)`` in float32, and reads them four times (mask,
log-sum-exp, exp, the product with v); here they stay in registers, softmax online as in flash attention.

Per (query tile, sequence, KV head) one program, whose ``BR`` rows are the ``G`` query heads of ``QB = BR // G``
consecutive queries of the block (row ``r``: query ``t0 + r // G``, head ``h·G + r % G``), walking the pool
in tiles of ``BN`` entries:

    pool entry p   a candidate index ``pool[b, h, p]`` into k, v, key; the first ``carried`` entries every query
                   of the block sees, entry ``carried + j`` (the block's j-th stream token) queries ``t0 + j``
                   and later; the tile's queries need the entries up to ``carried + (last query − t0)``
    kept           seen, and its selection key finite and at least the query's threshold ``thr`` (float64)
    softmax        online in float32 (:func:`linearize.ops.triton.tiles.online`); o = 0, lse = −inf
                   where a query keeps nothing

The keys and values are gathered a row at a time by index (a pool is not contiguous in the sequence), so
each tile reads ``BN`` rows of ``D`` elements wherever they lie. fp16/bf16 dots multiply in the inputs' dtype
and add in float32; fp32 inputs take IEEE dots. Measured on an H200 (SmolLM2-135M's architecture, a cache of
1,024, `scripts/bench_decode.py --paths teacher converted`): time to first token at 32K × 16 4.19 s against the
teacher's 1.94 s in the same run, where the dense form took 15.3 s against 1.96 s
(``results/prefill_sparse_cache_kernel_random_weights.json``, ``results/bench_decode_sparse_cache_1024_compiled_32kx16.json``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common import cdiv, next_pow2
from .tiles import dot, mm, online, online_result


@triton.jit
def _cache_fwd_kernel(
    q, k, v, key, pool, thr, o, lse, T, t0, Q, N, P, carried,
    H: tl.constexpr, G: tl.constexpr, D: tl.constexpr, QB: tl.constexpr, BR: tl.constexpr,
    BN: tl.constexpr, BD: tl.constexpr, IEEE: tl.constexpr,
):
    i_q, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = (i_bh // H).to(tl.int64), i_bh % H
    HQ: tl.constexpr = G * H
    o_r = tl.arange(0, BR)
    j = i_q * QB + o_r // G  # (BR,) each row's query, counted from the block's first
    head = i_h * G + o_r % G
    m_r = (o_r < QB * G) & (j < Q)
    o_d = tl.arange(0, BD)
    m_d = o_d < D
    m_rd = m_r[:, None] & m_d[None, :]
    row = ((i_b * T + t0 + j) * HQ + head).to(tl.int64)  # (BR,): the row of q, o, lse (T queries a sequence)
    b_q = tl.load(q + row[:, None] * D + o_d[None, :], mask=m_rd, other=0.0)  # (BR, BD)
    b_thr = tl.load(thr + (i_b * H + i_h) * Q + j, mask=m_r, other=float("inf"))  # (BR,) float64

    m_run = tl.full((BR,), float("-inf"), tl.float32)
    l_run = tl.zeros((BR,), tl.float32)
    acc = tl.zeros((BR, BD), tl.float32)
    last = tl.minimum(i_q * QB + QB, Q) - 1  # the tile's last query
    n_seen = carried + last + 1  # pool entries any of its queries sees
    o_n = tl.arange(0, BN)
    for n in range(0, tl.cdiv(n_seen, BN)):
        p = n * BN + o_n  # (BN,) pool entries
        m_p = p < n_seen
        idx = tl.load(pool + (i_b * H + i_h) * P + p, mask=m_p, other=0).to(tl.int64)  # candidate indices
        at = (i_b * N + idx) * H + i_h  # (BN,) their row of k, v (times D) and of key
        b_key = tl.load(key + at, mask=m_p, other=float("-inf"))  # (BN,) float64
        b_kt = tl.load(k + at[None, :] * D + o_d[:, None], mask=m_p[None, :] & m_d[:, None], other=0.0)  # (BD, BN)
        b_v = tl.load(v + at[:, None] * D + o_d[None, :], mask=m_p[:, None] & m_d[None, :], other=0.0)  # (BN, BD)
        seen = (p[None, :] < carried) | (p[None, :] - carried <= j[:, None])
        kept = seen & (b_key[None, :] > float("-inf")) & (b_key[None, :] >= b_thr[:, None]) & m_r[:, None]
        s = tl.where(kept, dot(b_q, b_kt, IEEE), float("-inf"))  # (BR, BN)
        m_run, pr, l_run, acc = online(s, m_run, l_run, acc)
        acc += mm(pr, b_v, b_v, IEEE)

    b_o, b_lse = online_result(m_run, l_run, acc)
    tl.store(o + row[:, None] * D + o_d[None, :], b_o, mask=m_rd)
    tl.store(lse + row, b_lse, mask=m_r)


@triton.jit
def _threshold_kernel(ordered, arrival, thr, P, Q, size, BQ: tl.constexpr, BN: tl.constexpr):
    """Per (query tile, sequence × KV head): each query's threshold, the key at the first position of the pool
    sorted by key (descending) where the count of the entries it sees reaches ``size`` (−inf if it never does).
    Entry ``r`` is seen by the queries ``j ≥ arrival[r]`` (−1: a carried entry, every query; past ``Q``: none).
    The counts stay in registers, where the PyTorch form writes and reads a ``(Q, P)`` matrix several times."""
    i_q, i_bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    j = i_q * BQ + tl.arange(0, BQ)  # (BQ,) queries of the block
    count = tl.zeros((BQ,), tl.int32)
    first = tl.full((BQ,), P, tl.int32)  # the position where the count reaches size (P: nowhere)
    for n0 in range(0, P, BN):
        r = n0 + tl.arange(0, BN)
        a = tl.load(arrival + i_bh * P + r, mask=r < P, other=Q)
        seen = (a[None, :] <= j[:, None]).to(tl.int32)  # (BQ, BN)
        run = count[:, None] + tl.cumsum(seen, axis=1)
        at = tl.min(tl.where(run >= size, r[None, :], P), axis=1)
        first = tl.minimum(first, at)
        count += tl.sum(seen, axis=1)
    k = tl.load(ordered + i_bh * P + first, mask=(first < P) & (j < Q), other=float("-inf"))
    tl.store(thr + i_bh * Q + j, k, mask=j < Q)


def block_thresholds(ordered: torch.Tensor, arrival: torch.Tensor, queries: int, size: int) -> torch.Tensor:
    """``(B, H, Q)`` float64: each of a block's ``queries`` queries' threshold from its pool sorted by key,
    ``ordered`` ``(B, H, P)`` float64 (descending), and each entry's ``arrival`` ``(B, H, P)`` int32 (the first
    query that sees it: −1 for a carried entry, ``Q`` or more for none) — what ``_pooled_blocks`` computes in
    PyTorch through a ``(B, H, Q, P)`` count, here in one kernel (CUDA, or the CPU under TRITON_INTERPRET=1)."""
    B, H, P = ordered.shape
    thr = torch.empty(B, H, queries, dtype=torch.float64, device=ordered.device)
    if B * H * queries:
        BQ = 32
        _threshold_kernel[(cdiv(queries, BQ), B * H)](ordered.contiguous(), arrival.contiguous(), thr, P, queries,
                                                      size, BQ=BQ, BN=64, num_warps=4)
    return thr


def tiles(G: int, D: int, dtype: torch.dtype) -> dict[str, int]:
    """``BR`` rows (G query heads × ``QB = BR // G`` queries) by ``BN`` pool entries by ``BD`` (D padded to a
    power of two), as :func:`linearize.ops.triton.window_fwd.blocks` tiles the window's keys."""
    BD = max(16, next_pow2(D))
    BR, BN = (32, 32) if dtype == torch.float32 else (64, 64) if BD <= 64 else (64, 32)
    BR = max(BR, next_pow2(G))
    return dict(QB=BR // G, BR=BR, BN=BN, BD=BD, num_warps=4)


def cache_softmax_triton(q: torch.Tensor, cand_k: torch.Tensor, cand_v: torch.Tensor, cand_key: torch.Tensor,
                         prior: int, size: int, block: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`linearize.ops.sparse_cache.cache_softmax` without documents, one kernel a block of queries;
    forward only. q ``(B, T, G·H, D)`` scaled, in fp16/bf16/fp32 (cast to ``cand_k``'s dtype for the dots);
    ``cand_k``/``cand_v`` ``(B, P + T, H, D)``; ``cand_key`` ``(B, P + T, H)``. Returns ``o (B, T, G·H, D)`` and
    ``lse (B, T, G·H)`` in float32 (``lse`` −inf and ``o`` 0 where a query keeps nothing)."""
    from ..sparse_cache import _pooled_blocks

    B, T, Hq, D = q.shape
    N, H = cand_k.shape[1], cand_k.shape[2]
    G = Hq // H
    o = torch.zeros(B, T, Hq, D, dtype=torch.float32, device=q.device)
    lse = torch.full((B, T, Hq), float("-inf"), dtype=torch.float32, device=q.device)
    if B * T * Hq == 0:
        return o, lse
    dt = cand_k.dtype if cand_k.dtype in (torch.float16, torch.bfloat16) else torch.float32
    qc, kc, vc = (x.to(dt).contiguous() for x in (q, cand_k, cand_v))
    keyc = cand_key.double().contiguous()
    cfg = tiles(G, D, dt)
    for t0, t1, idx, thr, _ in _pooled_blocks(cand_key, prior, size, None, None, block, kept=False,
                                              thresholds=block_thresholds):
        Q, P = t1 - t0, idx.shape[-1]
        _cache_fwd_kernel[(cdiv(Q, cfg["QB"]), B * H)](
            qc, kc, vc, keyc, idx.to(torch.int32).contiguous(), thr.contiguous(), o, lse, T, t0, Q, N, P, P - Q,
            H=H, G=G, D=D, IEEE=dt == torch.float32, **cfg,
        )
    return o, lse

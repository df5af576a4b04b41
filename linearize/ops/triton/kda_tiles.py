"""``@triton.jit`` helpers of the KDA kernels (``kda_fwd.py``, ``kda_bwd.py``): the chunk's per-channel
cumulative log-decay and the three products with a pairwise per-channel decay ``D_rj,i = exp(G_ri − G_ji)``
(``j ≤ r``) that the chunkwise form and its backward are made of:

    scores  M_rj = Σ_i a_ri b_ji D_rj,i          (the in-chunk q·k and k·k)
    left    L_r  = Σ_{j<r} W_rj (b_j ⊙ D_rj)     (dq through the scores, k's gradient through A's rows)
    right   R_j  = Σ_{r>j} W_rj (a_r ⊙ D_rj)     (dk through the scores and through A's columns)

``D`` is never split into ``exp(G_r)·exp(−G_j)``: the second factor overflows float32 once a chunk decays by
more than e⁸⁸. As in :func:`linearize.ops.kda.decayed_scores`, between sub-chunks of ``SUB`` rows a product goes
through the log-decay at the start of the row's sub-chunk, ``exp(G_r − G_s)·exp(G_s − G_j)``, both factors
≤ 1, as one dot per sub-chunk; inside a sub-chunk the pairwise decays are taken as they are, one
sub-diagonal ``d`` at a time (``SUB − 1`` steps, the rows ``d`` away read again from memory), with the decay
between the two rows summed from the ``d`` log-decays between them rather than taken as a difference of
cumulative sums. Only the ``n`` rows inside the document are read; every exponent is masked before ``exp``,
so nothing overflows where a mask drops it. The backward takes the left and right products of the scores' and
of A's gradients together, on a slice of the channels (:func:`decayed_pairs`, in ``kda_bwd._intra_bwd_kernel``):
step d of a sub-chunk's rows then does left's pairs on the rows at least d in and right's on the others, so no
row idles and one ``exp`` serves all four.

Inside the sub-chunks the products can also run as tensor-core dots (``DIAG``, a limit > 0): with each row's
log-decay taken from the one at its sub-chunk's middle row m, ``E_r = G_r − G_m``, a pair of one sub-chunk has
``exp(G_r − G_j) = exp(E_r)·exp(−E_j)``, so one (BT, BT) product of ``a ⊙ exp(E)`` and ``b ⊙ exp(−E)``, kept on the
sub-chunks' strictly lower triangles, gives every such entry at once (:func:`anchored_offsets`,
:func:`sub_chunk_dots`). Each factor is at most ``e^span``, span the largest |E| of the tile (half a
sub-chunk's decay at most); where it passes the limit (the factors would leave the dots' dtype, or lose its
precision) the program takes the row-by-row steps instead. The dots round ``a ⊙ exp(E)`` and ``b ⊙ exp(−E)`` to
the dots' dtype as the products between sub-chunks round theirs. Where even the offsets from the chunk's middle
row are within the limit (``WHOLE``, :func:`sub_chunk_dots_fit`'s mode 2), one such product takes every pair of
the chunk, those between sub-chunks too: two exps a channel and row, one dot per product, in place of the
sub-chunks' factors (three dots and six tiles of exps a product in the forward).

Tiles: (BT, BK) rows of a chunk (BK all of K, or a slice of it), G float32; products in float32 (the dots in the
inputs' dtype, or IEEE fp32).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..common import G_FLOOR
from .tiles import exp_ftz, mm

FLOOR = tl.constexpr(G_FLOOR)


@triton.jit
def floored(g):
    """Log-decays as the kernels take them: float32, each at least ``G_FLOOR`` (linearize/ops/common.py). Every
    read of g goes through here, so the caller passes g as it is, not a floored copy (a pass over [tokens, H, K]
    in float32: 86 µs of a 1.04 ms forward at 2×8192 on an H100); the backward zeroes dg where g < ``G_FLOOR``."""
    return tl.maximum(g.to(tl.float32), FLOOR)


@triton.jit
def chunk_log_decay(g, p, m):
    """``G``, the in-chunk cumulative log-decay per channel, (BT, BK) float32, from the log-decays at ``g + p``
    (``m``: rows inside the document and channels inside K; :func:`floored`). Rows past the document's end
    read 0, so G stays non-increasing down the whole tile and its last row is the chunk's total decay."""
    return tl.cumsum(floored(tl.load(g + p, mask=m, other=0.0)), 0)


@triton.jit
def row_of(x, j):
    """Row ``j`` of a register tile ``x`` (rows × ·), as a vector."""
    o = tl.arange(0, x.shape[0])
    return tl.sum(tl.where((o == j)[:, None], x, 0.0), 0)


@triton.jit
def _factors(G, s, SUB: tl.constexpr):
    """``(exp(G_r − G_s) on the rows r of sub-chunk s, exp(G_s − G_j) on the rows j before it)``, 0 elsewhere,
    with ``G_s`` the log-decay at the sub-chunk's first row: both ≤ 1."""
    o = tl.arange(0, G.shape[0])
    ref = row_of(G, s * SUB)
    ea = exp_ftz(tl.where((o // SUB == s)[:, None], G - ref[None, :], float("-inf")))
    fb = exp_ftz(tl.where((o < s * SUB)[:, None], ref[None, :] - G, float("-inf")))
    return ea, fb


@triton.jit
def anchored_offsets(G, SUB: tl.constexpr):
    """``(E, span)``: ``E_r = G_r − G_m``, ``G_m`` the log-decay at the middle row of r's sub-chunk (rows past the
    document's end hold its last row's G), and ``span``, the largest ``|E|`` of the tile (a scalar): for rows r, j
    of one sub-chunk ``exp(E_r)·exp(−E_j) = exp(G_r − G_j)``, each factor at most ``e^span``."""
    BT: tl.constexpr = G.shape[0]
    o = tl.arange(0, BT)
    Gm = tl.zeros(G.shape, dtype=tl.float32)
    for s in tl.static_range(0, BT // SUB):
        Gm += tl.where((o // SUB == s)[:, None], row_of(G, s * SUB + SUB // 2)[None, :], 0.0)
    E = G - Gm
    return E, tl.max(tl.max(tl.abs(E), 1), 0)


@triton.jit
def sub_chunk_dots_fit(G, SUB: tl.constexpr, DIAG: tl.constexpr, WHOLE: tl.constexpr):
    """``(E, mode)``, taken once a program for every query head: with ``WHOLE``, mode 2 where every row's offset
    from the chunk's middle row, ``E_r = G_r − G_{BT/2}``, is within ``DIAG`` (every pair of the chunk then one
    dot, :func:`sub_chunk_dots` with ``WHOLE``); else mode 1 where :func:`anchored_offsets`' span is (the pairs
    inside the sub-chunks as dots, those between them as before); else 0 (the row-by-row steps). E: the offsets
    of the mode taken. With ``DIAG`` 0, ``(G, 0)``, a constant the compiler folds the dots' branches away on."""
    E = G
    mode = tl.zeros([], dtype=tl.int32)
    if DIAG > 0:
        if WHOLE:  # the sub-chunks' offsets only where the chunk's are out of the limit
            E = G - row_of(G, G.shape[0] // 2)[None, :]
            if tl.max(tl.max(tl.abs(E), 1), 0) <= DIAG:
                mode += 2
            else:
                E, span = anchored_offsets(G, SUB)
                mode += (span <= DIAG).to(tl.int32)
        else:
            E, span = anchored_offsets(G, SUB)
            mode += (span <= DIAG).to(tl.int32)
    return E, mode


@triton.jit
def inside_sub_chunks(BT: tl.constexpr, SUB: tl.constexpr):
    """(BT, BT) mask of the pairs j < r of one sub-chunk."""
    o = tl.arange(0, BT)
    return (o[:, None] // SUB == o[None, :] // SUB) & (o[None, :] < o[:, None])


@triton.jit
def sub_chunk_dots(a, b, E, SUB: tl.constexpr, PAIR: tl.constexpr, IEEE: tl.constexpr, WHOLE: tl.constexpr):
    """``(M_bb, M_ab)`` of :func:`decayed_scores` on the sub-chunks' strictly lower triangles, 0 elsewhere (M_bb
    only with ``PAIR``, else 0), as tensor-core products through :func:`anchored_offsets`' ``E``: the entries
    :func:`sub_chunk_pairs` stores row by row, with the factors ``exp(±E)`` rounded to the dots' dtype. With
    ``WHOLE`` and the chunk-anchored E of :func:`sub_chunk_dots_fit`'s mode 2: the whole of both, M_bb strictly
    lower, M_ab with its diagonal (taken without the factors, as :func:`cross_scores_pair` does)."""
    BT: tl.constexpr = a.shape[0]
    o = tl.arange(0, BT)
    if WHOLE:
        inside = o[None, :] < o[:, None]
    else:
        inside = inside_sub_chunks(BT, SUB)
    af = a.to(tl.float32)
    ea = exp_ftz(E)
    bt = tl.trans(b.to(tl.float32) * exp_ftz(-E))
    Ma = tl.where(inside, mm(af * ea, bt, a, IEEE), 0.0)
    if WHOLE:
        Ma += tl.where(o[:, None] == o[None, :], tl.sum(af * b.to(tl.float32), 1)[:, None], 0.0)
    Mb = tl.zeros([BT, BT], dtype=tl.float32)
    if PAIR:
        Mb = tl.where(inside, mm(b.to(tl.float32) * ea, bt, b, IEEE), 0.0)
    return Mb, Ma


@triton.jit
def _rows(p, stride, d, m, K: tl.constexpr, BK: tl.constexpr):
    """Rows ``o + d`` (o = 0 … BT − 1) of the row-major tile at ``p`` (row stride ``stride``), channels < K,
    where ``m`` (0 elsewhere), as float32: the rows ``d`` before or after each row."""
    o, o_k = tl.arange(0, m.shape[0]), tl.arange(0, BK)
    return tl.load(p + (o + d)[:, None] * stride + o_k[None, :], mask=m[:, None] & (o_k < K)[None, :],
                   other=0.0).to(tl.float32)


@triton.jit
def decayed_scores(a, b, pb, pg, stride, G, n, K: tl.constexpr, STRICT: tl.constexpr, SUB: tl.constexpr,
                   IEEE: tl.constexpr):
    """``M_rj = Σ_i a_ri b_ji exp(G_ri − G_ji)`` for j < r (``STRICT``) or j ≤ r, 0 above: (BT, BT) float32.
    a, b: (BT, BK) in the dots' dtype (zero past the document's end); ``pb``, ``pg``: b's and the log-decays'
    first row in memory, both of row stride ``stride``."""
    BT: tl.constexpr = a.shape[0]
    BK: tl.constexpr = a.shape[1]
    o = tl.arange(0, BT)
    af, bf = a.to(tl.float32), b.to(tl.float32)
    M = tl.zeros([BT, BT], dtype=tl.float32)
    for s in tl.static_range(1, BT // SUB):  # row r of sub-chunk s, key j of an earlier one
        if s * SUB < n:
            ea, fb = _factors(G, s, SUB)
            M += mm(af * ea, tl.trans(bf * fb), a, IEEE)
    if not STRICT:
        M += tl.where(o[:, None] == o[None, :], tl.sum(af * bf, 1)[:, None], 0.0)
    # inside a sub-chunk, one sub-diagonal at a time: M[r, r − d], S_r = Σ_{r−d<t≤r} g_t the decay between
    S = tl.zeros(a.shape, dtype=tl.float32)
    for d in range(1, SUB):
        m_d = (o % SUB >= d) & (o < n)
        S += floored(_rows(pg, stride, 1 - d, m_d, K, BK))
        x = tl.sum(af * _rows(pb, stride, -d, m_d, K, BK) * exp_ftz(tl.where(m_d[:, None], S, float("-inf"))), 1)
        M += tl.where(o[None, :] == (o - d)[:, None], x[:, None], 0.0)
    return M


@triton.jit
def cross_scores_pair(a, b, G, n, SUB: tl.constexpr, PAIR: tl.constexpr, IEEE: tl.constexpr):
    """``(M_bb, M_ab)``: the parts of :func:`decayed_scores` of (b, b) (strict; only with ``PAIR``, else 0) and
    of (a, b) (with the diagonal) outside the sub-chunks' strictly lower triangles, which are 0 here
    (:func:`sub_chunk_pairs` gives them): the products between sub-chunks, which share their decay factors and
    b's decayed tiles, and the diagonal of M_ab. Each entry as :func:`decayed_scores` computes it."""
    BT: tl.constexpr = a.shape[0]
    o = tl.arange(0, BT)
    af, bf = a.to(tl.float32), b.to(tl.float32)
    Mb = tl.zeros([BT, BT], dtype=tl.float32)
    Ma = tl.zeros([BT, BT], dtype=tl.float32)
    for s in tl.static_range(1, BT // SUB):
        if s * SUB < n:
            ea, fb = _factors(G, s, SUB)
            bt = tl.trans(bf * fb)
            if PAIR:
                Mb += mm(bf * ea, bt, b, IEEE)
            Ma += mm(af * ea, bt, a, IEEE)
    Ma += tl.where(o[:, None] == o[None, :], tl.sum(af * bf, 1)[:, None], 0.0)
    return Mb, Ma


@triton.jit
def _between_and_inside(a, b, G, E, mode, n, SUB: tl.constexpr, PAIR: tl.constexpr, IEEE: tl.constexpr):
    Mb, Ma = cross_scores_pair(a, b, G, n, SUB, PAIR, IEEE)
    if mode == 1:
        dMb, dMa = sub_chunk_dots(a, b, E, SUB, PAIR, IEEE, False)
        Mb += dMb
        Ma += dMa
    return Mb, Ma


@triton.jit
def chunk_scores(a, b, G, E, mode, n, SUB: tl.constexpr, PAIR: tl.constexpr, IEEE: tl.constexpr,
                 WHOLE: tl.constexpr):
    """``(M_bb, M_ab)`` of :func:`decayed_scores` in a program's mode (:func:`sub_chunk_dots_fit`): 2, all of both
    as one dot each; 1, the products between sub-chunks (:func:`cross_scores_pair`) and those inside them as
    dots; 0, the former alone (the sub-chunks' strictly lower triangles 0: :func:`sub_chunk_pairs` gives them).
    Without ``WHOLE`` there is no mode 2, nor code for it."""
    if WHOLE:
        if mode == 2:
            Mb, Ma = sub_chunk_dots(a, b, E, SUB, PAIR, IEEE, True)
        else:
            Mb, Ma = _between_and_inside(a, b, G, E, mode, n, SUB, PAIR, IEEE)
    else:
        Mb, Ma = _between_and_inside(a, b, G, E, mode, n, SUB, PAIR, IEEE)
    return Mb, Ma


@triton.jit
def sub_chunk_pairs(pa, pb, pg, stride_a, stride, c, n, ws, pma, stride_ma, pmb, stride_mb, K: tl.constexpr,
                    BK: tl.constexpr, SUB: tl.constexpr, D: tl.constexpr, NA: tl.constexpr, BT: tl.constexpr):
    """The entries of :func:`decayed_scores` inside the sub-chunks, ``M_cj`` for ``0 < c − j < D``, of (b, b)
    times ``ws`` (float32, at ``pmb + c·stride_mb + j``) and of (a_h, b) for ``NA`` matrices a_h (the query
    heads of a GQA group, ``K`` apart in memory; in ``pma``'s dtype, at ``pma + c·stride_ma + h·BT + j``),
    stored as they come, one sub-diagonal at a time, for the rows ``c`` of the chunk (a vector; ``c < n`` inside
    the document). ``pa``, ``pb``, ``pg``: the chunk's first row of a_0, b and the log-decays (row strides
    ``stride_a``, ``stride``, ``stride``). Each entry as :func:`decayed_scores` computes it (the same sums of
    log-decays, products and order); every pairwise decay is taken once for all NA + 1 products, and only the
    rows given are worked on: the caller passes the rows that have keys up to ``D − 1`` back, rather than a
    whole (BT, BK) tile of which half the rows have no key ``d ≥ SUB / 2`` back."""
    o_k = tl.arange(0, BK)
    p = c % SUB  # position in the sub-chunk
    m_r = c < n
    m_k = (o_k < K)[None, :]
    p_a = pa + c[:, None] * stride_a + o_k[None, :]
    af = tl.load(p_a, mask=m_r[:, None] & m_k, other=0.0).to(tl.float32)
    bf = tl.load(pb + c[:, None] * stride + o_k[None, :], mask=m_r[:, None] & m_k, other=0.0).to(tl.float32)
    S = tl.zeros(af.shape, dtype=tl.float32)
    for d in range(1, D):
        m_d = (p >= d) & m_r
        m_dk = m_d[:, None] & m_k
        S += floored(tl.load(pg + (c + 1 - d)[:, None] * stride + o_k[None, :], mask=m_dk, other=0.0))
        rb = tl.load(pb + (c - d)[:, None] * stride + o_k[None, :], mask=m_dk, other=0.0).to(tl.float32)
        e = exp_ftz(tl.where(m_d[:, None], S, float("-inf")))
        tl.store(pmb + c * stride_mb + c - d, tl.sum(bf * rb * e, 1) * ws, mask=m_d)
        tl.store(pma + c * stride_ma + c - d, tl.sum(af * rb * e, 1).to(pma.dtype.element_ty), mask=m_d)
        for h in range(1, NA):  # the other a_h: read again at every step (L1), not held
            ah = tl.load(p_a + h * K, mask=m_dk, other=0.0).to(tl.float32)
            tl.store(pma + c * stride_ma + h * BT + c - d, tl.sum(ah * rb * e, 1).to(pma.dtype.element_ty), mask=m_d)


@triton.jit
def _pairs_by_steps(Lp, La, R, pk, pq, pg, pp, pa, pbeta, stride_k, stride_q, stride_p, stride_a, stride_beta, n, m_k,
                    BT: tl.constexpr, BK: tl.constexpr, WITH_A: tl.constexpr, SUB: tl.constexpr):
    """:func:`decayed_pairs`' products inside the sub-chunks, row by row (its docstring): ``(Lp, La, R)`` with them
    added, in float32 from the operands in memory."""
    o, o_k = tl.arange(0, BT), tl.arange(0, BK)
    p = o % SUB
    S = tl.zeros([BT, BK], dtype=tl.float32)
    for d in range(1, SUB):
        left = p >= d
        top = o - p + d  # the row at d in r's sub-chunk: the right products' later row
        m_l = left & (o < n)
        m_r = (p < d) & (top < n)
        m_x = m_l | m_r
        m_xk = m_x[:, None] & m_k[None, :]
        row = tl.where(left, o + 1 - d, top)
        S = tl.where((p == d - 1)[:, None], 0.0, S) + floored(tl.load(pg + row[:, None] * stride_k + o_k[None, :],
                                                                      mask=m_xk, other=0.0))
        e = exp_ftz(tl.where(m_x[:, None], S, float("-inf")))
        row = tl.where(left, o - d, top)  # k's row of the pair: j = r − d (left), r + d − p (right)
        xk = tl.load(pk + row[:, None] * stride_k + o_k[None, :], mask=m_xk, other=0.0).to(tl.float32) * e
        xq = tl.load(pq + top[:, None] * stride_q + o_k[None, :], mask=m_r[:, None] & m_k[None, :],
                     other=0.0).to(tl.float32) * e
        wp = tl.load(pp + tl.where(left, o * stride_p + o - d, top * stride_p + o), mask=m_x, other=0.0)
        Lp = tl.where(left[:, None], Lp + wp[:, None] * xk, Lp)
        R = tl.where(left[:, None], R, R + wp[:, None] * xq)
        if WITH_A:
            wa = tl.load(pa + tl.where(left, o * stride_a + o - d, top * stride_a + o), mask=m_x, other=0.0)
            wa = tl.where(left, wa, wa * tl.load(pbeta + top * stride_beta, mask=m_r, other=0.0).to(tl.float32))
            La = tl.where(left[:, None], La + wa[:, None] * xk, La)
            R = tl.where(left[:, None], R, R + wa[:, None] * xk)
    return Lp, La, R


@triton.jit
def decayed_pairs(P, A, R, k, q, beta, pk, pq, pg, pp, pa, pbeta, stride_k, stride_q, stride_p, stride_a, stride_beta,
                  G, n, m_k, WITH_A: tl.constexpr, SUB: tl.constexpr, IEEE: tl.constexpr, E, dots,
                  WHOLE: tl.constexpr):
    """``(L_P, L_A, R + R_P + R_A)``, each (BT, BK) float32, on one slice of BK channels (``m_k``: those inside K):
    ``L_P,r = Σ_{j<r} P_rj k_j⊙D_rj``, ``R_P,j = Σ_{r>j} P_rj q_r⊙D_rj``, and with ``WITH_A`` (else L_A = 0 and
    no R_A) ``L_A,r = Σ_{j<r} A_rj k_j⊙D_rj``, ``R_A,j = Σ_{r>j} A_rj β_r k_r⊙D_rj``: one ``exp`` per pair for all
    four, and the right products summed into R (the gradient takes them only summed, so one tile holds them).
    P, A: (BT, BT) float32, strictly lower, zero on rows past the document's end; k, q: (BT, BK) in the dots'
    dtype, beta (BT,) float32, G and R (BT, BK) float32. ``pk``, ``pq``, ``pg``: the chunk's first row of the slice of
    k, q and the log-decays (g's row stride is k's); ``pp``, ``pa``, ``pbeta``: the first row of P, A (in memory
    too: the steps inside a sub-chunk read their weights from there) and β.

    Between sub-chunks the products go through the log-decay at the later sub-chunk's start (:func:`_factors`),
    the factors taken once for all four. Inside the sub-chunks step d pairs row r at position p = r % SUB with
    r − d while d ≤ p (the left products' pair (r, r − d)), then with r + d − p, the row at d in its sub-chunk
    (the right products' pair (r + d − p, r)): every row works at every step, and the decay of the pair is a
    sum of log-decays, restarted at the switch, as :func:`decayed_scores` takes it. Where ``dots`` is 1 (the
    slice's anchored span within the limit, with its ``E``: :func:`sub_chunk_dots_fit`), the pairs inside the
    sub-chunks are four dots instead, as those between sub-chunks; where it is 2 (E anchored at the chunk's
    middle), four dots take every pair, and neither the steps nor the products between sub-chunks run."""
    BT: tl.constexpr = k.shape[0]
    BK: tl.constexpr = k.shape[1]
    kf, qf = k.to(tl.float32), q.to(tl.float32)
    bk = kf * beta[:, None]
    Lp = tl.zeros(k.shape, dtype=tl.float32)
    La = tl.zeros(k.shape, dtype=tl.float32)
    if not IEEE:  # the dots' operands: held in their dtype
        P = P.to(k.dtype)
        A = A.to(k.dtype)
    if dots == 0:
        Lp, La, R = _pairs_by_steps(Lp, La, R, pk, pq, pg, pp, pa, pbeta, stride_k, stride_q, stride_p, stride_a,
                                    stride_beta, n, m_k, BT, BK, WITH_A, SUB)
    whole = tl.zeros([], dtype=tl.int1)
    if WHOLE:  # mode 2 (without WHOLE none): E anchored at the chunk's middle, every pair (P, A strictly lower)
        whole = dots == 2
    if dots != 0:
        inside = inside_sub_chunks(BT, SUB)
        if WHOLE:
            inside = inside | (tl.zeros([BT, BT], dtype=tl.int32) + dots == 2)  # (a tile: the interpreter's scalar | is int)
        ea, fb = exp_ftz(E), exp_ftz(-E)
        kb, Pi = kf * fb, tl.where(inside, P, 0.0).to(P.dtype)
        Lp += ea * mm(Pi, kb, k, IEEE)
        R += fb * mm(tl.trans(Pi), qf * ea, q, IEEE)
        if WITH_A:
            Ai = tl.where(inside, A, 0.0).to(A.dtype)
            La += ea * mm(Ai, kb, k, IEEE)
            R += fb * mm(tl.trans(Ai), bk * ea, k, IEEE)
    # the products between sub-chunks after the steps: the steps then carry their sums in a plain layout, where
    # before the dots they carried them in the dots' and converted three tiles through shared memory every step
    # (compiled for sm_90: 259 → 200 instructions and 12 → 0 barriers a step)
    for s in tl.static_range(1, BT // SUB):
        if (s * SUB < n) & (whole == 0):
            ea, fb = _factors(G, s, SUB)
            kb = kf * fb
            Lp += ea * mm(P, kb, k, IEEE)
            R += fb * mm(tl.trans(P), qf * ea, q, IEEE)
            if WITH_A:
                La += ea * mm(A, kb, k, IEEE)
                R += fb * mm(tl.trans(A), bk * ea, k, IEEE)
    return Lp, La, R

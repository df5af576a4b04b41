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
row idles and one ``exp`` serves all four. The forward's scores (:func:`band_scores`, in
``kda_fwd._solve_kernel``) are held as the GDN solve holds A, ten 16×16 blocks, built over K in blocks of a few
channels: the same factors between sub-chunks (one band of 16 rows at a time, nothing masked), and inside one a
column at a time, the decay a difference of the band's cumulative sums (at most 16 rows apart), in log2 units
(``exp2``).

Tiles: (BT, BK) rows of a chunk (BK all of K, or a slice of it), G float32; products in float32 (the dots in the
inputs' dtype, or IEEE fp32).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .tiles import mm

LOG2E = tl.constexpr(1.4426950408889634)  # the cumulative log-decays of band_scores are in log2 units (exp2)


@triton.jit
def chunk_log_decay(g, p, m):
    """``G``, the in-chunk cumulative log-decay per channel, (BT, BK) float32, from the log-decays at ``g + p``
    (``m``: rows inside the document and channels inside K). Rows past the document's end read 0, so G stays
    non-increasing down the whole tile and its last row is the chunk's total decay."""
    return tl.cumsum(tl.load(g + p, mask=m, other=0.0).to(tl.float32), 0)


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
    ea = tl.exp(tl.where((o // SUB == s)[:, None], G - ref[None, :], float("-inf")))
    fb = tl.exp(tl.where((o < s * SUB)[:, None], ref[None, :] - G, float("-inf")))
    return ea, fb


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
        S += _rows(pg, stride, 1 - d, m_d, K, BK)
        x = tl.sum(af * _rows(pb, stride, -d, m_d, K, BK) * tl.exp(tl.where(m_d[:, None], S, float("-inf"))), 1)
        M += tl.where(o[None, :] == (o - d)[:, None], x[:, None], 0.0)
    return M


@triton.jit
def _band(p, stride, r, m, o_k, m_k):
    """Rows ``r`` (``m``: inside the document) and channels ``o_k`` (``m_k``: inside K) of the row-major tile
    at ``p`` (row stride ``stride``), 0 elsewhere."""
    return tl.load(p + r[:, None] * stride + o_k[None, :], mask=m[:, None] & m_k[None, :], other=0.0)


@triton.jit
def _row(p, stride, j, nb, o_k, K: tl.constexpr):
    """Row ``j`` of the row-major tile at ``p`` (row stride ``stride``), channels ``o_k`` < K, as a float32
    vector; 0 unless ``j < nb`` (inside the document)."""
    return tl.load(p + j * stride + o_k, mask=o_k < tl.where(j < nb, K, 0), other=0.0).to(tl.float32)


@triton.jit
def _in_band(Ma, Mb, a, b, c, pb, pg, stride, nb, o_k, K: tl.constexpr, WITH_A: tl.constexpr, WITH_B: tl.constexpr):
    """Add a 16-row band's pairs inside itself, column ``j`` at a time, to ``Ma`` (of (a, b), j ≤ r; with
    ``WITH_A``) and ``Mb`` (of (b, b), j < r; with ``WITH_B``): b's row j and the log-decays' row j are read as
    vectors (``pb``, ``pg``: the band's first row; ``nb`` rows inside the document) and one exp per pair serves
    both. ``c``: the band's in-band cumulative log-decay, log2-scaled (:data:`LOG2E`); the decay of a pair is
    the difference ``c_r − c_j`` (at most 16 rows apart), masked to −inf for j > r before the exp."""
    o = tl.arange(0, a.shape[0])
    cj = tl.zeros(o_k.shape, dtype=tl.float32)
    for j in range(a.shape[0]):
        cj += _row(pg, stride, j, nb, o_k, K) * LOG2E
        bj = _row(pb, stride, j, nb, o_k, K)
        e = tl.exp2(tl.where((o >= j)[:, None], c - cj[None, :], float("-inf"))) * bj[None, :]
        col = o[None, :] == j
        if WITH_A:
            Ma += tl.where(col & (o >= j)[:, None], tl.sum(a * e, 1)[:, None], 0.0)
        if WITH_B:
            Mb += tl.where(col & (o > j)[:, None], tl.sum(b * e, 1)[:, None], 0.0)
    return Ma, Mb


@triton.jit
def _load_band(pa, stride_a, pb, pg, stride, r, m, o_k, m_k, WITH_A: tl.constexpr):
    """``(b in its dtype, b, a (b without WITH_A), x)`` of a band's rows ``r`` (``m``: inside the document) and
    channels ``o_k``: b and a float32, x the log-decays in log2 units; 0 outside."""
    kb = _band(pb, stride, r, m, o_k, m_k)
    bf = kb.to(tl.float32)
    af = bf
    if WITH_A:
        af = _band(pa, stride_a, r, m, o_k, m_k).to(tl.float32)
    return kb, bf, af, _band(pg, stride, r, m, o_k, m_k) * LOG2E


@triton.jit
def band_scores(pa, stride_a, pb, pg, stride, r0, n, K: tl.constexpr, BKB: tl.constexpr, BC: tl.constexpr,
                WITH_B: tl.constexpr, WITH_A: tl.constexpr, IEEE: tl.constexpr):
    """The scores of one chunk as the ten lower (BC, BC) blocks of 4 bands of ``BC`` = 16 rows, for the GDN
    solve's :func:`solve.store_inverse`: ``(B00, B10, B11, B20, B21, B22, B30, B31, B32, B33, M00, …, M33)``,
    ``B`` of (b, b) (strict; with ``WITH_B``, else 0) and ``M`` of (a, b) (with the diagonal; with ``WITH_A``,
    else 0), each entry ``Σ_i x_ri b_ji exp(G_ri − G_ji)``, float32. ``pa``, ``pb``, ``pg``: row 0 of the
    document's a, b and log-decays (row strides ``stride_a``, ``stride``, ``stride``), the chunk's rows
    ``r0 …`` of which ``n`` are inside the document.

    Over K in blocks of ``BKB`` channels (channels are independent, so G is cumulated per block and per band,
    in log2 units), one band after the other, holding one band's tiles at a time: inside a band,
    :func:`_in_band`; between bands, dots of (BC, BKB) tiles through the log-decay ``G_s`` at the first row of
    the later band s, ``exp(G_r − G_s)`` on its rows and ``exp(G_s − G_j)`` on the earlier band's: every
    earlier band's decayed b, ``R_t = b_t ⊙ exp(G_s − G_t)``, is carried from one band's first row to the next
    (times a per-channel ``exp(G_{s+1} − G_s)``). Every factor ≤ 1, and no exp is masked."""
    o = tl.arange(0, BC)
    z = tl.zeros([BC, BC], dtype=tl.float32)
    B00, B10, B11, B20, B21, B22, B30, B31, B32, B33 = z, z, z, z, z, z, z, z, z, z
    M00, M10, M11, M20, M21, M22, M30, M31, M32, M33 = z, z, z, z, z, z, z, z, z, z
    for i_k in range(tl.cdiv(K, BKB)):
        o_k = i_k * BKB + tl.arange(0, BKB)
        m_k = o_k < K
        # band 0
        kb, b, a, x = _load_band(pa, stride_a, pb, pg, stride, r0 + o, o < n, o_k, m_k, WITH_A)
        c = tl.cumsum(x, 0)
        M00, B00 = _in_band(M00, B00, a, b, c, pb + r0 * stride, pg + r0 * stride, stride, n, o_k, K, WITH_A,
                            WITH_B)
        f = _row(pg, stride, r0 + BC, r0 + n, o_k, K) * LOG2E  # the log-decay at band 1's first row
        R0 = b * tl.exp2(tl.sum(x, 0)[None, :] - c + f[None, :])  # b_j ⊙ exp(G_16 − G_j)
        # band 1
        kb, b, a, x = _load_band(pa, stride_a, pb, pg, stride, r0 + BC + o, o + BC < n, o_k, m_k, WITH_A)
        c = tl.cumsum(x, 0)
        e = tl.exp2(c - f[None, :])  # exp(G_r − G_16)
        if WITH_B:
            B10 += mm(b * e, tl.trans(R0), kb, IEEE)
        if WITH_A:
            M10 += mm(a * e, tl.trans(R0), kb, IEEE)
        M11, B11 = _in_band(M11, B11, a, b, c, pb + (r0 + BC) * stride, pg + (r0 + BC) * stride, stride, n - BC,
                            o_k, K, WITH_A, WITH_B)
        f1 = f
        f = _row(pg, stride, r0 + 2 * BC, r0 + n, o_k, K) * LOG2E
        R0 *= tl.exp2(tl.sum(x, 0) - f1 + f)[None, :]  # on to band 2's first row
        R1 = b * tl.exp2(tl.sum(x, 0)[None, :] - c + f[None, :])
        # band 2
        kb, b, a, x = _load_band(pa, stride_a, pb, pg, stride, r0 + 2 * BC + o, o + 2 * BC < n, o_k, m_k, WITH_A)
        c = tl.cumsum(x, 0)
        e = tl.exp2(c - f[None, :])
        if WITH_B:
            B20 += mm(b * e, tl.trans(R0), kb, IEEE)
            B21 += mm(b * e, tl.trans(R1), kb, IEEE)
        if WITH_A:
            M20 += mm(a * e, tl.trans(R0), kb, IEEE)
            M21 += mm(a * e, tl.trans(R1), kb, IEEE)
        M22, B22 = _in_band(M22, B22, a, b, c, pb + (r0 + 2 * BC) * stride, pg + (r0 + 2 * BC) * stride, stride,
                            n - 2 * BC, o_k, K, WITH_A, WITH_B)
        f2 = f
        f = _row(pg, stride, r0 + 3 * BC, r0 + n, o_k, K) * LOG2E
        u = tl.exp2(tl.sum(x, 0) - f2 + f)[None, :]
        R0 *= u
        R1 *= u
        R2 = b * tl.exp2(tl.sum(x, 0)[None, :] - c + f[None, :])
        # band 3
        kb, b, a, x = _load_band(pa, stride_a, pb, pg, stride, r0 + 3 * BC + o, o + 3 * BC < n, o_k, m_k, WITH_A)
        c = tl.cumsum(x, 0)
        e = tl.exp2(c - f[None, :])
        if WITH_B:
            B30 += mm(b * e, tl.trans(R0), kb, IEEE)
            B31 += mm(b * e, tl.trans(R1), kb, IEEE)
            B32 += mm(b * e, tl.trans(R2), kb, IEEE)
        if WITH_A:
            M30 += mm(a * e, tl.trans(R0), kb, IEEE)
            M31 += mm(a * e, tl.trans(R1), kb, IEEE)
            M32 += mm(a * e, tl.trans(R2), kb, IEEE)
        M33, B33 = _in_band(M33, B33, a, b, c, pb + (r0 + 3 * BC) * stride, pg + (r0 + 3 * BC) * stride, stride,
                            n - 3 * BC, o_k, K, WITH_A, WITH_B)
    return B00, B10, B11, B20, B21, B22, B30, B31, B32, B33, M00, M10, M11, M20, M21, M22, M30, M31, M32, M33


@triton.jit
def decayed_pairs(P, A, R, k, q, beta, pk, pq, pg, pp, pa, pbeta, stride_k, stride_q, stride_p, stride_a, stride_beta,
                  G, n, m_k, WITH_A: tl.constexpr, SUB: tl.constexpr, IEEE: tl.constexpr):
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
    sum of log-decays, restarted at the switch, as :func:`decayed_scores` takes it."""
    BT: tl.constexpr = k.shape[0]
    BK: tl.constexpr = k.shape[1]
    o, o_k = tl.arange(0, BT), tl.arange(0, BK)
    kf, qf = k.to(tl.float32), q.to(tl.float32)
    bk = kf * beta[:, None]
    Lp = tl.zeros(k.shape, dtype=tl.float32)
    La = tl.zeros(k.shape, dtype=tl.float32)
    if not IEEE:  # the dots' operands: held in their dtype
        P = P.to(k.dtype)
        A = A.to(k.dtype)
    for s in tl.static_range(1, BT // SUB):
        if s * SUB < n:
            ea, fb = _factors(G, s, SUB)
            kb = kf * fb
            Lp += ea * mm(P, kb, k, IEEE)
            R += fb * mm(tl.trans(P), qf * ea, q, IEEE)
            if WITH_A:
                La += ea * mm(A, kb, k, IEEE)
                R += fb * mm(tl.trans(A), bk * ea, k, IEEE)
    p = o % SUB
    S = tl.zeros(k.shape, dtype=tl.float32)
    for d in range(1, SUB):
        left = p >= d
        top = o - p + d  # the row at d in r's sub-chunk: the right products' later row
        m_l = left & (o < n)
        m_r = (p < d) & (top < n)
        m_x = m_l | m_r
        m_xk = m_x[:, None] & m_k[None, :]
        row = tl.where(left, o + 1 - d, top)
        S = tl.where((p == d - 1)[:, None], 0.0, S) + tl.load(pg + row[:, None] * stride_k + o_k[None, :],
                                                              mask=m_xk, other=0.0)
        e = tl.exp(tl.where(m_x[:, None], S, float("-inf")))
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

"""``@triton.jit`` tile helpers shared by the kernels: the dots with their precision switch; the sequential GDN
kernels' [K, BV] state held as up to four (KB, BV) float32 K blocks (the blocks past K are never touched), so
each product is (BT, KB)·(KB, BV) and the blocks update independently; and the online softmax step of the
exact-attention kernels (window, sparse cache)."""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice

# on, ``exp_ftz`` compiles to one ex2 with denormals flushed (``ex2.approx.ftz``: libdevice's fast_expf under the
# FTZ reflection Triton links it with), where tl.exp's ``ex2.approx.f32`` wraps each ex2 in a compare and two
# predicated multiplies for denormal inputs and results (sm_90, the kda kernels: 393 of them fewer in the scores
# kernel, which then schedules 233 more of other kinds). On an H100 it took 4-5% off kda's forward and 1-2% off
# forward+backward (results/bench_kda_chunk_dots_h100.md); off until its GPU test
# (tests/test_kda_triton_bwd.py::test_flushed_exps_gpu_equal_reference) has passed. Never under the interpreter,
# which has no libdevice. Set it before the first launch: Triton refuses a global that changed under a compiled kernel.
FLUSH_EXP = tl.constexpr(False)


@triton.jit
def log_decay(p, mask, USE_G: tl.constexpr):
    """The log-decays at ``p`` as float32 (0 where ``mask`` is off; ``mask`` None: one value), or 0 everywhere
    without a decay (``USE_G`` False: the ``deltanet`` target). Every exp of those zeros is exp(0), which Triton
    folds at compile time: the kernels then read no g and take no exp for it."""
    if not USE_G:
        return tl.zeros(p.shape, dtype=tl.float32)
    elif mask is None:  # one value
        return tl.load(p).to(tl.float32)
    else:
        return tl.load(p, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def exp_ftz(x):
    """e^x of float32 ``x``; with ``FLUSH_EXP`` a result below e^-87 (float32's normal range) is 0: the kda
    kernels' decays, where such a factor weighs nothing beside the terms it is added to."""
    if FLUSH_EXP:
        return libdevice.fast_expf(x)
    else:
        return tl.exp(x)


@triton.jit
def dot(a, b, IEEE: tl.constexpr):
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def mm(a, b, ref, IEEE: tl.constexpr):
    """a @ b with fp32 accumulation: IEEE fp32 operands, or both cast to ``ref``'s dtype (bf16/fp16)."""
    if IEEE:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a.to(ref.dtype), b.to(ref.dtype))


@triton.jit
def _kv_load(p, kb, o_v, m_v, K: tl.constexpr, V: tl.constexpr, KB: tl.constexpr):
    """Rows ``kb·KB …`` (a K block) and columns ``o_v`` of a row-major [K, V] state at ``p``, as fp32."""
    o_k = kb * KB + tl.arange(0, KB)
    return tl.load(p + o_k[:, None] * V + o_v[None, :], mask=(o_k < K)[:, None] & m_v[None, :], other=0.0).to(tl.float32)


@triton.jit
def _kv_store(p, b, kb, o_v, m_v, K: tl.constexpr, V: tl.constexpr, KB: tl.constexpr):
    o_k = kb * KB + tl.arange(0, KB)
    tl.store(p + o_k[:, None] * V + o_v[None, :], b.to(p.dtype.element_ty), mask=(o_k < K)[:, None] & m_v[None, :])


@triton.jit
def _rows_dot(x, stride, o_r, m_r, kb, b, K: tl.constexpr, KB: tl.constexpr, IEEE: tl.constexpr):
    """``x[o_r, K block kb] @ b`` (fp32): x a row-major [rows, stride] tile pointer, b a fp32 (KB, ·) tile."""
    o_k = kb * KB + tl.arange(0, KB)
    xb = tl.load(x + o_r[:, None] * stride + o_k[None, :], mask=m_r[:, None] & (o_k < K)[None, :], other=0.0)
    if IEEE:
        return tl.dot(xb.to(tl.float32), b, input_precision="ieee")
    else:
        return tl.dot(xb, b.to(xb.dtype))


@triton.jit
def _cols_dot(x, stride, o_r, m_r, kb, b, K: tl.constexpr, KB: tl.constexpr, IEEE: tl.constexpr):
    """``x[o_r, K block kb]ᵀ @ b`` (fp32), the transposed tile loaded directly; b a (rows, ·) tile."""
    o_k = kb * KB + tl.arange(0, KB)
    xt = tl.load(x + o_k[:, None] + o_r[None, :] * stride, mask=(o_k < K)[:, None] & m_r[None, :], other=0.0)
    if IEEE:
        return tl.dot(xt.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(xt, b.to(xt.dtype))


@triton.jit
def blocks_load(p, b1, b2, b3, b4, o_v, m_v, K: tl.constexpr, V: tl.constexpr, KB: tl.constexpr):
    """The state kernels hold a [K, BV] tile as four (KB, BV) fp32 K blocks; the blocks past K are never
    touched. This adds the row-major [K, V] state at ``p`` (columns ``o_v``) to ``b1 … b4``."""
    NKB: tl.constexpr = (K + KB - 1) // KB
    b1 += _kv_load(p, 0, o_v, m_v, K, V, KB)
    if NKB > 1:
        b2 += _kv_load(p, 1, o_v, m_v, K, V, KB)
    if NKB > 2:
        b3 += _kv_load(p, 2, o_v, m_v, K, V, KB)
    if NKB > 3:
        b4 += _kv_load(p, 3, o_v, m_v, K, V, KB)
    return b1, b2, b3, b4


@triton.jit
def blocks_start(p, USE: tl.constexpr, o_v, m_v, K: tl.constexpr, V: tl.constexpr, KB: tl.constexpr, BV: tl.constexpr):
    """The four (KB, BV) fp32 K blocks a state kernel starts from: zeros, plus the [K, V] state at ``p`` if ``USE``."""
    b1 = tl.zeros([KB, BV], dtype=tl.float32)
    b2 = tl.zeros([KB, BV], dtype=tl.float32)
    b3 = tl.zeros([KB, BV], dtype=tl.float32)
    b4 = tl.zeros([KB, BV], dtype=tl.float32)
    if USE:
        b1, b2, b3, b4 = blocks_load(p, b1, b2, b3, b4, o_v, m_v, K, V, KB)
    return b1, b2, b3, b4


@triton.jit
def blocks_store(p, b1, b2, b3, b4, o_v, m_v, K: tl.constexpr, V: tl.constexpr, KB: tl.constexpr):
    """Store the K blocks ``b1 … b4`` as columns ``o_v`` of the row-major [K, V] state at ``p``."""
    NKB: tl.constexpr = (K + KB - 1) // KB
    _kv_store(p, b1, 0, o_v, m_v, K, V, KB)
    if NKB > 1:
        _kv_store(p, b2, 1, o_v, m_v, K, V, KB)
    if NKB > 2:
        _kv_store(p, b3, 2, o_v, m_v, K, V, KB)
    if NKB > 3:
        _kv_store(p, b4, 3, o_v, m_v, K, V, KB)


@triton.jit
def blocks_rows_dot(x, stride, o_r, m_r, b1, b2, b3, b4, K: tl.constexpr, KB: tl.constexpr,
                     NEG: tl.constexpr, IEEE: tl.constexpr):
    """``±x[o_r, :K] @ [b1; …; b4]`` (fp32; ``NEG``: minus), one (BT, KB)·(KB, ·) product per K block."""
    NKB: tl.constexpr = (K + KB - 1) // KB
    acc = _rows_dot(x, stride, o_r, m_r, 0, b1, K, KB, IEEE)
    if NEG:
        acc = -acc
    if NKB > 1:
        acc = _rows_acc(acc, x, stride, o_r, m_r, 1, b2, K, KB, NEG, IEEE)
    if NKB > 2:
        acc = _rows_acc(acc, x, stride, o_r, m_r, 2, b3, K, KB, NEG, IEEE)
    if NKB > 3:
        acc = _rows_acc(acc, x, stride, o_r, m_r, 3, b4, K, KB, NEG, IEEE)
    return acc


@triton.jit
def _rows_acc(acc, x, stride, o_r, m_r, kb, b, K: tl.constexpr, KB: tl.constexpr, NEG: tl.constexpr, IEEE: tl.constexpr):
    if NEG:
        return acc - _rows_dot(x, stride, o_r, m_r, kb, b, K, KB, IEEE)
    else:
        return acc + _rows_dot(x, stride, o_r, m_r, kb, b, K, KB, IEEE)


@triton.jit
def blocks_update(b1, b2, b3, b4, scale, x, stride, o_r, m_r, d, K: tl.constexpr, KB: tl.constexpr,
                   SUB: tl.constexpr, IEEE: tl.constexpr):
    """``b_kb ← scale·b_kb ± x[o_r, K block kb]ᵀ d`` for every K block (``SUB``: minus), the transposed
    tiles loaded directly."""
    NKB: tl.constexpr = (K + KB - 1) // KB
    b1 = _block_update(b1, scale, x, stride, o_r, m_r, 0, d, K, KB, SUB, IEEE)
    if NKB > 1:
        b2 = _block_update(b2, scale, x, stride, o_r, m_r, 1, d, K, KB, SUB, IEEE)
    if NKB > 2:
        b3 = _block_update(b3, scale, x, stride, o_r, m_r, 2, d, K, KB, SUB, IEEE)
    if NKB > 3:
        b4 = _block_update(b4, scale, x, stride, o_r, m_r, 3, d, K, KB, SUB, IEEE)
    return b1, b2, b3, b4


@triton.jit
def _block_update(b, scale, x, stride, o_r, m_r, kb, d, K: tl.constexpr, KB: tl.constexpr,
                  SUB: tl.constexpr, IEEE: tl.constexpr):
    if SUB:
        return b * scale - _cols_dot(x, stride, o_r, m_r, kb, d, K, KB, IEEE)
    else:
        return b * scale + _cols_dot(x, stride, o_r, m_r, kb, d, K, KB, IEEE)


@triton.jit
def online(s, m_run, l_run, acc):
    """Fold scores ``s [BR, n]`` (−inf: not a key) into the running max and sum; returns the new max, the
    probabilities ``p [BR, n]`` and ``acc [BR, BD]``, ``l [BR]`` rescaled to it (``p·v`` still to add)."""
    m_new = tl.maximum(m_run, tl.max(s, axis=1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen no key yet stays at p = 0
    p = tl.exp(s - m_use[:, None])
    alpha = tl.exp(m_run - m_use)
    return m_new, p, l_run * alpha + tl.sum(p, axis=1), acc * alpha[:, None]


@triton.jit
def online_result(m_run, l_run, acc):
    """What :func:`online` folded, finished: ``o = acc / l`` and ``lse = m + log l`` a row, ``o = 0`` and
    ``lse = −inf`` for a row that saw no key."""
    seen = l_run > 0.0
    o = tl.where(seen[:, None], acc / tl.where(seen, l_run, 1.0)[:, None], 0.0)
    return o, tl.where(seen, m_run + tl.log(tl.where(seen, l_run, 1.0)), float("-inf"))

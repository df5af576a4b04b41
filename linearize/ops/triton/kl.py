"""Triton kernel of the distillation loss on one chunk of vocabulary-sized logits: per row, the KL of the
teacher's tempered distribution to the student's, the optional next-token cross-entropy, and the
gradient of the weighted sum with respect to the student's logits, in two passes over the row.

Spec and the PyTorch path: :mod:`linearize.ops.kl`. Tested there against float64 autograd (CPU, under
``TRITON_INTERPRET=1``). Reads the two logit rows twice and writes the gradient once, in the logits'
dtype; no float32 copy of a logit row is ever stored.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common import next_pow2


@triton.jit
def _online(m, z, x):
    """Running (max, Σ exp(x − max)) of a row after one more block ``x`` (masked entries are −inf)."""
    m_new = tl.maximum(m, tl.max(x, axis=0))
    return m_new, z * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)


@triton.jit
def _kl_loss_kernel(
    s, t, labels, grad, kl, ce, ce_w, n_cols, inv_temp, kl_w_temp,
    HAS_CE: tl.constexpr, BLOCK: tl.constexpr,
):
    """One program per row. Pass 1: log-sum-exps of s/T, t/T (and of s when CE is on). Pass 2: the row's
    ``KL = Σ p_t (log p_t − log p_s)``, and ``grad = kl_w·T·(p_s − p_t) + ce_w·(softmax(s) − onehot(y))``."""
    row = tl.program_id(0).to(tl.int64)
    s += row * n_cols
    t += row * n_cols
    grad += row * n_cols
    o = tl.arange(0, BLOCK)
    zero = tl.sum(tl.zeros([BLOCK], dtype=tl.float32), axis=0)
    m_s, z_s, m_t, z_t, m_c, z_c = zero - float("inf"), zero, zero - float("inf"), zero, zero - float("inf"), zero
    for a in range(0, n_cols, BLOCK):
        m = a + o < n_cols
        xs = tl.load(s + a + o, mask=m, other=-float("inf")).to(tl.float32)
        xt = tl.load(t + a + o, mask=m, other=-float("inf")).to(tl.float32)
        m_s, z_s = _online(m_s, z_s, xs * inv_temp)
        m_t, z_t = _online(m_t, z_t, xt * inv_temp)
        if HAS_CE:
            m_c, z_c = _online(m_c, z_c, xs)
    lse_s = m_s + tl.log(z_s)
    lse_t = m_t + tl.log(z_t)
    if HAS_CE:
        lse_c = m_c + tl.log(z_c)
        y = tl.load(labels + row)
        cw = tl.where(y >= 0, tl.load(ce_w), 0.0)  # ignored targets (−100) add neither loss nor gradient
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for a in range(0, n_cols, BLOCK):
        m = a + o < n_cols
        xs = tl.load(s + a + o, mask=m, other=0.0).to(tl.float32)
        xt = tl.load(t + a + o, mask=m, other=0.0).to(tl.float32)
        lps = xs * inv_temp - lse_s
        lpt = xt * inv_temp - lse_t
        pt = tl.exp(lpt)
        acc += tl.where(m, pt * (lpt - lps), 0.0)
        gr = kl_w_temp * (tl.exp(lps) - pt)
        if HAS_CE:
            gr += cw * (tl.exp(xs - lse_c) - tl.where(a + o == y, 1.0, 0.0))
        tl.store(grad + a + o, gr.to(grad.dtype.element_ty), mask=m)
    tl.store(kl + row, tl.sum(acc, axis=0))
    if HAS_CE:
        x_y = tl.load(s + tl.maximum(y, 0)).to(tl.float32)
        tl.store(ce + row, tl.where(y >= 0, lse_c - x_y, 0.0))


def kl_loss_rows(s, t, labels, temperature: float, kl_weight: float, ce_weight):
    """``(kl [R] fp32, ce [R] fp32 or None, grad [R, V] in s's dtype)`` for contiguous 2-D logits; ``ce_weight``
    (a 0-dim float32 tensor on s's device, or None) weights the cross-entropy's gradient."""
    R, n = s.shape
    s, t = s.contiguous(), t.contiguous()
    grad = torch.empty_like(s)
    kl = torch.empty(R, dtype=torch.float32, device=s.device)
    has_ce = ce_weight is not None
    ce = torch.empty(R, dtype=torch.float32, device=s.device) if has_ce else kl
    if R:
        _kl_loss_kernel[(R,)](
            s, t, labels.contiguous() if has_ce else kl, grad, kl, ce, ce_weight if has_ce else kl, n,
            1.0 / temperature, kl_weight * temperature, HAS_CE=has_ce,
            BLOCK=min(4096, next_pow2(n)), num_warps=8 if n >= 4096 else 4)
    return kl, (ce if has_ce else None), grad

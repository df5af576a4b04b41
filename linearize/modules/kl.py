"""The distillation loss on one chunk of logits, with its gradient computed in the forward.

For student logits ``s`` and teacher logits ``t`` (rows of the vocabulary), temperature ``T`` and labels
``y`` (−100: none), the loss of a chunk is

    kl_weight · Σ_rows T² KL(softmax(t/T) ‖ softmax(s/T))  +  ce_weight · Σ_rows CE(s, y)

and its gradient with respect to ``s`` is ``kl_weight·T·(p_s − p_t) + ce_weight·(softmax(s) − onehot(y))``.
Autograd of the textbook expression keeps several float32 copies of every ``[rows, vocab]`` tile alive
until the backward (the float cast, both log-softmaxes, ``p_t``); here the forward computes the gradient
at once and keeps only it, in the logits' dtype. On CUDA one Triton kernel does it in two passes over
each row, reading the two logit rows twice and writing the gradient once (no float32 copy of a row is
ever stored); elsewhere the library's ``kl_div`` and ``cross_entropy`` through autograd. ``tests/test_kl.py`` checks both
against float64 autograd (the kernel on the CPU under ``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..ops.common import next_pow2


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


def library_loss(s, t, labels, temperature: float, kl_weight: float, ce_weight):
    """The same loss through the library (``kl_div`` and ``cross_entropy`` of float32 log-softmaxes, autograd):
    the path off CUDA, where the hand-written one did not win (peak 1,421 vs 964 MB at 1024 × 49152 bf16)."""
    import torch.nn.functional as F

    T = temperature
    lps, lpt = (torch.log_softmax(x.float() / T, -1) for x in (s, t.detach()))
    loss = F.kl_div(lps, lpt, log_target=True, reduction="sum") * (kl_weight * T * T)
    if ce_weight is not None:
        loss = loss + F.cross_entropy(s.float(), labels, ignore_index=-100, reduction="sum") * ce_weight
    return loss


class _KLLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, s, t, labels, temperature, kl_weight, ce_weight):
        kl, ce, grad = kl_loss_rows(s.detach(), t.detach(), labels, temperature, kl_weight, ce_weight)
        ctx.save_for_backward(grad)
        loss = kl.sum() * (kl_weight * temperature * temperature)
        if ce is not None:
            loss = loss + ce.sum() * ce_weight
        return loss

    @staticmethod
    def backward(ctx, dloss):
        (grad,) = ctx.saved_tensors
        return grad * dloss.to(grad.dtype), None, None, None, None, None


def kl_loss(student_logits, teacher_logits, labels=None, temperature: float = 1.0, kl_weight: float = 1.0,
            ce_weight: torch.Tensor | float | None = None, backend: str = "auto") -> torch.Tensor:
    """``kl_weight·Σ T²·KL(teacher ‖ student) + ce_weight·Σ CE`` over the rows of 2-D logits (see the module
    docstring); differentiable in ``student_logits`` only. ``ce_weight`` None (or labels None): no CE.
    ``backend``: "auto" (Triton on CUDA), "triton" or "torch"."""
    if student_logits.shape != teacher_logits.shape or student_logits.dim() != 2:
        raise ValueError(f"kl_loss takes two [rows, vocab] logits of one shape; got {tuple(student_logits.shape)} "
                         f"and {tuple(teacher_logits.shape)}")
    if backend not in ("auto", "triton", "torch"):
        raise ValueError(f"kl_loss backend must be 'auto', 'triton' or 'torch'; got {backend!r}")
    if labels is None or ce_weight is None:
        labels, ce_weight = None, None
    else:  # a float32 0-dim tensor on the logits' device (the kernel reads it from memory)
        ce_weight = torch.as_tensor(ce_weight).detach().to(device=student_logits.device, dtype=torch.float32).reshape(())
    if not (backend == "triton" or (backend == "auto" and student_logits.is_cuda)):
        return library_loss(student_logits, teacher_logits, labels, float(temperature), float(kl_weight), ce_weight)
    # the kernel against library_loss on the H200 at the distill shape (4096 × 49152 bf16): 0.15× the time,
    # 0.14× the peak memory (results/bench_kl.json, scripts/bench_kl.py)
    return _KLLoss.apply(student_logits, teacher_logits, labels, float(temperature), float(kl_weight), ce_weight)
